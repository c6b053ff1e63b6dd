"""The math of the objective's terms: HN-CLIP (paper Eq. 2), the FILIP token term (Eq. 3), FineLIP's hinge,
GOAL's and StructXLIP's terms, and the margin in SigLIP's sigmoid loss (HN-SigLIP).

Everything here is a pure function of L2-normalised features, written for a *block of rows* of the global batch
against the whole batch: the single-device losses below call the row functions with all rows, and the mesh
objective (`hnclip_jax.objective`) calls the same functions on each device's rows inside `shard_map`, so the two
cannot drift apart. Every similarity, margin and cross-entropy is computed with fp32 accumulation and, for fp32
operands, `Precision.HIGHEST` (no bf16 passes on TPU, no TF32 on GPU): the margin γ·Ḡ is a small difference of
near-equal similarities, and rounding it away is rounding the method away.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
# Rows / columns of the token term computed at a time when config.loss.chunk_size is 0: the live block is
# [TOKEN_BLOCK, TOKEN_BLOCK, L_image, L_text] (65 MB at ViT-L/14 with 248 text tokens).
TOKEN_BLOCK = 16
NEG = -1e30  # masked-out similarity; finite, so masked entries get an exact-zero gradient, never NaN


def sims(a, b, spec: str):
  """einsum(spec, a, b) with fp32 accumulation, at full fp32 precision when the operands are fp32.

  bf16 operands (config.dtype="bfloat16") are multiplied in bf16 and accumulated in fp32."""
  precision = HIGHEST if a.dtype == F32 and b.dtype == F32 else None
  return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=F32)


def divisor_at_most(n: int, k: int) -> int:
  """The largest divisor of n that is <= k (>= 1): a block size that tiles n exactly."""
  k = max(1, min(n, k))
  while n % k:
    k -= 1
  return k


def margin_rows(txt_rows, txt_all, gamma, is_pos, shape=None):
  """γ·Ḡ for a block of rows: [n, B], stop-gradient, zero at the positives. Ḡ is symmetric, so the same rows
  serve image→text (row i of S + γḠ) and text→image (column i of it). `shape`: a control in place of the geometry
  (`MarginShape`: a constant, each row's values shuffled, only the top k), applied to Ḡ's rows."""
  g_rows = jax.lax.stop_gradient(sims(txt_rows.astype(F32), txt_all.astype(F32), "nd,bd->nb"))
  g_rows = jnp.where(is_pos, 0.0, g_rows)
  return gamma * (g_rows if shape is None else shape(g_rows, is_pos))


def mean_offdiagonal(sum_t, sum_sq, batch: int):
  """The mean off-diagonal caption similarity of a batch, mean_{i≠j} t_i·t_j, from Σ_b t_b ([D]) and Σ_b |t_b|²
  alone: (|Σ t|² − Σ |t|²) / (B (B − 1)); no [B, B] matrix."""
  return (jnp.sum(sum_t * sum_t) - sum_sq) / (batch * (batch - 1))


@dataclasses.dataclass(frozen=True)
class MarginShape:
  """A geometry-free control in place of Ḡ's off-diagonal values, row by row (the positive keeps 0):
  "constant": every negative gets `value` (the batch's mean off-diagonal Ḡ, or a fixed number);
  "shuffled": each row's off-diagonal values permuted among its negatives (same values, no geometry), by `key`
  folded with the row's global index, so any layout draws the same permutation;
  "topk": each row keeps its k largest off-diagonal values (its k nearest captions), the rest 0.
  `row_offset`: the global index of the block's first row."""
  kind: str
  value: object = None
  k: int = 0
  key: object = None
  row_offset: object = 0

  def __call__(self, g_rows, is_pos):
    if self.kind == "constant":
      return jnp.where(is_pos, 0.0, jnp.broadcast_to(jnp.asarray(self.value, F32), g_rows.shape))
    if self.kind == "topk":
      kth = jax.lax.top_k(jnp.where(is_pos, -jnp.inf, g_rows), self.k)[0][:, -1:]
      return jnp.where(~is_pos & (g_rows >= kth), g_rows, 0.0)
    if self.kind == "shuffled":
      n, b = g_rows.shape
      pos = jnp.argmax(is_pos, axis=1)  # each row's positive column
      slot = jnp.arange(b - 1)[None, :]
      cols = slot + (slot >= pos[:, None])  # [n, B-1]: the negatives' columns, in order
      vals = jnp.take_along_axis(g_rows, cols, axis=1)
      keys = jax.vmap(lambda i: jax.random.fold_in(self.key, i))(self.row_offset + jnp.arange(n))
      perm = jax.vmap(lambda k: jax.random.permutation(k, b - 1))(keys)
      shuffled = jnp.take_along_axis(vals, perm, axis=1)
      return jnp.zeros_like(g_rows).at[jnp.arange(n)[:, None], cols].set(shuffled)
    raise ValueError(f"margin shape {self.kind!r}")


def _cross_entropy(logits, is_pos):  # [n, B] fp32 logits, [n, B] bool -> [n] CE with the marked target
  pos = jnp.sum(jnp.where(is_pos, logits, 0.0), axis=1)
  return jax.nn.logsumexp(logits, axis=1) - pos


def hn_nce(logits, is_pos, beta: float, alpha: float = 1.0, valid=None):
  """HN-NCE (Radenovic et al., CVPR 2023, "Filtering, Distillation, and Hard Negatives for Vision-Language
  Pre-Training", Eq. 3) per row: −log e^{l_ii} / (α e^{l_ii} + Σ_{j≠i} w_ij e^{l_ij}), with importance weights
  w_ij = (N − 1) e^{β l_ij} / Σ_{k≠i} e^{β l_ik} over the row's N − 1 negatives (l = s·v·t, the logits; the
  weights are part of the loss, not stop-gradient). β = 0 and α = 1 is InfoNCE. `valid`: [n, B] bool, columns that
  take part (others: no one's negative). [n, B] fp32 logits -> [n]."""
  neg = ~is_pos if valid is None else (~is_pos & valid)
  count = jnp.sum(neg, axis=1, keepdims=True).astype(F32)
  lse_beta = jax.nn.logsumexp(jnp.where(neg, beta * logits, -jnp.inf), axis=1, keepdims=True)
  weighted = jnp.where(neg, logits + jnp.log(count) + beta * logits - lse_beta, -jnp.inf)
  pos = jnp.sum(jnp.where(is_pos, logits, 0.0), axis=1)
  terms = jnp.where(is_pos, math.log(alpha) + logits, weighted)
  return jax.nn.logsumexp(terms, axis=1) - pos


def positives(n, batch, row_offset):  # [n, B] bool: the global position of each row's positive
  return (row_offset + jnp.arange(n))[:, None] == jnp.arange(batch)[None, :]


def has_margin(gamma) -> bool:
  return not (isinstance(gamma, (int, float)) and gamma == 0)


def contrastive_rows(img_rows, txt_rows, img_all, txt_all, logit_scale, gamma, row_offset, valid_all=None,
                     shape=None, hn_nce_beta: float = 0.0, directions: str = "both"):
  """Per-example losses of the global term for a block of rows of the global batch.

  img_rows, txt_rows: [n, D] rows `row_offset .. row_offset+n` of the batch.
  img_all, txt_all:   [B, D] the whole (global) batch.
  valid_all: optional [B] bool; pairs marked False are no one's negative (their columns are left out) and their own
  rows' losses are 0 (GOAL's segment term: examples without a segment).
  shape: a control in place of Ḡ's geometry (`MarginShape`); hn_nce_beta: > 0 scores each row with HN-NCE
  (`hn_nce`, α = 1) instead of the cross-entropy; directions: which cross-entropies get the margin ("both", "i2t":
  the rows only, "t2i": the columns only).
  Returns (i2t [n], t2i [n]) fp32 cross-entropies: row i of s·(S + γḠ) with
  target i (image→text) and column i of it (text→image). A Python γ = 0 is plain InfoNCE exactly.
  """
  img_rows, txt_rows, img_all, txt_all = (x.astype(F32) for x in (img_rows, txt_rows, img_all, txt_all))
  is_pos = positives(img_rows.shape[0], img_all.shape[0], row_offset)
  s_rows = sims(img_rows, txt_all, "nd,bd->nb")  # [n, B] rows of S
  s_cols = sims(txt_rows, img_all, "nd,bd->nb")  # [n, B] columns of S (S is not symmetric)
  margin = margin_rows(txt_rows, txt_all, gamma, is_pos, shape) if has_margin(gamma) else 0.0
  scale = logit_scale.astype(F32)
  l_rows = scale * (s_rows + (margin if directions != "t2i" else 0.0))
  l_cols = scale * (s_cols + (margin if directions != "i2t" else 0.0))
  if hn_nce_beta:
    valid = None if valid_all is None else jnp.broadcast_to(valid_all[None, :], is_pos.shape)
    score = lambda logits: hn_nce(logits, is_pos, hn_nce_beta, valid=valid)  # noqa: E731
  else:
    score = lambda logits: _cross_entropy(logits, is_pos)  # noqa: E731
  if valid_all is None:
    return score(l_rows), score(l_cols)
  keep = valid_all[None, :]
  mine = jax.lax.dynamic_slice_in_dim(valid_all, row_offset, img_rows.shape[0])
  ce = lambda logits: jnp.where(mine, score(jnp.where(keep, logits, NEG)), 0.0)  # noqa: E731
  return ce(l_rows), ce(l_cols)


# The sigmoid loss (SigLIP, Zhai et al. 2023) with the margin: every image-caption pair is its own binary problem.
def _sigmoid_block(img_rows, txt_cols, txt_rows, logit_scale, logit_bias, gamma, row_offset, col_offset, shape=None):
  """[n, m] -log σ(y_ij·z_ij) of `n` image rows (global positions row_offset ..) against `m` captions (col_offset ..):
  z_ij = t·(S_ij + γ·Ḡ_ij) + b, y = +1 for the positive pair (i = j) and -1 otherwise; Ḡ_ij = stop_gradient(
  txt_i·txt_j), 0 at the positive (txt_rows: the rows' own captions)."""
  is_pos = (row_offset + jnp.arange(img_rows.shape[0]))[:, None] == (col_offset + jnp.arange(txt_cols.shape[0]))[None]
  s = sims(img_rows.astype(F32), txt_cols.astype(F32), "nd,md->nm")
  if has_margin(gamma):
    s = s + margin_rows(txt_rows, txt_cols, gamma, is_pos, shape)
  z = logit_scale.astype(F32) * s + logit_bias.astype(F32)
  return -jax.nn.log_sigmoid(jnp.where(is_pos, z, -z))


def sigmoid_rows(img_rows, txt_rows, txt_all, logit_scale, logit_bias, gamma, row_offset, shape=None):
  """Per-example losses of HN-SigLIP for a block of image rows against every caption of the (global) batch:
  row i is Σ_j -log σ(y_ij·z_ij), z_ij = t·(S_ij + γ·Ḡ_ij) + b (see `_sigmoid_block`). The batch loss is their sum
  over the whole batch divided by B (big_vision's average: over images of the sum over captions). There is one
  direction only: the pairs are scored once, each as its own binary problem. A Python γ = 0 is the plain SigLIP
  loss exactly. img_rows, txt_rows: [n, D] rows `row_offset ..`; txt_all: [B, D]. Returns [n] fp32."""
  return jnp.sum(_sigmoid_block(img_rows, txt_all, txt_rows, logit_scale, logit_bias, gamma, row_offset, 0, shape),
                 axis=1)


def sigmoid_rows_ring(img_rows, txt_rows, logit_scale, logit_bias, gamma, row_offset, axes, num_devices: int,
                      shape=None):
  """`sigmoid_rows` on a mesh without gathering the captions (big_vision's chunked schedule): inside `shard_map`
  over the batch axes `axes`, each device scores its n images against the caption chunk at hand while sending that
  chunk on to the next device (`ppermute`); after num_devices - 1 hops every chunk has visited every device, and
  no device ever holds the [B, D] captions of an all-gather at once in the forward pass. Autodiff keeps what each
  hop's backward needs (the visiting chunk and its [n, n] logits: [B, D] and [n, B] over all hops, as the gather
  schedule holds) and sends the chunks' gradients back around the ring. txt_rows: this device's captions (they
  also give Ḡ's rows)."""
  n = img_rows.shape[0]
  me = jax.lax.axis_index(axes)
  total, chunk = 0.0, txt_rows
  for k in range(num_devices):  # unrolled: no collective inside a loop (see ring_token_scores)
    nxt = jax.lax.ppermute(chunk, axes, _ring(num_devices)) if k < num_devices - 1 else None
    owner = (me - k) % num_devices  # the device whose captions are at hand
    total = total + jnp.sum(_sigmoid_block(img_rows, chunk, txt_rows, logit_scale, logit_bias, gamma, row_offset,
                                           owner * n, shape), axis=1)
    chunk = nxt
  return total


def siglip_loss(img_emb, txt_emb, logit_scale, logit_bias, gamma=0.0):
  """HN-SigLIP loss on one device (plain SigLIP for γ = 0). img_emb, txt_emb: [B, D] L2-normalised; logit_scale t
  and logit_bias b: scalars. Returns the scalar Σ_ij -log σ(y_ij z_ij) / B."""
  rows = sigmoid_rows(img_emb, txt_emb, txt_emb, jnp.asarray(logit_scale), jnp.asarray(logit_bias), gamma, 0)
  return jnp.sum(rows) / img_emb.shape[0]


def token_scores(img_r, txt_c, mask_c):
  """FILIP late-interaction scores of r images against c captions, both directions from one similarity tensor.

  img_r: [r, P, E] per-patch features, txt_c: [c, L, E] per-token features (both L2-normalised per token),
  mask_c: [c, L] bool, True on real text tokens.
  Returns (i2t [r, c]: image a vs caption b = mean over a's patches of the max over b's real tokens,
           t2i [r, c]: caption b vs image a = mean over b's real tokens of the max over a's patches), fp32.
  Lives as [r, c, P, L]: call it on blocks (see `token_rows`).
  """
  s = sims(img_r, txt_c, "ape,bqe->abpq")  # [r, c, P, L]
  i2t = jnp.mean(jnp.max(jnp.where(mask_c[None, :, None, :], s, NEG), axis=3), axis=2)
  m = mask_c[None].astype(F32)  # [1, c, L]
  t2i = jnp.sum(jnp.max(s, axis=2) * m, axis=2) / jnp.maximum(jnp.sum(m, axis=2), 1.0)
  return i2t, t2i


def kept_tokens(keep: float, length: int) -> int:
  """How many of `length` token slots `select_tokens` keeps for a fraction `keep` in (0, 1]: ceil(keep·length)."""
  return max(1, min(length, math.ceil(keep * length - 1e-9)))


def select_tokens(tokens, emb, keep: float, mask=None):
  """FILIP-style token selection, per example and before anything is sent: keeps the fraction `keep` of each
  example's tokens most similar to its own global embedding (the one retrieval uses).

  tokens: [B, T, E] per-token features, emb: [B, E] the examples' global embeddings, mask: [B, T] bool (True on
  real tokens) or None (every token real, as for image patches).
  Returns (tokens [B, K, E], mask [B, K] bool) with K = kept_tokens(keep, T): the kept tokens in descending order
  of <token, emb>; with a mask, each example keeps ceil(K·n/T) of its n real tokens (the same fraction of its own
  length, at least one) and the remaining slots are masked. The ranking is not differentiated (stop_gradient); the
  kept tokens' features are, so gradients reach exactly the kept tokens.
  """
  t = tokens.shape[1]
  k = kept_tokens(keep, t)
  score = sims(jax.lax.stop_gradient(tokens), jax.lax.stop_gradient(emb), "bte,be->bt")
  if mask is not None:
    score = jnp.where(mask, score, -jnp.inf)
  _, idx = jax.lax.top_k(score, k)  # [B, K], best first
  kept = jnp.take_along_axis(tokens, idx[..., None], axis=1)
  if mask is None:
    return kept, jnp.ones(kept.shape[:2], bool)
  real = jnp.sum(mask, axis=1).astype(jnp.int32)
  quota = jnp.maximum(1, (real * k + t - 1) // t)  # ceil(K·n/T) in integers
  return kept, jnp.arange(k)[None, :] < quota[:, None]


def pairwise_rows(pair, rows, cols, block: int, cols_to_rows=lambda x: x):
  """Scores of a block of rows of the global batch against the whole batch, `block` × `block` pairs at a time.

  pair(rows_r, *cols_c) -> (score_a [r, c], score_b [r, c]): two scores of r row items against c column items.
  rows: [n, ...] this block's items; cols: a tuple of [B, ...] arrays, every item of the batch.
  Returns (a [n, B]: rows of A, b [n, B]: rows of B^T, i.e. `cols_to_rows` applied to the [B, n] columns of B) —
  `cols_to_rows` is a transpose on one device and an all-to-all on a mesh. Each [block, block] tile is
  rematerialised in the backward pass, so at most one tile's intermediates are alive (never [n, B, ...])."""
  n, batch = rows.shape[0], cols[0].shape[0]
  rb, cb = divisor_at_most(n, block), divisor_at_most(batch, block)
  tile = lambda x, k: x.reshape(x.shape[0] // k, k, *x.shape[1:])
  tiled_cols = tuple(tile(c, cb) for c in cols)  # [B/cb, cb, ...]
  pair = jax.checkpoint(pair)

  @jax.checkpoint
  def row_block(rows_r):  # [rb, ...] -> ([rb, B], [rb, B])
    _, (a, b) = jax.lax.scan(lambda c, col: (c, pair(rows_r, *col)), None, tiled_cols)
    return tuple(x.transpose(1, 0, 2).reshape(rb, batch) for x in (a, b))

  _, (a, b_cols) = jax.lax.scan(lambda c, x: (c, row_block(x)), None, tile(rows, rb))
  return a.reshape(n, batch), cols_to_rows(b_cols.reshape(n, batch).T)


def token_rows(img_tok_rows, txt_tok_all, mask_all, logit_scale, row_offset, block: int = TOKEN_BLOCK, margin=None,
               cols_to_rows=lambda x: x):
  """Per-example losses of the token term (paper Eq. 3, FILIP) for a block of rows of the global batch.

  img_tok_rows: [n, P, E] this block's images' patch features (rows `row_offset ..` of the batch);
  txt_tok_all, mask_all: [B, L, E], [B, L] every caption's token features and real-token mask.
  Each image–caption pair's similarities are computed once and give both directions: the rows of S^I (these
  images against all captions) and the columns of S^T (all captions against these images, [B, n]);
  `cols_to_rows` turns the latter into this block's rows of S^T (the captions `row_offset ..` against all images):
  a transpose on one device, an all-to-all on a mesh. The [n, B] scores are built `block` rows × `block` columns
  at a time, each block rematerialised in the backward pass, so at most [block, block, P, L] similarities are alive
  (never [n, B, P, L]).
  margin: None, or (gamma, txt_emb_rows [n, D], txt_emb_all [B, D]) to add HN-CLIP's γ·Ḡ to the token logits.
  Returns (i2t [n], t2i [n]) fp32 cross-entropies of s·scores with the diagonal as target.
  """
  n, batch = img_tok_rows.shape[0], txt_tok_all.shape[0]
  i2t, t2i = pairwise_rows(token_scores, img_tok_rows, (txt_tok_all, mask_all), block, cols_to_rows)
  is_pos = positives(n, batch, row_offset)
  extra = 0.0 if margin is None else margin_rows(margin[1], margin[2], margin[0], is_pos)
  scale = logit_scale.astype(F32)
  return _cross_entropy(scale * (i2t + extra), is_pos), _cross_entropy(scale * (t2i + extra), is_pos)


# The token term's ring schedule: caption-token tiles travel around the batch axes instead of being all-gathered.
def token_rows_ring(img_tok_rows, txt_tok_rows, mask_rows, logit_scale, row_offset, axes, num_devices: int,
                    block: int = TOKEN_BLOCK, margin=None):
  """`token_rows` on a mesh without gathering the caption tokens: inside `shard_map` over the batch axes `axes`
  (num_devices devices), each device holds its n images' and n captions' tokens; the caption tiles (tokens, mask)
  pass around the ring with `ppermute` (each hop's send overlapping the scoring of the tile at hand), and each
  device scores its images against the tile at hand; the text->image scores computed for visiting captions go home
  by one all-to-all. So per device the term holds O(n) tokens (its own, one or two visiting tiles) and the [n, B]
  scores, whatever B; the backward pass sends the tiles around again, recomputing each
  tile's similarities (`ring_token_scores`'s custom VJP), instead of keeping every visiting tile.
  Same arguments and result as `token_rows` (txt_tok_rows / mask_rows: this device's captions, not all)."""
  n = img_tok_rows.shape[0]
  batch = n * num_devices
  i2t, t2i = ring_token_scores(img_tok_rows, txt_tok_rows, mask_rows.astype(F32), axes, num_devices, block)
  is_pos = positives(n, batch, row_offset)
  extra = 0.0 if margin is None else margin_rows(margin[1], margin[2], margin[0], is_pos)
  scale = logit_scale.astype(F32)
  return _cross_entropy(scale * (i2t + extra), is_pos), _cross_entropy(scale * (t2i + extra), is_pos)


def _tile_scores(img, txt, maskf, block):
  """This device's images against one tile of captions -> (i2t [n_img, n_cap], t2i [n_cap, n_img])."""
  return pairwise_rows(lambda i, t, m: token_scores(i, t, m > 0.5), img, (txt, maskf), block)


def _varying(x, axes):
  """A loop carry that differs per device (shard_map's type of the values a ring passes around)."""
  return jax.lax.pcast(x, axes, to="varying")


def _ring(d):
  return [(j, (j + 1) % d) for j in range(d)]  # after k hops a device holds the tile of device (me - k) mod d


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def ring_token_scores(img, txt, maskf, axes, d: int, block: int):
  """-> (i2t [n, B]: this device's images against every caption, t2i [n, B]: this device's captions against every
  image); maskf: [n, L] float (1 on real tokens). See `token_rows_ring`.

  Each hop starts sending the tile at hand to the next device before scoring it, so the transfer overlaps the
  scoring; d - 1 hops bring every tile past every device. The text->image scores a device computes for a visiting
  tile are columns of the owners' rows ([B, n] here), sent home by one all-to-all at the end."""
  n = img.shape[0]
  me = jax.lax.axis_index(axes)

  def score(k, rows, cols, txt_k, mask_k):
    src = ((me - k) % d) * n
    a, bt = _tile_scores(img, txt_k, mask_k, block)
    return jax.lax.dynamic_update_slice(rows, a, (0, src)), jax.lax.dynamic_update_slice(cols, bt, (src, 0))

  def hop(k, carry):
    rows, cols, txt_k, mask_k = carry
    nxt = jax.lax.ppermute((txt_k, mask_k), axes, _ring(d))  # in flight while the tile at hand is scored
    return (*score(k, rows, cols, txt_k, mask_k), *nxt)

  carry = (_varying(jnp.zeros((n, n * d), F32), axes), _varying(jnp.zeros((n * d, n), F32), axes), txt, maskf)
  for k in range(d - 1):  # unrolled: no collective inside a loop (XLA:CPU may then order them differently per device)
    carry = hop(k, carry)
  rows, cols, txt_last, mask_last = carry
  rows, cols = score(d - 1, rows, cols, txt_last, mask_last)
  return rows, jax.lax.all_to_all(cols, axes, 0, 1, tiled=True)


def _ring_fwd(img, txt, maskf, axes, d, block):
  return ring_token_scores(img, txt, maskf, axes, d, block), (img, txt, maskf)


def _ring_bwd(axes, d, block, res, cotangents):
  """The tiles go around once more: each device recomputes its images' similarities with the tile at hand (the
  forward kept none of them) and adds the tile's token gradient to what the tile carries; after d hops every
  tile's gradient is home."""
  img, txt, maskf = res
  g_rows, g_t2i = cotangents
  g_cols = jax.lax.all_to_all(g_t2i, axes, 1, 0, tiled=True)  # [B, n]: the visiting captions' t2i cotangents
  n = img.shape[0]
  me = jax.lax.axis_index(axes)

  def grads(k, txt_k, mask_k):
    src = ((me - k) % d) * n
    ga = jax.lax.dynamic_slice(g_rows, (0, src), (n, n))
    gbt = jax.lax.dynamic_slice(g_cols, (src, 0), (n, n))
    _, vjp = jax.vjp(lambda i, t: _tile_scores(i, t, mask_k, block), img, txt_k)
    di, dt = vjp((ga, gbt))
    return di.astype(F32), dt.astype(F32)

  def hop(k, carry):
    dimg, txt_k, mask_k, dtxt_k = carry
    nxt = jax.lax.ppermute((txt_k, mask_k), axes, _ring(d))
    di, dt = grads(k, txt_k, mask_k)
    return (dimg + di, *nxt, jax.lax.ppermute(dtxt_k + dt, axes, _ring(d)))

  carry = (_varying(jnp.zeros(img.shape, F32), axes), txt, maskf, _varying(jnp.zeros(txt.shape, F32), axes))
  for k in range(d - 1):  # unrolled, as in the forward
    carry = hop(k, carry)
  dimg, txt_last, mask_last, dtxt = carry
  di, dt = grads(d - 1, txt_last, mask_last)
  dtxt = jax.lax.ppermute(dtxt + dt, axes, _ring(d))  # the d-th hop brings each tile's gradient home
  return (dimg + di).astype(img.dtype), dtxt.astype(txt.dtype), jnp.zeros_like(maskf)


ring_token_scores.defvjp(_ring_fwd, _ring_bwd)


def hn_clip_loss(img_emb, txt_emb, logit_scale, gamma):
  """HN-CLIP loss (paper Eq. 2). img_emb, txt_emb: [B, D] L2-normalised; logit_scale: scalar s. Returns scalar."""
  i2t, t2i = contrastive_rows(img_emb, txt_emb, img_emb, txt_emb, jnp.asarray(logit_scale), gamma, 0)
  return 0.5 * (jnp.mean(i2t) + jnp.mean(t2i))


def clip_loss(img_emb, txt_emb, logit_scale):
  """Plain CLIP InfoNCE (paper Eq. 1). img_emb, txt_emb: [B, D] L2-normalised. Returns scalar."""
  return hn_clip_loss(img_emb, txt_emb, logit_scale, 0.0)


def token_loss(img_tok, txt_tok, txt_mask, logit_scale, block: int = TOKEN_BLOCK):
  """FILIP token term on one device. img_tok [B, P, E], txt_tok [B, L, E] per-token L2-normalised, txt_mask [B, L]
  bool. Returns the scalar ½[CE(s·S_tok^I, y) + CE(s·S_tok^T, y)] (see `token_scores`)."""
  i2t, t2i = token_rows(img_tok, txt_tok, txt_mask, jnp.asarray(logit_scale), 0, block)
  return 0.5 * (jnp.mean(i2t) + jnp.mean(t2i))
