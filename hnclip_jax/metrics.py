"""Metrics to the console, `metrics.jsonl` and TensorBoard event files (process 0 only)."""
from __future__ import annotations

import json
import os
import time

import jax
from absl import logging


class MetricsWriter:
  """write(step, {name: float}) appends one JSON line and TensorBoard scalars."""

  def __init__(self, workdir: str, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    if self.enabled:
      from tensorboardX import SummaryWriter  # writes event files without TensorFlow
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def truncate_after(self, step: int) -> None:
    """On resume: drop lines logged after the restored checkpoint, so no step appears twice."""
    if not self.enabled or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(keep)
    os.replace(tmp, self.path)

  def write(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    for k, v in scalars.items():
      self._tb.add_scalar(k.replace("@", ""), float(v), int(step))  # TensorBoard tags cannot hold "@"
    self._tb.flush()

  def close(self):
    if self._tb is not None:
      self._tb.close()


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
