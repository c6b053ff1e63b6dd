"""Writing a workdir when the file system misbehaves (full, read-only, flaky): appended JSON-lines logs that a
cut-off write cannot break, write checks that fail fast with one line, and library tracebacks kept in a debug log.

    append_jsonl(path, row)      one line, all or nothing: a failed write takes its partial line back
    read_jsonl(path)             -> (rows, torn): lines that do not parse (a line cut off by a full disk or a kill)
                                  are returned apart, never raised
    check_writable(dir, what)    creates `dir` and a probe file in it; StorageError naming it if it cannot
    describe(err)                'No space left on device (ENOSPC): /w/metrics.jsonl' for any OSError
    DebugLog                     library log records and thread tracebacks -> WORKDIR/debug.log, not the console
"""
from __future__ import annotations

import json
import logging as std_logging
import os
import sys
import tempfile
import threading
import traceback

from hnclip_jax import paths, stores



class StorageError(RuntimeError):
  """A file of the run could not be written or read; the message names it, the step and what to do."""


def describe(err: BaseException) -> str:
  """One line for an OSError (its errno name, message and file) or any other exception (its first line)."""
  return stores.describe_os_error(err)


def append_jsonl(path: str, row: dict) -> None:
  """Appends `row` as one JSON line (paths.append_line: a failed write leaves the file a list of whole lines)."""
  paths.append_line(path, (json.dumps(row) + "\n").encode())


def write_text_atomic(path: str, text: str) -> None:
  """A reader sees the old file or the new one, never half of one (a failed write leaves no temp file)."""
  paths.write_text(path, text)


def read_jsonl(path: str) -> tuple[list[dict], list[tuple[int, str]]]:
  """-> (rows, torn): every line that is a JSON object, and (line number, text) of those that are not (a line cut
  off by a full disk or a kill). A missing file is empty."""
  rows, torn = [], []
  if not paths.exists(path):
    return rows, torn
  for i, raw in enumerate(paths.read_bytes(path).splitlines(), 1):
    text = raw.decode("utf-8", errors="replace").strip()
    if not text:
      continue
    try:
      row = json.loads(text)
    except ValueError:
      row = None
    if isinstance(row, dict):
      rows.append(row)
    else:
      torn.append((i, text))
  return rows, torn


def torn_warning(path: str, torn: list[tuple[int, str]]) -> str:
  lines = ", ".join(str(i) for i, _ in torn[:5]) + (" ..." if len(torn) > 5 else "")
  return (f"WARNING: {path}: set aside {len(torn)} line(s) that are not whole JSON rows (line {lines}: "
          f"{torn[0][1][:80]!r}); a write was cut off (full disk or kill)")


def check_writable(directory: str, what: str) -> None:
  """Creates `directory` if needed and a probe file in it; StorageError naming `what` if either fails."""
  try:
    paths.check_writable(directory)
  except Exception as e:  # noqa: BLE001 (a bucket's client raises its own errors)
    if not isinstance(e, OSError) and paths.opens_natively(directory):
      raise
    raise StorageError(f"{what} {directory} cannot be written ({paths.describe_error(directory, e)}); make it "
                       "writable (or free space) or choose another directory. Nothing was changed") from e


class _ConsoleFilter(std_logging.Filter):
  """Keeps library tracebacks and multi-line records off the console (they go to the debug log)."""

  def filter(self, record):
    return not (record.exc_info or "\n" in str(record.msg) or record.levelno >= std_logging.ERROR
                and "hnclip_jax" not in (record.pathname or ""))


class _FileHandler(std_logging.StreamHandler):
  def handleError(self, record):  # the disk that failed the run may fail the log too: never print about it
    pass


class _ThreadOutput:
  """sys.stderr while a DebugLog is active: the main thread writes to the console; other threads (library
  callbacks printing tracebacks from C++ threads, e.g. after a failed background write) to the debug log."""

  def __init__(self, console, log):
    self._console, self._log = console, log

  def write(self, text):
    if threading.current_thread() is threading.main_thread():
      return self._console.write(text)
    self._log.write(text, newline=False)
    return len(text)

  def flush(self):
    self._console.flush()

  def __getattr__(self, name):
    return getattr(self._console, name)


class _LazyFile:
  """A file opened at its first write (a run that logs nothing leaves none); in the temp directory when `path`
  cannot be written."""

  def __init__(self, path: str):
    self.path, self._f = path, None

  def write(self, text: str) -> None:
    if self._f is None:
      try:
        if not paths.opens_natively(self.path):  # a bucket has no appends: the debug log stays on this host
          raise OSError("not a local file")
        self._f = open(self.path, "a")
      except OSError:
        fd, self.path = tempfile.mkstemp(prefix="hnclip_jax-debug-", suffix=".log")
        self._f = os.fdopen(fd, "a")
    self._f.write(text)
    self._f.flush()

  def flush(self) -> None:
    pass

  def close(self) -> None:
    if self._f is not None:
      self._f.close()


class DebugLog:
  """While active: warnings and errors of every library (with their tracebacks) and uncaught exceptions of
  background threads go to the file `path` (a workdir's debug.log: Workdir.debug_log; created at the first
  record, in the temp directory when it cannot be written); the console keeps one-line warnings and this package's
  own messages. `path` is where the records go."""

  def __init__(self, path: str):
    self._file = _LazyFile(path)
    self.records = 0
    self.last_error = None  # first line of the latest ERROR record: the cause a later one-line error can quote
    self._handler = _FileHandler(self._file)
    self._handler.setLevel(std_logging.WARNING)
    self._handler.setFormatter(std_logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    self._handler.addFilter(self._count)
    std_logging.getLogger().addHandler(self._handler)
    self._filter = _ConsoleFilter()
    from absl import logging as absl_logging
    self._console = absl_logging.get_absl_handler()
    self._console.addFilter(self._filter)
    self._previous_hook = threading.excepthook
    threading.excepthook = self._thread_exception
    self._stderr = sys.stderr
    sys.stderr = _ThreadOutput(sys.stderr, self)
    std_logging.captureWarnings(True)  # Python warnings become log records: one-line ones still reach the console

  @property
  def path(self) -> str:
    return self._file.path

  def _count(self, record) -> bool:
    self.records += 1
    if record.levelno >= std_logging.ERROR:
      try:
        msg = record.getMessage()
      except Exception:  # noqa: BLE001
        msg = str(record.msg)
      lines = [line for line in msg.splitlines() if line.strip()]
      if lines:  # Orbax words the cause last: "... raised an exception: RESOURCE_EXHAUSTED: ... No space left"
        self.last_error = lines[0].split("raised an exception: ")[-1][:500]
    return True

  def _thread_exception(self, args) -> None:
    if args.exc_type is SystemExit:
      return
    name = args.thread.name if args.thread is not None else "?"
    self.write(f"exception in thread {name}:\n" +
               "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))

  def write(self, text: str, newline: bool = True) -> None:
    try:
      self._file.write(text.rstrip("\n") + "\n" if newline else text)
      self.records += 1
    except (OSError, ValueError):  # the disk that failed the run may fail this too; the console has the error
      pass

  def exception(self, err: BaseException) -> None:
    self.write("".join(traceback.format_exception(type(err), err, err.__traceback__)))

  def close(self) -> None:
    std_logging.captureWarnings(False)
    sys.stderr = self._stderr
    std_logging.getLogger().removeHandler(self._handler)
    self._console.removeFilter(self._filter)
    threading.excepthook = self._previous_hook
    try:
      self._file.close()
    except OSError:
      pass


_active: DebugLog | None = None


def start_debug_log(path: str) -> DebugLog:
  """Starts (once per process) the debug log of an entry point's workdir (its Workdir.debug_log)."""
  global _active
  if _active is None:
    _active = DebugLog(path)
  return _active


def active_debug_log() -> DebugLog | None:
  return _active


def stop_debug_log() -> None:
  """Ends the process's debug log (an entry point run in-process, as the tests do, ends it on the way out)."""
  global _active
  if _active is not None:
    _active.close()
    _active = None


def print_error(msg: str) -> None:
  """The one `error:` console line of a failed run, the last line on stderr, pointing at the debug log when library
  details went there. A message's further lines (instructions: how to lay out hand-downloaded data) go above it."""
  first, _, more = msg.partition("\n")
  if more.strip():
    print(more.rstrip(), file=sys.stderr)
  log = _active
  extra = f" (details: {log.path})" if log is not None and log.records else ""
  print(f"error: {first}{extra}", file=sys.stderr, flush=True)
