"""Stop requests (SIGTERM/SIGINT), the workdir lock, and workdir checks."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from hnclip_jax import paths, storage


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
  if paths.is_url(workdir):  # a bucket: writing (and removing) a probe object is the check
    storage.check_writable(workdir, "--workdir")
    return
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir} is a file; pass a directory")
  storage.check_writable(workdir, "--workdir")
  if not os.access(workdir, os.R_OK | os.W_OK | os.X_OK):
    raise ValueError(f"--workdir={workdir} is not readable and writable by this user; fix its permissions or "
                     "choose another directory")


class WorkdirLock:
  """One train.py per workdir. Local: an exclusive lock on WORKDIR/.lock (released by the OS even after SIGKILL).
  A bucket has no locks: WORKDIR/.lease is an object created only if absent (generation precondition 0) and
  renewed every LEASE_RENEW_S by a background thread. A second run finding a lease younger than LEASE_TTL_S is
  refused; a lease left by a run on this host whose process is gone is taken over at once; one left by a host
  that vanished (a preempted VM) expires LEASE_TTL_S after its last renewal — that wait, or deleting the object,
  is what a SIGKILL costs on a bucket."""

  def __init__(self, wd):
    """wd: the run's Workdir (its `lock` and `lease` paths)."""
    workdir, self.path = wd.path, wd.lock
    self._fd = None
    self._lease = None
    if jax.process_index() != 0:
      return
    if paths.is_url(workdir):
      self._lease = Lease(wd.lease)
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

  def check(self) -> None:
    """Raises (ValueError naming the new holder) once this run has lost its bucket lease to another train.py —
    its renewals stalled past LEASE_TTL_S and the other run took the workdir over. Called before each checkpoint
    save and log write, so a stalled run finds out instead of writing over the new one's files."""
    if self._lease is not None and self._lease.lost is not None:
      held = self._lease.lost
      raise ValueError(f"this train.py lost {self._lease.path} to another run (host {held.get('host', '?')}, pid "
                       f"{held.get('pid', '?')}): its lease renewals stalled and the other run took the workdir "
                       "over. Stopped without writing anything more; the other run owns the workdir now")

  def release(self):
    if self._lease is not None:
      self._lease.release()
      self._lease = None
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None


LEASE_TTL_S = 120.0
LEASE_RENEW_S = 30.0


class Lease:
  """The bucket's single-writer guard (see WorkdirLock): {"host", "pid", "renewed"} in one object, created only if
  absent (GCS `ifGenerationMatch=0`), so of two runs starting at once exactly one gets it, and renewed only if it
  is still the generation this run wrote (`ifGenerationMatch=<ours>`): a holder whose renewals stalled until
  another run took over finds out at its next renewal (`lost`: the new holder) instead of overwriting the new
  lease, and its release removes nothing that is not its own."""

  def __init__(self, path: str):
    self.path, self._fs = path, paths.filesystem()
    self._key = path.split("://", 1)[1]
    self._me = {"host": socket.gethostname(), "pid": os.getpid()}
    self._stop = threading.Event()
    self._generation, self.lost = None, None
    if not self._create():
      held = self._read()
      age = time.time() - float(held.get("renewed", 0)) if held else LEASE_TTL_S
      dead_here = held and held.get("host") == self._me["host"] and not _alive(int(held.get("pid", -1)))
      if held and age < LEASE_TTL_S and not dead_here:
        raise ValueError(f"another train.py (host {held.get('host')}, pid {held.get('pid')}) holds {path}, renewed "
                         f"{age:.0f} s ago; wait for it to finish, or — if that run is gone — for the lease to "
                         f"expire ({LEASE_TTL_S - age:.0f} s) or delete {path}, or use another --workdir")
      self._fs.rm(self._key)  # stale: taken over, and said so
      print(f"taking over {path}: its holder (host {held.get('host') if held else '?'}, pid "
            f"{held.get('pid') if held else '?'}) " + ("is gone" if dead_here else "stopped renewing it "
            f"{age:.0f} s ago"), flush=True)
      if not self._create():
        raise ValueError(f"another train.py took {path} at the same moment; use another --workdir")
    self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
    self._thread.start()

  def _body(self) -> bytes:
    return json.dumps({**self._me, "renewed": time.time()}).encode()

  def _create(self) -> bool:
    self._generation = paths.write_if_generation(self.path, self._body(), 0)
    return self._generation is not None

  def _read(self) -> dict | None:
    try:
      return json.loads(self._fs.cat(self._key))
    except (FileNotFoundError, ValueError):
      return None

  def _renew(self) -> None:
    while not self._stop.wait(LEASE_RENEW_S) and self.lost is None:
      try:
        self.renew()
      except Exception:  # noqa: BLE001 (a failed renewal is retried; the run's own writes report storage trouble)
        pass

  def renew(self) -> bool:
    """One renewal; False (and `lost` set to the new holder) when the lease is no longer this run's."""
    generation = paths.write_if_generation(self.path, self._body(), self._generation)
    if generation is None:
      held = self._read() or {}
      if {k: held.get(k) for k in self._me} == self._me:  # ours after all: a renewal whose answer was lost, retried
        self._generation = int(self._fs.info(self._key)["generation"])
        return True
      self.lost = held
      return False
    self._generation = generation
    return True

  def release(self) -> None:
    self._stop.set()
    self._thread.join(timeout=30)  # a renewal in flight must not land after the removal below
    if self.lost is None:
      try:
        paths.remove_if_generation(self.path, self._generation)
      except Exception:  # noqa: BLE001
        pass


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
    return True
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
