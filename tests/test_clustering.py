"""config.data.batching="clustered" (hnclip_jax/data/clustering.py): batches of caption neighbours under the start
model — every example at most once per epoch, each batch an anchor and its nearest not-yet-placed neighbours,
deterministic given the seed and the epoch, the same global batches for every process (each reading its rows), and
train.py resuming exactly from the stored caption index."""
import json
import os
import pickle
import re
import signal

import numpy as np
import pytest

from conftest import assert_error_exit, assert_in_layout, metrics_rows, run_py
from hnclip_jax.data import clustering, pipeline


def _index(n=96, groups=12, dim=16, seed=0):
  """Unit vectors in `groups` tight groups (near-duplicate captions) around random centres."""
  r = np.random.default_rng(seed)
  centres = r.normal(size=(groups, dim))
  x = centres[np.arange(n) % groups] + 0.15 * r.normal(size=(n, dim))
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("n, batch", [(96, 8), (100, 8), (37, 4)])
def test_each_batch_is_an_anchor_and_its_nearest_free_neighbours(n, batch):
  index = _index(n)
  plan = clustering.epoch_plan(index, batch, seed=3, epoch=0)
  assert plan.shape == (n // batch, batch)
  assert len(np.unique(plan)) == plan.size  # no example twice; N mod B dropped
  placed = np.zeros(n, bool)
  for members in plan:  # brute force: the anchor's B-1 most similar examples among those still free
    anchor, rest = members[0], members[1:]
    free = np.flatnonzero(~placed & (np.arange(n) != anchor))
    sims = index[free].astype(np.float64) @ index[anchor].astype(np.float64)
    want = np.sort(sims)[::-1][: batch - 1]
    got = np.sort(index[rest].astype(np.float64) @ index[anchor].astype(np.float64))[::-1]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    placed[members] = True


def test_plans_are_deterministic_and_differ_by_seed_and_epoch():
  index = _index()
  a = clustering.epoch_plan(index, 8, seed=1, epoch=0)
  np.testing.assert_array_equal(a, clustering.epoch_plan(index, 8, seed=1, epoch=0))
  assert not np.array_equal(a, clustering.epoch_plan(index, 8, seed=1, epoch=1))
  assert not np.array_equal(a, clustering.epoch_plan(index, 8, seed=2, epoch=0))


def test_clustered_batches_are_crowded():
  """The mean in-batch caption similarity (mean Ḡ) of clustered batches against random ones, and the helper
  against a brute-force mean over each batch's off-diagonal pairs."""
  index = _index()
  clustered = clustering.epoch_plan(index, 8, 0, 0)
  random = clustering.random_plan(len(index), 8, 0, 0)
  brute = lambda plan: np.mean([(index[b] @ index[b].T)[~np.eye(8, dtype=bool)].mean() for b in plan])  # noqa: E731
  for plan in (clustered, random):
    assert abs(clustering.mean_in_batch_similarity(index, plan) - brute(plan)) < 1e-6
  assert brute(clustered) > brute(random) + 0.3


def test_steps_run_through_epochs_and_survive_pickling():
  """Step k of ClusteredBatches is batch k mod (N // B) of epoch k // (N // B); grain's worker processes get a
  pickled copy that draws the same batches."""
  index = _index(96)
  plan = clustering.ClusteredBatches(index, 8, seed=5)
  assert plan.per_epoch == 12
  np.testing.assert_array_equal(plan(13), clustering.epoch_plan(index, 8, 5, 1)[1])
  copy = pickle.loads(pickle.dumps(plan))
  for step in (0, 11, 12, 40):
    np.testing.assert_array_equal(copy(step), plan(step))


class _Source:
  """A data source of n tiny examples whose caption names the example (what the pipeline reads of it)."""

  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    return {"image": np.full((8, 8, 3), i % 255, np.uint8), "caption": f"example {i}".encode(), "image_id": i}


def test_every_process_reads_its_rows_of_the_same_global_batches():
  """Two processes (halves of each global batch) and one process with every row read the same batches, exactly the
  plan's, from any start step (a resume)."""
  from hnclip_jax.data.tokenizer import WordTokenizer
  source = _Source(96)
  tok = WordTokenizer.fit([f"example {i}" for i in range(96)], context_length=8)
  plan = clustering.ClusteredBatches(_index(96), 8, seed=2)
  kw = dict(image_size=8, global_batch=8, seed=2, plan=plan, prefetch=1)
  whole = iter(pipeline.train_dataset(source, tok, rows=np.arange(8), start_step=10, **kw))
  halves = [iter(pipeline.train_dataset(source, tok, rows=np.arange(4) + 4 * p, start_step=10, **kw)) for p in range(2)]
  for step in range(10, 16):
    w = next(whole)
    h = [next(it) for it in halves]
    np.testing.assert_array_equal(w["index"], plan(step))
    np.testing.assert_array_equal(np.concatenate([x["index"] for x in h]), plan(step))


def test_train_py_clustered_batches_resume_exactly(tmp_path, tfds_dir):
  """train.py with config.data.batching=clustered: the caption index is built from the start model at the first
  start and stored; a run killed after step 3 and rerun reads it back and ends with the metrics of an uninterrupted
  run, bit for bit; the log reports the batches' crowding against random ones."""
  args = ["train.py", "--config", "configs/demo.py:test", f"--config.data.data_dir={tfds_dir}",
          "--config.data.batching=clustered", "--config.total_steps=6", "--config.log_every=1",
          "--config.checkpoint_every=2", "--config.eval_every=100"]
  whole = run_py([*args, "--workdir", str(tmp_path / "whole")])
  line = next(x for x in whole.stdout.splitlines() if "clustered batches:" in x)
  crowd, spread = (float(v) for v in re.findall(r"-?\d+\.\d+", line))
  assert crowd > spread, line
  meta = json.load(open(tmp_path / "whole" / "batching" / "caption_index.json"))
  assert meta["examples"] == 128 and meta["built_from"].startswith("initial parameters")
  assert_in_layout(tmp_path / "whole")
  resumed = tmp_path / "resumed"
  killed = run_py([*args, "--workdir", str(resumed)], env_extra={"HNCLIP_FAULT": "kill_after_saves@3"}, check=False)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert sorted(os.listdir(resumed / "checkpoints")) == ["2"]  # the kill came after step 3: checkpoint 2 survived
  index_file = resumed / "batching" / "caption_index.npy"
  written = (index_file.read_bytes(), index_file.stat().st_mtime_ns)
  again = run_py([*args, "--workdir", str(resumed)])
  assert f"resumed from {resumed}/checkpoints/2 (step 2)" in again.stdout, again.stdout[-2000:]
  assert metrics_rows(str(resumed)) == metrics_rows(str(tmp_path / "whole"))
  # the index is read back, never rebuilt (the same bytes, never rewritten); without it a resume is refused
  assert (index_file.read_bytes(), index_file.stat().st_mtime_ns) == written
  os.remove(index_file)
  proc = run_py([*args, "--config.total_steps=8", "--workdir", str(resumed)], check=False)
  assert_error_exit(proc, "caption_index.npy is missing")
