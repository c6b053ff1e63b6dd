"""The objective (L_HN + λ·L_tok) against float64 NumPy, the model's outputs dict, precision, and the logit scale."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from hnclip_jax import config as config_lib, losses, optim, sharding, train_step
from hnclip_jax.models import CLIPConfig, bind, init_params
from hnclip_jax.models.clip import LOGIT_SCALE_PARAM_MAX
from hnclip_jax.objective import Objective
from hnclip_jax.terms import TokenTerm
from test_losses import np_reference, np_sigmoid_reference

MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def np_token_loss(it, tt, mask, s, margin=None):
  """FILIP token term in float64: S^I[a,b] = mean_p max_{real q} <it[a,p], tt[b,q]>, S^T[a,b] = mean_{real q}
  max_p <tt[a,q], it[b,p]>; ½[CE(s·S^I) + CE(s·S^T)] over rows with the diagonal as target. margin: [B, B] added
  to both score matrices before scaling."""
  it, tt = it.astype(np.float64), tt.astype(np.float64)
  sim = np.einsum("ape,bqe->abpq", it, tt)  # image a's patches vs caption b's tokens
  s_i = np.where(mask[None, :, None, :], sim, -np.inf).max(3).mean(2)
  best = np.einsum("aqe,bpe->abqp", tt, it).max(3)  # caption a's tokens: best patch of image b
  s_t = (best * mask[:, None, :]).sum(2) / mask.sum(1)[:, None]

  def ce(m):
    m = s * (m + (0 if margin is None else margin))
    top = m.max(1, keepdims=True)
    logp = m - top - np.log(np.exp(m - top).sum(1, keepdims=True))
    return -np.mean(np.diag(logp))

  return 0.5 * (ce(s_i) + ce(s_t))


def _outputs(seed, b=6, p=5, l=7, e=4):
  r = np.random.default_rng(seed)
  lengths = r.integers(2, l + 1, b)
  lengths[0], lengths[1] = 2, l  # the shortest and the longest caption are both present
  return {"img": _unit(r.normal(size=(b, e))).astype(np.float32),
          "txt": _unit(r.normal(size=(b, e))).astype(np.float32),
          "img_tokens": _unit(r.normal(size=(b, p, e))).astype(np.float32),
          "txt_tokens": _unit(r.normal(size=(b, l, e))).astype(np.float32),
          "txt_mask": np.arange(l)[None] < lengths[:, None], "scale": np.float32(7.0)}


def _numeric_grad(f, x, eps=1e-6):
  g = np.zeros_like(x, np.float64)
  for idx in np.ndindex(x.shape):
    hi, lo = x.astype(np.float64).copy(), x.astype(np.float64).copy()
    hi[idx] += eps
    lo[idx] -= eps
    g[idx] = (f(hi) - f(lo)) / (2 * eps)
  return g


def _value_and_grads(objective, out):
  floats = {k: v for k, v in out.items() if k != "txt_mask"}
  f = lambda fl: objective({**fl, "txt_mask": out["txt_mask"]}, MESH)[0]
  return jax.jit(jax.value_and_grad(f))(floats)


@pytest.mark.parametrize("weight", [0.0, 1.0])
@pytest.mark.parametrize("chunk", [0, 2, 3])
def test_objective_value_and_gradients_match_numpy(weight, chunk):
  """Value and gradients w.r.t. every output (embeddings, token features, scale) equal float64 NumPy: L_HN's
  analytic gradient (test_losses.np_reference) plus λ times the token term's central differences."""
  out = _outputs(0)
  s = float(out["scale"])
  got, g = _value_and_grads(Objective.of(gamma=0.5, token_weight=weight, chunk_size=chunk), out)
  it, tt, m = out["img_tokens"], out["txt_tokens"], out["txt_mask"]
  hn, dv, dt = np_reference(out["img"], out["txt"], s, 0.5)
  want = hn + weight * np_token_loss(it, tt, m, s)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(g["img"], dv, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(g["txt"], dt, rtol=1e-4, atol=1e-6)
  d_it = weight * _numeric_grad(lambda x: np_token_loss(x, tt, m, s), it) if weight else 0 * it
  d_tt = weight * _numeric_grad(lambda x: np_token_loss(it, x, m, s), tt) if weight else 0 * tt
  np.testing.assert_allclose(g["img_tokens"], d_it, rtol=1e-3, atol=2e-6)
  np.testing.assert_allclose(g["txt_tokens"], d_tt, rtol=1e-3, atol=2e-6)
  if weight:  # padding gets exactly no gradient, real tokens do
    assert np.all(np.asarray(g["txt_tokens"])[~m] == 0) and np.abs(np.asarray(g["txt_tokens"])[m]).max() > 1e-4
  total = lambda sc: np_reference(out["img"], out["txt"], sc, 0.5)[0] + weight * np_token_loss(it, tt, m, sc)
  np.testing.assert_allclose(g["scale"], (total(s + 1e-5) - total(s - 1e-5)) / 2e-5, rtol=1e-3)


@pytest.mark.parametrize("schedule,chunk", [("ring", 0), ("gather", 0), ("gather", 2)])
def test_sigmoid_objective_matches_numpy(schedule, chunk):
  """config.loss.kind="sigmoid": value, per-example losses (each image's row sum) and gradients w.r.t. both
  embeddings, t and b equal float64 NumPy (test_losses.np_sigmoid_reference), with the token term added on top."""
  out = {**_outputs(1), "bias": np.float32(-4.0)}
  obj = Objective.of(gamma=0.5, kind="sigmoid", sigmoid_schedule=schedule, chunk_size=chunk)
  got, g = _value_and_grads(obj, out)
  want, dv, dt, ds, db = np_sigmoid_reference(out["img"], out["txt"], 7.0, -4.0, 0.5)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in ((g["img"], dv), (g["txt"], dt), (g["scale"], ds), (g["bias"], db)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  per = np.asarray(obj({**out}, MESH)[1]["per_example"])
  np.testing.assert_allclose(per.mean(), want, rtol=1e-5)
  assert obj.plain_name == "siglip" and Objective.of().plain_name == "infonce"
  both, _ = _value_and_grads(obj.replace(terms=obj.terms + (TokenTerm(weight=1.0),)), out)
  np.testing.assert_allclose(both, want + np_token_loss(out["img_tokens"], out["txt_tokens"], out["txt_mask"], 7.0),
                             rtol=1e-5)


def test_sigmoid_loss_needs_a_logit_bias_and_valid_settings():
  with pytest.raises(ValueError, match="kind='sigmoid' needs the model's learned logit bias"):
    Objective.of(kind="sigmoid").check(CLIPConfig())
  Objective.of(kind="sigmoid").check(CLIPConfig(logit_bias=True))
  c = config_lib.base_config()
  c.loss.kind = "hinge"
  with pytest.raises(ValueError, match="config.loss.kind='hinge'; choose one of"):
    config_lib.validate(c)
  c = config_lib.base_config()
  c.loss.sigmoid_schedule = "gather"
  with pytest.raises(ValueError, match="sigmoid_schedule='gather' set, but config.loss.kind='softmax'"):
    config_lib.validate(c)
  c.loss.kind = "sigmoid"
  config_lib.validate(c)
  c.loss.chunk_size = 4
  config_lib.validate(c)  # the gather schedule scores rows in chunks
  c.loss.sigmoid_schedule = "ring"
  with pytest.raises(ValueError, match="config.loss.chunk_size=4 set, but the sigmoid loss's ring schedule"):
    config_lib.validate(c)
  assert optim.logit_scale_max(c) == float("inf") and optim.logit_scale_max(config_lib.base_config()) == \
      LOGIT_SCALE_PARAM_MAX
  # The sigmoid loss's t is not clamped at all (docs/objective.md): log t may go below 0 and above ln 100, while
  # the softmax loss's parameter is kept in [0, ln 100].
  for value in (-0.5, 7.0):
    p = {"logit_scale": jnp.float32(value)}
    assert float(optim.clamp_logit_scale(p, optim.logit_scale_max(c))["logit_scale"]) == value
    assert float(optim.clamp_logit_scale(p, LOGIT_SCALE_PARAM_MAX)["logit_scale"]) == pytest.approx(
        min(max(value, 0.0), LOGIT_SCALE_PARAM_MAX))


def test_token_term_options_match_numpy():
  """token_margin adds γ·Ḡ (zero diagonal) to the token logits; token_logit_scale fixes their multiplier."""
  out = _outputs(1)
  s, it, tt, m = float(out["scale"]), out["img_tokens"], out["txt_tokens"], out["txt_mask"]
  hn = np_reference(out["img"], out["txt"], s, 0.5)[0]
  g = out["txt"].astype(np.float64) @ out["txt"].T.astype(np.float64)
  np.fill_diagonal(g, 0.0)
  got, _ = _value_and_grads(Objective.of(gamma=0.5, token_weight=1.0, token_margin=True), out)
  np.testing.assert_allclose(got, hn + np_token_loss(it, tt, m, s, margin=0.5 * g), rtol=1e-5)
  got, _ = _value_and_grads(Objective.of(gamma=0.5, token_weight=2.0, token_logit_scale=25.0), out)
  np.testing.assert_allclose(got, hn + 2.0 * np_token_loss(it, tt, m, 25.0), rtol=1e-5)


@pytest.mark.parametrize("group,chunk", [(3, 0), (2, 1)])
def test_token_groups_match_numpy(group, chunk):
  """token_group=G: the token term of each example against its group of G consecutive rows only (with the margin,
  the group's own Ḡ); value and token-feature gradients equal float64 NumPy on the groups, the global term L_HN is
  unchanged; G = B is the global-batch term; a G that does not divide the batch is refused by name."""
  out = _outputs(2)
  s, it, tt, m = float(out["scale"]), out["img_tokens"], out["txt_tokens"], out["txt_mask"]
  hn = np_reference(out["img"], out["txt"], s, 0.5)[0]

  def grouped(it, tt):
    parts = []
    for k in range(0, 6, group):
      t = out["txt"][k:k + group].astype(np.float64)
      g = t @ t.T
      np.fill_diagonal(g, 0.0)
      parts.append(np_token_loss(it[k:k + group], tt[k:k + group], m[k:k + group], s, margin=0.5 * g))
    return float(np.mean(parts))  # equal groups: the mean over groups is the mean over all rows

  obj = Objective.of(gamma=0.5, token_weight=1.0, token_margin=True, token_group=group, chunk_size=chunk)
  got, g = _value_and_grads(obj, out)
  np.testing.assert_allclose(got, hn + grouped(it, tt), rtol=1e-5)
  assert abs(grouped(it, tt) - np_token_loss(it, tt, m, s)) > 1e-3  # the groups really change the term
  np.testing.assert_allclose(g["img_tokens"], _numeric_grad(lambda x: grouped(x, tt), it), rtol=1e-3, atol=2e-6)
  np.testing.assert_allclose(g["txt_tokens"], _numeric_grad(lambda x: grouped(it, x), tt), rtol=1e-3, atol=2e-6)
  whole, _ = _value_and_grads(Objective.of(gamma=0.5, token_weight=1.0, token_group=6), out)
  plain, _ = _value_and_grads(Objective.of(gamma=0.5, token_weight=1.0), out)
  np.testing.assert_allclose(whole, plain, rtol=1e-6)
  with pytest.raises(ValueError, match=r"config.loss.token_group=4 must divide the per-device batch 6"):
    _value_and_grads(Objective.of(gamma=0.5, token_weight=1.0, token_group=4), out)


def np_select(tokens, emb, keep, mask=None):
  """token_keep's rule in NumPy: each example's ceil(keep·T) tokens with the largest <token, own embedding>, best
  first; with a mask, real tokens only and each example's quota ceil(K·n/T) of its n real ones. -> (index [B, K]
  into the token axis, kept mask [B, K])."""
  b, t = tokens.shape[:2]
  k = int(np.ceil(keep * t - 1e-9))
  score = np.einsum("bte,be->bt", tokens.astype(np.float64), emb.astype(np.float64))
  if mask is not None:
    score = np.where(mask, score, -np.inf)
  idx = np.argsort(-score, axis=1, kind="stable")[:, :k]
  if mask is None:
    return idx, np.ones((b, k), bool)
  quota = np.maximum(1, np.ceil(k * mask.sum(1) / t))
  return idx, np.arange(k)[None] < quota[:, None]


@pytest.mark.parametrize("keep,group", [(0.5, 0), (0.3, 3)])
def test_token_keep_matches_numpy(keep, group):
  """token_keep=f: the token term on each example's kept tokens (NumPy's ranking by the example's own embedding),
  with the margin and with groups; gradients reach exactly the kept tokens; f = 1 is the whole term."""
  out = _outputs(4, p=6, l=9)
  s, it, tt, m = float(out["scale"]), out["img_tokens"], out["txt_tokens"], out["txt_mask"]
  hn = np_reference(out["img"], out["txt"], s, 0.5)[0]
  i_idx, _ = np_select(it, out["img"], keep)
  t_idx, t_mask = np_select(tt, out["txt"], keep, m)
  rows = np.arange(6)[:, None]
  assert 0 < t_mask.sum() < m.sum() and t_mask.shape[1] < m.shape[1]  # captions lose tokens, none all of them

  def term(it, tt):
    ki, kt = it[rows, i_idx], tt[rows, t_idx]
    parts = []
    for k in range(0, 6, group or 6):
      sl = slice(k, k + (group or 6))
      g = out["txt"][sl].astype(np.float64) @ out["txt"][sl].T.astype(np.float64)
      np.fill_diagonal(g, 0.0)
      parts.append(np_token_loss(ki[sl], kt[sl], t_mask[sl], s, margin=0.5 * g))
    return float(np.mean(parts))

  obj = Objective.of(gamma=0.5, token_weight=1.0, token_margin=True, token_group=group, token_keep=keep)
  selected = lambda o, mesh: obj({**o, **obj.term(TokenTerm).outputs(None, o, None)}, mesh)  # what `forward` does before the loss  # noqa: E731
  got, g = _value_and_grads(selected, out)
  np.testing.assert_allclose(got, hn + term(it, tt), rtol=1e-5)
  np.testing.assert_allclose(g["img_tokens"], _numeric_grad(lambda x: term(x, tt), it), rtol=1e-3, atol=2e-6)
  np.testing.assert_allclose(g["txt_tokens"], _numeric_grad(lambda x: term(it, x), tt), rtol=1e-3, atol=2e-6)
  kept_i = np.zeros(it.shape[:2], bool)
  kept_i[rows, i_idx] = True
  kept_t = np.zeros(tt.shape[:2], bool)
  kept_t[rows, t_idx] = t_mask
  norm = lambda x: np.abs(np.asarray(x)).sum(-1)
  assert np.all(norm(g["img_tokens"])[~kept_i] == 0) and np.all(norm(g["img_tokens"])[kept_i] > 0)
  assert np.all(norm(g["txt_tokens"])[~kept_t] == 0) and np.all(norm(g["txt_tokens"])[kept_t] > 0)
  whole, _ = _value_and_grads(obj.with_term(TokenTerm, token_keep=1.0), out)
  assert abs(got - whole) > 1e-3  # the selection really changes the term
  full, _ = _value_and_grads(Objective.of(gamma=0.5, token_weight=1.0, token_margin=True, token_group=group), out)
  np.testing.assert_allclose(whole, full, rtol=1e-6)


def test_token_weight_zero_is_exactly_the_hn_loss_and_asks_for_no_tokens():
  out = _outputs(2)
  obj = Objective.of(gamma=0.5, token_weight=0.0)
  got, aux = obj({k: out[k] for k in ("img", "txt", "scale")}, MESH)
  # Bit for bit the loss the train step used before the token term existed: psum of the rows' sums over 2B ...
  i2t, t2i = losses.contrastive_rows(out["img"], out["txt"], out["img"], out["txt"], jnp.float32(7.0), 0.5, 0)
  assert float(got) == float((jnp.sum(i2t) + jnp.sum(t2i)) / 12)
  np.testing.assert_allclose(got, losses.hn_clip_loss(out["img"], out["txt"], out["scale"], 0.5), rtol=1e-6)
  # ... and the L_HN part of the objective with the token term on.
  _, aux_tok = Objective.of(gamma=0.5, token_weight=1.0)(out, MESH)
  assert float(aux_tok["terms"]["hn"]) == float(got)
  assert obj.model_kwargs == {} and set(aux["terms"]) == {"hn"}
  with_tok = Objective.of(gamma=0.5, token_weight=1.0)
  assert with_tok.model_kwargs == {"token_layer": -1, "image_cls_token": False}


def test_one_device_never_holds_the_pairwise_token_tensor():
  b, p, l, e = 64, 16, 12, 8
  out = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in
         {"img": (b, e), "txt": (b, e), "img_tokens": (b, p, e), "txt_tokens": (b, l, e)}.items()}
  f = lambda o, m: Objective.of(token_weight=1.0)({**o, "txt_mask": m, "scale": jnp.float32(10.0)}, MESH)[0]
  hlo = jax.jit(jax.value_and_grad(f)).lower(out, jax.ShapeDtypeStruct((b, l), jnp.bool_)).compile().as_text()
  sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"[fs]\d+\[([\d,]*)\]", hlo)]
  assert max(sizes) <= losses.TOKEN_BLOCK ** 2 * p * l < b * b * p * l


def _dots(lowered_text):
  return [line for line in lowered_text.splitlines() if "stablehlo.dot_general" in line]


def test_loss_dot_products_run_at_full_fp32_precision():
  """Every dot product of the loss (S, Ḡ, token similarities, and their gradients) asks for HIGHEST precision on
  fp32 features, so TPU's default bf16 passes / GPU's TF32 cannot round the margin; bf16 token features
  (config.dtype=bfloat16) are multiplied in bf16 and accumulated into fp32."""
  out = _outputs(3)
  floats = {k: v for k, v in out.items() if k != "txt_mask"}
  f = lambda fl: Objective.of(token_weight=1.0)({**fl, "txt_mask": out["txt_mask"]}, MESH)[0]
  dots = _dots(jax.jit(jax.value_and_grad(f)).lower(floats).as_text())
  assert len(dots) >= 10 and all("precision = [HIGHEST, HIGHEST]" in d for d in dots), dots
  half = {**floats, **{k: floats[k].astype(jnp.bfloat16) for k in ("img_tokens", "txt_tokens")}}
  dots = _dots(jax.jit(f).lower(half).as_text())
  bf16 = [d for d in dots if "bf16>, tensor" in d]
  assert len(bf16) == 1 and all(re.search(r"-> tensor<[\dx]+xf32>", d) for d in bf16), bf16
  assert all("precision = [HIGHEST, HIGHEST]" in d for d in dots if d not in bf16)


CFG = CLIPConfig(embed_dim=16, image_size=16, patch_size=8, vision_width=32, vision_layers=2, vision_heads=4,
                 vision_mlp_dim=64, text_context=8, vocab_size=64, text_width=32, text_layers=2, text_heads=4,
                 text_mlp_dim=64, eot_token_id=3)


@pytest.fixture(scope="module")
def tiny():
  graphdef, params = init_params(CFG, 0)
  r = np.random.default_rng(0)
  lengths = np.array([2, 8, 5, 3])
  tokens = np.where(np.arange(8)[None] < lengths[:, None] - 1, r.integers(4, 64, (4, 8)), 0)
  tokens[:, 0], tokens[np.arange(4), lengths - 1] = 2, 3
  return graphdef, params, r.normal(size=(4, 16, 16, 3)).astype(np.float32), tokens.astype(np.int32), lengths


def test_model_outputs_dict(tiny):
  graphdef, params, pixels, tokens, lengths = tiny
  m = bind(graphdef, params)
  plain = m(pixels, tokens)
  assert set(plain) == {"img", "txt", "scale"}
  out = m(pixels, tokens, token_layer=-1, image_cls_token=True)
  np.testing.assert_array_equal(out["txt_mask"], np.arange(8)[None] < lengths[:, None])  # through the end token
  assert out["img_tokens"].shape == (4, 1 + 4, 16) and out["txt_tokens"].shape == (4, 8, 16)
  np.testing.assert_allclose(np.linalg.norm(out["txt_tokens"], axis=-1), 1.0, rtol=1e-5)
  # Same final LayerNorm and projection as the pooled embeddings: CLS token = image embedding, end token = text's.
  np.testing.assert_allclose(out["img_tokens"][:, 0], plain["img"], atol=1e-6)
  np.testing.assert_allclose(np.asarray(out["txt_tokens"])[np.arange(4), lengths - 1], plain["txt"], atol=1e-6)
  np.testing.assert_allclose(plain["img"], m.encode_image(pixels), atol=1e-7)  # eval's embeddings: same path
  assert m(pixels, tokens, token_layer=-1)["img_tokens"].shape == (4, 4, 16)  # patches only by default
  early = m(pixels, tokens, token_layer=0)
  assert np.abs(np.asarray(early["txt_tokens"]) - np.asarray(out["txt_tokens"])).max() > 1e-2
  with pytest.raises(ValueError, match="config.loss.token_layer=2 is outside"):
    Objective.of(token_weight=1.0, token_layer=2).check(CFG)


def test_separate_token_projection_starts_equal_and_learns_on_its_own(tiny):
  """config.model.token_projection="separate": the token features get their own projections, initialised as
  copies (same features at the start); only the token term sends them gradient; a pretrained model gains them."""
  import dataclasses
  from hnclip_jax.pretrained import Pretrained
  graphdef, params, pixels, tokens, _ = tiny
  sep_cfg = dataclasses.replace(CFG, token_projection="separate")
  sep_graphdef, sep_params = init_params(sep_cfg, 0)
  a = bind(graphdef, params)(pixels, tokens, token_layer=-1)
  b = bind(sep_graphdef, sep_params)(pixels, tokens, token_layer=-1)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  grad = lambda obj: jax.jit(jax.grad(lambda p: obj(bind(sep_graphdef, p)(pixels, tokens, **obj.model_kwargs),
                                                     MESH)[0]))(sep_params)
  assert np.abs(grad(Objective.of(token_weight=1.0))["text_token_projection"]).max() > 0
  assert np.abs(grad(Objective.of(token_weight=0.0))["text_token_projection"]).max() == 0
  pre = Pretrained(CFG, params, None, "test").with_token_projection("separate")
  np.testing.assert_array_equal(pre.params["visual_token_projection"], params["visual_projection"])
  with pytest.raises(ValueError, match="would drop them"):
    pre.with_token_projection("shared")


def _step(graphdef, params, tx, **optimizer):
  config = config_lib.base_config()
  config.optimizer.update(optimizer)
  state = train_step.init_state(jax.tree.map(lambda x: jnp.array(x, copy=True), params), tx)  # the step donates
  sh = sharding.state_shardings(jax.eval_shape(lambda: state), "params", MESH,
                                sharding.parse_rules(sharding.DEFAULT_RULES))
  step = train_step.make_train_step(graphdef, tx, MESH, config, optim.lr_schedule(config.optimizer, 10), sh)
  return step, jax.device_put(state, sh)


def test_logit_scale_moves_down_from_a_real_long_clip_value(tiny):
  """Long-CLIP stores logit_scale = 4.6052 (s = 100.003, above the clamp). Its gradient must act: one AdamW step
  whose gradient says 'lower s' (a random model is over-confident at s = 100) lowers it by about lr."""
  graphdef, params, pixels, tokens, _ = tiny
  params = dict(params, logit_scale=jnp.float32(4.6052))
  config = config_lib.base_config()
  config.optimizer.update(dict(lr=0.05, warmup_steps=0))
  g = jax.jit(jax.grad(lambda p: Objective.of()(bind(graphdef, p)(pixels, tokens), MESH)[0]))(params)["logit_scale"]
  assert float(g) > 0  # the loss falls as s falls
  step, state = _step(graphdef, params, optim.make_optimizer(config.optimizer, 10), lr=0.05, warmup_steps=0)
  state, metrics = step(state, {"image": pixels, "tokens": tokens})
  assert float(metrics["logit_scale"]) == pytest.approx(np.exp(4.6052), rel=1e-6)  # reported before the update
  assert float(state["params"]["logit_scale"]) < LOGIT_SCALE_PARAM_MAX - 0.03


def test_logit_scale_never_exceeds_100_and_can_be_frozen(tiny):
  graphdef, params, pixels, tokens, _ = tiny
  params = dict(params, logit_scale=jnp.float32(4.5))
  push_up = optax.stateless(lambda updates, _: jax.tree.map(lambda u: jnp.full_like(u, 0.5), updates))
  step, state = _step(graphdef, params, push_up)
  for _ in range(2):
    state, _ = step(state, {"image": pixels, "tokens": tokens})
  assert float(jnp.exp(state["params"]["logit_scale"])) <= 100.0 + 1e-4
  assert float(state["params"]["logit_scale"]) == pytest.approx(LOGIT_SCALE_PARAM_MAX)
  # Frozen: bit-identical after several steps, and no optimizer moments for it.
  config = config_lib.base_config()
  config.optimizer.update(dict(lr=0.05, warmup_steps=0, train_logit_scale=False))
  tx = optim.make_optimizer(config.optimizer, 10)
  frozen = dict(params, logit_scale=jnp.float32(4.6052))
  step, state = _step(graphdef, frozen, tx, lr=0.05, warmup_steps=0, train_logit_scale=False)
  before_other = np.asarray(state["params"]["text_projection"]).copy()
  for _ in range(3):
    state, _ = step(state, {"image": pixels, "tokens": tokens})
  assert np.asarray(state["params"]["logit_scale"]).tobytes() == np.float32(4.6052).tobytes()
  assert not np.array_equal(np.asarray(state["params"]["text_projection"]), before_other)
  moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim == 0 and x.dtype == jnp.float32]
  assert moments == []  # AdamW's mu/nu of a scalar parameter would be fp32 scalars


IMAGE_TOWER = "^(vision/|patch_embed|class_embedding|vision_positions|ln_pre|ln_post|visual_projection)"


def test_freeze_the_image_tower(tiny):
  """config.finetune.freeze (LiT): the frozen tower is bit-identical after several full train steps, the text tower
  moves, and AdamW keeps moments only for the trained parameters."""
  graphdef, params, pixels, tokens, _ = tiny
  config = config_lib.base_config()
  config.optimizer.update(dict(lr=0.05, warmup_steps=0))
  tx = optim.make_optimizer(config.optimizer, 10, freeze=(IMAGE_TOWER,))
  step, state = _step(graphdef, params, tx, lr=0.05, warmup_steps=0)
  before = jax.tree.map(lambda x: np.asarray(x).copy(), state["params"])
  for _ in range(3):
    state, _ = step(state, {"image": pixels, "tokens": tokens})
  flat = {optim.param_path(p): (np.asarray(x), before_x) for (p, x), before_x in zip(
      jax.tree_util.tree_flatten_with_path(state["params"])[0], jax.tree.leaves(before))}
  frozen = [k for k in flat if re.search(IMAGE_TOWER, k)]
  assert len(frozen) > 10 and all(flat[k][0].tobytes() == flat[k][1].tobytes() for k in frozen)
  assert not np.array_equal(*flat["text/blocks/0/fc1/kernel"])
  trained = [v[0] for k, v in flat.items() if k not in frozen]
  adam = [s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)]
  assert len(adam) == 1
  mu = jax.tree.leaves(adam[0].mu)  # frozen leaves are optax.MaskedNode: no arrays
  assert sorted(x.size for x in mu) == sorted(x.size for x in trained)
  with pytest.raises(ValueError, match=r"config.finetune.freeze: '\^visoin/' matches no parameter"):
    train_step.init_state(params, optim.make_optimizer(config.optimizer, 10, freeze=("^visoin/",)))


def _one_adamw_update(opt_overrides, params, grads):
  config = config_lib.base_config()
  config.optimizer.update(dict(lr=0.01, warmup_steps=0, grad_clip_norm=0.0, weight_decay=0.1, **opt_overrides))
  tx = optim.make_optimizer(config.optimizer, 10)
  updates, _ = tx.update(grads, tx.init(params), params)
  return {optim.param_path(p): np.asarray(u) for p, u in jax.tree_util.tree_flatten_with_path(updates)[0]}


def _adamw_first_step(g, p, lr, wd, eps=1e-6):
  """AdamW's first update by hand: bias-corrected m = g, v = g², so g / (|g| + eps); decay on matrices only."""
  g, p = np.asarray(g, np.float64), np.asarray(p, np.float64)
  return -lr * (g / (np.abs(g) + eps) + (wd * p if p.ndim >= 2 else 0))


def test_lr_multipliers_and_layer_decay_against_hand_computed_updates(tiny):
  _, params, _, _, _ = tiny
  r = np.random.default_rng(0)
  grads = jax.tree.map(lambda x: jnp.asarray(r.normal(size=x.shape), x.dtype), params)
  flat_p = {optim.param_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  flat_g = {optim.param_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(grads)[0]}
  depth_v = len(params["vision"]["blocks"])
  depth_t = len(params["text"]["blocks"])
  # (rule, factor) pairs: the first matching regex wins.
  mult = (("^vision/blocks/0/", 0.5), ("^vision/", 0.1), ("projection", 2.0))
  got = _one_adamw_update({"lr_multipliers": mult}, params, grads)
  for k, u in got.items():
    f = 0.5 if k.startswith("vision/blocks/0/") else 0.1 if k.startswith("vision/") else 2.0 if "projection" in k \
        else 1.0
    np.testing.assert_allclose(u, f * _adamw_first_step(flat_g[k], flat_p[k], 0.01, 0.1), rtol=1e-5, atol=1e-9,
                               err_msg=k)
  # Layer decay d: block i of a tower with L blocks gets d^(L - i), its embeddings d^(L + 1), heads 1.
  d = 0.5
  got = _one_adamw_update({"layer_decay": d, "lr_multipliers": (("^text_projection$", 3.0),)}, params, grads)
  want_factor = {"vision/blocks/0/fc1/kernel": d ** depth_v, f"vision/blocks/{depth_v - 1}/attn/q/bias": d,
                 "text/blocks/0/ln1/scale": d ** depth_t, "patch_embed/kernel": d ** (depth_v + 1),
                 "class_embedding": d ** (depth_v + 1), "token_embedding/embedding": d ** (depth_t + 1),
                 "text_positions": d ** (depth_t + 1), "ln_final/scale": 1.0, "visual_projection": 1.0,
                 "text_projection": 3.0, "logit_scale": 1.0}
  for k, f in want_factor.items():
    np.testing.assert_allclose(got[k], f * _adamw_first_step(flat_g[k], flat_p[k], 0.01, 0.1), rtol=1e-5,
                               atol=1e-9, err_msg=k)
  with pytest.raises(ValueError, match="lr_multipliers: 'nothing_here' matches no parameter"):
    _one_adamw_update({"lr_multipliers": (("nothing_here", 2.0),)}, params, grads)
  with pytest.raises(ValueError, match="is not a \\(regex, factor >= 0\\) pair"):
    _one_adamw_update({"lr_multipliers": ("^vision/",)}, params, grads)


def test_checkpoints_from_before_token_projection_still_resume():
  """Workdirs written before config.model.token_projection existed have no such field: it reads as the default."""
  import dataclasses
  from hnclip_jax import workdir
  old = {k: v for k, v in dataclasses.asdict(CFG).items() if k != "token_projection"}
  workdir.check_model_compatible(old, CFG, "old checkpoint")
  with pytest.raises(ValueError, match="token_projection: checkpoint='shared', config='separate'"):
    workdir.check_model_compatible(old, dataclasses.replace(CFG, token_projection="separate"), "old")
