"""Model families by name: `CLIPConfig.family` picks the module that builds and runs the parts of the dual encoder
that differ between families — the image tower's stem (class token, positions, pre-norm) and pooling head, how text
attends and is pooled, the projections into the joint space, which token features a token-level term sees, the
logit scale's start and the family's own architecture checks. The towers' transformer blocks, adapters, sharding
rules, the objective and checkpoints are shared and never ask which family a model is.

A family is a subclass of `Family` registered here by name ("package.module:Class", imported on first use, like
config.framework). The built-in ones: "clip" (OpenAI CLIP, `clip_family.py`) and "siglip" (transformers'
SiglipModel, `siglip_family.py`). Pretrained conversion and export dispatch on the same names
(`hnclip_jax/pretrained`), and so does the input pipeline's image preprocessing (`data/pipeline.PREPROCESS`).
"""
from __future__ import annotations

import importlib

REGISTRY = {"clip": "hnclip_jax.models.clip_family:CLIPFamily",
            "siglip": "hnclip_jax.models.siglip_family:SigLIPFamily"}
NAMES = tuple(REGISTRY)


class Family:
  """What a model family defines. Every method takes the model (`hnclip_jax.models.clip.CLIP`, whose shared
  parts — patch_embed, vision, ln_post, token_embedding, text_positions, text, ln_final, logit_scale — exist when
  it is called) and adds or uses the family's own attributes on it; parameter names are the family's (they are the
  checkpoint's tree)."""

  name = ""
  patch_bias = False  # the patch convolution has a bias
  causal_text = True  # the text transformer's attention is causal
  logit_scale_init = 0.0  # the logit-scale parameter's start (log t)

  @staticmethod
  def check(cfg) -> None:
    """Raises ValueError naming the config key when `cfg` (a CLIPConfig) cannot be built as this family."""

  @staticmethod
  def build_image_stem(model, cfg, dtype, rngs) -> None:
    """The parameters between the patch convolution and the vision transformer (created in this order: the random
    initialisation follows it)."""

  @staticmethod
  def build_image_head(model, cfg, dtype, dense, rngs) -> None:
    """The image tower's pooling head / projection (after ln_post)."""

  @staticmethod
  def build_text_head(model, cfg, dtype, rngs) -> None:
    """The text tower's projection (after ln_final)."""

  @staticmethod
  def build_token_projections(model, cfg) -> None:
    """config.model.token_projection='separate': projections of the per-token features of their own."""

  @staticmethod
  def image_tower(model, patches, token_layer, rng):
    """patches [B, P, W] (the patch convolution's output, flattened) -> (pooled [B, E], tokens or None,
    the last block's output)."""
    raise NotImplementedError

  @staticmethod
  def text_head(model, normed, kept, tokens):
    """The text transformer's normalised output [B, L, W] (and block `token_layer`'s output `kept` or None) ->
    (pooled [B, E], tokens [B, L, E] or None)."""
    raise NotImplementedError

  @staticmethod
  def patch_tokens(img_tokens, image_cls_token: bool):
    """The image token features a token-level term sees: [B, P, E] (the patches), or with `image_cls_token` the
    class token first."""
    raise NotImplementedError


_LOADED = {}


def get(name: str) -> type[Family]:
  """CLIPConfig.family -> its Family (imported once per process); ValueError naming the choices."""
  if name not in _LOADED:
    if name not in REGISTRY:
      raise ValueError(f"config.model.family={name!r}; choose one of {list(NAMES)}")
    module, _, attr = REGISTRY[name].partition(":")
    _LOADED[name] = getattr(importlib.import_module(module), attr)
  return _LOADED[name]
