"""Export a model to the Hugging Face CLIP format (the inverse of `weights.read_hf_directory`):

  python -m hnclip_jax.pretrained.export SOURCE OUT_DIR [--step N]

SOURCE: anything `pretrained.load` reads (a train.py workdir, optionally at --step, a converted directory, a Hugging
Face directory, an OpenAI/Long-CLIP .pt). OUT_DIR gets config.json and model.safetensors that
`transformers.CLIPModel.from_pretrained` loads (max_position_embeddings = the model's text context, 248 for
Long-CLIP), preprocessor_config.json (CLIP's resize / centre crop / normalisation at the model's image size) and,
for a CLIP BPE tokenizer, vocab.json + merges.txt. A word-level tokenizer (models trained from scratch here) is
not a CLIP tokenizer: the export says so and writes the weights only.
"""
from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from hnclip_jax.cli import clean_errors

flags.DEFINE_integer("step", None, "Checkpoint step of a train.py workdir (default: the newest).")

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _blocks(params, tower):
  blocks = params[tower]["blocks"]
  return [blocks[i] if i in blocks else blocks[str(i)] for i in range(len(blocks))]


def hf_state_dict(params, cfg) -> dict:
  """Our params -> transformers CLIPModel state dict (NumPy fp32, PyTorch layouts)."""
  if cfg.token_projection != "shared":
    raise ValueError("this model has separate token projections (config.model.token_projection='separate'); the "
                     "Hugging Face CLIP format has no place for them")
  f = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
  sd = {}

  def linear(name, p):
    sd[name + ".weight"], sd[name + ".bias"] = f(np.asarray(p["kernel"]).T), f(p["bias"])

  def norm(name, p):
    sd[name + ".weight"], sd[name + ".bias"] = f(p["scale"]), f(p["bias"])

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
  sd["vision_model.embeddings.patch_embedding.weight"] = f(np.asarray(params["patch_embed"]["kernel"]).transpose(3, 2, 0, 1))
  sd["vision_model.embeddings.class_embedding"] = f(params["class_embedding"])
  sd["vision_model.embeddings.position_embedding.weight"] = f(params["vision_positions"])
  norm("vision_model.pre_layrnorm", params["ln_pre"])
  norm("vision_model.post_layernorm", params["ln_post"])
  sd["visual_projection.weight"] = f(np.asarray(params["visual_projection"]).T)
  sd["text_model.embeddings.token_embedding.weight"] = f(params["token_embedding"]["embedding"])
  sd["text_model.embeddings.position_embedding.weight"] = f(params["text_positions"])
  norm("text_model.final_layer_norm", params["ln_final"])
  sd["text_projection.weight"] = f(np.asarray(params["text_projection"]).T)
  sd["logit_scale"] = f(params["logit_scale"]).reshape(())
  return sd


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


def export_hf(model, out_dir: str) -> list[str]:
  """Writes the Hugging Face directory; returns warnings (what could not be exported)."""
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
    return [f"{model.source} has no tokenizer files: {out_dir} has the weights, config and preprocessing only"]
  if tok.kind != "clip_bpe":
    return [f"the model's tokenizer is {tok.kind!r} (fitted on the training captions), not CLIP's BPE: no "
            "Hugging Face tokenizer files were written"]
  tok._tok.model.save(out_dir)  # vocab.json + merges.txt, the files transformers' CLIPTokenizer reads
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": model.config.text_context,
               "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
               "pad_token": "<|endoftext|>"}, f, indent=2)
  return []


@clean_errors
def main(argv):
  if len(argv) != 3:
    raise app.UsageError("usage: python -m hnclip_jax.pretrained.export SOURCE OUT_DIR [--step N]")
  from hnclip_jax import pretrained
  from hnclip_jax.metrics import quiet_libraries
  quiet_libraries()  # Orbax logs every file operation at INFO
  model = pretrained.load(argv[1], step=flags.FLAGS.step)
  for w in export_hf(model, argv[2]):
    print(f"warning: {w}")
  print(f"wrote {argv[2]} (Hugging Face CLIPModel) from {model.source}")


if __name__ == "__main__":
  app.run(main)
