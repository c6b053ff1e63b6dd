"""Fast paths stay within tolerance of the reference path: bf16 compute, rematerialisation, attention kernels."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ml_collections
from flax import nnx

from hnclip_jax import config as config_lib, experiment, losses
from hnclip_jax.models import CLIPConfig, bind, init_params
from hnclip_jax.models.clip import Attention

CFG = CLIPConfig(embed_dim=32, image_size=32, patch_size=8, vision_width=64, vision_layers=2, vision_heads=4,
                 vision_mlp_dim=128, text_context=16, vocab_size=100, text_width=64, text_layers=2, text_heads=4,
                 text_mlp_dim=128, eot_token_id=3)


@pytest.fixture(scope="module")
def setup():
  _, params = init_params(CFG, 0)
  r = np.random.default_rng(0)
  pixels = r.normal(size=(8, 32, 32, 3)).astype(np.float32)
  tokens = np.concatenate([np.full((8, 1), 2), r.integers(4, 100, (8, 10)), np.full((8, 1), 3),
                           np.zeros((8, 4), np.int64)], 1).astype(np.int32)
  return params, pixels, tokens


def loss_and_grads(cfg, params, pixels, tokens):
  graphdef, _ = init_params(cfg, 0)

  def loss(p):
    m = bind(graphdef, p)
    return losses.hn_clip_loss(m.encode_image(pixels), m.encode_text(tokens), m.scale(), 0.5)

  return jax.jit(jax.value_and_grad(loss))(params)


def test_bf16_close_to_fp32(setup):
  params, pixels, tokens = setup
  f32 = bind(init_params(CFG, 0)[0], params)
  b16 = bind(init_params(dataclasses.replace(CFG, dtype="bfloat16"), 0)[0], params)
  for a, b in ((f32.encode_image(pixels), b16.encode_image(pixels)), (f32.encode_text(tokens), b16.encode_text(tokens))):
    assert b.dtype == jnp.float32  # embeddings leave the towers in fp32
    cos = np.sum(np.asarray(a) * np.asarray(b), axis=1)
    assert cos.min() > 0.99, cos
  l32, _ = loss_and_grads(CFG, params, pixels, tokens)
  l16, g16 = loss_and_grads(dataclasses.replace(CFG, dtype="bfloat16"), params, pixels, tokens)
  assert abs(float(l16) - float(l32)) / float(l32) < 0.02
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g16))  # fp32 parameters and gradients


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_gives_the_same_gradients(setup, policy):
  params, pixels, tokens = setup
  l0, g0 = loss_and_grads(CFG, params, pixels, tokens)
  l1, g1 = loss_and_grads(dataclasses.replace(CFG, remat=policy), params, pixels, tokens)
  assert float(l1) == pytest.approx(float(l0), rel=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bad_dtype_and_remat_are_named():
  with pytest.raises(ValueError, match="config.remat='some'"):
    dataclasses.replace(CFG, remat="some").validate()
  with pytest.raises(ValueError, match="config.dtype='float16'"):
    dataclasses.replace(CFG, dtype="float16").validate()


def numpy_attention(x, attn, causal):
  """Multi-head self-attention in float64 NumPy, from the module's projection weights."""
  x = np.asarray(x, np.float64)
  proj = lambda lin: x @ np.asarray(lin.kernel[...], np.float64) + np.asarray(lin.bias[...], np.float64)
  b, l, w = x.shape
  h = attn.heads
  q, k, v = (proj(lin).reshape(b, l, h, w // h) for lin in (attn.q, attn.k, attn.v))
  s = np.einsum("blhd,bmhd->bhlm", q, k) / np.sqrt(w // h)
  if causal:
    s = np.where(np.tril(np.ones((l, l), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  o = np.einsum("bhlm,bmhd->blhd", p, v).reshape(b, l, w)
  return o @ np.asarray(attn.out.kernel[...], np.float64) + np.asarray(attn.out.bias[...], np.float64)


@pytest.mark.parametrize("impl", ["auto", "einsum", "xla"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_implementations_match_numpy(impl, causal):
  attn = Attention(64, 4, dtype=jnp.float32, rngs=nnx.Rngs(0), implementation=impl)
  x = np.random.default_rng(1).normal(size=(3, 11, 64)).astype(np.float32)
  np.testing.assert_allclose(attn(jnp.asarray(x), causal), numpy_attention(x, attn, causal), rtol=1e-4, atol=1e-5)


def test_bad_attention_is_named():
  with pytest.raises(ValueError, match="config.attention='flash'"):
    dataclasses.replace(CFG, attention="flash").validate()
  with pytest.raises(ValueError, match="needs config.dtype='bfloat16'"):
    dataclasses.replace(CFG, attention="cudnn").validate()
  run = ml_collections.ConfigDict({"dtype": "bfloat16", "remat": "none", "attention": "cudnn"})
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
      experiment.runtime(CFG, run)
  else:
    assert experiment.runtime(CFG, run).attention == "cudnn"


def test_compute_settings_fail_in_config_validation():
  """A typo in config.dtype/remat/attention stops the run before any data is built or compiled."""
  for key, bad in (("dtype", "fp16"), ("remat", "some"), ("attention", "flash")):
    c = config_lib.base_config()
    c[key] = bad
    with pytest.raises(ValueError, match=f"config.{key}='{bad}'"):
      config_lib.validate(c)
  config_lib.validate(config_lib.base_config())  # the defaults pass


def test_train_step_skips_nonfinite_in_place_and_uses_cpu_options(setup):
  """The compiled step guards the update with a cond (a non-finite batch leaves params and optimizer state
  bit-identical, a finite one changes them) and, on a CPU mesh, is compiled with sharding.CPU_COMPILER_OPTIONS."""
  from hnclip_jax import optim, sharding, train_step
  params, pixels, tokens = setup
  graphdef, _ = init_params(CFG, 0)
  run = config_lib.base_config()
  run.optimizer.update(dict(lr=1e-3, warmup_steps=0))
  opt = run.optimizer
  tx = optim.make_optimizer(opt, 10)
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1}), jax.devices()[:1])
  state = train_step.init_state(params, tx)
  sh = sharding.state_shardings(jax.eval_shape(lambda: state), "params", mesh,
                                sharding.parse_rules(sharding.DEFAULT_RULES))
  step = train_step.make_train_step(graphdef, tx, mesh, run, optim.lr_schedule(opt, 10), sh)
  state = jax.device_put(state, sh)
  before = jax.tree.map(np.asarray, state)
  bad = pixels.copy()
  bad[0, 0, 0, 0] = np.nan
  assert "__ynn_fusion" not in step.lower(state, {"image": bad, "tokens": tokens}).compile().as_text()
  state, m = step(state, {"image": bad, "tokens": tokens})
  assert not np.isfinite(float(m["loss"])) and int(state["nonfinite_steps"]) == 1 and int(state["step"]) == 1
  for a, b in zip(jax.tree.leaves(before["params"]) + jax.tree.leaves(before["opt_state"]),
                  jax.tree.leaves(state["params"]) + jax.tree.leaves(state["opt_state"])):
    np.testing.assert_array_equal(a, b)
  state, m = step(state, {"image": pixels, "tokens": tokens})
  assert np.isfinite(float(m["loss"])) and int(state["nonfinite_steps"]) == 1
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before["params"]),
                                                      jax.tree.leaves(state["params"]))]
  assert all(changed)
