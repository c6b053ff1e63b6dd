"""Goodput: where each train.py process's wall time went, and what a whole run (all its restarts) cost.

A process's wall time, from the moment the OS started it, is split into named parts that add up to it:

    init         distributed init, config, model and abstract state, data, tokenizer, the initial state
    compile      tracing, lowering and XLA compiles or persistent-cache reads of every program (per program:
                 its name, seconds, and cache "hit" / "miss" / "off"), wherever they happen (first step, first eval)
    restore      reading the checkpoint a resumed run starts from
    steps        the training loop's own work: dispatching and running train steps, logging
    input_wait   the loop waiting for the next batch
    checkpoint   the loop blocked by checkpoint saves (the device-to-host copy, a previous save still in flight)
    eval         in-training evaluations
    other        what is left: interpreter start-up before the first timer, closing files at the end

Each process rewrites its account whole to WORKDIR/goodput/<start>-p<i>.json (Workdir.goodput_record) at every
log step, checkpoint save and eval, and at its end; process 0 also puts it in metrics.jsonl (goodput/*). A
process killed without warning leaves its account as of its last record. After a resume, the steps the earlier
process ran past its last complete checkpoint are redone: `summarize` reads them from that process's records
(the loop time and step time it had reached at each checkpoint it saved) and reports them as progress lost.
`python -m hnclip_jax.tools.goodput --workdir DIR` prints a whole run's account across its restarts.

Timing comes from JAX's own monitoring events (jax.monitoring: the trace, lowering and backend-compile spans, the
persistent cache's hit events), counted on the main thread only: a compile in a library's background thread
overlaps the loop and costs it nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time

PARTS = ("init", "compile", "restore", "steps", "input_wait", "checkpoint", "eval")
_COMPILE_SPANS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def process_start_time() -> float:
  """When the OS started this process (epoch seconds, ~10 ms resolution; Linux /proc), so the interpreter's and
  JAX's import time are part of the account; elsewhere, now."""
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, `starttime`, in clock ticks after boot
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    now = time.time()
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    return time.time()


class Account:
  """One process's account, from `start_time` (default: now; train.py run as a script passes
  process_start_time()). `phase(name)` sets the part the time goes to from now; `with part(name)` carves a
  stretch out of it (nested parts carve from their parent); compiles are carved from whatever part runs them."""

  def __init__(self, start_time: float | None = None):
    self.start_time = time.time() if start_time is None else start_time
    self.totals = dict.fromkeys(PARTS, 0.0)
    self.programs: list[dict] = []
    self._stack = [["init", self.start_time, 0.0]]  # [part, since, seconds carved out by nested parts]
    self._spans: list[tuple[float, float]] = []  # recorded compile spans (time.time()), to skip nested ones
    self._cache = None  # the persistent cache's verdict for the program being compiled
    self._lock = threading.Lock()
    self._listening = False

  # ---- JAX's monitoring events ----
  def listen(self) -> "Account":
    from jax import monitoring
    monitoring.register_event_time_span_listener(self._on_span)
    monitoring.register_event_listener(self._on_event)
    self._listening = True
    return self

  def close(self) -> None:
    if self._listening:
      from jax import monitoring
      monitoring.unregister_event_time_span_listener(self._on_span)
      monitoring.unregister_event_listener(self._on_event)
      self._listening = False

  def _on_event(self, event: str, **kwargs) -> None:
    if threading.current_thread() is not threading.main_thread():
      return
    if event == "/jax/compilation_cache/compile_requests_use_cache":
      self._cache = "miss"
    elif event == "/jax/compilation_cache/cache_hits":
      self._cache = "hit"

  def _on_span(self, event: str, start: float, end: float, **kwargs) -> None:
    if event not in _COMPILE_SPANS or threading.current_thread() is not threading.main_thread():
      return
    with self._lock:
      inner = [s for s in self._spans if start <= s[0] and s[1] <= end]  # a span inside this one: counted already
      self._spans = [s for s in self._spans if s not in inner][-64:] + [(start, end)]
      seconds = max(0.0, (end - start) - sum(e - s for s, e in inner))
      self.totals["compile"] += seconds
      if self._stack[-1][0] is not None:
        self._stack[-1][2] += seconds
      if event == _BACKEND_COMPILE:
        self.programs.append({"name": str(kwargs.get("fun_name", "?")), "s": round(end - start, 4),
                              "cache": self._cache or "off"})
        self._cache = None

  # ---- parts ----
  def phase(self, name: str | None) -> None:
    """From now, the outermost part is `name` (init -> steps at the loop); None: no part (what follows is
    `other`, e.g. closing files at the end)."""
    assert name is None or name in PARTS, name
    with self._lock:
      now = time.time()
      base = self._stack[0]
      if base[0] is not None:
        self.totals[base[0]] += now - base[1] - base[2]
      self._stack[0] = [name, now, 0.0]

  @contextlib.contextmanager
  def part(self, name: str):
    assert name in PARTS, name
    with self._lock:
      self._stack.append([name, time.time(), 0.0])
    try:
      yield
    finally:
      with self._lock:
        part, since, carved = self._stack.pop()
        elapsed = time.time() - since
        self.totals[part] += elapsed - carved
        self._stack[-1][2] += elapsed

  def snapshot(self) -> dict:
    """The account up to now: every part's seconds (the open ones included), `other` and the wall time."""
    with self._lock:
      now = time.time()
      totals = dict(self.totals)
      inner_elapsed = 0.0
      for part, since, carved in reversed(self._stack):
        elapsed = now - since
        if part is not None:
          totals[part] += elapsed - carved - inner_elapsed
        inner_elapsed = elapsed
      wall = now - self.start_time
      return {"wall_s": wall, "parts": totals, "other_s": wall - sum(totals.values())}

  def line(self) -> str:
    """The one-line account of this process."""
    snap = self.snapshot()
    return "goodput (this process): " + describe(snap["wall_s"], snap["parts"], snap["other_s"], self.programs)


def describe(wall: float, parts: dict, other: float, programs: list[dict], lost: float = 0.0,
             redone: int = 0) -> str:
  productive = parts["steps"] - lost
  hits = [p for p in programs if p["cache"] == "hit"]
  misses = [p for p in programs if p["cache"] != "hit"]
  bits = [f"init {parts['init']:.1f}",
          f"compile {parts['compile']:.1f} ({len(programs)} programs: {len(hits)} cache hits, "
          f"{len(misses)} compiled)",
          f"restore {parts['restore']:.1f}", f"input wait {parts['input_wait']:.1f}",
          f"checkpoint {parts['checkpoint']:.1f}", f"eval {parts['eval']:.1f}"]
  if redone:
    bits.append(f"redone {redone} steps {lost:.1f}")
  bits.append(f"other {other:.1f}")
  return (f"{productive / max(wall, 1e-9):.1%} productive steps ({productive:.1f} s of {wall:.1f} s wall); "
          + ", ".join(bits) + " s")


class Recorder:
  """Writes an Account to the workdir, one file per process start (attempt), rewritten whole (atomically) at each
  record. `checkpoint(step)` notes the loop and step time reached when checkpoint `step` was saved, which is
  what a later resume from that step reads to count the progress lost."""

  def __init__(self, account: Account, workdir, start_step: int, process: int):
    self.account, self.process = account, process
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(account.start_time))
    self.attempt = f"{stamp}.{int(account.start_time * 1000) % 1000:03d}-p{process}"
    self.path = workdir.goodput_record(self.attempt)
    self.start_step, self.step = start_step, start_step
    self.checkpoints: dict[str, dict] = {}
    self.loop_start: float | None = None

  def loop_started(self) -> None:
    self.account.phase("steps")
    self.loop_start = time.time()

  def loop_ended(self) -> None:
    self.account.phase(None)

  def _clock(self) -> dict:
    snap = self.account.snapshot()
    return {"loop_s": time.time() - self.loop_start if self.loop_start else 0.0, "steps_s": snap["parts"]["steps"]}

  def checkpoint(self, step: int) -> None:
    self.checkpoints[str(step)] = self._clock()

  def row(self, step: int, ended: str | None = None) -> dict:
    self.step = step
    snap = self.account.snapshot()
    return {"attempt": self.attempt, "process": self.process, "start_time": self.account.start_time,
            "time": time.time(), "start_step": self.start_step, "step": step, **snap, **self._clock(),
            "programs": self.account.programs, "checkpoints": self.checkpoints, "ended": ended}

  def write(self, step: int, ended: str | None = None) -> None:
    from hnclip_jax import paths, storage
    try:
      paths.makedirs(paths.dirname(self.path))
      storage.write_text_atomic(self.path, json.dumps(self.row(step, ended)))
    except OSError as e:
      raise storage.StorageError(f"writing the goodput record of step {step} to {self.path} failed "
                                 f"({storage.describe(e)})") from e

  def write_quietly(self, step: int, ended: str) -> None:
    """On the way out of a failed run: never raises over the error that ended it."""
    try:
      self.write(step, ended)
    except Exception:  # noqa: BLE001
      pass

  def scalars(self) -> dict:
    """For metrics.jsonl / TensorBoard: cumulative seconds per part and the productive share of this process."""
    snap = self.account.snapshot()
    out = {f"goodput/{k}_s": v for k, v in snap["parts"].items()}
    out.update({"goodput/other_s": snap["other_s"], "goodput/wall_s": snap["wall_s"],
                "goodput/productive_frac": snap["parts"]["steps"] / max(snap["wall_s"], 1e-9)})
    return out


def lost_after(a: dict, resumed_at: int | None) -> dict:
  """What attempt `a` ran past step `resumed_at` (where the next start resumed): the steps, and the loop time and
  step time they had cost, from the clock `a` recorded when it saved that checkpoint (none: a resume from where
  `a` started, or from before — then all of its loop is lost)."""
  if resumed_at is None or a["step"] <= resumed_at:
    return {"redone_steps": 0, "lost_loop_s": 0.0, "lost_steps_s": 0.0}
  at = a["checkpoints"].get(str(resumed_at), {"loop_s": 0.0, "steps_s": 0.0})
  return {"redone_steps": a["step"] - resumed_at, "lost_loop_s": max(0.0, a["loop_s"] - at["loop_s"]),
          "lost_steps_s": max(0.0, a["steps_s"] - at["steps_s"])}


def redone_note(rows: list[dict], start_step: int, process: int) -> str | None:
  """At a resume: the line saying which steps the previous start of this process ran past `start_step` (redone
  now) and what they had cost; None when nothing is redone."""
  earlier = sorted((r for r in rows if r.get("process") == process), key=lambda r: r["start_time"])
  if not earlier:
    return None
  prev = earlier[-1]
  lost = lost_after(prev, start_step)
  if not lost["redone_steps"]:
    return None
  return (f"goodput: the previous start ({time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(prev['start_time']))} "
          f"UTC, {prev.get('ended') or 'killed'}) had recorded step {prev['step']}; steps {start_step + 1}-"
          f"{prev['step']} are redone from checkpoint {start_step} (they had cost {lost['lost_loop_s']:.1f} s of "
          "its training loop)")


def summarize(rows: list[dict], process: int = 0) -> dict:
  """A whole run's account from its records (Workdir.goodput_records) for one process, in start order;
  for each attempt followed by a resume, the steps it ran past the checkpoint the next one started from, and
  the loop time and step time they had cost (progress lost)."""
  attempts = sorted((r for r in rows if r.get("process") == process), key=lambda r: r["start_time"])
  out_attempts = []
  for i, a in enumerate(attempts):
    out_attempts.append({**a, **lost_after(a, attempts[i + 1]["start_step"] if i + 1 < len(attempts) else None)})
  parts = {k: sum(a["parts"][k] for a in out_attempts) for k in PARTS}
  return {"attempts": out_attempts, "wall_s": sum(a["wall_s"] for a in out_attempts), "parts": parts,
          "other_s": sum(a["other_s"] for a in out_attempts),
          "programs": [p for a in out_attempts for p in a["programs"]],
          "redone_steps": sum(a["redone_steps"] for a in out_attempts),
          "lost_loop_s": sum(a["lost_loop_s"] for a in out_attempts),
          "lost_steps_s": sum(a["lost_steps_s"] for a in out_attempts)}


def run_line(summary: dict) -> str:
  n = len(summary["attempts"])
  return (f"goodput (whole run, {n} process start{'s' if n != 1 else ''}): " +
          describe(summary["wall_s"], summary["parts"], summary["other_s"], summary["programs"],
                   summary["lost_steps_s"], summary["redone_steps"]))


def report(summary: dict) -> str:
  """A table of a run's attempts and its totals (tools/goodput)."""
  head = ("start (UTC)", "steps", "wall s", *[f"{k} s" for k in PARTS], "other s", "redone", "lost s", "ended")
  lines = [" | ".join(head), " | ".join("---" for _ in head)]
  for a in summary["attempts"]:
    lines.append(" | ".join([
        time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(a["start_time"])), f"{a['start_step']}->{a['step']}",
        f"{a['wall_s']:.1f}", *[f"{a['parts'][k]:.1f}" for k in PARTS], f"{a['other_s']:.1f}",
        str(a["redone_steps"]), f"{a['lost_loop_s']:.1f}", a.get("ended") or "killed (no end record)"]))
  return "\n".join(lines + ["", run_line(summary)])


def to_json(summary: dict) -> str:
  return json.dumps(summary, indent=2)
