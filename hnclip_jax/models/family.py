"""Model families by name: `CLIPConfig.family` picks the module that owns everything that differs between families —
the image tower's stem (class token, positions, pre-norm) and pooling head, how text attends and is pooled, the
projections into the joint space, which token features a token-level term sees, the logit scale's start, the
family's own architecture checks, its named sizes (`presets`), its image preprocessing (`preprocess`), the logical
sharding axes of its own parameters (`logical_axes`) and its Hugging Face mapping (`hf_mapping`: the module that
reads and writes its transformers directories; also the tokenizer such a directory holds). The towers' transformer
blocks, adapters, the objective and checkpoints are shared and never ask which family a model is; no table outside
models/ is keyed by family name.

A family is a subclass of `Family` registered here by name ("package.module:Class", imported on first use, like
config.framework). The built-in ones: "clip" (OpenAI CLIP, `clip_family.py`) and "siglip" (transformers'
SiglipModel, `siglip_family.py`). A registered family lacking a required part is refused naming it (`get`); one
without a Hugging Face mapping or the OpenAI format is refused when asked to read or write them (`hf`).
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping

from hnclip_jax import sharding

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
  # Its own top-level modules (beyond sharding.SHARED_MODULES): not taken for a framework's parts.
  modules: tuple = ()
  # (path regex, logical axes) of the family's own parameters (its heads), ahead of sharding.LOGICAL_AXES' shared
  # rules (sharding.param_specs): "replicated" or one logical name (or None) per dimension.
  logical_axes: tuple = ()
  # Set by a family for itself only (a subclass that changes the architecture does not inherit them, OWN):
  presets: dict = {}  # named sizes: preset name -> CLIPConfig (config.model.preset; names unique across families)
  hf_mapping = ""  # "package.module" reading / writing its transformers directories: MODEL_CLASS, config(c, where),
  #                  params(state_dict, cfg, where), export(model, out_dir) -> warnings, tokenizer(directory, context)
  hf_model_type = ""  # transformers' config.json model_type of those directories
  hf_class = ""  # transformers' model class of those directories (e.g. "CLIPModel")
  openai_format = False  # an OpenAI-CLIP / Long-CLIP state dict (.pt) can hold it

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

  @staticmethod
  def preprocess(image, size: int):
    """One image (PIL or uint8 [H, W, 3|1]) as the family's model sees it: (uint8 [size, size, 3], float32
    [size, size, 3] normalised)."""
    raise NotImplementedError


REQUIRED = ("image_tower", "text_head", "patch_tokens", "preprocess")  # what every family must define
OWN = ("presets", "hf_mapping", "hf_model_type", "hf_class", "openai_format")  # not inherited


def own(cls: type[Family], attr: str):
  """A family's own setting of `attr` (one of OWN), or the contract's default when it sets none."""
  return cls.__dict__.get(attr, getattr(Family, attr))


def setting(name: str, attr: str):
  """Family `name`'s own setting of `attr` (one of OWN: presets, hf_mapping, hf_model_type, hf_class,
  openai_format)."""
  return own(get(name), attr)


_LOADED = {}


def get(name: str) -> type[Family]:
  """CLIPConfig.family -> its Family (imported once per process); ValueError naming the choices, or the required
  parts (REQUIRED) a registered family lacks."""
  if name not in _LOADED:
    if name not in REGISTRY:
      raise ValueError(f"config.model.family={name!r}; choose one of {list(REGISTRY)}")
    module, _, attr = REGISTRY[name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    missing = [h for h in REQUIRED if getattr(cls, h, None) is getattr(Family, h)]
    if missing:
      raise ValueError(f"model family {name!r} ({REGISTRY[name]}) lacks {', '.join(missing)}: a family defines "
                       f"{', '.join(REQUIRED)} (hnclip_jax/models/family.py)")
    sharding.add_family(name, cls.modules, cls.logical_axes)
    _LOADED[name] = cls
  return _LOADED[name]


def hf(name: str):
  """Family `name`'s Hugging Face mapping module (its `hf_mapping`); ValueError when it has none."""
  mapping = setting(name, "hf_mapping")
  if not mapping:
    raise ValueError(f"model family {name!r} has no Hugging Face mapping (its Family sets no hf_mapping): its "
                     "models cannot be read from or written as a transformers directory")
  return importlib.import_module(mapping)


def by_hf_model_type(model_type: str) -> str | None:
  """The registered family whose transformers directories have config.json model_type `model_type`, or None."""
  return next((n for n in REGISTRY if setting(n, "hf_mapping") and setting(n, "hf_model_type") == model_type), None)


def of_directory(directory: str) -> str | None:
  """The registered family whose Hugging Face directory (or tokenizer files) `directory` is: by its config.json's
  model_type, else the first family whose mapping recognises the files (`owns_directory`); None when none does."""
  import json
  import os
  config = os.path.join(directory, "config.json")
  if os.path.exists(config):
    with open(config, encoding="utf-8") as f:
      name = by_hf_model_type(json.load(f).get("model_type"))
    if name is not None:
      return name
  return next((n for n in REGISTRY if setting(n, "hf_mapping") and getattr(hf(n), "owns_directory", None)
               and hf(n).owns_directory(directory)), None)


def presets() -> dict:
  """Every registered family's named sizes; ValueError when two families name one size alike."""
  out, owner = {}, {}
  for n in REGISTRY:
    for k, v in setting(n, "presets").items():
      if k in out:
        raise ValueError(f"model preset {k!r} is defined by families {owner[k]!r} and {n!r}; rename one")
      out[k], owner[k] = v, n
  return out


class _Presets(Mapping):
  """PRESETS: every registered family's presets (read at each use, so a family registered later adds its own)."""

  def __getitem__(self, k):
    return presets()[k]

  def __iter__(self):
    return iter(presets())

  def __len__(self):
    return len(presets())


PRESETS = _Presets()
