"""State-dict helpers both formats share (NumPy fp32, PyTorch layouts): what export.py and the families'
Hugging Face mappings (hf_clip.py, hf_siglip.py) write a model's parameters with."""
from __future__ import annotations

import dataclasses

import numpy as np

from hnclip_jax.models import abstract_model


def f32(x) -> np.ndarray:
  """A parameter as a contiguous fp32 NumPy array (what both state-dict formats hold)."""
  return np.ascontiguousarray(np.asarray(x, np.float32))


def writers(sd: dict):
  """(linear, norm): write a Dense layer (PyTorch [out, in] weight + bias) or a LayerNorm into `sd` under a name."""
  def linear(name, p):
    sd[name + ".weight"], sd[name + ".bias"] = f32(np.asarray(p["kernel"]).T), f32(p["bias"])

  def norm(name, p):
    sd[name + ".weight"], sd[name + ".bias"] = f32(p["scale"]), f32(p["bias"])

  return linear, norm


def blocks(params, tower):
  blocks = params[tower]["blocks"]
  return [blocks[i] if i in blocks else blocks[str(i)] for i in range(len(blocks))]


def hf_encoder_blocks(params, linear, norm) -> None:
  """Both towers' transformer blocks in transformers' layout (the same in CLIPModel and SiglipModel)."""
  for tower, prefix in (("vision", "vision_model"), ("text", "text_model")):
    for i, b in enumerate(blocks(params, tower)):
      p = f"{prefix}.encoder.layers.{i}."
      norm(p + "layer_norm1", b["ln1"])
      norm(p + "layer_norm2", b["ln2"])
      for k in ("q", "k", "v"):
        linear(p + f"self_attn.{k}_proj", b["attn"][k])
      linear(p + "self_attn.out_proj", b["attn"]["out"])
      linear(p + "mlp.fc1", b["fc1"])
      linear(p + "mlp.fc2", b["fc2"])


HF_ACT = {"gelu_tanh": "gelu_pytorch_tanh"}  # our activation names -> transformers' (the rest are the same)


def parts_left_out(model) -> list[str]:
  """A warning naming a framework's own modules (CLIPConfig.parts, e.g. token aggregators): neither format has a
  place for them, so the export holds the towers only ([] for a model without parts)."""
  if not model.config.parts:
    return []
  towers = set(abstract_model(dataclasses.replace(model.config, parts="", part_settings=()))[1])
  extra = sorted(k for k in model.params if k not in towers)
  return [f"the model's framework modules {extra} ({model.config.parts}) have no place in this format and were left "
          "out: the export holds the towers, so cosine retrieval is the model's; a framework score (eval.py "
          "--score) needs the workdir or pretrained.load of it"]
