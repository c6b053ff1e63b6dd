"""grain input pipelines: deterministic, resumable training batches and padded eval batches."""
from __future__ import annotations

import dataclasses
import re

import grain
import numpy as np
from PIL import Image

from hnclip_jax.data import manual

# OpenAI CLIP's pixel statistics (RGB, [0, 1] scale).
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)


def resize_center_crop(image, size: int) -> np.ndarray:
  """PIL image or uint8 [H, W, 3|1] -> uint8 [size, size, 3]: short side to `size` (bicubic), centre crop."""
  img = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image).squeeze())
  img = img.convert("RGB")
  w, h = img.size
  if (w, h) != (size, size):
    if w <= h:
      new_w, new_h = size, int(size * h / w)
    else:
      new_w, new_h = int(size * w / h), size
    img = img.resize((new_w, new_h), Image.BICUBIC)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    img = img.crop((left, top, left + size, top + size))
  return np.asarray(img, np.uint8)


def clip_preprocess(image, size: int) -> np.ndarray:
  """CLIP preprocessing of one image (PIL or uint8 array) -> float32 [size, size, 3], normalised."""
  return normalize(resize_center_crop(image, size))


def normalize(image: np.ndarray) -> np.ndarray:
  """uint8 [H, W, 3] -> float32 [H, W, 3]: scaled to [0, 1], then CLIP mean/std."""
  return (np.asarray(image, np.float32) / 255.0 - CLIP_MEAN) / CLIP_STD


def _text(c) -> str:
  return c.decode("utf-8") if isinstance(c, bytes) else str(c)


def captions_of(ex) -> list[str]:
  """An example's captions: several for datasets with a `captions` list (the `pairs` layout), else one."""
  if "captions" in ex:
    return [_text(c) for c in ex["captions"]]
  return [_text(ex["caption"])]


def caption_choice(seed: int, step: int, index: int, num_captions: int) -> int:
  """Which of an image's captions training uses at `step`: uniform, a pure function of (seed, step, example)."""
  if num_captions == 1:
    return 0
  return int(np.random.default_rng([seed, step, index]).integers(num_captions))


# ---- Segments (config.framework="goal"): a box of the image and the caption sentence describing it ----


def segments_of(ex) -> list[dict]:
  """An example's segments as [{"box": [4] float, "sentence": str, "score": float}] ([] when it has none)."""
  seg = ex.get("segments")
  if seg is None or not len(seg["sentence"]):
    return []
  boxes = np.asarray(seg["box"], np.float32).reshape(-1, 4)
  return [{"box": boxes[j], "sentence": _text(seg["sentence"][j]), "score": float(seg["score"][j])}
          for j in range(len(boxes))]


def segment_choice(segments, seed: int, step: int, index: int) -> int:
  """Which segment training uses at `step`: the best-scoring one (GOAL's choice); ties (exact segments all score
  1) are broken uniformly at random, a pure function of (seed, step, example)."""
  scores = np.asarray([s["score"] for s in segments])
  best = np.flatnonzero(scores == scores.max())
  return int(best[0] if len(best) == 1 else best[np.random.default_rng([seed, step, index, 1]).integers(len(best))])


def locate_sentence(caption: str, sentence: str):
  """(start, end) characters of `sentence` in `caption` (white space and letter case may differ), or None."""
  i = caption.find(sentence)
  if i >= 0:
    return i, i + len(sentence)
  words = sentence.split()
  if not words:
    return None
  m = re.search(r"\s+".join(re.escape(w) for w in words), caption, flags=re.IGNORECASE)
  return (m.start(), m.end()) if m else None


def box_to_patches(box, width: int, height: int, image_size: int, patch_size: int) -> np.ndarray:
  """float32 [g*g] (g = image_size // patch_size, row-major like the patch tokens): 1 on the patches a box of the
  original width x height image covers after `resize_center_crop` to image_size (the same resize and crop as the
  image); all 0 when the crop cut the box away."""
  if width <= height:
    new_w, new_h = image_size, int(image_size * height / width)
  else:
    new_w, new_h = int(image_size * width / height), image_size
  left, top = (new_w - image_size) // 2, (new_h - image_size) // 2
  x0, y0, x1, y1 = (float(v) for v in box)
  x0, x1 = x0 * new_w / width - left, x1 * new_w / width - left
  y0, y1 = y0 * new_h / height - top, y1 * new_h / height - top
  g = image_size // patch_size
  c0, c1 = max(int(np.floor(x0 / patch_size)), 0), min(int(np.ceil(x1 / patch_size)), g)
  r0, r1 = max(int(np.floor(y0 / patch_size)), 0), min(int(np.ceil(y1 / patch_size)), g)
  mask = np.zeros((g, g), np.float32)
  if c1 > c0 and r1 > r0:
    mask[r0:r1, c0:c1] = 1.0
  return mask.reshape(-1)


def segment_inputs(ex, caption: str, tokenizer, image_size: int, patch_size: int, seed: int, step: int,
                   index: int) -> dict:
  """The GOAL inputs of one example: its chosen segment's crop ("seg_image", CLIP-preprocessed like any image),
  sentence tokens ("seg_tokens"), the patches under its box ("seg_patches" [g*g]), the positions of the sentence
  among the caption's tokens ("seg_span" [L], 0 where the sentence is not in this caption or was truncated) and
  "seg_valid" (False for an example without segments: every segment term leaves it out)."""
  g, length = image_size // patch_size, tokenizer.context_length
  segments = segments_of(ex)
  if not segments:
    return {"seg_image": np.zeros((image_size, image_size, 3), np.float32), "seg_tokens": tokenizer([""])[0],
            "seg_patches": np.zeros(g * g, np.float32), "seg_span": np.zeros(length, np.float32),
            "seg_valid": np.bool_(False)}
  seg = segments[segment_choice(segments, seed, step, index)]
  image = ex["image"] if isinstance(ex["image"], Image.Image) else Image.fromarray(np.asarray(ex["image"]).squeeze())
  image = image.convert("RGB")
  box = manual.check_box(list(seg["box"]), image.width, image.height, f"example {index} segment")
  span = np.zeros(length, np.float32)
  where = locate_sentence(caption, seg["sentence"])
  if where is not None:
    span[tokenizer.span_positions(caption, *where)] = 1.0
  return {"seg_image": clip_preprocess(manual.crop_box(image, box), image_size),
          "seg_tokens": tokenizer([seg["sentence"]])[0],
          "seg_patches": box_to_patches(box, image.width, image.height, image_size, patch_size),
          "seg_span": span, "seg_valid": np.bool_(True)}


# ---- StructXLIP (config.framework="structxlip"): edge maps, the caption without appearance words, its chunks ----
@dataclasses.dataclass(frozen=True)
class StructureSettings:
  """config.structxlip's input settings (`from_config`)."""
  top_k: int = 3  # segment edge crops per example
  canny_low: float = 100.0
  canny_high: float = 200.0
  remove: tuple = ("colors",)  # structure.VISUAL_WORDS groups removed from the structure caption
  base_window: int = 3
  stride: int = 1
  max_chunks: int = 64

  @classmethod
  def from_config(cls, sx) -> "StructureSettings":
    remove = (sx.remove,) if isinstance(sx.remove, str) else tuple(sx.remove)
    return cls(int(sx.top_k), float(sx.canny_low), float(sx.canny_high), remove, int(sx.base_window),
               int(sx.stride), int(sx.max_chunks))


def top_segments(segments, k: int, seed: int, step: int, index: int) -> list:
  """The `k` best-scoring segments (ties in a random order per step, a pure function of (seed, step, example))."""
  jitter = np.random.default_rng([seed, step, index, 2]).random(len(segments))
  order = sorted(range(len(segments)), key=lambda j: (-segments[j]["score"], jitter[j]))
  return [segments[j] for j in order[:k]]


def structure_inputs(ex, caption: str, image_u8: np.ndarray, tokenizer, image_size: int, settings: StructureSettings,
                     seed: int, step: int, index: int) -> dict:
  """StructXLIP's inputs of one example: "sx_edge" (the edge map of the preprocessed image `image_u8`,
  CLIP-normalised), "sx_crop_edges" [top_k, S, S, 3] (edge maps of the best segments' crops, each crop
  preprocessed like an image first) with "sx_crop_valid" [top_k], "sx_tokens" (the caption without appearance
  words) and "sx_chunks" [max_chunks, L] (its word-window chunks as token masks)."""
  from hnclip_jax.data import structure
  st = settings
  edge = normalize(structure.edge_map(image_u8, st.canny_low, st.canny_high))
  crops = np.zeros((st.top_k, image_size, image_size, 3), np.float32)
  valid = np.zeros(st.top_k, bool)
  segments = segments_of(ex)
  if segments:
    image = ex["image"] if isinstance(ex["image"], Image.Image) else Image.fromarray(np.asarray(ex["image"]).squeeze())
    image = image.convert("RGB")
    for j, seg in enumerate(top_segments(segments, st.top_k, seed, step, index)):
      box = manual.check_box(list(seg["box"]), image.width, image.height, f"example {index} segment")
      crop = resize_center_crop(manual.crop_box(image, box), image_size)
      crops[j], valid[j] = normalize(structure.edge_map(crop, st.canny_low, st.canny_high)), True
  filtered = structure.filter_caption(caption, st.remove)
  return {"sx_edge": edge, "sx_crop_edges": crops, "sx_crop_valid": valid, "sx_tokens": tokenizer([filtered])[0],
          "sx_chunks": structure.chunk_masks(filtered, tokenizer, st.max_chunks, st.base_window, st.stride)}


class _Preprocess(grain.transforms.Map):

  def __init__(self, tokenizer, image_size, extra=None):
    self.tokenizer, self.image_size, self.extra = tokenizer, image_size, extra

  def map(self, ex, caption: int = 0, seed: int = 0, step: int = 0, index: int = 0):
    text = captions_of(ex)[caption]
    pixels = resize_center_crop(ex["image"], self.image_size)
    out = {"image": normalize(pixels), "tokens": self.tokenizer([text])[0]}
    if self.extra is not None:  # a framework's own per-example inputs (frameworks: `inputs`)
      out.update(self.extra(ex, text, pixels, seed, step, index))
    return out


class _LoadRows(grain.transforms.MapWithIndex):
  """(step, global batch of example indices) -> this process's rows, read and preprocessed, stacked. An image
  with several captions contributes the one `caption_choice` picks for this step; with `extra`, also a framework's
  per-example inputs."""

  def __init__(self, source, tokenizer, image_size, rows: slice, seed: int, extra=None):
    self.source, self.rows, self.seed = source, rows, seed
    self.pre = _Preprocess(tokenizer, image_size, extra)

  def map_with_index(self, step, indices):
    mine = indices[self.rows]
    items = []
    for i in mine:
      ex = self.source[int(i)]
      n = len(ex["captions"]) if "captions" in ex else 1
      items.append(self.pre.map(ex, caption_choice(self.seed, step, int(i), n), self.seed, step, int(i)))
    out = {k: np.stack([it[k] for it in items]) for k in items[0]}
    out["index"] = np.asarray(mine, np.int64)  # record index in the source: which examples this batch holds
    return out


def train_dataset(source, tokenizer, *, image_size: int, global_batch: int, seed: int, start_step: int = 0,
                  process_index: int = 0, process_count: int = 1, workers: int = 0, prefetch: int = 4,
                  extra_inputs=None):
  """Infinite iterator of this process's batches: image f32 [b,H,W,3], tokens int32 [b,L], b = global_batch / processes.

  The global batch order is shuffled per epoch from `seed` and does not depend on
  the number of processes: batch k is the same set of examples whether 1 or 64
  hosts read it, each host reading only its own rows. Batch k is a pure function
  of (seed, k), so `start_step` resumes the exact stream of an uninterrupted run.
  An image with several captions appears once per batch, with the caption
  `caption_choice(seed, k, index)` picks.
  extra_inputs: a framework's (example, caption, image uint8 [H, W, 3], seed, step, index) -> {name: array}, added
  to each row (hnclip_jax.frameworks: `inputs`); a pure function of its arguments keeps resumes bit-identical.
  """
  if global_batch % process_count:
    raise ValueError(f"config.batch_size={global_batch} is not divisible by the {process_count} processes")
  local = global_batch // process_count
  if len(source) < global_batch:
    raise ValueError(f"the training split has {len(source)} examples, fewer than one batch ({global_batch}); "
                     "lower config.batch_size")
  rows = slice(process_index * local, (process_index + 1) * local)
  ds = (grain.MapDataset.range(len(source)).shuffle(seed=seed).batch(global_batch, drop_remainder=True)
        .repeat().map_with_index(_LoadRows(source, tokenizer, image_size, rows, seed, extra_inputs))[start_step:])
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=max(1, prefetch), prefetch_buffer_size=prefetch))
  if workers > 0:
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return it


def _padded_batches(n_total: int, load, batch_size: int, process_index: int, process_count: int):
  """This process's share of rows 0..n_total-1 (every process_count-th), `load(rows) -> {name: [m, ...]}` per
  batch, zero-padded to `batch_size` with mask=False. Every process yields the same number of batches
  (ceil(ceil(N / processes) / batch_size)), so collective operations line up even when N is not divisible."""
  num_batches = -(-(-(-n_total // process_count)) // batch_size)
  mine = np.arange(process_index, n_total, process_count)
  template = load(np.arange(min(1, n_total)))
  for b in range(num_batches):
    idx = mine[b * batch_size:(b + 1) * batch_size]
    pad = batch_size - len(idx)
    got = load(idx) if len(idx) else {k: v[:0] for k, v in template.items()}
    batch = {k: np.concatenate([v, np.zeros((pad, *template[k].shape[1:]), template[k].dtype)]) for k, v in got.items()}
    batch["index"] = np.concatenate([idx, -np.ones(pad, np.int64)]).astype(np.int64)
    batch["mask"] = np.arange(batch_size) < len(idx)
    yield batch


def eval_image_batches(source, *, image_size: int, batch_size: int, process_index: int = 0, process_count: int = 1):
  """This process's share of the images of `source`: {"image" f32 [B,H,W,3], "index" (row in source), "mask"}."""
  load = lambda rows: {"image": np.stack([clip_preprocess(source[int(i)]["image"], image_size)  # noqa: E731
                                          for i in rows])}
  return _padded_batches(len(source), load, batch_size, process_index, process_count)


def eval_text_batches(captions, tokenizer, *, batch_size: int, process_index: int = 0, process_count: int = 1):
  """This process's share of `captions` (a flat list): {"tokens" int32 [B, L], "index" (row in captions), "mask"}."""
  load = lambda rows: {"tokens": tokenizer([captions[int(i)] for i in rows])}  # noqa: E731
  return _padded_batches(len(captions), load, batch_size, process_index, process_count)


def read_captions(source) -> list[str]:
  """All captions of a source, flattened (images are not decoded if the source skips decoding)."""
  return [c for caps in caption_lists(source) for c in caps]


def caption_lists(source) -> list[list[str]]:
  """Each example's captions, in source order."""
  return [captions_of(source[i]) for i in range(len(source))]
