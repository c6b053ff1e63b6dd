"""StructXLIP (config.framework="structxlip"): its terms and schedules against float64 NumPy, the chunk pool, the
inputs (edge maps, caption filter, chunks, crops), the config, and train.py / eval.py end to end."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import check_resume_is_bit_identical, metrics_rows as _metrics, run_py
from hnclip_jax import config as config_lib, experiment, losses, optim, sharding
from hnclip_jax.data import pipeline
from hnclip_jax.frameworks import structure, structxlip as structxlip_fw
from hnclip_jax.data.tokenizer import WordTokenizer
from hnclip_jax.models import CLIPConfig, bind, init_params
from hnclip_jax.frameworks.structxlip import StructXLIPTerm, pool_chunks
from hnclip_jax.objective import Objective
from test_losses import np_reference
from test_goal import _run
from test_objective import _numeric_grad

MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
SX = dict(structure_weight=0.5, consistency_weight=0.05, local_weight=0.1)


def sx_objective(gamma=0.5, **kw):
  return Objective.of(gamma=gamma, terms=(StructXLIPTerm(**{**SX, **kw}),))


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _lse(x, axis=-1):
  m = x.max(axis, keepdims=True)
  return (m + np.log(np.exp(x - m).sum(axis, keepdims=True))).squeeze(axis)


def np_local(chunks, chunk_valid, crops, crop_valid, s):
  """Per row: mean over its valid chunks of lse over all valid crops − lse over its own valid crops (float64);
  (losses [B], applies [B])."""
  b, k = crop_valid.shape
  flat, fv = crops.reshape(b * k, -1).astype(np.float64), crop_valid.reshape(-1)
  out, applies = np.zeros(len(chunks)), np.zeros(len(chunks), bool)
  for i in range(len(chunks)):
    own = np.zeros(b * k, bool)
    own[i * k:(i + 1) * k] = crop_valid[i]
    cs = [c for c, ok in zip(chunks[i].astype(np.float64), chunk_valid[i]) if ok]
    if not cs or not own.any():
      continue
    vals = [_lse(s * (flat[fv] @ c)) - _lse(s * (flat[own] @ c)) for c in cs]
    out[i], applies[i] = np.mean(vals), True
  return out, applies


def _outputs(seed, b=6, k=2, c=3, e=4):
  r = np.random.default_rng(seed)
  out = {n: _unit(r.normal(size=(b, e))).astype(np.float32) for n in ("img", "txt", "sx_edge_img", "sx_txt")}
  out["sx_crop_img"] = _unit(r.normal(size=(b, k, e))).astype(np.float32)
  out["sx_chunks"] = _unit(r.normal(size=(b, c, e))).astype(np.float32)
  out["sx_crop_valid"] = np.ones((b, k), bool)
  out["sx_crop_valid"][1] = False  # no segments: no positives
  out["sx_crop_valid"][3, 1] = False  # one segment
  out["sx_chunk_valid"] = np.ones((b, c), bool)
  out["sx_chunk_valid"][4] = False  # a caption without chunks
  out["sx_chunk_valid"][0, 2] = False
  out["scale"] = np.float32(5.0)
  return out


def np_sx(out, gamma=0.5, weights=(0.5, 0.05, 0.1), tau=0.07, s_struct=None, gbar=None, margin=False):
  """L_HN + the three StructXLIP terms in float64 (s_struct: the structure term's constant s)."""
  s = float(out["scale"])
  hn = np_reference(out["img"], out["txt"], s, gamma)[0]
  e, t = out["sx_edge_img"].astype(np.float64), out["sx_txt"].astype(np.float64)
  logits = e @ t.T
  if margin:
    g = (t @ t.T if gbar is None else gbar).copy()
    np.fill_diagonal(g, 0)
    logits = logits + gamma * g
  logits = (s if s_struct is None else s_struct) * logits
  d = np.diag(logits)
  struct = ((_lse(logits, 1) - d).sum() + (_lse(logits, 0) - d).sum()) / (2 * len(d))
  consist = np.mean(1 - np.sum(out["img"].astype(np.float64) * e, -1))
  loc, applies = np_local(out["sx_chunks"], out["sx_chunk_valid"], out["sx_crop_img"], out["sx_crop_valid"],
                          min(s / tau, 100.0))
  local = loc.sum() / max(applies.sum(), 1)
  return hn + weights[0] * struct + weights[1] * consist + weights[2] * local, (struct, consist, local)


def test_local_term_matches_numpy():
  """Multi-positive InfoNCE of chunks vs crops: value and gradients (float64 central differences); rows without a
  valid chunk or without a valid crop contribute nothing and get no gradient."""
  o = _outputs(0)
  f = lambda ch, cr: structxlip_fw.multi_positive_rows(ch, jnp.asarray(o["sx_chunk_valid"]), cr,  # noqa: E731
                                                jnp.asarray(o["sx_crop_valid"]), jnp.float32(9.0), 0)
  got, applies = f(jnp.asarray(o["sx_chunks"]), jnp.asarray(o["sx_crop_img"]))
  want, want_applies = np_local(o["sx_chunks"], o["sx_chunk_valid"], o["sx_crop_img"], o["sx_crop_valid"], 9.0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert applies.tolist() == want_applies.tolist() == [True, False, True, True, False, True]
  g_ch, g_cr = jax.grad(lambda a, b: jnp.sum(f(a, b)[0]), argnums=(0, 1))(jnp.asarray(o["sx_chunks"]),
                                                                          jnp.asarray(o["sx_crop_img"]))
  total = lambda ch, cr: np_local(ch, o["sx_chunk_valid"], cr, o["sx_crop_valid"], 9.0)[0].sum()  # noqa: E731
  np.testing.assert_allclose(g_ch, _numeric_grad(lambda x: total(x, o["sx_crop_img"]), o["sx_chunks"]),
                             rtol=1e-3, atol=1e-6)
  np.testing.assert_allclose(g_cr, _numeric_grad(lambda x: total(o["sx_chunks"], x), o["sx_crop_img"]),
                             rtol=1e-3, atol=1e-6)
  assert np.all(np.asarray(g_ch)[[1, 4]] == 0) and np.all(np.asarray(g_ch)[0, 2] == 0)
  assert np.all(np.asarray(g_cr)[1] == 0) and np.all(np.asarray(g_cr)[3, 1] == 0)  # invalid crops: no gradient


@pytest.mark.parametrize("margin", [False, True])
def test_structxlip_objective_matches_numpy(margin):
  """L_HN + 0.5·L_struct + 0.05·L_consist + 0.1·L_local: value, terms, per-example shares and the gradient w.r.t.
  every output; the structure term's s is a constant (s's gradient comes from L_HN and the local term only)."""
  o = _outputs(1)
  obj = sx_objective(structure_margin=margin)
  masks = {k: o[k] for k in ("sx_crop_valid", "sx_chunk_valid")}
  floats = {k: v for k, v in o.items() if k not in masks}
  (loss, aux), g = jax.jit(jax.value_and_grad(lambda fl: obj({**fl, **masks}, MESH), has_aux=True))(floats)
  want, (struct, consist, local) = np_sx(o, margin=margin)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose([aux["terms"][k] for k in ("struct", "consist", "local")], [struct, consist, local],
                             rtol=1e-5)
  np.testing.assert_allclose(np.mean(aux["per_example"]), loss, rtol=1e-5)
  _, dv, dt = np_reference(o["img"], o["txt"], 5.0, 0.5)
  t64 = o["sx_txt"].astype(np.float64)
  fixed = dict(s_struct=5.0, gbar=t64 @ t64.T, margin=margin)
  d_img_consist = -0.05 * o["sx_edge_img"] / len(o["img"])
  np.testing.assert_allclose(g["img"], dv + d_img_consist, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(g["txt"], dt, rtol=1e-4, atol=1e-6)
  for k in ("sx_edge_img", "sx_txt", "sx_crop_img", "sx_chunks"):
    np.testing.assert_allclose(g[k], _numeric_grad(lambda x, k=k: np_sx({**o, k: x}, **fixed)[0], o[k]),
                               rtol=1e-3, atol=1e-6, err_msg=k)
  ds = (np_sx({**o, "scale": 5.0 + 1e-5}, **fixed)[0] - np_sx({**o, "scale": 5.0 - 1e-5}, **fixed)[0]) / 2e-5
  np.testing.assert_allclose(g["scale"], ds, rtol=1e-3)


def test_weight_schedule_matches_the_authors_formula():
  """Per epoch: 1 in epochs 0 and 1, cosine to the floor at epoch 8, the floor after; steps_per_epoch 0: none."""
  obj = sx_objective(steps_per_epoch=10)
  floors = np.array([0.7, 0.5, 0.4])
  for step in (0, 9, 10, 19, 25, 40, 79, 80, 95, 300):
    epoch = step // 10
    if epoch < 1:
      want = np.ones(3)
    else:
      progress = min(max(epoch - 1, 0), 7)
      want = floors + (1 - floors) * 0.5 * (1 + np.cos(np.pi * progress / 7))
    np.testing.assert_allclose(obj.term(StructXLIPTerm).schedule(step), want, rtol=1e-6, err_msg=str(step))
  np.testing.assert_allclose(sx_objective().term(StructXLIPTerm).schedule(500), np.ones(3))
  o = _outputs(2)
  loss_late = _run(obj, o, 200)[0]
  want, terms = np_sx(o)
  hn = np_reference(o["img"], o["txt"], 5.0, 0.5)[0]
  np.testing.assert_allclose(loss_late, hn + np.dot(floors * [0.5, 0.05, 0.1], terms), rtol=1e-5)
  np.testing.assert_allclose(_run(obj, o, 0)[0], want, rtol=1e-5)


def test_gamma_zero_is_structxlip_with_plain_infonce():
  o = _outputs(3)
  np.testing.assert_allclose(_run(sx_objective(gamma=0.0), o)[0], np_sx(o, gamma=0.0)[0], rtol=1e-5)
  assert sx_objective().term_names == ("hn", "struct", "consist", "local")


TINY = CLIPConfig(embed_dim=8, image_size=16, patch_size=4, vision_width=16, vision_layers=1, vision_heads=2,
                  vision_mlp_dim=32, text_context=12, vocab_size=40, text_width=16, text_layers=2, text_heads=2,
                  text_mlp_dim=32, eot_token_id=3)


def _np_ln(x, p, eps=1e-5):
  mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * np.asarray(p["scale"], np.float64) + np.asarray(p["bias"], np.float64)


def test_model_structure_outputs_match_numpy():
  """Chunk pools: softmax of the tokens' norms over each chunk, the weighted last-block outputs, LN_final,
  projection, normalised; an empty chunk is invalid; edge maps and crops are ordinary image embeddings."""
  graphdef, params = init_params(TINY, 0)
  model = bind(graphdef, params)
  r = np.random.default_rng(5)
  b, k, c = 3, 2, 4
  tokens = np.zeros((b, 12), np.int32)
  for i, n in enumerate((5, 9, 12)):
    tokens[i, :n] = np.r_[2, r.integers(4, 40, n - 2), 3]
  chunks = np.zeros((b, c, 12), np.float32)
  chunks[0, 0, 1:3], chunks[0, 1, 2:4], chunks[1, 0, 3:7], chunks[2, 2, 5:10] = 1, 1, 1, 1
  sx = {"sx_edge": r.normal(size=(b, 16, 16, 3)).astype(np.float32),
        "sx_crop_edges": r.normal(size=(b, k, 16, 16, 3)).astype(np.float32),
        "sx_crop_valid": np.array([[True, False], [True, True], [False, False]]), "sx_tokens": tokens,
        "sx_chunks": chunks}
  # Through the objective's forward pass, as training runs it: the model's outputs plus StructXLIPTerm.outputs.
  obj = Objective.of(terms=(StructXLIPTerm(),))
  out = jax.jit(lambda p, x, t, st: obj.forward(bind(graphdef, p), {"image": x, "tokens": t, **st}))(
      params, sx["sx_edge"], tokens, sx)
  hidden = jax.jit(lambda p, t: bind(graphdef, p)._text_tower(t)[2])(params, tokens)
  h = np.asarray(hidden, np.float64)
  pp = jax.tree.map(np.asarray, params)
  for i in range(b):
    for j in range(c):
      m = chunks[i, j] > 0
      if not m.any():
        continue
      w = np.exp(np.linalg.norm(h[i][m], axis=-1))
      pooled = (w[:, None] * h[i][m]).sum(0) / w.sum()
      want = _unit(_np_ln(pooled, pp["ln_final"]) @ pp["text_projection"])
      np.testing.assert_allclose(out["sx_chunks"][i, j], want, rtol=1e-4, atol=1e-5)
  assert out["sx_chunk_valid"].tolist() == [[True, True, False, False], [True, False, False, False],
                                            [False, False, True, False]]
  enc_img = jax.jit(lambda p, x: bind(graphdef, p).encode_image(x))
  np.testing.assert_allclose(out["sx_edge_img"], enc_img(params, sx["sx_edge"]), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["sx_crop_img"][1, 1], enc_img(params, sx["sx_crop_edges"][1, 1:2])[0],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["sx_txt"], jax.jit(lambda p, t: bind(graphdef, p).encode_text(t))(params, tokens),
                             rtol=1e-5, atol=1e-6)
  # No gradient through the pooling weights: d(pool)/d(hidden) is the softmax weights, not their derivative.
  g = jax.jit(jax.grad(lambda hd: jnp.sum(pool_chunks(model, hd, jnp.asarray(chunks))[0, 0])))(hidden)
  assert np.all(np.asarray(g)[0, 3:] == 0) and np.abs(np.asarray(g)[0, 1:3]).max() > 0


# ---- Inputs ----------------------------------------------------------------------------------------------------

def test_caption_filter():
  cap = "A red car with shiny wooden wheels. The sky is light blue, and a dog sits."
  assert structure.filter_caption(cap, ("colors",)) == "A car with shiny wooden wheels. The sky is, and a dog sits."
  assert structure.filter_caption(cap, ("colors", "materials", "textures")) == \
      "A car with wheels. The sky is, and a dog sits."
  assert structure.filter_caption("Red and blue.", ("colors",)) == "Red and blue."  # too little left: kept whole
  assert structure.filter_caption("Reddish BLUE cars here", ("colors",)) == "cars here"
  assert structure.filter_caption(cap, ()) == cap
  with pytest.raises(ValueError, match=r"config.structxlip.remove=\('colours',\): unknown word group"):
    structure.filter_caption(cap, ("colours",))


def test_chunks_are_word_windows_per_clause():
  text = "One two three. Four five six seven eight nine, ten!"
  spans = structure.chunk_char_spans(text, base_window=3)
  words = [text[a:b] for a, b in spans]
  # "One two three" (3 words: window 2), "Four .. nine" (6 words: window 3), "ten" (1 word: no window of 2).
  assert words == ["One two", "two three", "Four five six", "five six seven", "six seven eight", "seven eight nine"]
  assert len(structure.chunk_char_spans(text, base_window=3, max_chunks=4)) == 4
  assert structure.window_size(15, 3) == 4 and structure.window_size(30, 3) == 5 and structure.window_size(41, 3) == 6
  assert len(structure.chunk_char_spans(" ".join(["w"] * 12) + ".", base_window=3, stride=2)) == 5  # window 4
  tok = WordTokenizer.fit([text], context_length=8)  # truncates after 6 tokens
  masks = structure.chunk_masks(text, tok, max_chunks=8)
  row = tok([text])[0]
  for c, w in enumerate(words):
    got = row[masks[c] > 0]
    want = tok([w])[0]
    want = want[1:1 + np.count_nonzero(want) - 2]
    if c < 3:  # inside the 6 kept tokens
      np.testing.assert_array_equal(got, want[:len(got)])
  assert masks[4].sum() == masks[5].sum() == 0 and masks[6:].sum() == 0  # truncated away / no chunk


def test_edge_map_marks_the_outline():
  img = np.full((40, 40, 3), 30, np.uint8)
  img[10:30, 12:28] = 220
  e = structure.edge_map(img, 100, 200)
  assert e.shape == (40, 40, 3) and e.dtype == np.uint8 and set(np.unique(e)) == {0, 255}
  ys, xs = np.nonzero(e[..., 0] == 0)
  near = (np.minimum.reduce([np.abs(ys - 10), np.abs(ys - 29), np.abs(xs - 12), np.abs(xs - 27)]) <= 1)
  assert len(ys) > 60 and near.all()  # every edge pixel on the rectangle's border, and the border is drawn
  assert ys.min() >= 9 and ys.max() <= 30 and xs.min() >= 11 and xs.max() <= 28
  assert structure.edge_map(np.full((20, 20, 3), 77, np.uint8), 100, 200).min() == 255  # flat: no edges


def test_structure_inputs_of_an_example():
  img = np.zeros((30, 50, 3), np.uint8)
  img[5:25, 5:20] = 200
  img[8:22, 30:45] = 120
  segs = {"box": [np.array([5, 5, 20, 25], np.float32), np.array([30, 8, 45, 22], np.float32)],
          "sentence": [b"A red box.", b"A gray box."], "score": [np.float32(0.2), np.float32(0.9)]}
  ex = {"image": img, "caption": b"x", "segments": segs}
  cap = "A red box on the left. A gray box on the right."
  tok = WordTokenizer.fit([cap], context_length=20)
  st = structxlip_fw.StructureSettings(top_k=3, max_chunks=8)
  got = structxlip_fw.structure_inputs(ex, cap, pipeline.resize_center_crop(img, 16), tok, 16, st, 0, 0, 0)
  assert got["sx_crop_valid"].tolist() == [True, True, False]
  want_first = pipeline.normalize(structure.edge_map(
      pipeline.resize_center_crop(img[8:22, 30:45], 16), 100, 200))  # the best-scoring segment comes first
  np.testing.assert_allclose(got["sx_crop_edges"][0], want_first, atol=1e-6)
  np.testing.assert_array_equal(got["sx_tokens"], tok(["A box on the left. A box on the right."])[0])
  assert got["sx_chunks"].shape == (8, 20) and got["sx_chunks"].sum(1)[0] > 0
  none = structxlip_fw.structure_inputs({**ex, "segments": None}, cap, pipeline.resize_center_crop(img, 16), tok, 16, st,
                                   0, 0, 0)
  assert not none["sx_crop_valid"].any() and none["sx_crop_edges"].sum() == 0


# ---- Config and end to end -------------------------------------------------------------------------------------

def test_structxlip_config():
  c = config_lib.base_config()
  c.structxlip.tau = 0.1
  with pytest.raises(ValueError, match="config.structxlip.tau=0.1 set, but config.framework='longclip'"):
    config_lib.validate(c)
  c.framework = "structxlip"
  config_lib.validate(c)
  c.structxlip.floors = (0.5, 0.5)
  with pytest.raises(ValueError, match=r"config.structxlip.floors=\(0.5, 0.5\)"):
    config_lib.validate(c)
  c.structxlip.floors, c.structxlip.canny_low = (0.7, 0.5, 0.4), 300.0
  with pytest.raises(ValueError, match="config.structxlip.canny_low=300.0 must be below canny_high=200.0"):
    config_lib.validate(c)
  c.structxlip.canny_low = 100.0
  assert optim.logit_scale_max(c) == 3.5
  assert experiment.resolve_epoch_settings(c, 1000).structxlip.steps_per_epoch == 1000 // 128
  np.testing.assert_allclose(optim.clamp_logit_scale({"logit_scale": jnp.float32(4.6)}, 3.5)["logit_scale"], 3.5)
  from configs import longclip_l
  c = longclip_l.get_config("docci,structxlip")
  config_lib.validate(c)
  assert c.framework == "structxlip" and c.batch_size == 16 and c.structxlip.top_k == 2
  assert c.structxlip.structure_weight == 0.25 and c.structxlip.local_weight == 0.001


CONFIG = "configs/demo.py:test"
SX_RUN = ["--config.framework=structxlip", "--config.total_steps=6", "--config.log_every=2",
          "--config.checkpoint_every=3", "--config.eval_every=3", "--config.structxlip.steps_per_epoch=2",
          "--config.structxlip.decay_epochs=3", "--config.structxlip.logit_scale_max=2.6"]


def test_structxlip_trains_resumes_bit_identically_and_evaluates(tmp_path, tfds_dir):
  """train.py with config.framework=structxlip on the built-in data: the three terms logged, the loss is
  L_HN + scheduled weights · terms, the logit scale stays under its clamp; a resume from step 3 is bit-identical;
  eval.py evaluates the checkpoint."""
  workdir = str(tmp_path / "sx")
  args = ["train.py", "--config", CONFIG, f"--config.data.data_dir={tfds_dir}", *SX_RUN]
  run_py([*args, "--workdir", workdir])
  rows = [r for r in _metrics(workdir) if "loss" in r]
  assert [r["step"] for r in rows] == [2, 4, 6]
  obj = sx_objective(steps_per_epoch=2, decay_epochs=3).term(StructXLIPTerm)
  for r in rows:  # the logged loss is that of step r["step"] - 1
    f = np.asarray(obj.schedule(r["step"] - 1)) * [0.5, 0.05, 0.1]
    assert r["loss"] == pytest.approx(r["loss/hn"] + f[0] * r["loss/struct"] + f[1] * r["loss/consist"]
                                      + f[2] * r["loss/local"], rel=1e-5)
    assert r["logit_scale"] <= np.exp(2.6) * (1 + 1e-6) < 1 / 0.07  # 14.29 at init, clamped to e^2.6 = 13.46
  check_resume_is_bit_identical(args, workdir, str(tmp_path / "resumed"), last=6, resume_from=3)
  run_py(["eval.py", "--config", CONFIG, "--workdir", workdir, f"--config.data.data_dir={tfds_dir}"])
  with open(os.path.join(workdir, "eval_results.json")) as f:
    res = json.load(f)
  assert res["t2i"]["R@1"] == pytest.approx([r for r in _metrics(workdir) if "eval/t2i/R@1" in r][-1]["eval/t2i/R@1"])
