"""A TFDS build on a bucket, staged into a local cache on each host before training reads it.

array_record's reader fetches every example of a bucket file with its own request for the rest of the file
(docs/buckets.md "Data in a bucket": 36x slower than a local disk and 93x the bytes, measured on the emulator), so
each process copies the build's files once to its own disk and reads them there:

    HNCLIP_DATA_CACHE (default ~/.cache/hnclip_jax/data)/<bucket>/<path of data_dir>/<dataset>/<config>/<version>/

Each file is streamed to a temporary name, its MD5 checked against the object's (GCS's md5Hash; its size where an
object has none), and only then renamed into place with a manifest beside it (size, MD5, generation): a file is
never read half-copied, a restart or a second run reuses every file whose object is unchanged, and a changed
object is fetched again. `dataset_info.json` comes last: TFDS takes a build as complete once it is there.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os

from hnclip_jax import paths, storage

CHUNK = 16 << 20


def cache_root() -> str:
  return os.path.expanduser(os.environ.get("HNCLIP_DATA_CACHE") or "~/.cache/hnclip_jax/data")


def local_data_dir(data_dir: str) -> str:
  """Where the build of bucket `data_dir` is staged on this host (its TFDS data_dir)."""
  root = paths.root(data_dir)  # gs://BUCKET: staged under <cache>/BUCKET/<the path in it>
  return os.path.join(cache_root(), paths.basename(root), *data_dir[len(root):].strip("/").split("/"))


def _manifest(path: str) -> dict | None:
  try:
    with open(path + ".staged.json") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def stage(data_dir: str, build_path: str) -> tuple[str, int, int]:
  """Copies bucket build directory `build_path` (under bucket `data_dir`) into this host's cache. Returns (the local
  data_dir to read from, bytes fetched now, bytes reused). A local disk that is full or not writable: StorageError
  naming the file and the way out; nothing half-copied is left in place."""
  local_root = local_data_dir(data_dir)
  rel = build_path[len(data_dir.rstrip("/")):].strip("/")
  local_build = os.path.join(local_root, *rel.split("/"))
  objects = sorted(paths.files(build_path), key=lambda o: (o["rel"].endswith("dataset_info.json"), o["rel"]))
  fetched = reused = 0
  for obj in objects:
    target = os.path.join(local_build, *obj["rel"].split("/"))
    want = {k: obj[k] for k in ("size", "md5", "generation")}
    if os.path.exists(target) and os.path.getsize(target) == want["size"] and _manifest(target) == want:
      reused += want["size"]
      continue
    try:
      _fetch(obj, target, want)
    except paths.Unreachable:
      raise
    except OSError as e:
      raise storage.StorageError(f"staging {obj['path']} into {target} failed ({storage.describe(e)}); free space "
                                 f"there or set HNCLIP_DATA_CACHE to a disk with room ({obj['size'] / 1e6:.1f} MB "
                                 "for this file), then rerun") from e
    fetched += want["size"]
  return local_root, fetched, reused


def _fetch(obj: dict, target: str, want: dict) -> None:
  os.makedirs(os.path.dirname(target), exist_ok=True)
  tmp = f"{target}.tmp{os.getpid()}"
  md5 = hashlib.md5()
  try:
    with paths.open_read(obj["path"], CHUNK) as src, open(tmp, "wb") as dst:
      while chunk := src.read(CHUNK):
        md5.update(chunk)
        dst.write(chunk)
    size, got = os.path.getsize(tmp), base64.b64encode(md5.digest()).decode()
    if size != want["size"] or (want["md5"] and got != want["md5"]):
      raise ValueError(f"staging {obj['path']} into {target}: the copy differs from the object ({size} bytes, MD5 "
                       f"{got}; the object: {want['size']} bytes, MD5 {want['md5']}); it was replaced while being "
                       "read, or the transfer was damaged: rerun to fetch it again")
    with open(target + ".staged.json", "w") as f:  # before the rename: a file in place always has its manifest
      json.dump(want, f)
    os.replace(tmp, target)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
