"""Recall@K for paired embeddings, counted chunk by chunk (memory O(chunk × N), never N × N)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnames=("ks",))
def _chunk_hits(queries, gallery, gt_index, valid, ks):
  """queries [c, D], gallery [N, D], gt_index [c], valid [c] bool -> int32 [len(ks)] queries with rank < k.

  rank = number of gallery items other than the ground truth scoring >= it, so
  ties count against the ground truth (a collapsed model ranks last).
  """
  scores = queries @ gallery.T  # [c, N]
  gt = jnp.take_along_axis(scores, gt_index[:, None], axis=1)  # [c, 1]
  rank = jnp.sum(scores >= gt, axis=1) - 1  # [c]
  return jnp.stack([jnp.sum((rank < k) & valid) for k in ks])


def _recall(queries, gallery, ks, chunk):
  """Percent of queries i whose gallery item i ranks < k, for each k."""
  n = queries.shape[0]
  chunk = min(chunk, n)
  gallery = jnp.asarray(gallery, jnp.float32)
  hits = np.zeros(len(ks), np.int64)
  for start in range(0, n, chunk):
    q = np.asarray(queries[start:start + chunk], np.float32)
    m = len(q)
    idx = np.arange(start, start + chunk) % n  # padded rows point anywhere valid and are masked out
    if m < chunk:  # pad the last chunk to the compiled shape
      q = np.concatenate([q, np.zeros((chunk - m, q.shape[1]), np.float32)])
    hits += np.asarray(_chunk_hits(jnp.asarray(q), gallery, jnp.asarray(idx), jnp.arange(chunk) < m, ks))
  return {f"R@{k}": 100.0 * float(h) / n for k, h in zip(ks, hits)}


def recall_at_k(img_emb, txt_emb, ks=(1, 5, 10), chunk: int = 1024):
  """img_emb, txt_emb: [N, D] paired by index -> {"t2i": {"R@k": %}, "i2t": {"R@k": %}}."""
  img_emb, txt_emb = np.asarray(img_emb), np.asarray(txt_emb)
  if img_emb.shape != txt_emb.shape or img_emb.ndim != 2:
    raise ValueError(f"recall_at_k needs two [N, D] arrays of the same shape, got {img_emb.shape} and {txt_emb.shape}")
  ks = tuple(int(k) for k in ks)
  return {"t2i": _recall(txt_emb, img_emb, ks, chunk), "i2t": _recall(img_emb, txt_emb, ks, chunk)}
