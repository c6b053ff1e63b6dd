"""The optimizer: AdamW with warmup-cosine decay, per-parameter learning-rate factors (regex multipliers,
layer-wise decay), frozen parameters (config.finetune.freeze, LoRA / DoRA, the logit scale) and the logit scale's
clamp. Parameters are named by their key path ("vision/blocks/3/attn/q/kernel"), which the patterns match."""
from __future__ import annotations

import math

import re

import jax
import jax.numpy as jnp
import optax

from hnclip_jax import frameworks
from hnclip_jax.models.clip import LOGIT_SCALE_PARAM_MAX

SCALE_PARAM = "logit_scale"  # the params-dict key of CLIP's log logit scale
BIAS_PARAM = "logit_bias"  # the sigmoid loss's logit bias (SigLIP): trained or frozen with the scale


def lr_schedule(opt_cfg, total_steps: int):
  """Linear warmup from 0 to `lr`, then cosine decay to 0 at `total_steps`."""
  warmup = min(int(opt_cfg.warmup_steps), max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(0.0, opt_cfg.lr, warmup_steps=warmup,
                                            decay_steps=max(total_steps, warmup + 1), end_value=0.0)


def param_path(path) -> str:
  """A parameter's key path as "vision/blocks/3/attn/q/kernel" (what freeze / lr-multiplier patterns match)."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def layer_index(path: str, depth: dict) -> tuple[str, int]:
  """(tower, layer) for layer-wise lr decay: the tower's embeddings are layer 0, block i is i + 1, everything after
  the blocks (final norms, projections, logit scale) is depth + 1."""
  parts = path.split("/")
  if parts[0] in depth and len(parts) > 2 and parts[1] == "blocks":
    return parts[0], int(parts[2]) + 1
  if parts[0] in ("patch_embed", "class_embedding", "vision_positions", "ln_pre"):
    return "vision", 0
  if parts[0] in ("token_embedding", "text_positions"):
    return "text", 0
  return "", -1  # the heads: no decay


def _patterns(value, key: str) -> list:
  """A config tuple of regexes (or one string) -> compiled patterns; raises naming the key and the bad pattern."""
  items = [value] if isinstance(value, str) else list(value or ())
  out = []
  for v in items:
    try:
      out.append(re.compile(v))
    except (re.error, TypeError) as e:
      raise ValueError(f"{key}: {v!r} is not a regular expression ({e})") from e
  return out


def lr_factors(opt_cfg, paths: list[str]) -> dict:
  """Each parameter path -> its learning-rate factor: config.optimizer.lr_multipliers (the first (regex, factor)
  whose regex is found in the path) times layer_decay ** (depth + 1 - layer) within its tower."""
  rules = list(opt_cfg.get("lr_multipliers", ()) or ())
  compiled = []
  for r in rules:
    if not (isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[1], (int, float)) and r[1] >= 0):
      raise ValueError(f"config.optimizer.lr_multipliers: {r!r} is not a (regex, factor >= 0) pair; e.g. "
                       "(('^vision/', 0.1),)")
    compiled.append((_patterns(r[0], "config.optimizer.lr_multipliers")[0], float(r[1])))
  for pat, _ in compiled:
    if not any(pat.search(p) for p in paths):
      raise ValueError(f"config.optimizer.lr_multipliers: {pat.pattern!r} matches no parameter (paths look like "
                       f"{paths[len(paths) // 2]!r})")
  decay = float(opt_cfg.get("layer_decay", 0.0) or 0.0)
  if decay < 0 or decay > 1:
    raise ValueError(f"config.optimizer.layer_decay={decay} must be in (0, 1] (0 = off)")
  depth = {}
  for p in paths:
    parts = p.split("/")
    if len(parts) > 2 and parts[1] == "blocks":
      depth[parts[0]] = max(depth.get(parts[0], 0), int(parts[2]) + 1)
  out = {}
  for p in paths:
    f = next((m for pat, m in compiled if pat.search(p)), 1.0)
    if decay:
      tower, layer = layer_index(p, depth)
      if layer >= 0:
        f *= decay ** (depth[tower] + 1 - layer)
    out[p] = f
  return out


def frozen_predicate(opt_cfg, freeze):
  """path -> True for the parameters that get no update: matching a `freeze` regex, or the logit scale (and a
  logit bias) with config.optimizer.train_logit_scale=False."""
  patterns = _patterns(freeze, "config.finetune.freeze")
  return lambda p: (p in (SCALE_PARAM, BIAS_PARAM) and not opt_cfg.get("train_logit_scale", True)) or any(
      pat.search(p) for pat in patterns)


def freeze_patterns(config, model_cfg) -> tuple:
  """config.finetune.freeze, plus every non-adapter parameter for LoRA / DoRA except the logit scale (trained or
  not by config.optimizer.train_logit_scale, as with full fine-tuning) and a framework's new modules (its
  `trained_with_adapters`: they start from scratch and train with the adapters)."""
  freeze = [config.finetune.freeze] if isinstance(config.finetune.freeze, str) else list(config.finetune.freeze)
  if model_cfg.adapter != "none":
    # adapter leaves (adapters.ADAPTER_LEAF), the logit scale and bias
    kept = [r".*(?:/lora/lora_[ab]|/magnitude)$", f"{SCALE_PARAM}$", f"{BIAS_PARAM}$"]
    own = frameworks.hook(config, "trained_with_adapters")  # a framework's new modules
    if own is not None:
      kept.extend(own(model_cfg))
    freeze.append(f"^(?!(?:{'|'.join(kept)}))")
  return tuple(freeze)


def make_optimizer(opt_cfg, total_steps: int, freeze=()) -> optax.GradientTransformation:
  """AdamW with warmup-cosine schedule; weight decay only on matrices (no biases, norms, scale).

  Parameters whose path matches a `freeze` regex (config.finetune.freeze), and the logit scale with
  config.optimizer.train_logit_scale=False, get no update and no optimizer state (optax.multi_transform).
  config.optimizer.lr_multipliers / layer_decay scale each trained parameter's update (learning rate and the
  decoupled weight decay alike), see `lr_factors`."""
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  chain = []
  if opt_cfg.grad_clip_norm and opt_cfg.grad_clip_norm > 0:
    chain.append(optax.clip_by_global_norm(opt_cfg.grad_clip_norm))
  chain.append(optax.adamw(lr_schedule(opt_cfg, total_steps), b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                           weight_decay=opt_cfg.weight_decay, mask=decay_mask))
  if opt_cfg.get("lr_multipliers") or opt_cfg.get("layer_decay"):
    def scale(updates, params=None):
      del params
      paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
      factors = lr_factors(opt_cfg, paths)
      return jax.tree_util.tree_map_with_path(lambda p, u: u * factors[param_path(p)], updates)
    chain.append(optax.stateless(scale))
  tx = optax.chain(*chain)
  freeze = _patterns(freeze, "config.finetune.freeze")
  if opt_cfg.get("train_logit_scale", True) and not freeze:
    return tx

  frozen = frozen_predicate(opt_cfg, freeze)

  def labels(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [param_path(p) for p, _ in flat]
    for pat in freeze:
      if not any(pat.search(p) for p in paths):
        raise ValueError(f"config.finetune.freeze: {pat.pattern!r} matches no parameter (paths look like "
                         f"{paths[len(paths) // 2]!r})")
    if all(frozen(p) for p in paths):
      raise ValueError("config.finetune.freeze freezes every parameter; nothing would be trained")
    return jax.tree_util.tree_map_with_path(lambda p, _: "frozen" if frozen(param_path(p)) else "train", params)

  return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)


def trained_params(opt_state) -> list:
  """The parameters the optimizer updates, as AdamW's first moments (frozen ones have none)."""
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
  return [leaf for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s) for leaf in jax.tree.leaves(s.mu)]


def clamp_logit_scale(params: dict, upper: float = LOGIT_SCALE_PARAM_MAX) -> dict:
  """The logit-scale parameter clipped to [0, upper] (OpenAI / open_clip: ln 100, after the update, not in the
  forward; a framework may set its own); upper = inf: not clamped at all, neither bound (the sigmoid loss's t,
  as big_vision leaves it)."""
  if math.isinf(upper):
    return params
  return {**params, SCALE_PARAM: jnp.clip(params[SCALE_PARAM], 0.0, upper)}


def logit_scale_max(config) -> float:
  """The logit-scale parameter's upper clamp: ln 100 (OpenAI, open_clip) for the softmax loss, none for the sigmoid
  loss (big_vision does not clamp SigLIP's t), or the chosen framework's
  (`logit_scale_max(config)` in its module)."""
  own = frameworks.hook(config, "logit_scale_max")
  if own is not None:
    return float(own(config))
  return math.inf if config.loss.get("kind", "softmax") == "sigmoid" else LOGIT_SCALE_PARAM_MAX
