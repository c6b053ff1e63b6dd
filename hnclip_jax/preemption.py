"""Stop requests (SIGTERM/SIGINT), the workdir lock, and workdir checks."""
from __future__ import annotations

import os
import signal

import jax
import numpy as np
from jax.experimental import multihost_utils

from hnclip_jax import paths, storage, stores


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
  if paths.opens_natively(workdir) and paths.exists(workdir) and not paths.isdir(workdir):
    raise ValueError(f"--workdir={workdir} is a file; pass a directory")
  storage.check_writable(workdir, "--workdir")


class WorkdirLock:
  """One train.py per workdir: process 0 holds the store's lease on WORKDIR/.lock (paths.lease). Local: an
  exclusive flock, released by the OS even after SIGKILL. A bucket has no locks: the lease is an object created
  only if absent and renewed in the background under generation preconditions (stores/gcs.py); a second run
  finding it fresh is refused, a lease left by a process of this host that is gone is taken over at once, one
  left by a host that vanished (a preempted VM) expires after its TTL — that wait, or deleting the object, is what
  a SIGKILL costs on a bucket."""

  def __init__(self, wd):
    """wd: the run's Workdir (its `lock` path)."""
    self.path, self._lease = wd.lock, None
    if jax.process_index() != 0:
      return
    try:
      self._lease = paths.lease(wd.lock)
    except stores.Held as e:
      who = ", ".join(f"{k} {e.holder[k]}" for k in ("host", "pid") if k in e.holder)
      raise ValueError(f"another train.py{f' ({who})' if who else ''} {e.detail}, or use another --workdir") \
          from None

  def check(self) -> None:
    """Raises (ValueError naming the new holder) once this run has lost its lease to another train.py — its
    renewals stalled past the TTL and the other run took the workdir over. Called before each checkpoint save and
    log write, so a stalled run finds out instead of writing over the new one's files."""
    if self._lease is not None and self._lease.lost is not None:
      held = self._lease.lost
      raise ValueError(f"this train.py lost {self.path} to another run (host {held.get('host', '?')}, pid "
                       f"{held.get('pid', '?')}): its lease renewals stalled and the other run took the workdir "
                       "over. Stopped without writing anything more; the other run owns the workdir now")

  def release(self):
    if self._lease is not None:
      self._lease.release()
      self._lease = None
