"""Entry-point helpers shared by train.py, eval.py and the tools: configuration and input errors end the program with
one clear line, not a traceback; flag parsing with did-you-mean; process set-up (joining a multi-process job, the
persistent XLA compilation cache)."""
from __future__ import annotations

import difflib
import functools
import os
import re
import sys
import threading

import jax

from hnclip_jax import paths, storage
from hnclip_jax.checkpoint import CheckpointError


def clean_errors(main):
  """Wraps an absl main: ValueError/FileNotFoundError/CheckpointError/StorageError/OSError -> one 'error: ...'
  line on stderr (the traceback goes to the workdir's debug log when one is open), exit 2 (HNCLIP_TRACEBACK=1
  re-raises)."""

  @functools.wraps(main)
  def wrapped(argv):
    try:
      return main(argv)
    except (ValueError, FileNotFoundError, CheckpointError, storage.StorageError, OSError) as e:
      if os.environ.get("HNCLIP_TRACEBACK"):
        raise
      log = storage.active_debug_log()
      if log is not None and isinstance(e, (storage.StorageError, OSError)) and not isinstance(e, FileNotFoundError):
        log.exception(e)  # a storage failure's library causes; a configuration error is its own explanation
      msg = str(e)
      if isinstance(e, paths.Unreachable):
        msg = f"{e}. Once it answers, rerun the same command (what was complete before is kept)"
      elif isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
        msg = (f"{storage.describe(e)}; fix the file system (space, permissions, mount) and rerun the same "
               "command")
      storage.print_error(msg)
      if _caused_by(e, paths.Unreachable):
        # The storage server stopped answering: the libraries' writer threads would retry against it for many
        # minutes at interpreter exit (tensorstore: ~15), and nothing they hold can reach it. End now.
        _exit_now(2)
      _exit_within(EXIT_GRACE_S, 2)
      sys.exit(2)

  return wrapped


# After the error line, a failed process gets this long to exit the normal way (atexit handlers, the distributed
# client's shutdown); a library thread that would hold the exit longer (a background checkpoint write retrying
# against storage that stopped answering in a way the error did not show) is cut off: chips are not held idle.
EXIT_GRACE_S = 60.0


def _exit_now(code: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _exit_within(seconds: float, code: int) -> None:
  """Once the interpreter starts to exit, ends the process with `code` if it has not exited `seconds` later: a
  daemon timer armed by threading's exit hook, which runs before the exit waits for the library threads (so a
  program that goes on after catching SystemExit — a test running main in-process — is not cut off)."""

  def arm():
    timer = threading.Timer(seconds, _exit_now, (code,))
    timer.daemon = True
    timer.start()

  register = getattr(threading, "_register_atexit", None)  # what concurrent.futures uses to stop its workers
  (register or (lambda fn: fn()))(arm)


def _caused_by(err: BaseException, kind) -> bool:
  seen = set()
  while err is not None and id(err) not in seen:
    if isinstance(err, kind):
      return True
    seen.add(id(err))
    err = err.__cause__ or err.__context__
  return False


def define_distributed_flags() -> None:
  """Flags for launching one process of a multi-process (multi-host) job."""
  from absl import flags
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for multi-process runs.")
  flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run.")
  flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
  flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() with cluster auto-detection "
                    "(TPU pods, SLURM, ...).")


def _flag_error(err: BaseException, argv) -> str:
  """A one-line explanation of a command-line parsing failure, with the 'did you mean' where there is one."""
  raw = str(err)
  # A --config.KEY override naming a key the config does not have (ml_collections raises AttributeError/KeyError).
  m = re.search(r'Did you mean \\?"([\w.]+)\\?" instead of \\?"([\w.]+)\\?"', raw)
  if isinstance(err, (AttributeError, KeyError)):
    bad = m.group(2) if m else re.sub(r"\W", "", raw.split()[0]) if raw.split() else ""
    overrides = [a.split("=", 1)[0] for a in argv if a.startswith("--config.")]
    arg = next((a for a in overrides if bad and re.search(rf"[.]{re.escape(bad)}([.]|$)", a)), None)
    key = arg or f"--config...{bad}"
    parts = key.split(".")
    if m and bad in parts:
      parts[parts.index(bad)] = m.group(1)
    hint = f"; did you mean {'.'.join(parts)}?" if m else ""
    return f"unknown config key {key}{hint} (every key and its default: hnclip_jax/config.py)"
  lines = [line.strip() for line in raw.splitlines() if line.strip()]
  if "Traceback (most recent call last)" in raw and lines:  # an exception inside the config file: its last line
    return f"{lines[0].split(':', 1)[0]}: {lines[-1]}"
  errno_line = next((line for line in lines if line.startswith("[Errno")), None)
  if errno_line:
    return f"cannot load the config file: {errno_line}"
  return " ".join(raw.split())


def parse_flags(argv):
  """absl `flags_parser` for app.run: a bad flag, unknown --config key or unloadable config file ends the program
  with one 'error: ...' line (and a 'did you mean' where there is one), exit 2; HNCLIP_TRACEBACK=1 re-raises."""
  from absl import flags
  from ml_collections.config_flags.config_flags import is_config_flag
  try:
    rest = flags.FLAGS(argv)
    for name in list(flags.FLAGS):  # config files load lazily: a missing one only fails when first read
      if is_config_flag(flags.FLAGS[name]) and flags.FLAGS[name].value is not None:
        flags.FLAGS[name].value.keys()
    return rest
  except Exception as e:  # noqa: BLE001 — absl flag errors, config-file load errors, bad override keys/values
    if os.environ.get("HNCLIP_TRACEBACK"):
      raise
    if isinstance(e, flags.Error) and "Unknown command line flag" in str(e):
      name = re.search(r"flag '([^']+)'", str(e))
      close = difflib.get_close_matches(name.group(1), list(flags.FLAGS), n=1) if name else []
      msg = str(e).split(".")[0] + (f"; did you mean --{close[0]}?" if close else "") + " (--helpshort lists them)"
    else:
      msg = _flag_error(e, argv)
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def enable_compilation_cache(cache_dir: str) -> None:
  """Persistent XLA cache: repeated runs skip recompiling the same programs. Programs that compile in under 0.5 s are
  not stored, unless JAX's own JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS is set (the test suite sets 0). JAX's own
  JAX_COMPILATION_CACHE_DIR, when set, wins over cache_dir (config.compilation_cache_dir): every process of a job
  or a test run then shares one cache. Either may be a bucket URL (gs://BUCKET/PATH): JAX reads and writes it
  through etils epath, here on the same gcsfs client (its retries, the emulator) as every other bucket path, so
  every host of a pod and every replacement VM reads the programs the first one compiled (docs/buckets.md)."""
  from_env = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
  if cache_dir and not from_env:
    cache_dir = paths.resolve(cache_dir, "config.compilation_cache_dir")
    jax.config.update("jax_compilation_cache_dir", cache_dir)
  if from_env or cache_dir:
    paths.prepare(from_env or cache_dir)  # before JAX's cache first opens the directory
  if (cache_dir or from_env) and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def maybe_initialize_distributed() -> None:
  """Joins a multi-process job: from --coordinator_address/--num_processes/--process_id, the JAX_COORDINATOR_ADDRESS/
  JAX_NUM_PROCESSES/JAX_PROCESS_ID environment variables, or --distributed (cluster auto-detection on TPU pods/SLURM).
  """
  from absl import flags
  f = flags.FLAGS

  def flag(name):  # a library caller (a test, a notebook) may have parsed no flags, or defined none of these
    return f[name].value if name in f and f.is_parsed() else None

  addr = flag("coordinator_address") or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if addr:
    num = flag("num_processes") if flag("num_processes") is not None else int(os.environ.get("JAX_NUM_PROCESSES", "0"))
    pid = flag("process_id") if flag("process_id") is not None else int(os.environ.get("JAX_PROCESS_ID", "-1"))
    if num <= 0 or pid < 0:
      raise ValueError(f"coordinator address {addr} given, but not the process count and id: pass --num_processes "
                       "and --process_id (or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
    jax.distributed.initialize(coordinator_address=addr, num_processes=num, process_id=pid)
  elif flag("distributed"):
    jax.distributed.initialize()
