"""Look at a dataset before training on it:

  python -m hnclip_jax.data.inspect DATASET --split test [--manual_dir DIR] [--data_dir DIR] [--vocab PATH]

Prints the example count, caption length statistics (words, tokens), the share of captions longer than 77 and
248 tokens (CLIP, Long-CLIP; 64 and 196 for SigLIP and SigLIP stretched) that would be truncated, and a few
examples. Tokens are CLIP BPE tokens when --vocab names a CLIP vocabulary (a directory with vocab.json + merges.txt /
tokenizer.json, or bpe_simple_vocab_16e6.txt.gz), SigLIP tokens when it names a SigLIP directory (spiece.model, or
tokenizer.json with a SigLIP config.json), else word-level tokens of a vocabulary fitted on the split.
"""

import json
import os

import numpy as np
from absl import app, flags

from hnclip_jax.cli import clean_errors
from hnclip_jax.data.siglip_tokenizer import SPIECE, SigLIPTokenizer

flags.DEFINE_string("split", "test", "Split to inspect.")
flags.DEFINE_string("manual_dir", "", "Directory with the downloaded files (not needed for 'synthetic').")
flags.DEFINE_string("data_dir", "", "TFDS data directory (default ~/tensorflow_datasets).")
flags.DEFINE_string("vocab", "", "CLIP vocabulary for token counts (optional).")
flags.DEFINE_integer("show", 3, "Number of examples to print.")
flags.DEFINE_bool("skip_bad", False, "Build with on_bad_example=skip.")


def _siglip_tokenizer(directory: str):
  """The SigLIP tokenizer of a SigLIP directory (spiece.model, or tokenizer.json next to a SigLIP config.json)."""
  config = os.path.join(directory, "config.json")
  is_siglip = os.path.exists(os.path.join(directory, SPIECE))
  if not is_siglip and os.path.exists(config):
    with open(config) as fh:
      is_siglip = json.load(fh).get("model_type") == "siglip"
  return SigLIPTokenizer.from_directory(directory, 64) if is_siglip else None


@clean_errors
def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python -m hnclip_jax.data.inspect DATASET --split SPLIT")
  from hnclip_jax.config import base_config
  from hnclip_jax.data import builders, pipeline
  from hnclip_jax.data.tokenizer import WordTokenizer
  from hnclip_jax.data.clip_tokenizer import CLIPTokenizer
  f = flags.FLAGS
  data = base_config().data
  data.name, data.manual_dir, data.data_dir = argv[1], f.manual_dir, f.data_dir
  data.on_bad_example = "skip" if f.skip_bad else "error"
  source = builders.data_source(data, f.split, decode_images=False)
  lists = pipeline.caption_lists(source)
  captions = [c for caps in lists for c in caps]
  contexts, specials = (77, 248), 2  # CLIP's start and end tokens
  siglip = _siglip_tokenizer(f.vocab) if f.vocab and not f.vocab.endswith(".gz") else None
  if siglip is not None:
    tok, kind, contexts = siglip, "SigLIP", (64, 196)
    specials = 1 if tok._sp is not None else len(tok._tok.encode("", add_special_tokens=True).ids)
  elif f.vocab:
    tok = (CLIPTokenizer.from_openai_bpe(f.vocab) if f.vocab.endswith(".gz")
           else CLIPTokenizer.from_directory(f.vocab))
    kind = "CLIP BPE"
  else:
    tok, kind = WordTokenizer.fit(captions, context_length=77), "word-level"
  tokens = np.array([len(ids) + specials for ids in tok.encode_ids(captions)])
  words = np.array([len(c.split()) for c in captions])
  counts = "" if len(captions) == len(lists) else f" with {len(captions)} captions"
  print(f"{argv[1]}/{f.split}: {len(lists)} examples{counts}")
  for name, v in (("words", words), (f"tokens ({kind}, with start/end)", tokens)):
    print(f"  {name}: mean {v.mean():.1f}, median {np.median(v):.0f}, min {v.min()}, max {v.max()}")
  for ctx in contexts:
    print(f"  truncated at {ctx} tokens: {100 * np.mean(tokens > ctx):.1f}%")
  for i in range(min(f.show, len(source))):
    ex = source[i]
    print(f"--- {ex['image_id'].decode() if isinstance(ex['image_id'], bytes) else ex['image_id']} "
          f"({len(ex['image'])} image bytes)\n" + "\n".join(lists[i]))


if __name__ == "__main__":
  app.run(main)
