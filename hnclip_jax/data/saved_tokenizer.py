"""A saved tokenizer read back, whichever kind it is (`save(dir)` writes its kind into tokenizer_meta.json)."""
from __future__ import annotations

import json
import os

from hnclip_jax.data.clip_tokenizer import CLIPTokenizer
from hnclip_jax.data.siglip_tokenizer import SigLIPTokenizer
from hnclip_jax.data.tokenizer import META_FILE, WordTokenizer

TOKENIZERS = {cls.kind: cls for cls in (WordTokenizer, CLIPTokenizer, SigLIPTokenizer)}


def load_tokenizer(directory: str):
  """Loads a tokenizer saved with `.save(directory)`."""
  path = os.path.join(directory, META_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no tokenizer in {directory}: {META_FILE} is missing")
  with open(path) as f:
    meta = json.load(f)
  if meta.get("type") not in TOKENIZERS:
    raise ValueError(f"{path}: unknown tokenizer type {meta.get('type')!r}; known: {sorted(TOKENIZERS)}")
  return TOKENIZERS[meta["type"]].load(directory, meta)
