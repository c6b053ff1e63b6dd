"""LoRA / DoRA adapters as parameters: adding them to base weights, folding them back in, telling them apart, and
initialising a model with or without them (`init_params`, exported as `hnclip_jax.models.init_params`).

The layers are `clip.LoRALinear` (Flax's nnx.LoRALinear plus LoRA's alpha / r scale) and `clip.DoRALinear`; their
base kernel and bias keep nnx.Linear's paths, so base weights from any source load unchanged. Adapter leaves:
  .../lora/lora_a [in, r]   random (he_uniform, as nnx.LoRA), from the run's seed and the layer's path
  .../lora/lora_b [r, out]  zeros: the adapted model equals the base model at the start
  .../magnitude   [out]     DoRA only: ||W||_c of the base kernel
"""
from __future__ import annotations

import dataclasses
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hnclip_jax.models.clip import CLIP, abstract_model, column_norm, split_params

ADAPTER_LEAF = re.compile(r"/lora/lora_[ab]$|/magnitude$")
# Matches every parameter that is not an adapter leaf: what LoRA / DoRA fine-tuning freezes.
NOT_ADAPTER = r"^(?!.*(/lora/lora_[ab]|/magnitude)$)"


def path_of(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flat(params) -> dict:
  return {path_of(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def base_config(cfg):
  """The architecture without adapters."""
  return dataclasses.replace(cfg, adapter="none")


def is_adapter(path: str) -> bool:
  return bool(ADAPTER_LEAF.search(path))


def _column_norm(w) -> np.ndarray:
  return jax.jit(column_norm)(jnp.asarray(w))


def add_adapters(base: dict, cfg, seed: int) -> dict:
  """Base params (no adapters) -> params of `cfg`'s adapted model; raises naming a base leaf that is missing."""
  _, abstract = abstract_model(cfg)
  have = flat(base)
  init_a = nnx.initializers.he_uniform()
  key = jax.random.key(seed)

  def leaf(p, a):
    name = path_of(p)
    if name in have:
      return jnp.asarray(have[name], a.dtype)
    if name.endswith("/lora/lora_a"):
      return init_a(jax.random.fold_in(key, zlib.crc32(name.encode())), a.shape, a.dtype)
    if name.endswith("/lora/lora_b"):
      return jnp.zeros(a.shape, a.dtype)
    if name.endswith("/magnitude"):
      return _column_norm(have[name.rsplit("/", 1)[0] + "/kernel"]).astype(a.dtype)
    raise ValueError(f"the base weights have no parameter {name!r} that the {cfg.adapter} model needs")

  return jax.tree_util.tree_map_with_path(leaf, abstract)


def merge_adapters(params: dict, cfg):
  """Adapted params -> (base CLIPConfig, plain params): each adapted kernel folded to W + (alpha / r) A B (LoRA) or
  m * V / ||V||_c (DoRA), adapter leaves dropped. The plain model computes what the adapted one does."""
  if cfg.adapter == "none":
    return cfg, params
  base_cfg = base_config(cfg)
  _, abstract = abstract_model(base_cfg)
  have = flat(params)
  scale = cfg.adapter_alpha / cfg.adapter_rank

  @jax.jit
  def fold(w, a, b, m):
    v = w.astype(jnp.float32) + scale * (a @ b)
    return v if m is None else v * (m / column_norm(v))

  def leaf(p, _):
    name = path_of(p)
    layer = name.rsplit("/", 1)[0]
    if name.endswith("/kernel") and f"{layer}/lora/lora_a" in have:
      return fold(have[name], have[f"{layer}/lora/lora_a"], have[f"{layer}/lora/lora_b"], have.get(f"{layer}/magnitude"))
    return have[name]

  return base_cfg, jax.tree_util.tree_map_with_path(leaf, abstract)


def sizes(params) -> tuple[int, int]:
  """(adapter parameters, all parameters)."""
  f = flat(params)
  return sum(int(np.prod(np.shape(x))) for k, x in f.items() if is_adapter(k)), sum(
      int(np.prod(np.shape(x))) for x in f.values())


def init_params(cfg, seed: int):
  """Returns (graphdef, params) of a freshly initialised model; adapters, if any, added to the base weights as
  `add_adapters` does for pretrained ones (B = 0: the adapted model starts as the base model)."""
  if cfg.adapter != "none":
    _, base = split_params(CLIP(base_config(cfg), rngs=nnx.Rngs(seed)))
    graphdef, _ = abstract_model(cfg)
    return graphdef, add_adapters(base, cfg, seed)
  return split_params(CLIP(cfg, rngs=nnx.Rngs(seed)))
