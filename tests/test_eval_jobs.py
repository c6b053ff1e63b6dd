"""Eval jobs: several benchmarks in one eval.py run (the paper's Table 1), and `eval.py --watch` beside a real
train.py run (deleted checkpoints, kills and restarts of both), its best checkpoint, and the table's arithmetic."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import CACHE, ROOT, _env, assert_error_exit, assert_in_layout, run_entry, run_py
from hnclip_jax import config as config_lib
from hnclip_jax.evaluation import benchmarks as bench_lib

CONFIG = "configs/demo.py:test"
TOTAL = 10


def _rows(names, seed):
  r = np.random.default_rng(seed)
  return [{"step": 7, "benchmark": n, "dataset": n, "split": "test", "num_images": 10 + i, "num_captions": 10 + i,
           "score": "cosine", **{d: {f"R@{k}": float(r.uniform(0, 100)) for k in (1, 5, 10)} for d in ("t2i", "i2t")}}
          for i, n in enumerate(names)]


def test_table_averages_markdown_and_metric_names():
  rows = _rows(["docci", "dci", "long_dci", "urban1k"], 0)
  tab = bench_lib.table(rows)
  r1 = np.array([[row["t2i"]["R@1"], row["i2t"]["R@1"]] for row in rows])  # [benchmark, direction]
  assert tab["average"]["t2i"]["R@1"] == pytest.approx(r1[:, 0].mean())
  assert tab["average"]["i2t"]["R@1"] == pytest.approx(r1[:, 1].mean())
  assert bench_lib.metric(tab, "average/R@1") == pytest.approx(r1.mean())  # the paper's 4-benchmark average
  assert bench_lib.metric(tab, "average/i2t/R@10") == pytest.approx(np.mean([row["i2t"]["R@10"] for row in rows]))
  assert bench_lib.metric(tab, "dci/t2i/R@5") == rows[1]["t2i"]["R@5"]
  with pytest.raises(ValueError, match=r"best_metric='docci/R@1'.*BENCHMARK/t2i\|i2t/R@K.*'docci', 'dci'"):
    bench_lib.metric(tab, "docci/R@1")
  md = bench_lib.markdown(tab)
  lines = md.splitlines()
  body = [[c.strip() for c in line.strip("|").split("|")] for line in lines
          if line.startswith("| ") and "benchmark" not in line]
  assert [cells[0].split(" (")[0] for cells in body] == ["docci", "dci", "long_dci", "urban1k", "**average**"]
  assert body[1][1:] == [f"{rows[1][d][k]:.2f}" for d in ("t2i", "i2t") for k in ("R@1", "R@5", "R@10")]
  assert f"R@1 {r1.mean():.2f}" in lines[-1]


def test_benchmark_list_is_checked_and_resolved():
  c = config_lib.base_config()
  with pytest.raises(ValueError, match="config.eval.benchmarks is empty"):
    bench_lib.resolve(c, "all")
  c.eval.benchmarks.urban1k = {"manual_dir": "u1k"}
  c.eval.benchmarks.docci = {"manual_dir": "/abs/docci", "split": "qual_test"}
  c.eval.benchmarks.mine = {"name": "pairs", "manual_dir": ""}
  config_lib.validate(c)
  with pytest.raises(ValueError, match=r"--benchmarks=docci,coco: coco is not in config.eval.benchmarks"):
    bench_lib.resolve(c, "docci,coco")
  with pytest.raises(ValueError, match=r"urban1k.manual_dir='u1k' is relative, but config.eval.data_root is empty"):
    bench_lib.resolve(c, "urban1k")
  with pytest.raises(ValueError, match=r"config.eval.benchmarks.mine.manual_dir is empty"):
    bench_lib.resolve(c, "mine")
  c.eval.data_root = "/root_of_data"
  got = bench_lib.resolve(c, "urban1k,docci", order=["docci", "urban1k", "mine"])
  assert [(b.name, b.data.name, b.data.manual_dir, b.split) for b in got] == [
      ("urban1k", "urban1k", "/root_of_data/u1k", "test"), ("docci", "docci", "/abs/docci", "qual_test")]
  assert got[0].data.image_size == c.data.image_size and c.data.name == "synthetic"  # the run's data is untouched
  c.eval.benchmarks.mine.manual_dir = "m"
  assert [b.name for b in bench_lib.resolve(c, "all", order=["docci", "urban1k", "mine"])] == ["docci", "urban1k",
                                                                                                "mine"]
  # A build read by its name needs no folder; the run's own build is never a benchmark's.
  c.eval.benchmarks.mine = {"name": "pairs", "build": "default_0123"}
  c.data.build = "default_run"
  got = {b.name: b.data for b in bench_lib.resolve(c, "all", order=["docci", "urban1k", "mine"])}
  assert (got["mine"].build, got["mine"].manual_dir) == ("default_0123", "")
  assert got["docci"].build == got["urban1k"].build == ""
  c.eval.benchmarks.bad = {"manul_dir": "x"}
  with pytest.raises(ValueError, match=r"unknown key config.eval.benchmarks.bad.manul_dir; did you mean "
                                       r"config.eval.benchmarks.bad.manual_dir\?"):
    config_lib.validate(c)


# ---------------------------------------------------------------------------------------------- end to end


def _train_args(workdir, tfds_dir):
  return ["train.py", "--config", CONFIG, "--workdir", workdir, f"--config.data.data_dir={tfds_dir}",
          f"--config.total_steps={TOTAL}", "--config.checkpoint_every=1", "--config.eval_every=1000"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tfds_dir):
  """A run that keeps every checkpoint: what the watched run's checkpoints hold, step by step (a fresh process,
  as the watched run is)."""
  workdir = str(tmp_path_factory.mktemp("reference"))
  run_py([*_train_args(workdir, tfds_dir), "--config.max_to_keep=100"])
  return workdir


def _eval(workdir, tfds_dir, *args, config=CONFIG):
  out = run_entry("eval.py", ["--config", config, "--workdir", workdir, f"--config.data.data_dir={tfds_dir}",
                              f"--config.compilation_cache_dir={CACHE}", *args])
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out


def _benchmark_data(root):
  """The four benchmarks' native layouts (the fixtures of tests/test_datasets.py)."""
  from test_datasets import dci_fixture, docci_fixture, image_bytes, write
  docci_fixture(os.path.join(root, "docci"))
  dci_fixture(os.path.join(root, "dci"), n=9)
  write(os.path.join(root, "dci", "dci_long.csv"), "filepath\ttitle\n" + "".join(
      f"densely_captioned_images/photos/sa_{1000 + i}.jpg\tA long caption of a red circle, number {i}\n"
      for i in range(9)))
  for i in range(1, 7):
    write(os.path.join(root, "urban1k", "image", f"{i}.jpg"), image_bytes(300 + i))
    write(os.path.join(root, "urban1k", "caption", f"{i}.txt"), f"A small blue square left of circle {i}.\n")


def test_table_one_from_one_command(reference, tfds_dir, tmp_path, monkeypatch):
  root = str(tmp_path / "benchmarks")
  _benchmark_data(root)
  cfg = tmp_path / "paper_table.py"
  cfg.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom configs.demo import get_config as demo\n\n\n"
                 "def get_config():\n  c = demo('test')\n"
                 "  c.eval.benchmarks.docci = {'manual_dir': 'docci'}\n"
                 "  c.eval.benchmarks.dci = {'manual_dir': 'dci'}\n"
                 "  c.eval.benchmarks.long_dci = {'manual_dir': 'dci'}\n"
                 "  c.eval.benchmarks.urban1k = {'manual_dir': 'urban1k'}\n  return c\n")
  work = str(tmp_path / "w")
  shutil.copytree(reference, work)
  # Each data set is built once and the encoders compile once for all four (same batch and image shapes).
  from hnclip_jax.data import builders
  from hnclip_jax.evaluation import embedding
  made, reads = [], []
  real_embed, real_source = embedding.make_embed_fn, builders.data_source
  monkeypatch.setattr(embedding, "make_embed_fn", lambda *a, **k: made.append(real_embed(*a, **k)) or made[-1])
  monkeypatch.setattr(builders, "data_source", lambda d, split, **k: reads.append((d.name, split, k.get(
      "decode_images", True))) or real_source(d, split, **k))
  out = _eval(work, tfds_dir, "--benchmarks=all", f"--config.eval.data_root={root}", "--step=6", config=str(cfg))
  monkeypatch.undo()
  assert len(made) == 1 and made[0].images._cache_size() == 1 and made[0].texts._cache_size() == 1
  assert sorted(reads) == sorted({(n, "test", d) for n in ("docci", "dci", "long_dci", "urban1k")
                                  for d in (True, False)})
  with open(os.path.join(work, "eval_table.json")) as f:
    tab = json.load(f)
  assert list(tab["benchmarks"]) == ["docci", "dci", "long_dci", "urban1k"]  # the config's order
  with open(os.path.join(work, "eval_results.json")) as f:
    assert json.load(f) == tab
  md = open(os.path.join(work, "eval_table.md")).read()
  assert md in out.stdout and "| **average** |" in md
  history = [json.loads(line) for line in open(os.path.join(work, "eval_history.jsonl"))]
  assert [(h["benchmark"], h["step"]) for h in history] == [(n, 6) for n in tab["benchmarks"]]
  # Every row equals the single-benchmark eval.py of that data set, and the averages are theirs.
  sizes = {"docci": 2, "dci": 5, "long_dci": 9, "urban1k": 6}
  singles = {}
  for name in tab["benchmarks"]:
    one = str(tmp_path / f"one_{name}")
    shutil.copytree(reference, one)
    folder = {"long_dci": "dci"}.get(name, name)
    _eval(one, tfds_dir, "--step=6", f"--config.data.name={name}", f"--config.data.manual_dir={root}/{folder}")
    with open(os.path.join(one, "eval_results.json")) as f:
      singles[name] = json.load(f)
    assert singles[name]["num_images"] == tab["benchmarks"][name]["num_images"] == sizes[name]
    for d in ("t2i", "i2t"):
      assert tab["benchmarks"][name][d] == singles[name][d], (name, d)
  for d in ("t2i", "i2t"):
    assert tab["average"][d]["R@5"] == pytest.approx(np.mean([singles[n][d]["R@5"] for n in singles]))
  # A setting that does not apply with --benchmarks is refused before anything is evaluated.
  refused = run_entry("eval.py", ["--config", str(cfg), "--workdir", work, "--benchmarks=docci", "--split=train"])
  assert_error_exit(refused, "--split=train with --benchmarks")


def _popen(args, log, env_extra=None):
  return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(1, env_extra), stdout=log,
                          stderr=subprocess.STDOUT, text=True)


def _watch_rows(workdir, final: bool = False):
  """The watcher's rows of eval_history.jsonl. While it runs, a last line being appended right now is read on the
  next look; final=True (the watcher has ended): every line must parse."""
  path = os.path.join(workdir, "eval_history.jsonl")
  if not os.path.exists(path):
    return []
  lines = open(path).read().splitlines()
  rows = []
  for i, line in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except ValueError:
      assert not final and i == len(lines) - 1, f"{path}: line {i + 1} of {len(lines)} does not parse: {line!r}"
  return [r for r in rows if r.get("job") == "watch"]


def _wait(pred, timeout, what):
  end = time.monotonic() + timeout
  while not pred():
    if time.monotonic() > end:
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.2)


def test_watcher_follows_training_through_kills_deletions_and_restarts(reference, tfds_dir, tmp_path):
  work = str(tmp_path / "w")
  train = [*_train_args(work, tfds_dir), "--config.max_to_keep=2"]
  watch = ["eval.py", "--config", CONFIG, "--workdir", work, f"--config.data.data_dir={tfds_dir}", "--watch",
           "--watch_poll_s=0.2", "--watch_timeout_s=120"]
  logs = {k: open(tmp_path / f"{k}.log", "w+") for k in ("train1", "train2", "watch1", "watch2")}
  # The eval job starts first: it waits for the training run to set up its workdir.
  watcher = _popen(watch, logs["watch1"])
  _wait(lambda: "waiting for train.py to set up" in open(tmp_path / "watch1.log").read(), 120,
        "the eval job to wait for the run")  # (started together, training could set up first: nothing to wait for)
  trainer = _popen(train, logs["train1"], {"HNCLIP_FAULT": "kill@5"})
  assert trainer.wait(timeout=300) == -signal.SIGKILL  # killed after step 5 (preempted)
  _wait(lambda: len(_watch_rows(work)) >= 1, 120, "the first watched step")
  trainer = _popen(train, logs["train2"])  # resumes
  watcher.kill()  # the eval job is killed too, and restarted
  watcher.wait()
  first = [r["step"] for r in _watch_rows(work)]
  watcher = _popen(watch, logs["watch2"])
  assert trainer.wait(timeout=300) == 0
  assert watcher.wait(timeout=300) == 0  # it ends by itself once the final step is evaluated
  out = {k: (f.seek(0), f.read())[1] for k, f in logs.items()}
  assert f"the final step {TOTAL} is evaluated; stopping" in out["watch2"]
  assert "resumed from" in out["train2"] and "done:" in out["train2"]
  rows = _watch_rows(work, final=True)
  steps = [r["step"] for r in rows]
  assert steps == sorted(set(steps)) and steps[-1] == TOTAL, steps  # in step order, none twice
  assert steps[:len(first)] == first and f"steps {first}" in out["watch2"]  # the restart picked up its history
  skipped = [int(s) for s in re.findall(r"step (\d+): its checkpoint was deleted", out["watch1"] +
                                                     out["watch2"])]
  assert not set(skipped) & set(steps)
  # max_to_keep=2 (a save the kill cut short may have left a "N.orbax-checkpoint-tmp-..." directory beside them)
  assert sorted(int(d) for d in os.listdir(os.path.join(work, "checkpoints")) if d.isdigit()) == [TOTAL - 1, TOTAL]
  # Every watched result equals a one-shot eval.py --step N of the same checkpoint (the reference kept them all).
  for r in rows:
    one = str(tmp_path / "one")
    shutil.rmtree(one, ignore_errors=True)
    shutil.copytree(reference, one)
    _eval(one, tfds_dir, f"--step={r['step']}")
    with open(os.path.join(one, "eval_results.json")) as f:
      want = json.load(f)
    assert (r["t2i"], r["i2t"]) == (want["t2i"], want["i2t"]), r["step"]
  # TensorBoard next to training's: a scalar per watched step, equal to the history.
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(os.path.join(work, "tensorboard", "eval"))
  acc.Reload()
  tb = {e.step: e.value for e in acc.Scalars("benchmarks/synthetic/t2i/R1")}
  assert set(steps) <= set(tb) and all(tb[r["step"]] == pytest.approx(r["t2i"]["R@1"]) for r in rows)
  # The best step (average R@1 of both directions) is kept outside checkpoints/ and loads.
  value = {r["step"]: (r["t2i"]["R@1"] + r["i2t"]["R@1"]) / 2 for r in rows}
  best = max(steps, key=lambda s: (value[s], -s))
  assert all(r["metric_value"] == pytest.approx(value[r["step"]]) for r in rows)
  with open(os.path.join(work, "best", "best.json")) as f:
    info = json.load(f)
  assert (info["step"], info["metric"]) == (best, "average/R@1") and rows[-1]["best_step"] == best
  from hnclip_jax import pretrained
  import jax
  got, want = pretrained.load(work, step="best"), pretrained.load(reference, step=best)
  assert jax.tree.all(jax.tree.map(np.array_equal, got.params, want.params))
  assert_in_layout(work)


def test_watcher_accounts_for_checkpoints_it_never_saw(reference, tfds_dir, tmp_path, capsys):
  """Training faster than evaluation with a small max_to_keep writes and deletes checkpoints between two looks of the
  watcher: those are named as missed (from training's own goodput records), in the log and the summary, so every
  checkpoint written is evaluated, skipped or missed."""
  from hnclip_jax import experiment
  from hnclip_jax.evaluation import job
  sys.path.insert(0, ROOT)
  from configs.demo import get_config
  work = str(tmp_path / "w")
  shutil.copytree(reference, work)
  for s in (2, 3, 5):  # written and deleted (max_to_keep) before the job's first look
    shutil.rmtree(os.path.join(work, "checkpoints", str(s)))
  config = get_config("test")
  config.data.data_dir = tfds_dir
  ev = job.Evaluator(experiment.resolve(config, work, "eval"), [bench_lib.own_data(config, "test")], "cosine")
  now = [0.0]
  summary = job.watch(ev, poll_s=5, timeout_s=30, newest_only=False, metric="average/R@1",
                      clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
  ev.close()
  out = capsys.readouterr().out
  assert summary["missed"] == [2, 3, 5] and summary["skipped"] == []
  assert summary["evaluated"] == [1, 4, 6, 7, 8, 9, 10]
  assert "steps [2, 3, 5]: written by training but deleted (max_to_keep) before this job saw them; missed" in out


def test_watcher_skips_deleted_checkpoints_and_ends_on_timeout(reference, tfds_dir, tmp_path, capsys, monkeypatch):
  """The races of the end-to-end test, made to happen: a checkpoint deleted while it waits, one deleted while it is
  read, --watch_newest_only, and no final checkpoint (a run that stopped): the job ends after the timeout."""
  from hnclip_jax import experiment
  from hnclip_jax.evaluation import job
  sys.path.insert(0, ROOT)
  from configs.demo import get_config
  work = str(tmp_path / "w")
  shutil.copytree(reference, work)
  for s in range(7, TOTAL + 1):  # training stopped after step 6 of 10
    shutil.rmtree(os.path.join(work, "checkpoints", str(s)))
  config = get_config("test")
  config.data.data_dir = tfds_dir
  run = experiment.resolve(config, work, "eval")
  ev = job.Evaluator(run, [bench_lib.own_data(run.config, "test")], "cosine")
  real_read = ev.read

  def read(step):
    if step == 4:  # deleted while being read: the read fails, the directory is gone
      shutil.rmtree(os.path.join(work, "checkpoints", "4"))
      raise FileNotFoundError("a file vanished")
    return real_read(step)

  ev.read = read
  real_list = job.finished_steps

  def listing(directory):
    steps = real_list(directory)
    if 3 in steps and [r["step"] for r in _watch_rows(work)] == [1, 2]:  # deleted right after it was listed
      shutil.rmtree(os.path.join(work, "checkpoints", "3"))
    return steps

  monkeypatch.setattr(job, "finished_steps", listing)
  now = [0.0]
  summary = job.watch(ev, poll_s=5, timeout_s=30, newest_only=False, metric="average/R@1",
                      clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
  out = capsys.readouterr().out
  assert summary["evaluated"] == [1, 2, 5, 6] and summary["skipped"] == [3, 4]
  assert "step 3: its checkpoint was deleted by training (max_to_keep) before it was read; skipped" in out
  assert "no new checkpoint in" in out and now[0] > 30
  assert [r["step"] for r in _watch_rows(work, final=True)] == [1, 2, 5, 6]
  # Restarted with the newest-only option after training went on: only the newest of the waiting steps.
  for s in (7, 8, 9):
    shutil.copytree(os.path.join(reference, "checkpoints", str(s)), os.path.join(work, "checkpoints", str(s)))
  ev.read = real_read
  summary = job.watch(ev, poll_s=5, timeout_s=30, newest_only=True, metric="average/R@1",
                      clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
  out = capsys.readouterr().out
  assert summary["evaluated"] == [9] and summary["skipped"] == [7, 8]
  assert "already evaluated by an earlier watcher (eval_history.jsonl): steps [1, 2, 5, 6]" in out
  assert "skipping steps [7, 8] (--watch_newest_only), evaluating 9" in out
  ev.close()
  with pytest.raises(FileNotFoundError, match=r"no training run appeared in --workdir=/nowhere within 3 s"):
    job.wait_for_run("/nowhere", 1, 3, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
