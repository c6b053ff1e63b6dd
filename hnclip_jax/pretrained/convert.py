"""Convert CLIP weights once, so TPU/GPU jobs start without PyTorch:

  python -m hnclip_jax.pretrained.convert SRC OUT_DIR [--text_context=248]

SRC: a Hugging Face CLIP directory, an OpenAI/Long-CLIP .pt file, or a train.py workdir.
OUT_DIR gets params/ (Orbax), model.json and tokenizer/. Use it with --config.init_from=OUT_DIR.
"""
from absl import app, flags

from hnclip_jax.cli import clean_errors

flags.DEFINE_integer("text_context", None, "Stretch text positions to this length (Long-CLIP: 77 -> 248).")


@clean_errors
def main(argv):
  if len(argv) != 3:
    raise app.UsageError("usage: python -m hnclip_jax.pretrained.convert SRC OUT_DIR [--text_context=248]")
  from hnclip_jax import pretrained
  model = pretrained.load(argv[1])
  if flags.FLAGS.text_context:
    model = model.with_text_context(flags.FLAGS.text_context)
  model.save(argv[2])
  n = sum(x.size for x in __import__("jax").tree.leaves(model.params))
  print(f"wrote {argv[2]}: {n / 1e6:.2f}M parameters, {model.config}"
        + ("" if model.tokenizer is not None else " (no tokenizer files found next to the source)"))


if __name__ == "__main__":
  app.run(main)
