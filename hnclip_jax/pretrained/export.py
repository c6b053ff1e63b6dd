"""Export a model to the Hugging Face CLIP / SigLIP format or the OpenAI / Long-CLIP state-dict format (the
inverses of `weights.read_hf_directory` and `weights.read_openai_file`):

  python -m hnclip_jax.pretrained.export SOURCE OUT [--format hf|openai] [--step N]

SOURCE: anything `pretrained.load` reads (a train.py workdir, optionally at --step, a converted directory, a Hugging
Face directory, an OpenAI/Long-CLIP .pt). LoRA / DoRA adapters are folded into the weights first.

--format=hf (default): OUT is a directory with config.json and model.safetensors that
`transformers.CLIPModel.from_pretrained` loads (max_position_embeddings = the model's text context, 248 for
Long-CLIP), preprocessor_config.json (CLIP's resize / centre crop / normalisation at the model's image size) and the
tokenizer: vocab.json + merges.txt for CLIP's BPE (`CLIPTokenizer`), tokenizer.json for the word-level tokenizer of
models trained from scratch here (`PreTrainedTokenizerFast`, start/end tokens and padding as in training). A SigLIP
model (config.model.family='siglip') is written as a `transformers.SiglipModel` directory with SigLIP's
preprocessor_config.json and its own tokenizer file (spiece.model or tokenizer.json).

--format=openai: OUT is a .pt file holding an OpenAI-CLIP state dict (what `clip.model.build_model` reads); a
248-token model gets Long-CLIP's two position tables (`positional_embedding` for positions < 20,
`positional_embedding_res` for the rest; both [248, width], as Long-CLIP's `build_model` expects). Writing it needs
PyTorch. The format stores no tokenizer and fixes the architecture rules OpenAI's loader infers (QuickGELU, 64-wide
heads, the end token = the last id); a model outside them is refused with the reason.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from absl import app, flags

from hnclip_jax import paths
from hnclip_jax.cli import clean_errors
from hnclip_jax.data.tokenizer import EOT, PAD, SOT, UNK
from hnclip_jax.models import abstract_model

flags.DEFINE_integer("step", None, "Checkpoint step of a train.py workdir (default: the newest).")
flags.DEFINE_enum("format", "hf", ["hf", "openai"], "hf: a transformers CLIPModel directory; openai: an "
                  "OpenAI/Long-CLIP state dict .pt file.")

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
LONGCLIP_CONTEXT = 248  # Long-CLIP's model code has 248 positions in two tables


def _f32(x) -> np.ndarray:
  """A parameter as a contiguous fp32 NumPy array (what both state-dict formats hold)."""
  return np.ascontiguousarray(np.asarray(x, np.float32))


def _writers(sd: dict):
  """(linear, norm): write a Dense layer (PyTorch [out, in] weight + bias) or a LayerNorm into `sd` under a name."""
  def linear(name, p):
    sd[name + ".weight"], sd[name + ".bias"] = _f32(np.asarray(p["kernel"]).T), _f32(p["bias"])

  def norm(name, p):
    sd[name + ".weight"], sd[name + ".bias"] = _f32(p["scale"]), _f32(p["bias"])

  return linear, norm


def _blocks(params, tower):
  blocks = params[tower]["blocks"]
  return [blocks[i] if i in blocks else blocks[str(i)] for i in range(len(blocks))]


def _hf_encoder_blocks(params, linear, norm) -> None:
  """Both towers' transformer blocks in transformers' layout (the same in CLIPModel and SiglipModel)."""
  for tower, prefix in (("vision", "vision_model"), ("text", "text_model")):
    for i, b in enumerate(_blocks(params, tower)):
      p = f"{prefix}.encoder.layers.{i}."
      norm(p + "layer_norm1", b["ln1"])
      norm(p + "layer_norm2", b["ln2"])
      for k in ("q", "k", "v"):
        linear(p + f"self_attn.{k}_proj", b["attn"][k])
      linear(p + "self_attn.out_proj", b["attn"]["out"])
      linear(p + "mlp.fc1", b["fc1"])
      linear(p + "mlp.fc2", b["fc2"])


def hf_state_dict(params, cfg) -> dict:
  """Our params -> transformers CLIPModel state dict (NumPy fp32, PyTorch layouts)."""
  if cfg.token_projection != "shared":
    raise ValueError("this model has separate token projections (config.model.token_projection='separate'); the "
                     "Hugging Face CLIP format has no place for them")
  sd = {}
  linear, norm = _writers(sd)
  _hf_encoder_blocks(params, linear, norm)
  sd["vision_model.embeddings.patch_embedding.weight"] = _f32(
      np.asarray(params["patch_embed"]["kernel"]).transpose(3, 2, 0, 1))
  sd["vision_model.embeddings.class_embedding"] = _f32(params["class_embedding"])
  sd["vision_model.embeddings.position_embedding.weight"] = _f32(params["vision_positions"])
  norm("vision_model.pre_layrnorm", params["ln_pre"])
  norm("vision_model.post_layernorm", params["ln_post"])
  sd["visual_projection.weight"] = _f32(np.asarray(params["visual_projection"]).T)
  sd["text_model.embeddings.token_embedding.weight"] = _f32(params["token_embedding"]["embedding"])
  sd["text_model.embeddings.position_embedding.weight"] = _f32(params["text_positions"])
  norm("text_model.final_layer_norm", params["ln_final"])
  sd["text_projection.weight"] = _f32(np.asarray(params["text_projection"]).T)
  sd["logit_scale"] = _f32(params["logit_scale"]).reshape(())
  return sd


def hf_siglip_state_dict(params, cfg) -> dict:
  """Our SigLIP params -> transformers SiglipModel state dict (NumPy fp32, PyTorch layouts)."""
  sd = {}
  linear, norm = _writers(sd)
  _hf_encoder_blocks(params, linear, norm)
  sd["vision_model.embeddings.patch_embedding.weight"] = _f32(
      np.asarray(params["patch_embed"]["kernel"]).transpose(3, 2, 0, 1))
  sd["vision_model.embeddings.patch_embedding.bias"] = _f32(params["patch_embed"]["bias"])
  sd["vision_model.embeddings.position_embedding.weight"] = _f32(params["vision_positions"])
  norm("vision_model.post_layernorm", params["ln_post"])
  head = params["vision_head"]
  sd["vision_model.head.probe"] = _f32(head["probe"]).reshape(1, 1, -1)
  sd["vision_model.head.attention.in_proj_weight"] = _f32(np.concatenate(
      [np.asarray(head["attn"][k]["kernel"]).T for k in "qkv"]))
  sd["vision_model.head.attention.in_proj_bias"] = _f32(np.concatenate([np.asarray(head["attn"][k]["bias"])
                                                                       for k in "qkv"]))
  linear("vision_model.head.attention.out_proj", head["attn"]["out"])
  norm("vision_model.head.layernorm", head["ln"])
  linear("vision_model.head.mlp.fc1", head["fc1"])
  linear("vision_model.head.mlp.fc2", head["fc2"])
  sd["text_model.embeddings.token_embedding.weight"] = _f32(params["token_embedding"]["embedding"])
  sd["text_model.embeddings.position_embedding.weight"] = _f32(params["text_positions"])
  norm("text_model.final_layer_norm", params["ln_final"])
  linear("text_model.head", params["text_head"])
  sd["logit_scale"] = _f32(params["logit_scale"]).reshape(1)
  sd["logit_bias"] = _f32(params["logit_bias"]).reshape(1)
  return sd


HF_ACT = {"gelu_tanh": "gelu_pytorch_tanh"}  # our activation names -> transformers' (the rest are the same)


def hf_siglip_config_dict(cfg) -> dict:
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


def export_hf_siglip(model, out_dir: str) -> list[str]:
  """A SigLIP model as a transformers SiglipModel directory: weights, config.json, SigLIP's
  preprocessor_config.json and the tokenizer file it came with (spiece.model or tokenizer.json)."""
  from safetensors.numpy import save_file
  cfg = model.config
  if not cfg.logit_bias:
    raise ValueError("this SigLIP-family model has no logit bias (config.model.logit_bias=False); transformers' "
                     "SiglipModel needs one")
  os.makedirs(out_dir, exist_ok=True)
  save_file(hf_siglip_state_dict(model.params, cfg), os.path.join(out_dir, "model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_siglip_config_dict(cfg), f, indent=2)
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


def hf_config_dict(cfg) -> dict:
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


def export_hf(model, out_dir: str) -> list[str]:
  """Writes the Hugging Face directory (CLIPModel, or SiglipModel for SigLIP towers); returns warnings (what could
  not be exported)."""
  return HF_EXPORTS[model.config.family](model, out_dir)


def export_hf_clip(model, out_dir: str) -> list[str]:
  """A CLIP-family model as a transformers CLIPModel directory; returns warnings."""
  from safetensors.numpy import save_file
  os.makedirs(out_dir, exist_ok=True)
  save_file(hf_state_dict(model.params, model.config), os.path.join(out_dir, "model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config_dict(model.config), f, indent=2)
  s = model.config.image_size
  with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
    json.dump({"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": s},
               "resample": 3, "do_center_crop": True, "crop_size": {"height": s, "width": s}, "do_rescale": True,
               "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
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


# CLIPConfig.family -> (its transformers class, its Hugging Face export); its OpenAI-format export, where it has one.
HF_EXPORTS = {"clip": export_hf_clip, "siglip": export_hf_siglip}
HF_CLASSES = {"clip": "CLIPModel", "siglip": "SiglipModel"}
OPENAI_FAMILIES = ("clip",)


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


def openai_state_dict(params, cfg) -> dict:
  """Our params -> an OpenAI-CLIP state dict (NumPy fp32); Long-CLIP's two position tables at 248 tokens."""
  why = []
  if cfg.token_projection != "shared":
    why.append("it has separate token projections (config.model.token_projection='separate')")
  if cfg.family not in OPENAI_FAMILIES:
    raise ValueError(f"a {cfg.family} model cannot be written in the OpenAI CLIP format; export it with --format=hf "
                     f"(a transformers {HF_CLASSES[cfg.family]} directory)")
  if cfg.act != "quick_gelu":
    why.append(f"its activation is {cfg.act!r} (OpenAI's model code is QuickGELU)")
  for tower, width, heads in (("vision", cfg.vision_width, cfg.vision_heads), ("text", cfg.text_width,
                                                                                cfg.text_heads)):
    if heads * 64 != width:
      why.append(f"its {tower} tower has {heads} heads of width {width // heads} (OpenAI's loader infers "
                 f"width / 64 = {width // 64} heads)")
  if cfg.eot_token_id != cfg.vocab_size - 1:
    why.append(f"its end token is id {cfg.eot_token_id}, not the last id {cfg.vocab_size - 1} (OpenAI's code pools "
               "at the largest id)")
  if why:
    raise ValueError("this model cannot be written in the OpenAI format: " + "; ".join(why) + ". Export it with "
                     "--format=hf instead")
  sd = {}
  linear, norm = _writers(sd)

  for tower, prefix in (("vision", "visual.transformer"), ("text", "transformer")):
    for i, b in enumerate(_blocks(params, tower)):
      p = f"{prefix}.resblocks.{i}."
      sd[p + "attn.in_proj_weight"] = _f32(np.concatenate([np.asarray(b["attn"][k]["kernel"]).T for k in "qkv"]))
      sd[p + "attn.in_proj_bias"] = _f32(np.concatenate([np.asarray(b["attn"][k]["bias"]) for k in "qkv"]))
      linear(p + "attn.out_proj", b["attn"]["out"])
      norm(p + "ln_1", b["ln1"])
      norm(p + "ln_2", b["ln2"])
      linear(p + "mlp.c_fc", b["fc1"])
      linear(p + "mlp.c_proj", b["fc2"])
  sd["visual.conv1.weight"] = _f32(np.asarray(params["patch_embed"]["kernel"]).transpose(3, 2, 0, 1))
  sd["visual.class_embedding"] = _f32(params["class_embedding"])
  sd["visual.positional_embedding"] = _f32(params["vision_positions"])
  norm("visual.ln_pre", params["ln_pre"])
  norm("visual.ln_post", params["ln_post"])
  sd["visual.proj"] = _f32(params["visual_projection"])
  sd["token_embedding.weight"] = _f32(params["token_embedding"]["embedding"])
  positions = _f32(params["text_positions"])
  sd["positional_embedding"] = positions
  if cfg.text_context == LONGCLIP_CONTEXT:  # Long-CLIP: rows < 20 are read from the first table, the rest from
    sd["positional_embedding_res"] = positions.copy()  # the second; both hold the whole table
  norm("ln_final", params["ln_final"])
  sd["text_projection"] = _f32(params["text_projection"])
  sd["logit_scale"] = _f32(params["logit_scale"]).reshape(())
  return sd


def check_openai_out(out_file: str) -> None:
  if not out_file.endswith((".pt", ".pth")):
    raise ValueError(f"--format=openai writes one state-dict file: OUT={out_file!r} should end in .pt")


def export_openai(model, out_file: str) -> list[str]:
  """Writes the OpenAI / Long-CLIP .pt; returns warnings."""
  check_openai_out(out_file)
  if os.path.isdir(out_file):
    raise IsADirectoryError(f"OUT={out_file!r} is a directory; --format=openai writes a .pt file")
  sd = openai_state_dict(model.params, model.config)
  try:
    import torch
  except ImportError as e:
    raise ImportError("--format=openai writes a PyTorch .pt file and needs PyTorch (pip install torch); "
                      "--format=hf needs no PyTorch") from e
  os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
  tmp = out_file + ".tmp"
  torch.save({k: torch.from_numpy(v) for k, v in sd.items()}, tmp)
  os.replace(tmp, out_file)
  tok = model.tokenizer
  if tok is not None and tok.kind != "clip_bpe":
    return parts_left_out(model) + [
        f"the model's tokenizer is {tok.kind!r} (fitted on the training captions), not CLIP's BPE; the OpenAI "
        "format stores no tokenizer, and OpenAI/Long-CLIP code tokenizes with CLIP's BPE, which does not match "
        "these weights. Use --format=hf, which writes the tokenizer"]
  return parts_left_out(model)


@clean_errors
def main(argv):
  if len(argv) != 3:
    raise app.UsageError("usage: python -m hnclip_jax.pretrained.export SOURCE OUT [--format hf|openai] [--step N]")
  from hnclip_jax import pretrained
  from hnclip_jax.metrics import quiet_libraries
  quiet_libraries()  # Orbax logs every file operation at INFO
  fmt, out = flags.FLAGS.format, argv[2]
  if fmt == "openai":
    check_openai_out(out)  # before loading anything
  model = pretrained.load(argv[1], step=flags.FLAGS.step).merged()  # LoRA / DoRA adapters folded in first
  out = paths.resolve(out, "OUT")
  if fmt == "hf":
    with paths.staged_dir(out) as local:  # a bucket: written locally, uploaded when complete
      warnings = export_hf(model, local)
  else:
    with paths.staged_dir(paths.dirname(out)) as local:  # a bucket: written locally, uploaded when complete
      warnings = export_openai(model, os.path.join(local, paths.basename(out)))
  for w in warnings:
    print(f"warning: {w}")
  what = f"Hugging Face {HF_CLASSES[model.config.family]}" if fmt == "hf" else ("Long-CLIP state dict" if model.config.text_context ==
                                                       LONGCLIP_CONTEXT else "OpenAI-CLIP state dict")
  print(f"wrote {out} ({what}) from {model.source}")


if __name__ == "__main__":
  app.run(main)
