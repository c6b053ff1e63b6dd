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

from hnclip_jax import paths

CHUNK = 16 << 20


def cache_root() -> str:
  return os.path.expanduser(os.environ.get("HNCLIP_DATA_CACHE") or "~/.cache/hnclip_jax/data")


def local_data_dir(data_dir: str) -> str:
  """Where the build of bucket `data_dir` is staged on this host (its TFDS data_dir)."""
  return os.path.join(cache_root(), *data_dir.split("://", 1)[1].strip("/").split("/"))


def _objects(remote: str) -> list[dict]:
  fs = paths.filesystem()
  return [info for info in fs.find(remote, detail=True).values() if info.get("type") != "directory"]


def _manifest(path: str) -> dict | None:
  try:
    with open(path + ".staged.json") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _want(info: dict) -> dict:
  return {"size": int(info["size"]), "md5": info.get("md5Hash"), "generation": str(info.get("generation", ""))}


def stage(data_dir: str, build_path: str) -> tuple[str, int, int]:
  """Copies bucket build directory `build_path` (under bucket `data_dir`) into this host's cache. Returns (the local
  data_dir to read from, bytes fetched now, bytes reused)."""
  local_root = local_data_dir(data_dir)
  rel = build_path[len(data_dir.rstrip("/")):].strip("/")
  local_build = os.path.join(local_root, *rel.split("/"))
  objects = sorted(_objects(build_path), key=lambda o: (o["name"].endswith("/dataset_info.json"), o["name"]))
  fetched = reused = 0
  fs = paths.filesystem()
  prefix = build_path.split("://", 1)[1].rstrip("/") + "/"
  for info in objects:
    name = info["name"][len(prefix):] if info["name"].startswith(prefix) else os.path.basename(info["name"])
    target = os.path.join(local_build, *name.split("/"))
    want = _want(info)
    if os.path.exists(target) and os.path.getsize(target) == want["size"] and _manifest(target) == want:
      reused += want["size"]
      continue
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp{os.getpid()}"
    md5 = hashlib.md5()
    try:
      with fs.open(info["name"], "rb", block_size=CHUNK) as src, open(tmp, "wb") as dst:
        while chunk := src.read(CHUNK):
          md5.update(chunk)
          dst.write(chunk)
      size = os.path.getsize(tmp)
      got = base64.b64encode(md5.digest()).decode()
      if size != want["size"] or (want["md5"] and got != want["md5"]):
        raise OSError(f"staging gs://{info['name']} into {target}: the copy differs from the object "
                      f"({size} bytes, MD5 {got}; the object: {want['size']} bytes, MD5 {want['md5']}); it was "
                      "replaced while being read, or the transfer was damaged: rerun to fetch it again")
      with open(target + ".staged.json", "w") as f:  # before the rename: a file in place always has its manifest
        json.dump(want, f)
      os.replace(tmp, target)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
    fetched += want["size"]
  return local_root, fetched, reused
