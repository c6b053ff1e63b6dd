"""FineLIP (Asokan et al. 2025): a hinge over late-interaction scores of aggregated tokens, added to L_HN.

This module holds FineLIP's config block (`config.finelip`), its checks and its loss term. The model side (the token
aggregators, `CLIPConfig.aggregate_tokens`) is still in hnclip_jax/models/clip.py; docs/frameworks.md describes the
method."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hnclip_jax import losses
from hnclip_jax.frameworks.base import Term, one_epoch_as_steps


TITLE = "FineLIP"
# config.finelip; defaults = the authors' released settings. tokens: K aggregated tokens per tower
# (39 = int(196 patches × 0.4 × 0.5)); hidden_ratio: the aggregation MLP's width / embed_dim; weight, margin:
# the hinge's weight and margin; reduction: "sum" over every violating pair (the authors) or "mean" (÷ batch);
# ramp_steps: the hinge's weight ramps linearly from 0 over these steps (-1: one epoch of the training split, the
# authors' ramp; 0: none); hn_margin: also add γ·Ḡ to the hinge's negatives; global_weight: weight of L_HN (the
# released FineLIP code has none: 0; the paper's swap adds it: 1); score_weight: eval.py --score=finelip ranks by
# (1 − w)·cosine + w·late interaction (the authors: 0.2). The aggregators' learning rate is set with
# config.optimizer.lr_multipliers (configs/longclip_l.py:finelip: backbone 1e-6, aggregators 2e-4).
CONFIG = {"tokens": 39, "hidden_ratio": 0.2, "weight": 1.0, "margin": 0.2, "reduction": "sum", "ramp_steps": -1,
          "hn_margin": False, "global_weight": 1.0, "score_weight": 0.2}
NON_NEGATIVE = ("weight", "margin", "global_weight", "score_weight")
# Read whatever config.framework is (eval.py --score=finelip on any model with aggregators).
# The architecture fields this framework sets, as they are when another framework is chosen.
OFF = {"aggregate_tokens": 0}
ALWAYS_READ = ("score_weight",)


def model_fields(config) -> dict:
  """Checks config.finelip; the model's architecture fields it implies (the aggregators)."""
  f = config.finelip
  if int(f.tokens) < 1:
    raise ValueError(f"config.finelip.tokens={f.tokens} must be >= 1 (the aggregated tokens per tower)")
  if not 0 < float(f.hidden_ratio):
    raise ValueError(f"config.finelip.hidden_ratio={f.hidden_ratio} must be positive")
  if f.reduction not in ("sum", "mean"):
    raise ValueError(f"config.finelip.reduction={f.reduction!r}; choose 'sum' (FineLIP) or 'mean'")
  if int(f.ramp_steps) < -1:
    raise ValueError(f"config.finelip.ramp_steps={f.ramp_steps}; use -1 (one epoch), 0 (no ramp) or a step count")
  if not 0 <= float(f.score_weight) <= 1:
    raise ValueError(f"config.finelip.score_weight={f.score_weight} must be in [0, 1]")
  return {"aggregate_tokens": int(f.tokens), "aggregate_hidden_ratio": float(f.hidden_ratio)}


# The model's top-level modules this framework adds (models/clip.py TokenAggregation, one per tower).
PARAMS = ("image_aggregator", "text_aggregator")


def start_params(params: dict, cfg, seed: int, source: str) -> dict:
  """Pretrained weights with the aggregators `cfg` has: fresh ones where the weights lack them (pre-trained CLIP),
  a FineLIP start's own where their shapes match."""
  import jax
  import numpy as np
  from hnclip_jax.models.clip import init_aggregators
  if not cfg.aggregate_tokens:
    return {k: v for k, v in params.items() if k not in PARAMS}
  params = dict(params)
  for name, tree in init_aggregators(cfg, seed).items():
    if name not in params:
      params[name] = tree
      continue
    have, want = jax.tree.map(np.shape, params[name]), jax.tree.map(np.shape, tree)
    if have != want:
      raise ValueError(f"config.init_from={source} has FineLIP aggregators of other shapes ({name}: {have} vs "
                       f"{want} for config.finelip.tokens={cfg.aggregate_tokens}, hidden_ratio="
                       f"{cfg.aggregate_hidden_ratio}); use its settings, or set them to match")
  return params


def trained_with_adapters(model_cfg) -> tuple:
  """Parameters (path regexes) that train under LoRA / DoRA although they are not adapters: the aggregators, new
  and randomly initialised."""
  return (r"(?:image|text)_aggregator/",) if model_cfg.aggregate_tokens else ()


def resolve_epochs(config, steps_per_epoch: int):
  """config.finelip.ramp_steps = -1 (one epoch) as steps."""
  return one_epoch_as_steps(config, "finelip.ramp_steps", steps_per_epoch)


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
