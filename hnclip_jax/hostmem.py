"""Host memory allocator: optionally run the entry points under tcmalloc.

XLA:CPU allocates each executable's temporaries as one buffer per call (279 MB for the tiny model's train step at
batch 64) with posix_memalign from a thread-pool thread. glibc serves a block that large from a fresh mmap and
unmaps it on free, so every step page-faults the whole buffer again: 68k faults and ~200 ms of kernel time per
step on 2 cores. tcmalloc keeps the freed pages and reuses them (~0 faults); the CPU train step is 1.3-1.5x faster
(docs/benchmarks.md). Accelerator backends keep the step's buffers on the device; this only matters on CPU.

The allocator must be chosen before the process starts. Either preload it yourself:

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python train.py ...

or ask the entry points to do it (opt-in; nothing happens by default):

  HNCLIP_TCMALLOC unset or 0       : keep the system allocator (the default)
  HNCLIP_TCMALLOC=1                : preload the installed tcmalloc (apt-get install libtcmalloc-minimal4);
                                     an error if there is none
  HNCLIP_TCMALLOC=auto             : preload it when installed, else keep the system allocator
  HNCLIP_TCMALLOC=/path/to/lib.so  : preload that library (an error if it does not exist)

`use_tcmalloc()` then re-executes the program once with LD_PRELOAD set; it is called first thing by train.py and
eval.py, before anything imports JAX. It does not re-execute under a debugger, in an interactive interpreter
(python -i, IPython/Jupyter %run) or for a program read from stdin or given with -c (it says so on stderr); and the
re-executed program removes the preload and its marker from the environment, so its child processes start with
the environment the user gave.

This module imports nothing beyond the standard library.
"""
from __future__ import annotations

import os
import sys

ENV = "HNCLIP_TCMALLOC"
_DONE = "_HNCLIP_TCMALLOC_REEXEC"  # set for the re-executed process: "1:" + the LD_PRELOAD it was started with
_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
         "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu")
_OFF = ("", "0", "off", "false", "no", "none")
_ON = ("1", "on", "true", "yes")
_reexecuted = False  # this process is the re-executed one


def find_tcmalloc(dirs=None) -> str | None:
  """Path of an installed tcmalloc shared library (in `dirs`, default the system's library directories), or None."""
  for d in _DIRS if dirs is None else dirs:
    for n in _NAMES:
      p = os.path.join(d, n)
      if os.path.isfile(p):
        return p
  return None


def host_allocator() -> str:
  """Which malloc this process runs on: the mapped tcmalloc/jemalloc library's path, else 'system malloc'."""
  try:
    with open("/proc/self/maps") as f:
      maps = f.read()
  except OSError:
    return "system malloc"
  for line in maps.splitlines():
    fields = line.split()
    name = os.path.basename(fields[-1]) if len(fields) >= 6 else ""
    if "tcmalloc" in name or "jemalloc" in name:
      return fields[-1]
  return "system malloc"


def cpu_allocator_note() -> str:
  """One log line: which allocator the CPU backend runs on, and how to get tcmalloc when it is not it."""
  a = host_allocator()
  if a != "system malloc":
    return f"host allocator: {a} (preloaded)"
  if os.environ.get(ENV, "").strip().lower() in _OFF:
    how = f"set {ENV}=1" + ("" if find_tcmalloc() else " after apt-get install libtcmalloc-minimal4")
  else:
    how = "apt-get install libtcmalloc-minimal4" if not find_tcmalloc() else "run it as a script file, not under a debugger"
  return f"host allocator: {a}; CPU train steps run ~1.3x faster under tcmalloc: {how} (hnclip_jax/hostmem.py)"


def preload_target(environ=os.environ) -> str | None:
  """The library `use_tcmalloc` would preload under `environ`, or None. A named path that does not exist, or
  HNCLIP_TCMALLOC=1 without an installed tcmalloc, is a ValueError naming the variable and the value."""
  setting = environ.get(ENV, "").strip()
  if setting.lower() in _OFF:
    return None
  if setting.lower() == "auto":
    return find_tcmalloc()
  if setting.lower() in _ON:
    found = find_tcmalloc()
    if found is None:
      raise ValueError(f"{ENV}={setting!r} asks for tcmalloc but none is installed in {', '.join(_DIRS)}: "
                       "apt-get install libtcmalloc-minimal4, give the library's path, or unset it")
    return found
  if not os.path.isfile(setting):
    raise ValueError(f"{ENV}={setting!r}: no such file; give the path of a tcmalloc shared library "
                     f"(e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4), 1, auto, or 0 to keep the "
                     "system allocator")
  return setting


def why_not_reexec() -> str | None:
  """Why this process must not be replaced by a re-executed copy, or None when it may be."""
  if sys.gettrace() is not None or any(m in sys.modules for m in ("pdb", "debugpy", "pydevd")):
    return "under a debugger"
  if hasattr(sys, "ps1") or sys.flags.interactive or "IPython" in sys.modules or "ipykernel" in sys.modules:
    return "in an interactive interpreter"
  if not sys.argv or sys.argv[0] in ("", "-", "-c") or not os.path.isfile(sys.argv[0]):
    return "for a program read from stdin or given with -c"
  return None


def _clean_environment() -> None:
  """In the re-executed process: give children the environment the user started us with."""
  global _reexecuted
  _reexecuted = True
  original = os.environ.pop(_DONE)[2:]
  if original:
    os.environ["LD_PRELOAD"] = original
  else:
    os.environ.pop("LD_PRELOAD", None)


def use_tcmalloc(default: str = "") -> None:
  """When HNCLIP_TCMALLOC asks for it (`default` when it is unset), re-executes this program (same interpreter,
  options and arguments) once with the library preloaded. Does nothing when it is not asked for, when a
  tcmalloc/jemalloc is loaded already, or where a re-exec would break the session (see `why_not_reexec`). Call it
  before importing JAX. A bad setting ends the program with an 'error: ...' line (exit 2)."""
  if os.environ.get(_DONE, "").startswith("1:"):
    _clean_environment()
    return
  if _reexecuted or not sys.platform.startswith("linux") or host_allocator() != "system malloc":
    return
  environ = dict(os.environ)
  if default and ENV not in environ:
    environ[ENV] = default
  try:
    path = preload_target(environ)
  except ValueError as e:  # an entry point's bad setting: one clear line, like cli.clean_errors
    sys.stderr.write(f"error: {e}\n")
    raise SystemExit(2) from None
  if path is None:
    return
  reason = why_not_reexec()
  if reason is not None:
    sys.stderr.write(f"note: {ENV} ignored {reason} (the program would restart); the system allocator is used\n")
    return
  env = dict(os.environ)
  env[_DONE] = "1:" + env.get("LD_PRELOAD", "")
  env["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, list(sys.orig_argv), env)


_trim = []


def release_free_memory() -> None:
  """Returns the C heap's free pages to the OS (glibc's malloc_trim(0); elsewhere, or under tcmalloc's own heap,
  nothing happens). Called before each checkpoint save: Orbax's host copy of the state and tensorstore's write
  buffers are freed in many small blocks from its worker threads' malloc arenas, which glibc keeps — without this the
  resident memory of a process saving ViT-L/14's 5.1 GB train state grew by 1-2 GB per save (10.7 -> 17.4 GB over 5
  saves, peak 21.9 GB on a 24 GB machine: the OOM docs/benchmarks.md recorded); with it, it stays at the state plus
  one host copy (docs/benchmarks.md, "Checkpoint memory")."""
  if not _trim:
    import ctypes
    try:
      _trim.append(ctypes.CDLL(None).malloc_trim)
    except (OSError, AttributeError):
      _trim.append(None)
  if _trim[0] is not None:
    _trim[0](0)
