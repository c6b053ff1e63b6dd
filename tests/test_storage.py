"""What a failing file system or a diverged model can do to a run's files, checked in-process: appended logs that a
cut-off write cannot break, checkpoints that are never written non-finite and whose fingerprint cannot overflow,
retrieval that refuses NaN embeddings, and the console / debug-log split of library tracebacks."""
import contextlib
import errno
import json
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hnclip_jax import checkpoint, storage
from hnclip_jax.evaluation import retrieval
from hnclip_jax.metrics import MetricsWriter
from hnclip_jax.workdir import Workdir


def can_mount() -> bool:
  """Whether tests may mount a tmpfs or a read-only bind (root); HNCLIP_TEST_NO_MOUNT=1 tries the fallbacks."""
  if os.environ.get("HNCLIP_TEST_NO_MOUNT"):
    return False
  return os.geteuid() == 0 and subprocess.run(["mount", "--version"], capture_output=True).returncode == 0


USERNS = ["unshare", "--user", "--map-root-user", "--mount"]


def rerun_as_namespace_root(request) -> bool:
  """For a check that needs a real small disk (a tmpfs) where this process may not mount one (not root, or
  HNCLIP_TEST_NO_MOUNT=1): runs this same test in a fresh pytest process as root of its own user and mount namespace
  (`unshare --user --map-root-user --mount`, open to unprivileged users where the kernel allows user namespaces)
  and asserts it passed there. Returns True when it did (the caller then returns), False when this process can
  mount; skips, saying why, where neither is possible (listed at the end of the run: pytest -rs)."""
  if can_mount():
    return False
  if os.environ.get("HNCLIP_TEST_IN_USERNS"):
    pytest.fail("root of a user namespace, yet a tmpfs cannot be mounted here")
  probe = subprocess.run([*USERNS, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", "/mnt"], capture_output=True,
                         text=True)
  if probe.returncode != 0:
    pytest.skip("needs a small tmpfs: not root, and no user namespace may mount one here "
                f"({(probe.stderr.strip() or 'unshare failed').splitlines()[-1]})")
  env = {k: v for k, v in os.environ.items()
         if k != "HNCLIP_TEST_NO_MOUNT" and not k.startswith(("PYTEST_", "XDIST"))}
  env["HNCLIP_TEST_IN_USERNS"] = "1"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([*USERNS, sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                         request.node.nodeid], cwd=root, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
  return True


@contextlib.contextmanager
def small_disk(path, kib: int):
  """`path` as a tmpfs of `kib` KiB (root); yields True, or False where mounting is not allowed."""
  os.makedirs(path, exist_ok=True)
  ok = can_mount() and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)],
                                      capture_output=True).returncode == 0
  try:
    yield ok
  finally:
    if ok:
      subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def file_size_limit(nbytes: int):
  """Pure-Python stand-in for a full disk: writes past `nbytes` in any file fail (EFBIG) instead of ENOSPC."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)


# ---- appended JSON-lines logs -----------------------------------------------------------------------------------

def test_a_failed_append_takes_its_partial_line_back(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  for step in range(3):
    storage.append_jsonl(path, {"step": step, "loss": 1.0})
  before = open(path, "rb").read()
  big = {"step": 3, "blob": "x" * 4000}
  with file_size_limit(len(before) + 100):  # room for the start of the line only
    with pytest.raises(OSError) as e:
      storage.append_jsonl(path, big)
  assert e.value.errno == errno.EFBIG
  assert open(path, "rb").read() == before  # no partial line left behind
  storage.append_jsonl(path, big)  # space is back
  assert [r["step"] for r in storage.read_jsonl(path)[0]] == [0, 1, 2, 3]


def test_full_tmpfs_append_is_all_or_nothing(tmp_path, request):
  if rerun_as_namespace_root(request):
    return
  with small_disk(tmp_path / "disk", 8) as mounted:
    assert mounted
    path = str(tmp_path / "disk" / "log.jsonl")
    with pytest.raises(OSError) as e:
      for step in range(10_000):
        storage.append_jsonl(path, {"step": step, "pad": "y" * 50})
    assert e.value.errno == errno.ENOSPC
    rows, torn = storage.read_jsonl(path)
    assert not torn and [r["step"] for r in rows] == list(range(len(rows))) and len(rows) == step


def _cut_positions(path):
  data = open(path, "rb").read()
  start = data.rstrip(b"\n").rfind(b"\n") + 1
  return data, start, range(start, len(data))


def test_metrics_resume_survives_a_cut_at_every_byte_of_the_last_line(tmp_path, capsys):
  w = MetricsWriter(str(tmp_path / "metrics.jsonl"), str(tmp_path / "tensorboard"), enabled=True)
  for step in range(1, 5):
    w.write(step, {"loss": 1.0 / step, "eval/t2i/R@1": 10.0 * step})
  w.close()
  path = str(tmp_path / "metrics.jsonl")
  data, start, cuts = _cut_positions(path)
  full = [json.loads(line) for line in data.decode().splitlines()]
  for cut in cuts:
    with open(path, "wb") as f:
      f.write(data[:cut])
    whole = data[start:cut].strip()
    complete = bool(whole) and whole == data[start:].strip()  # only the newline is missing
    w = MetricsWriter(str(tmp_path / "metrics.jsonl"), str(tmp_path / "tensorboard"), enabled=True)
    w.truncate_after(3)  # the resumed checkpoint's step: the last line is past it anyway
    w.write(4, {"loss": 0.25, "eval/t2i/R@1": 40.0})
    w.close()
    rows, torn = storage.read_jsonl(path)
    assert not torn and rows == full, cut
    out = capsys.readouterr().out
    assert ("set aside 1 line(s)" in out) == (bool(whole) and not complete), (cut, out)


def test_eval_history_survives_a_cut_at_every_byte_of_the_last_line(tmp_path, capsys):
  wd = Workdir(str(tmp_path))
  for step in (2, 4):
    wd.record_eval({"step": step, "t2i": {"R@1": float(step)}}, {"data": {"name": "synthetic"}})
  data, start, cuts = _cut_positions(wd.eval_history)
  for cut in cuts:
    with open(wd.eval_history, "wb") as f:
      f.write(data[:cut])
    complete = data[start:cut].strip() == data[start:].strip()
    assert [r["step"] for r in wd.eval_records()] == ([2, 4] if complete else [2]), cut
    wd.record_eval({"step": 6, "t2i": {"R@1": 6.0}})
    assert [r["step"] for r in wd.eval_records()] == ([2, 4, 6] if complete else [2, 6]), cut
  capsys.readouterr()


def test_a_failed_eval_record_names_the_file_and_leaves_no_temp_file(tmp_path):
  wd = Workdir(str(tmp_path))
  wd.record_eval({"step": 2, "t2i": {"R@1": 1.0}})
  before = sorted(os.listdir(tmp_path))
  with file_size_limit(os.path.getsize(wd.eval_history) + 10):
    with pytest.raises(storage.StorageError, match=r"recording the result of step 4 in .*eval_history.jsonl failed"):
      wd.record_eval({"step": 4, "t2i": {"R@1": 2.0}, "pad": "z" * 500})
  assert sorted(os.listdir(tmp_path)) == before
  assert [r["step"] for r in wd.eval_records()] == [2]


def test_damaged_data_json_is_named(tmp_path):
  wd = Workdir(str(tmp_path))
  wd.save_data({"name": "synthetic"})
  with open(wd.data_json, "r+b") as f:
    f.truncate(9)
  with pytest.raises(ValueError, match=r"data.json is damaged"):
    wd.data()


# ---- checkpoints: finite values only, fingerprints that cannot overflow ----------------------------------------

def _state(scale=1.0):
  return {"params": {"w": jnp.full((64,), scale, jnp.float32), "b": jnp.arange(4.0) * scale},
          "opt_state": {"mu": jnp.zeros((64,)), "count": jnp.int32(3)}, "step": jnp.int32(3)}


def _abstract(state):
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state)


def test_huge_finite_values_checkpoint_and_restore(tmp_path):
  """1e30 squared overflows fp32: the fingerprint is taken from scaled sums, in float64 on the host."""
  state = _state(5e29)
  fp = checkpoint.fingerprint(state)
  assert np.all(np.isfinite(np.asarray(fp["params"])))
  np.testing.assert_allclose(fp["params"][1], [5e29 * 64, 25e58 * 64], rtol=1e-6)  # sorted keys: b, w
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), async_save=False)
  ckpt.save(3, state, {})
  got = ckpt.restore(3, _abstract(state))  # verified against the fingerprint: not called damaged
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state)))
  ckpt.close()


def test_old_fingerprints_still_verify(tmp_path):
  """Checkpoints written before the scaled fingerprint hold plain fp32 sums: they still match."""
  state = _state(0.37)
  old = {k: [[float(jnp.sum(jnp.abs(x.astype(jnp.float32)))), float(jnp.sum(jnp.square(x.astype(jnp.float32))))]
             for x in jax.tree.leaves(v)] for k, v in state.items()}
  assert all(checkpoint._same(old[k], v) for k, v in checkpoint.fingerprint(state).items())


@pytest.mark.parametrize("where", ["params/w", "opt_state/mu"])
def test_a_non_finite_state_is_never_written(tmp_path, where):
  state = _state()
  group, name = where.split("/")
  state[group][name] = state[group][name].at[5].set(jnp.inf if group == "params" else jnp.nan)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), async_save=False)
  ckpt.save(1, _state(), {})
  with pytest.raises(checkpoint.NonFiniteState, match=rf"state after step 2 holds NaN or Inf in 1 of 5 arrays "
                                                      rf"\(first: {where}\); checkpoint 2 was not written.*/c/1\) "
                                                      "are kept"):
    ckpt.save(2, state, {})
  assert ckpt.finished_steps() == [1] and os.listdir(tmp_path / "c") == ["1"]
  ckpt.close()


def test_a_save_the_disk_cannot_hold_is_refused_before_writing(tmp_path, request):
  if rerun_as_namespace_root(request):
    return
  with small_disk(tmp_path / "disk", 64) as mounted:
    assert mounted
    ckpt = checkpoint.Checkpointer(str(tmp_path / "disk" / "c"), async_save=False)
    big = {"params": {"w": jnp.ones((64 * 1024,))}, "step": jnp.int32(1)}  # 256 KiB
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint .*/c/7 needs about 0.3 MiB, but only"):
      ckpt.save(7, big, {})
    assert os.listdir(tmp_path / "disk" / "c") == []
    ckpt.close()


def test_a_failed_background_save_is_reported_at_the_next_step(tmp_path, monkeypatch):
  """With overlap_steps=1 the step after a save waits for it, however long the write takes, and names the step
  whose save failed (Orbax may only log a failed write: the step then is not on disk)."""
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), async_save=True, overlap_steps=1)
  ckpt.save(4, _state(), {})
  monkeypatch.setattr(ckpt._mgr, "is_saving_in_progress", lambda: True)  # a slow write ...
  monkeypatch.setattr(ckpt, "finished_steps", lambda: [])  # ... that ends with nothing on disk
  ckpt.check(4)  # the step that saved goes on
  with pytest.raises(checkpoint.CheckpointError, match=r"writing checkpoint .*/c/4 failed in the background"):
    ckpt.check(5)
  monkeypatch.undo()
  ckpt.close()
  from hnclip_jax import config as config_lib
  c = config_lib.base_config()
  c.async_checkpointing, c.checkpoint_overlap_steps = False, 4
  with pytest.raises(ValueError, match=r"config.checkpoint_overlap_steps=4 does not apply: "
                                       r"config.async_checkpointing=False"):
    config_lib.validate(c)
  c.checkpoint_overlap_steps = 0
  with pytest.raises(ValueError, match=r"config.checkpoint_overlap_steps=0 must be positive"):
    config_lib.validate(c)


# ---- retrieval refuses NaN --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["one image", "one caption", "all"])
def test_recall_refuses_non_finite_embeddings(case):
  rng = np.random.default_rng(0)
  img, txt = rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(6, 4)).astype(np.float32)
  assert retrieval.recall_at_k(img, txt)["t2i"]["R@10"] == 100.0  # finite: fine
  if case == "one image":
    img[3, 1] = np.nan
    want = r"1 of 6 image embeddings \(first: row 3\)"
  elif case == "one caption":
    txt[2, 0] = np.inf
    want = r"1 of 6 caption embeddings \(first: row 2\)"
  else:
    img[:], txt[:] = np.nan, np.nan
    want = r"6 of 6 image embeddings \(first: row 0\) and 6 of 6 caption embeddings"
  with pytest.raises(retrieval.NonFiniteEmbeddings, match=want):
    retrieval.recall_at_k(img, txt)
  with pytest.raises(retrieval.NonFiniteEmbeddings):
    retrieval.recall_from_scores(txt @ img.T)
  from hnclip_jax.evaluation.report import write_report
  with pytest.raises(retrieval.NonFiniteEmbeddings):
    write_report("/nonexistent", img=img, txt=txt, caption_image=np.arange(6), captions=["c"] * 6,
                 image_bytes=lambda r: b"", recall={}, meta={})


# ---- errors: one console line, tracebacks in the debug log ------------------------------------------------------

def test_os_errors_end_with_one_line_and_the_traceback_in_the_debug_log(tmp_path, capsys):
  from hnclip_jax.cli import clean_errors
  log = storage.start_debug_log(Workdir(str(tmp_path)).debug_log)
  try:
    logging.getLogger("orbax.fake").error("background write failed", exc_info=ValueError("RESOURCE_EXHAUSTED: x"))
    t = threading.Thread(target=lambda: 1 / 0, name="writer")
    t.start()
    t.join()

    def other_thread_prints():
      print("Traceback (most recent call last):\nRuntimeError: Event loop is closed", file=sys.stderr)
    t = threading.Thread(target=other_thread_prints)
    t.start()
    t.join()

    @clean_errors
    def main(argv):
      raise OSError(errno.EROFS, "Read-only file system", "/w/checkpoints/8")

    with pytest.raises(SystemExit) as e:
      main([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"error: Read-only file system (EROFS): /w/checkpoints/8; fix the file system (space, permissions, mount) "
        f"and rerun the same command (details: {log.path})"]
    text = open(log.path).read()
    assert "RESOURCE_EXHAUSTED" in text and "ZeroDivisionError" in text and "Event loop is closed" in text
    assert "OSError: [Errno 30] Read-only file system" in text and log.last_error.startswith("background write")
  finally:
    log.close()
    storage._active = None


def test_a_failed_process_that_a_library_thread_would_hold_open_still_exits(tmp_path):
  """After its error line, a process whose exit waits on a non-daemon thread that never ends (a background
  checkpoint write retrying against storage that stopped answering) exits with code 2 once cli.EXIT_GRACE_S is up;
  one that has no such thread exits at once, as before."""
  script = tmp_path / "held.py"
  script.write_text(textwrap.dedent("""
      import sys, threading, time
      from hnclip_jax import cli
      cli.EXIT_GRACE_S = float(sys.argv[1])
      if sys.argv[2] == "held":
        threading.Thread(target=time.sleep, args=(3600,), name="writer").start()  # non-daemon: exit waits for it

      @cli.clean_errors
      def main(argv):
        raise ValueError("the write failed")

      main([])
  """))
  for held in ("held", "free"):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), "10", held], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    took = time.monotonic() - start
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == "error: the write failed", proc.stderr
    assert (took >= 10) == (held == "held") and took < 60, (held, took)


def test_check_writable_names_the_directory(tmp_path):
  d = tmp_path / "ro"
  d.mkdir()
  if can_mount() and subprocess.run(["mount", "--bind", str(d), str(d)], capture_output=True).returncode == 0:
    subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], check=True)
    code = "EROFS"
  else:
    os.chmod(d, 0o500)
    code = "EACCES"
  try:
    with pytest.raises(storage.StorageError, match=rf"the checkpoint directory {d} cannot be written \(.*{code}"):
      storage.check_writable(str(d), "the checkpoint directory")
  finally:
    subprocess.run(["umount", str(d)], capture_output=True)
    os.chmod(d, 0o755)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the event writer's thread
def test_metrics_writer_failures_name_the_file_and_never_hang(tmp_path, monkeypatch):
  """A full disk under metrics.jsonl, then under the TensorBoard events (whose writer thread used to die silently
  and leave flush() waiting forever): StorageError naming the file and the step, whole lines kept."""
  w = MetricsWriter(str(tmp_path / "metrics.jsonl"), str(tmp_path / "tensorboard"), enabled=True)
  w.write(1, {"loss": 1.0})
  with file_size_limit(os.path.getsize(tmp_path / "metrics.jsonl") + 20):
    with pytest.raises(storage.StorageError, match=r"appending step 2 to .*metrics.jsonl failed \(File too large"):
      w.write(2, {"loss": 0.5, "grad_norm": 3.0})
  assert [r["step"] for r in storage.read_jsonl(str(tmp_path / "metrics.jsonl"))[0]] == [1]

  from tensorboard.summary.writer import record_writer

  def full(self, data):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(record_writer.RecordWriter, "write", full)
  done = threading.Event()
  errors = []

  def write():
    try:
      for step in range(3, 50):  # the writer thread fails on the first event; a later call must raise
        w.write(step, {"loss": 0.1})
    except storage.StorageError as e:
      errors.append(str(e))
    done.set()
  threading.Thread(target=write, daemon=True).start()
  assert done.wait(60), "MetricsWriter.write hung after the event writer failed"
  assert errors and re.match(r"writing step \d+ to the TensorBoard events in .*tensorboard failed \(No space left "
                             r"on device \(ENOSPC\)\)", errors[0]), errors
  w.close(quiet=True)


def test_data_json_write_failure_is_named(tmp_path):
  wd = Workdir(str(tmp_path))
  with file_size_limit(10):
    with pytest.raises(storage.StorageError, match=r"writing .*data.json failed \(File too large \(EFBIG\)\); "
                                                   "nothing was trained yet"):
      wd.save_data({"name": "synthetic", "manual_dir": "/x" * 50})
  assert os.listdir(tmp_path) == []
