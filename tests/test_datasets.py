"""The benchmark builders read tiny fixtures written in each dataset's exact native layout."""
import io
import re
import json
import os

import ml_collections
import numpy as np
import pytest
from PIL import Image

from hnclip_jax.data import builders, pipeline
from hnclip_jax.frameworks.segments import segments_of
from conftest import assert_error_exit, run_processes, run_py


def image_bytes(seed, fmt="JPEG", size=(20, 16)):
  arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
  buf = io.BytesIO()
  Image.fromarray(arr).save(buf, format=fmt)
  return buf.getvalue()


def write(path, data):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb" if isinstance(data, bytes) else "w", **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
    f.write(data)


def cfg(name, manual_dir, data_dir, skip=False):
  return ml_collections.ConfigDict(dict(name=name, manual_dir=str(manual_dir), data_dir=str(data_dir),
                                        on_bad_example="skip" if skip else "error"))


def read_all(config, split):
  """{image id: (caption, image bytes)}; the caption is a list for images with several."""
  src = builders.data_source(config, split, decode_images=False)
  out = {}
  for i in range(len(src)):
    caps = pipeline.captions_of(src[i])
    out[src[i]["image_id"].decode()] = (caps[0] if len(caps) == 1 else caps, src[i]["image"])
  return out


# ---------------------------------------------------------------------------------------------- DOCCI


def docci_fixture(root, extra_lines=()):
  rows = []
  for i, split in enumerate(["train", "train", "train", "test", "test", "qual_train", "qual_test"]):
    rows.append({"example_id": f"{split}_{i:05d}", "split": split, "image_file": f"{split}_{i:05d}.jpg",
                 "description": f"Picture {i}: a {split} scene with a lamp, ünïcode, and {i} chairs."})
    write(os.path.join(root, "images", f"{split}_{i:05d}.jpg"), image_bytes(i))
  write(os.path.join(root, "docci_descriptions.jsonlines"),
        "\n".join([json.dumps(r) for r in rows] + list(extra_lines)) + "\n")
  return rows


def test_docci(tmp_path):
  rows = docci_fixture(tmp_path / "m")
  c = cfg("docci", tmp_path / "m", tmp_path / "d")
  for split in ("train", "test", "qual_train", "qual_test"):
    got = read_all(c, split)
    want = {r["example_id"]: r for r in rows if r["split"] == split}
    assert set(got) == set(want)
    for k, (cap, img) in got.items():
      assert cap == want[k]["description"]
      assert img == (tmp_path / "m" / "images" / want[k]["image_file"]).read_bytes()  # original bytes
  assert not set(read_all(c, "train")) & set(read_all(c, "test"))


def test_docci_bad_examples(tmp_path):
  docci_fixture(tmp_path / "m", extra_lines=[
      json.dumps({"example_id": "train_00000", "split": "test", "image_file": "train_00000.jpg", "description": "dup"})])
  with pytest.raises(ValueError, match="duplicated image id 'train_00000'"):
    read_all(cfg("docci", tmp_path / "m", tmp_path / "d"), "train")
  # Missing image, truncated image, empty caption: skipped and reported with skip.
  m = tmp_path / "m2"
  rows = docci_fixture(m)
  os.remove(m / "images" / rows[0]["image_file"])
  data = (m / "images" / rows[1]["image_file"]).read_bytes()
  (m / "images" / rows[1]["image_file"]).write_bytes(data[: len(data) // 2])
  rows[3]["description"] = "   "  # a test example
  write(str(m / "docci_descriptions.jsonlines"), "\n".join(json.dumps(r) for r in rows) + "\n")
  with pytest.raises(ValueError, match=r"docci_descriptions.jsonlines:1: image .* does not exist"):
    read_all(cfg("docci", m, tmp_path / "d2"), "train")
  got = read_all(cfg("docci", m, tmp_path / "d3", skip=True), "train")
  assert sorted(got) == [rows[2]["example_id"]]  # two of three train examples were bad
  assert sorted(read_all(cfg("docci", m, tmp_path / "d3", skip=True), "test")) == [rows[4]["example_id"]]
  report = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "d3") for f in fs if f == "skipped_examples.txt"]
  text = open(report[0]).read()
  assert "does not exist" in text and "corrupt or truncated" in text and "caption is empty" in text


def test_missing_manual_dir_and_file(tmp_path):
  with pytest.raises(ValueError, match="set config.data.manual_dir"):
    builders.data_source(cfg("docci", "", tmp_path / "d"), "train")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="does not exist or is empty"):
    builders.data_source(cfg("docci", tmp_path / "empty", tmp_path / "d"), "train")
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "readme.txt").write_text("x")
  with pytest.raises(FileNotFoundError, match="docci_descriptions.jsonlines is missing"):
    builders.data_source(cfg("docci", tmp_path / "other", tmp_path / "d"), "train")


# ---------------------------------------------------------------------------------------------- DCI / Long-DCI


def dci_fixture(root, n=6):
  base = os.path.join(root, "densely_captioned_images")
  for i in range(n):
    name = f"sa_{1000 + i}.jpg"
    write(os.path.join(base, "photos", name), image_bytes(100 + i))
    write(os.path.join(base, "annotations", f"sa_{1000 + i}.json"),
          json.dumps({"image": name, "short_caption": "short", "extra_caption": f"Dense caption number {i}.",
                      "mask_data": {}}))
  write(os.path.join(root, "splits", "train.json"),
        json.dumps([{"filename": f"sa_{1000 + i}.jpg", "caption": "x"} for i in range(4)]))
  write(os.path.join(root, "splits", "test.json"),
        json.dumps([{"filename": f"sa_{1000 + i}.jpg", "caption": "x"} for i in range(4, n)]))


def test_dci_and_long_dci(tmp_path):
  m = tmp_path / "m"
  dci_fixture(m)
  c = cfg("dci", m, tmp_path / "d")
  train, test = read_all(c, "train"), read_all(c, "test")
  assert sorted(train) == [f"sa_{1000 + i}.jpg" for i in range(4)] and sorted(test) == ["sa_1004.jpg", "sa_1005.jpg"]
  assert train["sa_1002.jpg"][0] == "Dense caption number 2."
  write(str(m / "dci_long.csv"), "filepath\ttitle\n" + "".join(
      f"densely_captioned_images/photos/sa_{1000 + i}.jpg\tA long caption, with commas, number {i}\n" for i in range(6)))
  long = read_all(cfg("long_dci", m, tmp_path / "d"), "test")
  assert len(long) == 6 and long["sa_1003.jpg"][0] == "A long caption, with commas, number 3"
  assert long["sa_1003.jpg"][1] == (m / "densely_captioned_images" / "photos" / "sa_1003.jpg").read_bytes()


def test_dci_masks_are_segments(tmp_path):
  """DCI's masks become segments: bounds in pixels, "label: caption" for fine masks (score 1), the label for
  low-quality ones (0.5), unusable ones left out; malformed bounds follow on_bad_example."""
  m = tmp_path / "m"
  dci_fixture(m)
  ann = m / "densely_captioned_images" / "annotations" / "sa_1001.json"
  masks = {"0": {"bounds": {"topLeft": {"x": 2, "y": 3}, "bottomRight": {"x": 12, "y": 9}}, "label": "A cup",
                 "caption": "white, on a table", "mask_quality": 0},
           "1": {"bounds": {"topLeft": {"x": 0, "y": 0}, "bottomRight": {"x": 5, "y": 5}}, "label": "Shadow",
                 "caption": "dark", "mask_quality": 1},
           "2": {"bounds": {"topLeft": {"x": 1, "y": 1}, "bottomRight": {"x": 4, "y": 4}}, "label": "blur",
                 "caption": "", "mask_quality": 2}}
  write(str(ann), json.dumps({"image": "sa_1001.jpg", "extra_caption": "Dense caption number 1.", "mask_data": masks}))
  src = builders.data_source(cfg("dci", m, tmp_path / "d"), "train")
  by_id = {src[i]["image_id"].decode(): segments_of(src[i]) for i in range(len(src))}
  got = by_id["sa_1001.jpg"]
  assert [(list(map(float, s["box"])), s["sentence"], s["score"]) for s in got] == [
      ([2.0, 3.0, 12.0, 9.0], "A cup: white, on a table", 1.0), ([0.0, 0.0, 5.0, 5.0], "Shadow", 0.5)]
  assert by_id["sa_1000.jpg"] == []  # no masks: no segments
  masks["0"]["bounds"] = {"topLeft": {"x": 30, "y": 3}, "bottomRight": {"x": 50, "y": 9}}  # the image is 20 px wide
  write(str(ann), json.dumps({"image": "sa_1001.jpg", "extra_caption": "Dense caption number 1.", "mask_data": masks}))
  with pytest.raises(ValueError, match=r"sa_1001.json segment 0 \(image .*sa_1001.jpg\): box .* lies outside"):
    builders.data_source(cfg("dci", m, tmp_path / "d2"), "train")
  masks["0"]["bounds"] = {"topLeft": {"x": 2}}
  write(str(ann), json.dumps({"image": "sa_1001.jpg", "extra_caption": "Dense caption number 1.", "mask_data": masks}))
  assert len(builders.data_source(cfg("dci", m, tmp_path / "d3", skip=True), "train")) == 3


def test_dci_split_list_naming_an_unknown_image(tmp_path):
  m = tmp_path / "m"
  dci_fixture(m)
  write(str(m / "splits" / "test.json"), json.dumps([{"filename": "sa_9999.jpg", "caption": "x"}]))
  with pytest.raises(ValueError, match=r"test.json\[0\]: sa_9999.jpg has no annotation"):
    read_all(cfg("dci", m, tmp_path / "d"), "test")


# ---------------------------------------------------------------------------------------------- Urban-1K, pairs


def test_urban1k(tmp_path):
  m = tmp_path / "m"
  for i in range(1, 6):
    write(str(m / "image" / f"{i}.jpg"), image_bytes(200 + i))
    write(str(m / "caption" / f"{i}.txt"), f"Street {i} with tall buildings and a red bus.\n")
  got = read_all(cfg("urban1k", m, tmp_path / "d"), "test")
  assert sorted(got, key=int) == ["1", "2", "3", "4", "5"] and got["4"][0] == "Street 4 with tall buildings and a red bus."
  write(str(m / "caption" / "6.txt"), b"\xff\xfe not utf-8")
  write(str(m / "image" / "6.jpg"), image_bytes(206))
  with pytest.raises(ValueError, match=r"6.txt: caption is not valid UTF-8"):
    read_all(cfg("urban1k", m, tmp_path / "d2"), "test")


def test_generic_pairs_json_and_jsonl(tmp_path):
  m = tmp_path / "m"
  entries = []
  for i in range(5):
    name = f"sub/img{i}.{'png' if i % 2 else 'jpg'}"
    write(str(m / name), image_bytes(300 + i, "PNG" if i % 2 else "JPEG"))
    entries.append({"filename": name, "caption": f"caption {i}", **({"split": "test"} if i >= 3 else {})})
  write(str(m / "pairs.json"), json.dumps(entries))
  c = cfg("pairs", m, tmp_path / "d")
  assert sorted(read_all(c, "train")) == ["sub/img0.jpg", "sub/img1.png", "sub/img2.jpg"]
  assert read_all(c, "test")["sub/img4.jpg"][0] == "caption 4"
  m2 = tmp_path / "m2"
  os.makedirs(m2)
  for e in entries:
    write(str(m2 / e["filename"]), (m / e["filename"]).read_bytes())
  write(str(m2 / "pairs.jsonl"), "\n".join(json.dumps(e) for e in entries))
  assert read_all(cfg("pairs", m2, tmp_path / "d2"), "train") == read_all(c, "train")


def test_pairs_with_several_captions_per_image(tmp_path):
  """A 'captions' list and repeated 'filename' rows (mixed) give one example per image with every caption in
  order; an image in two splits or an empty list is a named error; training uses one caption per image per step,
  picked from the seed, and resuming at step k gives the same captions."""
  from hnclip_jax.data.tokenizer import WordTokenizer
  m = tmp_path / "m"
  rows, want = [], {}
  for i in range(8):
    write(str(m / f"img{i}.jpg"), image_bytes(900 + i))
    caps = [f"image {i} caption {j}" + " word" * j for j in range(1 + i % 3)]
    want[f"img{i}.jpg"] = caps
    if i % 2:  # one row per caption
      rows += [{"filename": f"img{i}.jpg", "caption": c} for c in caps]
    else:
      rows.append({"filename": f"img{i}.jpg", "captions": caps})
  rows.insert(3, rows.pop())  # the rows of one image need not be adjacent; captions keep the file's order
  want["img7.jpg"] = want["img7.jpg"][::-1]
  write(str(m / "pairs.jsonl"), "\n".join(json.dumps(r) for r in rows))
  c = cfg("pairs", m, tmp_path / "d")
  got = read_all(c, "train")
  assert {k: v[0] if isinstance(v[0], list) else [v[0]] for k, v in got.items()} == want

  src = builders.data_source(c, "train")
  tok = WordTokenizer.fit(pipeline.read_captions(src), context_length=16)
  kw = dict(image_size=16, global_batch=4, seed=7)
  stream = [b for _, b in zip(range(12), pipeline.train_dataset(src, tok, **kw))]
  used = {}
  for step, b in enumerate(stream):
    assert len(set(b["index"].tolist())) == 4  # an image appears once per batch
    for row, i in enumerate(b["index"]):
      caps = pipeline.captions_of(src[int(i)])
      k = pipeline.caption_choice(7, step, int(i), len(caps))
      np.testing.assert_array_equal(b["tokens"][row], tok([caps[k]])[0])
      used.setdefault(int(i), set()).add(k)
  assert any(len(v) > 1 for v in used.values())  # captions vary from step to step
  resumed = [b for _, b in zip(range(3), pipeline.train_dataset(src, tok, start_step=9, **kw))]
  for a, b in zip(stream[9:], resumed):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
  other_seed = [b for _, b in zip(range(12), pipeline.train_dataset(src, tok, **{**kw, "seed": 8}))]
  assert any(not np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(stream, other_seed))

  bad = tmp_path / "bad"
  write(str(bad / "a.jpg"), image_bytes(1))
  write(str(bad / "pairs.json"), json.dumps([{"filename": "a.jpg", "caption": "x"},
                                             {"filename": "a.jpg", "caption": "y", "split": "test"}]))
  with pytest.raises(ValueError, match=r"pairs.json\[1\]: image 'a.jpg' is in split 'test' here but in 'train'"):
    read_all(cfg("pairs", bad, tmp_path / "d2"), "train")
  write(str(bad / "pairs.json"), json.dumps([{"filename": "a.jpg", "captions": []}]))
  with pytest.raises(ValueError, match=r"pairs.json\[0\]: 'captions' must be a non-empty list"):
    read_all(cfg("pairs", bad, tmp_path / "d3"), "train")


def karpathy_fixture(m, name):
  """COCO's or Flickr30k's images and Karpathy's split file, in their own layout."""
  js, folder = {"coco": ("dataset_coco.json", None), "flickr30k": ("dataset_flickr30k.json", "flickr30k-images")}[name]
  images = []
  for i, split in enumerate(["train", "restval", "val", "test", "test"]):
    sub = folder or ("train2014" if split in ("train", "restval") else "val2014")
    fname = f"{name}_{i:06d}.jpg"
    write(str(m / sub / fname), image_bytes(1000 + i))
    entry = {"filename": fname, "split": split, "imgid": i,
             "sentences": [{"raw": f"{name} image {i} says {j}.", "tokens": [], "imgid": i} for j in range(5)]}
    if folder is None:
      entry["filepath"] = sub
    images.append(entry)
  write(str(m / js), json.dumps({"images": images, "dataset": name}))


def test_coco_and_flickr30k_karpathy_splits(tmp_path):
  """Karpathy's split files in their own layout: restval joins train, five captions per image in order, COCO's
  filepath folders and Flickr's flickr30k-images/."""
  for name, folder in (("coco", None), ("flickr30k", "flickr30k-images")):
    m = tmp_path / name
    karpathy_fixture(m, name)
    c = cfg(name, m, tmp_path / "d")
    train, test = read_all(c, "train"), read_all(c, "test")
    assert sorted(train) == [f"{folder or 'train2014'}/{name}_00000{i}.jpg" for i in (0, 1)]
    key = f"{folder or 'val2014'}/{name}_000004.jpg"
    assert len(test) == 2 and test[key][0] == [f"{name} image 4 says {j}." for j in range(5)]
    assert test[key][1] == (m / key).read_bytes()
  with pytest.raises(FileNotFoundError, match=r"dataset_coco.json is missing(.|\n)*train2014"):
    read_all(cfg("coco", tmp_path / "flickr30k", tmp_path / "d3"), "test")


def pairs_fixture(m):
  """40 PNGs and pairs.json: 32 train images, 8 test images, some with a second caption (11 test captions)."""
  words = ["red", "green", "blue", "circle", "square", "left", "right", "small", "large"]
  entries = []
  for i in range(40):
    name = f"img{i}.png"
    write(str(m / name), image_bytes(400 + i, "PNG", (24, 40)))
    cap = " ".join(np.random.default_rng(i).choice(words, 8))
    split = "test" if i >= 32 else "train"
    entries.append({"filename": name, "caption": f"{cap} number {i}", "split": split})
    if i % 3 == 0:  # some images have a second caption: 8 test images, 11 test captions
      entries.append({"filename": name, "caption": f"number {i}, {cap}", "split": split})
  write(str(m / "pairs.json"), json.dumps(entries))
  return entries


def test_train_and_eval_on_pairs_from_scratch(tmp_path, tfds_dir):
  m = tmp_path / "m"
  entries = pairs_fixture(m)
  w = tmp_path / "w"
  base = ["--config", "configs/demo.py:test", "--workdir", str(w)]
  data = ["--config.data.name=pairs", f"--config.data.manual_dir={m}", f"--config.data.data_dir={tmp_path / 'd'}",
          "--config.data.num_test=8"]
  run_py(["train.py", *base, *data])
  vocab = json.load(open(w / "tokenizer" / "tokenizer.json"))["model"]["vocab"]
  assert "circle" in vocab and "number" in vocab  # fitted on this dataset's training captions

  # The data overrides forgotten: eval and a resume read what the workdir recorded, and say so.
  build = json.load(open(w / "data.json"))["data"]["build"]  # the build these files gave, named once
  assert build.startswith("default_") and (tmp_path / "d" / "hnclip_pairs" / build).is_dir()
  ev = run_py(["eval.py", *base])
  assert (f"data: pairs from {m} (build {build}) (recorded in {w}/data.json; the config file's manual_dir='', "
          "name='synthetic'") in ev.stdout
  res = json.load(open(w / "eval_results.json"))
  assert res["dataset"] == "pairs" and (res["num_images"], res["num_captions"]) == (8, 11)
  assert "8 images, 11 captions" in ev.stdout
  # A resume reads the recorded build: with the folder edited since (the edit is not read), and with no folder at
  # all (a replacement VM); with neither the build nor the files it was made from, it is refused in one line.
  caption = entries[0]["caption"]
  entries[0]["caption"] = "an edit made after the run started"
  write(str(m / "pairs.json"), json.dumps(entries))
  again = run_py(["train.py", *base, "--config.total_steps=8"])
  assert f"data: pairs from {m} (build {build}) (recorded in {w}/data.json" in again.stdout
  assert "resumed from" in again.stdout
  assert f"reusing the hnclip_pairs build in {tmp_path / 'd'}/hnclip_pairs/{build}/" in again.stdout, again.stdout
  assert f"the files in {m} have changed since, and are not read" in again.stdout
  os.rename(m, tmp_path / "m-moved")
  gone = run_py(["train.py", *base, "--config.total_steps=10"])
  assert "resumed from" in gone.stdout and "its files are not on this machine" in gone.stdout
  os.rename(tmp_path / "m-moved", m)
  os.rename(tmp_path / "d" / "hnclip_pairs" / build, tmp_path / f"{build}-moved")
  refused = run_py(["train.py", *base, "--config.total_steps=12"], check=False)
  assert_error_exit(refused, f"config.data.build={build}: there is no such build in {tmp_path / 'd'}/hnclip_pairs",
                    f"the files in {m} have changed since it was made")
  os.rename(tmp_path / f"{build}-moved", tmp_path / "d" / "hnclip_pairs" / build)
  entries[0]["caption"] = caption
  # Contradicting the recorded data on resume is refused; for eval it is another evaluation, kept beside the first.
  write(str(m / "pairs.json"), json.dumps(entries))
  refused = run_py(["train.py", *base, "--config.data.name=synthetic"], check=False)
  assert_error_exit(refused, "config.data.name='synthetic' (the workdir's: 'pairs')")
  other = run_py(["eval.py", *base, "--config.data.name=synthetic", f"--config.data.data_dir={tfds_dir}"])
  assert f"not the data it was trained on, pairs from {m} (build {build})" in other.stdout
  assert json.load(open(w / "eval_results.json"))["dataset"] == "synthetic"
  history = [json.loads(line) for line in open(w / "eval_history.jsonl")]
  assert [(h["dataset"], h["num_images"], h["num_captions"]) for h in history] == [("pairs", 8, 11),
                                                                                  ("synthetic", 8, 8)]
  assert history[0]["data"]["manual_dir"] == str(m)


def test_a_changed_pairs_folder_is_rebuilt(tmp_path, capsys):
  m = tmp_path / "m"
  rows = []
  for i in range(6):
    write(str(m / f"img{i}.jpg"), image_bytes(700 + i))
    rows.append(json.dumps({"filename": f"img{i}.jpg", "caption": f"caption {i}"}))
  write(str(m / "pairs.jsonl"), "\n".join(rows))
  c = cfg("pairs", m, tmp_path / "d")
  assert len(read_all(c, "train")) == 6
  assert "data: building hnclip_pairs" in capsys.readouterr().out
  builders._reported.clear()  # a new process would say it again
  assert len(read_all(c, "train")) == 6
  assert "data: reusing the hnclip_pairs build" in capsys.readouterr().out
  write(str(m / "pairs.jsonl"), "\n".join(rows[:4]))  # the index file edited
  assert sorted(read_all(c, "train")) == [f"img{i}.jpg" for i in range(4)]
  assert f"the manual folder {m} differs from what the earlier build" in capsys.readouterr().out
  m2 = tmp_path / "m2"  # another folder with the same content is another input too
  for i in range(2):
    write(str(m2 / f"img{i}.jpg"), image_bytes(700 + i))
  write(str(m2 / "pairs.jsonl"), "\n".join(rows[:2]))
  assert sorted(read_all(cfg("pairs", m2, tmp_path / "d"), "train")) == ["img0.jpg", "img1.jpg"]


def test_inspect_tool(tmp_path):
  m = tmp_path / "m"
  for i in range(1, 4):
    write(str(m / "image" / f"{i}.jpg"), image_bytes(500 + i))
    write(str(m / "caption" / f"{i}.txt"), " ".join(["word"] * (30 * i)))
  proc = run_py(["-m", "hnclip_jax.data.inspect", "urban1k", "--split", "test", f"--manual_dir={m}",
                 f"--data_dir={tmp_path / 'd'}"])
  out = proc.stdout
  assert "3 examples" in out and "words: mean 60.0" in out
  assert "truncated at 77 tokens: 33.3%" in out and "truncated at 248 tokens: 0.0%" in out
  # CLIP's BPE file and a directory holding the same tokenizer (no config.json: its files name the family) count
  # alike; a directory no family recognises is refused in one line.
  import openai_bpe
  from hnclip_jax.data.clip_tokenizer import CLIPTokenizer
  CLIPTokenizer.from_openai_bpe(openai_bpe.path(), 77).save(str(tmp_path / "clip"))
  outs = [run_py(["-m", "hnclip_jax.data.inspect", "urban1k", "--split", "test", f"--manual_dir={m}",
                  f"--data_dir={tmp_path / 'd'}", f"--vocab={v}"]).stdout for v in (openai_bpe.path(), tmp_path / "clip")]
  counts = [[line for line in o.splitlines() if "tokens (" in line or "truncated" in line] for o in outs]
  assert counts[0] == counts[1] and "tokens (CLIP BPE, with start/end): mean 62.0, median 62, min 32, max 92" in counts[0][0], counts
  os.makedirs(tmp_path / "neither")
  refused = run_py(["-m", "hnclip_jax.data.inspect", "urban1k", "--split", "test", f"--manual_dir={m}",
                    f"--data_dir={tmp_path / 'd'}", f"--vocab={tmp_path / 'neither'}"], check=False)
  assert_error_exit(refused, "--vocab=", "a tokenizer directory a model family recognises (clip, siglip")


def test_every_builder_prepares_into_a_bucket_and_a_host_without_the_files_reads_it(gcs, tmp_path, monkeypatch,
                                                                                     capsys):
  """config.data.data_dir=gs://…: each builder's build goes into the bucket (made locally, then uploaded) and reads
  back as the same examples as a local build; a host with none of the downloaded files and an empty cache (a pod's
  other host, a replacement VM) reads it by the name the first one printed (config.data.build); a name with no
  build behind it is refused in one line that lists the builds there."""
  for k, v in gcs.env.items():
    monkeypatch.setenv(k, v)
  fixtures = {"docci": lambda m: docci_fixture(m), "dci": lambda m: dci_fixture(m),
              "long_dci": lambda m: (dci_fixture(m), write(str(m / "dci_long.csv"), "filepath\ttitle\n" + "".join(
                  f"densely_captioned_images/photos/sa_{1000 + i}.jpg\tLong caption {i}\n" for i in range(6)))),
              "urban1k": lambda m: [(write(str(m / "image" / f"{i}.jpg"), image_bytes(200 + i)),
                                     write(str(m / "caption" / f"{i}.txt"), f"Street {i}.\n")) for i in range(1, 4)],
              "pairs": lambda m: [write(str(m / f"p{i}.png"), image_bytes(i, "PNG")) for i in range(3)] and write(
                  str(m / "pairs.jsonl"), "\n".join(json.dumps({"filename": f"p{i}.png", "caption": f"pair {i}"})
                                                   for i in range(3))),
              "coco": lambda m: karpathy_fixture(m, "coco"), "flickr30k": lambda m: karpathy_fixture(m, "flickr30k")}
  for name, make in fixtures.items():
    m = tmp_path / name
    make(m)
    split = "train" if name in ("pairs", "coco", "flickr30k") else "test"
    local = read_all(cfg(name, m, tmp_path / "local"), split)
    capsys.readouterr()
    monkeypatch.setenv("HNCLIP_DATA_CACHE", str(tmp_path / f"cache-{name}"))
    assert read_all(cfg(name, m, f"gs://bkt/data/{name}"), split) == local
    built = re.search(r"data: building \S+ into gs://bkt/data/\S+/(\w+)/[\d.]+: no build for these inputs yet; "
                      r"config.data.build=(\w+) reads it", capsys.readouterr().out)
    assert built and built.group(1) == built.group(2), name
    assert [o for o in gcs.objects("bkt", f"data/{name}/") if o.endswith("dataset_info.json")]
    builders._reported.clear()
    monkeypatch.setenv("HNCLIP_DATA_CACHE", str(tmp_path / f"empty-{name}"))
    elsewhere = cfg(name, tmp_path / "not-here", f"gs://bkt/data/{name}")
    elsewhere.build = built.group(1)
    assert read_all(elsewhere, split) == local
    assert "its files are not on this machine" in capsys.readouterr().out
  elsewhere.build = "default_0000000000000000"
  with pytest.raises(FileNotFoundError, match=r"config.data.build=default_0+: there is no such build in "
                                              r"gs://bkt/data/flickr30k/hnclip_flickr30k \(builds there: default_\w+\), and "
                                              r"it cannot be made: config.data.manual_dir=\S+not-here'? is not on"):
    builders.data_source(elsewhere, "train")
  assert "data: building" not in capsys.readouterr().out  # no line saying it builds what it refuses to


def test_processes_whose_copies_of_the_files_differ_read_the_build_process_0_names(tmp_path):
  """Two processes (two hosts) whose copies of the downloaded files differ in place and times (the build name's
  fingerprint would differ on each) read the one build process 0 made and named: one build in data_dir, the name
  data.json records."""
  from hnclip_jax.data import manual
  homes = [tmp_path / f"host{i}" for i in range(2)]
  for home in homes:
    pairs_fixture(home / "pairs")
  workdir, data_dir = tmp_path / "w", tmp_path / "d"
  run_processes(["train.py", "--config", "configs/demo.py:test", "--workdir", str(workdir), "--config.total_steps=2",
                 "--config.data.name=pairs", "--config.data.manual_dir=~/pairs", f"--config.data.data_dir={data_dir}",
                 "--config.data.num_test=8", "--config.batch_size=8"],
                num_processes=2, devices_per_process=2, env_of={i: {"HOME": str(h)} for i, h in enumerate(homes)})
  names = [f"default_{manual.input_fingerprint(str(h / 'pairs'))}" for h in homes]
  assert names[0] != names[1]
  assert [d for d in os.listdir(data_dir / "hnclip_pairs") if not d.startswith(".")] == [names[0]]
  assert json.load(open(workdir / "data.json"))["data"]["build"] == names[0]
