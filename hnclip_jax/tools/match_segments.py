"""Pair region boxes with the caption sentences they show, by a CLIP model's own similarity (the matching step of
region-based fine-tuning).

  python -m hnclip_jax.tools.match_segments --model PATH --manual_dir DIR --boxes BOXES.json --out SEGMENTS.json

Region-based frameworks train on segments: a box of the image and the sentence of its long caption that describes it.
Boxes come from any segmenter run offline (SAM in the papers: each mask's bounding box; SAM is not run here).
BOXES.json is the `pairs` layout (a JSON list, docs in hnclip_jax/data/manual.py HnclipPairs) whose entries carry
"boxes": [[x0, y0, x1, y1], ...] in original-image pixels (x right, y down; x1 > x0, y1 > y0). This tool splits each
entry's caption(s) into sentences, encodes every box's crop (CLIP preprocessing: short side to the model's size,
centre crop) and every sentence with the model (PATH: anything `hnclip_jax.pretrained.load` reads), gives each box
its most similar sentence, and writes the same list with "segments": [{"box": [...], "sentence": "...", "score":
cosine}, ...] in place of "boxes" (boxes under --min_score dropped; the score is kept, so a later filter can use it).

A box that is malformed or lies outside its image stops the tool naming the entry and the box, or with
--on_bad_box=skip is left out and counted.
"""
from __future__ import annotations

import json
import os
import re

from absl import app, flags
from PIL import Image

from hnclip_jax.cli import clean_errors
from hnclip_jax.data.manual import BadExample as BadBox, check_box, crop_box as crop

def define_flags() -> None:
  """The command's flags (defined only when run as a program, so importing the module defines none)."""
  flags.DEFINE_string("model", None, "Model whose similarity matches boxes to sentences (hnclip_jax.pretrained.load).")
  flags.DEFINE_string("manual_dir", None, "Folder the entries' filenames are relative to.")
  flags.DEFINE_string("boxes", None, "pairs-layout JSON list whose entries have 'boxes'.")
  flags.DEFINE_string("out", None, "Where to write the list with 'segments'.")
  flags.DEFINE_float("min_score", -1.0, "Drop boxes whose best sentence scores below this cosine.")
  flags.DEFINE_enum("on_bad_box", "error", ["error", "skip"], "A malformed or out-of-image box: stop, or skip it.")
  flags.mark_flags_as_required(["model", "manual_dir", "boxes", "out"])


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
  """A caption's sentences (split after . ! or ? followed by white space), stripped, empty ones dropped."""
  return [s.strip() for s in _SENTENCE_END.split(text.strip()) if s.strip()]


def captions_of(entry: dict) -> list[str]:
  caps = entry.get("captions", [entry["caption"]] if "caption" in entry else [])
  return [caps] if isinstance(caps, str) else list(caps)


def match_entry(model, image: Image.Image, boxes, captions, where: str, min_score: float = -1.0,
                on_bad_box: str = "error"):
  """(segments [{"box", "sentence", "score"}], number of bad boxes skipped) for one image."""
  sentences = list(dict.fromkeys(s for c in captions for s in split_sentences(c)))
  if not sentences:
    raise BadBox(f"{where}: no caption sentences to match boxes to")
  good, skipped = [], 0
  for i, b in enumerate(boxes):
    try:
      good.append((b, check_box(b, image.width, image.height, f"{where} box {i}")))
    except BadBox:
      if on_bad_box != "skip":
        raise
      skipped += 1
  if not good:
    return [], skipped
  img = model.encode_images([crop(image, c) for _, c in good])  # [n_boxes, E], normalised
  txt = model.encode_texts(sentences)  # [n_sentences, E]
  sims = img @ txt.T
  best = sims.argmax(axis=1)
  segments = [{"box": [float(v) for v in box], "sentence": sentences[j], "score": float(sims[i, j])}
              for i, ((box, _), j) in enumerate(zip(good, best)) if sims[i, j] >= min_score]
  return segments, skipped


@clean_errors
def main(argv):
  del argv
  from hnclip_jax import pretrained
  f = flags.FLAGS
  with open(f.boxes, encoding="utf-8") as fh:
    entries = json.load(fh)
  if not isinstance(entries, list):
    raise ValueError(f"{f.boxes}: expected a JSON list of pairs-layout entries with 'boxes'")
  model = pretrained.load(f.model)
  out, n_boxes, n_segments, n_skipped = [], 0, 0, 0
  for i, entry in enumerate(entries):
    where = f"{f.boxes}[{i}]"
    entry = dict(entry)
    boxes = entry.pop("boxes", None)
    if boxes is not None:
      if not isinstance(boxes, list):
        raise ValueError(f"{where}: 'boxes' must be a list of [x0, y0, x1, y1]")
      path = os.path.join(f.manual_dir, entry["filename"])
      with Image.open(path) as im:
        image = im.convert("RGB")
      entry["segments"], skipped = match_entry(model, image, boxes, captions_of(entry), where, f.min_score,
                                               f.on_bad_box)
      n_boxes, n_segments, n_skipped = n_boxes + len(boxes), n_segments + len(entry["segments"]), n_skipped + skipped
    out.append(entry)
  with open(f.out + ".tmp", "w", encoding="utf-8") as fh:
    json.dump(out, fh, indent=1)
  os.replace(f.out + ".tmp", f.out)
  print(f"{n_boxes} boxes in {len(entries)} entries -> {n_segments} segments ({n_skipped} bad boxes skipped, "
        f"{n_boxes - n_segments - n_skipped} under --min_score={f.min_score}); wrote {f.out}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
