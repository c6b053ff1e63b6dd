"""TFDS builders for the paper's benchmarks and for any folder of image/caption pairs (manual download).

Each reads a dataset's native layout from a manual directory (`config.data.manual_dir`), validates every example,
and writes array_record files with the original image bytes (never re-encoded), the caption and an image id.
Bad examples (missing/corrupt image, empty or non-UTF-8 caption, duplicated id) stop the build with the file and
line, or with `config.data.on_bad_example="skip"` are skipped and reported at the end of the build.
"""
from __future__ import annotations

import csv
import dataclasses
import glob
import hashlib
import io
import json
import math
import os

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

MAX_REPORTED = 5


# Files whose content (not only name, size and mtime) goes into a manual folder's fingerprint: the index files.
INDEX_SUFFIXES = (".json", ".jsonl", ".jsonlines", ".csv", ".tsv", ".txt")
INDEX_MAX_BYTES = 256 << 20


def input_fingerprint(manual_dir: str) -> str:
  """A hash of what a build reads: the folder's absolute path, every file's relative name, size and modification
  time, and the content of the index files (pairs.json, *.jsonlines, *.csv, captions). A change to any of them
  gives another build."""
  root = os.path.abspath(os.path.expanduser(manual_dir))
  h = hashlib.sha256(root.encode())
  for d, dirs, files in os.walk(root, followlinks=True):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(d, name)
      st = os.stat(path)
      h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
      if name.lower().endswith(INDEX_SUFFIXES) and st.st_size <= INDEX_MAX_BYTES:
        with open(path, "rb") as f:
          h.update(hashlib.sha256(f.read()).digest())
  return h.hexdigest()[:16]


class BadExample(ValueError):
  pass


# Per-example segments (region annotations, read by the frameworks that use regions: docs/frameworks.md): a region
# box of the image in original-image pixels [x0, y0, x1, y1] (x right, y down), the caption sentence that describes it, and how well they match (a cosine from
# tools/match_segments, 1.0 for exact ones). Stored as a sequence: {"box": [n, 4], "sentence": [n], "score": [n]}.
SEGMENTS_FEATURE = tfds.features.Sequence({"box": tfds.features.Tensor(shape=(4,), dtype=np.float32),
                                           "sentence": tfds.features.Text(), "score": np.float32})


def segments_feature_value(segments) -> dict:
  """A list of {"box", "sentence", "score"} (already checked) -> the SEGMENTS_FEATURE value."""
  return {"box": np.asarray([s["box"] for s in segments], np.float32).reshape(-1, 4),
          "sentence": [s["sentence"] for s in segments],
          "score": np.asarray([s["score"] for s in segments], np.float32)}


def check_box(box, width: int, height: int, where: str) -> tuple:
  """[x0, y0, x1, y1] in pixels -> the box clipped to the image; BadExample naming `where` if it is not 4 finite
  numbers with x1 > x0 and y1 > y0, or does not overlap the image."""
  if not (isinstance(box, (list, tuple, np.ndarray)) and len(box) == 4 and all(
      isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool) and math.isfinite(v)
      for v in box)):
    raise BadExample(f"{where}: box {box!r} is not [x0, y0, x1, y1] (four finite numbers, pixels)")
  x0, y0, x1, y1 = (float(v) for v in box)
  if not (x1 > x0 and y1 > y0):
    raise BadExample(f"{where}: box {box!r} is empty or reversed (need x1 > x0 and y1 > y0)")
  cx0, cy0, cx1, cy1 = max(x0, 0.0), max(y0, 0.0), min(x1, float(width)), min(y1, float(height))
  if not (cx1 > cx0 and cy1 > cy0):
    raise BadExample(f"{where}: box {box!r} lies outside the {width}x{height} image")
  return cx0, cy0, cx1, cy1


def crop_box(image: Image.Image, box) -> Image.Image:
  """The pixels under `box` (already checked and clipped), rounded outward to whole pixels."""
  x0, y0, x1, y1 = (float(v) for v in box)
  return image.crop((int(math.floor(x0)), int(math.floor(y0)), int(math.ceil(x1)), int(math.ceil(y1))))


def check_segments(segments, where: str) -> list:
  """The "segments" field of a `pairs` entry -> a list of {"box", "sentence", "score"}; BadExample naming the
  entry and segment when it is not a list of objects with a box (4 finite numbers, x1 > x0, y1 > y0), a non-empty
  sentence and, optionally, a finite score (default 1.0). Whether a box lies on its image is checked when the
  image is read (`check_box`)."""
  if not isinstance(segments, list):
    raise BadExample(f"{where}: 'segments' must be a list of {{'box': [x0, y0, x1, y1], 'sentence': ..., "
                     f"'score': ...}} objects, got {type(segments).__name__}")
  out = []
  for j, seg in enumerate(segments):
    w = f"{where} segments[{j}]"
    if not isinstance(seg, dict) or "box" not in seg or "sentence" not in seg:
      raise BadExample(f"{w}: needs 'box' ([x0, y0, x1, y1], pixels) and 'sentence'")
    check_box(seg["box"], math.inf, math.inf, w)
    if not isinstance(seg["sentence"], str) or not seg["sentence"].strip():
      raise BadExample(f"{w}: 'sentence' must be a non-empty string")
    score = seg.get("score", 1.0)
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
      raise BadExample(f"{w}: 'score' {score!r} is not a finite number")
    out.append({"box": [float(v) for v in seg["box"]], "sentence": " ".join(seg["sentence"].split()),
                "score": float(score)})
  return out


@dataclasses.dataclass
class ManualConfig(tfds.core.BuilderConfig):
  on_bad_example: str = "error"  # "error" | "skip"


@dataclasses.dataclass
class Pair:
  image_id: str
  image_path: str
  caption: object  # str, or bytes to be decoded (checked); HnclipPairs: a list of (caption, where)
  where: str  # file:line, for error messages
  split: str = "train"
  segments: object = None  # HnclipPairs: a checked list of {"box", "sentence", "score"}, or None (not given)


def _read_text(path: str, where: str) -> str:
  with open(path, "rb") as f:
    return _decode_caption(f.read(), where)


def _decode_caption(raw, where: str) -> str:
  if isinstance(raw, bytes):
    try:
      raw = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise BadExample(f"{where}: caption is not valid UTF-8 ({e}); re-save it as UTF-8") from e
  if not isinstance(raw, str) or not raw.strip():
    raise BadExample(f"{where}: caption is empty")
  return raw.strip()


def _image_bytes(path: str, where: str) -> bytes:
  if not os.path.exists(path):
    raise BadExample(f"{where}: image {path} is listed but does not exist")
  with open(path, "rb") as f:
    data = f.read()
  try:
    with Image.open(io.BytesIO(data)) as im:
      fmt = im.format
      im.load()  # decodes fully: catches truncated files that verify() lets through
  except Exception as e:  # noqa: BLE001 — PIL raises many types for broken files
    raise BadExample(f"{where}: image {path} is corrupt or truncated ({e})") from e
  if fmt not in ("JPEG", "PNG"):
    raise BadExample(f"{where}: image {path} is {fmt}; only JPEG and PNG are supported")
  return data


class _ManualPairs(tfds.core.GeneratorBasedBuilder):
  """Shared machinery; subclasses implement `_pairs(manual_dir) -> {split: [Pair]}`."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [ManualConfig(name="default", on_bad_example="error"),
                     ManualConfig(name="skip_bad", on_bad_example="skip")]

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, description=self.__doc__,
        features=tfds.features.FeaturesDict({"image": tfds.features.Image(), "caption": tfds.features.Text(),
                                             "image_id": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    manual_dir = str(dl_manager.manual_dir)
    if not os.path.isdir(manual_dir):
      raise FileNotFoundError(f"{self.name}: manual directory {manual_dir} does not exist (what it must hold: "
                              "above)\n"
                              f"{self.MANUAL_DOWNLOAD_INSTRUCTIONS}")
    self._skipped = []
    splits = self._pairs(manual_dir)
    seen = {}
    for split, pairs in splits.items():  # ids must be unique across all splits: a split never mixes examples
      for p in pairs:
        if p.image_id in seen:
          self._bad(BadExample(f"{p.where}: duplicated image id {p.image_id!r} (first at {seen[p.image_id]})"))
          p.image_id = None
        else:
          seen[p.image_id] = p.where
    return {split: self._generate_examples([p for p in pairs if p.image_id is not None])
            for split, pairs in splits.items()}

  def _bad(self, err: BadExample):
    if self.builder_config.on_bad_example != "skip":
      raise BadExample(f"{self.name}: {err}. Fix the file, or set config.data.on_bad_example=skip to leave such "
                       "examples out")
    self._skipped = getattr(self, "_skipped", []) + [str(err)]

  def _generate_examples(self, pairs):
    for p in pairs:
      try:
        example = self._example(p)
      except BadExample as e:
        self._bad(e)
        continue
      yield p.image_id, example

  def _example(self, p: Pair) -> dict:
    caption = _decode_caption(p.caption, p.where)
    return {"image": _image_bytes(p.image_path, p.where), "caption": caption, "image_id": p.image_id}

  def _download_and_prepare(self, *args, **kwargs):
    super()._download_and_prepare(*args, **kwargs)
    skipped = getattr(self, "_skipped", [])
    if skipped:
      first = "\n  ".join(skipped[:MAX_REPORTED])
      print(f"{self.name}: skipped {len(skipped)} bad example(s); first {min(len(skipped), MAX_REPORTED)}:\n  {first}",
            flush=True)
      with open(os.path.join(self.data_path, "skipped_examples.txt"), "w") as f:
        f.write("\n".join(skipped) + "\n")


def _need(path: str, builder) -> str:
  if not os.path.exists(path):
    raise FileNotFoundError(f"{builder.name}: {path} is missing (what the folder must hold: above)\n"
                            f"{builder.MANUAL_DOWNLOAD_INSTRUCTIONS}")
  return path


class HnclipDocci(_ManualPairs):
  """DOCCI: Descriptions of Connected and Contrasting Images (Google, 2024)."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Download docci_descriptions.jsonlines and docci_images.tar.gz from the DOCCI page (google.github.io/docci),
unpack the images so that MANUAL_DIR/images/<image_file> exist, and put docci_descriptions.jsonlines in
MANUAL_DIR. Splits (train 9,647 / test 5,000 / qual_train / qual_test) come from its `split` field."""

  def _pairs(self, manual_dir):
    path = _need(os.path.join(manual_dir, "docci_descriptions.jsonlines"), self)
    splits = {}
    with open(path, "rb") as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        where = f"{path}:{n}"
        try:
          row = json.loads(line)
          pair = Pair(str(row["example_id"]), os.path.join(manual_dir, "images", row["image_file"]),
                      row["description"], where)
          split = row["split"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
          self._bad(BadExample(f"{where}: not a DOCCI record with example_id, split, image_file, description ({e})"))
          continue
        splits.setdefault(split, []).append(pair)
    return splits


def _load_split_list(path: str, builder) -> list:
  with open(_need(path, builder), encoding="utf-8") as f:
    rows = json.load(f)
  if not isinstance(rows, list) or not all(isinstance(r, dict) and "filename" in r for r in rows):
    raise ValueError(f"{path}: expected a JSON list of objects with a 'filename' field")
  return rows


def dci_segments(mask_data, where: str) -> list:
  """DCI's masks as segments: each mask's bounds (original pixels) with the text DCI itself gives it — "label:
  caption" for a fine mask (mask_quality 0, score 1.0), the label alone for a low-quality one (1, score 0.5);
  unusable masks (2) are left out. BadExample naming the mask when its bounds are malformed."""
  if not isinstance(mask_data, dict):
    raise BadExample(f"{where}: 'mask_data' must be an object of masks")
  segments = []
  for key, m in mask_data.items():
    w = f"{where} mask_data[{key!r}]"
    try:
      quality, label = int(m.get("mask_quality", 0)), str(m.get("label", "")).strip()
      tl, br = m["bounds"]["topLeft"], m["bounds"]["bottomRight"]
      box = [tl["x"], tl["y"], br["x"], br["y"]]
    except (KeyError, TypeError, AttributeError, ValueError) as e:
      raise BadExample(f"{w}: needs bounds {{topLeft: {{x, y}}, bottomRight: {{x, y}}}} ({e!r})") from None
    if quality == 2 or not label:
      continue
    caption = str(m.get("caption", "")).strip()
    sentence = f"{label}: {caption}" if quality == 0 and caption else label
    check_box(box, math.inf, math.inf, w)
    segments.append({"box": [float(v) for v in box], "sentence": sentence, "score": 1.0 if quality == 0 else 0.5})
  return segments


class HnclipDci(_ManualPairs):
  """DCI: Densely Captioned Images (Meta, 2024); the caption of each image is its `extra_caption`. Its masks are the
  segments (`dci_segments`: each mask's bounds and its own caption), for the frameworks that read regions."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.1.0": "segments from DCI's masks (bounds, 'label: caption')"}

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, description=self.__doc__,
        features=tfds.features.FeaturesDict({"image": tfds.features.Image(), "caption": tfds.features.Text(),
                                             "image_id": tfds.features.Text(), "segments": SEGMENTS_FEATURE}))

  def _example(self, p: Pair) -> dict:
    example = super()._example(p)
    segments = p.segments or []
    if segments:
      with Image.open(io.BytesIO(example["image"])) as im:
        width, height = im.size
      for j, seg in enumerate(segments):
        check_box(seg["box"], width, height, f"{p.where} segment {j} (image {p.image_path})")
    example["segments"] = segments_feature_value(segments)
    return example

  MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Download the DCI archive (github.com/facebookresearch/DCI: densely_captioned_images with annotations/ and
photos/) and unpack it so that MANUAL_DIR/densely_captioned_images/annotations/*.json and
MANUAL_DIR/densely_captioned_images/photos/ exist. Put the split lists used by published DCI fine-tuning code in
MANUAL_DIR/splits/train.json and MANUAL_DIR/splits/test.json (JSON lists of {"filename", "caption"};
train 5,445 / test 1,999 images)."""

  def _pairs(self, manual_dir):
    root = os.path.join(manual_dir, "densely_captioned_images")
    ann_dir = _need(os.path.join(root, "annotations"), self)
    by_image = {}
    for path in sorted(glob.glob(os.path.join(ann_dir, "*.json"))):
      try:
        with open(path, "rb") as f:
          ann = json.loads(f.read())
        pair = Pair(ann["image"], os.path.join(root, "photos", ann["image"]), ann.get("extra_caption", ""), path)
        pair.segments = dci_segments(ann.get("mask_data", {}), path)
        by_image[ann["image"]] = pair
      except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        self._bad(BadExample(f"{path}: not a DCI annotation with 'image' and 'extra_caption' ({e})"))
      except BadExample as e:
        self._bad(e)
    splits = {}
    for split in ("train", "test"):
      path = os.path.join(manual_dir, "splits", f"{split}.json")
      for n, row in enumerate(_load_split_list(path, self)):
        if row["filename"] not in by_image:
          self._bad(BadExample(f"{path}[{n}]: {row['filename']} has no annotation in {ann_dir}"))
          continue
        splits.setdefault(split, []).append(dataclasses.replace(by_image[row["filename"]]))
    return splits


class HnclipLongDci(_ManualPairs):
  """Long-DCI: long captions of the DCI photos (`dci_long.csv`); a test set."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Put the tab-separated dci_long.csv (columns filepath, title) in MANUAL_DIR, with the DCI photos at the paths its
`filepath` column names, relative to MANUAL_DIR (e.g. MANUAL_DIR/densely_captioned_images/photos/...)."""

  def _pairs(self, manual_dir):
    path = _need(os.path.join(manual_dir, "dci_long.csv"), self)
    pairs = []
    with open(path, "rb") as f:
      raw = f.read()
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise BadExample(f"{path}: not UTF-8 ({e})") from e
    reader = csv.DictReader(io.StringIO(text), delimiter="\t")
    if not {"filepath", "title"} <= set(reader.fieldnames or []):
      raise ValueError(f"{path}: expected tab-separated columns 'filepath' and 'title', got {reader.fieldnames}")
    for n, row in enumerate(reader, 2):
      fp = row["filepath"]
      pairs.append(Pair(os.path.basename(fp), fp if os.path.isabs(fp) else os.path.join(manual_dir, fp),
                        row["title"] or "", f"{path}:{n}"))
    return {"test": pairs}


class HnclipUrban1k(_ManualPairs):
  """Urban-1K: 1,000 urban scenes with long captions (from the Long-CLIP release); a test set."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Download Urban1k.zip (Long-CLIP release) and unpack it so that MANUAL_DIR/image/N.jpg and MANUAL_DIR/caption/N.txt
exist for N = 1..1000."""

  def _pairs(self, manual_dir):
    img_dir = _need(os.path.join(manual_dir, "image"), self)
    cap_dir = _need(os.path.join(manual_dir, "caption"), self)
    images = {os.path.splitext(f)[0]: f for f in os.listdir(img_dir)}
    captions = {os.path.splitext(f)[0] for f in os.listdir(cap_dir) if f.endswith(".txt")}
    pairs = []
    for key in sorted(images.keys() | captions, key=lambda k: (len(k), k)):
      cap_path = os.path.join(cap_dir, f"{key}.txt")
      if key not in captions:
        self._bad(BadExample(f"{os.path.join(img_dir, images[key])}: no caption file {cap_path}"))
        continue
      if key not in images:
        self._bad(BadExample(f"{cap_path}: no image {key}.jpg in {img_dir}"))
        continue
      with open(cap_path, "rb") as f:
        pairs.append(Pair(key, os.path.join(img_dir, images[key]), f.read(), cap_path))
    return {"test": pairs}


class HnclipPairs(_ManualPairs):
  """Any folder of images with one or more captions each, listed in pairs.json (a JSON list) or pairs.jsonl."""

  VERSION = tfds.core.Version("3.0.0")
  RELEASE_NOTES = {"2.0.0": "several captions per image: the feature 'captions' (a list) replaces 'caption'",
                   "3.0.0": "per-image segments (box, sentence, score) for GOAL / StructXLIP: the feature 'segments'"}
  MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Put pairs.json (a JSON list) or pairs.jsonl (one object per line) in MANUAL_DIR; each entry is
{"filename": "relative/path.jpg", "caption": "...", "split": "train"} with filenames relative to MANUAL_DIR.
An image with several captions (COCO, Flickr30k) has either one entry with "captions": ["...", "..."] or one entry
per caption repeating its "filename" (both may be mixed; captions keep their order). "split" is optional
(default "train"); an image belongs to one split. Images must be JPEG or PNG.
Segments (region annotations for the frameworks that read them, docs/frameworks.md): an entry may carry
"segments": [{"box": [x0, y0, x1, y1], "sentence": "...", "score": 0.31}, ...] with the box in original-image pixels (x right, y down), the caption
sentence that describes it and, optionally, a match score (default 1.0; the best-scoring segment is used).
python -m hnclip_jax.tools.match_segments writes this field from any segmenter's boxes (docs/frameworks.md). When
any entry has segments, every image must have the field ("segments": [] for an image with none)."""

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, description=self.__doc__,
        features=tfds.features.FeaturesDict({"image": tfds.features.Image(),
                                             "captions": tfds.features.Sequence(tfds.features.Text()),
                                             "image_id": tfds.features.Text(),
                                             "segments": SEGMENTS_FEATURE}))

  def _example(self, p: Pair) -> dict:
    captions = [_decode_caption(c, w) for c, w in p.caption]
    data = _image_bytes(p.image_path, p.where)
    segments = p.segments or []
    if segments:
      with Image.open(io.BytesIO(data)) as im:
        width, height = im.size
      for j, seg in enumerate(segments):
        check_box(seg["box"], width, height, f"{p.where} segments[{j}] (image {p.image_path})")
    return {"image": data, "captions": captions, "image_id": p.image_id,
            "segments": segments_feature_value(segments)}

  def _pairs(self, manual_dir):
    js, jl = os.path.join(manual_dir, "pairs.json"), os.path.join(manual_dir, "pairs.jsonl")
    rows = []
    if os.path.exists(js):
      with open(js, "rb") as f:
        try:
          data = json.loads(f.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
          raise ValueError(f"{js}: not valid UTF-8 JSON ({e})") from e
      if not isinstance(data, list):
        raise ValueError(f"{js}: expected a JSON list of {{'filename', 'caption'}} objects")
      rows = [(f"{js}[{i}]", r) for i, r in enumerate(data)]
    elif os.path.exists(jl):
      with open(jl, "rb") as f:
        for n, line in enumerate(f, 1):
          if line.strip():
            try:
              rows.append((f"{jl}:{n}", json.loads(line)))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
              self._bad(BadExample(f"{jl}:{n}: not a JSON object ({e})"))
    else:
      _need(js, self)
    images = {}  # filename -> Pair, its caption a list of (caption, where); in order of first appearance
    for where, r in rows:
      if not isinstance(r, dict) or "filename" not in r or ("caption" in r) == ("captions" in r):
        self._bad(BadExample(f"{where}: needs 'filename' and either 'caption' (a string) or 'captions' (a list)"))
        continue
      caps = r["captions"] if "captions" in r else [r["caption"]]
      if not isinstance(caps, list) or not caps:
        self._bad(BadExample(f"{where}: 'captions' must be a non-empty list of strings"))
        continue
      try:
        segments = check_segments(r["segments"], where) if "segments" in r else None
      except BadExample as e:
        self._bad(e)
        continue
      split = r.get("split", "train")
      p = images.get(r["filename"])
      if p is None:
        p = images[r["filename"]] = Pair(r["filename"], os.path.join(manual_dir, r["filename"]), [], where, split)
      elif p.split != split:
        self._bad(BadExample(f"{where}: image {r['filename']!r} is in split {split!r} here but in {p.split!r} at "
                             f"{p.where}; an image belongs to one split"))
        continue
      p.caption += [(c, f"{where} caption {j}" if len(caps) > 1 else where) for j, c in enumerate(caps)]
      if segments is not None:  # an image listed once per caption may give its segments in any of its entries
        p.segments = (p.segments or []) + segments
    with_segments = [p for p in images.values() if p.segments is not None]
    splits = {}
    for p in images.values():
      if with_segments and p.segments is None:
        self._bad(BadExample(f"{p.where}: image {p.image_id!r} has no 'segments', but other entries do (first: "
                             f"{with_segments[0].where}); give every image the field ('segments': [] for none)"))
        continue
      splits.setdefault(p.split, []).append(p)
    return splits


class _Karpathy(HnclipPairs):
  """Shared reader of Karpathy's split files (dataset_coco.json / dataset_flickr30k.json): five captions per image;
  splits train (+ restval), val, test (the standard 5k / 1k test images)."""

  JSON = ""
  DEFAULT_FOLDER = ""  # where images live when an entry has no "filepath"

  def _pairs(self, manual_dir):
    path = _need(os.path.join(manual_dir, self.JSON), self)
    with open(path, "rb") as f:
      try:
        data = json.loads(f.read())
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid UTF-8 JSON ({e}); download it again") from e
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
      raise ValueError(f"{path}: expected Karpathy's split file, a JSON object with an 'images' list")
    splits = {}
    for n, im in enumerate(data["images"]):
      where = f"{path} images[{n}]"
      try:
        rel = os.path.join(im.get("filepath") or self.DEFAULT_FOLDER, im["filename"])
        split = {"restval": "train"}.get(im["split"], im["split"])
        caps = [(s["raw"], f"{where} sentences[{j}]") for j, s in enumerate(im["sentences"])]
      except (KeyError, TypeError, AttributeError) as e:
        self._bad(BadExample(f"{where}: needs 'filename', 'split' and 'sentences' with 'raw' ({e!r} missing)"))
        continue
      if not caps:
        self._bad(BadExample(f"{where}: no sentences"))
        continue
      splits.setdefault(split, []).append(Pair(rel, os.path.join(manual_dir, rel), caps, where, split))
    return splits


class HnclipCoco(_Karpathy):
  """MS-COCO captions, Karpathy splits (113,287 train+restval / 5,000 val / 5,000 test images, 5 captions each)."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.1.0": "the (empty) 'segments' feature of the pairs layout"}
  JSON = "dataset_coco.json"
  MANUAL_DOWNLOAD_INSTRUCTIONS = """\
MANUAL_DIR must hold Karpathy's split file and COCO 2014's images:
  MANUAL_DIR/dataset_coco.json      from caption_datasets.zip (Karpathy & Fei-Fei's splits)
  MANUAL_DIR/train2014/*.jpg        from train2014.zip (cocodataset.org)
  MANUAL_DIR/val2014/*.jpg          from val2014.zip (the 5k test and 5k val images are taken from here)
Each entry's "filepath" (train2014 / val2014) and "filename" name its image."""


class HnclipFlickr30k(_Karpathy):
  """Flickr30k, Karpathy splits (29,000 train / 1,014 val / 1,000 test images, 5 captions each)."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.1.0": "the (empty) 'segments' feature of the pairs layout"}
  JSON = "dataset_flickr30k.json"
  DEFAULT_FOLDER = "flickr30k-images"
  MANUAL_DOWNLOAD_INSTRUCTIONS = """\
MANUAL_DIR must hold Karpathy's split file and the Flickr30k images:
  MANUAL_DIR/dataset_flickr30k.json   from caption_datasets.zip (Karpathy & Fei-Fei's splits)
  MANUAL_DIR/flickr30k-images/*.jpg   from flickr30k-images.tar.gz (the Flickr30k request form)"""
