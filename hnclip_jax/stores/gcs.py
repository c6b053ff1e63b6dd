"""Google Cloud Storage (gs://BUCKET/PATH), through gcsfs — also the GCS emulator (STORAGE_EMULATOR_HOST), which the
tests run against. Its retry rules, credential checks and conditional (generation) writes live here and nowhere else.

An object store has no append and no rename: a log is rewritten whole as one object (GCS shows an object whole or
not at all), a directory is replaced by removing the old objects and writing the new ones with the completion
marker last, and the single-writer guard is a lease object created and renewed under generation preconditions.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import threading
import time

from hnclip_jax.stores import Held, Lease, Store, Unreachable

# A bucket path fails in seconds, not minutes, when nothing answers: gcsfs retries every connection error six times
# with backoff up to 32 s (tried: ~35 s per call, ~160 s before a run stopped on a dead server). A refused
# connection or an unknown host name is not an answer GCS gives under load, so it gets a few quick tries and then
# ends the call; what GCS does answer under load (429, 5xx, timeouts, resets) keeps gcsfs' own backoff.
UNREACHABLE_RETRY_DELAYS_S = (0.5, 1.0, 2.0)
# How often a long library call on a bucket (an Orbax save finishing, a restore) checks that the server still
# answers. Orbax writes and reads arrays through tensorstore, which retries a refused connection ~32 times with
# backoff up to 32 s (~15 min) and takes no setting for it through Orbax; the check ends such a call in seconds.
WATCH_POLL_S = 5.0
LEASE_TTL_S = 120.0
LEASE_RENEW_S = 30.0

_configured = threading.Lock()
_done = []
_credentials = []


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


def credentials_problem() -> BaseException | None:
  """Outside an emulator: the error finding Application Default Credentials, or None when there are some (looked
  up once per process: ~0.3 s)."""
  if os.environ.get("STORAGE_EMULATOR_HOST"):
    return None
  if not _credentials:
    import google.auth
    import google.auth.exceptions
    try:
      google.auth.default()
      _credentials.append(None)
    except google.auth.exceptions.DefaultCredentialsError as e:
      _credentials.append(e)
  return _credentials[0]


def bucket(path: str) -> str:
  return str(path).split("://", 1)[1].split("/", 1)[0]


def _key(path: str) -> tuple[str, str]:
  bucket_name, key = str(path).split("://", 1)[1].split("/", 1)
  return bucket_name, key


class _GenerationLease(Lease):
  """{"host", "pid", "renewed"} in one object, created only if absent (GCS `ifGenerationMatch=0`), so of two runs
  starting at once exactly one gets it, and renewed every LEASE_RENEW_S only if it is still the generation this
  process wrote (`ifGenerationMatch=<ours>`): a holder whose renewals stalled until another run took over finds out
  at its next renewal (`lost`: the new holder) instead of overwriting the new lease, and its release removes
  nothing that is not its own. A lease younger than LEASE_TTL_S is Held; one left by a process of this host that
  is gone is taken over at once; one left by a host that vanished (a preempted VM) LEASE_TTL_S after its last
  renewal."""

  def __init__(self, store: "GCSStore", path: str):
    self.store, self.path = store, path
    self._fs = store.filesystem()
    self._key = path.split("://", 1)[1]
    self._me = {"host": socket.gethostname(), "pid": os.getpid()}
    self._stop = threading.Event()
    self._generation, self.lost = None, None
    if not self._create():
      held = self._read()
      age = time.time() - float(held.get("renewed", 0)) if held else LEASE_TTL_S
      dead_here = held and held.get("host") == self._me["host"] and not _alive(int(held.get("pid", -1)))
      if held and age < LEASE_TTL_S and not dead_here:
        raise Held(held, f"holds {path}, renewed {age:.0f} s ago; wait for it to finish, or — if that run is gone "
                         f"— for the lease to expire ({LEASE_TTL_S - age:.0f} s) or delete {path}")
      self._fs.rm(self._key)  # stale: taken over, and said so
      print(f"taking over {path}: its holder (host {held.get('host') if held else '?'}, pid "
            f"{held.get('pid') if held else '?'}) " + ("is gone" if dead_here else "stopped renewing it "
            f"{age:.0f} s ago"), flush=True)
      if not self._create():
        raise Held({}, f"took {path} at the same moment; wait for it to finish")
    self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
    self._thread.start()

  def _body(self) -> bytes:
    return json.dumps({**self._me, "renewed": time.time()}).encode()

  def _create(self) -> bool:
    self._generation = self.store.write_if_generation(self.path, self._body(), 0)
    return self._generation is not None

  def _read(self) -> dict | None:
    try:
      return json.loads(self._fs.cat(self._key))
    except (FileNotFoundError, ValueError):
      return None

  def _renew(self) -> None:
    while not self._stop.wait(LEASE_RENEW_S) and self.lost is None:
      try:
        self.renew()
      except Exception:  # noqa: BLE001 (a failed renewal is retried; the run's own writes report storage trouble)
        pass

  def renew(self) -> bool:
    """One renewal; False (and `lost` set to the new holder) when the lease is no longer this process's."""
    generation = self.store.write_if_generation(self.path, self._body(), self._generation)
    if generation is None:
      held = self._read() or {}
      if {k: held.get(k) for k in self._me} == self._me:  # ours after all: a renewal whose answer was lost, retried
        self._generation = int(self._fs.info(self._key)["generation"])
        return True
      self.lost = held
      return False
    self._generation = generation
    return True

  def release(self) -> None:
    self._stop.set()
    self._thread.join(timeout=30)  # a renewal in flight must not land after the removal below
    if self.lost is None:
      try:
        self.store.remove_if_generation(self.path, self._generation)
      except Exception:  # noqa: BLE001
        pass


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
    return True
  except ProcessLookupError:
    return False
  except PermissionError:
    return True


class GCSStore(Store):
  schemes = ("gs",)
  native = False
  recovery = "Once the bucket answers again (docs/buckets.md),"

  # ---- the client ----
  def configure(self) -> None:
    """Once per process, before the first bucket call: gs:// through gcsfs with the bounded retries above, its
    retry log (a traceback per failed call) kept off the console — a failure reaches the user as one line from
    describe_error."""
    with _configured:
      if _done:
        return
      import fsspec
      cls = _bounded_gcs_class()
      for name in ("gs", "gcs"):
        fsspec.register_implementation(name, cls, clobber=True)
      logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
      # array_record reads gs:// data through Google Cloud's C++ storage client, which knows no
      # STORAGE_EMULATOR_HOST: pointed at the same emulator (tests), or it would try the real endpoint and hang.
      if os.environ.get("STORAGE_EMULATOR_HOST") and not os.environ.get("CLOUD_STORAGE_EMULATOR_ENDPOINT"):
        os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = os.environ["STORAGE_EMULATOR_HOST"]
      _done.append(True)

  def filesystem(self):
    """The gcsfs filesystem every bucket call of this layer goes through (configure's bounded retries). fsspec
    keeps one per set of arguments: the endpoint is one of them, so a process whose STORAGE_EMULATOR_HOST changes
    (tests that start emulators of their own) never talks to an emulator that is gone."""
    import fsspec
    self.configure()
    return fsspec.filesystem("gcs", finalize_on_close=True,
                             endpoint_url=os.environ.get("STORAGE_EMULATOR_HOST") or None)

  def _info(self, path) -> dict | None:
    """A path's metadata (gcsfs `info`: an object, or a prefix with objects under it as a "directory"), or None when
    nothing is there. Any other failure is raised: fsspec's own `exists` / `isdir` answer False for every error, so
    a bucket that does not answer (Unreachable) would read as empty — and a run would report "no checkpoint" about
    checkpoints that are there."""
    try:
      return self.filesystem().info(str(path))
    except FileNotFoundError:
      return None

  # ---- names ----
  def resolve(self, path: str, flag: str) -> str:
    s, rest = str(path).split("://", 1)
    rest = rest.strip("/")
    if not rest:
      raise ValueError(f"{flag}={path} names no bucket; use gs://BUCKET/PATH")
    # Outside an emulator a bucket path needs credentials: an anonymous client can write no workdir, and finding
    # that out from the server takes gcsfs ~15 s of bucket-type probing and then an unhelpful error.
    problem = credentials_problem()
    if problem is not None:
      raise ValueError(f"{flag}={path}: {self.describe_error(path, problem)}")
    return f"{s}://{rest}"

  def is_root(self, path: str) -> bool:
    return "/" not in str(path).split("://", 1)[1].strip("/")

  def root(self, path: str) -> str:
    return f"gs://{bucket(path)}"

  # ---- reading ----
  def exists(self, path) -> bool:
    return self._info(path) is not None

  def isdir(self, path) -> bool:
    info = self._info(path)
    return info is not None and info.get("type") == "directory"

  def listdir(self, path) -> list[str]:
    """Also [] when the prefix goes between the check and the listing: a prefix ends with its last object (another
    process's write probe, say), and gcsfs then raises FileNotFoundError for the prefix itself."""
    if not self.isdir(path):
      return []
    try:
      return sorted({n.rstrip("/").rsplit("/", 1)[-1] for n in self.filesystem().ls(str(path), detail=False)})
    except FileNotFoundError:
      return []

  def read_bytes(self, path) -> bytes:
    return self.filesystem().cat_file(str(path))

  def open_read(self, path, block_size: int):
    return self.filesystem().open(str(path), "rb", block_size=block_size)

  def files(self, directory: str) -> list[dict]:
    prefix = str(directory).split("://", 1)[1].rstrip("/") + "/"
    out = []
    for name, info in self.filesystem().find(str(directory), detail=True).items():
      if info.get("type") == "directory" or not name.startswith(prefix):
        continue
      out.append({"path": f"gs://{name}", "rel": name[len(prefix):], "size": int(info["size"]),
                  "md5": info.get("md5Hash"), "generation": str(info.get("generation", ""))})
    return sorted(out, key=lambda o: o["rel"])

  # ---- writing ----
  def makedirs(self, path) -> None:
    """Nothing: a bucket has no directories (a prefix exists once an object is under it)."""

  def write_bytes(self, path, data: bytes) -> None:
    """One object upload (gcsfs' resumable upload, the object name in its URL), which GCS makes visible whole or
    not at all."""
    with self.filesystem().open(str(path), "wb") as f:
      f.write(data)

  def append_line(self, path, line: bytes) -> None:
    """No appends on an object store: the object is rewritten whole with the line added."""
    old = self.read_bytes(path) if self.exists(path) else b""
    self.write_bytes(path, old + (b"\n" if old and not old.endswith(b"\n") else b"") + line)

  def put_file(self, local: str, path: str) -> None:
    self.filesystem().put_file(local, str(path))

  def remove(self, path) -> None:
    self.filesystem().rm_file(str(path))

  def rmtree(self, path) -> None:
    if self.exists(path):
      self.filesystem().rm(str(path), recursive=True)

  def move(self, src, dst) -> None:
    """A copy of every object, then their removal (not atomic)."""
    self.filesystem().mv(str(src), str(dst), recursive=True)

  def replace_dir(self, final: str, write) -> None:
    """No renames: the old objects are removed and the new ones written in place, `write`'s marker last."""
    self.rmtree(final)
    write(final)

  def check_writable(self, directory: str) -> None:
    """Writes and removes one probe object under the prefix."""
    probe = self.join(directory, f".write-probe-{os.getpid()}")
    self.write_bytes(probe, b"x")
    self.remove(probe)

  def write_if_generation(self, path: str, data: bytes, generation: int) -> int | None:
    """An object written only if its generation is still `generation` (0: only if there is none) — GCS's
    ifGenerationMatch precondition, one request: the new generation, or None when the precondition failed
    (another writer replaced or removed it meanwhile)."""
    from urllib.parse import quote
    fs = self.filesystem()
    bucket_name, key = _key(path)
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

  def remove_if_generation(self, path: str, generation: int) -> bool:
    """An object removed only if its generation is still `generation`; False when it was not (or is gone)."""
    from urllib.parse import quote
    bucket_name, key = _key(path)
    try:
      self.filesystem().call("DELETE", f"b/{quote(bucket_name)}/o/{quote(key, safe='')}",
                             ifGenerationMatch=str(generation))
      return True
    except (FileExistsError, FileNotFoundError):
      return False

  def lease(self, path: str) -> Lease:
    return _GenerationLease(self, path)

  # ---- library access ----
  def unreachable(self, path) -> Unreachable | None:
    """Unreachable when the server behind `path` does not answer (after the quick retries), else None. Any answer,
    an error status included, counts as reachable."""
    try:
      self.filesystem().call("GET", "b/{}", bucket(path), json_out=True)
    except Unreachable as e:
      return e
    except Exception:  # noqa: BLE001 — the server answered (404, 403, ...): reachable
      pass
    return None

  def watched(self, fn, path, what: str):
    """Unreachable naming `what` within about WATCH_POLL_S + the quick retries once nothing answers. The abandoned
    call keeps a daemon thread; a process that gets this error should end (cli.clean_errors does)."""
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
      gone = self.unreachable(path)
      if gone is not None and not done.is_set():
        raise Unreachable(f"{what}: gs://{bucket(path)}: {gone}") from None
    if "error" in box:
      raise box["error"]
    return box.get("value")

  def describe_error(self, path, err: BaseException) -> str:
    """What is wrong (no such bucket, not authenticated, not allowed, not answering) and what to do. Never the
    request's headers or a token: only the error's type and its first line."""
    b, text = bucket(path), str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    if not isinstance(err, FileNotFoundError) and credentials_problem() is not None:
      err, text = credentials_problem(), "no Application Default Credentials found"
    low = f"{type(err).__name__} {text}".lower()
    # An HTTP status as a whole number (or gcsfs' own .code), never digits inside a URL: an emulator's port 40312
    # once read as "403 Forbidden".
    status = getattr(err, "code", None)
    codes = {status} if isinstance(status, int) else {int(c) for c in re.findall(r"(?<![\d.:])(4\d\d)(?![\d.])", low)}
    if isinstance(err, Unreachable) or "connect" in low and not codes:
      return (f"Cloud Storage cannot be reached for gs://{b} ({type(err).__name__}: {text}); check the network (or "
              "STORAGE_EMULATOR_HOST for an emulator)")
    if isinstance(err, FileNotFoundError) or 404 in codes or "not found" in low and "credential" not in low:
      return (f"bucket gs://{b} does not exist (or the object path is wrong); create it next to the TPUs "
              f"(gcloud storage buckets create gs://{b} --location=REGION) or fix the URL")
    if 401 in codes or any(k in low for k in ("credential", "unauthenticated", "refresh", "auth")):
      return (f"no usable Google Cloud credentials for gs://{b} ({type(err).__name__}); run `gcloud auth "
              "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or on "
              "a TPU / GCE VM give its service account access to the bucket")
    if 403 in codes or "permission" in low or "forbidden" in low:
      return (f"this account may not write gs://{b} ({type(err).__name__}); grant it roles/storage.objectAdmin on "
              "the bucket or use another one")
    if "connect" in low or "name or service not known" in low or "timeout" in low:
      return (f"Cloud Storage cannot be reached for gs://{b} ({type(err).__name__}: {text}); check the network (or "
              "STORAGE_EMULATOR_HOST for an emulator)")
    return f"{type(err).__name__}: {text}"
