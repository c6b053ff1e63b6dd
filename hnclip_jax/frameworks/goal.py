"""GOAL: segment crops against their sentences (InfoNCE, optionally with γ·Ḡ of the sentences), and the alignment
of pooled patches with the crop and of the caption's sentence span with the sentence, added to L_HN.

This module holds GOAL's config block (`config.goal`) and its loss term. The model side (segment outputs) and the
inputs (hnclip_jax/data/pipeline.segment_inputs) are still in the core modules; docs/frameworks.md describes the
method."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hnclip_jax import losses
from hnclip_jax.frameworks.base import Term
from hnclip_jax.frameworks.segments import check_segments
from hnclip_jax.models.clip import SEGMENT_KEYS


TITLE = "GOAL"
# config.goal; defaults = the authors' released goal_loss_finetuning.py. Each example's best-scoring segment (a box
# and its caption sentence; the data's "segments") gives: segment_weight · InfoNCE(crop, sentence) over the batch,
# patch_weight · (cos(patches under the box, pooled -> final LN -> projection; crop) − 1)², and text_weight ·
# (cos(the sentence's tokens in the caption, pooled likewise; sentence) − 1)², beside the global L_HN.
# segment_margin: put L_HN's margin (γ·Ḡ of the sentences) in the segment term too (off: the paper swaps the global
# term; docs/frameworks.md).
CONFIG = {"segment_weight": 0.5, "patch_weight": 1.0, "text_weight": 1.0, "segment_margin": False}
NON_NEGATIVE = ("segment_weight", "patch_weight", "text_weight")
# The architecture fields this framework sets, as they are when another framework is chosen.
OFF = {}
ALWAYS_READ = ()


def model_fields(config) -> dict:
  del config
  return {}


@dataclasses.dataclass(frozen=True)
class GOALTerm(Term):
  """w_s·L_seg + w_p·L_patch + w_t·L_span, each a mean over the examples it applies to."""
  segment_weight: float = 0.0  # w_s: segment crops vs their sentences
  patch_weight: float = 0.0  # w_p: pooled patches under the box vs the crop
  text_weight: float = 0.0  # w_t: the sentence's span in the caption vs the sentence
  segment_margin: bool = False  # L_HN's margin (γ·Ḡ of the sentences) in the segment term too
  names = ("seg", "patch", "span")
  input_keys = SEGMENT_KEYS

  def model_kwargs(self, objective, inputs=None) -> dict:
    return {} if inputs is None else {"segments": {k: inputs[k] for k in SEGMENT_KEYS}}

  def __call__(self, out, ctx, sched):
    del sched
    count = lambda v: jnp.maximum(ctx.psum(jnp.sum(v.astype(jnp.float32))), 1.0)  # noqa: E731
    n_seg, n_patch, n_span = count(out["seg_valid"]), count(out["patch_valid"]), count(out["span_valid"])
    seg_gamma = ctx.gamma if self.segment_margin else 0
    si2t, st2i = losses.contrastive_rows(out["seg_img"], out["seg_txt"], ctx.gather(out["seg_img"]),
                                         ctx.gather(out["seg_txt"]), ctx.scale, seg_gamma, ctx.offset,
                                         valid_all=ctx.gather(out["seg_valid"]))
    patch = losses.cosine_mse_rows(out["patch_pool"], out["seg_img"], out["patch_valid"])
    span = losses.cosine_mse_rows(out["span_pool"], out["seg_txt"], out["span_valid"])
    terms = {"seg": ctx.psum(jnp.sum(si2t) + jnp.sum(st2i)) / (2 * n_seg),
             "patch": ctx.psum(jnp.sum(patch)) / n_patch, "span": ctx.psum(jnp.sum(span)) / n_span}
    # Per-example shares of the masked means: they average to each term over the whole batch.
    per = ctx.batch * (self.segment_weight * 0.5 * (si2t + st2i) / n_seg + self.patch_weight * patch / n_patch
                       + self.text_weight * span / n_span)
    loss = (self.segment_weight * terms["seg"] + self.patch_weight * terms["patch"]
            + self.text_weight * terms["span"])
    return [loss], terms, [per]


def objective(config, obj):
  g = config.goal
  term = GOALTerm(segment_weight=float(g.segment_weight), patch_weight=float(g.patch_weight),
                  text_weight=float(g.text_weight), segment_margin=bool(g.segment_margin))
  return obj.replace(terms=obj.terms + (term,))


def check_data(config, objective) -> str:
  del objective
  return check_segments(config)
