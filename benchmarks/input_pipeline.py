"""Input pipeline throughput: decode + CLIP preprocessing + tokenization, images/s, for 0/1/2 grain workers, with
random and clustered batches (config.data.batching), and what a clustered epoch's plan costs the host.

  python benchmarks/input_pipeline.py [--image_size 224] [--batch 32] [--batches 20] [--batching random,clustered]
                                      [--plan_sizes 4096,9647,50000] [--json out.json]

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
from hnclip_jax.data import builders, clustering, pipeline  # noqa: E402
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
  p.add_argument("--batching", default="random,clustered")
  p.add_argument("--plan_sizes", default="4096,9647,50000",
                 help="training-set sizes whose clustered epoch plan is timed (768-d index, batch --plan_batch)")
  p.add_argument("--plan_batch", type=int, default=128)
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
  r = np.random.default_rng(0)
  unit = lambda n, d: (x := r.normal(size=(n, d))) / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
  index = unit(len(source), 64).astype(np.float32)  # a caption index: the plan's cost does not depend on the model
  for batching in a.batching.split(","):
    for workers in [int(w) for w in a.workers.split(",")]:
      plan = clustering.ClusteredBatches(index, a.batch, 0) if batching == "clustered" else None
      it = iter(pipeline.train_dataset(source, tok, image_size=a.image_size, global_batch=a.batch, seed=0,
                                       workers=workers, plan=plan))
      next(it)  # warm-up (starts worker processes; the clustered plan of epoch 0)
      t = time.perf_counter()
      for _ in range(a.batches):
        next(it)
      dt = time.perf_counter() - t
      rows.append({"batching": batching, "workers": workers, "images_per_s": a.batch * a.batches / dt})
  print(f"input pipeline, {a.image_size}px, batch {a.batch}, {os.cpu_count()} CPU cores")
  print(table(rows, ["batching", "workers", "images_per_s"]))
  plans = []
  for n in [int(x) for x in a.plan_sizes.split(",") if x]:
    index = unit(n, 768).astype(np.float32)
    t = time.perf_counter()
    clustering.epoch_plan(index, a.plan_batch, 0, 0)
    plans.append({"examples": n, "batch": a.plan_batch, "epoch plan (s)": time.perf_counter() - t})
  print("clustered batches: one epoch's plan on the host (768-d caption index)")
  print(table(plans, ["examples", "batch", "epoch plan (s)"]))
  dump(a.json, {"pipeline": rows, "plans": plans})


if __name__ == "__main__":
  main()
