"""The local file system (and anything mounted into it): plain paths."""
from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile

from hnclip_jax.stores import Held, Lease, Store


class _FileLock(Lease):
  """An exclusive flock on a file holding the holder's pid: the OS releases it when the process ends, even by
  SIGKILL, so a lease left by a killed run never blocks the next one."""

  def __init__(self, path: str):
    self.path, self.lost = path, None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      owner = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
      os.close(fd)
      raise Held({"pid": owner}, f"is already running (it holds {path}); wait for it to finish") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    self._fd = fd

  def release(self) -> None:
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None


class LocalStore(Store):
  schemes = ()
  native = True
  recovery = "Free space or fix the directory, then"

  def resolve(self, path: str, flag: str) -> str:
    return os.path.abspath(os.path.expanduser(str(path)))

  def is_root(self, path: str) -> bool:
    return os.path.dirname(str(path)) == str(path)

  def root(self, path: str) -> str:
    return os.path.abspath(os.sep)

  def join(self, base, *parts) -> str:
    return os.path.join(str(base), *map(str, parts))

  def basename(self, path) -> str:
    return os.path.basename(str(path))

  def dirname(self, path) -> str:
    return os.path.dirname(str(path))

  def exists(self, path) -> bool:
    return os.path.exists(path)

  def isdir(self, path) -> bool:
    return os.path.isdir(path)

  def listdir(self, path) -> list[str]:
    try:
      return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
      return []

  def read_bytes(self, path) -> bytes:
    with open(path, "rb") as f:
      return f.read()

  def open_read(self, path, block_size: int):
    return open(path, "rb")

  def files(self, directory: str) -> list[dict]:
    out = []
    for root, _, names in os.walk(directory):
      for name in names:
        full = os.path.join(root, name)
        digest = hashlib.md5()
        with open(full, "rb") as f:
          for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        out.append({"path": full, "rel": os.path.relpath(full, directory).replace(os.sep, "/"),
                    "size": os.path.getsize(full), "md5": base64.b64encode(digest.digest()).decode(),
                    "generation": str(os.stat(full).st_mtime_ns)})
    return sorted(out, key=lambda o: o["rel"])

  def makedirs(self, path) -> None:
    os.makedirs(path, exist_ok=True)

  def write_bytes(self, path, data: bytes) -> None:
    """A temp file beside `path`, renamed over it (a failed write leaves no temp file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
      with open(tmp, "wb") as f:
        f.write(data)
      os.replace(tmp, path)
    except OSError:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise

  def append_line(self, path, line: bytes) -> None:
    """O_APPEND; after a torn last line the new one starts on a line of its own; a write cut short (a full disk)
    is cut off again before the OSError propagates."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      size = os.fstat(fd).st_size
      if size and os.pread(fd, 1, size - 1) != b"\n":
        line = b"\n" + line
      try:
        view = memoryview(line)
        while view:
          view = view[os.write(fd, view):]
      except OSError:
        with contextlib.suppress(OSError):
          os.ftruncate(fd, size)  # shrinking needs no space
        raise
    finally:
      os.close(fd)

  def truncate(self, path, size: int) -> bool:
    os.truncate(path, size)
    return True

  def put_file(self, local: str, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
      shutil.copyfile(local, tmp)
      os.replace(tmp, path)
    except OSError:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise

  def remove(self, path) -> None:
    os.remove(path)

  def rmtree(self, path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
    elif os.path.lexists(path):
      os.remove(path)

  def move(self, src, dst) -> None:
    os.replace(src, dst)

  def replace_dir(self, final: str, write) -> None:
    """Filled beside it (`final`.tmp) and renamed over it; the old one kept as `final`.old until then."""
    tmp, old = final + ".tmp", final + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
      os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)

  def check_writable(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
    try:
      os.write(fd, b"x")
    finally:
      os.close(fd)
      os.remove(probe)
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):  # root may write where the owner's bits say no
      raise PermissionError(errno.EACCES, "not readable and writable by this user", directory)

  def free_bytes(self, directory: str) -> int | None:
    try:
      st = os.statvfs(directory)
    except OSError:
      return None
    return st.f_bavail * st.f_frsize

  def lease(self, path: str) -> Lease:
    return _FileLock(path)

  @contextlib.contextmanager
  def local_copy(self, directory: str):
    yield directory

  @contextlib.contextmanager
  def staged_dir(self, directory: str):
    os.makedirs(directory, exist_ok=True)
    yield directory
