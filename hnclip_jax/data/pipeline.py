"""grain input pipelines: deterministic, resumable training batches and padded eval batches."""
from __future__ import annotations

import grain
import numpy as np

# The image primitives, here for the frameworks' own inputs (a family's preprocessing is its own: Family.preprocess).
from hnclip_jax import paths
from hnclip_jax.data.images import CLIP_MEAN, CLIP_STD, normalize, resize_center_crop, resize_square  # noqa: F401
from hnclip_jax.frameworks.base import check_input_names  # a framework's inputs take no core batch entry's name
from hnclip_jax.models import family as family_lib


def clip_preprocess(image, size: int, family: str = "clip") -> np.ndarray:
  """The model family's preprocessing of one image (PIL or uint8 array) -> float32 [size, size, 3], normalised
  (`pixels_of`'s second half)."""
  return pixels_of(image, size, family)[1]


def pixels_of(image, size: int, family: str = "clip") -> tuple[np.ndarray, np.ndarray]:
  """(uint8 [size, size, 3] as the model sees it, float32 normalised) by the model family's own preprocessing
  (models/family.py: `Family.preprocess`)."""
  return family_lib.get(family).preprocess(image, size)


def text_of(c) -> str:
  """A caption / sentence field (bytes from TFDS, or str) -> str."""
  return c.decode("utf-8") if isinstance(c, bytes) else str(c)


def captions_of(ex) -> list[str]:
  """An example's captions: several for datasets with a `captions` list (the `pairs` layout), else one."""
  if "captions" in ex:
    return [text_of(c) for c in ex["captions"]]
  return [text_of(ex["caption"])]


def caption_choice(seed: int, step: int, index: int, num_captions: int) -> int:
  """Which of an image's captions training uses at `step`: uniform, a pure function of (seed, step, example)."""
  if num_captions == 1:
    return 0
  return int(np.random.default_rng([seed, step, index]).integers(num_captions))


class _Preprocess(grain.transforms.Map):

  def __init__(self, tokenizer, image_size, extra=None, family="clip"):
    self.tokenizer, self.image_size, self.extra, self.family = tokenizer, image_size, extra, family

  def map(self, ex, caption: int = 0, seed: int = 0, step: int = 0, index: int = 0):
    text = captions_of(ex)[caption]
    pixels, image = pixels_of(ex["image"], self.image_size, self.family)
    out = {"image": image, "tokens": self.tokenizer([text])[0]}
    if self.extra is not None:  # a framework's own per-example inputs (frameworks: `inputs`)
      extra = self.extra(ex, text, pixels, seed, step, index)
      check_input_names(extra, "the framework's `inputs`")
      out.update(extra)
    return out


class _LoadRows(grain.transforms.MapWithIndex):
  """(step, global batch of example indices) -> this process's rows, read and preprocessed, stacked. An image
  with several captions contributes the one `caption_choice` picks for this step; with `extra`, also a framework's
  per-example inputs."""

  def __init__(self, source, tokenizer, image_size, rows, seed: int, extra=None, family="clip"):
    self.source, self.rows, self.seed = source, rows, seed
    self.pre = _Preprocess(tokenizer, image_size, extra, family)

  def map_with_index(self, step, indices):
    mine = indices[self.rows]
    items = []
    for i in mine:
      ex = self.source[int(i)]
      n = len(ex["captions"]) if "captions" in ex else 1
      items.append(self.pre.map(ex, caption_choice(self.seed, step, int(i), n), self.seed, step, int(i)))
    out = {k: np.stack([it[k] for it in items]) for k in items[0]}
    out["index"] = np.asarray(mine, np.int64)  # record index in the source: which examples this batch holds
    return out


class _PlannedBatch(grain.transforms.MapWithIndex):
  """step -> that step's global batch of example indices, from a batch plan (data/clustering.py)."""

  def __init__(self, plan):
    self.plan = plan

  def map_with_index(self, step, _):
    return np.asarray(self.plan(step), np.int64)


class WatchedReads:
  """Batches read in place from a bucket (config.data.bucket_reads='direct'), each awaited with paths.watched:
  array_record's reader (Google Cloud's C++ storage client) retries a server that stopped answering for many
  minutes, so a bucket that does not answer ends the run within seconds in one line naming the data path."""

  def __init__(self, iterator, data_dir: str):
    self._it, self._dir, self._what = iterator, data_dir, f"reading the data in {data_dir}"

  def __iter__(self):
    return self

  def __next__(self):
    try:
      return paths.watched(lambda: next(self._it), self._dir, self._what)
    except (paths.Unreachable, StopIteration):
      raise
    except Exception:  # the reader's own error: the bucket's, if it does not answer (exists raises Unreachable)
      try:
        paths.exists(self._dir)
      except paths.Unreachable as e:
        raise paths.Unreachable(f"{self._what}: {e}") from None
      raise


def train_dataset(source, tokenizer, *, image_size: int, global_batch: int, seed: int, start_step: int = 0,
                  process_index: int = 0, process_count: int = 1, rows=None, workers: int = 0, prefetch: int = 4,
                  extra_inputs=None, family: str = "clip", plan=None):
  """Infinite iterator of this process's batches: image f32 [b,H,W,3], tokens int32 [b,L]: the rows of each global
  batch that this process's devices hold (`rows`, from `sharding.process_rows`), or without `rows` the
  process_index-th of process_count equal contiguous parts (b = global_batch / processes).

  The global batch order is shuffled per epoch from `seed` and does not depend on
  the number of processes: batch k is the same set of examples whether 1 or 64
  hosts read it, each host reading only its own rows. Batch k is a pure function
  of (seed, k), so `start_step` resumes the exact stream of an uninterrupted run.
  An image with several captions appears once per batch, with the caption
  `caption_choice(seed, k, index)` picks.
  extra_inputs: a framework's (example, caption, image uint8 [H, W, 3], seed, step, index) -> {name: array}, added
  to each row (hnclip_jax.frameworks: `inputs`); a pure function of its arguments keeps resumes bit-identical.
  family: the model family whose image preprocessing applies (`Family.preprocess`).
  plan: step -> the global batch's example indices (`clustering.ClusteredBatches`, config.data.batching =
  "clustered"), a pure function of the step like the random order; None: the seeded random order.
  """
  if len(source) < global_batch:
    raise ValueError(f"the training split has {len(source)} examples, fewer than one batch ({global_batch}); "
                     "lower config.batch_size")
  if rows is None:
    if global_batch % process_count:
      raise ValueError(f"config.batch_size={global_batch} is not divisible by the {process_count} processes")
    local = global_batch // process_count
    rows = slice(process_index * local, (process_index + 1) * local)
  else:
    rows = np.asarray(rows, np.int64)
  if plan is None:
    indices = grain.MapDataset.range(len(source)).shuffle(seed=seed).batch(global_batch, drop_remainder=True).repeat()
  else:
    indices = grain.MapDataset.range(plan.per_epoch).repeat().map_with_index(_PlannedBatch(plan))
  ds = indices.map_with_index(_LoadRows(source, tokenizer, image_size, rows, seed, extra_inputs, family))[start_step:]
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=max(1, prefetch), prefetch_buffer_size=prefetch))
  if workers > 0:
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return it


def _padded_batches(n_total: int, load, batch_size: int, positions=None):
  """Rows 0..n_total-1 in global batches of `batch_size` (batch b holds rows b·batch_size + j), of which this
  process reads the positions j in `positions` (default: all; `sharding.process_rows` gives a process's):
  `load(rows) -> {name: [m, ...]}` per batch, zero-padded past the last row with mask=False and index -1. Every
  process yields the same number of batches (ceil(N / batch_size)), so collective operations line up when N does
  not divide."""
  positions = np.arange(batch_size) if positions is None else np.asarray(positions, np.int64)
  num_batches = -(-n_total // batch_size)
  template = load(np.arange(min(1, n_total)))
  for b in range(num_batches):
    idx = b * batch_size + positions
    valid = idx < n_total
    got = load(idx[valid]) if valid.any() else {k: v[:0] for k, v in template.items()}
    pad = len(idx) - int(valid.sum())
    batch = {k: np.concatenate([v, np.zeros((pad, *template[k].shape[1:]), template[k].dtype)]) for k, v in got.items()}
    batch["index"] = np.where(valid, idx, -1).astype(np.int64)
    batch["mask"] = valid
    yield batch


def eval_image_batches(source, *, image_size: int, batch_size: int, positions=None, family: str = "clip"):
  """This process's share of the images of `source` (see `_padded_batches`): {"image" f32 [b,H,W,3], "index" (row
  in source), "mask"}."""
  load = lambda rows: {"image": np.stack([clip_preprocess(source[int(i)]["image"], image_size, family)  # noqa: E731
                                          for i in rows])}
  return _padded_batches(len(source), load, batch_size, positions)


def eval_text_batches(captions, tokenizer, *, batch_size: int, positions=None):
  """This process's share of `captions` (a flat list): {"tokens" int32 [b, L], "index" (row in captions), "mask"}."""
  load = lambda rows: {"tokens": tokenizer([captions[int(i)] for i in rows])}  # noqa: E731
  return _padded_batches(len(captions), load, batch_size, positions)


def read_captions(source) -> list[str]:
  """All captions of a source, flattened (images are not decoded if the source skips decoding)."""
  return [c for caps in caption_lists(source) for c in caps]


def caption_lists(source) -> list[list[str]]:
  """Each example's captions, in source order."""
  return [captions_of(source[i]) for i in range(len(source))]
