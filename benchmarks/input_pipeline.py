"""Input pipeline throughput: decode + CLIP preprocessing + tokenization, images/s, for 0/1/2 grain workers.

  python benchmarks/input_pipeline.py [--image_size 224] [--batch 32] [--batches 20] [--json out.json]

Writes a 'pairs' dataset of realistic JPEGs (480×360 photos-like noise + gradients, 60-word captions) to a temp
dir, builds it with the TFDS builder, and times the training iterator after one warm-up batch.
"""
import argparse
import io
import json
import os
import sys
import tempfile
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import dump, table  # noqa: E402
from hnclip_jax.config import base_config  # noqa: E402
from hnclip_jax.data import builders, pipeline  # noqa: E402
from hnclip_jax.data.tokenizer import WordTokenizer  # noqa: E402


def make_pairs(root, n):
  r = np.random.default_rng(0)
  yy, xx = np.mgrid[0:360, 0:480]
  words = "a red car parked near the old stone building with tall windows and green trees".split()
  entries = []
  for i in range(n):
    img = np.stack([(xx * (i % 7 + 1)) % 256, (yy * 2 + i) % 256, (xx + yy) % 256], -1) + r.normal(0, 20, (360, 480, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    with open(os.path.join(root, f"{i}.jpg"), "wb") as f:
      f.write(buf.getvalue())
    entries.append({"filename": f"{i}.jpg", "caption": " ".join(r.choice(words, 60))})
  with open(os.path.join(root, "pairs.json"), "w") as f:
    json.dump(entries, f)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--image_size", type=int, default=224)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--batches", type=int, default=20)
  p.add_argument("--workers", default="0,1,2")
  p.add_argument("--json", default="")
  a = p.parse_args()
  from absl import flags
  flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags
  tmp = tempfile.mkdtemp()
  make_pairs(tmp, a.batch * 8)
  data = base_config().data
  data.name, data.manual_dir, data.data_dir = "pairs", tmp, os.path.join(tmp, "tfds")
  source = builders.data_source(data, "train")
  tok = WordTokenizer.fit(pipeline.read_captions(source), context_length=77)
  rows = []
  for workers in [int(w) for w in a.workers.split(",")]:
    it = iter(pipeline.train_dataset(source, tok, image_size=a.image_size, global_batch=a.batch, seed=0,
                                     workers=workers))
    next(it)  # warm-up (starts worker processes)
    t = time.perf_counter()
    for _ in range(a.batches):
      next(it)
    dt = time.perf_counter() - t
    rows.append({"workers": workers, "images_per_s": a.batch * a.batches / dt})
  print(f"input pipeline, {a.image_size}px, batch {a.batch}, {os.cpu_count()} CPU cores")
  print(table(rows, ["workers", "images_per_s"]))
  dump(a.json, rows)


if __name__ == "__main__":
  main()
