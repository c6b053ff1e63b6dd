"""Host memory allocator: run the entry points under tcmalloc when it is installed.

XLA:CPU allocates each executable's temporaries as one buffer per call (279 MB for the tiny model's train step at
batch 64) with posix_memalign from a thread-pool thread. glibc serves a block that large from a fresh mmap and
unmaps it on free, so every step page-faults the whole buffer again: 68k faults and ~200 ms of kernel time per
step on 2 cores. tcmalloc keeps the freed pages and reuses them (~0 faults); the train step is 1.3-1.5x faster
(docs/benchmarks.md). The allocator must be chosen before the process starts, so `use_tcmalloc()` re-executes
the program once with LD_PRELOAD set; it is called first thing by train.py and eval.py (and the benchmarks),
before anything imports JAX. Accelerator backends keep the step's buffers on the device (the effect there is
unmeasured); the re-exec is harmless there.

  HNCLIP_TCMALLOC unset or "auto": preload libtcmalloc if found (apt-get install libtcmalloc-minimal4)
  HNCLIP_TCMALLOC=0                : keep the system allocator
  HNCLIP_TCMALLOC=/path/to/lib.so  : preload that library (an error if it does not exist)

This module imports nothing beyond the standard library.
"""
from __future__ import annotations

import os
import sys

ENV = "HNCLIP_TCMALLOC"
_DONE = "_HNCLIP_TCMALLOC_REEXEC"  # set in the re-executed process: never re-exec twice
_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
         "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu")
_OFF = ("0", "off", "false", "no", "none")


def find_tcmalloc(dirs=_DIRS) -> str | None:
  """Path of an installed tcmalloc shared library, or None."""
  for d in dirs:
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
  why = "HNCLIP_TCMALLOC=0" if os.environ.get(ENV, "auto").strip().lower() in _OFF else "tcmalloc not found"
  return (f"host allocator: {a} ({why}); CPU train steps run ~1.3x faster under tcmalloc: "
          "apt-get install libtcmalloc-minimal4, then rerun")


def preload_target(environ=os.environ) -> str | None:
  """The library `use_tcmalloc` would preload under `environ`, or None. A named path that does not exist is a
  ValueError naming the variable and the value."""
  setting = environ.get(ENV, "auto").strip()
  if setting.lower() in _OFF:
    return None
  if setting.lower() in ("", "auto", "1", "on", "true", "yes"):
    return find_tcmalloc()
  if not os.path.isfile(setting):
    raise ValueError(f"{ENV}={setting!r}: no such file; give the path of a tcmalloc shared library "
                     f"(e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4), 'auto', or 0 to keep the "
                     "system allocator")
  return setting


def use_tcmalloc() -> None:
  """Re-executes this program (same interpreter, options and arguments) with tcmalloc preloaded, once, when one
  is available and no tcmalloc/jemalloc is loaded already. Returns (doing nothing) otherwise; call it before
  importing JAX. A bad HNCLIP_TCMALLOC path ends the program with an 'error: ...' line (exit 2)."""
  if not sys.platform.startswith("linux") or os.environ.get(_DONE) or host_allocator() != "system malloc":
    return
  try:
    path = preload_target()
  except ValueError as e:  # an entry point's bad setting: one clear line, like cli.clean_errors
    sys.stderr.write(f"error: {e}\n")
    raise SystemExit(2) from None
  if path is None:
    return
  env = dict(os.environ)
  env["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
  env[_DONE] = "1"
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, list(sys.orig_argv), env)
