"""The core's loss terms: the global contrastive term (L_HN, or HN-SigLIP) and the FILIP token term (L_tok).

They are `frameworks.Term`s like every framework's, each owning its settings (its fields), its checks, the model
outputs it asks for and the values it reports; `objective.Objective` only sums its terms. A plug-in may add terms or
replace these (`Objective.with_term`, `Objective.replace`). The math is in `hnclip_jax.losses` (functions of a
block of rows against the whole batch).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hnclip_jax import losses
from hnclip_jax.config import check_chunk_size, check_margin_settings
from hnclip_jax.frameworks.base import Context, Term

TOKEN_OUTPUTS = ("img_tokens", "txt_tokens", "txt_mask")


def _at(shape, row_offset):
  """A margin control for a block of rows starting at global row `row_offset`."""
  return None if shape is None else dataclasses.replace(shape, row_offset=row_offset)


@dataclasses.dataclass(frozen=True)
class ContrastiveTerm(Term):
  """w_g·L_HN: the global term (paper Eq. 2), reported as "hn". kind "softmax": cross-entropy both ways over the
  boosted logits s·(S + γ·Ḡ); "sigmoid" (HN-SigLIP): SigLIP's pairwise sigmoid loss with the margin on every
  negative's logit (the model needs its logit bias b). γ is the objective's (ctx.gamma): γ = 0 is CLIP's InfoNCE /
  SigLIP's loss exactly."""
  kind: str = "softmax"
  # How the sigmoid loss meets every caption on a mesh: "ring" (big_vision's chunked schedule: caption chunks
  # passed around the batch axes, no [B, D] gather) or "gather".
  sigmoid_schedule: str = "ring"
  weight: float = 1.0  # w_g (a framework may set it: FineLIP's global_weight)
  # Controls in place of the margin's geometry (config.loss.margin; docs/objective.md "Controls"): "geometry"
  # (γ·Ḡ), "constant" (γ·c on every negative: c = margin_value, or with margin_value < 0 the batch's mean
  # off-diagonal Ḡ), "shuffled" (each row's off-diagonal Ḡ permuted among its negatives; drawn from shuffle_seed
  # and the step), "topk" (only each row's margin_topk nearest captions by Ḡ keep their margin).
  margin: str = "geometry"
  margin_value: float = -1.0
  margin_topk: int = 0
  shuffle_seed: int = 0
  # HN-NCE (Radenovic et al. 2023, Eq. 3; losses.hn_nce): β > 0 re-weights the negatives by e^{β·logit} instead of
  # the plain cross-entropy (softmax only; 0 = off).
  hn_nce_beta: float = 0.0
  # Which of the softmax's two cross-entropies get the margin: "both" (the paper), "i2t" (rows) or "t2i" (columns).
  margin_directions: str = "both"
  names = ("hn",)

  @property
  def plain_name(self) -> str:
    """What the term is without the margin (γ = 0), for telemetry: "infonce" or "siglip"."""
    return "siglip" if self.kind == "sigmoid" else "infonce"

  def plain(self) -> "ContrastiveTerm":
    """This term as plain InfoNCE / SigLIP (with γ = 0): no HN-NCE weighting, no margin control."""
    return dataclasses.replace(self, margin="geometry", margin_value=-1.0, margin_topk=0, hn_nce_beta=0.0,
                               margin_directions="both")

  def schedule(self, step):
    """The shuffled margin's key for this step (replicated; None for the other margins)."""
    if self.margin != "shuffled":
      return None
    return jax.random.fold_in(jax.random.PRNGKey(self.shuffle_seed), 0 if step is None else step)

  def _shape(self, out, ctx: Context, key):
    """The margin control of this step (losses.MarginShape; None for the geometry)."""
    if self.margin == "geometry" or not losses.has_margin(ctx.gamma):
      return None
    if self.margin == "constant":
      if self.margin_value >= 0:
        return losses.MarginShape("constant", value=self.margin_value)
      txt = jax.lax.stop_gradient(out["txt"].astype(jnp.float32))
      mean = losses.mean_offdiagonal(jax.lax.psum(jnp.sum(txt, axis=0), ctx.axes),
                                     jax.lax.psum(jnp.sum(txt * txt), ctx.axes), ctx.batch)
      return losses.MarginShape("constant", value=mean)
    if self.margin == "topk":
      if not 0 < self.margin_topk < ctx.batch:
        raise ValueError(f"config.loss.margin_topk={self.margin_topk} must be in [1, {ctx.batch - 1}] (the negatives "
                         f"of a batch of {ctx.batch})")
      return losses.MarginShape("topk", k=self.margin_topk)
    return losses.MarginShape("shuffled", key=key, row_offset=ctx.offset)

  def check(self, model_cfg, objective) -> None:
    check_margin_settings(self, objective.gamma)
    if self.kind == "sigmoid" and not model_cfg.logit_bias:
      raise ValueError("config.loss.kind='sigmoid' needs the model's learned logit bias b (z = t·cos + b): start "
                       "from a SigLIP checkpoint or preset (they have one), or set config.model.logit_bias=True "
                       "(a fresh b starts at -10)")

  def __call__(self, out, ctx: Context, sched):
    shape = self._shape(out, ctx, sched)
    if self.kind == "sigmoid":  # each pair its own binary problem; per example: its image's row sum
      rows = self._sigmoid_rows(out, ctx, shape)
      value = jax.lax.psum(jnp.sum(rows), ctx.axes) / ctx.batch
      per = self.weight * rows
    else:
      i2t, t2i = self._softmax_rows(out["img"], out["txt"], ctx, shape)
      value = jax.lax.psum(jnp.sum(i2t) + jnp.sum(t2i), ctx.axes) / (2 * ctx.batch)
      per = self.weight * 0.5 * (i2t + t2i)
    return [self.weight * value], {"hn": value}, [per]

  def _sigmoid_rows(self, out, ctx: Context, shape=None):
    """HN-SigLIP's per-example losses [n] for this device's images (their rows' sums over all captions)."""
    img, txt, scale, bias, gamma = out["img"], out["txt"], out["scale"], out["bias"], ctx.gamma
    n, chunk = img.shape[0], ctx.chunk_size
    if self.sigmoid_schedule == "ring":
      return losses.sigmoid_rows_ring(img, txt, scale, bias, gamma, ctx.offset, ctx.axes, ctx.batch // n, shape)
    if not chunk or chunk >= n:
      return losses.sigmoid_rows(img, txt, ctx.txt_all, scale, bias, gamma, ctx.offset, shape)
    check_chunk_size(chunk, n)

    @jax.checkpoint
    def block(k, img_c, txt_c):
      return losses.sigmoid_rows(img_c, txt_c, ctx.txt_all, scale, bias, gamma, ctx.offset + k * chunk,
                                 _at(shape, ctx.offset + k * chunk))

    split = lambda x: x.reshape(n // chunk, chunk, x.shape[-1])  # noqa: E731
    _, rows = jax.lax.scan(lambda c, xs: (c, block(*xs)), None, (jnp.arange(n // chunk), split(img), split(txt)))
    return rows.reshape(n)

  def _softmax_rows(self, img, txt, ctx: Context, shape=None):
    """L_HN's per-example (i2t [n], t2i [n]) for this device's rows, `chunk_size` rows at a time if set."""
    n, chunk, gamma, scale = img.shape[0], ctx.chunk_size, ctx.gamma, ctx.scale
    beta = self.hn_nce_beta
    if not chunk or chunk >= n:
      return losses.contrastive_rows(img, txt, ctx.img_all, ctx.txt_all, scale, gamma, ctx.offset, shape=shape,
                                     hn_nce_beta=beta, directions=self.margin_directions)
    check_chunk_size(chunk, n)

    @jax.checkpoint
    def block(k, img_c, txt_c):
      at = ctx.offset + k * chunk
      return losses.contrastive_rows(img_c, txt_c, ctx.img_all, ctx.txt_all, scale, gamma, at, shape=_at(shape, at),
                                     hn_nce_beta=beta, directions=self.margin_directions)

    split = lambda x: x.reshape(n // chunk, chunk, x.shape[-1])  # noqa: E731
    _, (i2t, t2i) = jax.lax.scan(lambda c, xs: (c, block(*xs)), None, (jnp.arange(n // chunk), split(img), split(txt)))
    return i2t.reshape(n), t2i.reshape(n)


@dataclasses.dataclass(frozen=True)
class TokenTerm(Term):
  """λ·L_tok: FILIP's token-level late interaction (paper Eq. 3), reported as "tok". Its fields are config.loss's
  token_* settings (docs/objective.md)."""
  weight: float = 1.0  # λ (config.loss.token_weight)
  token_layer: int = -1  # which transformer block's tokens (-1: the last), through the tower's final LN + projection
  token_image_cls: bool = False  # include the image CLS token among the patches
  token_logit_scale: float = 0.0  # 0: the model's learned s; > 0: this fixed multiplier for the token logits
  token_margin: bool = False  # also add γ·Ḡ to the token logits
  token_schedule: str = "gather"  # "gather": all caption tokens on every device | "ring": tiles passed around
  token_group: int = 0  # 0: the negatives are the global batch; G: the example's group of G rows
  token_keep: float = 1.0  # fraction of each image's patches and each caption's tokens the term scores
  names = ("tok",)
  reads_tokens = True  # the objective keeps the token outputs (TOKEN_OUTPUTS) for it

  def model_kwargs(self, objective, inputs=None) -> dict:
    del objective, inputs
    return {"token_layer": self.token_layer, "image_cls_token": self.token_image_cls}

  def outputs(self, model, out, inputs, rng=None, hidden=None) -> dict:
    """With token_keep < 1, the token outputs cut to the kept fraction of each example's tokens
    (`losses.select_tokens`): per micro-batch on the device that holds the example, before anything is sent, so the
    global-batch accumulation caches (and back-propagates) only the kept tokens."""
    del model, inputs, rng, hidden
    if self.token_keep >= 1:
      return {}
    img_tokens, _ = losses.select_tokens(out["img_tokens"], out["img"], self.token_keep)
    txt_tokens, txt_mask = losses.select_tokens(out["txt_tokens"], out["txt"], self.token_keep, out["txt_mask"])
    return {"img_tokens": img_tokens, "txt_tokens": txt_tokens, "txt_mask": txt_mask}

  def __call__(self, out, ctx: Context, sched):
    del sched
    n = out["img"].shape[0]
    tok_scale = ctx.scale if self.token_logit_scale == 0 else jnp.asarray(self.token_logit_scale, jnp.float32)
    margin = (ctx.gamma, out["txt"], ctx.txt_all) if self.token_margin and losses.has_margin(ctx.gamma) else None
    block = ctx.chunk_size or losses.TOKEN_BLOCK
    if self.token_group:  # each group of G consecutive rows on its own: on this device, nothing sent
      ti2t, tt2i = self._grouped_rows(out, tok_scale, ctx)
    elif self.token_schedule == "ring":  # caption-token tiles around the batch axes: O(n) tokens per device
      ti2t, tt2i = losses.token_rows_ring(out["img_tokens"], out["txt_tokens"], out["txt_mask"], tok_scale,
                                          ctx.offset, ctx.axes, ctx.batch // n, block=block, margin=margin)
    else:  # [B, n] columns of S^T (all captions vs this device's images) -> this device's [n, B] rows of it
      ti2t, tt2i = losses.token_rows(out["img_tokens"], ctx.gather(out["txt_tokens"]), ctx.gather(out["txt_mask"]),
                                     tok_scale, ctx.offset, block=block, margin=margin, cols_to_rows=ctx.cols_to_rows)
    value = jax.lax.psum(jnp.sum(ti2t) + jnp.sum(tt2i), ctx.axes) / (2 * ctx.batch)
    return [self.weight * value], {"tok": value}, [self.weight * 0.5 * (ti2t + tt2i)]

  def _grouped_rows(self, out, scale, ctx: Context):
    """Per-example (i2t [n], t2i [n]) with each example's negatives its group of `token_group` consecutive rows of
    the global batch (groups lie within a device: G divides the per-device batch), one group at a time."""
    n, g = out["img_tokens"].shape[0], self.token_group
    if n % g:
      raise ValueError(f"config.loss.token_group={g} must divide the per-device batch {n} (config.batch_size over "
                       "the mesh's data x fsdp devices, and over grad_accum_steps with negatives=micro_batch): "
                       "choose a divisor of it, or 0 for the whole global batch")
    margin = self.token_margin and losses.has_margin(ctx.gamma)

    def group(xs):
      img_t, txt_t, mask, txt = xs
      return losses.token_rows(img_t, txt_t, mask, scale, 0, block=ctx.chunk_size or losses.TOKEN_BLOCK,
                               margin=(ctx.gamma, txt, txt) if margin else None)

    split = lambda x: x.reshape(n // g, g, *x.shape[1:])  # noqa: E731
    i2t, t2i = jax.lax.map(group, tuple(split(out[k]) for k in ("img_tokens", "txt_tokens", "txt_mask", "txt")))
    return i2t.reshape(n), t2i.reshape(n)
