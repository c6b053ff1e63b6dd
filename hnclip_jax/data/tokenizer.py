"""Tokenizers behind one small interface: `tok(texts) -> int32 [N, context_length]`, `save(dir)`; a saved one of
either kind is read back by `saved_tokenizer.load_tokenizer(dir)`.

`WordTokenizer` is a word-level vocabulary fitted on training captions with the
`tokenizers` library; it is used when training from scratch. CLIP's BPE is `clip_tokenizer.CLIPTokenizer`.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import numpy as np
import tokenizers
from tokenizers import models, normalizers, pre_tokenizers, trainers

PAD, UNK, SOT, EOT = "<pad>", "<unk>", "<|startoftext|>", "<|endoftext|>"
META_FILE = "tokenizer_meta.json"


def pack(ids: Sequence[Sequence[int]], sot_id: int, eot_id: int, context_length: int) -> tuple[np.ndarray, int]:
  """[sot] + ids + [eot], truncated so that eot stays last, zero-padded. Returns (int32 [N, L], number truncated)."""
  out = np.zeros((len(ids), context_length), np.int32)
  truncated = 0
  for i, seq in enumerate(ids):
    seq = list(seq)
    if len(seq) > context_length - 2:
      truncated += 1
      seq = seq[:context_length - 2]
    row = [sot_id] + seq + [eot_id]
    out[i, :len(row)] = row
  return out, truncated


class PackedTokenizer:
  """A `tokenizers.Tokenizer` plus CLIP-style packing: tok(texts) -> int32 [N, context_length].

  Subclasses set `kind` (saved with the files, to load the right class back). Padding is id 0.
  """

  kind = ""
  num_special = 2  # the start and end tokens each packed caption gets

  def __init__(self, tok: tokenizers.Tokenizer, context_length: int):
    if context_length < 3:
      raise ValueError(f"context_length={context_length} must be at least 3 (start, one token, end)")
    self._tok = tok
    self.context_length = int(context_length)
    self.vocab_size = tok.get_vocab_size()
    self.sot_id, self.eot_id = tok.token_to_id(SOT), tok.token_to_id(EOT)
    self.last_truncated = 0

  def with_context(self, context_length: int):
    return type(self)(self._tok, context_length)

  def encode_ids(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids without start/end tokens, padding or truncation."""
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def span_positions(self, text: str, start: int, end: int) -> np.ndarray:
    """Positions in `text`'s packed row (start token at 0) of the tokens that overlap characters [start, end) of
    `text`, within the context (truncated tokens are left out): where a sentence of a caption sits among its
    tokens. int64 [k], possibly empty."""
    enc = self._tok.encode(text, add_special_tokens=False)
    keep = self.context_length - 2  # `pack` keeps the first context_length - 2 tokens
    return np.asarray([k + 1 for k, (a, b) in enumerate(enc.offsets[:keep]) if a < end and b > start], np.int64)

  def __call__(self, texts: Sequence[str]) -> np.ndarray:
    """texts: N strings -> int32 [N, context_length]."""
    if isinstance(texts, str):
      raise TypeError("tokenizer expects a list of strings, got a single str")
    out, self.last_truncated = pack(self.encode_ids(texts), self.sot_id, self.eot_id, self.context_length)
    return out

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    self._tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, META_FILE), "w") as f:
      json.dump({"type": self.kind, "context_length": self.context_length}, f)

  @classmethod
  def load(cls, directory: str, meta: dict):
    return cls(tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json")), meta["context_length"])


class WordTokenizer(PackedTokenizer):
  """Lower-cased word-level tokenizer. Ids: 0 pad, 1 unknown, 2 start-of-text, 3 end-of-text, then words."""

  kind = "word"

  @classmethod
  def fit(cls, texts: Iterable[str], context_length: int, min_frequency: int = 1) -> "WordTokenizer":
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, UNK, SOT, EOT], min_frequency=min_frequency)
    tok.train_from_iterator(texts, trainer=trainer)
    return cls(tok, context_length)
