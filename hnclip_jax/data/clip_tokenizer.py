"""CLIP's byte-level BPE tokenizer on the `tokenizers` library.

Text is NFC-normalised, runs of whitespace become one space, and it is
lower-cased; CLIP's regex splits it into words, numbers (one digit each) and
punctuation runs; each piece is byte-encoded and merged by BPE with `</w>` on
word ends. Rows are [<|startoftext|>] + ids + [<|endoftext|>], truncated so the
end token stays last, zero-padded (as OpenAI CLIP pads). Like Hugging Face's
CLIPTokenizer, OpenAI's optional ftfy/HTML-unescape clean-up is not applied.

Vocabulary sources: Hugging Face `vocab.json` + `merges.txt`, a `tokenizer.json`,
or OpenAI's `bpe_simple_vocab_16e6.txt.gz` (merges only; the vocabulary is
derived from them exactly as OpenAI does).
"""
from __future__ import annotations

import gzip
import json
import os
import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from hnclip_jax.data.tokenizer import PackedTokenizer

SOT, EOT = "<|startoftext|>", "<|endoftext|>"
CLIP_PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
OPENAI_NUM_MERGES = 49152 - 256 - 2


def byte_alphabet() -> list[str]:
  """The 256 printable stand-ins for bytes used by byte-level BPE, in CLIP's vocabulary order.

  Printable bytes stand for themselves and come first (in byte order); the
  other 68 bytes map to chr(256 + k) and follow. This order fixes the ids of
  the first 512 vocabulary entries.
  """
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  rest = [b for b in range(256) if b not in set(printable)]
  return [chr(b) for b in printable] + [chr(256 + k) for k in range(len(rest))]


def _build(vocab: dict, merges: list[tuple[str, str]]) -> tokenizers.Tokenizer:
  for special in (SOT, EOT):
    if special not in vocab:
      raise ValueError(f"the CLIP vocabulary has no {special!r} token")
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, end_of_word_suffix="</w>",
                                        continuing_subword_prefix="", unk_token=EOT, fuse_unk=False))
  tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                         normalizers.Lowercase()])
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(CLIP_PATTERN), behavior="removed", invert=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False)])
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([SOT, EOT])  # written in the text, they are the special tokens (as in OpenAI's code)
  return tok


def _read_openai_merges(path: str) -> list[tuple[str, str]]:
  try:
    with gzip.open(path, "rt", encoding="utf-8") as f:
      lines = f.read().split("\n")
  except (OSError, EOFError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: not a readable gzip'd BPE merge list ({e})") from e
  merges = [tuple(line.split()) for line in lines[1:1 + OPENAI_NUM_MERGES] if line.strip()]
  if len(merges) != OPENAI_NUM_MERGES or any(len(m) != 2 for m in merges):
    raise ValueError(f"{path}: expected {OPENAI_NUM_MERGES} merge pairs after the header line, "
                     f"found {len(merges)} valid ones; is this OpenAI's bpe_simple_vocab_16e6.txt.gz?")
  return merges


def _read_hf_merges(path: str) -> list[tuple[str, str]]:
  with open(path, encoding="utf-8") as f:
    lines = [line for line in f.read().split("\n") if line and not line.startswith("#version")]
  merges = [tuple(line.split()) for line in lines]
  bad = [i for i, m in enumerate(merges) if len(m) != 2]
  if bad:
    raise ValueError(f"{path}: line {bad[0] + 1} is not a merge pair 'a b'")
  return merges


class CLIPTokenizer(PackedTokenizer):
  """tok(texts) -> int32 [N, context_length]; see the module docstring."""

  kind = "clip_bpe"

  @classmethod
  def from_openai_bpe(cls, path: str, context_length: int = 77) -> "CLIPTokenizer":
    merges = _read_openai_merges(path)
    alphabet = byte_alphabet()
    words = alphabet + [a + "</w>" for a in alphabet] + ["".join(m) for m in merges] + [SOT, EOT]
    return cls(_build({w: i for i, w in enumerate(words)}, merges), context_length)

  @classmethod
  def from_hf_files(cls, vocab_json: str, merges_txt: str, context_length: int = 77) -> "CLIPTokenizer":
    with open(vocab_json, encoding="utf-8") as f:
      vocab = json.load(f)
    merges = _read_hf_merges(merges_txt)
    missing = [("".join(m)) for m in merges if "".join(m) not in vocab]
    if missing:
      raise ValueError(f"{merges_txt} and {vocab_json} do not belong together: merge result {missing[0]!r} "
                       f"(and {len(missing) - 1} more) is not in the vocabulary")
    return cls(_build(vocab, merges), context_length)

  @classmethod
  def from_directory(cls, directory: str, context_length: int = 77) -> "CLIPTokenizer":
    """Finds vocab.json + merges.txt, tokenizer.json, or bpe_simple_vocab_16e6.txt.gz in `directory`."""
    j = lambda name: os.path.join(directory, name)
    if os.path.exists(j("vocab.json")) and os.path.exists(j("merges.txt")):
      return cls.from_hf_files(j("vocab.json"), j("merges.txt"), context_length)
    if os.path.exists(j("tokenizer.json")):
      with open(j("tokenizer.json"), encoding="utf-8") as f:
        model = json.load(f).get("model", {})
      if model.get("type") != "BPE":
        raise ValueError(f"{j('tokenizer.json')} holds a {model.get('type')} model, not CLIP's BPE")
      merges = [tuple(m.split()) if isinstance(m, str) else tuple(m) for m in model["merges"]]
      return cls(_build(model["vocab"], merges), context_length)
    if os.path.exists(j("bpe_simple_vocab_16e6.txt.gz")):
      return cls.from_openai_bpe(j("bpe_simple_vocab_16e6.txt.gz"), context_length)
    raise FileNotFoundError(f"no CLIP vocabulary in {directory}: expected vocab.json + merges.txt, tokenizer.json, "
                            "or bpe_simple_vocab_16e6.txt.gz")


