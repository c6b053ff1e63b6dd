"""Fold a LoRA / DoRA workdir's adapters into plain CLIP weights:

  python -m hnclip_jax.pretrained.merge_adapters WORKDIR OUT_DIR [--step N]

OUT_DIR is a converted directory (params/, model.json, tokenizer/) of the plain architecture: `pretrained.load`,
`--config.init_from` and `pretrained.export` read it like any other. Each adapted kernel becomes W + (alpha / r) A B
(LoRA) or m * V / ||V||_c (DoRA); the merged model's embeddings equal the adapted model's (tested to 1e-5).
`pretrained.load(WORKDIR)` gives the adapted model without merging.
"""
from absl import app, flags

from hnclip_jax.cli import clean_errors

flags.DEFINE_integer("step", None, "Checkpoint step of the workdir (default: the newest).")


@clean_errors
def main(argv):
  if len(argv) != 3:
    raise app.UsageError("usage: python -m hnclip_jax.pretrained.merge_adapters WORKDIR OUT_DIR [--step N]")
  from hnclip_jax import pretrained
  from hnclip_jax.metrics import quiet_libraries
  from hnclip_jax.models import adapters
  quiet_libraries()
  model = pretrained.load(argv[1], step=flags.FLAGS.step)
  if model.config.adapter == "none":
    raise ValueError(f"{model.source} has no adapters (it was trained with config.finetune.method=full); its "
                     "weights are plain already: use it directly, or `python -m hnclip_jax.pretrained.convert`")
  n_adapter, n_all = adapters.sizes(model.params)
  merged = model.merged()
  merged.save(argv[2])
  print(f"wrote {argv[2]}: {model.config.adapter} adapters ({n_adapter / 1e6:.3f}M of {n_all / 1e6:.2f}M "
        f"parameters) folded into the weights of {model.source}")


if __name__ == "__main__":
  app.run(main)
