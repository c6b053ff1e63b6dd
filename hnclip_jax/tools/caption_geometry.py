"""How hard are a dataset's negatives for a given text encoder? (Will HN-CLIP help here?)

  python -m hnclip_jax.tools.caption_geometry --config CONFIG --init_from PATH --split test --out DIR

PATH is anything `hnclip_jax.pretrained.load` reads (a converted or Hugging Face checkpoint, an OpenAI .pt, or a
train.py workdir). Encodes every caption of the split and writes to DIR:
  pairwise_similarity.png   histogram of all pairwise caption cosine similarities
  hardest_negative.png      histogram of each caption's most similar other caption
  batch_G.png               Ḡ of one real training-size batch, its maximum annotated
  summary.json              means, the share of in-batch negatives per hardness bucket, counts
"""
from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from hnclip_jax.cli import clean_errors

config_flags.DEFINE_config_file("config", None, "Config file (dataset and batch size).", lock_config=True)
flags.DEFINE_string("init_from", None, "Model to encode captions with (default: config.init_from).")
flags.DEFINE_string("split", "test", "Split whose captions are encoded.")
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_integer("chunk", 1024, "Rows of the similarity matrix computed at a time.")
flags.mark_flags_as_required(["config", "out"])

BUCKETS = (-1.0, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0001)


def similarity_stats(emb: np.ndarray, chunk: int):
  """emb [N, D] normalised -> (histogram counts of pairwise sims over i<j on 200 bins in [-1, 1], hardest [N])."""
  n = emb.shape[0]
  edges = np.linspace(-1, 1, 201)
  counts = np.zeros(200, np.int64)
  hardest = np.full(n, -np.inf, np.float32)
  for start in range(0, n, chunk):
    sims = emb[start:start + chunk] @ emb.T  # [c, N]
    rows = np.arange(start, min(start + chunk, n))
    upper = np.arange(n)[None, :] > rows[:, None]
    counts += np.histogram(np.clip(sims[upper], -1, 1), edges)[0]
    sims[np.arange(len(rows)), rows] = -np.inf
    hardest[rows] = sims.max(axis=1)
  return counts, edges, hardest


def bucket_shares(g: np.ndarray) -> dict:
  """Share of the off-diagonal entries of a batch's Ḡ per similarity bucket."""
  off = g[~np.eye(len(g), dtype=bool)]
  hist = np.histogram(off, BUCKETS)[0] / max(off.size, 1)
  names = ["<0.5", "0.5-0.7", "0.7-0.8", "0.8-0.9", "0.9-0.95", ">=0.95"]
  return {k: float(v) for k, v in zip(names, hist)}


@clean_errors
def main(argv):
  del argv
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from hnclip_jax import config as config_lib, pretrained
  from hnclip_jax.data import builders, pipeline
  from hnclip_jax.metrics import quiet_libraries
  quiet_libraries()
  f = flags.FLAGS
  config = config_lib.validate(f.config)
  source_path = f.init_from or config.init_from
  if not source_path:
    raise ValueError("no model to encode with: pass --init_from (a converted/HF checkpoint, an OpenAI .pt or a "
                     "train.py workdir) or set config.init_from")
  model = pretrained.load(source_path)
  if config.model.text_context > model.config.text_context:  # as train.py would start from it (Long-CLIP stretch)
    model = model.with_text_context(config.model.text_context)
  captions = pipeline.read_captions(builders.data_source(config.data, f.split, decode_images=False))
  if len(captions) < 2:
    raise ValueError(f"{config.data.name}/{f.split} has {len(captions)} caption(s); need at least 2")
  emb = np.concatenate([model.encode_texts(captions[i:i + 256]) for i in range(0, len(captions), 256)])
  counts, edges, hardest = similarity_stats(emb, f.chunk)
  batch_n = min(config.batch_size, len(captions))
  batch = np.random.default_rng(config.seed).permutation(len(captions))[:batch_n]
  g = emb[batch] @ emb[batch].T
  np.fill_diagonal(g, np.nan)
  os.makedirs(f.out, exist_ok=True)
  centers = (edges[:-1] + edges[1:]) / 2
  mean_pair = float((counts * centers).sum() / max(counts.sum(), 1))
  title = f"{config.data.name}/{f.split}, {len(captions)} captions"

  fig, ax = plt.subplots(figsize=(6, 4))
  ax.bar(centers, counts / max(counts.sum(), 1), width=edges[1] - edges[0])
  ax.set(xlabel="cosine similarity of two captions", ylabel="share of pairs", title=title)
  ax.axvline(mean_pair, color="k", ls="--", label=f"mean {mean_pair:.3f}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(f.out, "pairwise_similarity.png"), dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 4))
  ax.hist(hardest, bins=100, range=(-1, 1))
  ax.axvline(float(hardest.mean()), color="k", ls="--", label=f"mean {hardest.mean():.3f}")
  ax.set(xlabel="similarity to the most similar other caption", ylabel="captions", title=title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(f.out, "hardest_negative.png"), dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 5))
  im = ax.imshow(g, vmin=np.nanmin(g), vmax=1.0, cmap="viridis")
  i, j = np.unravel_index(np.nanargmax(g), g.shape)
  ax.scatter([j], [i], s=80, facecolors="none", edgecolors="r")
  ax.annotate(f"max {g[i, j]:.3f}", (j, i), color="r", xytext=(5, -5), textcoords="offset points")
  ax.set(title=f"Ḡ of one batch of {batch_n} (diagonal masked)", xlabel="caption", ylabel="caption")
  fig.colorbar(im)
  fig.tight_layout()
  fig.savefig(os.path.join(f.out, "batch_G.png"), dpi=120)
  plt.close(fig)

  summary = {"dataset": config.data.name, "split": f.split, "model": model.source, "num_captions": len(captions),
             "text_context": model.config.text_context,
             "mean_pairwise_similarity": mean_pair, "mean_hardest_negative_similarity": float(hardest.mean()),
             "batch_size": batch_n, "batch_G_offdiag_mean": float(np.nanmean(g)),
             "batch_G_offdiag_max": float(np.nanmax(g)),
             "batch_negative_share_by_similarity": bucket_shares(np.nan_to_num(g, nan=1.0))}
  with open(os.path.join(f.out, "summary.json"), "w") as fh:
    json.dump(summary, fh, indent=2)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main)
