"""SigLIP's tokenizers, as Hugging Face's SigLIP processors run them: `tok(texts) -> int32 [N, context_length]`.

Two sources, whichever sits next to the weights:
- `spiece.model` (SigLIP): SentencePiece, after SigLIP's text canonicalisation (lower-cased, ASCII punctuation
  removed, runs of whitespace collapsed, stripped); the ids are truncated to context_length - 1, "</s>" appended,
  and the row padded with the pad id to the full length (SigLIP pads to the full length: its text tower pools the
  last position).
- `tokenizer.json` (SigLIP 2's Gemma tokenizer, or any fast tokenizer): the file's own normalisation and
  post-processing (its special tokens), truncated to context_length and padded with its pad token to the full
  length, as `transformers` does with padding="max_length".
"""
from __future__ import annotations

import json
import os
import re
import shutil
import string
from typing import Sequence

import numpy as np

from hnclip_jax.data.tokenizer import META_FILE

SPIECE, TOKENIZER_JSON = "spiece.model", "tokenizer.json"
_PUNCT = str.maketrans("", "", string.punctuation)


def canonicalize(text: str) -> str:
  """SigLIP's text canonicalisation (big_vision; transformers' SiglipTokenizer with do_lower_case=True)."""
  return re.sub(r"\s+", " ", text.lower().translate(_PUNCT)).strip()


class SigLIPTokenizer:
  kind = "siglip"

  def __init__(self, path: str, context_length: int):
    self.path, self.context_length = os.path.abspath(path), int(context_length)
    if self.context_length < 2:
      raise ValueError(f"context_length={context_length} must be at least 2 (one token and the end token)")
    self.last_truncated = 0
    name = os.path.basename(path)
    if name == SPIECE:
      try:
        import sentencepiece
      except ImportError as e:  # in requirements.txt; named here for a partial install
        raise ImportError(f"{path} is a SentencePiece model; reading it needs `pip install sentencepiece`") from e
      self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
      self.vocab_size = self._sp.get_piece_size()
      self.eot_id = self._sp.piece_to_id("</s>")
      self.pad_id = self.eot_id  # SigLIP: pad_token = eos_token = "</s>"
      if self._sp.id_to_piece(self.eot_id) != "</s>":
        raise ValueError(f"{path} has no '</s>' piece; SigLIP's SentencePiece vocabulary ends each caption with it")
      self._tok = None
    elif name == TOKENIZER_JSON:
      import tokenizers
      self._tok = tokenizers.Tokenizer.from_file(path)
      self._sp = None
      self.vocab_size = self._tok.get_vocab_size()
      with open(path, encoding="utf-8") as f:
        spec = json.load(f)
      specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
      pad = (spec.get("padding") or {}).get("pad_id")
      self.pad_id = pad if pad is not None else specials.get("<pad>", specials.get("</s>"))
      self.eot_id = specials.get("<eos>", specials.get("</s>"))
      if self.pad_id is None or self.eot_id is None:
        raise ValueError(f"{path}: no pad or end token found (looked for '<pad>', '<eos>', '</s>' among its added "
                         "tokens); SigLIP pads every caption to the full length")
      self._tok.no_padding()  # padded here, to the full length
      self._tok.enable_truncation(max_length=self.context_length)  # before the special tokens are added, as HF does
    else:
      raise ValueError(f"{path}: a SigLIP tokenizer is {SPIECE} or {TOKENIZER_JSON}")

  @property
  def num_special(self) -> int:
    """The special tokens each caption gets: "</s>" (spiece.model), or what the tokenizer.json's template adds."""
    return 1 if self._sp is not None else len(self._tok.encode("", add_special_tokens=True).ids)

  def with_context(self, context_length: int) -> "SigLIPTokenizer":
    return SigLIPTokenizer(self.path, context_length)

  def encode_ids(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids without special tokens (spiece.model: after canonicalisation), untruncated."""
    if self._sp is not None:
      return [self._sp.encode(canonicalize(t)) for t in texts]
    self._tok.no_truncation()
    try:
      return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
    finally:
      self._tok.enable_truncation(max_length=self.context_length)

  def __call__(self, texts: Sequence[str]) -> np.ndarray:
    if isinstance(texts, str):
      raise TypeError("tokenizer expects a list of strings, got a single str")
    n, out, truncated = self.context_length, np.full((len(texts), self.context_length), self.pad_id, np.int32), 0
    if self._sp is not None:  # text, then "</s>": the end token survives truncation
      rows = []
      for ids in self.encode_ids(texts):
        truncated += len(ids) > n - 1
        rows.append(ids[:n - 1] + [self.eot_id])
    else:  # the file's own special tokens, kept through truncation
      rows = []
      for e in self._tok.encode_batch(list(texts), add_special_tokens=True):
        truncated += bool(e.overflowing)
        rows.append(e.ids)
    for i, ids in enumerate(rows):
      out[i, :len(ids)] = ids
    self.last_truncated = truncated
    return out

  def span_positions(self, text: str, start: int, end: int) -> np.ndarray:
    raise NotImplementedError("SigLIP tokenizers canonicalise the text before tokenizing, so character spans do not "
                              "map onto tokens: frameworks that locate sentences among the tokens need CLIP's BPE")

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    shutil.copyfile(self.path, os.path.join(directory, os.path.basename(self.path)))
    with open(os.path.join(directory, META_FILE), "w") as f:
      json.dump({"type": self.kind, "context_length": self.context_length,
                 "file": os.path.basename(self.path)}, f)

  @classmethod
  def load(cls, directory: str, meta: dict) -> "SigLIPTokenizer":
    return cls(os.path.join(directory, meta["file"]), meta["context_length"])

  @classmethod
  def from_directory(cls, directory: str, context_length: int) -> "SigLIPTokenizer | None":
    """The tokenizer next to SigLIP weights (spiece.model first, then tokenizer.json), or None."""
    for name in (SPIECE, TOKENIZER_JSON):
      if os.path.exists(os.path.join(directory, name)):
        return cls(os.path.join(directory, name), context_length)
    return None
