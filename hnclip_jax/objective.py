"""The training objective: model outputs -> (loss, per-term metrics), on a device mesh.

One `Objective`, built from `config.loss`, is the only place the loss is assembled. The train step, the
global-batch accumulation path, the saturation telemetry and the HN-vs-InfoNCE gradient comparison all call it on
the model's outputs dict (`CLIP.__call__`: "img", "txt", "scale" and, when a term asks, "img_tokens",
"txt_tokens", "txt_mask").

    L = w_g·L_HN(γ) + λ·L_tok + w_f·ramp(step)·L_FineLIP + w_s·L_seg + w_p·L_patch + w_t·L_span
        + Σ_k w_k·factor_k(epoch)·L_k,  k ∈ {struct, consist, local}
                                                              (paper Eq. 2 and 3; λ = config.loss.token_weight)

w_g = 1 and w_f = 0 except in config.framework="finelip" (docs/frameworks.md): there L_FineLIP is FineLIP's hinge
over late-interaction scores of aggregated tokens, w_f = config.finelip.weight, ramped linearly from 0 over
config.finelip.ramp_steps, and w_g = config.finelip.global_weight (FineLIP's released code has no global term; the
paper's swap adds L_HN). w_s, w_p, w_t are GOAL's (config.framework="goal", config.goal): L_seg is InfoNCE between
segment crops and their sentences over the examples that have a segment (with γ·Ḡ of the sentences when
config.goal.segment_margin), L_patch = mean (cos(patch_pool, seg_img) − 1)², L_span = mean (cos(span_pool,
seg_txt) − 1)², each over the examples where it applies. The last sum is StructXLIP's (config.framework="structxlip",
config.structxlip): InfoNCE of edge maps vs structure captions (s constant), 1 − cos(image, edge map), and the
multi-positive InfoNCE of structure-caption chunks vs the example's own segment edge crops among all the batch's;
docs/frameworks.md.

On a mesh every device all-gathers what its terms need, builds only its own rows of each B×B score matrix against
the whole batch (the math is in `hnclip_jax.losses`), and the per-device sums are reduced with psum; the gather's
transpose is a reduce-scatter, so gradients stay sharded and equal the single-device ones.

How to add a term: (1) if it needs new per-example outputs, add them to `CLIP.__call__` behind a keyword (and to
`model_kwargs` below, so only objectives that use them pay for them); (2) write its math in `losses.py` as a
function of a block of rows against the whole batch; (3) call it in `Objective.__call__`'s `local` with its weight
and add its per-example loss to `per`; (4) add its weight and settings to `config.loss` (hnclip_jax/config.py) and
`from_config`. Accumulation, telemetry, the gradient comparison and sharding then work without further changes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hnclip_jax import losses, sharding
from hnclip_jax.models.clip import SEGMENT_KEYS, STRUCTURE_KEYS

# Outputs without a batch dimension (everything else in an outputs dict is [B, ...]).
GLOBAL_OUTPUTS = ("scale",)


@dataclasses.dataclass(frozen=True)
class Objective:
  """L_HN(γ) + λ·L_tok. Fields mirror config.loss (see hnclip_jax/config.py and docs/objective.md)."""
  gamma: float = 0.5
  token_weight: float = 0.0  # λ; 0 turns the token term (and the token outputs) off
  chunk_size: int = 0  # rows per device computed at a time (0: all rows for L_HN, losses.TOKEN_BLOCK for L_tok)
  token_layer: int = -1  # which transformer block's tokens (-1: the last), through the tower's final LN + projection
  token_image_cls: bool = False  # include the image CLS token among the patches
  token_logit_scale: float = 0.0  # 0: the model's learned s; > 0: this fixed multiplier for the token logits
  token_margin: bool = False  # also add γ·Ḡ to the token logits
  token_schedule: str = "gather"  # "gather": all caption tokens on every device | "ring": tiles passed around
  global_weight: float = 1.0  # w_g: weight of L_HN
  finelip_weight: float = 0.0  # w_f: FineLIP's hinge on aggregated tokens (0: off; the model needs aggregators)
  finelip_margin: float = 0.2  # the hinge's margin
  finelip_reduction: str = "sum"  # "sum" over every violating pair (FineLIP) | "mean": divided by the batch size
  finelip_ramp_steps: int = 0  # w_f ramps linearly from 0 to 1 over these steps (0: no ramp)
  finelip_hn_margin: bool = False  # also add γ·Ḡ to the hinge's negatives
  goal_segment_weight: float = 0.0  # w_s: GOAL's segment contrastive term (0 with the other two: no segments read)
  goal_patch_weight: float = 0.0  # w_p: GOAL's patch-pool-to-crop alignment
  goal_text_weight: float = 0.0  # w_t: GOAL's sentence-span-to-sentence alignment
  goal_segment_margin: bool = False  # L_HN's margin (γ·Ḡ of the sentences) in the segment term too
  sx_structure_weight: float = 0.0  # StructXLIP: edge map vs caption-without-appearance-words InfoNCE
  sx_consistency_weight: float = 0.0  # StructXLIP: 1 − cos(image, its edge map)
  sx_local_weight: float = 0.0  # StructXLIP: caption chunks vs the example's own segment edge crops
  sx_floors: tuple = (0.7, 0.5, 0.4)  # the three weights' schedule floors
  sx_decay_epochs: int = 8  # the weights decay (cosine) from epoch 1 to this epoch, then stay at the floor
  sx_steps_per_epoch: int = 0  # 0: no schedule (full weights)
  sx_tau: float = 0.07  # the local term's temperature: its multiplier is min(s / tau, 100)
  sx_structure_margin: bool = False  # L_HN's margin (γ·Ḡ of the structure captions) in the structure term too
  batch_axes: tuple = sharding.BATCH_AXES

  @classmethod
  def from_config(cls, loss_cfg, config=None) -> "Objective":
    """From config.loss; with the whole `config`, also the framework's terms (config.framework, config.finelip)."""
    obj = cls(gamma=float(loss_cfg.gamma), token_weight=float(loss_cfg.token_weight),
              chunk_size=int(loss_cfg.chunk_size), token_layer=int(loss_cfg.token_layer),
              token_image_cls=bool(loss_cfg.token_image_cls), token_logit_scale=float(loss_cfg.token_logit_scale),
              token_margin=bool(loss_cfg.token_margin), token_schedule=str(loss_cfg.get("token_schedule", "gather")))
    if config is not None and config.get("framework", "longclip") == "finelip":
      f = config.finelip
      obj = obj.replace(global_weight=float(f.global_weight), finelip_weight=float(f.weight),
                        finelip_margin=float(f.margin), finelip_reduction=str(f.reduction),
                        finelip_ramp_steps=max(int(f.ramp_steps), 0), finelip_hn_margin=bool(f.hn_margin))
    if config is not None and config.get("framework", "longclip") == "goal":
      g = config.goal
      obj = obj.replace(goal_segment_weight=float(g.segment_weight), goal_patch_weight=float(g.patch_weight),
                        goal_text_weight=float(g.text_weight), goal_segment_margin=bool(g.segment_margin))
    if config is not None and config.get("framework", "longclip") == "structxlip":
      x = config.structxlip
      obj = obj.replace(sx_structure_weight=float(x.structure_weight),
                        sx_consistency_weight=float(x.consistency_weight),
                        sx_local_weight=float(x.local_weight), sx_floors=tuple(float(f) for f in x.floors),
                        sx_decay_epochs=int(x.decay_epochs), sx_steps_per_epoch=max(int(x.steps_per_epoch), 0),
                        sx_tau=float(x.tau), sx_structure_margin=bool(x.structure_margin))
    return obj

  def check(self, model_cfg) -> None:
    """Raises naming the config key if this objective cannot run on `model_cfg` (before anything compiles)."""
    layers = min(model_cfg.vision_layers, model_cfg.text_layers)
    if self.needs_aggregates and not model_cfg.aggregate_tokens:
      raise ValueError("config.framework='finelip' needs the model's token aggregators, but this model has none "
                       "(config.finelip.tokens=0?)")
    if self.finelip_reduction not in ("sum", "mean"):
      raise ValueError(f"config.finelip.reduction={self.finelip_reduction!r}; choose 'sum' (FineLIP) or 'mean'")
    if (self.needs_tokens or self.needs_aggregates) and not -layers <= self.token_layer < layers:
      raise ValueError(f"config.loss.token_layer={self.token_layer} is outside the towers' blocks (the model has "
                       f"{model_cfg.vision_layers} vision and {model_cfg.text_layers} text blocks); use -1 for the "
                       f"last block or an index in [-{layers}, {layers})")

  def replace(self, **changes) -> "Objective":
    return dataclasses.replace(self, **changes)

  @property
  def needs_tokens(self) -> bool:
    return self.token_weight > 0

  @property
  def needs_aggregates(self) -> bool:
    return self.finelip_weight > 0

  @property
  def needs_segments(self) -> bool:
    return self.goal_segment_weight > 0 or self.goal_patch_weight > 0 or self.goal_text_weight > 0

  @property
  def needs_structure(self) -> bool:
    return self.sx_structure_weight > 0 or self.sx_consistency_weight > 0 or self.sx_local_weight > 0

  @property
  def term_names(self) -> tuple:
    return (("hn",) + (("tok",) if self.needs_tokens else ()) + (("fine",) if self.needs_aggregates else ())
            + (("seg", "patch", "span") if self.needs_segments else ())
            + (("struct", "consist", "local") if self.needs_structure else ()))

  @property
  def input_keys(self) -> tuple:
    """The batch entries `forward` reads."""
    return (("image", "tokens") + (SEGMENT_KEYS if self.needs_segments else ())
            + (STRUCTURE_KEYS if self.needs_structure else ()))

  @property
  def model_kwargs(self) -> dict:
    """Keyword arguments of `CLIP.__call__` that produce the outputs this objective reads."""
    kw = {}
    if self.needs_tokens or self.needs_aggregates:
      kw.update(token_layer=self.token_layer, image_cls_token=self.token_image_cls)
    if self.needs_aggregates:
      kw["aggregate"] = True
    return kw

  def forward(self, model, inputs: dict, rng=None) -> dict:
    """The model's outputs dict for a batch: inputs {"image" [B, H, W, 3], "tokens" [B, L], and the segment inputs
    when a GOAL term is on} (`input_keys`); rng: adapter dropout key."""
    segments = {k: inputs[k] for k in SEGMENT_KEYS} if self.needs_segments else None
    structure = {k: inputs[k] for k in STRUCTURE_KEYS} if self.needs_structure else None
    out = model(inputs["image"], inputs["tokens"], dropout_rng=rng, segments=segments, structure=structure,
                **self.model_kwargs)
    if not self.needs_tokens:  # the aggregates were made from them; the loss does not read them
      out = {k: v for k, v in out.items() if k not in ("img_tokens", "txt_tokens", "txt_mask")}
    return out

  def ramp(self, step):
    """w_f's ramp at `step` (None: 1, the full weight)."""
    if step is None or not self.finelip_ramp_steps:
      return jnp.float32(1.0)
    return jnp.minimum(jnp.asarray(step, jnp.float32) / self.finelip_ramp_steps, 1.0)

  def sx_factors(self, step):
    """StructXLIP's per-epoch weight factors at `step` ([3]: structure, consistency, local; None: epoch 0): 1 in
    epochs 0 and 1, then a cosine decay to each floor at epoch `sx_decay_epochs`, the floor after."""
    floors = jnp.asarray(self.sx_floors, jnp.float32)
    if step is None or not self.sx_steps_per_epoch:
      return jnp.ones(3, jnp.float32)
    epoch = jnp.floor(jnp.asarray(step, jnp.float32) / self.sx_steps_per_epoch)
    span = max(self.sx_decay_epochs - 1, 1)
    progress = jnp.clip(epoch - 1.0, 0.0, span)
    return floors + (1.0 - floors) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress / span))

  def __call__(self, outputs: dict, mesh, step=None):
    """outputs: the model's outputs dict, [B, ...] leaves sharded over the batch axes of `mesh`; step: the train
    step (for FineLIP's ramp; None = fully ramped).

    Returns (loss scalar, aux) with aux = {"terms": {"hn": L_HN, "tok": L_tok, "fine": L_FineLIP (when on)},
    "per_example": [B] each example's loss (½(i2t + t2i) of the contrastive terms, i2t + t2i of the hinge,
    weighted)}. Value and gradients equal the single-device ones.
    """
    axes = tuple(self.batch_axes)
    batch = outputs["img"].shape[0]
    specs = {k: P() if k in GLOBAL_OUTPUTS else P(axes) for k in outputs}

    sched = {"ramp": self.ramp(step) if self.needs_aggregates else jnp.float32(1.0),
             "sx": self.sx_factors(step) if self.needs_structure else jnp.ones(3, jnp.float32)}

    def local(out, sched):
      ramp = sched["ramp"]
      n = out["img"].shape[0]
      offset = jax.lax.axis_index(axes) * n
      gather = lambda x: jax.lax.all_gather(x, axes, axis=0, tiled=True)  # [n, ...] -> [B, ...]
      scale = out["scale"]
      img_all, txt_all = gather(out["img"]), gather(out["txt"])
      i2t, t2i = self._global_rows(out["img"], out["txt"], img_all, txt_all, scale, offset)
      terms = {"hn": jax.lax.psum(jnp.sum(i2t) + jnp.sum(t2i), axes) / (2 * batch)}
      per = self.global_weight * 0.5 * (i2t + t2i)
      loss = self.global_weight * terms["hn"]
      if self.needs_tokens:
        tok_scale = scale if self.token_logit_scale == 0 else jnp.asarray(self.token_logit_scale, jnp.float32)
        margin = (self.gamma, out["txt"], txt_all) if self.token_margin and losses.has_margin(self.gamma) else None
        # [B, n] columns of S^T (all captions vs this device's images) -> this device's [n, B] rows of it.
        cols_to_rows = lambda x: jax.lax.all_to_all(x, axes, 0, 1, tiled=True)
        if self.token_schedule == "ring":  # caption-token tiles around the batch axes: O(n) tokens per device
          ti2t, tt2i = losses.token_rows_ring(
              out["img_tokens"], out["txt_tokens"], out["txt_mask"], tok_scale, offset, axes, batch // n,
              block=self.chunk_size or losses.TOKEN_BLOCK, margin=margin)
        else:
          ti2t, tt2i = losses.token_rows(
              out["img_tokens"], gather(out["txt_tokens"]), gather(out["txt_mask"]), tok_scale, offset,
              block=self.chunk_size or losses.TOKEN_BLOCK, margin=margin, cols_to_rows=cols_to_rows)
        terms["tok"] = jax.lax.psum(jnp.sum(ti2t) + jnp.sum(tt2i), axes) / (2 * batch)
        per = per + self.token_weight * 0.5 * (ti2t + tt2i)
        loss = loss + self.token_weight * terms["tok"]
      if self.needs_aggregates:
        margin = (self.gamma, out["txt"], txt_all) if self.finelip_hn_margin and losses.has_margin(self.gamma) else None
        fi2t, ft2i = losses.hinge_rows(
            out["img_agg"], gather(out["txt_agg"]), offset, self.finelip_margin,
            block=self.chunk_size or losses.TOKEN_BLOCK, hn_margin=margin,
            cols_to_rows=lambda x: jax.lax.all_to_all(x, axes, 0, 1, tiled=True))
        norm = batch if self.finelip_reduction == "mean" else 1
        terms["fine"] = jax.lax.psum(jnp.sum(fi2t) + jnp.sum(ft2i), axes) / norm
        weight = self.finelip_weight * ramp
        per = per + weight * (fi2t + ft2i) / norm
        loss = loss + weight * terms["fine"]
      if self.needs_segments:
        count = lambda v: jnp.maximum(jax.lax.psum(jnp.sum(v.astype(jnp.float32)), axes), 1.0)  # noqa: E731
        n_seg, n_patch, n_span = count(out["seg_valid"]), count(out["patch_valid"]), count(out["span_valid"])
        seg_gamma = self.gamma if self.goal_segment_margin else 0
        si2t, st2i = losses.contrastive_rows(out["seg_img"], out["seg_txt"], gather(out["seg_img"]),
                                             gather(out["seg_txt"]), scale, seg_gamma, offset,
                                             valid_all=gather(out["seg_valid"]))
        patch = losses.cosine_mse_rows(out["patch_pool"], out["seg_img"], out["patch_valid"])
        span = losses.cosine_mse_rows(out["span_pool"], out["seg_txt"], out["span_valid"])
        terms["seg"] = jax.lax.psum(jnp.sum(si2t) + jnp.sum(st2i), axes) / (2 * n_seg)
        terms["patch"] = jax.lax.psum(jnp.sum(patch), axes) / n_patch
        terms["span"] = jax.lax.psum(jnp.sum(span), axes) / n_span
        # Per-example shares of the masked means: they average to each term over the whole batch.
        per = per + batch * (self.goal_segment_weight * 0.5 * (si2t + st2i) / n_seg
                             + self.goal_patch_weight * patch / n_patch + self.goal_text_weight * span / n_span)
        loss = loss + (self.goal_segment_weight * terms["seg"] + self.goal_patch_weight * terms["patch"]
                       + self.goal_text_weight * terms["span"])
      if self.needs_structure:
        w_sc, w_rgb, w_loc = (sched["sx"][j] * w for j, w in enumerate(
            (self.sx_structure_weight, self.sx_consistency_weight, self.sx_local_weight)))
        # The structure term's logits use s as a constant (the authors detach it); the local term's use
        # min(s / tau, 100) with s trained.
        sc_gamma = self.gamma if self.sx_structure_margin else 0
        xi2t, xt2i = losses.contrastive_rows(out["sx_edge_img"], out["sx_txt"], gather(out["sx_edge_img"]),
                                             gather(out["sx_txt"]), jax.lax.stop_gradient(scale), sc_gamma, offset)
        consist = 1.0 - jnp.sum(out["img"].astype(jnp.float32) * out["sx_edge_img"], axis=-1)
        loc, applies = losses.multi_positive_rows(
            out["sx_chunks"], out["sx_chunk_valid"], gather(out["sx_crop_img"]), gather(out["sx_crop_valid"]),
            jnp.minimum(scale / self.sx_tau, 100.0), offset)
        n_loc = jnp.maximum(jax.lax.psum(jnp.sum(applies.astype(jnp.float32)), axes), 1.0)
        terms["struct"] = jax.lax.psum(jnp.sum(xi2t) + jnp.sum(xt2i), axes) / (2 * batch)
        terms["consist"] = jax.lax.psum(jnp.sum(consist), axes) / batch
        terms["local"] = jax.lax.psum(jnp.sum(loc), axes) / n_loc
        per = per + w_sc * 0.5 * (xi2t + xt2i) + w_rgb * consist + w_loc * batch * loc / n_loc
        loss = loss + w_sc * terms["struct"] + w_rgb * terms["consist"] + w_loc * terms["local"]
      return loss, {"terms": terms, "per_example": per}

    out_specs = (P(), {"terms": {k: P() for k in self.term_names},
                       "per_example": P(axes)})
    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=out_specs)
    return fn({k: (jnp.asarray(v, jnp.float32) if k in GLOBAL_OUTPUTS else v) for k, v in outputs.items()}, sched)

  def _global_rows(self, img, txt, img_all, txt_all, scale, offset):
    """L_HN's per-example (i2t [n], t2i [n]) for this device's rows, `chunk_size` rows at a time if set."""
    n, chunk = img.shape[0], self.chunk_size
    if not chunk or chunk >= n:
      return losses.contrastive_rows(img, txt, img_all, txt_all, scale, self.gamma, offset)
    if n % chunk:
      raise ValueError(f"config.loss.chunk_size={chunk} must divide the per-device batch {n}")

    @jax.checkpoint
    def block(k, img_c, txt_c):
      return losses.contrastive_rows(img_c, txt_c, img_all, txt_all, scale, self.gamma, offset + k * chunk)

    split = lambda x: x.reshape(n // chunk, chunk, x.shape[-1])
    _, (i2t, t2i) = jax.lax.scan(lambda c, xs: (c, block(*xs)), None, (jnp.arange(n // chunk), split(img), split(txt)))
    return i2t.reshape(n), t2i.reshape(n)


def embedding_outputs(img_emb, txt_emb, logit_scale) -> dict:
  """An outputs dict from bare embeddings ([B, D] each, L2-normalised) and s: for losses of given embeddings."""
  return {"img": img_emb, "txt": txt_emb, "scale": jnp.asarray(logit_scale, jnp.float32)}
