"""Every directory a user gives may be a local path or a bucket URL (`gs://BUCKET/PATH`): the one API the package
resolves, lists, reads, writes and removes a run's files with. Each call goes to the path's store
(`hnclip_jax.stores`: the contract, with a module per backend — local.py, gcs.py); nothing outside this layer
(paths.py, storage.py, stores/) asks which store a path is on.

    resolve(p, flag)      a local path made absolute, or a URL checked (a store opens its scheme); ValueError naming
                          `flag`
    join, basename, dirname, is_root, exists, isdir, isfile, listdir, makedirs, read_text, read_bytes, open_read,
    write_text, write_bytes, remove, rmtree, move, files
    write_text(p, s)      atomic: a reader sees the old file or the new one
    local_copy(dir)       a context manager: a local directory holding `dir`'s files (for libraries that only read
                          local files, e.g. a tokenizer)
    staged_dir(dir)       a context manager: a local directory whose files end up in `dir`
    upload_tree(src, dst) a local directory's files copied to `dst`
    opens_natively(p)     whether libraries with their own file API (TFDS, tokenizers, PyTorch) can open `p`
    watched(fn, p, what)  a long library call on `p` that ends soon after the store stops answering
"""
from __future__ import annotations

from hnclip_jax import stores
Unreachable = stores.Unreachable  # raised by a store that stops answering (after its quick retries)


def resolve(path: str, flag: str = "path") -> str:
  """A local path made absolute (with ~ expanded), or a URL checked: ValueError naming `flag` for a scheme no store
  opens, or a URL its store refuses (no bucket, no credentials)."""
  try:
    store = stores.of(path)
  except ValueError:
    urls = " or ".join(f"{s}://BUCKET/PATH" for s in stores.schemes())
    raise ValueError(f"{flag}={path}: nothing here opens {stores.scheme(path)}:// URLs; use a local path or "
                     f"{urls}") from None
  return store.resolve(str(path), flag)


def is_root(path: str) -> bool:
  """Whether a resolved path is the top of its store: a bucket's root (gs://BUCKET) or the file system's (/)."""
  return stores.of(path).is_root(str(path))


def root(path: str) -> str:
  """The top of `path`'s store: its bucket (gs://BUCKET), or the file system's root."""
  return stores.of(path).root(str(path))


def describe_error(path: str, err: BaseException) -> str:
  """One line for a failed operation on `path` (for a bucket: no such bucket, not authenticated, not allowed, not
  answering) and what to do."""
  return stores.of(path).describe_error(str(path), err)


def recovery(path: str) -> str:
  """What to do once a write to `path` failed for a reason outside the run, as the start of a sentence that ends
  "rerun the same command to resume"."""
  return stores.of(path).recovery


def opens_natively(path: str) -> bool:
  """Whether libraries that open files with their own file API (TFDS's manual folders, tokenizers, PyTorch) can
  open `path`; when not, this layer hands them a local copy (local_copy, staged_dir)."""
  return stores.of(path).native


def prepare(path: str) -> None:
  """Readies `path`'s store for a library that opens the path itself (JAX's compilation cache, Orbax, array_record):
  once per process, before it first does."""
  stores.of(path).configure()


def join(base, *parts) -> str:
  return stores.of(base).join(str(base), *parts)


def basename(path) -> str:
  return stores.of(path).basename(str(path))


def dirname(path) -> str:
  return stores.of(path).dirname(str(path))


def exists(path) -> bool:
  """Whether a file or directory is there; an error other than "not found" (a bucket that does not answer) is
  raised, never taken for False."""
  return stores.of(path).exists(str(path))


def isdir(path) -> bool:
  return stores.of(path).isdir(str(path))


def isfile(path) -> bool:
  return exists(path) and not isdir(path)


def listdir(path) -> list[str]:
  """Names (not paths) in a directory; [] when it does not exist."""
  return stores.of(path).listdir(str(path))


def makedirs(path) -> None:
  """Creates the directory (a bucket has none: a prefix exists once an object is under it)."""
  stores.of(path).makedirs(str(path))


def read_bytes(path) -> bytes:
  return stores.of(path).read_bytes(str(path))


def read_text(path) -> str:
  return read_bytes(path).decode("utf-8")


def open_read(path, block_size: int = 16 << 20):
  """A binary file object reading `path` (a bucket object streamed in blocks of `block_size`)."""
  return stores.of(path).open_read(str(path), block_size)


def files(directory: str) -> list[dict]:
  """Every file under `directory`: {"path", "rel" (relative, with "/"), "size", "md5" (base64, None when the store
  has none), "generation" (a version id)}, sorted by rel."""
  return stores.of(directory).files(str(directory))


def write_bytes(path, data: bytes) -> None:
  """Atomic: a reader sees the old file or the new one, never half of one (a failed write leaves no temp file)."""
  stores.of(path).write_bytes(str(path), data)


def write_text(path, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def append_line(path, line: bytes) -> None:
  """`line` (ending in a newline) added at the end of `path`, on a line of its own after a torn last line; a
  failed append leaves the file as it was (a bucket object is rewritten whole: GCS shows it whole or not)."""
  stores.of(path).append_line(str(path), line)


def truncate(path, size: int) -> bool:
  """Cuts `path` to `size` bytes in place (no space needed): True, or False when its store cannot."""
  return stores.of(path).truncate(str(path), size)


def replace_dir(final: str, write) -> None:
  """`final` replaced by the directory `write(path)` fills, only once it is complete: a reader sees the old one or
  the new one (on a store without renames `write` must write the file marking it complete last)."""
  stores.of(final).replace_dir(str(final), write)


def check_writable(directory: str) -> None:
  """Creates `directory` if needed and a probe file in it (removed again); raises what failed."""
  stores.of(directory).check_writable(str(directory))


def free_bytes(directory: str) -> int | None:
  """Space left under `directory`; None when its store has no such limit (a bucket) or cannot say."""
  return stores.of(directory).free_bytes(str(directory))


def lease(path: str):
  """This process's single-writer guard on `path` (stores.Lease: `lost`, `release()`); stores.Held when another
  live holder has it."""
  return stores.of(path).lease(str(path))


def remove(path) -> None:
  stores.of(path).remove(str(path))


def rmtree(path) -> None:
  """Removes a directory and everything under it; nothing when it does not exist."""
  stores.of(path).rmtree(str(path))


def move(src, dst) -> None:
  """A rename on a local disk; on a bucket a copy of every object then their removal (not atomic)."""
  stores.of(src).move(str(src), str(dst))


def upload_tree(src: str, dst: str, last: tuple[str, ...] = ()) -> None:
  """Copies the files under local directory `src` to `dst`, keeping relative paths; files named in `last` go after
  all others (a marker a reader takes as "complete"). Each file is streamed, never read into memory whole."""
  stores.of(dst).upload_tree(src, str(dst), last)


def local_copy(directory: str):
  """A context manager: a local directory holding `directory`'s files (itself when the store is local)."""
  return stores.of(directory).local_copy(str(directory))


def staged_dir(directory: str):
  """A context manager: a local directory whose files end up in `directory` (itself when local; else a temp
  directory uploaded when the block ends without an exception)."""
  return stores.of(directory).staged_dir(str(directory))


def watched(fn, path, what: str):
  """fn() — a long library call that reads or writes `path` — with the store watched while it runs: Unreachable
  naming `what` soon after the store stops answering, instead of the library's own retries for many minutes. The
  abandoned call keeps a daemon thread; a process that gets this error should end (cli.clean_errors does)."""
  return stores.of(path).watched(fn, str(path), what)
