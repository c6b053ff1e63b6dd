"""The CLIP family's Hugging Face mapping (transformers' CLIPModel): config.json and weights read into our
CLIPConfig and params, and a model written back as a CLIPModel directory. models/clip_family.py names this module
(`CLIPFamily.hf_mapping`); pretrained/ reaches it through `models.family.hf("clip")`."""
from __future__ import annotations

import json
import os

import numpy as np

from hnclip_jax.data import images
from hnclip_jax.data.tokenizer import EOT, PAD, SOT, UNK
from hnclip_jax.models import CLIPConfig
from hnclip_jax.pretrained.layout import f32, hf_encoder_blocks, parts_left_out, writers
from hnclip_jax.pretrained.weights import _norm, hf_act, hf_blocks


def tokenizer(directory: str, context: int):
  """The tokenizer files next to the weights (CLIP's BPE, or the word-level tokenizer.json of an export)."""
  from hnclip_jax.pretrained import tokenizer_near
  return tokenizer_near(directory, context)


TOKENIZER_NAME = "CLIP BPE"
TEXT_CONTEXTS = (77, 248)  # CLIP's positions and Long-CLIP's stretch of them


def owns_directory(directory: str) -> bool:
  """A CLIP tokenizer directory without a config.json: transformers' vocab.json + merges.txt, or a tokenizer.json
  whose vocabulary has CLIP's start token."""
  if all(os.path.exists(os.path.join(directory, f)) for f in ("vocab.json", "merges.txt")):
    return True
  tj = os.path.join(directory, "tokenizer.json")
  if not os.path.exists(tj):
    return False
  with open(tj, encoding="utf-8") as f:
    return SOT in (json.load(f).get("model", {}).get("vocab") or {})


def config(c: dict, config_json: str) -> CLIPConfig:
  """CLIPConfig(family="clip") from a transformers CLIPModel config.json's contents."""
  v, t = c["vision_config"], c["text_config"]
  act_v, act_t = hf_act(v.get("hidden_act", "quick_gelu"), config_json), hf_act(t.get("hidden_act", "quick_gelu"),
                                                                                config_json)
  if act_v != act_t:
    raise ValueError(f"{config_json}: the towers use different activations ({act_v}, {act_t}); not supported")
  eos = t.get("eos_token_id", 49407)
  if eos == 2:  # old configs: Hugging Face then pools at argmax(input_ids), i.e. CLIP's end token (the largest id)
    eos = t.get("vocab_size", 49408) - 1
  return CLIPConfig(
      embed_dim=c.get("projection_dim", 512), image_size=v.get("image_size", 224), patch_size=v.get("patch_size", 32),
      vision_width=v.get("hidden_size", 768), vision_layers=v.get("num_hidden_layers", 12),
      vision_heads=v.get("num_attention_heads", 12), vision_mlp_dim=v.get("intermediate_size", 3072),
      text_context=t.get("max_position_embeddings", 77), vocab_size=t.get("vocab_size", 49408),
      text_width=t.get("hidden_size", 512), text_layers=t.get("num_hidden_layers", 12),
      text_heads=t.get("num_attention_heads", 8), text_mlp_dim=t.get("intermediate_size", 2048),
      eot_token_id=eos, act=act_v, ln_eps=v.get("layer_norm_eps", 1e-5)).validate()


def params(sd: dict, cfg: CLIPConfig, where: str) -> dict:
  ln = lambda name: _norm(sd, name)
  try:
    return {
        "patch_embed": {"kernel": sd["vision_model.embeddings.patch_embedding.weight"].transpose(2, 3, 1, 0)},
        "class_embedding": sd["vision_model.embeddings.class_embedding"],
        "vision_positions": sd["vision_model.embeddings.position_embedding.weight"],
        "ln_pre": ln("vision_model.pre_layrnorm"),
        "vision": {"blocks": hf_blocks(sd, "vision_model", cfg.vision_layers)},
        "ln_post": ln("vision_model.post_layernorm"),
        "visual_projection": sd["visual_projection.weight"].T,
        "token_embedding": {"embedding": sd["text_model.embeddings.token_embedding.weight"]},
        "text_positions": sd["text_model.embeddings.position_embedding.weight"],
        "text": {"blocks": hf_blocks(sd, "text_model", cfg.text_layers)},
        "ln_final": ln("text_model.final_layer_norm"),
        "text_projection": sd["text_projection.weight"].T,
        "logit_scale": sd["logit_scale"].reshape(()),
    }
  except KeyError as e:
    raise ValueError(f"{where}: weight {e.args[0]!r} is missing; is this a transformers CLIPModel checkpoint?") from e


def state_dict(params, cfg) -> dict:
  """Our params -> transformers CLIPModel state dict (NumPy fp32, PyTorch layouts)."""
  if cfg.token_projection != "shared":
    raise ValueError("this model has separate token projections (config.model.token_projection='separate'); the "
                     "Hugging Face CLIP format has no place for them")
  sd = {}
  linear, norm = writers(sd)
  hf_encoder_blocks(params, linear, norm)
  sd["vision_model.embeddings.patch_embedding.weight"] = f32(
      np.asarray(params["patch_embed"]["kernel"]).transpose(3, 2, 0, 1))
  sd["vision_model.embeddings.class_embedding"] = f32(params["class_embedding"])
  sd["vision_model.embeddings.position_embedding.weight"] = f32(params["vision_positions"])
  norm("vision_model.pre_layrnorm", params["ln_pre"])
  norm("vision_model.post_layernorm", params["ln_post"])
  sd["visual_projection.weight"] = f32(np.asarray(params["visual_projection"]).T)
  sd["text_model.embeddings.token_embedding.weight"] = f32(params["token_embedding"]["embedding"])
  sd["text_model.embeddings.position_embedding.weight"] = f32(params["text_positions"])
  norm("text_model.final_layer_norm", params["ln_final"])
  sd["text_projection.weight"] = f32(np.asarray(params["text_projection"]).T)
  sd["logit_scale"] = f32(params["logit_scale"]).reshape(())
  return sd


def config_dict(cfg) -> dict:
  common = {"hidden_act": cfg.act, "layer_norm_eps": cfg.ln_eps, "projection_dim": cfg.embed_dim}
  return {
      "architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": cfg.embed_dim,
      "logit_scale_init_value": 2.6592,
      "text_config": {**common, "vocab_size": cfg.vocab_size, "hidden_size": cfg.text_width,
                      "intermediate_size": cfg.text_mlp_dim, "num_hidden_layers": cfg.text_layers,
                      "num_attention_heads": cfg.text_heads, "max_position_embeddings": cfg.text_context,
                      "eos_token_id": cfg.eot_token_id},  # the pooled (end) token
      "vision_config": {**common, "hidden_size": cfg.vision_width, "intermediate_size": cfg.vision_mlp_dim,
                        "num_hidden_layers": cfg.vision_layers, "num_attention_heads": cfg.vision_heads,
                        "image_size": cfg.image_size, "patch_size": cfg.patch_size, "num_channels": 3},
  }


def export(model, out_dir: str) -> list[str]:
  """A CLIP-family model as a transformers CLIPModel directory; returns warnings."""
  from safetensors.numpy import save_file
  os.makedirs(out_dir, exist_ok=True)
  save_file(state_dict(model.params, model.config), os.path.join(out_dir, "model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config_dict(model.config), f, indent=2)
  s = model.config.image_size
  with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
    json.dump({"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": s},
               "resample": 3, "do_center_crop": True, "crop_size": {"height": s, "width": s}, "do_rescale": True,
               "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": images.CLIP_MEAN.tolist(),
               "image_std": images.CLIP_STD.tolist(),
               "do_convert_rgb": True}, f, indent=2)
  tok = model.tokenizer
  if tok is None:
    return parts_left_out(model) + [
        f"{model.source} has no tokenizer files (vocab.json + merges.txt, tokenizer.json or "
        f"bpe_simple_vocab_16e6.txt.gz): {out_dir} has the weights, config.json and preprocessor_config.json "
        "only; copy the tokenizer files the model was trained with next to them"]
  if tok.kind == "clip_bpe":
    tok._tok.model.save(out_dir)  # vocab.json + merges.txt, the files transformers' CLIPTokenizer reads
    tok_config = {"tokenizer_class": "CLIPTokenizer", "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
                  "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
  elif tok.kind == "word":
    _word_tokenizer_json(tok, os.path.join(out_dir, "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SOT, "eos_token": EOT,
                  "unk_token": UNK, "pad_token": PAD, "padding_side": "right", "truncation_side": "right"}
  else:
    return parts_left_out(model) + [f"the model's tokenizer is of kind {tok.kind!r}, which has no Hugging Face "
                                    "export: no tokenizer files were written"]
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump({**tok_config, "model_max_length": model.config.text_context}, f, indent=2)
  return parts_left_out(model)


def _word_tokenizer_json(tok, path: str) -> None:
  """The word-level tokenizer as one tokenizer.json that adds start/end tokens like training does; with
  `padding="max_length", truncation=True, max_length=context` it gives our ids (pad id 0)."""
  import tokenizers
  from tokenizers import processors
  t = tokenizers.Tokenizer.from_str(tok._tok.to_str())  # a copy: the post-processor is for the export only
  t.post_processor = processors.TemplateProcessing(single=f"{SOT} $A {EOT}",
                                                   special_tokens=[(SOT, tok.sot_id), (EOT, tok.eot_id)])
  t.save(path)


# --------------------------------------------------------------------------- OpenAI / Long-CLIP
