"""Fault injection for the reliability tests, driven by the HNCLIP_FAULT environment variable.

HNCLIP_FAULT="EVENT@STEP[,EVENT@STEP...]" with EVENT one of:
  kill              SIGKILL the process right after train step STEP (a checkpoint save may still be in flight)
  kill_after_saves  the same, once every checkpoint save started before it has committed (a resume is certain)
  kill_during_save  SIGKILL right after the (asynchronous) checkpoint write of STEP has started
  save_fails        the checkpoint write of STEP fails as a full disk would (OSError ENOSPC)
  nan               the batch of step STEP is made non-finite
  restore_io        every read of checkpoint STEP fails as a flaky disk would (OSError EIO)
  restore_io_once   only the first read of checkpoint STEP in this process fails that way
Unset in normal use: every hook is then a no-op.
"""
from __future__ import annotations

import errno
import os
import signal


def _armed(event: str, step: int) -> bool:
  spec = os.environ.get("HNCLIP_FAULT", "")
  return f"{event}@{step}" in {s.strip() for s in spec.split(",")}


def maybe_kill(event: str, step: int, before=None) -> None:
  """SIGKILL if EVENT@STEP is armed, after calling `before()` when given. In a multi-process run every process
  first waits for the others to get here (a barrier), then the others die at once and process 0 a second later:
  process 0 hosts JAX's coordination service, and its end makes every process still alive abort (SIGABRT) or fail
  in whatever collective it is in, so killed together the processes raced, and which signal ended each depended on
  the scheduler (docs/testing.md, "Known flaky")."""
  if _armed(event, step):
    if before is not None:
      before()
    import jax
    if jax.process_count() > 1:
      import time
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"HNCLIP_FAULT {event}@{step}")
      if jax.process_index() == 0:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_fail(event: str, step: int) -> None:
  if _armed(event, step):
    raise OSError(errno.ENOSPC, "No space left on device (injected by HNCLIP_FAULT)")


_failed_once: set = set()


def maybe_fail_read(event: str, step: int) -> None:
  if _armed(event, step) or (_armed(f"{event}_once", step) and (event, step) not in _failed_once):
    _failed_once.add((event, step))
    raise OSError(errno.EIO, "Input/output error (injected by HNCLIP_FAULT)")


def poisoned(step: int) -> bool:
  return _armed("nan", step)
