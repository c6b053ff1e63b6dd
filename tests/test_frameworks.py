"""The plug-in frameworks (config.framework): FineLIP's aggregation module, late interaction, hinge and ramp against
float64 NumPy; its model outputs, eval score, config and weights handling; train.py / eval.py end to end."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from scipy.special import erf

from conftest import assert_error_exit, metrics_rows, run_py
from hnclip_jax import config as config_lib, experiment, losses, pretrained, sharding
from hnclip_jax.evaluation.retrieval import recall_at_k, recall_from_scores
from hnclip_jax.models import CLIPConfig, bind, init_params
from hnclip_jax.frameworks import finelip as finelip_fw
from hnclip_jax.frameworks.finelip import PARAMS as AGGREGATORS, FineLIPTerm, TokenAggregation, finelip_scores, \
    init_aggregators
from hnclip_jax.objective import Objective
from hnclip_jax.pretrained import export
from test_losses import np_reference
from test_objective import _numeric_grad

MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


# ---- float64 NumPy references ----------------------------------------------------------------------------------

def np_late(img, txt, slope=0.1):
  """img [A, Ti, E], txt [C, Tt, E] -> [A, C]: for each pair, LeakyReLU'd token similarities; per caption token the
  max over image tokens, averaged, plus per image token the max over caption tokens, averaged."""
  s = np.einsum("ape,bqe->abpq", img.astype(np.float64), txt.astype(np.float64))
  s = np.where(s > 0, s, slope * s)
  return s.max(2).mean(2) + s.max(3).mean(2)


def np_hinge(img_agg, txt_agg, margin=0.2, extra=None):
  """FineLIP's hinge, summed: Σ_a Σ_{b≠a} [m + S[a,b] − S[a,a]]_+ + [m + S[b,a] − S[a,a]]_+ (extra: [B, B] added to
  the negatives' scores, symmetric)."""
  S = np_late(img_agg, txt_agg)
  b = S.shape[0]
  extra = np.zeros((b, b)) if extra is None else extra
  d = np.diag(S)[:, None]
  off = ~np.eye(b, dtype=bool)
  i2t = np.where(off, np.maximum(0, margin + S + extra - d), 0).sum(1)
  t2i = np.where(off, np.maximum(0, margin + S.T + extra - d), 0).sum(1)
  return i2t, t2i


def np_aggregate(x, mask, p, eps=1e-5):
  """TokenAggregation in float64: softmax over (masked) tokens of s·MLP(LN(x)), weights times tokens."""
  x = x.astype(np.float64)
  mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  h = (x - mu) / np.sqrt(var + eps) * p["norm"]["scale"] + p["norm"]["bias"]
  h = h @ p["fc1"]["kernel"] + p["fc1"]["bias"]
  h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
  logits = (h @ p["fc2"]["kernel"] + p["fc2"]["bias"]) * float(p["scale"])  # [B, N, K]
  if mask is not None:
    logits = np.where(mask[:, :, None], logits, -np.inf)
  w = np.exp(logits - logits.max(1, keepdims=True))
  w = w / w.sum(1, keepdims=True)
  return np.einsum("bnk,bne->bke", w, x)


def _agg(seed, b=6, ti=4, tt=5, e=4):
  r = np.random.default_rng(seed)
  return (_unit(r.normal(size=(b, ti, e))).astype(np.float32), _unit(r.normal(size=(b, tt, e))).astype(np.float32))


# ---- The math ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [16, 2, 4])
def test_hinge_value_and_gradients_match_numpy(block):
  """hinge_rows, computed `block` × `block` pairs at a time (block 4 does not divide B = 6: tiles of 3), equals the
  float64 hinge; gradients equal its central differences."""
  img, txt = _agg(0)
  f = jax.jit(lambda i, t: sum(jnp.sum(x) for x in finelip_fw.hinge_rows(i, t, 0, 0.2, block=block)))
  i2t, t2i = finelip_fw.hinge_rows(jnp.asarray(img), jnp.asarray(txt), 0, 0.2, block=block)
  w_i2t, w_t2i = np_hinge(img, txt)
  np.testing.assert_allclose(i2t, w_i2t, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(t2i, w_t2i, rtol=1e-5, atol=1e-6)
  assert w_i2t.min() >= 0 and np.count_nonzero(w_i2t) > 0 and not np.allclose(w_i2t, w_t2i)  # the directions differ
  gi, gt = jax.grad(f, argnums=(0, 1))(jnp.asarray(img), jnp.asarray(txt))
  total = lambda i, t: sum(x.sum() for x in np_hinge(i, t))
  np.testing.assert_allclose(gi, _numeric_grad(lambda x: total(x, txt), img), rtol=1e-3, atol=1e-5)
  np.testing.assert_allclose(gt, _numeric_grad(lambda x: total(img, x), txt), rtol=1e-3, atol=1e-5)


def test_hinge_margin_option_adds_gamma_gbar_without_gradient():
  img, txt = _agg(1)
  r = np.random.default_rng(1)
  emb = _unit(r.normal(size=(6, 8))).astype(np.float32)
  g = emb.astype(np.float64) @ emb.T.astype(np.float64)
  np.fill_diagonal(g, 0.0)
  got = finelip_fw.hinge_rows(jnp.asarray(img), jnp.asarray(txt), 0, 0.2, hn_margin=(0.5, emb, emb))
  want = np_hinge(img, txt, extra=0.5 * g)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
  assert not np.allclose(want[0], np_hinge(img, txt)[0])  # the margin changes the loss ...
  d_emb = jax.grad(lambda e: sum(jnp.sum(x) for x in finelip_fw.hinge_rows(img, txt, 0, 0.2, hn_margin=(0.5, e, e))))(
      jnp.asarray(emb))
  assert np.all(np.asarray(d_emb) == 0)  # ... but Ḡ is a constant


def test_aggregation_module_matches_numpy_with_masks():
  """Softmax over the valid tokens only: masked tokens get no weight and no gradient; the learned scale counts."""
  r = np.random.default_rng(2)
  mod = TokenAggregation(8, 3, 5, 1e-5, rngs=nnx.Rngs(0))
  mod.scale[...] = jnp.float32(1.7)
  p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(mod, nnx.Param)))
  x = r.normal(size=(4, 6, 8)).astype(np.float32)
  mask = np.arange(6)[None] < np.array([1, 3, 6, 4])[:, None]
  np.testing.assert_allclose(mod(jnp.asarray(x), jnp.asarray(mask)), np_aggregate(x, mask, p), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mod(jnp.asarray(x)), np_aggregate(x, None, p), rtol=1e-5, atol=1e-6)
  gx = jax.grad(lambda v: jnp.sum(mod(v, jnp.asarray(mask)) ** 2))(jnp.asarray(x))
  assert np.all(np.asarray(gx)[~mask] == 0) and np.abs(np.asarray(gx)[mask]).min() > 0
  want = _numeric_grad(lambda v: np.sum(np_aggregate(v, mask, p) ** 2), x)
  np.testing.assert_allclose(gx, want, rtol=1e-3, atol=1e-5)


def _outputs(seed, b=6, t=4, e=4):
  r = np.random.default_rng(seed)
  img_agg, txt_agg = _agg(seed, b, t, t, e)
  return {"img": _unit(r.normal(size=(b, e))).astype(np.float32), "txt": _unit(r.normal(size=(b, e))).astype(np.float32),
          "img_agg": img_agg, "txt_agg": txt_agg, "scale": np.float32(7.0)}


@pytest.mark.parametrize("reduction,global_weight,chunk", [("sum", 1.0, 0), ("mean", 0.0, 2), ("sum", 0.5, 3)])
def test_finelip_objective_value_and_gradients_match_numpy(reduction, global_weight, chunk):
  """w_g·L_HN + w·ramp(step)·hinge from the outputs dict: value, and gradients w.r.t. every output."""
  out = _outputs(3)
  s = float(out["scale"])
  obj = Objective.of(gamma=0.5, global_weight=global_weight, chunk_size=chunk,
                  terms=(FineLIPTerm(weight=2.0, reduction=reduction, ramp_steps=8),))
  got, g = jax.jit(jax.value_and_grad(lambda o: obj(o, MESH, jnp.int32(2))[0]))(out)
  norm = 6 if reduction == "mean" else 1
  hinge = lambda i, t: sum(x.sum() for x in np_hinge(i, t)) / norm
  hn, dv, dt = np_reference(out["img"], out["txt"], s, 0.5)
  w = 2.0 * 2 / 8  # weight × ramp at step 2 of 8
  np.testing.assert_allclose(got, global_weight * hn + w * hinge(out["img_agg"], out["txt_agg"]), rtol=1e-5)
  np.testing.assert_allclose(g["img"], global_weight * dv, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(g["txt"], global_weight * dt, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(g["img_agg"], w * _numeric_grad(lambda x: hinge(x, out["txt_agg"]), out["img_agg"]),
                             rtol=1e-3, atol=1e-5)
  np.testing.assert_allclose(g["txt_agg"], w * _numeric_grad(lambda x: hinge(out["img_agg"], x), out["txt_agg"]),
                             rtol=1e-3, atol=1e-5)
  _, aux = jax.jit(lambda o: obj(o, MESH, 2))(out)
  np.testing.assert_allclose(aux["terms"]["fine"], hinge(out["img_agg"], out["txt_agg"]), rtol=1e-5)
  # Each example's share: ½(i2t + t2i) of L_HN (weighted) plus its rows of the hinge; they add up to B·w_g·L_HN + w·hinge.
  np.testing.assert_allclose(np.sum(aux["per_example"]), 6 * global_weight * hn + w * hinge(out["img_agg"], out["txt_agg"]),
                             rtol=1e-4)


def test_ramp_runs_from_zero_to_the_full_weight():
  out = _outputs(4)
  obj = Objective.of(gamma=0.5, terms=(FineLIPTerm(weight=1.0, ramp_steps=10),))
  hn = float(np_reference(out["img"], out["txt"], float(out["scale"]), 0.5)[0])
  at = jax.jit(lambda o, step: obj(o, MESH, step))  # the step traced, as in the train step: one compile
  fine = float(at(out, 0)[1]["terms"]["fine"])
  assert fine > 0
  for step, ramp in ((0, 0.0), (5, 0.5), (10, 1.0), (1000, 1.0)):
    np.testing.assert_allclose(at(out, step)[0], hn + ramp * fine, rtol=1e-5)
  np.testing.assert_allclose(jax.jit(lambda o: obj(o, MESH, None)[0])(out), hn + fine, rtol=1e-5)  # no step: full
  np.testing.assert_allclose(jax.jit(lambda o: obj.replace(terms=obj.terms[:1] + (FineLIPTerm(weight=1.0, ramp_steps=0),))(o, MESH, 0)[0])(out), hn + fine,
                             rtol=1e-5)


def test_gamma_zero_finelip_is_its_own_infonce_plus_hinge():
  out = _outputs(5)
  got = Objective.of(gamma=0.0, terms=(FineLIPTerm(weight=1.0),))(out, MESH)[0]
  s = float(out["scale"])
  hn0 = np_reference(out["img"], out["txt"], s, 0.0)[0]
  np.testing.assert_allclose(got, hn0 + sum(x.sum() for x in np_hinge(out["img_agg"], out["txt_agg"])), rtol=1e-5)


# ---- The model -----------------------------------------------------------------------------------------------

TINY = CLIPConfig(embed_dim=8, image_size=16, patch_size=4, vision_width=16, vision_layers=1, vision_heads=2,
                  vision_mlp_dim=32, text_context=8, vocab_size=64, text_width=16, text_layers=1, text_heads=2,
                  text_mlp_dim=32, eot_token_id=3, parts=finelip_fw.PARTS,
                  part_settings=(("hidden_ratio", 0.2), ("tokens", 3)))


def _with(cfg, tokens):
  """cfg with `tokens` aggregated tokens per tower (0: no aggregators)."""
  if not tokens:
    return CLIPConfig(**{**cfg.__dict__, "parts": "", "part_settings": ()})
  return CLIPConfig(**{**cfg.__dict__, "parts": finelip_fw.PARTS, "part_settings": (("hidden_ratio", 0.2),
                                                                                      ("tokens", tokens))})


def _batch(b=5, seed=0):
  r = np.random.default_rng(seed)
  lengths = np.array([2, 8, 5, 3, 6])[:b]  # start, words, end; the shortest caption has no word at all
  tokens = np.where(np.arange(8)[None] < lengths[:, None] - 1, r.integers(4, 64, (b, 8)), 0)
  tokens[:, 0], tokens[np.arange(b), lengths - 1] = 2, 3
  return r.normal(size=(b, 16, 16, 3)).astype(np.float32), tokens.astype(np.int32), lengths


def test_model_aggregates_cls_plus_k_patches_and_k_words_plus_end_token():
  """img_agg = [CLS, K aggregated patches], txt_agg = [K aggregated tokens start..last word, end token], each
  L2-normalised, from the towers' projected tokens; padding and the end token take no part in the aggregation."""
  graphdef, params = init_params(TINY, 0)
  images, tokens, lengths = _batch()

  obj = Objective.of(terms=(FineLIPTerm(),))

  @jax.jit  # (one compile instead of op-by-op dispatch)
  def run(params, images, tokens):
    model = bind(graphdef, params)  # the objective's forward: the towers, then the term's own outputs
    return (obj.forward(model, {"image": images, "tokens": tokens}), model.image_tower(images, -1)[1],
            model.text_tower(tokens, -1)[1])

  out, img_tok, txt_tok = run(params, images, tokens)
  assert out["img_agg"].shape == (5, 4, 8) and out["txt_agg"].shape == (5, 4, 8)
  img_tok, txt_tok = np.asarray(img_tok, np.float64), np.asarray(txt_tok, np.float64)
  p = jax.tree.map(np.asarray, params)
  want_img = np.concatenate([img_tok[:, :1], np_aggregate(img_tok[:, 1:], None, p["image_aggregator"])], 1)
  words = np.arange(8)[None] < (lengths - 1)[:, None]
  eot = txt_tok[np.arange(5), lengths - 1][:, None]
  want_txt = np.concatenate([np_aggregate(txt_tok, words, p["text_aggregator"]), eot], 1)
  np.testing.assert_allclose(out["img_agg"], _unit(want_img), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out["txt_agg"], _unit(want_txt), rtol=1e-4, atol=1e-5)
  # The image's first row is the global image embedding (same CLS, same LayerNorm and projection).
  np.testing.assert_allclose(out["img_agg"][:, 0], out["img"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["txt_agg"][:, -1], out["txt"], rtol=1e-5, atol=1e-6)


def test_models_without_the_framework_are_unchanged():
  base = _with(TINY, 0)
  _, p0 = init_params(base, 0)
  _, p1 = init_params(TINY, 0)
  assert not set(p0) & set(AGGREGATORS) and set(AGGREGATORS) <= set(p1)
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), p0, {k: v for k, v in p1.items() if k in p0})
  assert all(jax.tree.leaves(same))  # the towers are initialised exactly as without the module


def test_weights_without_aggregators_get_fresh_ones_and_a_longclip_start_drops_them():
  _, with_agg = init_params(TINY, 0)
  base = {k: v for k, v in with_agg.items() if k not in AGGREGATORS}
  finelip, longclip = config_lib.base_config(), config_lib.base_config()
  finelip.framework = "finelip"
  filled = experiment.start_params(base, TINY, finelip, "w")
  assert jax.tree.structure(filled) == jax.tree.structure(with_agg)
  np.testing.assert_array_equal(filled["image_aggregator"]["fc1"]["kernel"],
                                init_aggregators(TINY, 0)["image_aggregator"]["fc1"]["kernel"])
  kept = experiment.start_params(with_agg, TINY, finelip, "w")  # a FineLIP start keeps its trained aggregators
  assert kept["text_aggregator"] is with_agg["text_aggregator"]
  plain = _with(TINY, 0)
  assert set(experiment.start_params(with_agg, plain, longclip, "w")) == set(base)
  with pytest.raises(ValueError, match="aggregators of other shapes.*config.finelip.tokens=5"):
    experiment.start_params(with_agg, _with(TINY, 5), finelip, "/w")


def test_aggregators_train_with_adapters():
  """LoRA freezes every base weight; FineLIP's aggregators, new and randomly initialised, still train."""
  from hnclip_jax import optim
  c = config_lib.base_config()
  c.framework, c.finetune.method = "finelip", "lora"
  cfg = CLIPConfig(**{**TINY.__dict__, **config_lib.adapter_fields(c)})
  frozen = optim.frozen_predicate(c.optimizer, optim.freeze_patterns(c, cfg))
  assert not frozen("image_aggregator/fc1/kernel") and not frozen("text_aggregator/scale")
  assert not frozen("text/blocks/0/fc1/lora/lora_a") and frozen("text/blocks/0/fc1/kernel") and frozen("ln_post/scale")
  assert not frozen("logit_scale")  # it follows config.optimizer.train_logit_scale (default: learned)
  plain = _with(cfg, 0)
  frozen_plain = optim.frozen_predicate(c.optimizer, optim.freeze_patterns(c, plain))
  assert frozen_plain("image_aggregator/fc1/kernel") and not frozen_plain("text/blocks/0/fc1/lora/lora_a")
  assert frozen_plain("vision/blocks/0/attn/q/kernel") and not frozen_plain("vision/blocks/0/attn/q/magnitude")
  c.optimizer.train_logit_scale = False
  assert optim.frozen_predicate(c.optimizer, optim.freeze_patterns(c, plain))("logit_scale")


def test_aggregators_are_replicated_on_every_layout():
  for name in ("image_aggregator/fc1/kernel", "text_aggregator/fc2/bias", "image_aggregator/norm/scale",
               "text_aggregator/scale"):
    ndim = 2 if name.endswith("kernel") else (0 if name.endswith("/scale") and "norm" not in name else 1)
    assert sharding.logical_axes(name, ndim) == (None,) * ndim


# ---- Eval ----------------------------------------------------------------------------------------------------

def test_recall_from_scores_equals_recall_at_k_for_cosine_scores():
  r = np.random.default_rng(6)
  img, txt = _unit(r.normal(size=(7, 5))), _unit(r.normal(size=(12, 5)))
  owner = np.array([0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 6])
  txt[7:] = _unit(img[owner[7:]] + 0.3 * r.normal(size=(5, 5)))
  want = recall_at_k(img.astype(np.float32), txt.astype(np.float32), ks=(1, 2, 5), caption_image=owner)
  assert recall_from_scores(txt @ img.T, owner, ks=(1, 2, 5)) == want


def test_finelip_score_is_the_weighted_sum_of_cosine_and_late_interaction():
  r = np.random.default_rng(7)
  img, txt = _unit(r.normal(size=(9, 4))), _unit(r.normal(size=(9, 4)))
  img_agg, txt_agg = _agg(7, b=9)
  got = finelip_scores(img, txt, img_agg, txt_agg, 0.2, chunk=4)  # 9 captions: chunks of 4, 4, 1 (padded)
  want = 0.8 * txt.astype(np.float64) @ img.T + 0.2 * np_late(img_agg, txt_agg).T
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---- Config --------------------------------------------------------------------------------------------------

def test_framework_config_is_checked():
  c = config_lib.base_config()
  c.framework = "filip"
  with pytest.raises(ValueError, match="config.framework='filip'; choose one of"):
    config_lib.validate(c)
  c.framework = "finelip"
  c.finelip.reduction = "avg"
  with pytest.raises(ValueError, match="config.finelip.reduction='avg'"):
    config_lib.validate(c)
  c = config_lib.base_config()
  c.finelip.margin = 0.3  # without config.framework="finelip" it would do nothing: refused, named
  with pytest.raises(ValueError, match="config.finelip.margin=0.3 set, but config.framework='longclip'"):
    config_lib.validate(c)
  # Every framework's block (hnclip_jax/frameworks/<name>.py: CONFIG, NON_NEGATIVE) is checked the same way.
  for fw, key, value, title in (("finelip", "goal.patch_weight", 2.0, "GOAL"),
                                ("goal", "structxlip.tau", 0.1, "StructXLIP"), ("structxlip", "finelip.tokens", 8, "FineLIP")):
    c = config_lib.base_config()
    c.framework = fw
    block, field = key.split(".")
    c[block][field] = value
    with pytest.raises(ValueError, match=rf"config.{key}={value!r} set, but config.framework='{fw}': {title}'s "
                                         rf"settings apply only with config.framework='{block}'"):
      config_lib.validate(c)
  c = config_lib.base_config()
  c.finelip.score_weight = 0.5  # read by eval.py --score=finelip whatever the framework
  config_lib.validate(c)
  assert config_lib.framework_fields(c) == {"parts": "", "part_settings": ()}  # a Long-CLIP start: no aggregators
  c.framework, c.goal.text_weight = "goal", -1.0
  with pytest.raises(ValueError, match=r"config.goal.text_weight=-1.0 must be >= 0"):
    config_lib.validate(c)
  from configs import longclip_l
  c = longclip_l.get_config("docci,finelip")
  config_lib.validate(c)
  assert c.framework == "finelip" and c.loss.token_weight == 0 and c.optimizer.lr == 1e-6
  assert config_lib.framework_fields(c) == {"parts": "hnclip_jax.frameworks.finelip:model_parts",
                                            "part_settings": (("hidden_ratio", 0.2), ("tokens", 39))}
  # FineLIP's aggregators read the token term's layer and CLS choice even with the term off; not its temperature.
  c.loss.token_layer, c.loss.token_image_cls = -2, True
  config_lib.validate(c)
  c.loss.token_logit_scale = 50.0
  with pytest.raises(ValueError, match=r"config.loss.token_logit_scale=50.0 set, but config.loss.token_weight=0"):
    config_lib.validate(c)
  with pytest.raises(ValueError, match="no lora/dora variant"):
    longclip_l.get_config("finelip,lora")


def test_epoch_settings_resolve_to_steps():
  c = config_lib.base_config()
  c.framework, c.batch_size = "finelip", 32
  assert experiment.resolve_epoch_settings(c, 1000).finelip.ramp_steps == 31
  assert c.finelip.ramp_steps == -1  # the caller's config is not changed
  c.finelip.ramp_steps = 7
  assert experiment.resolve_epoch_settings(c, 1000).finelip.ramp_steps == 7


# ---- End to end ----------------------------------------------------------------------------------------------

CONFIG = "configs/demo.py:test"
FINELIP_RUN = ["--config.framework=finelip", "--config.finelip.tokens=4", "--config.total_steps=8",
               "--config.log_every=2", "--config.checkpoint_every=4", "--config.eval_every=4",
               "--config.optimizer.lr_multipliers=((r'_aggregator/', 5.0),)"]


def _metrics(workdir):
  return metrics_rows(workdir)


def _params(workdir):
  return pretrained.load(workdir).params


def _at(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


def _finelip_reference_recall(workdir, model, tfds_dir) -> dict:
  """{w: {"t2i": {R@K}, "i2t": {R@K}}} for w in 0.2, 1.0: the test split's features from the trained model (global
  embeddings and FineLIP's aggregated tokens), scored in float64 NumPy ((1 − w)·cosine + w·np_late) and ranked with
  ties against the ground truth, as eval.py counts."""
  from configs.demo import get_config
  from hnclip_jax.data import builders, pipeline
  c = get_config("test")
  c.data.data_dir = tfds_dir
  c.framework = "finelip"
  source = builders.data_source(c.data, "test")
  captions = [caps[0] for caps in pipeline.caption_lists(source)]  # one caption per image here (40 pairs)
  pixels = np.stack([pipeline.clip_preprocess(source[i]["image"], model.config.image_size) for i in range(len(source))])
  tokens = model.tokenize(captions)
  m = bind(model.graphdef, model.params)
  fl = finelip_fw.SCORES["finelip"]
  img, txt = model.encode_pixels(pixels), model.encode_tokens(tokens)
  img_x = np.asarray(fl.encode_image(m, jnp.asarray(pixels), c), np.float64)
  txt_x = np.asarray(fl.encode_text(m, jnp.asarray(tokens), c), np.float64)
  out = {}
  for w in (0.2, 1.0):
    s = (1 - w) * txt.astype(np.float64) @ img.T.astype(np.float64) + w * np_late(img_x, txt_x).T  # [cap, img]
    gt = np.diag(s)
    rank_t2i = np.sum(s > gt[:, None], axis=1) + np.sum(s == gt[:, None], axis=1) - 1  # ties count against it
    rank_i2t = np.sum(s > gt[None, :], axis=0) + np.sum(s == gt[None, :], axis=0) - 1
    pct = lambda rank: {f"R@{k}": 100.0 * float(np.sum(rank < k)) / len(rank) for k in (1, 5, 10)}  # noqa: E731
    out[w] = {"t2i": pct(rank_t2i), "i2t": pct(rank_i2t)}
  return out


def test_finelip_trains_resumes_bit_identically_and_evaluates(tmp_path, tfds_dir):
  """train.py with config.framework=finelip on the built-in data: both terms logged (loss = L_HN + ramp·hinge, the
  ramp one epoch = 128 / 16 = 8 steps); a resume from the step-4 checkpoint gives bit-identical parameters and
  metrics; eval.py ranks by cosine and by FineLIP's combined score."""
  workdir = str(tmp_path / "fl")
  args = ["train.py", "--config", CONFIG, f"--config.data.data_dir={tfds_dir}", *FINELIP_RUN]
  run_py([*args, "--workdir", workdir])
  rows = [r for r in _metrics(workdir) if "loss" in r]
  assert [r["step"] for r in rows] == [2, 4, 6, 8]
  for r in rows:  # the logged loss is the loss of step r["step"] - 1, ramp (step - 1) / 8
    assert r["loss"] == pytest.approx(r["loss/hn"] + (r["step"] - 1) / 8 * r["loss/fine"], rel=1e-5)
  with open(os.path.join(workdir, "model.json")) as f:
    assert dict(json.load(f)["part_settings"])["tokens"] == 4
  resumed = str(tmp_path / "resumed")
  shutil.copytree(workdir, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "8"))
  proc = run_py([*args, "--workdir", resumed])
  assert "(step 4)" in proc.stdout
  assert _metrics(resumed) == _metrics(workdir)
  a, b = _params(workdir), _params(resumed)
  assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))
  # The aggregators trained: every parameter moved from the run's own initialisation (train.py: init_params(model,
  # seed)) by more than AdamW's decoupled decay, which is all a parameter with a zero gradient gets (Adam's update
  # of a zero gradient is 0): decay alone leaves c·w0 with 0 < c ≤ 1 (zeros stay zeros).
  model = pretrained.load(workdir)
  start = init_params(model.config, 0)[1]
  for agg in AGGREGATORS:
    for path, w in jax.tree_util.tree_leaves_with_path(a[agg]):
      w0, w = np.asarray(_at(start[agg], path), np.float64), np.asarray(w, np.float64)
      c = np.vdot(w, w0) / np.vdot(w0, w0) if np.any(w0) else 0.0
      decay_only = np.linalg.norm(w - c * w0) <= 1e-4 * np.linalg.norm(w) and c <= 1 + 1e-6
      assert not decay_only, (agg, path, c)
  # eval.py: cosine (the framework need not be repeated) and FineLIP's combined score.
  run_py(["eval.py", "--config", CONFIG, "--workdir", workdir, f"--config.data.data_dir={tfds_dir}"])
  with open(os.path.join(workdir, "eval_results.json")) as f:
    cos = json.load(f)
  train_eval = [r for r in _metrics(workdir) if "eval/t2i/R@1" in r][-1]
  assert cos["score"] == "cosine" and cos["t2i"]["R@1"] == pytest.approx(train_eval["eval/t2i/R@1"])
  # --score=finelip ranks by (1 − w)·cosine + w·late interaction with w = config.finelip.score_weight: its recall
  # equals NumPy's ranking of that float64 score over the model's features, for the default w and another one.
  want = _finelip_reference_recall(workdir, model, tfds_dir)
  assert want[0.2] != want[1.0]  # the weights rank differently on this data, so a w that is not passed shows
  for w in (0.2, 1.0):
    proc = run_py(["eval.py", "--config", CONFIG, "--workdir", workdir, f"--config.data.data_dir={tfds_dir}",
                   "--score=finelip", f"--config.finelip.score_weight={w}"])
    assert f"{1 - w:g}·cosine + {w:g}·late interaction" in proc.stdout
    with open(os.path.join(workdir, "eval_results.json")) as f:
      fine = json.load(f)
    assert fine["score"] == "finelip" and fine["num_pairs"] == 40
    assert {d: fine[d] for d in ("t2i", "i2t")} == want[w], w
  # Export: the towers in Hugging Face's format; the aggregators, which it has no place for, named as left out.
  warnings = export.export_hf(pretrained.load(workdir), str(tmp_path / "hf"))
  assert len(warnings) == 1 and "['image_aggregator', 'text_aggregator']" in warnings[0]
  assert os.path.exists(tmp_path / "hf" / "model.safetensors")
  # A model without aggregators cannot be ranked with FineLIP's score: a named error.
  plain = str(tmp_path / "plain")
  run_py(["train.py", "--config", CONFIG, f"--config.data.data_dir={tfds_dir}", "--config.total_steps=1",
          "--config.checkpoint_every=1", "--config.eval_every=1", "--workdir", plain])
  proc = run_py(["eval.py", "--config", CONFIG, "--workdir", plain, f"--config.data.data_dir={tfds_dir}",
                 "--score=finelip"], check=False)
  assert_error_exit(proc, "--score=finelip needs FineLIP's token aggregators")


def test_a_model_description_from_before_parts_loads():
  """model.json / checkpoint metadata written when FineLIP's aggregators were CLIPConfig fields (aggregate_tokens,
  aggregate_hidden_ratio) read as today's parts; a plain model's (aggregate_tokens 0) as no parts."""
  from hnclip_jax import frameworks
  from hnclip_jax.workdir import check_model_compatible
  today = json.loads(json.dumps({k: v for k, v in TINY.__dict__.items()}))  # part_settings as JSON lists
  old = {k: v for k, v in today.items() if k not in ("parts", "part_settings")}
  fine = {**old, "aggregate_tokens": 3, "aggregate_hidden_ratio": 0.2}
  assert CLIPConfig.from_dict(frameworks.upgrade_model_dict(fine)) == TINY == CLIPConfig.from_dict(today)
  plain = {**old, "aggregate_tokens": 0, "aggregate_hidden_ratio": 0.2}
  assert CLIPConfig.from_dict(frameworks.upgrade_model_dict(plain)) == _with(TINY, 0)
  check_model_compatible(fine, TINY, "old checkpoint")
  check_model_compatible(today, TINY, "new checkpoint")
  with pytest.raises(ValueError, match=r"model.part_settings: checkpoint=\(\('hidden_ratio', 0.2\), \('tokens', 4\)\)"):
    check_model_compatible({**fine, "aggregate_tokens": 4}, TINY, "old checkpoint")
  with pytest.raises(ValueError, match="model.parts: checkpoint=''"):
    check_model_compatible(plain, TINY, "old checkpoint")
