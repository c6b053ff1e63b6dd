"""The training objective: model outputs -> (loss, per-term metrics), on a device mesh.

One `Objective`, built from `config.loss` (and config.framework's terms), is the only place the loss is assembled.
The train step, the global-batch accumulation path, the saturation telemetry and the HN-vs-InfoNCE gradient
comparison all call it on the model's outputs dict (`CLIP.__call__`: "img", "txt", "scale" and, when a term asks,
"img_tokens", "txt_tokens", "txt_mask", ...).

    L = w_g·L_HN(γ) + λ·L_tok + Σ_terms (the framework's terms)      (paper Eq. 2 and 3; λ = config.loss.token_weight)

L_HN is HN-CLIP's global term (with config.loss.kind="sigmoid", SigLIP's pairwise sigmoid loss with the same margin:
HN-SigLIP), L_tok the FILIP token term. A fine-tuning framework adds its terms through
`hnclip_jax.frameworks` (each a `frameworks.Term`; docs/frameworks.md); w_g = 1 except where a framework sets it (its
`objective` hook).

On a mesh every device all-gathers what its terms need, builds only its own rows of each B×B score matrix against
the whole batch (the math is in `hnclip_jax.losses`), and the per-device sums are reduced with psum; the gather's
transpose is a reduce-scatter, so gradients stay sharded and equal the single-device ones.

How to add a term: write its math in `losses.py` as a function of a block of rows against the whole batch; wrap it
in a `frameworks.Term` (its settings as fields; `outputs` for model outputs it makes from the towers, or
`model_kwargs` for those `CLIP.__call__` makes, `input_keys` for batch entries, `schedule` for step-dependent
weights) and add it in a framework's `objective(config, obj)` (a framework may live outside this package:
docs/frameworks.md, "Write your own framework").
Accumulation, telemetry, the gradient comparison and sharding then work without further changes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hnclip_jax import frameworks, losses, sharding
from hnclip_jax.config import TOKEN_SETTINGS
from hnclip_jax.frameworks.base import Context

# Outputs without a batch dimension (everything else in an outputs dict is [B, ...]).
GLOBAL_OUTPUTS = ("scale", "bias")


@dataclasses.dataclass(frozen=True)
class Objective:
  """w_g·L_HN(γ) + λ·L_tok + the framework's terms. Fields mirror config.loss (hnclip_jax/config.py,
  docs/objective.md)."""
  gamma: float = 0.5
  # The global term: "softmax" (HN-CLIP, paper Eq. 2: cross-entropy both ways) or "sigmoid" (HN-SigLIP: SigLIP's
  # pairwise sigmoid loss with the margin on every negative's logit; the model needs its logit bias b).
  kind: str = "softmax"
  # How the sigmoid loss meets every caption on a mesh: "ring" (big_vision's chunked schedule: caption chunks
  # passed around the batch axes, no [B, D] gather) or "gather".
  sigmoid_schedule: str = "ring"
  token_weight: float = 0.0  # λ; 0 turns the token term (and the token outputs) off
  chunk_size: int = 0  # rows per device computed at a time (0: all rows for L_HN, losses.TOKEN_BLOCK for L_tok)
  token_layer: int = -1  # which transformer block's tokens (-1: the last), through the tower's final LN + projection
  token_image_cls: bool = False  # include the image CLS token among the patches
  token_logit_scale: float = 0.0  # 0: the model's learned s; > 0: this fixed multiplier for the token logits
  token_margin: bool = False  # also add γ·Ḡ to the token logits
  token_schedule: str = "gather"  # "gather": all caption tokens on every device | "ring": tiles passed around
  token_group: int = 0  # 0: the token term's negatives are the global batch; G: the example's group of G rows
  token_keep: float = 1.0  # fraction of each image's patches and each caption's tokens the token term scores
  global_weight: float = 1.0  # w_g: weight of L_HN (a framework may set it)
  # The framework's terms (hnclip_jax/frameworks: each a frameworks.Term), added in order.
  terms: tuple = ()
  batch_axes: tuple = sharding.BATCH_AXES

  @classmethod
  def from_config(cls, loss_cfg, config=None) -> "Objective":
    """From config.loss; with the whole `config`, also config.framework's terms (hnclip_jax.frameworks). The token
    term's settings are read only when it is on, or when the framework reads them itself (its LOSS_SETTINGS);
    otherwise they keep their defaults (config.validate refuses them changed)."""
    token_weight = float(loss_cfg.token_weight)
    read = TOKEN_SETTINGS if token_weight > 0 else (frameworks.loss_settings(config) if config is not None else ())
    token = {f.name: type(f.default)(loss_cfg[f.name]) for f in dataclasses.fields(cls) if f.name in read}
    kind = str(loss_cfg.get("kind", "softmax"))
    if kind == "sigmoid":  # read only where it applies (config.validate refuses it set otherwise)
      token["sigmoid_schedule"] = str(loss_cfg.sigmoid_schedule)
    obj = cls(gamma=float(loss_cfg.gamma), kind=kind, token_weight=token_weight,
              chunk_size=int(loss_cfg.chunk_size), **token)
    if config is not None:
      obj = frameworks.objective_for(config, obj)
    return obj

  def check(self, model_cfg) -> None:
    """Raises naming the config key if this objective cannot run on `model_cfg` (before anything compiles)."""
    layers = min(model_cfg.vision_layers, model_cfg.text_layers)
    if self.kind == "sigmoid" and not model_cfg.logit_bias:
      raise ValueError("config.loss.kind='sigmoid' needs the model's learned logit bias b (z = t·cos + b): start "
                       "from a SigLIP checkpoint or preset (they have one), or set config.model.logit_bias=True "
                       "(a fresh b starts at -10)")
    for term in self.terms:
      term.check(model_cfg, self)
    if "token_layer" in self.model_kwargs and not -layers <= self.token_layer < layers:
      raise ValueError(f"config.loss.token_layer={self.token_layer} is outside the towers' blocks (the model has "
                       f"{model_cfg.vision_layers} vision and {model_cfg.text_layers} text blocks); use -1 for the "
                       f"last block or an index in [-{layers}, {layers})")

  def replace(self, **changes) -> "Objective":
    return dataclasses.replace(self, **changes)

  @property
  def plain_name(self) -> str:
    """What the global term is without the margin (γ = 0), for telemetry: "infonce" or "siglip"."""
    return "siglip" if self.kind == "sigmoid" else "infonce"

  @property
  def needs_tokens(self) -> bool:
    return self.token_weight > 0

  def term(self, cls):
    """This objective's term of type `cls` (None if it has none)."""
    return next((t for t in self.terms if isinstance(t, cls)), None)

  @property
  def term_names(self) -> tuple:
    return ("hn",) + (("tok",) if self.needs_tokens else ()) + tuple(n for t in self.terms for n in t.names)

  @property
  def input_keys(self) -> tuple:
    """The batch entries `forward` reads."""
    return ("image", "tokens") + tuple(k for t in self.terms for k in t.input_keys)

  def model_inputs(self, inputs=None) -> dict:
    """Keyword arguments of `CLIP.__call__` that produce the outputs this objective reads (inputs: the batch
    entries, for terms whose outputs come from inputs of their own; None: the keys that need none)."""
    kw = {}
    if self.needs_tokens:
      kw.update(token_layer=self.token_layer, image_cls_token=self.token_image_cls)
    for t in self.terms:
      kw.update(t.model_kwargs(self, inputs))
    return kw

  @property
  def model_kwargs(self) -> dict:
    return self.model_inputs()

  def forward(self, model, inputs: dict, rng=None) -> dict:
    """The model's outputs dict for a batch: inputs {"image" [B, H, W, 3], "tokens" [B, L], and what the terms
    read} (`input_keys`); rng: adapter dropout key."""
    out, hidden = model.forward(inputs["image"], inputs["tokens"], dropout_rng=rng, **self.model_inputs(inputs))
    for t in self.terms:  # outputs a term makes itself (frameworks.Term.outputs)
      out.update(t.outputs(model, out, inputs, rng, hidden))
    if not self.needs_tokens:  # a term's outputs were made from them; the loss does not read them
      out = {k: v for k, v in out.items() if k not in ("img_tokens", "txt_tokens", "txt_mask")}
    return self.select_tokens(out)

  def __call__(self, outputs: dict, mesh, step=None):
    """outputs: the model's outputs dict, [B, ...] leaves sharded over the batch axes of `mesh`; step: the train
    step (for terms with a schedule; None = their full weight).

    Returns (loss scalar, aux) with aux = {"terms": {"hn": L_HN, "tok": L_tok (when on), and each framework
    term's values}, "per_example": [B] each example's loss (½(i2t + t2i) of the contrastive terms plus the
    terms' per-example shares, weighted)}. Value and gradients equal the single-device ones.
    """
    axes = tuple(self.batch_axes)
    batch = outputs["img"].shape[0]
    specs = {k: P() if k in GLOBAL_OUTPUTS else P(axes) for k in outputs}

    scheds = tuple(t.schedule(step) for t in self.terms)

    def local(out, scheds):
      n = out["img"].shape[0]
      offset = jax.lax.axis_index(axes) * n
      gather = lambda x: jax.lax.all_gather(x, axes, axis=0, tiled=True)  # [n, ...] -> [B, ...]
      scale = out["scale"]
      img_all, txt_all = gather(out["img"]), gather(out["txt"])
      if self.kind == "sigmoid":  # each pair its own binary problem; per example: its image's row sum
        rows = self._sigmoid_rows(out, txt_all, offset, axes, batch // n)
        terms = {"hn": jax.lax.psum(jnp.sum(rows), axes) / batch}
        per = self.global_weight * rows
      else:
        i2t, t2i = self._global_rows(out["img"], out["txt"], img_all, txt_all, scale, offset)
        terms = {"hn": jax.lax.psum(jnp.sum(i2t) + jnp.sum(t2i), axes) / (2 * batch)}
        per = self.global_weight * 0.5 * (i2t + t2i)
      loss = self.global_weight * terms["hn"]
      if self.needs_tokens:
        tok_scale = scale if self.token_logit_scale == 0 else jnp.asarray(self.token_logit_scale, jnp.float32)
        margin = (self.gamma, out["txt"], txt_all) if self.token_margin and losses.has_margin(self.gamma) else None
        # [B, n] columns of S^T (all captions vs this device's images) -> this device's [n, B] rows of it.
        cols_to_rows = lambda x: jax.lax.all_to_all(x, axes, 0, 1, tiled=True)
        tok = out  # with token_keep < 1, already the kept tokens (`forward` selects them)
        if self.token_group:  # each group of G consecutive rows on its own: on this device, nothing sent
          ti2t, tt2i = self._grouped_token_rows(tok, tok_scale)
        elif self.token_schedule == "ring":  # caption-token tiles around the batch axes: O(n) tokens per device
          ti2t, tt2i = losses.token_rows_ring(
              tok["img_tokens"], tok["txt_tokens"], tok["txt_mask"], tok_scale, offset, axes, batch // n,
              block=self.chunk_size or losses.TOKEN_BLOCK, margin=margin)
        else:
          ti2t, tt2i = losses.token_rows(
              tok["img_tokens"], gather(tok["txt_tokens"]), gather(tok["txt_mask"]), tok_scale, offset,
              block=self.chunk_size or losses.TOKEN_BLOCK, margin=margin, cols_to_rows=cols_to_rows)
        terms["tok"] = jax.lax.psum(jnp.sum(ti2t) + jnp.sum(tt2i), axes) / (2 * batch)
        per = per + self.token_weight * 0.5 * (ti2t + tt2i)
        loss = loss + self.token_weight * terms["tok"]
      ctx = Context(axes=axes, batch=batch, offset=offset, gamma=self.gamma, scale=scale, img_all=img_all,
                    txt_all=txt_all, chunk_size=self.chunk_size, gather=gather)
      for term, sched in zip(self.terms, scheds):
        loss_parts, values, per_parts = term(out, ctx, sched)
        terms.update(values)
        for part in loss_parts:
          loss = loss + part
        for part in per_parts:
          per = per + part
      return loss, {"terms": terms, "per_example": per}

    out_specs = (P(), {"terms": {k: P() for k in self.term_names},
                       "per_example": P(axes)})
    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=out_specs)
    return fn({k: (jnp.asarray(v, jnp.float32) if k in GLOBAL_OUTPUTS else v) for k, v in outputs.items()}, scheds)

  def select_tokens(self, out) -> dict:
    """`out` with the token term's inputs ("img_tokens", "txt_tokens", "txt_mask") cut to the kept fraction of each
    example's tokens when token_keep < 1 (`losses.select_tokens`; unchanged otherwise). `forward` applies it, so
    the selection happens per micro-batch on the device that holds the example, before anything is sent, and the
    global-batch accumulation caches (and back-propagates) only the kept tokens."""
    if not self.needs_tokens or self.token_keep >= 1:
      return out
    out = dict(out)
    out["img_tokens"], _ = losses.select_tokens(out["img_tokens"], out["img"], self.token_keep)
    out["txt_tokens"], out["txt_mask"] = losses.select_tokens(out["txt_tokens"], out["txt"], self.token_keep,
                                                              out["txt_mask"])
    return out

  def _grouped_token_rows(self, out, scale):
    """The token term's per-example (i2t [n], t2i [n]) with each example's negatives its group of `token_group`
    consecutive rows of the global batch (groups lie within a device: G divides the per-device batch), one group
    at a time."""
    n, g = out["img_tokens"].shape[0], self.token_group
    if n % g:
      raise ValueError(f"config.loss.token_group={g} must divide the per-device batch {n} (config.batch_size over "
                       "the mesh's data x fsdp devices, and over grad_accum_steps with negatives=micro_batch): "
                       "choose a divisor of it, or 0 for the whole global batch")
    margin = self.token_margin and losses.has_margin(self.gamma)

    def group(xs):
      img_t, txt_t, mask, txt = xs
      return losses.token_rows(img_t, txt_t, mask, scale, 0, block=self.chunk_size or losses.TOKEN_BLOCK,
                               margin=(self.gamma, txt, txt) if margin else None)

    split = lambda x: x.reshape(n // g, g, *x.shape[1:])
    i2t, t2i = jax.lax.map(group, tuple(split(out[k]) for k in ("img_tokens", "txt_tokens", "txt_mask", "txt")))
    return i2t.reshape(n), t2i.reshape(n)

  def _sigmoid_rows(self, out, txt_all, offset, axes, num_devices):
    """HN-SigLIP's per-example losses [n] for this device's images (their rows' sums over all captions)."""
    img, txt, scale, bias = out["img"], out["txt"], out["scale"], out["bias"]
    if self.sigmoid_schedule == "ring":
      return losses.sigmoid_rows_ring(img, txt, scale, bias, self.gamma, offset, axes, num_devices)
    n, chunk = img.shape[0], self.chunk_size
    if not chunk or chunk >= n:
      return losses.sigmoid_rows(img, txt, txt_all, scale, bias, self.gamma, offset)
    if n % chunk:
      raise ValueError(f"config.loss.chunk_size={chunk} must divide the per-device batch {n}")

    @jax.checkpoint
    def block(k, img_c, txt_c):
      return losses.sigmoid_rows(img_c, txt_c, txt_all, scale, bias, self.gamma, offset + k * chunk)

    split = lambda x: x.reshape(n // chunk, chunk, x.shape[-1])
    _, rows = jax.lax.scan(lambda c, xs: (c, block(*xs)), None, (jnp.arange(n // chunk), split(img), split(txt)))
    return rows.reshape(n)

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
