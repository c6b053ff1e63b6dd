"""The OpenAI CLIP family (`CLIPConfig.family="clip"`): a class token and pre-LayerNorm before the vision
transformer, the class token's output projected (bias-free) as the image embedding; causal text attention pooled at
the first end-of-text token and projected (bias-free); t starts at 1/0.07."""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from hnclip_jax.data import images
from hnclip_jax.models.clip import CLIPConfig
from hnclip_jax.models.family import Family

# Named sizes. "tiny" is the CPU demo size; the others are OpenAI's.
PRESETS = {
    "tiny": CLIPConfig(),
    "vit_b16": CLIPConfig(embed_dim=512, image_size=224, patch_size=16, vision_width=768, vision_layers=12,
                          vision_heads=12, vision_mlp_dim=3072, text_context=77, vocab_size=49408,
                          text_width=512, text_layers=12, text_heads=8, text_mlp_dim=2048),
    "vit_l14": CLIPConfig(embed_dim=768, image_size=224, patch_size=14, vision_width=1024, vision_layers=24,
                          vision_heads=16, vision_mlp_dim=4096, text_context=77, vocab_size=49408,
                          text_width=768, text_layers=12, text_heads=12, text_mlp_dim=3072),
}


class CLIPFamily(Family):
  name = "clip"
  patch_bias = False
  causal_text = True
  logit_scale_init = math.log(1 / 0.07)
  modules = ("ln_pre",)
  presets = PRESETS
  hf_mapping = "hnclip_jax.pretrained.hf_clip"
  hf_model_type = "clip"
  hf_class = "CLIPModel"
  openai_format = True

  @staticmethod
  def preprocess(image, size: int):
    """OpenAI CLIP's: short side to `size` (bicubic), centre crop, CLIP mean/std."""
    u8 = images.resize_center_crop(image, size)
    return u8, images.normalize(u8)

  @staticmethod
  def check(cfg) -> None:
    if cfg.image_size % cfg.patch_size:
      raise ValueError(f"config.model.image_size={cfg.image_size} is not a multiple of "
                       f"config.model.patch_size={cfg.patch_size}")

  @staticmethod
  def build_image_stem(model, cfg, dtype, rngs) -> None:
    vw = cfg.vision_width
    n_patches = (cfg.image_size // cfg.patch_size) ** 2
    model.class_embedding = nnx.Param(nnx.initializers.normal(vw ** -0.5)(rngs.params(), (vw,)))
    model.vision_positions = nnx.Param(nnx.initializers.normal(vw ** -0.5)(rngs.params(), (n_patches + 1, vw)))
    model.ln_pre = nnx.LayerNorm(vw, epsilon=cfg.ln_eps, dtype=dtype, rngs=rngs)

  @staticmethod
  def build_image_head(model, cfg, dtype, dense, rngs) -> None:
    vw = cfg.vision_width
    model.visual_projection = nnx.Param(nnx.initializers.normal(vw ** -0.5)(rngs.params(), (vw, cfg.embed_dim)))

  @staticmethod
  def build_text_head(model, cfg, dtype, rngs) -> None:
    tw = cfg.text_width
    model.text_projection = nnx.Param(nnx.initializers.normal(tw ** -0.5)(rngs.params(), (tw, cfg.embed_dim)))

  @staticmethod
  def build_token_projections(model, cfg) -> None:
    model.visual_token_projection = nnx.Param(jnp.array(model.visual_projection[...]))
    model.text_token_projection = nnx.Param(jnp.array(model.text_projection[...]))

  @staticmethod
  def image_tower(model, patches, token_layer, rng):
    dt = jnp.dtype(model.cfg.dtype)
    b = patches.shape[0]
    cls = jnp.broadcast_to(model.class_embedding[...].astype(dt), (b, 1, patches.shape[-1]))
    x = jnp.concatenate([cls, patches], axis=1) + model.vision_positions[...].astype(dt)
    proj = model.visual_projection[...].astype(dt)
    x, kept = model.run_tower(model.vision, model.ln_pre(x), False, token_layer, rng)
    if kept is None:
      return model.ln_post(x[:, 0]) @ proj, None, x
    tok_proj = model.visual_token_projection[...].astype(dt) if model.cfg.token_projection == "separate" else proj
    return model.ln_post(x[:, 0]) @ proj, model.ln_post(kept) @ tok_proj, x

  @staticmethod
  def text_head(model, normed, kept, tokens):
    dt = jnp.dtype(model.cfg.dtype)
    pooled = jnp.take_along_axis(normed, model.eot_positions(tokens)[:, None, None], axis=1)[:, 0]
    proj = model.text_projection[...].astype(dt)
    if kept is None:
      return pooled @ proj, None
    tok_proj = model.text_token_projection[...].astype(dt) if model.cfg.token_projection == "separate" else proj
    return pooled @ proj, model.ln_final(kept) @ tok_proj

  @staticmethod
  def patch_tokens(img_tokens, image_cls_token: bool):
    return img_tokens if image_cls_token else img_tokens[:, 1:]
