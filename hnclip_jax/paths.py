"""Every directory a user gives may be a local path or a bucket URL (`gs://BUCKET/PATH`): the one place that
resolves, lists, reads, writes and removes a run's files, on etils `epath` (what Orbax uses; `gs://` through gcsfs).

    resolve(p, flag)      a local path made absolute, or a URL checked (its scheme known); ValueError naming `flag`
    is_url(p)             True for 'gs://…'
    join, exists, isdir, listdir, makedirs, read_text, read_bytes, write_text, write_bytes, remove, rmtree
    write_text(p, s)      atomic: a reader sees the old file or the new one (local: temp file + rename; a bucket:
                          one object upload, which GCS makes visible whole or not at all)
    local_copy(dir)       a context manager: a bucket directory's files in a local temp directory (for libraries
                          that only read local files, e.g. a tokenizer); a local directory as is
    upload_tree(src, dst) a local directory's files copied to `dst`

An object store has no append and no rename; what the run writes there is designed for that (storage.py,
preemption.py, metrics.py): a log is rewritten whole as one object, the single-writer guard is a lease object
created with a generation precondition, and which checkpoints are complete is Orbax's commit marker.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import threading

from etils import epath

# The URL schemes this package writes to. gs:// is what Cloud TPU pods and the GCS emulator use; anything else is
# refused up front rather than becoming a local directory named after the URL.
SCHEMES = ("gs",)


def is_url(path) -> bool:
  return "://" in str(path)


def scheme(path) -> str:
  return str(path).split("://", 1)[0] if is_url(path) else ""


def resolve(path: str, flag: str = "path") -> str:
  """A local path made absolute (with ~ expanded), or a URL checked: ValueError naming `flag` for an unknown
  scheme or a URL without a bucket."""
  path = str(path)
  if not is_url(path):
    return os.path.abspath(os.path.expanduser(path))
  s = scheme(path)
  if s not in SCHEMES:
    raise ValueError(f"{flag}={path}: nothing here opens {s}:// URLs; use a local path or "
                     f"{' or '.join(x + '://BUCKET/PATH' for x in SCHEMES)}")
  rest = path.split("://", 1)[1].strip("/")
  if not rest:
    raise ValueError(f"{flag}={path} names no bucket; use gs://BUCKET/PATH")
  # Outside an emulator a bucket path needs credentials: an anonymous client can write no workdir, and finding
  # that out from the server takes gcsfs ~15 s of bucket-type probing and then an unhelpful error.
  problem = credentials_problem()
  if problem is not None:
    raise ValueError(f"{flag}={path}: {describe_error(path, problem)}")
  return f"{s}://{rest}"


def is_root(path: str) -> bool:
  """Whether a resolved path is the top of its store: a bucket's root (gs://BUCKET) or the file system's (/)."""
  path = str(path)
  if is_url(path):
    return "/" not in path.split("://", 1)[1].strip("/")
  return os.path.dirname(path) == path


def bucket(path: str) -> str:
  return str(path).split("://", 1)[1].split("/", 1)[0] if is_url(path) else ""


def describe_error(path: str, err: BaseException) -> str:
  """One line for a failed bucket operation: what is wrong (no such bucket, not authenticated, not allowed) and
  what to do. Never the request's headers or a token: only the error's type and its first line."""
  b, text = bucket(path), str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
  if is_url(path) and not isinstance(err, FileNotFoundError) and credentials_problem() is not None:
    err, text = credentials_problem(), "no Application Default Credentials found"
  low = f"{type(err).__name__} {text}".lower()
  if isinstance(err, FileNotFoundError) or "404" in low or "not found" in low and "credential" not in low:
    return (f"bucket gs://{b} does not exist (or the object path is wrong); create it next to the TPUs "
            f"(gcloud storage buckets create gs://{b} --location=REGION) or fix the URL")
  if any(k in low for k in ("credential", "401", "unauthenticated", "refresh", "auth")):
    return (f"no usable Google Cloud credentials for gs://{b} ({type(err).__name__}); run `gcloud auth "
            "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or on a "
            "TPU / GCE VM give its service account access to the bucket")
  if "403" in low or "permission" in low or "forbidden" in low:
    return (f"this account may not write gs://{b} ({type(err).__name__}); grant it roles/storage.objectAdmin on "
            "the bucket or use another one")
  if "connect" in low or "name or service not known" in low or "timeout" in low:
    return (f"Cloud Storage cannot be reached for gs://{b} ({type(err).__name__}: {text}); check the network (or "
            "STORAGE_EMULATOR_HOST for an emulator)")
  return f"{type(err).__name__}: {text}"


def join(base, *parts) -> str:
  if is_url(base):
    return "/".join([str(base).rstrip("/"), *(str(p).strip("/") for p in parts)])
  return os.path.join(str(base), *map(str, parts))


def basename(path) -> str:
  return str(path).rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(str(path))


def dirname(path) -> str:
  return str(path).rstrip("/").rsplit("/", 1)[0] if is_url(path) else os.path.dirname(str(path))


class Unreachable(ConnectionError):
  """The storage host refused the connection or its name did not resolve, past the quick retries below."""


# A bucket path fails in seconds, not minutes, when nothing answers: gcsfs retries every connection error six times
# with backoff up to 32 s (tried: ~35 s per call, ~160 s before a run stopped on a dead server). A refused
# connection or an unknown host name is not an answer GCS gives under load, so it gets a few quick tries and then
# ends the call; what GCS does answer under load (429, 5xx, timeouts, resets) keeps gcsfs' own backoff.
UNREACHABLE_RETRY_DELAYS_S = (0.5, 1.0, 2.0)
_configured = threading.Lock()
_done = []


def _bounded_gcs_class():
  import aiohttp
  import fsspec
  from gcsfs import retry as gcs_retry
  base = fsspec.get_filesystem_class("gcs")
  # gcsfs' request without its retry decorator: a private detail of the pinned gcsfs. Another gcsfs (an image's own)
  # may lack it: then its own retries stay (a dead server takes minutes to report, not seconds), the rest is the same.
  undecorated = getattr(getattr(base, "_request", None), "__wrapped__", None)
  retry_request = getattr(gcs_retry, "retry_request", None)

  async def request(self, *args, **kwargs):
    for delay in (*UNREACHABLE_RETRY_DELAYS_S, None):
      try:
        return await undecorated(self, *args, **kwargs)
      except aiohttp.ClientConnectorError as e:  # refused / DNS (not a timeout, reset or HTTP status)
        if delay is None:
          raise Unreachable(f"Cloud Storage cannot be reached ({e}); check the network (or STORAGE_EMULATOR_HOST "
                            "for an emulator)") from None
        await asyncio.sleep(delay)

  def __init__(self, *args, **kwargs):
    # No listings cache: other hosts and jobs write the same bucket (checkpoint shards, new steps an eval watcher
    # must see), so a listing kept from an earlier call would be wrong, not merely old.
    kwargs.setdefault("use_listings_cache", False)
    base.__init__(self, *args, **kwargs)

  request.__name__ = "_request"
  if undecorated is None or retry_request is None:
    return type("UncachedGCSFileSystem", (base,), {"__init__": __init__})
  return type("BoundedRetryGCSFileSystem", (base,),
              {"_request": retry_request(retries=base.retries)(request), "__init__": __init__})


def configure_clients() -> None:
  """Once per process, before the first bucket call: gs:// through gcsfs with the bounded retries above, its
  retry log (a traceback per failed call) kept off the console — a failure reaches the user as one line from
  describe_error. (Credentials are checked by resolve.)"""
  with _configured:
    if _done:
      return
    import fsspec
    cls = _bounded_gcs_class()
    for name in ("gs", "gcs"):
      fsspec.register_implementation(name, cls, clobber=True)
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    # array_record reads gs:// data through Google Cloud's C++ storage client, which knows no STORAGE_EMULATOR_HOST:
    # pointed at the same emulator (tests), or it would try the real endpoint and hang.
    if os.environ.get("STORAGE_EMULATOR_HOST") and not os.environ.get("CLOUD_STORAGE_EMULATOR_ENDPOINT"):
      os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = os.environ["STORAGE_EMULATOR_HOST"]
    _done.append(True)


def credentials_problem() -> BaseException | None:
  """Outside an emulator: the error finding Application Default Credentials, or None when there are some (looked
  up once per process: ~0.3 s)."""
  if os.environ.get("STORAGE_EMULATOR_HOST"):
    return None
  if not _credentials:
    _credentials.append(_find_credentials())
  return _credentials[0]


_credentials = []


def _find_credentials() -> BaseException | None:
  import google.auth
  import google.auth.exceptions
  try:
    google.auth.default()
    return None
  except google.auth.exceptions.DefaultCredentialsError as e:
    return e


# How often a long library call on a bucket (an Orbax save finishing, a restore) checks that the server still
# answers. Orbax writes and reads arrays through tensorstore, which retries a refused connection ~32 times with
# backoff up to 32 s (~15 min) and takes no setting for it through Orbax; the check ends such a call in seconds.
WATCH_POLL_S = 5.0


def unreachable(path) -> Unreachable | None:
  """Unreachable when the storage server behind bucket path `path` does not answer (after the quick retries), else
  None. Any answer, an error status included, counts as reachable."""
  try:
    filesystem().call("GET", "b/{}", bucket(path), json_out=True)
  except Unreachable as e:
    return e
  except Exception:  # noqa: BLE001 — the server answered (404, 403, ...): reachable
    pass
  return None


def watched(fn, path, what: str):
  """fn() — a long library call that reads or writes bucket path `path` — with the server watched while it runs:
  Unreachable naming `what` within about WATCH_POLL_S + the quick retries once nothing answers, instead of the
  library's own retries for many minutes. The abandoned call keeps a daemon thread; a process that gets this error
  should end (cli.clean_errors does). A local path: fn() itself."""
  if not is_url(path):
    return fn()
  box, done = {}, threading.Event()

  def run():
    try:
      box["value"] = fn()
    except BaseException as e:  # noqa: BLE001 — handed to the caller below
      box["error"] = e
    finally:
      done.set()

  threading.Thread(target=run, name=f"watched: {what}", daemon=True).start()
  while not done.wait(WATCH_POLL_S):
    gone = unreachable(path)
    if gone is not None and not done.is_set():
      raise Unreachable(f"{what}: gs://{bucket(path)}: {gone}") from None
  if "error" in box:
    raise box["error"]
  return box.get("value")


def write_if_generation(path: str, data: bytes, generation: int) -> int | None:
  """A bucket object written only if its generation is still `generation` (0: only if there is none) — GCS's
  ifGenerationMatch precondition, one request: the new generation, or None when the precondition failed (another
  writer replaced or removed it meanwhile)."""
  from urllib.parse import quote
  fs = filesystem()
  bucket_name, key = str(path).split("://", 1)[1].split("/", 1)
  # A multipart upload (metadata, then the bytes), as gcsfs' own uploads: GCS and the emulator check the
  # precondition on it (the emulator ignores it on a plain media upload).
  body = (b'--==0==\nContent-Type: application/json; charset=UTF-8\n\n' + json.dumps({"name": key}).encode()
          + b"\n--==0==\nContent-Type: application/octet-stream\n\n" + data + b"\n--==0==--")
  try:
    out = fs.call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket_name)}/o", uploadType="multipart",
                  ifGenerationMatch=str(generation), data=body, json_out=True,
                  headers={"Content-Type": 'multipart/related; boundary="==0=="'})
  except FileExistsError:  # gcsfs' answer to HTTP 412, Precondition Failed
    return None
  return int(out["generation"])


def remove_if_generation(path: str, generation: int) -> bool:
  """A bucket object removed only if its generation is still `generation`; False when it was not (or is gone)."""
  from urllib.parse import quote
  fs = filesystem()
  bucket_name, key = str(path).split("://", 1)[1].split("/", 1)
  try:
    fs.call("DELETE", f"b/{quote(bucket_name)}/o/{quote(key, safe='')}", ifGenerationMatch=str(generation))
    return True
  except (FileExistsError, FileNotFoundError):
    return False


def filesystem():
  """The gcsfs filesystem every bucket call goes through (configure_clients' bounded retries)."""
  import fsspec
  configure_clients()
  return fsspec.filesystem("gcs", finalize_on_close=True)


def _p(path) -> epath.Path:
  if is_url(path):
    configure_clients()
  return epath.Path(str(path))


def _bucket_info(path) -> dict | None:
  """A bucket path's metadata (gcsfs `info`: an object, or a prefix with objects under it as a "directory"), or
  None when nothing is there. Any other failure is raised: fsspec's own `exists` / `isdir` answer False for every
  error, so a bucket that does not answer (Unreachable, after the quick retries) would read as empty — and a
  run would report "no checkpoint" about checkpoints that are there."""
  try:
    return filesystem().info(str(path))
  except FileNotFoundError:
    return None


def exists(path) -> bool:
  """Whether a file or directory is there; on a bucket an error other than "not found" is raised, never False."""
  if is_url(path):
    return _bucket_info(path) is not None
  return _p(path).exists()


def isdir(path) -> bool:
  """Whether a directory is there; on a bucket an error other than "not found" is raised, never False."""
  if is_url(path):
    info = _bucket_info(path)
    return info is not None and info.get("type") == "directory"
  return _p(path).is_dir()


def isfile(path) -> bool:
  return exists(path) and not isdir(path)


def listdir(path) -> list[str]:
  """Names (not paths) in a directory; [] when it does not exist — also when it goes between the check and the
  listing: on a bucket a prefix ends with its last object (another process's write probe, say), and gcsfs then
  raises FileNotFoundError for the prefix itself."""
  if not isdir(path):
    return []
  try:
    return sorted(c.name for c in _p(path).iterdir())
  except FileNotFoundError:
    return []


def makedirs(path) -> None:
  """Local: creates the directory; a bucket has no directories (a prefix exists once an object is under it)."""
  if not is_url(path):
    os.makedirs(path, exist_ok=True)


def read_bytes(path) -> bytes:
  return _p(path).read_bytes()


def read_text(path) -> str:
  return _p(path).read_text()


def write_bytes(path, data: bytes) -> None:
  """Atomic (see the module docstring)."""
  if is_url(path):
    _p(path).write_bytes(data)
    return
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except OSError:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def write_text(path, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def remove(path) -> None:
  _p(path).unlink()


def rmtree(path) -> None:
  """Removes a directory and everything under it; nothing when it does not exist."""
  p = _p(path)
  if p.exists():
    p.rmtree() if p.is_dir() else p.unlink()


def move(src, dst) -> None:
  """A rename on a local disk; on a bucket a copy of every object then their removal (not atomic)."""
  if is_url(src):
    _p(src).rename(dst)
  else:
    os.replace(src, dst)


def upload_tree(src: str, dst: str, last: tuple[str, ...] = ()) -> None:
  """Copies the files under local directory `src` to `dst` (local or a bucket), keeping relative paths; files named
  in `last` go after all others (a marker a reader takes as "complete"). Each file is streamed (a bucket object
  appears whole once its upload ends), never read into memory whole."""
  files = sorted((os.path.relpath(os.path.join(root, f), src) for root, _, names in os.walk(src) for f in names),
                 key=lambda rel: (os.path.basename(rel) in last, rel))
  for rel in files:
    target = join(dst, *rel.split(os.sep))
    if is_url(target):
      filesystem().put_file(os.path.join(src, rel), target)
      continue
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(os.path.join(src, rel), "rb") as f:
      write_bytes(target, f.read())


def bucket_files(directory: str) -> list[dict]:
  """Every object under bucket directory `directory`: {"path" (gs://…), "rel" (relative to it, with "/"), "size",
  "md5" (GCS's base64 md5Hash; None for an object without one), "generation"}."""
  prefix = str(directory).split("://", 1)[1].rstrip("/") + "/"
  out = []
  for name, info in filesystem().find(str(directory), detail=True).items():
    if info.get("type") == "directory" or not name.startswith(prefix):
      continue
    out.append({"path": f"{scheme(directory)}://{name}", "rel": name[len(prefix):], "size": int(info["size"]),
                "md5": info.get("md5Hash"), "generation": str(info.get("generation", ""))})
  return sorted(out, key=lambda o: o["rel"])


def open_read(path, block_size: int = 16 << 20):
  """A binary file object reading `path` (a bucket object streamed in blocks of `block_size`)."""
  return filesystem().open(str(path), "rb", block_size=block_size) if is_url(path) else open(path, "rb")


def _download_tree(src: str, dst: str) -> None:
  for child in _p(src).iterdir():
    local = os.path.join(dst, child.name)
    if child.is_dir():
      os.makedirs(local, exist_ok=True)
      _download_tree(str(child), local)
    else:
      with open(local, "wb") as f:
        f.write(child.read_bytes())


@contextlib.contextmanager
def local_copy(directory: str):
  """Yields a local directory holding `directory`'s files: itself when local, else a temp copy removed after."""
  if not is_url(directory):
    yield directory
    return
  with tempfile.TemporaryDirectory(prefix="hnclip_jax-") as tmp:
    _download_tree(directory, tmp)
    yield tmp


@contextlib.contextmanager
def staged_dir(directory: str):
  """Yields a local directory whose files end up in `directory`: itself when local, else a temp directory
  uploaded when the block ends without an exception."""
  if not is_url(directory):
    os.makedirs(directory, exist_ok=True)
    yield directory
    return
  with tempfile.TemporaryDirectory(prefix="hnclip_jax-") as tmp:
    yield tmp
    upload_tree(tmp, directory)
