"""StructXLIP: edge maps against structure captions (InfoNCE, s held constant, optionally with γ·Ḡ), the RGB-edge
consistency 1 − cos, and the multi-positive local term of caption chunks against the example's own segment edge
crops, with per-epoch weight factors, added to L_HN.

The model side (edge and chunk outputs), the inputs (hnclip_jax/data/pipeline.structure_inputs), the logit scale's
clamp and the config block (`config.structxlip`) are still in the core modules; docs/frameworks.md describes the
method."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hnclip_jax import losses
from hnclip_jax.frameworks.base import Term
from hnclip_jax.models.clip import STRUCTURE_KEYS


@dataclasses.dataclass(frozen=True)
class StructXLIPTerm(Term):
  """Σ_k w_k·factor_k(epoch)·L_k, k ∈ {struct, consist, local}."""
  structure_weight: float = 0.0  # edge map vs caption-without-appearance-words InfoNCE
  consistency_weight: float = 0.0  # 1 − cos(image, its edge map)
  local_weight: float = 0.0  # caption chunks vs the example's own segment edge crops
  floors: tuple = (0.7, 0.5, 0.4)  # the three weights' schedule floors
  decay_epochs: int = 8  # the weights decay (cosine) from epoch 1 to this epoch, then stay at the floor
  steps_per_epoch: int = 0  # 0: no schedule (full weights)
  tau: float = 0.07  # the local term's temperature: its multiplier is min(s / tau, 100)
  structure_margin: bool = False  # L_HN's margin (γ·Ḡ of the structure captions) in the structure term too
  names = ("struct", "consist", "local")
  input_keys = STRUCTURE_KEYS

  def model_kwargs(self, objective, inputs=None) -> dict:
    return {} if inputs is None else {"structure": {k: inputs[k] for k in STRUCTURE_KEYS}}

  def schedule(self, step):
    """The per-epoch weight factors at `step` ([3]: structure, consistency, local; None: epoch 0): 1 in epochs 0
    and 1, then a cosine decay to each floor at epoch `decay_epochs`, the floor after."""
    floors = jnp.asarray(self.floors, jnp.float32)
    if step is None or not self.steps_per_epoch:
      return jnp.ones(3, jnp.float32)
    epoch = jnp.floor(jnp.asarray(step, jnp.float32) / self.steps_per_epoch)
    span = max(self.decay_epochs - 1, 1)
    progress = jnp.clip(epoch - 1.0, 0.0, span)
    return floors + (1.0 - floors) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress / span))

  def __call__(self, out, ctx, factors):
    w_sc, w_rgb, w_loc = (factors[j] * w for j, w in enumerate(
        (self.structure_weight, self.consistency_weight, self.local_weight)))
    # The structure term's logits use s as a constant (the authors detach it); the local term's use
    # min(s / tau, 100) with s trained.
    sc_gamma = ctx.gamma if self.structure_margin else 0
    xi2t, xt2i = losses.contrastive_rows(out["sx_edge_img"], out["sx_txt"], ctx.gather(out["sx_edge_img"]),
                                         ctx.gather(out["sx_txt"]), jax.lax.stop_gradient(ctx.scale), sc_gamma,
                                         ctx.offset)
    consist = 1.0 - jnp.sum(out["img"].astype(jnp.float32) * out["sx_edge_img"], axis=-1)
    loc, applies = losses.multi_positive_rows(
        out["sx_chunks"], out["sx_chunk_valid"], ctx.gather(out["sx_crop_img"]), ctx.gather(out["sx_crop_valid"]),
        jnp.minimum(ctx.scale / self.tau, 100.0), ctx.offset)
    n_loc = jnp.maximum(ctx.psum(jnp.sum(applies.astype(jnp.float32))), 1.0)
    terms = {"struct": ctx.psum(jnp.sum(xi2t) + jnp.sum(xt2i)) / (2 * ctx.batch),
             "consist": ctx.psum(jnp.sum(consist)) / ctx.batch, "local": ctx.psum(jnp.sum(loc)) / n_loc}
    return ([w_sc * terms["struct"], w_rgb * terms["consist"], w_loc * terms["local"]], terms,
            [w_sc * 0.5 * (xi2t + xt2i), w_rgb * consist, w_loc * ctx.batch * loc / n_loc])


def objective(config, obj):
  x = config.structxlip
  term = StructXLIPTerm(structure_weight=float(x.structure_weight), consistency_weight=float(x.consistency_weight),
                        local_weight=float(x.local_weight), floors=tuple(float(f) for f in x.floors),
                        decay_epochs=int(x.decay_epochs), steps_per_epoch=max(int(x.steps_per_epoch), 0),
                        tau=float(x.tau), structure_margin=bool(x.structure_margin))
  return obj.replace(terms=obj.terms + (term,))
