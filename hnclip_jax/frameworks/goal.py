"""GOAL: segment crops against their sentences (InfoNCE, optionally with γ·Ḡ of the sentences), and the alignment
of pooled patches with the crop and of the caption's sentence span with the sentence, added to L_HN.

This module holds all of GOAL: its config block (`config.goal`), its per-example inputs (`inputs`, `input_specs`;
`segment_inputs`: the segment choice, crop, patches and span), its model outputs (`GOALTerm.outputs`:
a second pass of each tower over the crop and the sentence, the region and span pools of the first pass's last
block) and its loss term; docs/frameworks.md describes the method."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from hnclip_jax import losses
from hnclip_jax.data import manual, pipeline
from hnclip_jax.frameworks.base import Term
from hnclip_jax.frameworks.segments import check_segments, segment_choice, segments_of
from hnclip_jax.models.clip import dropout_key, l2_normalize


TITLE = "GOAL"
# config.goal; defaults = the authors' released goal_loss_finetuning.py. Each example's best-scoring segment (a box
# and its caption sentence; the data's "segments") gives: segment_weight · InfoNCE(crop, sentence) over the batch,
# patch_weight · (cos(patches under the box, pooled -> final LN -> projection; crop) − 1)², and text_weight ·
# (cos(the sentence's tokens in the caption, pooled likewise; sentence) − 1)², beside the global L_HN.
# segment_margin: put L_HN's margin (γ·Ḡ of the sentences) in the segment term too (off: the paper swaps the global
# term; docs/frameworks.md).
CONFIG = {"segment_weight": 0.5, "patch_weight": 1.0, "text_weight": 1.0, "segment_margin": False}
NON_NEGATIVE = ("segment_weight", "patch_weight", "text_weight")
# Its per-example inputs (made by `inputs`: `segment_inputs`): the chosen segment's crop
# [H, W, 3] and sentence tokens [L], the patches under its box [P], the sentence's span in the caption [L], and
# whether the example has a segment.
SEGMENT_KEYS = ("seg_image", "seg_tokens", "seg_patches", "seg_span", "seg_valid")


def model_fields(config) -> dict:
  del config
  return {}


def _masked_mean(x, mask):
  """x [B, N, W], mask [B, N] float -> [B, W]: the mean of the rows under the mask (zeros where it is empty), fp32
  accumulation, in x's dtype."""
  w = mask / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0)
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  return jnp.einsum("bn,bnw->bw", w.astype(x.dtype), x, precision=precision,
                    preferred_element_type=jnp.float32).astype(x.dtype)


def pool_patches(model, hidden, mask):
  """The region embedding: the image tower's last-block patch outputs (hidden [B, 1+P, W], CLS first) averaged over
  `mask` [B, P] (1 on the patches under the box), then the tower's final LayerNorm and projection (as the CLS token
  goes) -> [B, E], unnormalised. An all-zero mask gives the LayerNorm of a zero vector (its bias)."""
  return model.ln_post(_masked_mean(hidden[:, 1:], mask)) @ model.visual_projection[...].astype(hidden.dtype)


def pool_span(model, hidden, mask):
  """The sentence-in-caption embedding: the text tower's last-block outputs (hidden [B, L, W]) averaged over `mask`
  [B, L] (1 on the sentence's tokens), then the final LayerNorm and projection -> [B, E], unnormalised."""
  return model.ln_final(_masked_mean(hidden, mask)) @ model.text_projection[...].astype(hidden.dtype)


def cosine_mse_rows(a, b, valid):
  """GOAL's alignment terms, per row: (cos(a_i, b_i) − 1)² for L2-normalised a, b [n, D]; 0 where valid [n] is
  False."""
  cos = jnp.sum(a.astype(losses.F32) * b.astype(losses.F32), axis=-1)
  return jnp.where(valid, jnp.square(cos - 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class GOALTerm(Term):
  """w_s·L_seg + w_p·L_patch + w_t·L_span, each a mean over the examples it applies to."""
  segment_weight: float = 0.0  # w_s: segment crops vs their sentences
  patch_weight: float = 0.0  # w_p: pooled patches under the box vs the crop
  text_weight: float = 0.0  # w_t: the sentence's span in the caption vs the sentence
  segment_margin: bool = False  # L_HN's margin (γ·Ḡ of the sentences) in the segment term too
  names = ("seg", "patch", "span")
  input_keys = SEGMENT_KEYS

  def outputs(self, model, out, inputs, rng=None, hidden=None):
    """"seg_img" (the segment crop's embedding), "seg_txt" (its sentence's), "patch_pool" (`pool_patches` under the
    box), "span_pool" (`pool_span` over the sentence's tokens in the caption), all [B, E] L2-normalised fp32, and
    [B] bools "seg_valid", "patch_valid" (a segment whose box covers a patch), "span_valid" (a segment whose
    sentence was found in the caption's tokens)."""
    valid = inputs["seg_valid"].astype(bool)
    patches, span = inputs["seg_patches"].astype(jnp.float32), inputs["seg_span"].astype(jnp.float32)
    return {"seg_img": l2_normalize(model.image_tower(inputs["seg_image"], rng=dropout_key(rng, 2))[0]),
            "seg_txt": l2_normalize(model.text_tower(inputs["seg_tokens"], rng=dropout_key(rng, 3))[0]),
            "patch_pool": l2_normalize(pool_patches(model, hidden["image"], patches)),
            "span_pool": l2_normalize(pool_span(model, hidden["text"], span)),
            "seg_valid": valid, "patch_valid": valid & (jnp.sum(patches, axis=1) > 0),
            "span_valid": valid & (jnp.sum(span, axis=1) > 0)}

  def __call__(self, out, ctx, sched):
    del sched
    count = lambda v: jnp.maximum(ctx.psum(jnp.sum(v.astype(jnp.float32))), 1.0)  # noqa: E731
    n_seg, n_patch, n_span = count(out["seg_valid"]), count(out["patch_valid"]), count(out["span_valid"])
    seg_gamma = ctx.gamma if self.segment_margin else 0
    si2t, st2i = losses.contrastive_rows(out["seg_img"], out["seg_txt"], ctx.gather(out["seg_img"]),
                                         ctx.gather(out["seg_txt"]), ctx.scale, seg_gamma, ctx.offset,
                                         valid_all=ctx.gather(out["seg_valid"]))
    patch = cosine_mse_rows(out["patch_pool"], out["seg_img"], out["patch_valid"])
    span = cosine_mse_rows(out["span_pool"], out["seg_txt"], out["span_valid"])
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


# ---- Per-example inputs (the input pipeline) ---------------------------------------------------------------------

def locate_sentence(caption: str, sentence: str):
  """(start, end) characters of `sentence` in `caption` (white space and letter case may differ), or None."""
  i = caption.find(sentence)
  if i >= 0:
    return i, i + len(sentence)
  words = sentence.split()
  if not words:
    return None
  m = re.search(r"\s+".join(re.escape(w) for w in words), caption, flags=re.IGNORECASE)
  return (m.start(), m.end()) if m else None


def box_to_patches(box, width: int, height: int, image_size: int, patch_size: int) -> np.ndarray:
  """float32 [g*g] (g = image_size // patch_size, row-major like the patch tokens): 1 on the patches a box of the
  original width x height image covers after `resize_center_crop` to image_size (the same resize and crop as the
  image); all 0 when the crop cut the box away."""
  if width <= height:
    new_w, new_h = image_size, int(image_size * height / width)
  else:
    new_w, new_h = int(image_size * width / height), image_size
  left, top = (new_w - image_size) // 2, (new_h - image_size) // 2
  x0, y0, x1, y1 = (float(v) for v in box)
  x0, x1 = x0 * new_w / width - left, x1 * new_w / width - left
  y0, y1 = y0 * new_h / height - top, y1 * new_h / height - top
  g = image_size // patch_size
  c0, c1 = max(int(np.floor(x0 / patch_size)), 0), min(int(np.ceil(x1 / patch_size)), g)
  r0, r1 = max(int(np.floor(y0 / patch_size)), 0), min(int(np.ceil(y1 / patch_size)), g)
  mask = np.zeros((g, g), np.float32)
  if c1 > c0 and r1 > r0:
    mask[r0:r1, c0:c1] = 1.0
  return mask.reshape(-1)


def segment_inputs(ex, caption: str, tokenizer, image_size: int, patch_size: int, seed: int, step: int,
                   index: int) -> dict:
  """The GOAL inputs of one example: its chosen segment's crop ("seg_image", CLIP-preprocessed like any image),
  sentence tokens ("seg_tokens"), the patches under its box ("seg_patches" [g*g]), the positions of the sentence
  among the caption's tokens ("seg_span" [L], 0 where the sentence is not in this caption or was truncated) and
  "seg_valid" (False for an example without segments: every segment term leaves it out)."""
  g, length = image_size // patch_size, tokenizer.context_length
  segments = segments_of(ex)
  if not segments:
    return {"seg_image": np.zeros((image_size, image_size, 3), np.float32), "seg_tokens": tokenizer([""])[0],
            "seg_patches": np.zeros(g * g, np.float32), "seg_span": np.zeros(length, np.float32),
            "seg_valid": np.bool_(False)}
  seg = segments[segment_choice(segments, seed, step, index)]
  image = ex["image"] if isinstance(ex["image"], Image.Image) else Image.fromarray(np.asarray(ex["image"]).squeeze())
  image = image.convert("RGB")
  box = manual.check_box(list(seg["box"]), image.width, image.height, f"example {index} segment")
  span = np.zeros(length, np.float32)
  where = locate_sentence(caption, seg["sentence"])
  if where is not None:
    span[tokenizer.span_positions(caption, *where)] = 1.0
  return {"seg_image": pipeline.clip_preprocess(manual.crop_box(image, box), image_size),
          "seg_tokens": tokenizer([seg["sentence"]])[0],
          "seg_patches": box_to_patches(box, image.width, image.height, image_size, patch_size),
          "seg_span": span, "seg_valid": np.bool_(True)}


class SegmentInputs:
  """The input pipeline's per-example GOAL inputs (picklable for grain's workers)."""

  def __init__(self, tokenizer, image_size: int, patch_size: int):
    self.tokenizer, self.image_size, self.patch_size = tokenizer, image_size, patch_size

  def __call__(self, example, caption, image, seed, step, index):
    del image
    return segment_inputs(example, caption, self.tokenizer, self.image_size, self.patch_size, seed, step, index)


def inputs(config, model_cfg, tokenizer):
  del config
  if model_cfg.family != "clip":
    raise ValueError(f"config.framework='goal' crops and preprocesses images and locates sentences among "
                     f"tokens the CLIP way; model.family={model_cfg.family!r} is not supported by it (use a CLIP "
                     "model, or the longclip framework)")
  return SegmentInputs(tokenizer, model_cfg.image_size, model_cfg.patch_size)


def input_specs(config, model_cfg) -> dict:
  del config
  s, l = model_cfg.image_size, model_cfg.text_context
  return {"seg_image": ((s, s, 3), "float32"), "seg_tokens": ((l,), "int32"),
          "seg_patches": (((s // model_cfg.patch_size) ** 2,), "float32"), "seg_span": ((l,), "float32"),
          "seg_valid": ((), "bool")}
