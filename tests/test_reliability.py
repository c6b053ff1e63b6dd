"""Preemption safety: exact resume after SIGKILL, SIGTERM, damaged checkpoints, non-finite steps, failing saves,
locks, and restoring onto other device layouts. Every killed, faulty or multi-device run is a real train.py
subprocess; plain one-device runs and reruns run in the test process (conftest.run_py)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import ROOT, _env, assert_error_exit, assert_in_layout, listing, metrics_rows, run_py

BASE = ["train.py", "--config", "configs/demo.py:test", "--config.total_steps=8", "--config.checkpoint_every=2",
        "--config.log_every=1", "--config.eval_every=100", "--config.max_to_keep=10"]


def train(workdir, tfds_dir, *extra, fault=None, devices=1, check=True):
  env = {"HNCLIP_FAULT": fault} if fault else None
  return run_py([*BASE, "--workdir", str(workdir), f"--config.data.data_dir={tfds_dir}", *extra], devices=devices,
                env_extra=env, check=check)


def metrics(workdir):
  return metrics_rows(workdir)


def final_params(workdir):
  from hnclip_jax import pretrained
  return [np.asarray(x) for x in jax.tree.leaves(pretrained.load(str(workdir)).params)]


def steps(workdir):
  return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())


@pytest.fixture(scope="session")  # one per test process: the module's tests are spread (conftest.SPLIT)
def reference(tmp_path_factory, tfds_dir):
  workdir = tmp_path_factory.mktemp("reference")
  train(workdir, tfds_dir)
  return workdir, final_params(workdir), metrics(workdir)


def assert_identical_to(reference, workdir):
  _, ref_params, ref_metrics = reference
  got = final_params(workdir)
  assert len(got) == len(ref_params)
  assert all(np.array_equal(a, b) for a, b in zip(got, ref_params))  # bit-identical
  assert metrics(workdir) == ref_metrics  # same steps, no gaps or duplicates, same values


# (fault, checkpoints that must survive it): after committed saves a resume is certain; a kill while a save is in
# flight (kill@3: the step-2 save may not have committed; kill_during_save@6) loses that save, never half of it.
KILLS = [pytest.param("kill_after_saves@3", [2], marks=pytest.mark.long),  # kill_after_saves@7 covers it
         ("kill_after_saves@7", [2, 4, 6]), ("kill_during_save@6", [2, 4]), ("kill@3", None)]


@pytest.mark.parametrize("fault, must_survive", KILLS, ids=[(k.values if hasattr(k, "values") else k)[0] for k in KILLS])
def test_sigkill_then_rerun_is_bit_identical(tmp_path, tfds_dir, reference, fault, must_survive):
  killed = train(tmp_path, tfds_dir, fault=fault, check=False)
  assert killed.returncode == -signal.SIGKILL
  survived = steps(tmp_path)  # async saves still in flight at the kill are lost, never half-visible
  assert survived == [s for s in (2, 4, 6) if s in survived] and max(survived, default=0) <= int(fault[-1])
  if must_survive is not None:
    assert survived == must_survive
  again = train(tmp_path, tfds_dir)
  if survived:
    assert f"resumed from {tmp_path}/checkpoints/{survived[-1]} (step {survived[-1]})" in again.stdout
  else:  # only kill@3, when the step-2 save had not committed: the rerun starts over and says nothing of a resume
    assert "resumed from" not in again.stdout
  assert_identical_to(reference, tmp_path)


def test_damaged_checkpoints_are_skipped(tmp_path, tfds_dir, reference):
  workdir = tmp_path / "w"
  shutil.copytree(reference[0], workdir)
  os.remove(workdir / ".lock") if (workdir / ".lock").exists() else None

  def largest_file(step):
    files = [os.path.join(d, f) for d, _, fs in os.walk(workdir / "checkpoints" / str(step)) for f in fs]
    return max(files, key=os.path.getsize)

  big = largest_file(8)
  with open(big, "r+b") as f:  # truncated
    f.truncate(os.path.getsize(big) // 3)
  big = largest_file(6)
  with open(big, "r+b") as f:  # bytes flipped in the middle
    f.seek(os.path.getsize(big) // 2)
    chunk = bytearray(f.read(64))
    f.seek(os.path.getsize(big) // 2)
    f.write(bytes(b ^ 0xFF for b in chunk))
  (workdir / "checkpoints" / "9.orbax-checkpoint-tmp-1234").mkdir()  # a half-written save
  # Make the run redo steps 5..8 from checkpoint 4: drop the later metrics so the comparison is exact.
  proc = train(workdir, tfds_dir)
  assert f"skipping checkpoint {workdir}/checkpoints/8" in proc.stdout
  assert f"skipping checkpoint {workdir}/checkpoints/6" in proc.stdout
  assert "(step 4)" in proc.stdout
  assert sorted(os.listdir(workdir / "checkpoints_damaged"))[0].startswith("6-")  # kept aside, not deleted
  assert_in_layout(workdir)
  assert_identical_to(reference, workdir)


def _copy(reference, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(reference[0], workdir)
  os.remove(workdir / ".lock") if (workdir / ".lock").exists() else None
  return workdir


@pytest.mark.parametrize("change,named", [
    (["--config.optimizer.grad_clip_norm=0"], "optimizer.grad_clip_norm: 1.0 -> 0.0"),
    (["--config.optimizer.train_logit_scale=false"], "optimizer.train_logit_scale: True -> False"),
])
def test_an_optimizer_change_on_resume_stops_and_changes_nothing(tmp_path, tfds_dir, reference, change, named):
  workdir = _copy(reference, tmp_path)
  before = listing(workdir)
  proc = train(workdir, tfds_dir, "--config.total_steps=10", *change, check=False)
  err = assert_error_exit(proc, named, f"--config.init_from={workdir} --workdir NEW_DIR")  # above it: library warnings
  assert err.startswith(f"error: {workdir}/checkpoints/8 cannot be resumed with this config"), err
  assert listing(workdir) == before  # checkpoints, metrics.jsonl, everything as it was
  assert not (workdir / "checkpoints_damaged").exists()


def test_accumulation_and_dtype_changes_resume_and_are_logged(tmp_path, tfds_dir, reference):
  """Neither changes the state's structure (parameters stay fp32; accumulation lives inside the step), so the run
  continues from step 8, saying what changed."""
  workdir = _copy(reference, tmp_path)
  proc = train(workdir, tfds_dir, "--config.total_steps=10", "--config.grad_accum_steps=2",
               "--config.dtype=bfloat16")
  assert (f"resumed from {workdir}/checkpoints/8 (step 8); settings changed since that checkpoint: dtype: "
          "'float32' -> 'bfloat16', grad_accum_steps: 1 -> 2") in proc.stdout
  rows = metrics(workdir)
  assert [r for r in rows if r["step"] <= 8] == reference[2]  # the history up to the checkpoint is kept as it was
  assert sorted({r["step"] for r in rows if r["step"] > 8}) == [9, 10]


def test_sigterm_checkpoints_and_exits(tmp_path, tfds_dir):
  args = [*BASE, "--workdir", str(tmp_path), f"--config.data.data_dir={tfds_dir}", "--config.total_steps=100000",
          "--config.checkpoint_every=100000"]
  proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(1), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    path = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (path.exists() and len(path.read_text().splitlines()) >= 3):
      time.sleep(0.2)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    elapsed = time.time() - t0
  finally:
    proc.kill()
  assert proc.returncode == 0, err[-3000:]
  stopped = int(out.split("stopped after step ")[1].split(";")[0])
  assert "SIGTERM" in out and steps(tmp_path) == [stopped]
  assert metrics(tmp_path)[-1]["step"] == stopped
  assert elapsed < 30, elapsed
  print(f"SIGTERM to exit: {elapsed:.2f}s")
  # The same command resumes from that checkpoint (and is killed one step later, to keep the test short).
  again = run_py(args, env_extra={"HNCLIP_FAULT": f"kill@{stopped + 1}"}, check=False)
  assert f"(step {stopped})" in again.stdout and again.returncode == -signal.SIGKILL


def test_nonfinite_stops_with_last_good_checkpoint(tmp_path, tfds_dir):
  proc = train(tmp_path, tfds_dir, fault="nan@3", check=False)
  assert_error_exit(proc, "non-finite loss or gradient at step 3", f"{tmp_path}/checkpoints/2")
  assert steps(tmp_path) == [2]


def test_nonfinite_skip_counts_and_continues(tmp_path, tfds_dir):
  train(tmp_path, tfds_dir, "--config.on_nonfinite=skip", fault="nan@3")
  rows = [r for r in metrics(tmp_path) if "loss" in r]
  assert [r["nonfinite_steps"] for r in rows] == [0, 0, 1, 1, 1, 1, 1, 1]
  assert np.isnan(rows[2]["loss"]) and all(np.isfinite(r["loss"]) for r in rows[3:])
  assert steps(tmp_path)[-1] == 8


def test_failed_save_keeps_earlier_checkpoints(tmp_path, tfds_dir, reference):
  proc = train(tmp_path, tfds_dir, fault="save_fails@4", check=False)
  assert_error_exit(proc, f"writing checkpoint {tmp_path}/checkpoints/4 failed", "No space left")
  assert steps(tmp_path) == [2]
  train(tmp_path, tfds_dir)  # space is back: resume from 2 and finish exactly
  assert_identical_to(reference, tmp_path)


def test_second_run_on_same_workdir_is_refused(tmp_path, tfds_dir):
  from hnclip_jax.preemption import WorkdirLock
  from hnclip_jax.workdir import Workdir
  lock = WorkdirLock(Workdir(str(tmp_path)))
  try:
    proc = train(tmp_path, tfds_dir, check=False)
  finally:
    lock.release()
  assert_error_exit(proc, f"another train.py (pid {os.getpid()}) is already running")


def test_workdir_that_is_a_file(tmp_path, tfds_dir):
  f = tmp_path / "file"
  f.write_text("x")
  proc = train(f, tfds_dir, check=False)
  assert_error_exit(proc, f"{f}", "is a file")


def _layout(d, f, t):
  return [f"--config.mesh.data={d}", f"--config.mesh.fsdp={f}", f"--config.mesh.tensor={t}"]


def _killed_after_step_4_on_8_devices(tmp_path, tfds_dir):
  """A run on 8 devices (data 2 x fsdp 4) killed at step 5, after its step-4 checkpoint (synchronous saves here, so
  checkpoint 4 is surely complete when step 5 is killed)."""
  part = tmp_path / "part"
  train(part, tfds_dir, *_layout(2, 4, 1), "--config.async_checkpointing=false", devices=8, fault="kill@5",
        check=False)
  assert max(steps(part)) == 4
  return part


def _resume_on(part, w, tfds_dir, reference, devices, layout):
  """A copy of `part` resumed on `layout` continues with the losses of the uninterrupted run (`reference`, one
  device; the layouts' equality with one device is tests/test_sharding.py's)."""
  want = {r["step"]: r["loss"] for r in reference[2] if "loss" in r}
  shutil.copytree(part, w)
  proc = train(w, tfds_dir, *layout, devices=devices)
  assert "(step 4)" in proc.stdout
  got = {r["step"]: r["loss"] for r in metrics(w) if "loss" in r}
  assert sorted(got) == list(range(1, 9))
  for s in range(5, 9):
    assert got[s] == pytest.approx(want[s], rel=1e-5), (str(w), s)


def test_restore_onto_other_layouts(tmp_path, tfds_dir, reference):
  """A run on 8 devices (data 2 x fsdp 4) killed after its step-4 checkpoint, resumed on 1 device and on data 2 x
  fsdp 2 x tensor 2: each continues with the losses of the uninterrupted run, and eval.py gives the same numbers on
  1 and on 8 devices. (Data 8: test_restore_onto_data_8, in `-m long`.)"""
  part = _killed_after_step_4_on_8_devices(tmp_path, tfds_dir)
  _resume_on(part, tmp_path / "one", tfds_dir, reference, 1, _layout(1, 1, 1))
  _resume_on(part, tmp_path / "tp", tfds_dir, reference, 8, _layout(2, 2, 2))
  # eval.py on any device count gives the same numbers (on the run finished on data 2 x fsdp 2 x tensor 2).
  results = []
  for devices in (1, 8):
    run_py(["eval.py", "--config", "configs/demo.py:test", "--workdir", str(tmp_path / "tp"),
            f"--config.data.data_dir={tfds_dir}", *(_layout(1, 1, 1) if devices == 1 else _layout(4, 1, 2))],
           devices=devices)
    with open(tmp_path / "tp" / "eval_results.json") as f:
      results.append(json.load(f))
  assert results[0] == results[1] and results[0]["step"] == 8


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
def test_restore_onto_data_8(tmp_path, tfds_dir, reference):
  """test_restore_onto_other_layouts' killed run resumed on data 8 (the batch over one axis, parameters whole)."""
  part = _killed_after_step_4_on_8_devices(tmp_path, tfds_dir)
  _resume_on(part, tmp_path / "dp8", tfds_dir, reference, 8, _layout(8, 1, 1))


# ---- faults of real file systems and real optimisation (docs/reliability.md, "When the machine misbehaves") ------

def _error_line(proc):
  """The one line a failed run ends with; above it only one-line library warnings (no traceback reaches the
  console: they are in WORKDIR/debug.log)."""
  assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
  return assert_error_exit(proc)


def test_full_disk_stops_at_once_and_a_rerun_ends_bit_identical(tmp_path, tfds_dir, reference, request):
  """The workdir on a disk that fills after two checkpoints (a 1.7 MB tmpfs; without root, the same test as root
  of a user namespace: test_storage.rerun_as_namespace_root): the run stops at the checkpoint that does not fit,
  naming it, with no traceback on the console, and so does a resume on the still full disk at its first save; a
  line cut off in metrics.jsonl by the full disk is set aside; with space back the rerun resumes from the newest
  checkpoint and ends bit-identical to the uninterrupted run."""
  from test_storage import rerun_as_namespace_root, small_disk
  if rerun_as_namespace_root(request):
    return
  disk = tmp_path / "disk"
  with small_disk(disk, 1700) as mounted:
    assert mounted
    workdir = disk / "w"
    args = [sys.executable, *BASE, "--workdir", str(workdir), f"--config.data.data_dir={tfds_dir}"]
    for attempt in ("first run", "a resume on the still full disk"):
      proc = subprocess.run(args, cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=600)
      err = _error_line(proc)
      done = steps(workdir)
      failed = int(err.split(f"{workdir}/checkpoints/")[1].split()[0].rstrip(")"))
      assert "Free space" in err and "rerun the same command" in err and failed > max(done, default=0), (attempt, err)
      assert failed <= 8 and done == [s for s in (2, 4, 6) if s < failed], (attempt, err)
      # Reported within the next step (config.checkpoint_overlap_steps=1): no step after it was logged.
      from hnclip_jax import storage
      rows, _ = storage.read_jsonl(str(workdir / "metrics.jsonl"))
      assert max(r["step"] for r in rows) == failed, (attempt, err, rows[-1])
    with open(workdir / "metrics.jsonl", "a") as f:  # what a write the full disk cut off leaves
      f.write('{"step": 13, "loss": 9.5')
    subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
    again = train(workdir, tfds_dir)
    assert f"{workdir}/metrics.jsonl: set aside 1 line(s)" in again.stdout
    assert done and f"resumed from {workdir}/checkpoints/{done[-1]} (step {done[-1]})" in again.stdout
    assert_identical_to(reference, workdir)


def test_diverged_runs_stop_and_keep_no_bad_checkpoint(tmp_path, tfds_dir):
  """lr=1e39 overflows the parameters in the first update: nothing is written. lr=1e30 with on_nonfinite=skip keeps
  finite but huge parameters whose embeddings are NaN: the first eval stops the run instead of reporting R@1 = 100,
  its checkpoints (values ~1e29) verify, and eval.py refuses them the same way."""
  overflow = tmp_path / "overflow"
  proc = train(overflow, tfds_dir, "--config.optimizer.lr=1e39", "--config.optimizer.warmup_steps=0",
               "--config.checkpoint_every=1", "--config.total_steps=6", check=False)
  err = _error_line(proc)
  assert "the state after step 1 holds NaN or Inf in" in err and "first: params/" in err
  assert "no checkpoint is complete yet" in err and "lower optimizer.lr" in err
  assert steps(overflow) == [] and os.listdir(overflow / "checkpoints") == []

  skip = tmp_path / "skip"
  proc = train(skip, tfds_dir, "--config.optimizer.lr=1e30", "--config.on_nonfinite=skip", "--config.eval_every=4",
               check=False)
  err = _error_line(proc)
  assert err.startswith("error: eval at step 4: non-finite (NaN or Inf) 40 of 40 image embeddings"), err
  assert "R@1=100" not in proc.stdout and steps(skip) == [2, 4]
  ev = run_py(["eval.py", "--config", "configs/demo.py:test", "--workdir", str(skip),
               f"--config.data.data_dir={tfds_dir}"], check=False)
  assert _error_line(ev).startswith("error: non-finite (NaN or Inf) 40 of 40 image embeddings")
  assert not (skip / "checkpoints_damaged").exists() and not (skip / "eval_results.json").exists()


def test_read_only_storage_stops_within_seconds(tmp_path, tfds_dir, reference):
  """A read-only checkpoints/ (a read-only bind mount as root, else no write permission) and a new workdir under
  a read-only directory: one line each, in seconds, nothing changed."""
  from test_storage import can_mount
  workdir = _copy(reference, tmp_path)
  ro = [workdir / "checkpoints", tmp_path / "parent"]
  ro[1].mkdir()
  mounted = can_mount()
  for d in ro:
    if mounted:
      subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
      subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], check=True)
    else:
      os.chmod(d, 0o500)
  try:
    before = listing(workdir)
    t0 = time.time()
    proc = train(workdir, tfds_dir, "--config.total_steps=10", check=False)
    elapsed = time.time() - t0
    err = _error_line(proc)
    assert err.startswith(f"error: the checkpoint directory {workdir}/checkpoints cannot be written (")
    assert elapsed < 90 and listing(workdir) == before  # the start-up check, not a 5-minute coordination timeout
    new = ro[1] / "new"
    err = _error_line(train(new, tfds_dir, check=False))
    assert err.startswith(f"error: --workdir {new} cannot be written (") and not new.exists()
  finally:
    for d in ro:
      subprocess.run(["umount", str(d)], capture_output=True)
      os.chmod(d, 0o755)


def test_eval_on_damaged_or_unwritable_workdirs(tmp_path, tfds_dir, reference):
  """eval.py: truncated array files or a truncated metadata file name the checkpoint and suggests --step; a file as
  --workdir is called a file; a workdir it cannot record in is refused before evaluating."""
  workdir = _copy(reference, tmp_path)
  evaluate = lambda *extra: run_py(["eval.py", "--config", "configs/demo.py:test", "--workdir", str(workdir),  # noqa
                                    f"--config.data.data_dir={tfds_dir}", *extra], check=False)
  data = [os.path.join(d, f) for d, _, fs in os.walk(workdir / "checkpoints" / "8" / "state") for f in fs
          if os.sep + "d" + os.sep in os.path.join(d, f)]  # the array data files (parameters among them)
  for path in data:
    with open(path, "r+b") as f:
      f.truncate(100)
  meta = workdir / "checkpoints" / "6" / "meta" / "metadata"
  with open(meta, "r+b") as f:
    f.truncate(100)
  for step in (8, 6):
    err = _error_line(evaluate(f"--step={step}"))
    assert err.startswith(f"error: checkpoint {workdir}/checkpoints/{step} cannot be read: it is damaged (")
    assert "--step=N (complete: [2, 4, " in err
  err = _error_line(run_py(["eval.py", "--config", "configs/demo.py:test", "--workdir", str(workdir / "data.json")],
                           check=False))
  assert err == f"error: --workdir={workdir}/data.json is a file; pass the directory train.py wrote to"
  from test_storage import can_mount
  if can_mount():
    subprocess.run(["mount", "--bind", str(workdir), str(workdir)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(workdir)], check=True)
  else:
    os.chmod(workdir, 0o500)
  try:
    err = _error_line(evaluate("--step=4"))
    assert f"{workdir} cannot be written (" in err and "eval.py records its result" in err
  finally:
    subprocess.run(["umount", str(workdir)], capture_output=True)
    os.chmod(workdir, 0o755)


_SAVES_SCRIPT = """
import json, sys, tempfile
import jax, jax.numpy as jnp
from hnclip_jax import hostmem
if sys.argv[1] == "keep":
  hostmem.release_free_memory = lambda: None
from hnclip_jax.checkpoint import Checkpointer

def rss():
  with open("/proc/self/status") as f:
    d = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("VmRSS", "VmHWM"))}
  return d["VmRSS"], d["VmHWM"]

state = {"step": jnp.int32(1), **{f"w{i}": jax.random.normal(jax.random.key(i), (1024, 768)) for i in range(128)}}
jax.block_until_ready(state)
hostmem.release_free_memory()
ck = Checkpointer(tempfile.mkdtemp() + "/checkpoints", max_to_keep=2)
rows = []
for i in range(1, 7):
  before = rss()[0]
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  ck.save(i, state, {"model": {}}, force=True)
  ck.wait()
  rows.append((before, rss()[1], rss()[0]))
print(json.dumps({"state": sum(x.nbytes for x in jax.tree.leaves(state)), "rows": rows}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to read peak memory")
def test_six_saves_in_one_process_neither_grow_it_nor_peak_above_one_host_copy():
  """A 400 MB state saved six times (async, as train.py saves): the process's resident memory after the last save is
  what it was after the first (glibc kept each save's freed host copy before hostmem.release_free_memory: +1.45x
  the state over five saves, measured), and each save's peak adds about one host copy of the state (Orbax's)."""
  got = {}
  for variant in ("release", "keep"):
    proc = subprocess.run([sys.executable, "-c", _SAVES_SCRIPT, variant], cwd=ROOT, env=_env(1),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
  state, rows = got["release"]["state"], got["release"]["rows"]
  assert abs(rows[-1][2] - rows[0][2]) < 0.1 * state, rows
  for before, peak, _ in rows[1:]:
    assert peak - before < 1.25 * state, (peak - before) / state
  keep = got["keep"]["rows"]  # the same without the release: the growth this guards against is real here
  assert keep[-1][2] - keep[0][2] > 0.3 * state, keep
