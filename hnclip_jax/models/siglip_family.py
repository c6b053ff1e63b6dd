"""The SigLIP family (`CLIPConfig.family="siglip"`, transformers' SiglipModel): a patch convolution with a bias and
no class token or pre-LayerNorm, the normalised patch tokens pooled by an attention-pooling ("MAP") head whose output
is the image embedding (embed_dim = vision_width); bidirectional text attention pooled at the last position through
a dense head with a bias; t starts at 10 (SigLIP's initialisation)."""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from hnclip_jax.models.clip import ACTIVATIONS, Attention, _apply, _key, dense_factory
from hnclip_jax.models.family import Family


class MAPHead(nnx.Module):
  """SigLIP's multihead attention-pooling head: a learned probe attends over the tokens, then a residual MLP on
  the pooled vector: y = a + mlp(ln(a)), a = attn(probe, x, x). Its dense layers are named like a block's
  ("vision_head/attn/q", "vision_head/fc1"), so adapters and sharding rules treat them alike."""

  def __init__(self, width, heads, mlp_dim, act, eps, *, dtype, rngs, attention="auto", dense=None,
               prefix="vision_head"):
    dense = dense or dense_factory(None, dtype, rngs)
    self.probe = nnx.Param(nnx.initializers.normal(width ** -0.5)(rngs.params(), (width,)))
    self.attn = Attention(width, heads, dtype=dtype, rngs=rngs, implementation=attention, dense=dense,
                          prefix=f"{prefix}/attn")
    self.ln = nnx.LayerNorm(width, epsilon=eps, dtype=dtype, rngs=rngs)
    init = nnx.initializers.normal((2 * width) ** -0.5)
    self.fc1 = dense(f"{prefix}/fc1", width, mlp_dim, init)
    self.fc2 = dense(f"{prefix}/fc2", mlp_dim, width, init)
    self.act = ACTIVATIONS[act]

  def __call__(self, x, rng=None):  # [B, L, W] -> [B, W]
    a = self.attn.pool(self.probe[...], x, _key(rng, 0))
    return a + _apply(self.fc2, self.act(_apply(self.fc1, self.ln(a), _key(rng, 1))), _key(rng, 2))


class SigLIPFamily(Family):
  name = "siglip"
  patch_bias = True
  causal_text = False
  logit_scale_init = math.log(10.0)

  @staticmethod
  def check(cfg) -> None:
    # SigLIP's conv covers the whole patches only (So400m/14 at 384 px: 27 x 27 patches, the last 6 pixel rows and
    # columns unused), as transformers' does.
    if cfg.embed_dim != cfg.vision_width:
      raise ValueError(f"config.model.embed_dim={cfg.embed_dim} must equal vision_width={cfg.vision_width} for "
                       "family='siglip' (the attention-pooling head's output is the image embedding)")
    if cfg.token_projection == "separate":
      raise ValueError("config.model.token_projection='separate' is for family='clip' (SigLIP's tokens go through "
                       "the towers' own final norms and heads); use 'shared'")

  @staticmethod
  def build_image_stem(model, cfg, dtype, rngs) -> None:
    vw = cfg.vision_width
    n_patches = (cfg.image_size // cfg.patch_size) ** 2
    model.vision_positions = nnx.Param(nnx.initializers.normal(vw ** -0.5)(rngs.params(), (n_patches, vw)))

  @staticmethod
  def build_image_head(model, cfg, dtype, dense, rngs) -> None:
    model.vision_head = MAPHead(cfg.vision_width, cfg.vision_heads, cfg.vision_mlp_dim, cfg.act, cfg.ln_eps,
                                dtype=dtype, rngs=rngs, attention=cfg.attention, dense=dense)

  @staticmethod
  def build_text_head(model, cfg, dtype, rngs) -> None:
    # a dense layer with a bias (not an adapter target: it is the tower's projection)
    model.text_head = nnx.Linear(cfg.text_width, cfg.embed_dim,
                                 kernel_init=nnx.initializers.normal(cfg.text_width ** -0.5), dtype=dtype, rngs=rngs)

  @staticmethod
  def image_tower(model, patches, token_layer, rng):
    dt = jnp.dtype(model.cfg.dtype)
    x = patches + model.vision_positions[...].astype(dt)
    h, kept = model.run_tower(model.vision, x, False, token_layer, rng)
    pooled = model.vision_head(model.ln_post(h), _key(rng, 1 << 20))
    return pooled, (None if kept is None else model.ln_post(kept)), h

  @staticmethod
  def text_head(model, normed, kept, tokens):
    del tokens  # SigLIP pads to the full length: the last position
    return model.text_head(normed[:, -1]), (None if kept is None else model.text_head(model.ln_final(kept)))

  @staticmethod
  def patch_tokens(img_tokens, image_cls_token: bool):
    if image_cls_token:
      raise ValueError("config.loss.token_image_cls=True: a SigLIP image tower has no class token; set it False")
    return img_tokens
