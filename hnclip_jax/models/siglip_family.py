"""The SigLIP family (`CLIPConfig.family="siglip"`, transformers' SiglipModel): a patch convolution with a bias and
no class token or pre-LayerNorm, the normalised patch tokens pooled by an attention-pooling ("MAP") head whose output
is the image embedding (embed_dim = vision_width); bidirectional text attention pooled at the last position through
a dense head with a bias; t starts at 10 (SigLIP's initialisation)."""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hnclip_jax.data import images
from hnclip_jax.models.clip import ACTIVATIONS, Attention, CLIPConfig, apply_dense, dense_factory, dropout_key
from hnclip_jax.models.family import Family


def _siglip(width, layers, heads, mlp, image, patch, vocab=32000, context=64):
  """A SigLIP size (transformers' SiglipModel; SigLIP's SentencePiece vocabulary, 64 text positions, "</s>" = 1)."""
  return CLIPConfig(family="siglip", logit_bias=True, embed_dim=width, image_size=image, patch_size=patch,
                    vision_width=width, vision_layers=layers, vision_heads=heads, vision_mlp_dim=mlp,
                    text_context=context, vocab_size=vocab, text_width=width, text_layers=layers, text_heads=heads,
                    text_mlp_dim=mlp, eot_token_id=1, act="gelu_tanh", ln_eps=1e-6)


# SigLIP's published sizes (SigLIP 2's fixed-resolution checkpoints have the same towers with Gemma's 256k
# vocabulary: set model.vocab_size from the tokenizer). "tiny_siglip" is the CPU demo size.
PRESETS = {
    "tiny_siglip": dataclasses.replace(_siglip(128, 2, 4, 512, 64, 8, vocab=49408, context=77), eot_token_id=49407),
    "siglip_b16_224": _siglip(768, 12, 12, 3072, 224, 16),
    "siglip_b16_256": _siglip(768, 12, 12, 3072, 256, 16),
    "siglip_l16_256": _siglip(1024, 24, 16, 4096, 256, 16),
    "siglip_so400m14_384": _siglip(1152, 27, 16, 4304, 384, 14),
}


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
    a = self.attn.pool(self.probe[...], x, dropout_key(rng, 0))
    return a + apply_dense(self.fc2, self.act(apply_dense(self.fc1, self.ln(a), dropout_key(rng, 1))),
                           dropout_key(rng, 2))


class SigLIPFamily(Family):
  name = "siglip"
  patch_bias = True
  causal_text = False
  logit_scale_init = math.log(10.0)
  # Its heads: the text head is a projection like CLIP's; the attention-pooling query is replicated (its dense
  # layers are named like a block's, vision_head/attn/q, and follow the shared rules).
  modules = ("vision_head", "text_head")
  logical_axes = ((r"^text_head/kernel$", ("embed", None)), (r"^vision_head/probe$", "replicated"))
  presets = PRESETS
  hf_mapping = "hnclip_jax.pretrained.hf_siglip"
  hf_model_type = "siglip"
  hf_class = "SiglipModel"

  @staticmethod
  def preprocess(image, size: int):
    """SigLIP's: the whole image resized to size x size (bicubic, no crop), mean 0.5 / std 0.5."""
    u8 = images.resize_square(image, size)
    return u8, np.asarray(u8, np.float32) / 127.5 - 1.0

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
    pooled = model.vision_head(model.ln_post(h), dropout_key(rng, 1 << 20))
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
