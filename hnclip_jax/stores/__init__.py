"""Where a path's files live: a local file system, or an object store (gs://). `Store` is the contract — every
operation a run needs from its storage, defined once; `local.py` and `gcs.py` implement it, each in its own module,
and `of(path)` picks the one a path belongs to by its URL scheme (the only place a scheme is looked at). The rest of
the package calls `hnclip_jax.paths` / `hnclip_jax.storage`, which hand each call to the path's store.

Adding a backend (docs/buckets.md, "Another store"): a module with a `Store` subclass that implements every
method below not marked optional, and one `register(TheStore())` call at the end of this file.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile


class Unreachable(ConnectionError):
  """The storage server does not answer (refused, or its name does not resolve), past a store's quick retries."""


class Held(Exception):
  """A lease another live holder has: `holder` {"host", "pid", ...} and `detail`, the store's own words on when or
  how it ends (e.g. "renewed 12 s ago; ... expires in 108 s or delete PATH")."""

  def __init__(self, holder: dict, detail: str):
    super().__init__(detail)
    self.holder, self.detail = holder, detail


class Lease:
  """A single-writer guard on one path, held until `release()`. `lost`: None while it is this process's, else the
  holder that took it over (a store whose guard can be taken from a stalled holder sets it)."""
  lost: dict | None = None

  def release(self) -> None:
    raise NotImplementedError


class Store:
  """The operations on one kind of storage. `path` arguments are resolved paths of this store."""
  schemes: tuple[str, ...] = ()  # the URL schemes it opens; () for plain (local) paths
  # Whether libraries that open files by themselves (TFDS's manual folders, tokenizers, PyTorch) can open its paths;
  # when False the layer hands them a local copy (local_copy / staged_dir) and the data is staged (data/staging.py).
  native = True
  # What a user does once a write here failed for a reason outside the run (words that end a sentence).
  recovery = "Free space or fix the directory, then"

  # ---- names ----
  def resolve(self, path: str, flag: str) -> str:
    """The canonical form of `path`; ValueError naming `flag` when it cannot be used."""
    raise NotImplementedError

  def is_root(self, path: str) -> bool:
    """Whether `path` is the top of its store (a bucket, the file system's root)."""
    raise NotImplementedError

  def root(self, path: str) -> str:
    """The top of the store `path` is in (its bucket; the file system's root)."""
    raise NotImplementedError

  def join(self, base: str, *parts) -> str:
    return "/".join([str(base).rstrip("/"), *(str(p).strip("/") for p in parts)])

  def basename(self, path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]

  def dirname(self, path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[0]

  # ---- reading ----
  def exists(self, path: str) -> bool:
    """Whether a file or directory is there; an error other than "not found" is raised, never taken for False."""
    raise NotImplementedError

  def isdir(self, path: str) -> bool:
    raise NotImplementedError

  def listdir(self, path: str) -> list[str]:
    """Names (not paths) in directory `path`; [] when it does not exist."""
    raise NotImplementedError

  def read_bytes(self, path: str) -> bytes:
    raise NotImplementedError

  def open_read(self, path: str, block_size: int):
    """A binary file object reading `path`, streamed in blocks."""
    raise NotImplementedError

  def files(self, directory: str) -> list[dict]:
    """Every file under `directory`: {"path", "rel" (with "/"), "size", "md5" (the store's base64 MD5, or None),
    "generation" (a version id, or "")}, sorted by rel."""
    raise NotImplementedError

  # ---- writing ----
  def makedirs(self, path: str) -> None:
    raise NotImplementedError

  def write_bytes(self, path: str, data: bytes) -> None:
    """Atomic: a reader sees the old file or the new one, never half of one."""
    raise NotImplementedError

  def append_line(self, path: str, line: bytes) -> None:
    """`line` (ending in a newline) added at the end of the file, created if absent — on a line of its own after a
    torn last line; a failed append leaves the file as it was (an object store rewrites the object whole)."""
    raise NotImplementedError

  def truncate(self, path: str, size: int) -> bool:
    """Cuts the file to `size` bytes in place (no space needed) and returns True; False when the store cannot (the
    caller rewrites the file whole)."""
    return False

  def put_file(self, local: str, path: str) -> None:
    """Local file `local` copied to `path`, streamed (never read into memory whole); whole or not at all."""
    raise NotImplementedError

  def remove(self, path: str) -> None:
    raise NotImplementedError

  def rmtree(self, path: str) -> None:
    """A directory and everything under it removed; nothing when it is not there."""
    raise NotImplementedError

  def move(self, src: str, dst: str) -> None:
    raise NotImplementedError

  def replace_dir(self, final: str, write) -> None:
    """`final` replaced by the directory `write(path)` fills, only once it is complete: a reader sees the old one
    or the new one (a store without renames: `write` writes its completion marker last)."""
    raise NotImplementedError

  def check_writable(self, directory: str) -> None:
    """Creates `directory` if needed and a probe file in it (removed again); raises what failed."""
    raise NotImplementedError

  def free_bytes(self, directory: str) -> int | None:
    """Space left for writing under `directory`; None when the store has no such limit (or cannot say)."""
    return None

  def lease(self, path: str) -> Lease:
    """This process's single-writer guard on `path`: Held when another live holder has it."""
    raise NotImplementedError

  # ---- library access (optional) ----
  def configure(self) -> None:
    """Once per process, before a library (JAX's compilation cache, Orbax, array_record) opens one of its paths."""

  def watched(self, fn, path: str, what: str):
    """fn() — a long library call on `path` — with the store watched: Unreachable naming `what` soon after the
    store stops answering, instead of the library's own retries."""
    return fn()

  def describe_error(self, path: str, err: BaseException) -> str:
    """One line for a failed operation on `path`: what is wrong and what to do."""
    return describe_os_error(err)

  @contextlib.contextmanager
  def local_copy(self, directory: str):
    """A local directory holding `directory`'s files (a temp copy for a store that is not native)."""
    with tempfile.TemporaryDirectory(prefix="hnclip_jax-") as tmp:
      for f in self.files(directory):
        local = os.path.join(tmp, *f["rel"].split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with self.open_read(f["path"], 16 << 20) as src, open(local, "wb") as out:
          shutil.copyfileobj(src, out, 16 << 20)  # streamed: a weights directory holds GB files
      yield tmp

  @contextlib.contextmanager
  def staged_dir(self, directory: str):
    """A local directory whose files end up in `directory` when the block ends without an exception."""
    with tempfile.TemporaryDirectory(prefix="hnclip_jax-") as tmp:
      yield tmp
      self.upload_tree(tmp, directory)

  def upload_tree(self, src: str, dst: str, last: tuple[str, ...] = ()) -> None:
    """The files under local directory `src` copied to `dst`, keeping relative paths, each streamed (put_file);
    files named in `last` go after all others (a marker a reader takes as "complete")."""
    files = sorted((os.path.relpath(os.path.join(root, f), src) for root, _, names in os.walk(src) for f in names),
                   key=lambda rel: (os.path.basename(rel) in last, rel))
    for rel in files:
      self.put_file(os.path.join(src, rel), self.join(dst, *rel.split(os.sep)))


def describe_os_error(err: BaseException) -> str:
  """One line for an OSError (its errno name, message and file) or any other exception (its first line)."""
  if isinstance(err, OSError) and err.errno is not None:
    name = errno.errorcode.get(err.errno, str(err.errno))
    where = f": {err.filename}" if err.filename else ""
    return f"{err.strerror or os.strerror(err.errno)} ({name}){where}"
  first = str(err).strip().splitlines()[0] if str(err).strip() else ""
  return f"{type(err).__name__}: {first[:400]}"


_STORES: dict[str, Store] = {}


def register(store: Store) -> None:
  """Makes `store` the one for its schemes (a plain path's store registers no scheme: the key "")."""
  for s in store.schemes or ("",):
    _STORES[s] = store


def scheme(path) -> str:
  """"gs" for "gs://bucket/x"; "" for a plain path."""
  return str(path).split("://", 1)[0] if "://" in str(path) else ""


def of(path) -> Store:
  """The store `path` lives on; ValueError for a URL scheme no store opens."""
  s = scheme(path)
  if s not in _STORES:
    urls = " or ".join(f"{x}://BUCKET/PATH" for x in sorted(_STORES) if x)
    raise ValueError(f"{path}: nothing here opens {s}:// URLs; use a local path or {urls}")
  return _STORES[s]


def schemes() -> list[str]:
  return sorted(s for s in _STORES if s)


from hnclip_jax.stores import gcs, local  # noqa: E402 — the built-in stores, registered here

register(local.LocalStore())
register(gcs.GCSStore())
