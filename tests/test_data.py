"""Synthetic data, its TFDS builder (array_record, no TensorFlow), the tokenizer and the grain pipeline."""
import io
import os

import ml_collections
import numpy as np
import pytest
from PIL import Image

from hnclip_jax.data import builders, pipeline, synthetic
from hnclip_jax.data.saved_tokenizer import load_tokenizer
from hnclip_jax.data.tokenizer import WordTokenizer
from conftest import ROOT, run_py


def test_generator_is_deterministic_and_described():
  a = list(synthetic.generate(24, 4, 32, seed=3))
  b = list(synthetic.generate(24, 4, 32, seed=3))
  c = list(synthetic.generate(24, 4, 32, seed=4))
  assert [x[1] for x in a] == [x[1] for x in b] and [x[2] for x in a] == [x[2] for x in b]
  assert [x[2] for x in a] != [x[2] for x in c]
  for _, png, cap, _, _ in a:
    assert len(cap.split()) >= 40
    img = np.asarray(Image.open(io.BytesIO(png)))
    assert img.shape == (32, 32, 3)
    # Every object is named with its colour and shape; the image shows each colour.
    sentences = [s for s in cap.split(". ") if s.startswith("In the ")]
    assert len(sentences) in (3, 4)
    assert len(set(cap for _, _, cap, *_ in a)) == len(a)  # no exact duplicates


def test_short_captions_are_alt_text_over_the_dense_vocabulary():
  """captions="short": the same scenes (same images), a few words naming one or two of the scene's objects, in
  varied phrasings; a word tokenizer fitted on them knows every word of the dense captions."""
  short = list(synthetic.generate(400, 1, 32, seed=5, captions="short"))
  dense = list(synthetic.generate(400, 1, 32, seed=5))
  assert [x[1] for x in short] == [x[1] for x in dense]  # the captions change, not the scenes
  words = [len(cap.replace(",", " ").split()) for _, _, cap, *_ in short]
  assert max(words) <= 14 and np.mean(words) < 8, (max(words), np.mean(words))
  assert len({cap for _, _, cap, *_ in short}) > 300 and len(set(x[3] for x in short)) == 400
  rng = np.random.default_rng(0)
  for _ in range(50):
    scene = tuple(synthetic._random_obj(rng, c) for c in rng.choice(9, 3, replace=False))
    cap = synthetic.short_caption(scene, rng)
    named = [(c, s) for c in synthetic.COLORS for s in synthetic.SHAPES if f"{c} {s}" in cap]
    assert 1 <= len(named) <= 2 and all(any((o.color, o.shape) == n for o in scene) for n in named), cap
  tok = WordTokenizer.fit([cap for _, _, cap, *_ in short], context_length=80)
  dense_words = {w.strip(".:,;").lower() for _, _, cap, *_ in dense for w in cap.split()}
  unknown = [w for w in dense_words if tok([w])[0, 1] == 1]  # id 1 is <unk>
  assert not unknown, unknown
  with pytest.raises(ValueError, match="captions='long'"):
    next(synthetic.generate(4, 1, 32, seed=0, captions="long"))
  bad = ml_collections.ConfigDict(dict(name="docci", manual_dir="/x", on_bad_example="error", captions="short"))
  with pytest.raises(ValueError, match="config.data.captions='short' applies to the built-in synthetic data only"):
    builders.check_data_config(bad)


def test_detailed_captions_are_a_second_dense_domain():
  """captions="detailed" (the three-stage regime's intermediate domain): the same scenes, every object named with
  its size, colour, shape and cell in another grammar than the dense one (large objects first), each segment's
  sentence a span of the caption, and no word a tokenizer fitted on the short captions does not know."""
  det = list(synthetic.generate(300, 1, 32, seed=7, captions="detailed"))
  dense = list(synthetic.generate(300, 1, 32, seed=7))
  short = list(synthetic.generate(300, 1, 32, seed=7, captions="short"))
  assert [x[1] for x in det] == [x[1] for x in dense]
  for (_, _, cap, _, segs), (_, _, dcap, *_) in zip(det, dense):
    assert cap != dcap and all(seg["sentence"] in cap for seg in segs), cap
    named = [cap.index(seg["sentence"]) for seg in segs]
    large_first = sorted(range(len(segs)), key=lambda i: ("a small" in segs[i]["sentence"], i))
    assert sorted(named) == [named[i] for i in large_first], cap
    # the dense caption says the same about every object
    for seg in segs:
      size, color, shape, _, _, *cell = seg["sentence"].split()[1:]
      assert f"In the {' '.join(cell)} there is a {size} {color} {shape}." in dcap
  tok = WordTokenizer.fit([cap for _, _, cap, *_ in short], context_length=80)
  ids = tok([cap for _, _, cap, *_ in det])
  assert not (ids == 1).any()  # id 1 is <unk>
  assert (ids != 0).sum(1).max() < 68  # fits the stretched context of configs/three_stage.py


def _word_diff(a, b):
  wa, wb = a.split(), b.split()
  return sum(x != y for x, y in zip(wa, wb)) + abs(len(wa) - len(wb))


def test_near_duplicate_groups():
  ex = list(synthetic.generate(200, 4, 32, seed=0))
  groups = {}
  for _, _, cap, g, _ in ex:
    groups.setdefault(g, []).append(cap)
  within = [_word_diff(a, b) for caps in groups.values() for i, a in enumerate(caps) for b in caps[i + 1:]]
  across = [_word_diff(groups[g][0], groups[g + 1][0]) for g in range(len(groups) - 1)]
  assert sum(len(c) == 4 for c in groups.values()) >= 0.9 * len(groups)
  assert np.median(within) <= 4  # one or two attributes apart (a move rewrites up to 4 words)
  assert np.median(across) > 2 * np.median(within)


DATA = ml_collections.ConfigDict(dict(name="synthetic", data_dir="", train_split="train", eval_split="test",
                                      num_train=48, num_test=20, group_size=4, image_size=32, seed=7,
                                      manual_dir="", on_bad_example="error"))


@pytest.fixture(scope="module")
def data_cfg(tfds_dir):
  cfg = ml_collections.ConfigDict(DATA.to_dict())
  cfg.data_dir = tfds_dir
  return cfg


def test_builder_round_trip(data_cfg):
  train = builders.data_source(data_cfg, "train")
  test = builders.data_source(data_cfg, "test", decode_images=False)
  assert len(train) == 48 and len(test) == 20
  want = {i: (png, cap) for i, png, cap, *_ in synthetic.generate(48, 4, 32, seed=7)}
  for k in range(len(train)):
    ex = train[k]
    png, cap = want[int(ex["image_id"])]
    assert ex["caption"].decode() == cap
    np.testing.assert_array_equal(ex["image"], np.asarray(Image.open(io.BytesIO(png))))
  assert sorted(int(train[k]["image_id"]) for k in range(48)) == list(range(48))
  train_caps = {train[k]["caption"] for k in range(48)}
  assert not train_caps & {test[k]["caption"] for k in range(20)}  # splits share no scene
  assert isinstance(test[0]["image"], bytes)  # SkipDecoding keeps the PNG


def test_unknown_dataset_and_split_are_named(data_cfg):
  bad = ml_collections.ConfigDict(data_cfg.to_dict())
  bad.name = "cifar"
  with pytest.raises(ValueError, match="config.data.name='cifar'"):
    builders.data_source(bad, "train")
  with pytest.raises(ValueError, match="split 'validation' does not exist"):
    builders.data_source(data_cfg, "validation")


def test_no_tensorflow_is_imported(tmp_path):
  """A tripwire `tensorflow` package on the path records any import of it (and then fails it, as if absent):
  building a dataset, reading it and importing the training code must not touch it."""
  fake = tmp_path / "fake" / "tensorflow"
  fake.mkdir(parents=True)
  marker = tmp_path / "tensorflow_was_imported"
  (fake / "__init__.py").write_text(f"import traceback\nopen({str(marker)!r}, 'w').write(''.join("
                                    "traceback.format_stack()))\nraise ImportError('tripwire')\n")
  code = ("import ml_collections; from hnclip_jax.data import builders, pipeline; import train; "
          "from hnclip_jax import checkpoint, experiment, metrics, train_step;"
          f"cfg = ml_collections.ConfigDict({DATA.to_dict()!r}); cfg.data_dir = {str(tmp_path / 'tfds')!r};"
          "s = builders.data_source(cfg, 'train'); s[0]; print('read', len(s))")
  out = run_py(["-c", code], env_extra={"PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{ROOT}"})
  assert "read 48" in out.stdout  # built from scratch and read
  assert not marker.exists(), marker.read_text()


def test_tokenizer_packs_truncates_and_round_trips(tmp_path):
  tok = WordTokenizer.fit(["A red circle.", "a blue square, small"], context_length=6)
  ids = tok(["A red circle.", "zebra", "a red circle a blue square small"])
  assert ids.dtype == np.int32 and ids.shape == (3, 6)
  assert (ids[:, 0] == tok.sot_id).all()
  row = ids[0].tolist()
  assert row[:6] == [tok.sot_id] + [tok._tok.token_to_id(w) for w in ["a", "red", "circle", "."]] + [tok.eot_id]
  assert ids[1].tolist() == [tok.sot_id, 1, tok.eot_id, 0, 0, 0]  # unknown word -> 1, zero padding
  assert ids[2, -1] == tok.eot_id and tok.last_truncated == 1  # truncation keeps the end token last
  tok.save(str(tmp_path))
  again = load_tokenizer(str(tmp_path))
  np.testing.assert_array_equal(again(["a blue square"]), tok(["a blue square"]))
  with pytest.raises(TypeError):
    tok("a single string")


@pytest.fixture(scope="module")
def tokenizer(data_cfg):
  return WordTokenizer.fit(pipeline.read_captions(builders.data_source(data_cfg, "train", False)), 80)


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_train_pipeline_is_deterministic_and_resumable(data_cfg, tokenizer):
  src = builders.data_source(data_cfg, "train")
  kw = dict(image_size=32, global_batch=16, seed=1)
  full = _take(iter(pipeline.train_dataset(src, tokenizer, **kw)), 7)
  resumed = _take(iter(pipeline.train_dataset(src, tokenizer, start_step=4, **kw)), 3)
  for a, b in zip(full[4:], resumed):
    np.testing.assert_array_equal(a["index"], b["index"])
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["image"], b["image"])
  b0 = full[0]
  assert b0["image"].shape == (16, 32, 32, 3) and b0["image"].dtype == np.float32
  assert b0["tokens"].shape == (16, 80)
  # One epoch = 3 batches of 16 without repeats; the next epoch is reshuffled.
  epoch = np.concatenate([b["index"] for b in full[:3]])
  assert sorted(epoch.tolist()) == list(range(48))
  assert not np.array_equal(epoch, np.concatenate([b["index"] for b in full[3:6]]))
  # CLIP normalisation of a known pixel value.
  np.testing.assert_allclose(pipeline.clip_preprocess(np.full((40, 32, 3), 255, np.uint8), 32)[0, 0],
                             (1 - pipeline.CLIP_MEAN) / pipeline.CLIP_STD, rtol=1e-6)


def test_process_shards_are_disjoint_and_form_the_global_batch(data_cfg, tokenizer):
  src = builders.data_source(data_cfg, "train")
  kw = dict(image_size=32, global_batch=16, seed=0)
  single = [b["index"] for b in _take(iter(pipeline.train_dataset(src, tokenizer, **kw)), 4)]
  parts = [[b["index"] for b in _take(iter(pipeline.train_dataset(src, tokenizer, process_index=p,
                                                                     process_count=2, **kw)), 4)]
           for p in range(2)]
  for k in range(4):
    assert len(parts[0][k]) == 8 and not set(parts[0][k]) & set(parts[1][k])
    # The global batch does not depend on how many processes read it.
    np.testing.assert_array_equal(np.concatenate([parts[0][k], parts[1][k]]), single[k])
  # Any rows of the global batch (sharding.process_rows on a hybrid mesh: strided, or all of them).
  rows = np.array([1, 2, 9, 15])
  strided = [b["index"] for b in _take(iter(pipeline.train_dataset(src, tokenizer, rows=rows, **kw)), 4)]
  for k in range(4):
    np.testing.assert_array_equal(strided[k], single[k][rows])


def test_eval_batches_pad_and_mask(data_cfg, tokenizer):
  src = builders.data_source(data_cfg, "test")
  batches = list(pipeline.eval_image_batches(src, image_size=32, batch_size=8))
  assert [b["mask"].sum() for b in batches] == [8, 8, 4] and batches[0]["image"].shape == (8, 32, 32, 3)
  assert not batches[-1]["image"][4:].any()  # zero padding
  ids = np.concatenate([b["index"][b["mask"]] for b in batches])
  assert sorted(ids.tolist()) == list(range(20))
  # Three processes, each holding 4 positions of a global batch of 12, over 20 pairs: the same number of batches
  # each (2), every pair exactly once; the last process's share of the second batch is all padding.
  shares = [list(pipeline.eval_image_batches(src, image_size=32, batch_size=12, positions=np.arange(4 * p, 4 * p + 4)))
            for p in range(3)]
  assert [len(s) for s in shares] == [2, 2, 2] and [b["mask"].sum() for b in shares[2]] == [4, 0]
  ids = np.concatenate([b["index"][b["mask"]] for s in shares for b in s])
  assert sorted(ids.tolist()) == list(range(20))
  # A strided layout (a process holding positions 1 and 3 of 4, e.g. fsdp across hosts): the rows at those places.
  strided = list(pipeline.eval_image_batches(src, image_size=32, batch_size=4, positions=[1, 3]))
  assert [b["index"].tolist() for b in strided] == [[4 * k + 1, 4 * k + 3] for k in range(5)]
  captions = pipeline.read_captions(src)
  text = [list(pipeline.eval_text_batches(captions[:5], tokenizer, batch_size=8, positions=np.arange(4 * p, 4 * p + 4)))
          for p in range(2)]
  assert [len(t) for t in text] == [1, 1]  # 4 and 1 captions: one padded batch each
  for t in text:
    b = t[0]
    np.testing.assert_array_equal(b["tokens"][b["mask"]], tokenizer([captions[i] for i in b["index"][b["mask"]]]))
    assert not b["tokens"][~b["mask"]].any() and (b["index"][~b["mask"]] == -1).all()