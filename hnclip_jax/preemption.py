"""Stop requests (SIGTERM/SIGINT), the workdir lock, and workdir checks."""
from __future__ import annotations

import fcntl
import os
import signal

import jax
import numpy as np
from jax.experimental import multihost_utils

from hnclip_jax import storage


class StopRequest:
  """Turns the first SIGTERM/SIGINT into a request to stop after the current step; a second one kills as usual.

  One process: a Python signal handler sets a flag. Several processes: JAX's preemption service (started by
  `jax.distributed.initialize`) catches SIGTERM on any process and agrees, through the coordination service, on
  one step at which every process stops, so no per-step collective is needed; SIGINT is forwarded to it as
  SIGTERM. Without that service (`jax_enable_preemption_service=False`) the flag is all-gathered every step.
  """

  def __init__(self):
    self.signal_name = None
    self._previous = {}
    self._service = jax.process_count() > 1 and jax.config.jax_enable_preemption_service
    if self._service:
      self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._forward)
    else:
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    self.signal_name = signal.Signals(signum).name
    for sig, handler in self._previous.items():  # a second signal gets the default behaviour
      signal.signal(sig, handler)

  def _forward(self, signum, frame):
    self._handle(signum, frame)
    os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier owns SIGTERM on multi-process runs

  def requested(self, step: int) -> bool:
    """True on every process, at the same step, once any process got a signal. Call it after every step."""
    if self._service:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal_name = self.signal_name or "SIGTERM to one of the processes"
        return True
      return False
    local = self.signal_name is not None
    if jax.process_count() == 1:
      return local
    if np.max(multihost_utils.process_allgather(np.int32(local))):
      self.signal_name = self.signal_name or "a signal to another process"
      return True
    return False


def check_workdir(workdir: str) -> None:
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir} is a file; pass a directory")
  storage.check_writable(workdir, "--workdir")
  if not os.access(workdir, os.R_OK | os.W_OK | os.X_OK):
    raise ValueError(f"--workdir={workdir} is not readable and writable by this user; fix its permissions or "
                     "choose another directory")


class WorkdirLock:
  """An exclusive lock on WORKDIR/.lock held while training (released by the OS even after SIGKILL)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, ".lock")
    self._fd = None
    if jax.process_index() != 0:
      return
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      owner = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
      os.close(fd)
      raise ValueError(f"another train.py (pid {owner}) is already running on {workdir}; wait for it to finish "
                       "or use another --workdir") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    self._fd = fd

  def release(self):
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None
