"""JPEG decode + CLIP preprocessing per CPU core: what one host core feeds a chip.

  python benchmarks/decode.py [--images 48] [--sizes 480x640,1024x1024] [--px 224,336]

Makes photo-like JPEGs (smooth gradients, shapes and sensor-like noise, quality 90) of each size and times, in one
thread, what the input pipeline does per training example: PIL decode, then `pipeline.pixels_of` (OpenAI CLIP's
bicubic resize of the short side, centre crop, mean/std normalisation) at each target resolution. One thread = one
core: grain's worker processes (config.workers) scale it across a host's cores.
"""
import argparse
import io
import os
import sys
import time

import numpy as np
from PIL import Image, ImageDraw

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hnclip_jax.data import pipeline  # noqa: E402


def photo_like(h: int, w: int, seed: int) -> bytes:
  r = np.random.default_rng(seed)
  y, x = np.mgrid[0:h, 0:w].astype(np.float32)
  base = np.stack([128 + 100 * np.sin(x / w * r.uniform(2, 6) + c) * np.cos(y / h * r.uniform(2, 6))
                   for c in range(3)], -1)
  img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
  d = ImageDraw.Draw(img)
  for _ in range(12):
    x0, y0 = r.integers(0, w), r.integers(0, h)
    d.ellipse([x0, y0, x0 + r.integers(20, w // 3), y0 + r.integers(20, h // 3)],
              fill=tuple(int(v) for v in r.integers(0, 255, 3)))
  arr = np.asarray(img, np.float32) + r.normal(0, 6, (h, w, 3))
  out = io.BytesIO()
  Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
  return out.getvalue()


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--images", type=int, default=48)
  p.add_argument("--sizes", default="480x640,1024x1024")
  p.add_argument("--px", default="224,336")
  a = p.parse_args()
  rows = []
  for size in a.sizes.split(","):
    h, w = map(int, size.split("x"))
    jpegs = [photo_like(h, w, i) for i in range(a.images)]
    kb = np.mean([len(j) for j in jpegs]) / 1024
    for px in map(int, a.px.split(",")):
      pipeline.pixels_of(Image.open(io.BytesIO(jpegs[0])), px)  # warm-up
      t = time.perf_counter()
      for j in jpegs:
        pipeline.pixels_of(Image.open(io.BytesIO(j)), px)
      rows.append((f"{h}×{w}", kb, px, a.images / (time.perf_counter() - t)))
  print(f"\none thread (one core) of {os.cpu_count()}; {a.images} images each")
  print("| JPEG | mean size (KB) | model px | images/s per core |")
  print("|---|---:|---:|---:|")
  for size, kb, px, rate in rows:
    print(f"| {size} | {kb:.0f} | {px} | {rate:.0f} |")


if __name__ == "__main__":
  main()
