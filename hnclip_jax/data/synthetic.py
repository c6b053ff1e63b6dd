"""Deterministic synthetic dense-caption data: drawn scenes with long captions and near-duplicate groups.

Each scene has 3-4 objects (colour, shape, size, grid cell). Scenes come in
groups of `group_size`: one base scene and variants that change one or two
attributes, so their captions differ in one or two words out of 40+. This is
the near-twin-caption situation HN-CLIP targets. Pure NumPy + PIL.

`captions="short"` writes web alt-text instead (`short_caption`): one or two salient objects in one of several
phrasings, a few words, no full inventory. With `group_size=1` this is a pre-training set of independent scenes,
so that a model pre-trained on it and fine-tuned on the dense set is in the paper's regime (CLIP pre-trained on
short web captions, fine-tuned on dense ones; docs/replication.md).

`captions="detailed"` is a second dense-caption domain in another grammar (`detailed_caption`): every object, large
ones first, in one sentence of phrases over the short captions' vocabulary. It plays Long-CLIP's ShareGPT4V captions
in the three-stage regime (configs/three_stage.py): long captions that are not the target benchmark's.
"""
from __future__ import annotations

import dataclasses
import io

import numpy as np
from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 215, 40),
    "purple": (150, 60, 190), "orange": (245, 140, 30), "white": (245, 245, 245), "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
SIZES = ("small", "large")
CELLS = ("top left", "top middle", "top right", "middle left", "center", "middle right",
         "bottom left", "bottom middle", "bottom right")
BACKGROUND = (128, 128, 128)


@dataclasses.dataclass(frozen=True)
class Obj:
  color: str
  shape: str
  size: str
  cell: int


def _random_obj(rng, cell):
  return Obj(str(rng.choice(list(COLORS))), str(rng.choice(SHAPES)), str(rng.choice(SIZES)), int(cell))


def _mutate(rng, scene):
  """Changes one attribute of one object (colour, shape, size, or moves it to a free cell)."""
  objs = list(scene)
  i = int(rng.integers(len(objs)))
  o = objs[i]
  kind = rng.choice(["color", "shape", "size", "cell"])
  if kind == "color":
    o = dataclasses.replace(o, color=str(rng.choice([c for c in COLORS if c != o.color])))
  elif kind == "shape":
    o = dataclasses.replace(o, shape=str(rng.choice([s for s in SHAPES if s != o.shape])))
  elif kind == "size":
    o = dataclasses.replace(o, size="large" if o.size == "small" else "small")
  else:
    free = [c for c in range(len(CELLS)) if c not in {x.cell for x in objs}]
    o = dataclasses.replace(o, cell=int(rng.choice(free)))
  objs[i] = o
  return tuple(sorted(objs, key=lambda x: x.cell))


NUMBER_WORDS = {3: "three", 4: "four"}


def object_sentence(o) -> str:
  """The caption's sentence about one object (a segment's sentence)."""
  return f"In the {CELLS[o.cell]} there is a {o.size} {o.color} {o.shape}."


def caption(scene) -> str:
  """A long caption (40+ words) that describes every object, in reading order."""
  parts = [f"This picture shows {NUMBER_WORDS[len(scene)]} simple shapes drawn on a plain gray background."]
  for o in scene:
    parts.append(object_sentence(o))
  parts.append("Nothing else appears in the scene and all shapes are flat and clearly separated.")
  return " ".join(parts)


def object_phrase(o) -> str:
  """`detailed_caption`'s phrase about one object (a segment's sentence in that style)."""
  return f"a {o.size} {o.color} {o.shape} in the {CELLS[o.cell]}"


def detailed_caption(scene) -> str:
  """A dense caption in a grammar other than `caption`'s: every object as a phrase, large objects first (then in
  reading order), the count and the background after them; only words that `short_caption` also uses."""
  order = sorted(scene, key=lambda o: (o.size != "large", o.cell))
  phrases = [object_phrase(o) for o in order]
  listing = ", ".join(phrases[:-1]) + " and " + phrases[-1]
  return (f"there is {listing}: {NUMBER_WORDS[len(scene)]} flat shapes drawn on a plain gray background, "
          "clearly separated; nothing else appears")


CAPTION_STYLES = ("dense", "short", "detailed")
# Alt-text phrasings; {a} and {b} are objects ("a red circle", sometimes with the size), {n} the object count,
# {cell} where {a} is. Over a corpus they use every word of the dense captions, so a tokenizer fitted on short
# captions covers the dense ones (as CLIP's BPE covers any English caption).
SHORT_TEMPLATES = (
    "{a}", "{a} and {b}", "picture of {a}", "{a} on a plain gray background", "simple shapes: {a} and {b}",
    "{a} in the {cell}", "this shows {a}", "flat shapes drawn on gray: {a}", "there is {a} in this scene",
    "{n} shapes clearly separated, including {a}", "{a}; nothing else appears", "all shapes are flat, {a} and {b}")


def short_caption(scene, rng) -> str:
  """Web alt-text for `scene`: a few words naming one or two salient objects (large ones first)."""
  order = sorted(scene, key=lambda o: (o.size != "large", float(rng.random())))

  def obj(o):
    return f"a {o.size} {o.color} {o.shape}" if rng.random() < 0.3 else f"a {o.color} {o.shape}"

  template = SHORT_TEMPLATES[int(rng.integers(len(SHORT_TEMPLATES)))]
  return template.format(a=obj(order[0]), b=obj(order[1]), n=NUMBER_WORDS[len(scene)], cell=CELLS[order[0].cell])


def render(scene, image_size, rng) -> np.ndarray:
  """Draws the scene: uint8 [image_size, image_size, 3]. `rng` jitters positions and adds mild noise."""
  return render_with_boxes(scene, image_size, rng)[0]


def render_with_boxes(scene, image_size, rng):
  """(`render`'s image, each object's bounding box [x0, y0, x1, y1] in image pixels, in scene order: the exact
  extent of the drawn shape, x right and y down, as segment boxes are given)."""
  scale = 4  # draw large, then downsample: anti-aliased edges
  side = image_size * scale
  img = Image.new("RGB", (side, side), BACKGROUND)
  draw = ImageDraw.Draw(img)
  cell = side / 3
  boxes = []
  for o in scene:
    r = cell * (0.42 if o.size == "large" else 0.22)
    cx = (o.cell % 3 + 0.5) * cell + rng.uniform(-0.08, 0.08) * cell
    cy = (o.cell // 3 + 0.5) * cell + rng.uniform(-0.08, 0.08) * cell
    col = COLORS[o.color]
    if o.shape == "circle":
      box = [cx - r, cy - r, cx + r, cy + r]
      draw.ellipse(box, fill=col)
    elif o.shape == "square":
      s = r * 0.85
      box = [cx - s, cy - s, cx + s, cy + s]
      draw.rectangle(box, fill=col)
    elif o.shape == "triangle":
      box = [cx - r, cy - r, cx + r, cy + r * 0.8]
      draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=col)
    else:
      box = [cx - r, cy - r, cx + r, cy + r]
      draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=col)
    boxes.append([float(v) / scale for v in box])  # drawn at `scale`x, then resized: pixel edges scale exactly
  arr = np.asarray(img.resize((image_size, image_size), Image.BILINEAR), dtype=np.float32)
  arr += rng.normal(0.0, 4.0, arr.shape)
  return np.clip(arr, 0, 255).astype(np.uint8), boxes


def generate(num_examples: int, group_size: int, image_size: int, seed: int, captions: str = "dense"):
  """Yields (image_id, png_bytes, caption, group_id, segments) for `num_examples` scenes, deterministic in `seed`;
  captions "dense" (`caption`), "short" (`short_caption`) or "detailed" (`detailed_caption`). segments: one per
  object, {"box": its exact bounding box in pixels, "sentence": `object_sentence` (a sentence of the dense caption;
  `object_phrase` for "detailed"), "score": 1.0} (the region
  annotations frameworks read, docs/frameworks.md; exact rather than matched)."""
  if num_examples <= 0 or group_size <= 0 or image_size <= 0:
    raise ValueError(f"synthetic data sizes must be positive, got num_examples={num_examples}, "
                     f"group_size={group_size}, image_size={image_size}")
  if captions not in CAPTION_STYLES:
    raise ValueError(f"synthetic captions={captions!r}; choose one of {list(CAPTION_STYLES)}")
  rng = np.random.default_rng(seed)
  text_rng = np.random.default_rng([seed, 1])  # short captions only; the scenes do not depend on the style
  seen = set()
  count, group = 0, 0
  while count < num_examples:
    n_obj = int(rng.integers(3, 5))
    cells = rng.choice(len(CELLS), size=n_obj, replace=False)
    base = tuple(sorted((_random_obj(rng, c) for c in cells), key=lambda x: x.cell))
    members, tries = [], 0
    cand = base
    while len(members) < group_size and tries < 50 * group_size:
      tries += 1
      if cand not in seen:
        seen.add(cand)
        members.append(cand)
      # Variants differ from the base in one or two attributes.
      cand = base
      for _ in range(int(rng.integers(1, 3))):
        cand = _mutate(rng, cand)
    for scene in members:
      if count == num_examples:
        break
      buf = io.BytesIO()
      image, boxes = render_with_boxes(scene, image_size, rng)
      Image.fromarray(image).save(buf, format="PNG")
      sentence = object_phrase if captions == "detailed" else object_sentence
      segments = [{"box": box, "sentence": sentence(o), "score": 1.0} for o, box in zip(scene, boxes)]
      text = {"dense": caption, "detailed": detailed_caption}.get(captions, lambda sc: short_caption(sc, text_rng))(scene)
      yield count, buf.getvalue(), text, group, segments
      count += 1
    group += 1
