"""Benchmark 4: Recall@K at scale — hnclip_jax.evaluation.recall_at_k vs faiss IndexFlatIP top-K search vs a NumPy
argsort baseline, on the same synthetic embeddings, both directions. Each method runs in its own subprocess so
its peak memory (max RSS) is its own.

  python benchmarks/retrieval.py [--sizes 10000,100000] [--dim 768] [--argsort_max 20000] [--json out.json]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KS = (1, 5, 10)


def embeddings(n, d, seed=0):
  """Paired embeddings with realistic difficulty: text = image + noise, normalised (R@1 around 40-60%)."""
  r = np.random.default_rng(seed)
  img = r.standard_normal((n, d), dtype=np.float32)
  img /= np.linalg.norm(img, axis=1, keepdims=True)
  txt = img + r.standard_normal((n, d), dtype=np.float32) * np.float32(0.3)  # noise norm ≈ 0.3·√d ≈ 8
  txt /= np.linalg.norm(txt, axis=1, keepdims=True)
  return img, txt


def method_hnclip(img, txt):
  sys.path.insert(0, ROOT)
  from hnclip_jax.evaluation import recall_at_k
  recall_at_k(img[:2048], txt[:2048])  # compile outside the timing
  t = time.perf_counter()
  r = recall_at_k(img, txt, KS)
  import jax
  r["device"] = jax.devices()[0].device_kind  # where recall_at_k ran (the table's header says)
  return r, time.perf_counter() - t


def method_faiss(img, txt):
  import faiss
  t = time.perf_counter()
  out = {}
  for name, q, g in (("t2i", txt, img), ("i2t", img, txt)):
    index = faiss.IndexFlatIP(g.shape[1])
    index.add(g)
    _, top = index.search(q, max(KS))
    hit = top == np.arange(len(q))[:, None]
    out[name] = {f"R@{k}": 100.0 * float(hit[:, :k].any(1).mean()) for k in KS}
  return out, time.perf_counter() - t


def method_argsort(img, txt):
  t = time.perf_counter()
  out = {}
  for name, q, g in (("t2i", txt, img), ("i2t", img, txt)):
    order = np.argsort(-(q @ g.T), axis=1)
    rank = np.argmax(order == np.arange(len(q))[:, None], axis=1)
    out[name] = {f"R@{k}": 100.0 * float((rank < k).mean()) for k in KS}
  return out, time.perf_counter() - t


def child(method, n, d):
  img, txt = embeddings(n, d)
  base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  res, dt = {"hnclip": method_hnclip, "faiss": method_faiss, "argsort": method_argsort}[method](img, txt)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  print("RESULT " + json.dumps({"method": method, "n": n, "seconds": dt, "peak_rss_MB": peak / 1024,
                                "rss_growth_MB": (peak - base) / 1024, "recall": res}))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--sizes", default="10000,100000")
  p.add_argument("--dim", type=int, default=768)
  p.add_argument("--argsort_max", type=int, default=20000)
  p.add_argument("--methods", default="hnclip,faiss,argsort")
  p.add_argument("--json", default="")
  p.add_argument("--child", nargs=3)
  a = p.parse_args()
  if a.child:
    child(a.child[0], int(a.child[1]), int(a.child[2]))
    return
  rows = []
  for n in [int(s) for s in a.sizes.split(",")]:
    for m in a.methods.split(","):
      if m == "argsort" and n > a.argsort_max:
        continue
      out = subprocess.run([sys.executable, __file__, "--child", m, str(n), str(a.dim)], capture_output=True,
                           text=True)
      if out.returncode != 0 or "RESULT " not in out.stdout:
        print(f"{m} at N={n} failed: {out.stderr[-500:]}")
        continue
      rows.append(json.loads(out.stdout.split("RESULT ", 1)[1]))
  dev = next((r["recall"].pop("device") for r in rows if "device" in r["recall"]), "-")
  print(f"Recall@K, both directions, D = {a.dim}, {os.cpu_count()} CPU cores, recall_at_k on JAX device: {dev}")
  print("| N | method | seconds | peak RSS MB | RSS growth MB | t2i R@1 | i2t R@10 |\n|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['n']} | {r['method']} | {r['seconds']:.2f} | {r['peak_rss_MB']:.0f} | {r['rss_growth_MB']:.0f} | "
          f"{r['recall']['t2i']['R@1']:.2f} | {r['recall']['i2t']['R@10']:.2f} |")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
