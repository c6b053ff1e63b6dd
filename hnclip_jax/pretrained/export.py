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

import os

import numpy as np
from absl import app, flags

from hnclip_jax import paths
from hnclip_jax.cli import clean_errors
from hnclip_jax.models import family
from hnclip_jax.pretrained.layout import blocks, f32, parts_left_out, writers

flags.DEFINE_integer("step", None, "Checkpoint step of a train.py workdir (default: the newest).")
flags.DEFINE_enum("format", "hf", ["hf", "openai"], "hf: a transformers CLIPModel directory; openai: an "
                  "OpenAI/Long-CLIP state dict .pt file.")

LONGCLIP_CONTEXT = 248  # Long-CLIP's model code has 248 positions in two tables


def export_hf(model, out_dir: str) -> list[str]:
  """Writes the Hugging Face directory (CLIPModel, or SiglipModel for SigLIP towers); returns warnings (what could
  not be exported)."""
  return family.hf(model.config.family).export(model, out_dir)


def openai_state_dict(params, cfg) -> dict:
  """Our params -> an OpenAI-CLIP state dict (NumPy fp32); Long-CLIP's two position tables at 248 tokens."""
  why = []
  if cfg.token_projection != "shared":
    why.append("it has separate token projections (config.model.token_projection='separate')")
  if not family.setting(cfg.family, "openai_format"):
    hf_class = family.setting(cfg.family, "hf_class")
    raise ValueError(f"a {cfg.family} model cannot be written in the OpenAI CLIP format" + (
        f"; export it with --format=hf (a transformers {hf_class} directory)" if hf_class else
        " (its model family declares neither that format nor a Hugging Face mapping)"))
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
  linear, norm = writers(sd)

  for tower, prefix in (("vision", "visual.transformer"), ("text", "transformer")):
    for i, b in enumerate(blocks(params, tower)):
      p = f"{prefix}.resblocks.{i}."
      sd[p + "attn.in_proj_weight"] = f32(np.concatenate([np.asarray(b["attn"][k]["kernel"]).T for k in "qkv"]))
      sd[p + "attn.in_proj_bias"] = f32(np.concatenate([np.asarray(b["attn"][k]["bias"]) for k in "qkv"]))
      linear(p + "attn.out_proj", b["attn"]["out"])
      norm(p + "ln_1", b["ln1"])
      norm(p + "ln_2", b["ln2"])
      linear(p + "mlp.c_fc", b["fc1"])
      linear(p + "mlp.c_proj", b["fc2"])
  sd["visual.conv1.weight"] = f32(np.asarray(params["patch_embed"]["kernel"]).transpose(3, 2, 0, 1))
  sd["visual.class_embedding"] = f32(params["class_embedding"])
  sd["visual.positional_embedding"] = f32(params["vision_positions"])
  norm("visual.ln_pre", params["ln_pre"])
  norm("visual.ln_post", params["ln_post"])
  sd["visual.proj"] = f32(params["visual_projection"])
  sd["token_embedding.weight"] = f32(params["token_embedding"]["embedding"])
  positions = f32(params["text_positions"])
  sd["positional_embedding"] = positions
  if cfg.text_context == LONGCLIP_CONTEXT:  # Long-CLIP: rows < 20 are read from the first table, the rest from
    sd["positional_embedding_res"] = positions.copy()  # the second; both hold the whole table
  norm("ln_final", params["ln_final"])
  sd["text_projection"] = f32(params["text_projection"])
  sd["logit_scale"] = f32(params["logit_scale"]).reshape(())
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
  what = f"Hugging Face {family.setting(model.config.family, 'hf_class')}" if fmt == "hf" else ("Long-CLIP state dict" if model.config.text_context ==
                                                       LONGCLIP_CONTEXT else "OpenAI-CLIP state dict")
  print(f"wrote {out} ({what}) from {model.source}")


if __name__ == "__main__":
  app.run(main)
