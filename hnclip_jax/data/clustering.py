"""Batches of caption neighbours (`config.data.batching = "clustered"`): hard-negative batch composition.

The margin HN-CLIP adds reads the crowding of the *batch*: Ḡ only ever compares the captions that share one. A batch
made of caption-embedding neighbours is crowded by construction, whatever the model's global geometry.

- **The index**: at a run's first start, the start model (its initial or `init_from` weights) embeds every training
  example's captions once (an example with several: the normalised mean of its captions' embeddings); the [N, E]
  array is stored in the workdir (`WORKDIR/batching/caption_index.npy`, with what it was built from in
  `caption_index.json`) and read back on every resume. It is never refreshed: the batches follow the start model's
  geometry, the condition the issue asks for ("strong and crowded" from the start), and a resume reads exactly the
  batches an uninterrupted run reads. Delete the directory to rebuild it from the latest weights of a new run.
- **The plan of an epoch** (`epoch_plan`): examples are visited in the order a seeded permutation of (seed, epoch)
  gives; each not-yet-placed example in that order opens a batch and takes its B − 1 nearest not-yet-placed
  neighbours by cosine similarity of the index. The N mod B examples no batch took are dropped — not a random
  N mod B as in the random order: they are the ones no anchor took as a neighbour, so outliers are dropped in a
  large share of epochs (36–56 % for some, measured, against (N mod B)/N under the random order). A pure function of (index, seed, epoch, B): every process computes the same global batches and reads its
  own rows of each (`pipeline.train_dataset`), on any mesh and any number of hosts.
- **Cost**: one [N] similarity row per batch (its anchor's), N/B batches: N²·E/B multiply-adds per epoch in NumPy on the host (measured in
  docs/benchmarks.md, "Input pipeline"); the plan of an epoch is computed once per process when the epoch starts.
"""
from __future__ import annotations

import hashlib
import io
import json

import numpy as np

from hnclip_jax import paths

BATCHINGS = ("random", "clustered")


def epoch_plan(index: np.ndarray, batch: int, seed: int, epoch: int) -> np.ndarray:
  """[N // batch, batch] example indices: the clustered batches of `epoch` (see the module doc)."""
  n = index.shape[0]
  num = n // batch
  order = np.random.default_rng([int(seed), int(epoch), 0x5EED]).permutation(n)
  emb = np.asarray(index, np.float32)
  free = np.ones(n, bool)
  plan = np.empty((num, batch), np.int64)
  k = 0
  for anchor in order:
    if k == num:
      break
    if not free[anchor]:
      continue
    sim = emb @ emb[anchor]
    sim[~free] = -np.inf
    sim[anchor] = np.inf  # the anchor first
    members = np.argpartition(-sim, batch - 1)[:batch]
    members = members[np.argsort(-sim[members], kind="stable")]
    plan[k] = members
    free[members] = False
    k += 1
  return plan


def random_plan(n: int, batch: int, seed: int, epoch: int) -> np.ndarray:
  """The random batches of an epoch, for comparison (the same drop of the last N mod B)."""
  order = np.random.default_rng([int(seed), int(epoch), 0x5EED]).permutation(n)
  return order[: (n // batch) * batch].reshape(-1, batch)


def mean_in_batch_similarity(index: np.ndarray, plan: np.ndarray) -> float:
  """The mean off-diagonal caption similarity (the mean Ḡ) of the plan's batches under `index`."""
  t = np.asarray(index, np.float64)[plan]  # [K, B, E]
  s = t.sum(axis=1)
  b = plan.shape[1]
  return float(np.mean((np.sum(s * s, axis=1) - np.sum(t * t, axis=(1, 2))) / (b * (b - 1))))


class ClusteredBatches:
  """Global batch k (a step) -> its example indices, epoch after epoch; an epoch's plan is computed when first asked
  for (the last two kept). Picklable (grain's worker processes get a copy without the computed plans)."""

  def __init__(self, index: np.ndarray, batch: int, seed: int):
    if index.shape[0] < batch:
      raise ValueError(f"the caption index has {index.shape[0]} examples, fewer than one batch ({batch})")
    self.index, self.batch, self.seed = np.asarray(index, np.float32), int(batch), int(seed)
    self.per_epoch = index.shape[0] // batch
    self._plans = {}

  def plan(self, epoch: int) -> np.ndarray:
    if epoch not in self._plans:
      if len(self._plans) >= 2:
        self._plans.pop(min(self._plans))
      self._plans[epoch] = epoch_plan(self.index, self.batch, self.seed, epoch)
    return self._plans[epoch]

  def __call__(self, step: int) -> np.ndarray:
    epoch, k = divmod(int(step), self.per_epoch)
    return self.plan(epoch)[k]

  def __getstate__(self):
    return {**self.__dict__, "_plans": {}}


def fingerprint(index: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(index, np.float32).tobytes()).hexdigest()[:16]


def read_index(file: str, meta_file: str, num_examples: int):
  """The caption index in `file` ([N, E] float32; a workdir's Workdir.caption_index, its record `meta_file`) or
  None; ValueError when it does not fit the data (another number of examples): the run would read other batches
  than it started with."""
  if not paths.exists(file):
    return None
  index = np.load(io.BytesIO(paths.read_bytes(file)))
  meta = json.loads(paths.read_text(meta_file)) if paths.exists(meta_file) else {}
  if index.shape[0] != num_examples or meta.get("fingerprint", fingerprint(index)) != fingerprint(index):
    raise ValueError(f"{file} holds a caption index of {index.shape[0]} examples (fingerprint "
                     f"{meta.get('fingerprint')}), but the training split has {num_examples} (or the file changed): "
                     "the clustered batches would not be the ones this run started with. Restore the file, or start "
                     "a new workdir")
  return index


def write_index(file: str, meta_file: str, index: np.ndarray, built_from: str) -> None:
  """Stores the index in `file` and its record in `meta_file` (paths.write_bytes: whole or not at all; process 0
  only, by the caller)."""
  paths.makedirs(paths.dirname(file))
  buf = io.BytesIO()
  np.save(buf, np.asarray(index, np.float32))
  paths.write_bytes(file, buf.getvalue())
  paths.write_text(meta_file, json.dumps({"examples": int(index.shape[0]), "dim": int(index.shape[1]),
                                          "fingerprint": fingerprint(index), "built_from": built_from}, indent=2))


def batch_plan(config, wd, num_examples: int, start: int, embed_captions, log=print):
  """config.data.batching='clustered': the batches of caption neighbours under the start model, from the workdir's
  caption index (Workdir.caption_index) — made at the run's first start by `embed_captions()` ([N, E]) and stored
  there by process 0; a resumed run needs it (it cannot be made again from a later checkpoint). None for random
  batches."""
  import jax
  if config.data.batching != "clustered":
    return None
  index = read_index(wd.caption_index, wd.caption_index_meta, num_examples)
  if index is None and start > 0:
    raise ValueError(f"{wd.caption_index} is missing: this run's clustered batches come from its "
                     "start model's caption embeddings, stored at its first start, and cannot be made again from a "
                     "later checkpoint. Restore the file, or start a new workdir")
  if index is None:
    index = embed_captions()
    if jax.process_index() == 0:
      write_index(wd.caption_index, wd.caption_index_meta, index,
                  config.init_from or f"initial parameters (seed {config.seed})")
  plan = ClusteredBatches(index, config.batch_size, config.seed)
  crowd = mean_in_batch_similarity(index, plan.plan(0))
  spread = mean_in_batch_similarity(index, random_plan(len(index), config.batch_size, config.seed, 0))
  log(f"clustered batches: mean in-batch caption similarity (the start model's, epoch 0) {crowd:.3f}, against "
      f"{spread:.3f} for random batches")
  return plan
