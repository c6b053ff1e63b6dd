"""Look at a dataset before training on it:

  python -m hnclip_jax.data.inspect DATASET --split test [--manual_dir DIR] [--data_dir DIR] [--vocab PATH]

Prints the example count, caption length statistics (words, tokens), the share of captions longer than 77 and
248 tokens (CLIP, Long-CLIP; 64 and 196 for SigLIP and SigLIP stretched) that would be truncated, and a few
examples. --vocab: CLIP's bpe_simple_vocab_16e6.txt.gz, or a directory whose model family its config.json or its
tokenizer files name (models/family.of_directory: CLIP's vocab.json + merges.txt or tokenizer.json, SigLIP's
spiece.model): that family's tokenizer and text contexts; without it, word-level tokens of a vocabulary fitted on
the split.
"""

import os

import numpy as np
from absl import app, flags

from hnclip_jax.cli import clean_errors

flags.DEFINE_string("split", "test", "Split to inspect.")
flags.DEFINE_string("manual_dir", "", "Directory with the downloaded files (not needed for 'synthetic').")
flags.DEFINE_string("data_dir", "", "TFDS data directory (default ~/tensorflow_datasets).")
flags.DEFINE_string("vocab", "", "CLIP vocabulary for token counts (optional).")
flags.DEFINE_integer("show", 3, "Number of examples to print.")
flags.DEFINE_bool("skip_bad", False, "Build with on_bad_example=skip.")


def _tokenizer(vocab: str):
  """--vocab -> (tokenizer, what it is, the text contexts to report): a model family's tokenizer directory (its
  mapping recognises it: models/family.of_directory), CLIP's BPE file, or None (a word-level one is fitted)."""
  from hnclip_jax.data.clip_tokenizer import CLIPTokenizer
  from hnclip_jax.models import family
  if vocab.endswith(".gz"):
    return CLIPTokenizer.from_openai_bpe(vocab), "CLIP BPE", (77, 248)
  name = family.of_directory(vocab) if os.path.isdir(vocab) else None
  if name is None:
    raise ValueError(f"--vocab={vocab}: neither CLIP's bpe_simple_vocab_16e6.txt.gz nor a tokenizer directory a "
                     f"model family recognises ({', '.join(family.REGISTRY)}: a config.json naming its model_type, "
                     "or its tokenizer files)")
  mapping = family.hf(name)
  contexts = mapping.TEXT_CONTEXTS
  tok = mapping.tokenizer(vocab, max(contexts))
  if tok is None:
    raise ValueError(f"--vocab={vocab}: a {name} directory without its tokenizer files")
  return tok, mapping.TOKENIZER_NAME, contexts


@clean_errors
def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python -m hnclip_jax.data.inspect DATASET --split SPLIT")
  from hnclip_jax.config import base_config
  from hnclip_jax.data import builders, pipeline
  from hnclip_jax.data.tokenizer import WordTokenizer
  f = flags.FLAGS
  data = base_config().data
  data.name, data.manual_dir, data.data_dir = argv[1], f.manual_dir, f.data_dir
  data.on_bad_example = "skip" if f.skip_bad else "error"
  source = builders.data_source(data, f.split, decode_images=False)
  lists = pipeline.caption_lists(source)
  captions = [c for caps in lists for c in caps]
  if f.vocab:
    tok, kind, contexts = _tokenizer(f.vocab)
  else:
    tok, kind, contexts = WordTokenizer.fit(captions, context_length=77), "word-level", (77, 248)
  tokens = np.array([len(ids) + tok.num_special for ids in tok.encode_ids(captions)])
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
