"""Read CLIP weights from Hugging Face (CLIPModel, SiglipModel) and OpenAI/Long-CLIP checkpoints into this
project's params layout.

Both readers return (CLIPConfig, params) with params a pure dict of NumPy fp32
arrays shaped like `hnclip_jax.models.init_params`. The architecture is read
from the weights (and config.json), never typed by the user. PyTorch is
imported only for `.pt` / `.bin` files.
"""
from __future__ import annotations

import json
import os
import re
import zipfile

import numpy as np

from hnclip_jax.models import CLIPConfig

LONGCLIP_KEEP = 20  # Long-CLIP: positions < 20 read `positional_embedding`, the rest `positional_embedding_res`


def stretch_positions(pos: np.ndarray, keep: int = 20, factor: int = 4) -> np.ndarray:
  """Long-CLIP's knowledge-preserved stretch: [L, D] -> [keep + factor·(L − keep), D] (77 -> 248 by default).

  The first `keep` rows are copied; each later row i (except the last) is
  followed by `factor − 1` linear interpolations toward row i+1; the last row is
  extrapolated `factor` times along its difference to the one before.
  """
  pos = np.asarray(pos)
  length = pos.shape[0]
  if not 0 < keep < length - 1:
    raise ValueError(f"stretch_positions: keep={keep} must be in 1..{length - 2} for {length} positions")
  w = np.arange(factor)[:, None] / factor  # [factor, 1]
  head = pos[:keep]
  a, b = pos[keep:length - 1], pos[keep + 1:length]  # [n, D] each
  mids = (a[:, None] * (1 - w) + b[:, None] * w).reshape(-1, pos.shape[1])
  tail = pos[-1] + w * (pos[-1] - pos[-2])
  return np.concatenate([head, mids, tail]).astype(pos.dtype)


def _linear(sd, name):
  """A PyTorch Linear (weight [out, in]) -> our kernel [in, out] and bias."""
  return {"kernel": sd[name + ".weight"].T, "bias": sd[name + ".bias"]}


def _norm(sd, name):
  return {"scale": sd[name + ".weight"], "bias": sd[name + ".bias"]}


# --------------------------------------------------------------------------- Hugging Face


def hf_act(name, where):
  acts = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
  if name not in acts:
    raise ValueError(f"{where}: hidden_act={name!r} is not supported ({', '.join(acts)})")
  return acts[name]


def hf_config(config_json: str) -> CLIPConfig:
  """CLIPConfig from a transformers config.json: its model_type names the model family whose Hugging Face mapping
  reads it (models/family.py: `Family.hf_model_type`; an old config without one is CLIP's)."""
  from hnclip_jax.models import family
  with open(config_json) as f:
    c = json.load(f)
  kind = c.get("model_type") or "clip"
  name = family.by_hf_model_type(kind)
  if name is None or "vision_config" not in c or "text_config" not in c:
    known = ", ".join(family.setting(n, "hf_class") for n in family.REGISTRY if family.setting(n, "hf_mapping"))
    raise ValueError(f"{config_json}: not a config of a model family here (model_type={c.get('model_type')!r}); "
                     f"expected a transformers directory of one of: {known}")
  return family.hf(name).config(c, config_json)


def hf_blocks(sd, prefix, layers):
  out = {}
  for i in range(layers):
    p = f"{prefix}.encoder.layers.{i}."
    lin, ln = (lambda name: _linear(sd, p + name)), (lambda name: _norm(sd, p + name))
    out[i] = {"ln1": ln("layer_norm1"), "ln2": ln("layer_norm2"),
              "attn": {k: lin(f"self_attn.{k}_proj") for k in ("q", "k", "v")} | {"out": lin("self_attn.out_proj")},
              "fc1": lin("mlp.fc1"), "fc2": lin("mlp.fc2")}
  return out


# --------------------------------------------------------------------------- OpenAI / Long-CLIP


def _count(sd, pattern):
  return len({m.group(1) for k in sd if (m := re.match(pattern, k))})


def openai_config(sd: dict, where: str) -> CLIPConfig:
  """Architecture from an OpenAI-layout state dict (as OpenAI's own loader infers it; heads = width / 64)."""
  need = ["visual.conv1.weight", "visual.positional_embedding", "visual.proj", "token_embedding.weight",
          "positional_embedding", "ln_final.weight", "text_projection"]
  missing = [k for k in need if k not in sd]
  if missing:
    raise ValueError(f"{where}: not an OpenAI-CLIP state dict (missing {missing[:3]}); ResNet CLIPs and other "
                     "model families are not supported")
  vw, _, patch, _ = sd["visual.conv1.weight"].shape
  grid = int(round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5))
  tw = sd["ln_final.weight"].shape[0]
  vl = _count(sd, r"^visual\.transformer\.resblocks\.(\d+)\.")
  tl = _count(sd, r"^transformer\.resblocks\.(\d+)\.")
  return CLIPConfig(
      embed_dim=sd["text_projection"].shape[1], image_size=patch * grid, patch_size=patch, vision_width=vw,
      vision_layers=vl, vision_heads=vw // 64, vision_mlp_dim=sd["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
      text_context=sd["positional_embedding"].shape[0], vocab_size=sd["token_embedding.weight"].shape[0],
      text_width=tw, text_layers=tl, text_heads=tw // 64,
      text_mlp_dim=sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
      eot_token_id=sd["token_embedding.weight"].shape[0] - 1, act="quick_gelu").validate()


def _openai_blocks(sd, prefix, layers):
  out = {}
  for i in range(layers):
    p = f"{prefix}.resblocks.{i}."
    w, b = sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"]
    width = w.shape[1]
    qkv = {k: {"kernel": w[j * width:(j + 1) * width].T, "bias": b[j * width:(j + 1) * width]}
           for j, k in enumerate("qkv")}
    lin, ln = (lambda name: _linear(sd, p + name)), (lambda name: _norm(sd, p + name))
    out[i] = {"ln1": ln("ln_1"), "ln2": ln("ln_2"), "attn": qkv | {"out": lin("attn.out_proj")},
              "fc1": lin("mlp.c_fc"), "fc2": lin("mlp.c_proj")}
  return out


def openai_params(sd: dict, cfg: CLIPConfig) -> dict:
  ln = lambda name: _norm(sd, name)
  positions = sd["positional_embedding"]
  if "positional_embedding_res" in sd:  # Long-CLIP: two tables, split at position 20
    positions = np.concatenate([positions[:LONGCLIP_KEEP], sd["positional_embedding_res"][LONGCLIP_KEEP:]])
  return {
      "patch_embed": {"kernel": sd["visual.conv1.weight"].transpose(2, 3, 1, 0)},
      "class_embedding": sd["visual.class_embedding"],
      "vision_positions": sd["visual.positional_embedding"],
      "ln_pre": ln("visual.ln_pre"),
      "vision": {"blocks": _openai_blocks(sd, "visual.transformer", cfg.vision_layers)},
      "ln_post": ln("visual.ln_post"),
      "visual_projection": sd["visual.proj"],
      "token_embedding": {"embedding": sd["token_embedding.weight"]},
      "text_positions": positions,
      "text": {"blocks": _openai_blocks(sd, "transformer", cfg.text_layers)},
      "ln_final": ln("ln_final"),
      "text_projection": sd["text_projection"],
      "logit_scale": np.asarray(sd["logit_scale"]).reshape(()),
  }


# --------------------------------------------------------------------------- files


def _to_numpy(sd) -> dict:
  out = {}
  for k, v in sd.items():
    if hasattr(v, "detach"):
      v = v.detach().float().cpu().numpy()
    out[k] = np.asarray(v, np.float32)
  return out


def read_torch_file(path: str) -> dict:
  """A TorchScript archive or a pickled state dict (optionally under "state_dict"/"model") -> NumPy dict."""
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"{path} is a PyTorch file; reading it needs PyTorch (pip install torch). Convert it once "
                      "with `python -m hnclip_jax.pretrained.convert` to train without PyTorch.") from e
  if not zipfile.is_zipfile(path):
    raise ValueError(f"{path}: not a PyTorch checkpoint (not a zip archive; truncated or another format?)")
  try:
    sd = torch.jit.load(path, map_location="cpu").state_dict()
  except Exception:  # not TorchScript: a plain pickled state dict
    try:
      sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
      raise ValueError(f"{path}: cannot be read as a TorchScript archive or a state dict ({e}); the file may be "
                       "truncated — download it again") from e
  if isinstance(sd, dict) and not any(hasattr(v, "shape") for v in sd.values()):
    for key in ("state_dict", "model"):
      if isinstance(sd.get(key), dict):
        sd = sd[key]
        break
  if not isinstance(sd, dict):
    raise ValueError(f"{path}: holds a {type(sd).__name__}, not a state dict")
  sd = {k.removeprefix("module."): v for k, v in sd.items()}
  for k in ("input_resolution", "context_length", "vocab_size"):
    sd.pop(k, None)
  return _to_numpy(sd)


def read_safetensors(path: str) -> dict:
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  try:
    return _to_numpy(load_file(path))
  except (SafetensorError, OSError, ValueError) as e:
    raise ValueError(f"{path}: not a readable safetensors file ({e}); it may be truncated — download it again") from e
  except TypeError as e:  # bf16 tensors cannot be read into NumPy without torch
    raise ValueError(f"{path}: {e}") from e


def read_hf_directory(directory: str):
  """(CLIPConfig, params) from a transformers CLIPModel or SiglipModel directory."""
  config_json = os.path.join(directory, "config.json")
  if not os.path.exists(config_json):
    raise FileNotFoundError(f"{directory}: no config.json; a Hugging Face CLIP directory needs config.json and "
                            "model.safetensors (or pytorch_model.bin)")
  cfg = hf_config(config_json)
  st, pt = os.path.join(directory, "model.safetensors"), os.path.join(directory, "pytorch_model.bin")
  if os.path.exists(st):
    sd, where = read_safetensors(st), st
  elif os.path.exists(pt):
    sd, where = read_torch_file(pt), pt
  else:
    raise FileNotFoundError(f"{directory}: no model.safetensors or pytorch_model.bin next to config.json")
  from hnclip_jax.models import family
  return cfg, family.hf(cfg.family).params(sd, cfg, where)


def read_openai_file(path: str):
  """(CLIPConfig, params) from an OpenAI / Long-CLIP .pt checkpoint."""
  sd = read_torch_file(path)
  cfg = openai_config(sd, path)
  return cfg, openai_params(sd, cfg)


def check_shapes(params, abstract, where: str) -> None:
  """Raises naming the first parameter whose shape differs from the model built from the inferred config."""
  import jax
  got = {jax.tree_util.keystr(p): np.shape(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  for k in sorted(set(got) | set(want)):
    if got.get(k) != want.get(k):
      raise ValueError(f"{where}: parameter {k} has shape {got.get(k)} but the inferred architecture needs "
                       f"{want.get(k)}; the checkpoint is inconsistent or of another model family")
