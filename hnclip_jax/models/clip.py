"""CLIP dual encoders in Flax NNX: the config, the shared building blocks (attention, transformer blocks, adapter
layers) and the dual encoder `CLIP`, whose family-specific parts — OpenAI CLIP's class token, projections and
end-of-text pooling (`clip_family.py`), SigLIP's attention-pooling head and dense text head (`siglip_family.py`) —
come from the family `CLIPConfig.family` names (`family.py`), so adapters, sharding rules, frameworks and
checkpoints treat every family alike.

Parameters are Flax `nnx.Param`s; the trainer works with their pure-dict form
(`split_params`) and rebuilds the module inside jit with `nnx.merge`.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from hnclip_jax.models import family as families
from hnclip_jax.sharding import constrain_batch

LOGIT_SCALE_MAX = 100.0
# The logit-scale *parameter* p (s = exp(p)) is clamped to [0, ln 100] after each optimizer update, as OpenAI's and
# open_clip's training do (train_step), never in the forward pass: a clamp there would give s a gradient of exactly
# 0 whenever a checkpoint sits at the bound (OpenAI and Long-CLIP store p = 4.6052 > ln 100).
LOGIT_SCALE_PARAM_MAX = math.log(LOGIT_SCALE_MAX)


def normalise_fields(d: dict) -> dict:
  """A model description read from JSON -> CLIPConfig's value types (part_settings: lists -> (key, value) pairs)."""
  d = dict(d)
  if "part_settings" in d:
    d["part_settings"] = tuple((str(k), v) for k, v in d["part_settings"])
  return d


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
  """Architecture of a CLIP dual encoder. Every field is a plain number/string so it round-trips through JSON."""
  embed_dim: int = 64
  image_size: int = 64
  patch_size: int = 8
  vision_width: int = 128
  vision_layers: int = 2
  vision_heads: int = 4
  vision_mlp_dim: int = 512
  text_context: int = 77
  vocab_size: int = 49408
  text_width: int = 128
  text_layers: int = 2
  text_heads: int = 4
  text_mlp_dim: int = 512
  eot_token_id: int = 49407  # CLIP pools text at the first occurrence of this id; real tokens end there (both families)
  act: str = "quick_gelu"  # "quick_gelu" (OpenAI), "gelu" or "gelu_tanh" (SigLIP's gelu_pytorch_tanh)
  ln_eps: float = 1e-5
  # "clip": OpenAI CLIP (class token, pre-LN on the patches, causal text pooled at eot_token_id, bias-free
  # projections). "siglip": transformers.SiglipModel (no class token, patch conv with a bias, attention-pooling
  # "MAP" head whose output is the image embedding (embed_dim = vision_width), bidirectional text pooled at the
  # last position through a dense head with a bias).
  family: str = "clip"
  # A learned logit bias b next to the logit scale (the sigmoid loss: z = t·cos + b). SigLIP checkpoints carry one;
  # a fresh one starts at -10 and, for the siglip family, t at log 10 (SigLIP's initialisation).
  logit_bias: bool = False
  dtype: str = "float32"  # compute dtype; parameters are always fp32
  remat: str = "none"  # rematerialise each transformer block in the backward pass: "none" | "full" | "dots"
  # How attention is computed (see ATTENTION_IMPLS): "auto", "einsum", "xla" or "cudnn" (NVIDIA GPU, bf16).
  attention: str = "auto"
  # Per-token features (for a token-level loss term) are projected into the joint space with the tower's own
  # projection ("shared", no new parameters) or with a projection of their own ("separate": visual_token_projection
  # and text_token_projection, initialised as copies of the towers' projections when starting from weights).
  token_projection: str = "shared"
  # Parameter-efficient fine-tuning (config.finetune): "none", "lora" or "dora" adapters on the dense layers whose
  # module path ("vision/blocks/3/attn/q", "text/blocks/0/fc1", ...) matches adapter_targets (a regex), with rank
  # adapter_rank and update scale adapter_alpha / adapter_rank (see hnclip_jax/models/adapters.py).
  adapter: str = "none"
  adapter_rank: int = 16
  adapter_alpha: float = 16.0
  adapter_targets: str = r"attn/(q|k|v|out)$|fc1$|fc2$"
  adapter_dropout: float = 0.0  # dropout on the adapter branch's input, in training only
  # DoRA: treat the column norm ||V||_c as a constant in the backward pass (the DoRA paper's §4.3 and PEFT do; it
  # changes gradients, not the forward). A training setting like the dropout: not stored in model.json.
  adapter_detach_norm: bool = False
  # A framework's own modules (hnclip_jax/frameworks; docs/frameworks.md): `parts` is the import path
  # "package.module:function" of a function (cfg, settings dict, rngs) -> {attribute name: nnx.Module} that the
  # model adds as top-level attributes ("": none), `part_settings` its architecture settings as sorted (key, value)
  # pairs. Both are in model.json, so a saved model rebuilds with them.
  parts: str = ""
  part_settings: tuple = ()

  @classmethod
  def from_dict(cls, d) -> "CLIPConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"config.model has unknown field(s) {unknown}; known fields: {sorted(names)}")
    return cls(**normalise_fields(d))

  def validate(self) -> "CLIPConfig":
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      may_be_zero = f.name == "adapter_dropout"
      if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 and not may_be_zero:
        raise ValueError(f"config.model.{f.name}={v} must be positive")
    for tower in ("vision", "text"):
      w, h = getattr(self, f"{tower}_width"), getattr(self, f"{tower}_heads")
      if w % h:
        raise ValueError(f"config.model.{tower}_width={w} is not divisible by config.model.{tower}_heads={h}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"config.remat={self.remat!r}; choose one of {sorted(REMAT_POLICIES)}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"config.dtype={self.dtype!r}; choose 'float32' or 'bfloat16'")
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f"config.attention={self.attention!r}; choose one of {list(ATTENTION_IMPLS)}")
    if self.attention == "cudnn" and self.dtype != "bfloat16":
      raise ValueError("config.attention='cudnn' needs config.dtype='bfloat16' (cuDNN's fused attention has no "
                       "fp32 kernel); use attention='auto' or 'xla' for fp32")
    if self.token_projection not in TOKEN_PROJECTIONS:
      raise ValueError(f"config.model.token_projection={self.token_projection!r}; choose one of {TOKEN_PROJECTIONS}")
    families.get(self.family).check(self)  # the family's own (an unknown family: its choices)
    if self.act not in ACTIVATIONS:
      raise ValueError(f"config.model.act={self.act!r}; choose one of {sorted(ACTIVATIONS)}")
    if not 0 <= self.adapter_dropout < 1:
      raise ValueError(f"config.finetune.dropout={self.adapter_dropout} must be in [0, 1)")
    if self.parts:
      check = getattr(model_parts_function(self.parts), "check", None)
      if check is not None:  # the parts' own settings against this architecture
        check(self, dict(self.part_settings))
    if self.adapter not in ADAPTERS:
      raise ValueError(f"config.finetune.method={self.adapter!r}; choose one of full, lora, dora")
    try:
      re.compile(self.adapter_targets)
    except re.error as e:
      raise ValueError(f"config.finetune.targets={self.adapter_targets!r} is not a regular expression ({e})") from e
    if not 0 <= self.eot_token_id < self.vocab_size:
      raise ValueError(f"config.model.eot_token_id={self.eot_token_id} is outside the vocabulary "
                       f"(vocab_size={self.vocab_size})")
    return self


TOKEN_PROJECTIONS = ("shared", "separate")
FAMILIES = families.NAMES
ADAPTERS = ("none", "lora", "dora")


def adapter_dropout(x, rate: float, rng):
  """Inverted dropout of the adapter branch's input; the identity without an rng (eval) or at rate 0."""
  if rng is None or not rate:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class LoRALinear(nnx.LoRALinear):
  """Flax's nnx.LoRALinear (kernel and bias where nnx.Linear keeps them, plus lora/lora_a [in, r] and
  lora/lora_b [r, out], lora_b zero at init) with LoRA's scaling: y = x W + b + (alpha / r) drop(x) A B."""

  def __init__(self, in_features, out_features, *, scale: float, dropout: float = 0.0, **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    self.scale, self.dropout = scale, dropout

  def __call__(self, x, rng=None):
    return nnx.Linear.__call__(self, x) + self.scale * self.lora(adapter_dropout(x, self.dropout, rng))


def column_norm(w):
  """L2 norm of each output unit's weights: kernel [in, out] -> [out] (DoRA's ||.||_c), in fp32."""
  w = w.astype(jnp.float32)
  return jnp.sqrt(jnp.sum(w * w, axis=0))


class DoRALinear(nnx.LoRALinear):
  """DoRA (Liu et al., 2024): the kernel split into a magnitude m [out] and a direction V = W + (alpha / r) A B,
  recombined as m * V / ||V||_c in every forward pass (column norms recomputed, gradients through them), so the
  low-rank update moves the direction and m the length. m starts at ||W||_c (set by adapters.add_adapters).

  Computed as y = (m / ||V||_c) * (x W + (alpha / r) (x A) B) + b, which equals x (m * V / ||V||_c) + b: the
  batch only meets W, A and B, so a frozen W gets no [in, out] weight-gradient matmul over the batch (only the
  norms' gradient, which does not grow with the batch)."""

  def __init__(self, in_features, out_features, *, scale: float, dropout: float = 0.0, detach_norm: bool = False,
               **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    self.scale, self.dropout, self.detach_norm = scale, dropout, detach_norm
    self.magnitude = nnx.Param(jnp.ones((out_features,), jnp.float32))

  def __call__(self, x, rng=None):
    w0 = self.kernel[...].astype(jnp.float32)
    a, b_lora = self.lora.lora_a[...], self.lora.lora_b[...]
    norm = column_norm(w0 + self.scale * (a @ b_lora))  # ||V||_c, [out]
    if self.detach_norm:  # a constant in the backward pass (DoRA §4.3, PEFT): no gradient through the norm
      norm = jax.lax.stop_gradient(norm)
    ratio = self.magnitude[...] / norm  # m / ||V||_c
    dt = self.dtype or x.dtype
    x = x.astype(dt)
    bias = self.bias[...].astype(dt) if self.bias is not None else 0
    base = x @ w0.astype(dt)
    if rng is None or not self.dropout:
      low_rank = (x @ a.astype(dt)) @ b_lora.astype(dt)
      return (ratio * (base + self.scale * low_rank)).astype(dt) + bias
    # With dropout on the adapter path (as PEFT does for DoRA): the base term sees x, the DoRA update x_d:
    # x W + b + (m/||V|| - 1) x_d W + (m/||V||) (alpha/r) x_d A B, the formula above when x_d = x.
    xd = adapter_dropout(x, self.dropout, rng).astype(dt)
    low_rank = (xd @ a.astype(dt)) @ b_lora.astype(dt)
    return (base + (ratio - 1) * (xd @ w0.astype(dt)) + ratio * self.scale * low_rank).astype(dt) + bias


def apply_dense(layer, x, rng):
  """A dense layer on x; adapter layers also get their dropout key."""
  return layer(x, rng) if isinstance(layer, (LoRALinear, DoRALinear)) else layer(x)


def dropout_key(rng, i: int):
  return None if rng is None else jax.random.fold_in(rng, i)


def dense_factory(cfg, dtype, rngs):
  """-> dense(path, in, out, init): nnx.Linear, or an adapter layer where cfg.adapter_targets matches the path."""
  pattern = re.compile(cfg.adapter_targets) if cfg is not None and cfg.adapter != "none" else None

  def dense(path, din, dout, init):
    if pattern is not None and pattern.search(path):
      cls, extra = ((LoRALinear, {}) if cfg.adapter == "lora" else
                    (DoRALinear, {"detach_norm": cfg.adapter_detach_norm}))
      return cls(din, dout, scale=cfg.adapter_alpha / cfg.adapter_rank, dropout=cfg.adapter_dropout,
                 lora_rank=cfg.adapter_rank, lora_dtype=dtype, kernel_init=init, dtype=dtype, rngs=rngs, **extra)
    return nnx.Linear(din, dout, kernel_init=init, dtype=dtype, rngs=rngs)

  return dense


def quick_gelu(x):
  return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
# "full": keep only each block's input, recompute the rest; "dots": also keep matmul outputs (no batch dims).
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims}

# "einsum": two einsums around an fp32 softmax, written out here; on XLA:CPU its forward+backward is 1.2-1.5x
#   faster than jax.nn.dot_product_attention's XLA path (benchmarks/layers.py, docs/benchmarks.md).
# "xla" / "cudnn": jax.nn.dot_product_attention with that implementation; "cudnn" is the fused kernel (NVIDIA GPU,
#   bf16 compute).
# "auto": on GPU, jax.nn.dot_product_attention with JAX's choice (cuDNN where it applies, else XLA); elsewhere "einsum".
ATTENTION_IMPLS = ("auto", "einsum", "xla", "cudnn")


def einsum_attention(q, k, v, causal):
  """Softmax attention on [B, L, H, D] q/k/v (jax.nn.dot_product_attention's layout) with fp32 logits/softmax."""
  heads_major = lambda t: t.transpose(0, 2, 1, 3)  # [B, H, L, D]: the two products are plain batched matmuls
  q, k, v = heads_major(q * q.shape[-1] ** -0.5), heads_major(k), heads_major(v)
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
  if causal:
    n = s.shape[-1]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, jnp.finfo(s.dtype).min)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  return heads_major(jnp.einsum("bhqk,bhkd->bhqd", p, v))

class Attention(nnx.Module):
  """Multi-head self-attention with separate q/k/v projections (the Hugging Face layout)."""

  def __init__(self, width, heads, *, dtype, rngs, implementation="auto", dense=None, prefix="attn"):
    if implementation not in ATTENTION_IMPLS:
      raise ValueError(f"config.attention={implementation!r}; choose one of {list(ATTENTION_IMPLS)}")
    self.heads = heads
    self.implementation = implementation
    init = nnx.initializers.normal(width ** -0.5)
    dense = dense or dense_factory(None, dtype, rngs)
    self.q, self.k, self.v, self.out = (dense(f"{prefix}/{n}", width, width, init) for n in ("q", "k", "v", "out"))

  def __call__(self, x, causal, length=None, rng=None):
    """x: [B, L, W], or the tokens flattened to [B*L, W] with `length` = L (see Transformer). rng: adapter
    dropout key (training only)."""
    shape, w = x.shape, x.shape[-1]
    l = length or shape[-2]
    x = x.reshape(-1, w)  # the projections are 2-D matmuls
    b = x.shape[0] // l
    split = lambda t: t.reshape(b, l, self.heads, w // self.heads)
    q, k, v = (split(apply_dense(layer, x, dropout_key(rng, j))) for j, layer in enumerate((self.q, self.k, self.v)))
    return self._attend(q, k, v, causal, rng).reshape(shape)

  def pool(self, query, x, rng=None):
    """Attention pooling: query [W] (one learned probe) against x [B, L, W] -> [B, W] (SigLIP's MAP head)."""
    b, l, w = x.shape
    flat = x.reshape(b * l, w)
    q = apply_dense(self.q, query[None].astype(x.dtype), dropout_key(rng, 0))  # [1, W]: the same for every example
    q = jnp.broadcast_to(q.reshape(1, 1, self.heads, w // self.heads), (b, 1, self.heads, w // self.heads))
    k, v = (apply_dense(layer, flat, dropout_key(rng, j)).reshape(b, l, self.heads, w // self.heads)
            for j, layer in ((1, self.k), (2, self.v)))
    return self._attend(q, k, v, False, rng).reshape(b, w)

  def _attend(self, q, k, v, causal, rng):
    """[B, Lq, H, D] queries against [B, L, H, D] keys/values -> the output projection's [B*Lq, W]."""
    b, lq, h, d = q.shape
    impl = self.implementation
    if impl == "auto":  # decided when traced, for the backend the program is compiled for
      impl = None if jax.default_backend() == "gpu" else "einsum"
    if impl == "einsum":
      o = einsum_attention(q, k, v, causal)
    else:
      o = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
    return apply_dense(self.out, o.reshape(b * lq, h * d), dropout_key(rng, 3))


class Block(nnx.Module):
  """Pre-LN residual block: x + attn(ln(x)); x + mlp(ln(x))."""

  def __init__(self, width, heads, mlp_dim, act, eps, *, dtype, rngs, attention="auto", dense=None, prefix="block"):
    dense = dense or dense_factory(None, dtype, rngs)
    self.ln1 = nnx.LayerNorm(width, epsilon=eps, dtype=dtype, rngs=rngs)
    self.attn = Attention(width, heads, dtype=dtype, rngs=rngs, implementation=attention, dense=dense,
                          prefix=f"{prefix}/attn")
    self.ln2 = nnx.LayerNorm(width, epsilon=eps, dtype=dtype, rngs=rngs)
    init = nnx.initializers.normal((2 * width) ** -0.5)
    self.fc1 = dense(f"{prefix}/fc1", width, mlp_dim, init)
    self.fc2 = dense(f"{prefix}/fc2", mlp_dim, width, init)
    self.act = ACTIVATIONS[act]

  def __call__(self, x, causal, length=None, rng=None):
    x = x + self.attn(self.ln1(x), causal, length, dropout_key(rng, 0))
    return x + apply_dense(self.fc2, self.act(apply_dense(self.fc1, self.ln2(x), dropout_key(rng, 1))),
                           dropout_key(rng, 2))


class Transformer(nnx.Module):

  def __init__(self, width, layers, heads, mlp_dim, act, eps, *, dtype, rngs, remat="none", attention="auto",
               dense=None, prefix="blocks"):
    self.blocks = nnx.List([Block(width, heads, mlp_dim, act, eps, dtype=dtype, rngs=rngs, attention=attention,
                                  dense=dense, prefix=f"{prefix}/blocks/{i}") for i in range(layers)])
    self.remat = remat

  def __call__(self, x, causal, keep: int | None = None, rng=None):
    """x: [B, L, W] -> [B, L, W]; with `keep` = k, returns (output, output of block k) (negative k from the end)."""
    # The blocks see the tokens flattened to [B*L, W]. Every dense layer is then a plain 2-D matmul, whose weight
    # gradient (contracting over B*L) needs no transposed copy of the activations; with [B, L, W] operands XLA:CPU
    # materialises one per layer and the MLP's forward+backward is 1.6-2.3x slower (benchmarks/layers.py).
    b, l, w = x.shape
    apply = lambda block, h, r: block(h, causal, l, r)
    if self.remat != "none":
      apply = nnx.remat(apply, policy=REMAT_POLICIES[self.remat])
    x = x.reshape(b * l, w)
    kept = None
    keep_index = None if keep is None else keep % len(self.blocks)
    for i, block in enumerate(self.blocks):
      x = apply(block, constrain_batch(x), dropout_key(rng, i))
      if i == keep_index:
        kept = x.reshape(b, l, w)
    x = x.reshape(b, l, w)
    return x if keep is None else (x, kept)


def model_parts_function(path: str):
  """CLIPConfig.parts ("package.module:function") -> the function that builds a framework's modules."""
  module, _, attr = path.partition(":")
  try:
    fn = getattr(importlib.import_module(module), attr, None)
  except ImportError as e:
    raise ValueError(f"model.parts={path!r}: cannot import {module!r} ({e}); put its folder on PYTHONPATH") from None
  if fn is None:
    raise ValueError(f"model.parts={path!r}: {module} has no {attr!r}")
  return fn


def _l2_normalize(x):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-12))


# For a framework's terms that make outputs of their own (frameworks.Term.outputs): the towers' normalisation and
# dropout-key derivation.
l2_normalize = _l2_normalize


class CLIP(nnx.Module):
  """CLIP dual encoder. encode_image: [B,H,W,3] f32 -> [B,E]; encode_text: [B,L] int32 -> [B,E] (both L2-normalised)."""

  def __init__(self, cfg: CLIPConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    fam = families.get(cfg.family)
    dt = jnp.dtype(cfg.dtype)
    vw, tw = cfg.vision_width, cfg.text_width
    normal = lambda std: nnx.initializers.normal(std)
    dense = dense_factory(cfg, dt, rngs)
    # Image tower (parameters created in this order: the random initialisation follows it).
    self.patch_embed = nnx.Conv(3, vw, kernel_size=(cfg.patch_size,) * 2, strides=(cfg.patch_size,) * 2,
                                padding="VALID", use_bias=fam.patch_bias, dtype=dt, rngs=rngs)
    fam.build_image_stem(self, cfg, dt, rngs)
    self.vision = Transformer(vw, cfg.vision_layers, cfg.vision_heads, cfg.vision_mlp_dim, cfg.act, cfg.ln_eps,
                              dtype=dt, rngs=rngs, remat=cfg.remat, attention=cfg.attention, dense=dense,
                              prefix="vision")
    self.ln_post = nnx.LayerNorm(vw, epsilon=cfg.ln_eps, dtype=dt, rngs=rngs)
    fam.build_image_head(self, cfg, dt, dense, rngs)
    # Text tower.
    self.token_embedding = nnx.Embed(cfg.vocab_size, tw, embedding_init=normal(0.02), dtype=dt, rngs=rngs)
    self.text_positions = nnx.Param(normal(0.01)(rngs.params(), (cfg.text_context, tw)))
    self.text = Transformer(tw, cfg.text_layers, cfg.text_heads, cfg.text_mlp_dim, cfg.act, cfg.ln_eps,
                            dtype=dt, rngs=rngs, remat=cfg.remat, attention=cfg.attention, dense=dense,
                            prefix="text")
    self.ln_final = nnx.LayerNorm(tw, epsilon=cfg.ln_eps, dtype=dt, rngs=rngs)
    fam.build_text_head(self, cfg, dt, rngs)
    self.logit_scale = nnx.Param(jnp.asarray(fam.logit_scale_init, jnp.float32))
    if cfg.logit_bias:
      self.logit_bias = nnx.Param(jnp.asarray(-10.0, jnp.float32))
    if cfg.parts:
      for name, module in model_parts_function(cfg.parts)(cfg, dict(cfg.part_settings),
                                                          nnx.Rngs(rngs.params())).items():
        setattr(self, name, module)
    if cfg.token_projection == "separate":
      fam.build_token_projections(self, cfg)

  def image_tower(self, pixels, token_layer: int | None = None, rng=None):
    """pixels [B, H, W, 3] -> (pooled [B, E], tokens [B, 1+P, E] or None), both projected and unnormalised.

    With `token_layer` = k the per-token features of block k's output (CLS first, then the P patches) go through
    the same final LayerNorm and projection as the pooled CLS token."""
    return self._image_tower(pixels, token_layer, rng)[:2]

  def _image_tower(self, pixels, token_layer=None, rng=None):
    """`image_tower`'s (pooled, tokens) and the last block's output (before the final LayerNorm)."""
    x = self.patch_embed(pixels.astype(jnp.dtype(self.cfg.dtype)))  # [B, h, w, W]
    return families.get(self.cfg.family).image_tower(self, x.reshape(x.shape[0], -1, x.shape[-1]), token_layer, rng)

  @staticmethod
  def run_tower(transformer, x, causal, token_layer, rng):
    """(last block's output, block `token_layer`'s output or None)."""
    if token_layer is None:
      return transformer(x, causal=causal, rng=rng), None
    return transformer(x, causal=causal, keep=token_layer, rng=rng)

  def text_tower(self, tokens, token_layer: int | None = None, rng=None):
    """tokens [B, L] int -> (pooled [B, E] at the first end-of-text token, tokens [B, L, E] or None), projected and
    unnormalised; `token_layer` as in `image_tower` (the final LayerNorm and projection apply to every token)."""
    return self._text_tower(tokens, token_layer, rng)[:2]

  def text_tower_hidden(self, tokens, token_layer: int | None = None, rng=None):
    """`text_tower`'s (pooled, tokens) and the last block's output [B, L, W] (before the final LayerNorm), for a
    framework's term that pools it."""
    return self._text_tower(tokens, token_layer, rng)

  def _text_tower(self, tokens, token_layer=None, rng=None):
    """`text_tower`'s (pooled, tokens) and the last block's output [B, L, W] (before the final LayerNorm)."""
    dt = jnp.dtype(self.cfg.dtype)
    fam = families.get(self.cfg.family)
    x = self.token_embedding(tokens) + self.text_positions[...][:tokens.shape[1]].astype(dt)
    h, kept = self.run_tower(self.text, x, fam.causal_text, token_layer, rng)
    pooled, tok = fam.text_head(self, self.ln_final(h), kept, tokens)
    return pooled, tok, h

  def eot_positions(self, tokens):  # [B, L] int -> [B] first end-of-text position
    return jnp.argmax(tokens == self.cfg.eot_token_id, axis=1)

  def image_features(self, pixels):  # [B, H, W, 3] -> [B, E] (unnormalised)
    return self.image_tower(pixels)[0]

  def text_features(self, tokens):  # [B, L] int -> [B, E] (unnormalised)
    return self.text_tower(tokens)[0]

  def encode_image(self, pixels):
    return _l2_normalize(self.image_features(pixels))

  def encode_text(self, tokens):
    return _l2_normalize(self.text_features(tokens))

  def scale(self):
    """The multiplier s = exp(logit_scale). Not clamped here: the parameter is clamped after each update."""
    return jnp.exp(self.logit_scale[...].astype(jnp.float32))

  def bias(self):
    """The sigmoid loss's logit bias b (models with `logit_bias`)."""
    return self.logit_bias[...].astype(jnp.float32)

  def __call__(self, pixels, tokens, *, token_layer: int | None = None, image_cls_token: bool = False,
               dropout_rng=None):
    """The training forward pass: pixels [B, H, W, 3], tokens [B, L] -> outputs dict (`forward`'s first half)."""
    return self.forward(pixels, tokens, token_layer=token_layer, image_cls_token=image_cls_token,
                        dropout_rng=dropout_rng)[0]

  def forward(self, pixels, tokens, *, token_layer: int | None = None, image_cls_token: bool = False,
              dropout_rng=None):
    """The training forward pass: pixels [B, H, W, 3], tokens [B, L] -> (outputs dict, hidden).

    Always: "img", "txt" [B, E] L2-normalised fp32 and "scale" (s, a scalar), and with `logit_bias` "bias" (b, a
    scalar): the only entries without a batch dimension. With `token_layer` (what a token-level loss term asks for): "img_tokens" [B, P, E] (P patches, or
    1+P with `image_cls_token`) and "txt_tokens" [B, L, E], L2-normalised per token, in the compute dtype, and
    "txt_mask" [B, L] bool, True on the real tokens (start through the first end-of-text, never padding).
    hidden: {"image": [B, 1+P, W], "text": [B, L, W]}, the towers' last-block outputs (before the final LayerNorm),
    and with `token_layer` "image_tokens" [B, 1+P, E] (CLS first) and "text_tokens" [B, L, E], the projected
    tokens before normalisation, for a framework's terms that pool them (frameworks.Term.outputs; unused ones
    cost nothing once compiled).
    dropout_rng: a key for the adapters' dropout (training); None (eval, and every model without it) is no dropout.
    The towers use its fold-ins 0 and 1; the built-in frameworks' passes 2 to 6.
    """
    img, img_tok, img_hidden = self._image_tower(pixels, token_layer, dropout_key(dropout_rng, 0))
    txt, txt_tok, txt_hidden = self._text_tower(tokens, token_layer, dropout_key(dropout_rng, 1))
    out = {"img": _l2_normalize(img), "txt": _l2_normalize(txt), "scale": self.scale()}
    if self.cfg.logit_bias:
      out["bias"] = self.bias()
    hidden = {"image": img_hidden, "text": txt_hidden}
    if token_layer is not None:
      hidden.update(image_tokens=img_tok, text_tokens=txt_tok)
      dt = jnp.dtype(self.cfg.dtype)
      img_tok = families.get(self.cfg.family).patch_tokens(img_tok, image_cls_token)
      out["img_tokens"] = _l2_normalize(img_tok).astype(dt)
      out["txt_tokens"] = _l2_normalize(txt_tok).astype(dt)
      out["txt_mask"] = jnp.arange(tokens.shape[1])[None, :] <= self.eot_positions(tokens)[:, None]
    return out, hidden


def split_params(model: CLIP):
  """Returns (graphdef, params) with params a pure nested dict of arrays."""
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


class _ShapeOnlyRngs:
  """The rngs of a model built for its shapes only: every stream gives the same key, and nothing is counted.
  nnx.Rngs counts its draws in a Variable, whose update compares the traced count's `sharding`; on a tracer JAX
  builds that AttributeError's message from every equation traced so far, so building a model abstractly was
  quadratic in its size (ViT-L/14 3.6 s -> 0.33 s; measurements and a reproduction in docs/upstream.md)."""

  def __init__(self):
    self._key = jax.random.key(0)

  def __getattr__(self, stream: str):
    if stream.startswith("__"):
      raise AttributeError(stream)
    return lambda: self._key


def abstract_model(cfg: CLIPConfig):
  """Returns (graphdef, params as ShapeDtypeStructs) without allocating anything: the model built under
  nnx.eval_shape with shape-only rngs, or with nnx.Rngs where those are refused (a flax that asks more of its
  rngs than a stream's next key)."""
  try:
    return split_params(nnx.eval_shape(lambda: CLIP(cfg, rngs=_ShapeOnlyRngs())))
  except (AttributeError, TypeError):
    return split_params(nnx.eval_shape(lambda: CLIP(cfg, rngs=nnx.Rngs(0))))


def bind(graphdef, params) -> CLIP:
  """Rebuilds the module from its graphdef and a pure params dict (cheap; used inside jit)."""
  return nnx.merge(graphdef, params)
