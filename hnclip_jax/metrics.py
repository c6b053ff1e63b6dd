"""Metrics to the console, `metrics.jsonl` and TensorBoard event files (process 0 only); a profiler trace of chosen
train steps (StepProfiler)."""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time

import jax
from absl import logging

from hnclip_jax import paths, storage

# Scalars that measure wall-clock time (throughput, MFU, input wait; the goodput account): different in every run,
# so left out wherever two runs are compared value for value.
TIMING_PREFIXES = ("perf/", "goodput/")


def _tail_cut(data: bytes, keep) -> int | None:
  """The byte offset after the last kept line of `data` when every later line is dropped (a tail to cut), else
  None."""
  offset, cut = 0, None
  parts = data.split(b"\n")  # the lines as a file reads them: "\n" ends a line, nothing else does
  for raw in [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else []):
    try:
      row = json.loads(raw)
    except ValueError:
      row = None
    if isinstance(row, dict) and keep(row):
      if cut is not None:
        return None  # a kept line after a dropped one: the file must be rewritten
    elif cut is None:
      cut = offset
    offset += len(raw)
  return offset if cut is None else cut


class MetricsWriter:
  """write(step, {name: float}) appends one JSON line and TensorBoard scalars; a failed write raises
  StorageError naming the file and the step (the event files' writer thread included: its errors surface at the
  next write instead of hanging the run)."""

  def __init__(self, jsonl: str | None, tb_dir: str, enabled: bool | None = None):
    """jsonl: the JSON-lines file (a run's Workdir.metrics; None: TensorBoard only); tb_dir: the event files' folder
    (Workdir.tensorboard, or .eval_tensorboard for an eval job); enabled: default on process 0 only."""
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.path = jsonl
    self.tb_dir = tb_dir
    self._tb = None
    # TensorBoard's writer opens local files only. Elsewhere (a bucket, which has no append either) the events go to a
    # local file that is uploaded whole, as one object, after every flush (what TensorFlow's gfile does on GCS), so
    # TensorBoard never reads a half-written file.
    self._staging = (tempfile.TemporaryDirectory(prefix="hnclip_jax-tb-")
                     if self.enabled and not paths.opens_natively(self.tb_dir) else None)
    if self.enabled:
      # TensorBoard's own event writer (no TensorFlow needed): unlike tensorboardX's, its writer thread hands a
      # failed write back to the caller, so a full disk cannot leave flush() waiting forever.
      from tensorboard.summary.writer.event_file_writer import EventFileWriter
      try:
        self._tb = EventFileWriter(self._staging.name if self._staging else self.tb_dir)
      except OSError as e:
        raise storage.StorageError(f"creating TensorBoard events in {self.tb_dir} failed ({storage.describe(e)}); "
                                   "free space or fix the directory and rerun") from e

  def truncate_after(self, step: int) -> None:
    """On resume: drop lines logged after the restored checkpoint, so no step appears twice, and set aside lines a
    cut-off write left (with a warning): they never block a resume. Dropping a tail cuts the file in place (no
    space needed, so this works on the full disk that stopped the run)."""
    if not self.enabled or self.path is None or not paths.exists(self.path):
      return
    rows, torn = storage.read_jsonl(self.path)
    if torn:
      print(storage.torn_warning(self.path, torn), flush=True)
    keep = lambda r: isinstance(r.get("step"), (int, float)) and r["step"] <= step  # noqa: E731
    if not torn and all(keep(r) for r in rows):
      return
    cut = _tail_cut(paths.read_bytes(self.path), keep)
    if cut is not None:
      try:
        if paths.truncate(self.path, cut):  # in place where the store can (a bucket cannot: rewritten below)
          return
      except OSError as e:
        raise storage.StorageError(f"cutting {self.path} back to step {step} failed ({storage.describe(e)}); fix "
                                   "the directory and rerun the same command") from e
    try:
      paths.write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows if keep(r)))
    except OSError as e:
      raise storage.StorageError(f"rewriting {self.path} to step {step} failed ({storage.describe(e)}); free space "
                                 "or fix the directory and rerun the same command") from e

  def write(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    from tensorboard.compat.proto import event_pb2, summary_pb2
    row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    try:
      if self.path is not None:
        storage.append_jsonl(self.path, row)
    except OSError as e:
      raise storage.StorageError(f"appending step {step} to {self.path} failed ({storage.describe(e)})") from e
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k.replace("@", ""), simple_value=float(v))
                                         for k, v in scalars.items()])  # TensorBoard tags cannot hold "@"
    try:
      self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
      self._tb.flush()
      self._upload()
    except OSError as e:
      raise storage.StorageError(f"writing step {step} to the TensorBoard events in {self.tb_dir} failed "
                                 f"({storage.describe(e)})") from e

  def _upload(self) -> None:
    if self._staging is not None:
      paths.upload_tree(self._staging.name, self.tb_dir)

  def close(self, quiet: bool = False):
    """quiet=True (on the way out of a failed run): a failure here is not raised over the one that ended it."""
    if self._tb is not None:
      tb, self._tb = self._tb, None
      try:
        tb.close()
        self._upload()
      except OSError as e:
        if quiet:
          return
        raise storage.StorageError(f"closing the TensorBoard events in {self.tb_dir} failed "
                                   f"({storage.describe(e)})") from e


# Peak dense bf16 matmul FLOP/s of one chip, from the vendors' data sheets (Google Cloud TPU system architecture
# pages; NVIDIA H100 / H200 / A100 data sheets, SXM parts, without sparsity), matched in this order against
# jax.Device.device_kind ("TPU v5 lite" is v5e, "TPU v6 lite" v6e). MFU is reported against this peak whatever
# config.dtype is, as MaxText does; a device not listed (CPU) gets no MFU.
PEAK_FLOPS = (("TPU v6 lite", 918e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v4", 275e12),
              ("H200", 989e12), ("H100", 989e12), ("A100", 312e12))


def peak_flops(device_kind: str) -> float | None:
  """The chip's peak bf16 FLOP/s (PEAK_FLOPS), or None when unknown."""
  return next((peak for name, peak in PEAK_FLOPS if name in device_kind), None)


class Throughput:
  """Per log interval, as scalars under perf/: the compiled step's matmul FLOPs per device (hlo.matmul_flops: every
  loop iteration, remat's recomputation included), the achieved TFLOP/s per device, MFU against the chip's peak
  (PEAK_FLOPS; left out where unknown) and the share of the interval's wall time spent waiting for the next batch.
  Like steps/s, an interval includes the evaluations and checkpoint waits that fell in it."""

  def __init__(self, start_step: int, device_kind: str):
    self.peak, self.flops = peak_flops(device_kind), None
    self._t, self._s, self._wait = time.perf_counter(), start_step, 0.0

  def count_flops(self, step_fn, state, batch) -> None:
    """Once, after the first step: the matmul FLOPs per device of the step program just run (from jit's cache),
    for MFU."""
    if self.flops is None:
      from hnclip_jax import hlo
      self.flops = hlo.matmul_flops(step_fn.lower(state, batch).compile().as_text())

  def waited(self, seconds: float) -> None:
    self._wait += seconds

  def scalars(self, step: int) -> dict:
    now = time.perf_counter()
    dt, n = max(now - self._t, 1e-9), step - self._s
    out = {"perf/input_wait_frac": self._wait / dt}
    if self.flops is not None:
      achieved = self.flops * n / dt
      out.update({"perf/step_tflop_per_device": self.flops / 1e12, "perf/tflops_per_device": achieved / 1e12})
      if self.peak is not None:
        out["perf/mfu"] = achieved / self.peak
    self._t, self._s, self._wait = now, step, 0.0
    return out


class Progress:
  """Steps/s and ETA between log lines."""

  def __init__(self, start_step: int, total_steps: int):
    self.total = total_steps
    self._t, self._s = time.perf_counter(), start_step

  def line(self, step: int, scalars: dict) -> str:
    now = time.perf_counter()
    rate = (step - self._s) / max(now - self._t, 1e-9)
    self._t, self._s = now, step
    eta = (self.total - step) / rate if rate > 0 else float("inf")
    vals = " ".join(f"{k}={v:.4g}" for k, v in scalars.items())
    return f"step {step}/{self.total} | {rate:.2f} steps/s | ETA {eta:.0f}s | {vals}"


def log(msg: str) -> None:
  """Progress for people: printed by process 0 (absl logging stays at WARNING unless --verbosity is given)."""
  if jax.process_index() == 0:
    print(msg, flush=True)


def quiet_libraries() -> None:
  """Orbax and friends log every file operation at INFO; keep the console readable unless asked otherwise."""
  from absl import flags
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


class StepProfiler:
  """A jax.profiler trace of train steps first..last (config.profile; None: off, and then nothing here calls the
  profiler). Written to WORKDIR/tensorboard, where TensorBoard's profile plugin finds it next to the scalars
  (plugins/profile/<time>/<host>.xplane.pb, and a .trace.json.gz that opens in Perfetto); with processes="all" each
  process i > 0 writes to WORKDIR/tensorboard/process_i. Each traced step is a `train` step event with its number.
  A resumed run traces the part of the range it runs, and says so; a trace that cannot be written stops the run
  with one StorageError line naming the directory. On a bucket the profiler writes to a local temp directory whose
  files are uploaded when the trace stops (as TensorBoard's event files are), so traces reach gs:// through the same
  client as everything else (the profiler's own GCS client ignores the emulator and the retry rules of paths.py)."""

  def __init__(self, steps: tuple[int, int] | None, processes: str, wd, start_step: int = 0):
    """wd: the run's Workdir (its tensorboard folder and each process's profile_dir)."""
    self.first, self.last = steps or (0, -1)
    index = jax.process_index()
    self.active = steps is not None and (processes == "all" or index == 0) and self.last > start_step
    self.root, self.dir = wd.tensorboard, wd.profile_dir(index)
    self.tracing, self._from, self._staging = False, None, None
    if steps is not None and self.first <= start_step:
      log(f"config.profile.steps={self.first}:{self.last}: this run starts after step {start_step}, so "
          + (f"only steps {start_step + 1}-{self.last} are traced" if self.active else "no step is traced"))

  def step(self, step: int):
    """Context for train step `step`: starts the trace at the range's first step run, annotates the step."""
    if not self.active or not self.first <= step <= self.last:
      return contextlib.nullcontext()
    if not self.tracing:
      if not paths.opens_natively(self.dir):  # the profiler writes local files (its own GCS client knows no emulator)
        self._staging = tempfile.mkdtemp(prefix="hnclip_jax-profile-")
      self._call(jax.profiler.start_trace, self._staging or self.dir)
      self.tracing, self._from = True, step
    return jax.profiler.StepTraceAnnotation("train", step_num=step)

  def after(self, step: int, state) -> None:
    """After train step `step`: at the range's last step, waits for the device work and writes the trace."""
    if self.tracing and step >= self.last:
      jax.block_until_ready(state)
      self.tracing = False
      self._call(jax.profiler.stop_trace)
      self._upload()
      log(f"profile of steps {self._from}-{step} written to {self.dir} (tensorboard --logdir {self.root})")

  def stop(self) -> None:
    """On the way out of a failed run: writes what was traced, never raising over the error that ended it."""
    if self.tracing:
      self.tracing = False
      try:
        jax.profiler.stop_trace()
        self._upload()
      except Exception:  # noqa: BLE001
        pass

  def _upload(self) -> None:
    if self._staging:
      staging, self._staging = self._staging, None
      try:
        self._call(paths.upload_tree, staging, self.dir)
      finally:
        shutil.rmtree(staging, ignore_errors=True)

  def _call(self, fn, *args) -> None:
    try:
      fn(*args)
    except Exception as e:  # noqa: BLE001  (the profiler raises JaxRuntimeError for a path it cannot write)
      raise storage.StorageError(f"writing the profile (config.profile.steps={self.first}:{self.last}) to "
                                 f"{self.dir} failed ({storage.describe(e)})") from e
