"""FineLIP (Asokan et al. 2025): a hinge over late-interaction scores of aggregated tokens, added to L_HN.

The model side (the token aggregators, `CLIPConfig.aggregate_tokens`) and the config block (`config.finelip`) are
still in hnclip_jax/models/clip.py and hnclip_jax/config.py; docs/frameworks.md describes the method."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hnclip_jax import losses
from hnclip_jax.frameworks.base import Term


@dataclasses.dataclass(frozen=True)
class FineLIPTerm(Term):
  """w_f·ramp(step)·L_FineLIP: the hinge over every in-batch negative of the late-interaction scores of the
  aggregated tokens ("img_agg" [B, 1+K, E], "txt_agg" [B, K+1, E])."""
  weight: float = 1.0  # w_f
  margin: float = 0.2  # the hinge's margin
  reduction: str = "sum"  # "sum" over every violating pair (FineLIP) | "mean": divided by the batch size
  ramp_steps: int = 0  # w_f ramps linearly from 0 to 1 over these steps (0: no ramp)
  hn_margin: bool = False  # also add γ·Ḡ to the hinge's negatives
  names = ("fine",)

  def model_kwargs(self, objective, inputs=None) -> dict:
    return {"token_layer": objective.token_layer, "image_cls_token": objective.token_image_cls, "aggregate": True}

  def check(self, model_cfg, objective) -> None:
    if not model_cfg.aggregate_tokens:
      raise ValueError("config.framework='finelip' needs the model's token aggregators, but this model has none "
                       "(config.finelip.tokens=0?)")
    if self.reduction not in ("sum", "mean"):
      raise ValueError(f"config.finelip.reduction={self.reduction!r}; choose 'sum' (FineLIP) or 'mean'")

  def schedule(self, step):
    """The ramp at `step` (None: 1, the full weight)."""
    if step is None or not self.ramp_steps:
      return jnp.float32(1.0)
    return jnp.minimum(jnp.asarray(step, jnp.float32) / self.ramp_steps, 1.0)

  def __call__(self, out, ctx, ramp):
    margin = (ctx.gamma, out["txt"], ctx.txt_all) if self.hn_margin and losses.has_margin(ctx.gamma) else None
    fi2t, ft2i = losses.hinge_rows(out["img_agg"], ctx.gather(out["txt_agg"]), ctx.offset, self.margin,
                                   block=ctx.chunk_size or losses.TOKEN_BLOCK, hn_margin=margin,
                                   cols_to_rows=ctx.cols_to_rows)
    norm = ctx.batch if self.reduction == "mean" else 1
    fine = ctx.psum(jnp.sum(fi2t) + jnp.sum(ft2i)) / norm
    weight = self.weight * ramp
    return [weight * fine], {"fine": fine}, [weight * (fi2t + ft2i) / norm]


def objective(config, obj):
  """config.finelip -> the objective's changes: FineLIP's hinge, and w_g (FineLIP's released code has no global
  term; the paper's swap adds L_HN with weight config.finelip.global_weight)."""
  f = config.finelip
  term = FineLIPTerm(weight=float(f.weight), margin=float(f.margin), reduction=str(f.reduction),
                     ramp_steps=max(int(f.ramp_steps), 0), hn_margin=bool(f.hn_margin))
  return obj.replace(global_weight=float(f.global_weight), terms=obj.terms + (term,))
