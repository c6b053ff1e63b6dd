"""Entry-point helper: configuration and input errors end the program with one clear line, not a traceback."""
from __future__ import annotations

import functools
import os
import sys

from hnclip_jax.checkpoint import CheckpointError


def clean_errors(main):
  """Wraps an absl main: ValueError/FileNotFoundError/CheckpointError -> 'error: ...' on stderr, exit 2
  (HNCLIP_TRACEBACK=1 re-raises)."""

  @functools.wraps(main)
  def wrapped(argv):
    try:
      return main(argv)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
      if os.environ.get("HNCLIP_TRACEBACK"):
        raise
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(2)

  return wrapped


def define_distributed_flags() -> None:
  """Flags for launching one process of a multi-process (multi-host) job."""
  from absl import flags
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for multi-process runs.")
  flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run.")
  flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
  flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() with cluster auto-detection "
                    "(TPU pods, SLURM, ...).")
