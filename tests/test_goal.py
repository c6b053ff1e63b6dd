"""GOAL (config.framework="goal"): its terms against float64 NumPy, the model's region and sentence pools, the
segment data (exact synthetic boxes, the pairs layout, crops / patch masks / caption spans made on the fly), the
config, and train.py / eval.py end to end."""
import io
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh
from PIL import Image, ImageDraw

from conftest import assert_error_exit, check_resume_is_bit_identical, metrics_rows as _metrics, run_py
from hnclip_jax import config as config_lib, sharding
from hnclip_jax.data import builders, pipeline, synthetic
from hnclip_jax.data.tokenizer import WordTokenizer
from hnclip_jax.models import CLIPConfig, bind, init_params
from hnclip_jax.frameworks import goal as goal_fw, segments as segments_fw
from hnclip_jax.frameworks.goal import GOALTerm
from hnclip_jax.objective import Objective
from test_losses import np_reference
from test_objective import _numeric_grad

MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
FLOATS = ("img", "txt", "seg_img", "seg_txt", "patch_pool", "span_pool")
GOAL = dict(segment_weight=0.5, patch_weight=1.0, text_weight=1.0)


def goal_objective(gamma=0.5, **kw):
  return Objective.of(gamma=gamma, terms=(GOALTerm(**{**GOAL, **kw}),))


def _run(objective, outputs, step=None):
  """The objective on `outputs` on one device, jitted (eager shard_map dispatches op by op: slow)."""
  return jax.jit(lambda o: objective(o, MESH, step))(outputs)


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _outputs(seed, b=7, e=5):
  r = np.random.default_rng(seed)
  out = {k: _unit(r.normal(size=(b, e))).astype(np.float32) for k in FLOATS}
  out["scale"] = np.float32(6.0)
  out["seg_valid"] = np.array([1, 1, 0, 1, 1, 1, 0][:b], bool)  # rows 2 and 6: no segment
  out["patch_valid"] = out["seg_valid"] & (np.arange(b) != 3)  # row 3: its box covers no patch
  out["span_valid"] = out["seg_valid"] & (np.arange(b) != 4)  # row 4: its sentence is not in the caption
  return out


def _lse(x, axis):
  m = x.max(axis, keepdims=True)
  return (m + np.log(np.exp(x - m).sum(axis, keepdims=True))).squeeze(axis)


def np_goal_terms(out, gamma, segment_margin, gbar=None):
  """GOAL's three terms in float64: InfoNCE of crops vs sentences over the rows with a segment (γ·Ḡ of the
  sentences on the negatives when `segment_margin`; `gbar` fixes Ḡ, a constant), and the two masked means of
  (cos − 1)²."""
  f = {k: np.asarray(out[k], np.float64) for k in FLOATS}
  s, v = float(out["scale"]), np.asarray(out["seg_valid"])
  img, txt = f["seg_img"][v], f["seg_txt"][v]
  logits = img @ txt.T
  if segment_margin:
    g = (txt @ txt.T) if gbar is None else gbar[np.ix_(v, v)]
    g = g.copy()
    np.fill_diagonal(g, 0.0)
    logits = logits + gamma * g
  logits = s * logits
  d = np.diag(logits)
  seg = ((_lse(logits, 1) - d).sum() + (_lse(logits, 0) - d).sum()) / (2 * v.sum())
  pv, sv = np.asarray(out["patch_valid"]), np.asarray(out["span_valid"])
  patch = np.mean((np.sum(f["patch_pool"] * f["seg_img"], -1)[pv] - 1) ** 2)
  span = np.mean((np.sum(f["span_pool"] * f["seg_txt"], -1)[sv] - 1) ** 2)
  return seg, patch, span


def np_goal(out, gamma, segment_margin, weights=(0.5, 1.0, 1.0), gbar=None):
  hn = np_reference(out["img"], out["txt"], float(out["scale"]), gamma)[0]
  return hn + sum(w * t for w, t in zip(weights, np_goal_terms(out, gamma, segment_margin, gbar)))


@pytest.mark.parametrize("segment_margin", [False, True])
def test_goal_objective_value_and_gradients_match_numpy(segment_margin):
  """L_HN + 0.5·L_seg + L_patch + L_span with rows lacking a segment / a patch / a sentence span: value, every
  term, the per-example shares and the gradient w.r.t. every output equal float64 NumPy (central differences, Ḡ
  held constant); rows a term leaves out get exactly no gradient from it."""
  out = _outputs(0)
  obj = goal_objective(segment_margin=segment_margin)
  masks = {k: out[k] for k in ("seg_valid", "patch_valid", "span_valid")}
  f = lambda fl: obj({**fl, **masks}, MESH)  # noqa: E731
  floats = {k: out[k] for k in (*FLOATS, "scale")}
  (loss, aux), g = jax.jit(jax.value_and_grad(f, has_aux=True))(floats)
  want_terms = np_goal_terms(out, 0.5, segment_margin)
  np.testing.assert_allclose(loss, np_goal(out, 0.5, segment_margin), rtol=1e-5)
  for name, want in zip(("seg", "patch", "span"), want_terms):
    np.testing.assert_allclose(aux["terms"][name], want, rtol=1e-5)
  np.testing.assert_allclose(np.mean(aux["per_example"]), loss, rtol=1e-5)
  txt64 = out["seg_txt"].astype(np.float64)
  gbar = txt64 @ txt64.T
  _, dv, dt = np_reference(out["img"], out["txt"], float(out["scale"]), 0.5)  # L_HN's analytic gradient
  np.testing.assert_allclose(g["img"], dv, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(g["txt"], dt, rtol=1e-4, atol=1e-6)
  for k in FLOATS[2:]:
    def total(x, k=k):
      return np_goal({**out, k: x}, 0.5, segment_margin, gbar=gbar)
    np.testing.assert_allclose(g[k], _numeric_grad(total, out[k]), rtol=1e-3, atol=1e-6, err_msg=k)
  # No segment: no gradient to its crop, sentence or pools; a box without patches: none to its region pool.
  for k in ("seg_img", "seg_txt", "patch_pool", "span_pool"):
    assert np.all(np.asarray(g[k])[[2, 6]] == 0), k
  assert np.all(np.asarray(g["patch_pool"])[3] == 0) and np.all(np.asarray(g["span_pool"])[4] == 0)
  assert np.abs(np.asarray(g["patch_pool"])[0]).max() > 1e-4
  ds = np_goal({**out, "scale": float(out["scale"]) + 1e-5}, 0.5, segment_margin, gbar=gbar)
  ds -= np_goal({**out, "scale": float(out["scale"]) - 1e-5}, 0.5, segment_margin, gbar=gbar)
  np.testing.assert_allclose(g["scale"], ds / 2e-5, rtol=1e-3)


def test_goal_gamma_zero_is_goal_with_plain_infonce_and_margin_changes_the_loss():
  out = _outputs(1)
  masks = {k: out[k] for k in ("seg_valid", "patch_valid", "span_valid")}
  loss0 = _run(goal_objective(gamma=0.0), out)[0]
  np.testing.assert_allclose(loss0, np_goal(out, 0.0, False), rtol=1e-5)
  hn0 = np_reference(out["img"], out["txt"], 6.0, 0.0)[0]
  assert abs(float(loss0) - hn0) > 1e-2  # the GOAL terms are really there
  plain = _run(Objective.of(gamma=0.0), {k: out[k] for k in ("img", "txt", "scale")})[0]
  np.testing.assert_allclose(plain, hn0, rtol=1e-6)
  a = _run(goal_objective(), {**out, **masks})[1]["terms"]["seg"]
  b = _run(goal_objective(segment_margin=True), {**out, **masks})[1]["terms"]["seg"]
  assert abs(float(a) - float(b)) > 1e-3  # segment_margin puts γ·Ḡ into the segment term
  assert goal_objective().term_names == ("hn", "seg", "patch", "span")
  assert goal_objective().input_keys[2:] == pipeline_keys()


def pipeline_keys():
  from hnclip_jax.frameworks.goal import SEGMENT_KEYS
  return SEGMENT_KEYS


# ---- The model's pools -----------------------------------------------------------------------------------------

TINY = CLIPConfig(embed_dim=8, image_size=16, patch_size=4, vision_width=16, vision_layers=2, vision_heads=2,
                  vision_mlp_dim=32, text_context=10, vocab_size=40, text_width=16, text_layers=2, text_heads=2,
                  text_mlp_dim=32, eot_token_id=3)


def _np_ln(x, p, eps=1e-5):
  x = x.astype(np.float64)
  mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * np.asarray(p["scale"], np.float64) + np.asarray(p["bias"], np.float64)


def test_model_segment_outputs_match_numpy():
  """patch_pool = normalise(LN_post(mean of the last block's patch outputs under the box) @ visual projection),
  span_pool likewise over the sentence's caption tokens with LN_final and the text projection (captions of
  unequal length); seg_img / seg_txt are the crop's and the sentence's ordinary embeddings; the validity flags."""
  graphdef, params = init_params(TINY, 0)
  model = bind(graphdef, params)
  r = np.random.default_rng(3)
  b, p_n = 4, 16
  images = r.normal(size=(b, 16, 16, 3)).astype(np.float32)
  lengths = np.array([4, 7, 10, 5])
  tokens = np.where(np.arange(10)[None] < lengths[:, None] - 1, r.integers(4, 40, (b, 10)), 0)
  tokens[:, 0], tokens[np.arange(b), lengths - 1] = 2, 3
  patches = (r.random((b, p_n)) < 0.3).astype(np.float32)
  patches[2] = 0.0
  span = np.zeros((b, 10), np.float32)
  span[0, 1:3], span[1, 2:6], span[3, 1:4] = 1, 1, 1
  seg = {"seg_image": r.normal(size=(b, 16, 16, 3)).astype(np.float32),
         "seg_tokens": np.roll(tokens, 1, axis=0).astype(np.int32), "seg_patches": patches, "seg_span": span,
         "seg_valid": np.array([True, True, True, False])}
  # Through the objective's forward pass, as training runs it: the model's outputs plus GOALTerm.outputs.
  out = goal_objective().forward(model, {"image": jnp.asarray(images), "tokens": jnp.asarray(tokens.astype(np.int32)),
                                         **seg})
  _, _, img_hidden = model._image_tower(jnp.asarray(images))
  _, _, txt_hidden = model._text_tower(jnp.asarray(tokens.astype(np.int32)))
  ih, th = np.asarray(img_hidden, np.float64), np.asarray(txt_hidden, np.float64)
  assert ih.shape == (b, 1 + p_n, 16) and th.shape == (b, 10, 16)
  pp = {k: jax.tree.map(np.asarray, v) for k, v in params.items()}
  for i in range(b):
    if patches[i].sum():
      pooled = ih[i, 1:][patches[i] > 0].mean(0)
      want = _unit(_np_ln(pooled, pp["ln_post"]) @ pp["visual_projection"])
      np.testing.assert_allclose(out["patch_pool"][i], want, rtol=1e-4, atol=1e-5)
    if span[i].sum():
      pooled = th[i][span[i] > 0].mean(0)
      want = _unit(_np_ln(pooled, pp["ln_final"]) @ pp["text_projection"])
      np.testing.assert_allclose(out["span_pool"][i], want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out["seg_img"], model.encode_image(jnp.asarray(seg["seg_image"])), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["seg_txt"], model.encode_text(jnp.asarray(seg["seg_tokens"])), rtol=1e-5, atol=1e-6)
  assert out["seg_valid"].tolist() == [True, True, True, False]
  assert out["patch_valid"].tolist() == [True, True, False, False]
  assert out["span_valid"].tolist() == [True, True, False, False]
  # The pooled features really are the last block's outputs: the image's CLS embedding is LN_post(hidden[0]) @ proj.
  np.testing.assert_allclose(out["img"][0], _unit(_np_ln(ih[0, 0], pp["ln_post"]) @ pp["visual_projection"]),
                             rtol=1e-4, atol=1e-5)


# ---- Data ------------------------------------------------------------------------------------------------------

def test_synthetic_segments_are_exact():
  """Each object's segment: the caption's own sentence about it, score 1, and a box that holds every pixel of the
  object's colour near it (checked on objects whose colour is unique in the scene) and is no bigger than the
  shape's extent."""
  checked = 0
  for _, png, cap, _, segments in synthetic.generate(40, 4, 64, seed=11):
    img = np.asarray(Image.open(io.BytesIO(png)), np.float64)
    sentences = [s["sentence"] for s in segments]
    assert len(segments) in (3, 4) and all(s in cap for s in sentences) and all(s["score"] == 1.0 for s in segments)
    colors = [s.split()[-2] for s in sentences]
    for seg, color in zip(segments, colors):
      x0, y0, x1, y1 = seg["box"]
      assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64
      if colors.count(color) > 1:
        continue
      near = np.linalg.norm(img - np.asarray(synthetic.COLORS[color]), axis=-1) < 30
      ys, xs = np.nonzero(near)
      assert len(xs) > 4, seg
      # Every pixel of the colour lies in the box (1.5 px for anti-aliasing) and the box is tight around them.
      assert xs.min() >= x0 - 1.5 and xs.max() <= x1 + 0.5 and ys.min() >= y0 - 1.5 and ys.max() <= y1 + 0.5, seg
      assert xs.max() - xs.min() + 1 >= 0.6 * (x1 - x0) and ys.max() - ys.min() + 1 >= 0.6 * (y1 - y0), seg
      checked += 1
  assert checked > 60


def test_box_to_patches_follows_the_image_transform():
  """The patch mask of a box equals the patches its pixels land on when a mask image of the box goes through the
  same resize + centre crop as the image (landscape, portrait and square originals)."""
  r = np.random.default_rng(4)
  tested = 0
  for w, h in ((90, 50), (40, 70), (32, 32)):
    for _ in range(80):
      x0, y0 = r.uniform(0, w - 4), r.uniform(0, h - 4)
      box = (x0, y0, r.uniform(x0 + 3, w), r.uniform(y0 + 3, h))
      scale = 32 / min(w, h)
      new_w, new_h = int(round(w * scale)) if w > h else 32, int(round(h * scale)) if h > w else 32
      edges = np.array([box[0] * new_w / w - (new_w - 32) // 2, box[2] * new_w / w - (new_w - 32) // 2,
                        box[1] * new_h / h - (new_h - 32) // 2, box[3] * new_h / h - (new_h - 32) // 2])
      if np.any(np.abs(edges - np.round(edges / 8) * 8) < 1.5):  # an edge on a patch border: bicubic blurs it
        continue
      mask = Image.new("L", (w, h), 0)
      ImageDraw.Draw(mask).rectangle([box[0], box[1], box[2] - 1e-6, box[3] - 1e-6], fill=255)
      px = pipeline.resize_center_crop(mask, 32)[..., 0].astype(np.float64)
      want = (px.reshape(4, 8, 4, 8).max(axis=(1, 3)) > 127).astype(np.float32).reshape(-1)
      np.testing.assert_array_equal(goal_fw.box_to_patches(box, w, h, 32, 8), want, err_msg=str((w, h, box)))
      tested += 1
  assert tested >= 25
  # A box the centre crop cuts away covers no patch.
  assert goal_fw.box_to_patches((0, 0, 10, 50), 100, 50, 32, 8).sum() == 0


def test_segment_inputs_and_choice():
  """The chosen segment (best score; ties at random per step, deterministic) gives the crop of its box, the
  sentence's tokens, and a caption span whose tokens are the sentence's; a sentence not in the caption gives an
  empty span; an example without segments is invalid."""
  img = np.zeros((40, 60, 3), np.uint8)
  img[10:30, 5:25] = (200, 0, 0)
  img[5:35, 35:55] = (0, 0, 200)
  cap = "A plain picture. There is a red square on the left. A blue square is on the right side."
  ex = {"image": img, "caption": cap.encode(),
        "segments": {"box": [np.array([5, 10, 25, 30], np.float32), np.array([35, 5, 55, 35], np.float32)],
                     "sentence": [b"There is a red square on the left.", b"A blue square is on the right side."],
                     "score": [np.float32(0.9), np.float32(0.4)]}}
  tok = WordTokenizer.fit([cap, "nothing here"], context_length=30)
  got = goal_fw.segment_inputs(ex, cap, tok, 16, 4, seed=0, step=0, index=0)
  assert got["seg_valid"]
  np.testing.assert_array_equal(got["seg_tokens"], tok(["There is a red square on the left."])[0])
  span = np.flatnonzero(got["seg_span"])
  words = tok(["There is a red square on the left."])[0]
  np.testing.assert_array_equal(tok([cap])[0][span], words[1:1 + len(span)])
  assert len(span) == np.count_nonzero(words) - 2  # every token of the sentence (its 8 words and the full stop)
  crop = got["seg_image"] * pipeline.CLIP_STD + pipeline.CLIP_MEAN
  assert np.allclose(crop.reshape(-1, 3).mean(0), [200 / 255, 0, 0], atol=0.03)  # the red box's pixels only
  # Ties: both scores equal -> the choice varies with the step, and is the same on a rerun.
  tie = dict(ex, segments=dict(ex["segments"], score=[np.float32(1), np.float32(1)]))
  picks = [segments_fw.segment_choice(segments_fw.segments_of(tie), 0, step, 3) for step in range(20)]
  assert set(picks) == {0, 1}
  assert picks == [segments_fw.segment_choice(segments_fw.segments_of(tie), 0, step, 3) for step in range(20)]
  other = goal_fw.segment_inputs(ex, "nothing here", tok, 16, 4, seed=0, step=0, index=0)
  assert other["seg_valid"] and other["seg_span"].sum() == 0
  none = goal_fw.segment_inputs(dict(ex, segments={"box": [], "sentence": [], "score": []}), cap, tok, 16, 4,
                                 0, 0, 0)
  assert not none["seg_valid"] and none["seg_patches"].sum() == 0 and none["seg_image"].shape == (16, 16, 3)
  assert goal_fw.locate_sentence("One.  Two   words here.", "two words here.") == (6, 23)


def _write_png(path, size=(40, 30), seed=0):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
  Image.fromarray(arr).save(path)


def _pairs_cfg(manual_dir, data_dir, skip=False):
  return ml_collections.ConfigDict(dict(name="pairs", data_dir=str(data_dir), train_split="train", eval_split="test",
                                        manual_dir=str(manual_dir), on_bad_example="skip" if skip else "error"))


def test_pairs_layout_reads_segments_and_refuses_bad_ones(tmp_path):
  m = tmp_path / "m"
  for i in range(3):
    _write_png(str(m / f"i{i}.png"), seed=i)
  seg = {"box": [2, 3, 20, 25], "sentence": "A thing.", "score": 0.5}
  rows = [{"filename": "i0.png", "caption": "A thing. Another.", "segments": [seg, {**seg, "box": [0, 0, 40, 30]}]},
          {"filename": "i1.png", "caption": "x", "segments": []},
          {"filename": "i2.png", "caption": "y"},
          {"filename": "i2.png", "caption": "z", "segments": [{"box": [1, 1, 5, 5], "sentence": "Z."}]}]
  with open(m / "pairs.json", "w") as f:
    json.dump(rows, f)
  c = _pairs_cfg(m, tmp_path / "d")
  src = builders.data_source(c, "train")
  by_id = {src[i]["image_id"].decode(): segments_fw.segments_of(src[i]) for i in range(len(src))}
  assert [s["sentence"] for s in by_id["i0.png"]] == ["A thing.", "A thing."]
  np.testing.assert_allclose(by_id["i0.png"][1]["box"], [0, 0, 40, 30])
  assert by_id["i1.png"] == [] and by_id["i2.png"][0]["score"] == 1.0  # default score
  assert segments_fw.count_segments(c, "train") == (2, 3)

  def build(rows, name, skip=False):
    with open(m / "pairs.json", "w") as f:
      json.dump(rows, f)
    return builders.data_source(_pairs_cfg(m, tmp_path / name, skip), "train")

  outside = [{"filename": "i0.png", "caption": "c", "segments": [{**seg, "box": [50, 40, 60, 45]}]},
             {"filename": "i1.png", "caption": "c", "segments": [seg]}]
  with pytest.raises(ValueError, match=r"pairs.json\[0\] segments\[0\] \(image .*i0.png\): box .* lies outside the "
                                       r"40x30 image.*on_bad_example=skip"):
    build(outside, "d2")
  assert len(build(outside, "d3", skip=True)) == 1
  with pytest.raises(ValueError, match=r"pairs.json\[0\] segments\[0\]: box \[3, 3, 1, 5\] is empty or reversed"):
    build([{"filename": "i0.png", "caption": "c", "segments": [{**seg, "box": [3, 3, 1, 5]}]}], "d4")
  with pytest.raises(ValueError, match=r"pairs.json\[0\] segments\[0\]: 'sentence' must be a non-empty string"):
    build([{"filename": "i0.png", "caption": "c", "segments": [{"box": [1, 1, 4, 4], "sentence": " "}]}], "d5")
  missing = [{"filename": "i0.png", "caption": "c", "segments": [seg]}, {"filename": "i1.png", "caption": "c"}]
  with pytest.raises(ValueError, match=r"pairs.json\[1\]: image 'i1.png' has no 'segments', but other entries do"):
    build(missing, "d6")
  assert len(build(missing, "d7", skip=True)) == 1
  no_segments = [{"filename": "i0.png", "caption": "c"}]
  build(no_segments, "d8")  # no segments anywhere: a dataset for the other frameworks
  assert segments_fw.count_segments(_pairs_cfg(m, tmp_path / "d8"), "train") == (0, 1)


# ---- Config and end to end -------------------------------------------------------------------------------------

def test_goal_config():
  c = config_lib.base_config()
  c.goal.patch_weight = 2.0
  with pytest.raises(ValueError, match="config.goal.patch_weight=2.0 set, but config.framework='longclip'"):
    config_lib.validate(c)
  c.framework = "goal"
  config_lib.validate(c)
  obj = Objective.from_config(c.loss, c)
  goal = obj.term(GOALTerm)
  assert (goal.segment_weight, goal.patch_weight, goal.text_weight) == (0.5, 2.0, 1.0)
  c.goal.text_weight = -1.0
  with pytest.raises(ValueError, match="config.goal.text_weight=-1.0 must be >= 0"):
    config_lib.validate(c)
  c = config_lib.base_config()
  c.framework = "gaol"
  with pytest.raises(ValueError, match=r"config.framework='gaol'; choose one of \['longclip', 'finelip', 'goal', "
                                       r"'structxlip'\]"):
    config_lib.validate(c)
  from configs import longclip_l
  c = longclip_l.get_config("dci,goal")
  config_lib.validate(c)
  assert c.framework == "goal" and c.batch_size == 16 and c.optimizer.lr == 5e-6 and c.loss.token_weight == 0
  assert c.total_steps == 10 * 5445 // 16
  with pytest.raises(ValueError, match="no lora/dora variant"):
    longclip_l.get_config("goal,dora")


CONFIG = "configs/demo.py:test"
GOAL_RUN = ["--config.framework=goal", "--config.total_steps=6", "--config.log_every=2",
            "--config.checkpoint_every=3", "--config.eval_every=3"]


def test_goal_trains_resumes_bit_identically_and_evaluates(tmp_path, tfds_dir):
  """train.py with config.framework=goal on the built-in data (exact segments): every term logged and the loss is
  L_HN + 0.5·L_seg + L_patch + L_span; a resume from the step-3 checkpoint gives bit-identical parameters and
  metrics; eval.py evaluates the checkpoint. GOAL on data without segments stops with a named error."""
  workdir = str(tmp_path / "goal")
  args = ["train.py", "--config", CONFIG, f"--config.data.data_dir={tfds_dir}", *GOAL_RUN]
  proc = run_py([*args, "--workdir", workdir])
  assert "goal segments: 128 of 128 training examples have one" in proc.stdout
  rows = [r for r in _metrics(workdir) if "loss" in r]
  assert [r["step"] for r in rows] == [2, 4, 6]
  for r in rows:
    assert r["loss/patch"] > 0 and r["loss/span"] > 0 and r["loss/seg"] > 0
    assert r["loss"] == pytest.approx(r["loss/hn"] + 0.5 * r["loss/seg"] + r["loss/patch"] + r["loss/span"], rel=1e-5)
  check_resume_is_bit_identical(args, workdir, str(tmp_path / "resumed"), last=6, resume_from=3)
  run_py(["eval.py", "--config", CONFIG, "--workdir", workdir, f"--config.data.data_dir={tfds_dir}"])
  with open(os.path.join(workdir, "eval_results.json")) as f:
    res = json.load(f)
  train_eval = [r for r in _metrics(workdir) if "eval/t2i/R@1" in r][-1]
  assert res["t2i"]["R@1"] == pytest.approx(train_eval["eval/t2i/R@1"])
  # Data without segments: a named error before any step.
  m = tmp_path / "m"
  for i in range(20):
    _write_png(str(m / f"i{i}.png"), seed=i)
  with open(m / "pairs.json", "w") as f:
    json.dump([{"filename": f"i{i}.png", "caption": f"picture {i}"} for i in range(20)], f)
  proc = run_py(["train.py", "--config", CONFIG, "--config.framework=goal", "--config.data.name=pairs",
                 f"--config.data.manual_dir={m}", "--config.data.eval_split=train", f"--config.data.data_dir={tmp_path}/d",
                 "--workdir", str(tmp_path / "nogoal")], check=False)
  assert_error_exit(proc, "config.framework='goal': none of the 20 examples of pairs/train has a segment")
