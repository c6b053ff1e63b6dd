"""The SigLIP family's Hugging Face mapping (transformers' SiglipModel): config.json and weights read into our
CLIPConfig and params, and a model written back as a SiglipModel directory. models/siglip_family.py names this
module (`SigLIPFamily.hf_mapping`); pretrained/ reaches it through `models.family.hf("siglip")`."""
from __future__ import annotations

import json
import os

import numpy as np

from hnclip_jax.models import CLIPConfig
from hnclip_jax.pretrained.layout import f32, hf_encoder_blocks, parts_left_out, writers
from hnclip_jax.pretrained.weights import _linear, _norm, hf_act, hf_blocks



def tokenizer(directory: str, context: int):
  """SigLIP's SentencePiece model (spiece.model) or tokenizer.json next to the weights."""
  from hnclip_jax.data.siglip_tokenizer import SigLIPTokenizer
  return SigLIPTokenizer.from_directory(directory, context)


TOKENIZER_NAME = "SigLIP"
TEXT_CONTEXTS = (64, 196)  # the checkpoints' positions; configs/siglip.py stretches them to 196 (Long-CLIP's way)


def owns_directory(directory: str) -> bool:
  """A SigLIP tokenizer directory even without a config.json: SentencePiece's spiece.model, which CLIP never ships."""
  from hnclip_jax.data.siglip_tokenizer import SPIECE
  return os.path.exists(os.path.join(directory, SPIECE))


SIGLIP_EOS = 1  # "</s>" in SigLIP's SentencePiece vocabulary and Gemma's (SigLIP 2)


def config(c: dict, where: str) -> CLIPConfig:
  """CLIPConfig(family="siglip") from a transformers SiglipModel config.json (SigLIP and fixed-resolution SigLIP 2
  checkpoints; defaults as transformers' SiglipVisionConfig / SiglipTextConfig)."""
  v, t = c.get("vision_config", {}), c.get("text_config", {})
  act_v, act_t = (hf_act(x.get("hidden_act", "gelu_pytorch_tanh"), where) for x in (v, t))
  if act_v != act_t:
    raise ValueError(f"{where}: the towers use different activations ({act_v}, {act_t}); not supported")
  if not v.get("vision_use_head", True):
    raise ValueError(f"{where}: vision_use_head=false (no attention-pooling head, so no image embedding); "
                     "use a SiglipModel checkpoint")
  eps_v, eps_t = v.get("layer_norm_eps", 1e-6), t.get("layer_norm_eps", 1e-6)
  if eps_v != eps_t:
    raise ValueError(f"{where}: the towers use different layer_norm_eps ({eps_v}, {eps_t}); not supported")
  width = v.get("hidden_size", 768)
  projection = t.get("projection_size") or t.get("hidden_size", 768)
  if projection != width:
    raise ValueError(f"{where}: text projection_size={projection} differs from the vision hidden_size={width}; "
                     "the embeddings could not be compared")
  vocab = t.get("vocab_size", 32000)
  eos = t.get("eos_token_id", SIGLIP_EOS)
  if not isinstance(eos, int) or not 0 <= eos < vocab:  # transformers' default 49407 is not a SigLIP id
    eos = SIGLIP_EOS
  return CLIPConfig(
      family="siglip", logit_bias=True, embed_dim=width, image_size=v.get("image_size", 224),
      patch_size=v.get("patch_size", 16), vision_width=width, vision_layers=v.get("num_hidden_layers", 12),
      vision_heads=v.get("num_attention_heads", 12), vision_mlp_dim=v.get("intermediate_size", 3072),
      text_context=t.get("max_position_embeddings", 64), vocab_size=vocab, text_width=t.get("hidden_size", 768),
      text_layers=t.get("num_hidden_layers", 12), text_heads=t.get("num_attention_heads", 12),
      text_mlp_dim=t.get("intermediate_size", 3072), eot_token_id=eos, act=act_v, ln_eps=eps_v).validate()


def params(sd: dict, cfg: CLIPConfig, where: str) -> dict:
  ln = lambda name: _norm(sd, name)
  lin = lambda name: _linear(sd, name)
  try:
    h = "vision_model.head."
    w, b = sd[h + "attention.in_proj_weight"], sd[h + "attention.in_proj_bias"]  # torch MultiheadAttention: [3W, W]
    width = w.shape[1]
    qkv = {k: {"kernel": w[j * width:(j + 1) * width].T, "bias": b[j * width:(j + 1) * width]}
           for j, k in enumerate("qkv")}
    return {
        "patch_embed": {"kernel": sd["vision_model.embeddings.patch_embedding.weight"].transpose(2, 3, 1, 0),
                        "bias": sd["vision_model.embeddings.patch_embedding.bias"]},
        "vision_positions": sd["vision_model.embeddings.position_embedding.weight"],
        "vision": {"blocks": hf_blocks(sd, "vision_model", cfg.vision_layers)},
        "ln_post": ln("vision_model.post_layernorm"),
        "vision_head": {"probe": sd[h + "probe"].reshape(-1), "attn": qkv | {"out": lin(h + "attention.out_proj")},
                        "ln": ln(h + "layernorm"), "fc1": lin(h + "mlp.fc1"), "fc2": lin(h + "mlp.fc2")},
        "token_embedding": {"embedding": sd["text_model.embeddings.token_embedding.weight"]},
        "text_positions": sd["text_model.embeddings.position_embedding.weight"],
        "text": {"blocks": hf_blocks(sd, "text_model", cfg.text_layers)},
        "ln_final": ln("text_model.final_layer_norm"),
        "text_head": lin("text_model.head"),
        "logit_scale": sd["logit_scale"].reshape(()),
        "logit_bias": sd["logit_bias"].reshape(()),
    }
  except KeyError as e:
    raise ValueError(f"{where}: weight {e.args[0]!r} is missing; is this a transformers SiglipModel checkpoint?") from e


def state_dict(params, cfg) -> dict:
  """Our SigLIP params -> transformers SiglipModel state dict (NumPy fp32, PyTorch layouts)."""
  sd = {}
  linear, norm = writers(sd)
  hf_encoder_blocks(params, linear, norm)
  sd["vision_model.embeddings.patch_embedding.weight"] = f32(
      np.asarray(params["patch_embed"]["kernel"]).transpose(3, 2, 0, 1))
  sd["vision_model.embeddings.patch_embedding.bias"] = f32(params["patch_embed"]["bias"])
  sd["vision_model.embeddings.position_embedding.weight"] = f32(params["vision_positions"])
  norm("vision_model.post_layernorm", params["ln_post"])
  head = params["vision_head"]
  sd["vision_model.head.probe"] = f32(head["probe"]).reshape(1, 1, -1)
  sd["vision_model.head.attention.in_proj_weight"] = f32(np.concatenate(
      [np.asarray(head["attn"][k]["kernel"]).T for k in "qkv"]))
  sd["vision_model.head.attention.in_proj_bias"] = f32(np.concatenate([np.asarray(head["attn"][k]["bias"])
                                                                       for k in "qkv"]))
  linear("vision_model.head.attention.out_proj", head["attn"]["out"])
  norm("vision_model.head.layernorm", head["ln"])
  linear("vision_model.head.mlp.fc1", head["fc1"])
  linear("vision_model.head.mlp.fc2", head["fc2"])
  sd["text_model.embeddings.token_embedding.weight"] = f32(params["token_embedding"]["embedding"])
  sd["text_model.embeddings.position_embedding.weight"] = f32(params["text_positions"])
  norm("text_model.final_layer_norm", params["ln_final"])
  linear("text_model.head", params["text_head"])
  sd["logit_scale"] = f32(params["logit_scale"]).reshape(1)
  sd["logit_bias"] = f32(params["logit_bias"]).reshape(1)
  return sd


HF_ACT = {"gelu_tanh": "gelu_pytorch_tanh"}  # our activation names -> transformers' (the rest are the same)


def config_dict(cfg) -> dict:
  common = {"hidden_act": HF_ACT.get(cfg.act, cfg.act), "layer_norm_eps": cfg.ln_eps}
  return {
      "architectures": ["SiglipModel"], "model_type": "siglip",
      "text_config": {**common, "vocab_size": cfg.vocab_size, "hidden_size": cfg.text_width,
                      "intermediate_size": cfg.text_mlp_dim, "num_hidden_layers": cfg.text_layers,
                      "num_attention_heads": cfg.text_heads, "max_position_embeddings": cfg.text_context,
                      "projection_size": cfg.embed_dim, "eos_token_id": cfg.eot_token_id},
      "vision_config": {**common, "hidden_size": cfg.vision_width, "intermediate_size": cfg.vision_mlp_dim,
                        "num_hidden_layers": cfg.vision_layers, "num_attention_heads": cfg.vision_heads,
                        "image_size": cfg.image_size, "patch_size": cfg.patch_size, "num_channels": 3,
                        "vision_use_head": True},
  }


def export(model, out_dir: str) -> list[str]:
  """A SigLIP model as a transformers SiglipModel directory: weights, config.json, SigLIP's
  preprocessor_config.json and the tokenizer file it came with (spiece.model or tokenizer.json)."""
  from safetensors.numpy import save_file
  cfg = model.config
  if not cfg.logit_bias:
    raise ValueError("this SigLIP-family model has no logit bias (config.model.logit_bias=False); transformers' "
                     "SiglipModel needs one")
  os.makedirs(out_dir, exist_ok=True)
  save_file(state_dict(model.params, cfg), os.path.join(out_dir, "model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config_dict(cfg), f, indent=2)
  s = cfg.image_size
  with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
    json.dump({"image_processor_type": "SiglipImageProcessor", "do_resize": True, "size": {"height": s, "width": s},
               "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
               "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}, f, indent=2)
  tok = model.tokenizer
  if tok is None or tok.kind != "siglip":
    return parts_left_out(model) + [f"{model.source} has no SigLIP tokenizer file (spiece.model or tokenizer.json): "
                                    f"{out_dir} has the weights and configs only; copy the tokenizer next to them"]
  import shutil
  shutil.copyfile(tok.path, os.path.join(out_dir, os.path.basename(tok.path)))
  if os.path.basename(tok.path) == "spiece.model":
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
      json.dump({"tokenizer_class": "SiglipTokenizer", "model_max_length": cfg.text_context, "eos_token": "</s>",
                 "pad_token": "</s>", "unk_token": "<unk>", "do_lower_case": True}, f, indent=2)
  return parts_left_out(model)
