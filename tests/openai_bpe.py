"""OpenAI CLIP's BPE merge list for the tokenizer tests: where it is, and how the test set-up gets it.

The project never ships the file (users' checkpoints bring their own vocabulary). The tests take the byte-identical
copy inside the `open-clip-torch` wheel on the package registry — only the wheel, not the package or its
dependencies (torch) — check its sha256 and keep it in the tests' cache beside the XLA cache and the TFDS test data.

  python tests/openai_bpe.py          # tests/setup.sh runs this: fetch into the cache unless it is there already
  path()                              # the file the tests read (HNCLIP_SHARED_DIR/data/... when that is set)
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

NAME = "bpe_simple_vocab_16e6.txt.gz"
WHEEL = "open-clip-torch==3.3.0"  # open_clip_torch-3.3.0-py3-none-any.whl, 1.5 MB
MEMBER = "open_clip/" + NAME
SHA256 = "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"
SIZE = 1356917
CACHE = os.path.expanduser(os.path.join("~/.cache/hnclip_jax/test-data", NAME))


def path() -> str:
  """The merge list the tests read: $HNCLIP_SHARED_DIR/data/NAME when HNCLIP_SHARED_DIR is set, else the cache."""
  shared = os.environ.get("HNCLIP_SHARED_DIR")
  return os.path.join(shared, "data", NAME) if shared else CACHE


def missing_message(file: str) -> str:
  return (f"{file} is missing: the tokenizer tests read OpenAI's BPE merge list; run `bash tests/setup.sh` (it "
          f"takes the file from the {WHEEL} wheel on the package registry) or set HNCLIP_SHARED_DIR to a folder "
          f"holding data/{NAME}")


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def fetch(dest: str = CACHE, python: str = sys.executable) -> str:
  """Puts the checked merge list at `dest` (kept when it is there and intact) -> dest. Raises RuntimeError with one
  line saying what failed and what to do."""
  if os.path.exists(dest):
    with open(dest, "rb") as f:
      if _sha256(f.read()) == SHA256:
        return dest
  with tempfile.TemporaryDirectory() as tmp:
    proc = subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp,
                           WHEEL], capture_output=True, text=True)
    wheels = [n for n in os.listdir(tmp) if n.endswith(".whl")]
    if proc.returncode != 0 or len(wheels) != 1:
      last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
      raise RuntimeError(f"could not download the {WHEEL} wheel (for OpenAI's BPE merge list, {NAME}) from the "
                         f"package registry: {last}; rerun `bash tests/setup.sh` once the registry is reachable, or "
                         f"set HNCLIP_SHARED_DIR to a folder holding data/{NAME}")
    with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
      data = z.read(MEMBER)
  if _sha256(data) != SHA256 or len(data) != SIZE:
    raise RuntimeError(f"{MEMBER} in the {WHEEL} wheel is {len(data)} bytes with sha256 {_sha256(data)}, not OpenAI's "
                       f"merge list ({SIZE} bytes, sha256 {SHA256}); nothing was written to {dest}")
  os.makedirs(os.path.dirname(dest), exist_ok=True)
  part = f"{dest}.part-{os.getpid()}"
  with open(part, "wb") as f:
    f.write(data)
  os.replace(part, dest)  # a reader sees the whole checked file or none
  return dest


if __name__ == "__main__":
  try:
    given = path()
    print(f"OpenAI's BPE merge list: {given if given != CACHE and os.path.exists(given) else fetch()}")
  except RuntimeError as e:
    sys.exit(f"error: {e}")
