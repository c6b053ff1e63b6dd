"""StructXLIP: edge maps against structure captions (InfoNCE, s held constant, optionally with γ·Ḡ), the RGB-edge
consistency 1 − cos, and the multi-positive local term of caption chunks against the example's own segment edge
crops, with per-epoch weight factors, added to L_HN.

This module holds all of StructXLIP: its config block (`config.structxlip`) and checks, its per-example inputs
(`inputs`, `input_specs`; edge maps and chunks are made by `structure_inputs` with
hnclip_jax/frameworks/structure.py), its model outputs (`StructXLIPTerm.outputs`: the towers over the edge maps,
crops and structure caption, and `pool_chunks`), its loss term and its logit-scale clamp; docs/frameworks.md
describes the method."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from hnclip_jax import losses
from hnclip_jax.data import manual, pipeline
from hnclip_jax.frameworks.base import Term, one_epoch_as_steps
from hnclip_jax.frameworks.segments import check_segments, segments_of, top_segments
from hnclip_jax.models.clip import dropout_key, l2_normalize


TITLE = "StructXLIP"
# config.structxlip; defaults = the authors' released structxlip/train.py. Besides L_HN: structure_weight ·
# InfoNCE(edge map of the image, caption without appearance words) (s held constant), consistency_weight ·
# (1 − cos(image, its edge map)), local_weight · multi-positive InfoNCE of word-window chunks of that caption
# against the edge maps of the example's top_k segment crops (all crops of the batch the candidates; multiplier
# min(s / tau, 100)). Each weight is 1x in epochs 0-1, then decays (cosine) to its floor (floors: structure,
# consistency, local) at epoch decay_epochs; steps_per_epoch -1 = the training split / batch. remove: the word
# groups taken out of the structure caption (hnclip_jax/frameworks/structure.py VISUAL_WORDS); canny_low/high: the edge
# maps' thresholds (OpenCV Canny on the preprocessed image); base_window, stride, max_chunks: the chunks;
# logit_scale_max: the logit-scale parameter is clamped to [0, this] (s <= e^3.5 = 33). structure_margin: put
# L_HN's margin (γ·Ḡ of the structure captions) in the structure term too.
CONFIG = {"structure_weight": 0.5, "consistency_weight": 0.05, "local_weight": 0.1, "floors": (0.7, 0.5, 0.4),
          "decay_epochs": 8, "steps_per_epoch": -1, "top_k": 3, "tau": 0.07, "base_window": 3, "stride": 1,
          "max_chunks": 64, "remove": ("colors",), "canny_low": 100.0, "canny_high": 200.0, "logit_scale_max": 3.5,
          "structure_margin": False}
NON_NEGATIVE = ("structure_weight", "consistency_weight", "local_weight", "canny_low", "canny_high",
                "logit_scale_max")


def model_fields(config) -> dict:
  """Raises naming the config.structxlip key that cannot work; StructXLIP changes no architecture field."""
  from hnclip_jax.frameworks import structure  # (OpenCV: imported only when StructXLIP is chosen)
  sx = config.structxlip
  for key in ("top_k", "max_chunks", "base_window", "stride", "decay_epochs"):
    if int(sx[key]) < 1:
      raise ValueError(f"config.structxlip.{key}={sx[key]!r} must be >= 1")
  if int(sx.steps_per_epoch) < -1:
    raise ValueError(f"config.structxlip.steps_per_epoch={sx.steps_per_epoch}; use -1 (the training split / batch "
                     "size), 0 (no schedule) or a step count")
  if len(tuple(sx.floors)) != 3 or not all(0 <= float(f) <= 1 for f in sx.floors):
    raise ValueError(f"config.structxlip.floors={tuple(sx.floors)!r}: three numbers in [0, 1] (structure, "
                     "consistency, local)")
  if not float(sx.tau) > 0:
    raise ValueError(f"config.structxlip.tau={sx.tau!r} must be positive")
  if not float(sx.canny_low) < float(sx.canny_high):
    raise ValueError(f"config.structxlip.canny_low={sx.canny_low} must be below canny_high={sx.canny_high}")
  structure.filter_caption("x", (sx.remove,) if isinstance(sx.remove, str) else tuple(sx.remove))  # known groups
  return {}


# Its per-example inputs (made by `inputs`: `structure_inputs`): the image's edge map
# [H, W, 3], the best segments' crops' edge maps [K, H, W, 3] and which exist [K], the caption without appearance
# words [L] and its word-window chunks [C, L].
STRUCTURE_KEYS = ("sx_edge", "sx_crop_edges", "sx_crop_valid", "sx_tokens", "sx_chunks")


def resolve_epochs(config, steps_per_epoch: int):
  """config.structxlip.steps_per_epoch = -1 (the training split's) as steps."""
  return one_epoch_as_steps(config, "structxlip.steps_per_epoch", steps_per_epoch)


def logit_scale_max(config) -> float:
  """The logit-scale parameter's upper clamp in StructXLIP (the authors' 3.5: s <= 33), not ln 100."""
  return float(config.structxlip.logit_scale_max)


def pool_chunks(model, hidden, masks):
  """The chunk embeddings: for each chunk (masks [B, C, L], 1 on its tokens) the text tower's last-block outputs
  (hidden [B, L, W]) weighted by a softmax, over the chunk's tokens, of their norms (a constant: no gradient through
  the weights), then the final LayerNorm and projection -> [B, C, E], unnormalised."""
  norms = jax.lax.stop_gradient(jnp.linalg.norm(hidden.astype(jnp.float32), axis=-1))  # [B, L]
  inside = masks > 0
  w = jax.nn.softmax(jnp.where(inside, norms[:, None, :], -1e30), axis=-1) * inside  # empty chunk: all 0
  precision = jax.lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else None
  pooled = jnp.einsum("bcl,blw->bcw", w.astype(hidden.dtype), hidden, precision=precision,
                      preferred_element_type=jnp.float32).astype(hidden.dtype)
  return model.ln_final(pooled) @ model.text_projection[...].astype(hidden.dtype)


def multi_positive_rows(chunks, chunk_valid, crops_all, crop_valid_all, logit_scale, row_offset):
  """StructXLIP's local term for a block of rows: each chunk of a row's caption against every valid crop of the
  batch, multi-positive InfoNCE with the row's own valid crops as the positives.

  chunks [n, C, E], chunk_valid [n, C] bool: rows `row_offset .. row_offset+n`; crops_all [B, K, E],
  crop_valid_all [B, K] bool: the whole batch (L2-normalised features). Per chunk c of row i:
  lse_{valid (b, k)} s·⟨c, crop_bk⟩ − lse_{valid (i, k)} s·⟨c, crop_ik⟩. Returns (loss [n]: the mean over the row's
  valid chunks, 0 where it has no valid chunk or no valid crop; applies [n] bool: where it has both).
  """
  n, c, e = chunks.shape
  b, k, _ = crops_all.shape
  logits = logit_scale.astype(losses.F32) * losses.sims(chunks.reshape(n * c, e), crops_all.reshape(b * k, e),
                                                        "ne,me->nm")
  logits = logits.reshape(n, c, b, k)
  mine = (row_offset + jnp.arange(n))[:, None] == jnp.arange(b)[None, :]  # [n, B]
  pos = mine[:, None, :, None] & crop_valid_all[None, None]  # [n, 1, B, K]
  den = jax.nn.logsumexp(jnp.where(crop_valid_all[None, None], logits, losses.NEG).reshape(n, c, -1), axis=-1)
  num = jax.nn.logsumexp(jnp.where(pos, logits, losses.NEG).reshape(n, c, -1), axis=-1)
  per_chunk = jnp.where(chunk_valid, den - num, 0.0)
  count = jnp.sum(chunk_valid, axis=1)
  applies = (count > 0) & jnp.any(pos.reshape(n, -1), axis=1)
  return jnp.where(applies, jnp.sum(per_chunk, axis=1) / jnp.maximum(count, 1), 0.0), applies


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

  def outputs(self, model, out, inputs, rng=None, hidden=None):
    """"sx_edge_img" (the edge map's embedding), "sx_crop_img" [B, K, E] (the segment crops' edge maps'), "sx_txt"
    (the caption without appearance words), "sx_chunks" [B, C, E] (`pool_chunks` of that caption's chunks), all
    L2-normalised fp32, and bools "sx_crop_valid" [B, K], "sx_chunk_valid" [B, C] (a chunk with a token)."""
    crops = inputs["sx_crop_edges"]
    b, k = crops.shape[:2]
    res = {"sx_edge_img": l2_normalize(model.image_tower(inputs["sx_edge"], rng=dropout_key(rng, 4))[0])}
    crop_emb = model.image_tower(crops.reshape(b * k, *crops.shape[2:]), rng=dropout_key(rng, 5))[0]
    res["sx_crop_img"] = l2_normalize(crop_emb).reshape(b, k, -1)
    sx_txt, _, sx_hidden = model.text_tower_hidden(inputs["sx_tokens"], rng=dropout_key(rng, 6))
    masks = inputs["sx_chunks"].astype(jnp.float32)
    res["sx_txt"] = l2_normalize(sx_txt)
    res["sx_chunks"] = l2_normalize(pool_chunks(model, sx_hidden, masks))
    res["sx_crop_valid"] = inputs["sx_crop_valid"].astype(bool)
    res["sx_chunk_valid"] = jnp.sum(masks, axis=-1) > 0
    return res

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
    loc, applies = multi_positive_rows(
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


def check_data(config, objective) -> str | None:
  """Its local term reads segments (the others need none)."""
  term = objective.term(StructXLIPTerm)
  return check_segments(config) if term is not None and term.local_weight > 0 else None


# ---- Per-example inputs (the input pipeline) ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StructureSettings:
  """config.structxlip's input settings (`from_config`)."""
  top_k: int = 3  # segment edge crops per example
  canny_low: float = 100.0
  canny_high: float = 200.0
  remove: tuple = ("colors",)  # structure.VISUAL_WORDS groups removed from the structure caption
  base_window: int = 3
  stride: int = 1
  max_chunks: int = 64

  @classmethod
  def from_config(cls, sx) -> "StructureSettings":
    remove = (sx.remove,) if isinstance(sx.remove, str) else tuple(sx.remove)
    return cls(int(sx.top_k), float(sx.canny_low), float(sx.canny_high), remove, int(sx.base_window),
               int(sx.stride), int(sx.max_chunks))


def structure_inputs(ex, caption: str, image_u8: np.ndarray, tokenizer, image_size: int, settings: StructureSettings,
                     seed: int, step: int, index: int) -> dict:
  """StructXLIP's inputs of one example: "sx_edge" (the edge map of the preprocessed image `image_u8`,
  CLIP-normalised), "sx_crop_edges" [top_k, S, S, 3] (edge maps of the best segments' crops, each crop
  preprocessed like an image first) with "sx_crop_valid" [top_k], "sx_tokens" (the caption without appearance
  words) and "sx_chunks" [max_chunks, L] (its word-window chunks as token masks)."""
  from hnclip_jax.frameworks import structure  # (OpenCV: imported only when StructXLIP is chosen)
  st = settings
  edge = pipeline.normalize(structure.edge_map(image_u8, st.canny_low, st.canny_high))
  crops = np.zeros((st.top_k, image_size, image_size, 3), np.float32)
  valid = np.zeros(st.top_k, bool)
  segments = segments_of(ex)
  if segments:
    image = ex["image"] if isinstance(ex["image"], Image.Image) else Image.fromarray(np.asarray(ex["image"]).squeeze())
    image = image.convert("RGB")
    for j, seg in enumerate(top_segments(segments, st.top_k, seed, step, index)):
      box = manual.check_box(list(seg["box"]), image.width, image.height, f"example {index} segment")
      crop = pipeline.resize_center_crop(manual.crop_box(image, box), image_size)
      crops[j], valid[j] = pipeline.normalize(structure.edge_map(crop, st.canny_low, st.canny_high)), True
  filtered = structure.filter_caption(caption, st.remove)
  return {"sx_edge": edge, "sx_crop_edges": crops, "sx_crop_valid": valid, "sx_tokens": tokenizer([filtered])[0],
          "sx_chunks": structure.chunk_masks(filtered, tokenizer, st.max_chunks, st.base_window, st.stride)}


class StructureInputs:
  """The input pipeline's per-example StructXLIP inputs (picklable for grain's workers)."""

  def __init__(self, tokenizer, image_size: int, settings):
    self.tokenizer, self.image_size, self.settings = tokenizer, image_size, settings

  def __call__(self, example, caption, image, seed, step, index):
    return structure_inputs(example, caption, image, self.tokenizer, self.image_size, self.settings, seed, step,
                            index)


def inputs(config, model_cfg, tokenizer):
  if model_cfg.family != "clip":
    raise ValueError(f"config.framework='structxlip' crops and preprocesses images and locates sentences among "
                     f"tokens the CLIP way; model.family={model_cfg.family!r} is not supported by it (use a CLIP "
                     "model, or the longclip framework)")
  return StructureInputs(tokenizer, model_cfg.image_size, StructureSettings.from_config(config.structxlip))


def input_specs(config, model_cfg) -> dict:
  s, l = model_cfg.image_size, model_cfg.text_context
  k, c = int(config.structxlip.top_k), int(config.structxlip.max_chunks)
  return {"sx_edge": ((s, s, 3), "float32"), "sx_tokens": ((l,), "int32"),
          "sx_crop_edges": ((k, s, s, 3), "float32"), "sx_crop_valid": ((k,), "bool"),
          "sx_chunks": ((c, l), "float32")}
