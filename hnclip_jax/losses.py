"""HN-CLIP and CLIP contrastive losses.

Everything here is a pure function of L2-normalised embeddings. The same
row-block routine (`contrastive_rows`) serves the single-device loss and the
mesh-sharded loss, so the two cannot drift apart.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def contrastive_rows(img_rows, txt_rows, img_all, txt_all, logit_scale, gamma, row_offset):
  """Per-example losses for a block of rows of the global batch.

  img_rows, txt_rows: [n, D] rows `row_offset .. row_offset+n` of the batch.
  img_all, txt_all:   [B, D] the whole (global) batch.
  Returns (i2t [n], t2i [n]) fp32 cross-entropies: row i of s·(S + γḠ) with
  target i (image→text) and column i of it (text→image).
  """
  f32 = jnp.float32
  img_rows, txt_rows, img_all, txt_all = (x.astype(f32) for x in (img_rows, txt_rows, img_all, txt_all))
  n, batch = img_rows.shape[0], img_all.shape[0]
  labels = row_offset + jnp.arange(n)  # [n] global positions of the positives
  is_pos = labels[:, None] == jnp.arange(batch)[None, :]  # [n, B]
  s_rows = img_rows @ txt_all.T  # [n, B] rows of S
  s_cols = txt_rows @ img_all.T  # [n, B] columns of S (S is not symmetric)
  if isinstance(gamma, (int, float)) and gamma == 0:
    margin = 0.0
  else:
    # Ḡ is symmetric, so its rows serve both directions. The positive gets no margin.
    g_rows = jax.lax.stop_gradient(txt_rows @ txt_all.T)  # [n, B]
    margin = gamma * jnp.where(is_pos, 0.0, g_rows)

  def ce(sims):  # [n, B] -> [n]
    logits = logit_scale.astype(f32) * (sims + margin)
    pos = jnp.sum(jnp.where(is_pos, logits, 0.0), axis=1)
    return jax.nn.logsumexp(logits, axis=1) - pos

  return ce(s_rows), ce(s_cols)


def hn_clip_loss(img_emb, txt_emb, logit_scale, gamma):
  """HN-CLIP loss (paper Eq. 2). img_emb, txt_emb: [B, D] L2-normalised; logit_scale: scalar s. Returns scalar."""
  i2t, t2i = contrastive_rows(img_emb, txt_emb, img_emb, txt_emb, jnp.asarray(logit_scale), gamma, 0)
  return 0.5 * (jnp.mean(i2t) + jnp.mean(t2i))


def clip_loss(img_emb, txt_emb, logit_scale):
  """Plain CLIP InfoNCE (paper Eq. 1). img_emb, txt_emb: [B, D] L2-normalised. Returns scalar."""
  return hn_clip_loss(img_emb, txt_emb, logit_scale, 0.0)


def sharded_hn_clip_loss(img_emb, txt_emb, logit_scale, gamma, mesh, batch_axes: Sequence[str],
                         chunk_size: int | None = None):
  """HN-CLIP loss of a batch sharded over `batch_axes` of `mesh`. Same value and gradient as `hn_clip_loss`.

  img_emb, txt_emb: [B, D] global arrays sharded along B. Each device gathers
  the whole batch, builds only its own [B/n_dev, B] rows of S and Ḡ, and the
  per-device sums are reduced with psum: no device holds the B×B logits. The
  gather's transpose is a reduce-scatter, so gradients stay sharded.
  chunk_size: if set (must divide B/n_dev), rows are processed `chunk_size` at a
  time under rematerialisation, so at most [chunk_size, B] logits are live, in
  the forward and the backward pass.
  Returns (loss scalar, per-example i2t [B], per-example t2i [B]).
  """
  axes = tuple(batch_axes)
  batch = img_emb.shape[0]

  def local(img, txt, scale):
    n = img.shape[0]
    img_all = jax.lax.all_gather(img, axes, axis=0, tiled=True)  # [B, D]
    txt_all = jax.lax.all_gather(txt, axes, axis=0, tiled=True)  # [B, D]
    offset = jax.lax.axis_index(axes) * n
    if chunk_size is None or chunk_size >= n:
      i2t, t2i = contrastive_rows(img, txt, img_all, txt_all, scale, gamma, offset)
    else:
      if n % chunk_size:
        raise ValueError(f"config.loss.chunk_size={chunk_size} must divide the per-device batch {n}")

      @jax.checkpoint
      def block(k, img_c, txt_c):
        return contrastive_rows(img_c, txt_c, img_all, txt_all, scale, gamma, offset + k * chunk_size)

      def body(_, xs):
        return None, block(*xs)

      split = lambda x: x.reshape(n // chunk_size, chunk_size, x.shape[-1])
      _, (i2t, t2i) = jax.lax.scan(body, None, (jnp.arange(n // chunk_size), split(img), split(txt)))
      i2t, t2i = i2t.reshape(n), t2i.reshape(n)
    loss = jax.lax.psum(jnp.sum(i2t) + jnp.sum(t2i), axes) / (2 * batch)
    return loss, i2t, t2i

  fn = jax.shard_map(
      local, mesh=mesh,
      in_specs=(P(axes), P(axes), P()),
      out_specs=(P(), P(axes), P(axes)))
  return fn(img_emb, txt_emb, jnp.asarray(logit_scale, jnp.float32))
