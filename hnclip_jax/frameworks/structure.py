"""StructXLIP's inputs (config.framework="structxlip"): edge maps, captions without appearance words, word-window
chunks of those captions.

- `edge_map`: OpenCV's Canny edges of an image as a sketch (black lines on white), 3 channels, so the image tower
  reads it like any picture. The StructXLIP paper says its structure maps are Canny edges but does not publish how
  they were made; here they are computed on the fly from the *preprocessed* image (the model's input size), so the
  lines have the same width whatever the original resolution. Thresholds: config.structxlip.canny_low / _high.
- `filter_caption`: the caption with colour / material / texture words removed (word lists below, chosen here;
  multi-word terms first, whole words only, case-insensitive); a caption left with fewer than two content words
  is kept whole, as the authors do.
- `chunk_spans`: sliding windows of consecutive words inside each sentence/clause of a caption, the window longer
  for longer clauses (2 words for clauses of <= 4, `base_window` for <= 10, +1 up to 20, +2 up to 40, +3 beyond),
  as token positions of the packed caption row (via the tokenizer's character offsets).
"""
from __future__ import annotations

import re

import cv2
import numpy as np

# Appearance words removed from the structure caption (config.structxlip.remove names the groups).
VISUAL_WORDS = {
    "colors": (
        "red", "green", "blue", "yellow", "orange", "purple", "violet", "pink", "brown", "black", "white", "gray",
        "grey", "beige", "tan", "cyan", "magenta", "teal", "turquoise", "maroon", "navy", "indigo", "gold",
        "golden", "silver", "ivory", "cream", "olive", "peach", "lavender", "crimson", "scarlet", "burgundy",
        "khaki", "charcoal", "colorful", "colourful", "multicolored", "multicoloured", "light blue", "dark blue",
        "light green", "dark green", "light gray", "dark gray", "light grey", "dark grey", "light brown",
        "dark brown", "bright red", "dark red", "reddish", "bluish", "greenish", "yellowish", "brownish",
        "grayish", "greyish", "pinkish", "purplish", "whitish", "blackish"),
    "materials": (
        "wood", "wooden", "metal", "metallic", "steel", "iron", "aluminum", "aluminium", "copper", "brass",
        "bronze", "glass", "plastic", "rubber", "leather", "cotton", "wool", "woolen", "silk", "linen", "denim",
        "velvet", "satin", "fabric", "cloth", "paper", "cardboard", "stone", "marble", "granite", "brick",
        "concrete", "ceramic", "porcelain", "clay", "bamboo", "wicker", "fur", "canvas", "nylon", "polyester"),
    "textures": (
        "smooth", "rough", "shiny", "glossy", "matte", "dull", "fuzzy", "fluffy", "furry", "silky", "grainy",
        "coarse", "bumpy", "wrinkled", "crumpled", "striped", "checkered", "plaid", "dotted", "polka dot",
        "spotted", "speckled", "floral", "patterned", "textured", "woven", "knitted", "transparent",
        "translucent", "opaque", "reflective", "glittery", "sparkly", "weathered", "rusty", "faded"),
}
_STOPWORDS = frozenset("a an and are as at be by for from in is it of on or that the to with this there".split())
_WORD = re.compile(r"\b\w+\b")
_CLAUSE_END = re.compile(r"[.,;!?]+")


def _pattern(groups) -> re.Pattern | None:
  unknown = [g for g in groups if g not in VISUAL_WORDS]
  if unknown:
    raise ValueError(f"config.structxlip.remove={tuple(groups)!r}: unknown word group(s) {unknown}; choose from "
                     f"{sorted(VISUAL_WORDS)}")
  terms = sorted({t for g in groups for t in VISUAL_WORDS[g]}, key=lambda t: (-len(t), t))
  if not terms:
    return None
  return re.compile(r"\b(?:" + "|".join(re.escape(t).replace(r"\ ", r"\s+") for t in terms) + r")\b", re.IGNORECASE)


def _tidy(text: str) -> str:
  text = re.sub(r"\s+", " ", text)
  text = re.sub(r"\s+([,.;:!?])", r"\1", text)
  text = re.sub(r"([,;:])(?:\s*[,;:])+", r"\1", text)
  return text.strip()


def filter_caption(text: str, groups=("colors",), min_content_words: int = 2) -> str:
  """`text` without the words of `groups` (VISUAL_WORDS); unchanged when fewer than `min_content_words`
  non-stop-words would be left."""
  pattern = _pattern(tuple(groups))
  if pattern is None:
    return text
  cleaned = _tidy(pattern.sub(" ", text))
  content = [w for w in _WORD.findall(cleaned.lower()) if w not in _STOPWORDS]
  return cleaned if len(content) >= min_content_words else text


def edge_map(image: np.ndarray, low: float, high: float) -> np.ndarray:
  """uint8 [H, W, 3] RGB -> uint8 [H, W, 3]: Canny edges of its luminance as black lines on white."""
  gray = cv2.cvtColor(np.ascontiguousarray(image, np.uint8), cv2.COLOR_RGB2GRAY)
  edges = cv2.Canny(gray, float(low), float(high))
  return np.repeat((255 - edges)[..., None], 3, axis=2)


def window_size(num_words: int, base_window: int) -> int:
  """The chunk length (words) for a clause of `num_words` words."""
  if num_words <= 4:
    return 2
  if num_words <= 10:
    return base_window
  if num_words <= 20:
    return base_window + 1
  if num_words <= 40:
    return base_window + 2
  return base_window + 3


def chunk_char_spans(text: str, base_window: int = 3, stride: int = 1, max_chunks: int = 64) -> list[tuple[int, int]]:
  """Character spans [start, end) of the word windows of `text`: per clause (text up to and including a run of
  . , ; ! ?), windows of `window_size` consecutive words every `stride` words (a clause shorter than its window
  gives none), at most `max_chunks` in all."""
  words = list(_WORD.finditer(text))
  bounds, begin = [], 0
  for m in _CLAUSE_END.finditer(text):
    bounds.append((begin, m.end()))
    begin = m.end()
  if begin < len(text):
    bounds.append((begin, len(text)))
  spans = []
  for start, end in bounds:
    clause = [w for w in words if start <= w.start() < end]
    if not clause:
      continue
    win = window_size(len(clause), base_window)
    for i in range(0, len(clause) - win + 1, stride):
      spans.append((clause[i].start(), clause[i + win - 1].end()))
      if len(spans) == max_chunks:
        return spans
  return spans


def chunk_masks(text: str, tokenizer, max_chunks: int, base_window: int = 3, stride: int = 1) -> np.ndarray:
  """float32 [max_chunks, context_length]: row c is 1 on the token positions (in `text`'s packed row) of chunk c;
  rows without a chunk, or whose tokens were all truncated away, are 0."""
  out = np.zeros((max_chunks, tokenizer.context_length), np.float32)
  for c, (a, b) in enumerate(chunk_char_spans(text, base_window, stride, max_chunks)):
    out[c, tokenizer.span_positions(text, a, b)] = 1.0
  return out
