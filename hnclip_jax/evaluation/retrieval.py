"""Recall@K for image/caption embeddings, counted chunk by chunk (memory O(chunk × N), never N × N).

One caption per image (the paper's benchmarks) or several (COCO / Flickr30k protocol): text→image counts a hit
when the caption's image is within the top K images; image→text counts a hit when any of the image's captions is
within the top K captions.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnames=("ks",))
def _chunk_hits(queries, gallery, owner, target, valid, ks):
  """queries [c, D], gallery [N, D], owner [N] (whose item each gallery row is), target [c] (the query's own),
  valid [c] bool -> int32 [len(ks)] queries whose best ground-truth item ranks < k.

  rank = number of gallery items that are not the query's ground truth and score >= its best ground-truth item,
  so ties count against the ground truth (a collapsed model ranks last).
  """
  scores = queries @ gallery.T  # [c, N]
  gt = owner[None, :] == target[:, None]  # [c, N]
  best = jnp.max(jnp.where(gt, scores, -jnp.inf), axis=1, keepdims=True)  # [c, 1]
  rank = jnp.sum((scores >= best) & ~gt, axis=1)  # [c]
  return jnp.stack([jnp.sum((rank < k) & valid) for k in ks])


def _recall(queries, gallery, target, owner, ks, chunk):
  """Percent of queries whose ground-truth gallery item (owner == target) ranks < k, for each k."""
  n = queries.shape[0]
  chunk = min(chunk, n)
  gallery, owner = jnp.asarray(gallery, jnp.float32), jnp.asarray(owner, jnp.int32)
  target = np.asarray(target, np.int32)
  hits = np.zeros(len(ks), np.int64)
  for start in range(0, n, chunk):
    q, t = np.asarray(queries[start:start + chunk], np.float32), target[start:start + chunk]
    m = len(q)
    if m < chunk:  # pad the last chunk to the compiled shape; padded rows are masked out
      q = np.concatenate([q, np.zeros((chunk - m, q.shape[1]), np.float32)])
      t = np.concatenate([t, np.zeros(chunk - m, np.int32)])
    hits += np.asarray(_chunk_hits(jnp.asarray(q), gallery, owner, jnp.asarray(t), jnp.arange(chunk) < m, ks))
  return {f"R@{k}": 100.0 * float(h) / n for k, h in zip(ks, hits)}


class NonFiniteEmbeddings(ValueError):
  """Some embeddings (or scores) are NaN or Inf: any recall computed from them would be meaningless."""


def check_finite(**arrays) -> None:
  """Raises NonFiniteEmbeddings naming, per array (name=[N, ...]), how many rows hold a NaN or Inf and the first.

  A NaN compares false with everything, so a collapsed, diverged model would otherwise rank every ground truth
  first and report perfect recall: evaluation stops instead (it never counts such rows as hits or misses)."""
  bad = []
  for name, x in arrays.items():
    x = np.asarray(x)
    rows = np.flatnonzero(~np.all(np.isfinite(x.reshape(len(x), -1)), axis=1)) if x.size else []
    if len(rows):
      bad.append(f"{len(rows)} of {len(x)} {name} (first: row {rows[0]})")
  if bad:
    raise NonFiniteEmbeddings(f"non-finite (NaN or Inf) {' and '.join(bad)}: the model's outputs are not numbers "
                              "(a diverged run?), so no recall is reported. Evaluate an earlier checkpoint (--step) "
                              "or retrain with a lower optimizer.lr")


def recall_at_k(img_emb, txt_emb, ks=(1, 5, 10), chunk: int = 1024, caption_image=None):
  """img_emb [N_img, D], txt_emb [N_cap, D] -> {"t2i": {"R@k": %}, "i2t": {"R@k": %}}.

  caption_image: int [N_cap], the image row of each caption (several captions may share one image); default:
  captions and images are paired by row (N_cap == N_img).
  """
  img_emb, txt_emb = np.asarray(img_emb), np.asarray(txt_emb)
  if caption_image is None:
    if img_emb.shape != txt_emb.shape or img_emb.ndim != 2:
      raise ValueError(f"recall_at_k needs two [N, D] arrays of the same shape, got {img_emb.shape} and "
                       f"{txt_emb.shape} (pass caption_image when images have several captions)")
    caption_image = np.arange(len(img_emb))
  caption_image = np.asarray(caption_image, np.int64)
  if img_emb.ndim != 2 or txt_emb.ndim != 2 or img_emb.shape[1] != txt_emb.shape[1]:
    raise ValueError(f"recall_at_k needs [N_img, D] and [N_cap, D] arrays, got {img_emb.shape} and {txt_emb.shape}")
  if caption_image.shape != (len(txt_emb),):
    raise ValueError(f"caption_image has shape {caption_image.shape}; it needs one image row per caption "
                     f"({len(txt_emb)})")
  if len(caption_image) and (caption_image.min() < 0 or caption_image.max() >= len(img_emb)):
    raise ValueError(f"caption_image holds rows outside 0..{len(img_emb) - 1}")
  check_finite(**{"image embeddings": img_emb, "caption embeddings": txt_emb})
  missing = np.setdiff1d(np.arange(len(img_emb)), caption_image)
  if len(missing):
    raise ValueError(f"{len(missing)} image(s) have no caption (first: row {missing[0]}); image→text recall "
                     "needs at least one caption per image")
  ks = tuple(int(k) for k in ks)
  return {"t2i": _recall(txt_emb, img_emb, caption_image, np.arange(len(img_emb)), ks, chunk),
          "i2t": _recall(img_emb, txt_emb, np.arange(len(img_emb)), caption_image, ks, chunk)}


def recall_from_scores(scores, caption_image=None, ks=(1, 5, 10)):
  """Recall@K from a score matrix: scores [N_cap, N_img] (caption c vs image i; higher ranks first), caption_image as
  in `recall_at_k`. Ties count against the ground truth, as there. For scores that are not a dot product of
  embeddings (a framework's score, e.g. late interaction of tokens); the matrix is held in host memory
  (4·N_cap·N_img bytes)."""
  scores = np.asarray(scores, np.float64)
  check_finite(**{"caption rows of the score matrix": scores})
  n_cap, n_img = scores.shape
  caption_image = np.arange(n_img) if caption_image is None else np.asarray(caption_image, np.int64)
  if caption_image.shape != (n_cap,):
    raise ValueError(f"caption_image has shape {caption_image.shape}; scores have {n_cap} captions")
  gt_t2i = scores[np.arange(n_cap), caption_image][:, None]
  not_gt = np.arange(n_img)[None, :] != caption_image[:, None]  # [N_cap, N_img]
  rank_t2i = np.sum((scores >= gt_t2i) & not_gt, axis=1)
  best = np.full(n_img, -np.inf)
  np.maximum.at(best, caption_image, scores[np.arange(n_cap), caption_image])
  rank_i2t = np.sum((scores >= best[None, :]) & not_gt, axis=0)
  pct = lambda rank, n: {f"R@{k}": 100.0 * float(np.sum(rank < k)) / n for k in ks}
  return {"t2i": pct(rank_t2i, n_cap), "i2t": pct(rank_i2t, n_img)}
