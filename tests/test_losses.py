"""HN-CLIP loss against an independent float64 NumPy reference (values and analytic gradients)."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from hnclip_jax import losses
from conftest import run_py


def _normalize(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def np_reference(v, t, s, gamma):
  """Paper Eq. 2 in float64. Returns (loss, dloss/dv, dloss/dt) with Ḡ treated as a constant."""
  v, t = v.astype(np.float64), t.astype(np.float64)
  b = v.shape[0]
  S = v @ t.T
  G = t @ t.T
  np.fill_diagonal(G, 0.0)
  L = s * (S + gamma * G)

  def log_softmax(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))

  lr, lc = log_softmax(L, 1), log_softmax(L, 0)
  loss = 0.5 * (-np.mean(np.diag(lr)) - np.mean(np.diag(lc)))
  # d loss / d L_ij = (P_row - I + P_col - I) / (2B); S enters L with factor s; Ḡ carries no gradient.
  M = (np.exp(lr) - np.eye(b) + np.exp(lc) - np.eye(b)) / (2 * b)
  return loss, s * M @ t, s * M.T @ v


def _emb(seed, b=12, d=16, near_dup=0.0):
  r = np.random.default_rng(seed)
  v = _normalize(r.normal(size=(b, d)))
  t = r.normal(size=(b, d))
  if near_dup:  # captions that are almost copies of one another
    t = t[:1] + near_dup * t
  return v.astype(np.float32), _normalize(t).astype(np.float32)


@pytest.mark.parametrize("gamma", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("s", [1.0, 14.3, 100.0])
def test_values_and_gradients_match_numpy(gamma, s):
  v, t = _emb(int(gamma * 100 + s))
  want, dv, dt = np_reference(v, t, s, gamma)
  got, (gv, gt) = jax.value_and_grad(losses.hn_clip_loss, argnums=(0, 1))(v, t, s, gamma)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(gv, dv, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(gt, dt, rtol=1e-4, atol=1e-6)


def _infonce_float64(v, t, s):
  """CLIP's symmetric InfoNCE written out on its own (no margin term at all), in float64."""
  logits = s * np.asarray(v, np.float64) @ np.asarray(t, np.float64).T
  def ce(x):
    x = x - x.max(axis=1, keepdims=True)
    return float(np.mean(np.log(np.exp(x).sum(axis=1)) - np.diag(x)))
  return 0.5 * (ce(logits) + ce(logits.T))


def test_gamma_zero_is_plain_clip():
  v, t = _emb(1)
  want = _infonce_float64(v, t, 20.0)
  for got in (losses.hn_clip_loss(v, t, 20.0, 0.0), losses.clip_loss(v, t, 20.0),
              jax.jit(losses.hn_clip_loss)(v, t, 20.0, jnp.float32(0.0))):  # a traced γ = 0 too
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
  # And the margin is active for gamma > 0 (the loss moves away from InfoNCE).
  assert abs(float(losses.hn_clip_loss(v, t, 20.0, 0.5)) - want) > 1e-3


def test_no_gradient_flows_through_margin():
  v, t = _emb(3)
  _, gt = jax.grad(losses.hn_clip_loss, argnums=(0, 1))(v, t, 20.0, 0.5)

  def leaky(v, t):  # the same loss with the stop_gradient removed
    S, G = v @ t.T, t @ t.T
    L = 20.0 * (S + 0.5 * G * (1 - jnp.eye(len(v))))
    lab = jnp.arange(len(v))
    ce = lambda x: jnp.mean(jax.nn.logsumexp(x, 1) - x[lab, lab])
    return 0.5 * (ce(L) + ce(L.T))

  _, gt_leaky = jax.grad(leaky, argnums=(0, 1))(v, t)
  _, _, dt_ref = np_reference(v, t, 20.0, 0.5)
  np.testing.assert_allclose(gt, dt_ref, rtol=1e-4, atol=1e-6)
  assert np.abs(np.asarray(gt_leaky) - dt_ref).max() > 1e-3  # the reference can tell the difference


def test_margin_skips_the_positive():
  """Adding a constant to the diagonal of Ḡ must not change the loss: only negatives get a margin."""
  v, t = _emb(4)
  # Equal text embeddings make G all ones; with the diagonal masked, every negative gets +γ.
  t_same = np.repeat(t[:1], len(t), axis=0)
  got = losses.hn_clip_loss(v, t_same, 10.0, 0.5)
  want, *_ = np_reference(v, t_same, 10.0, 0.5)
  np.testing.assert_allclose(got, want, rtol=2e-5)
  assert float(got) > float(losses.clip_loss(v, t_same, 10.0)) + 1.0


def test_fp32_safe_at_scale_100_with_near_identical_captions():
  v, t = _emb(5, b=64, d=32, near_dup=1e-3)
  assert (t @ t.T).min() > 0.999  # really near-identical
  got, (gv, gt) = jax.value_and_grad(losses.hn_clip_loss, argnums=(0, 1))(v, t, 100.0, 1.0)
  assert np.isfinite(got) and np.all(np.isfinite(gv)) and np.all(np.isfinite(gt))
  want, dv, _ = np_reference(v, t, 100.0, 1.0)
  np.testing.assert_allclose(got, want, rtol=1e-4)
  np.testing.assert_allclose(gv, dv, rtol=1e-3, atol=1e-5)
  # Saturated easy case: huge margins, loss ~ 0 but no NaN.
  e = np.eye(8, dtype=np.float32)
  sat = losses.hn_clip_loss(e, e, 100.0, 0.5)
  assert np.isfinite(sat) and float(sat) < 1e-30 + 1e-4


def test_bf16_inputs_are_computed_in_fp32():
  v, t = _emb(6)
  got = losses.hn_clip_loss(jnp.asarray(v, jnp.bfloat16), jnp.asarray(t, jnp.bfloat16), 50.0, 0.5)
  assert got.dtype == jnp.float32
  want, *_ = np_reference(np.asarray(jnp.asarray(v, jnp.bfloat16), np.float64),
                          np.asarray(jnp.asarray(t, jnp.bfloat16), np.float64), 50.0, 0.5)
  np.testing.assert_allclose(got, want, rtol=1e-4)


SHARDED = r"""
import itertools, json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hnclip_jax import losses
from hnclip_jax.objective import Objective, embedding_outputs
r = np.random.default_rng(0)
v = r.normal(size=(32, 16)); v /= np.linalg.norm(v, axis=1, keepdims=True)
t = r.normal(size=(32, 16)); t = t[:1] + 0.3 * t; t /= np.linalg.norm(t, axis=1, keepdims=True)
v, t = v.astype(np.float32), t.astype(np.float32)
dense = jax.value_and_grad(losses.hn_clip_loss, argnums=(0, 1))(v, t, 30.0, 0.5)
out = {}
for shape in [(8, 1, 1), (2, 4, 1), (1, 8, 1), (2, 2, 2), (4, 1, 2)]:
  mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "fsdp", "tensor"))
  sh = NamedSharding(mesh, P(("data", "fsdp")))
  f = lambda a, b: Objective.of(gamma=0.5)(embedding_outputs(a, b, 30.0), mesh)[0]
  val, (gv, gt) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(jax.device_put(v, sh), jax.device_put(t, sh))
  out[str(shape)] = [abs(float(val) - float(dense[0])) / abs(float(dense[0])),
                     float(np.abs(np.asarray(gv) - np.asarray(dense[1][0])).max()),
                     float(np.abs(np.asarray(gt) - np.asarray(dense[1][1])).max()),
                     float(np.abs(np.asarray(dense[1][1])).max())]
print("RESULT", json.dumps(out))
"""


def test_sharded_loss_equals_single_device_on_8_devices():
  proc = run_py(["-c", SHARDED], devices=8)
  res = __import__("json").loads(proc.stdout.split("RESULT", 1)[1])
  assert len(res) == 5
  for layout, (rel, dv, dt, scale) in res.items():
    assert rel <= 1e-5, layout
    assert dv <= 1e-5 * max(scale, 1.0) and dt <= 1e-5 * max(scale, 1.0), (layout, dv, dt)


# ---- HN-SigLIP: the margin in SigLIP's sigmoid loss ---------------------------------------------------------------

def np_sigmoid_reference(v, t, scale, bias, gamma):
  """Σ_ij -log σ(y_ij z_ij) / B in float64, z = scale·(S + γ·Ḡ) + bias, y = 2I - 1, Ḡ = tᵀt without its diagonal
  and constant. Returns (loss, d/dv, d/dt, d/dscale, d/dbias)."""
  v, t = v.astype(np.float64), t.astype(np.float64)
  b = v.shape[0]
  y = 2 * np.eye(b) - 1
  S = v @ t.T
  G = t @ t.T
  np.fill_diagonal(G, 0.0)
  z = scale * (S + gamma * G) + bias
  loss = np.sum(np.logaddexp(0.0, -y * z)) / b  # -log σ(x) = log(1 + e^-x)
  dz = -y / (1 + np.exp(y * z)) / b  # d/dz of log(1 + e^{-yz}) = -y σ(-yz)
  return loss, scale * dz @ t, scale * dz.T @ v, float(np.sum(dz * (S + gamma * G))), float(np.sum(dz))


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("scale,bias", [(10.0, -10.0), (3.0, 0.5), (117.0, -12.5)])
def test_sigmoid_values_and_gradients_match_numpy(gamma, scale, bias):
  v, t = _emb(int(gamma * 10 + scale), b=10, near_dup=0.5)
  want = np_sigmoid_reference(v, t, scale, bias, gamma)
  got, grads = jax.jit(jax.value_and_grad(losses.siglip_loss, argnums=(0, 1, 2, 3)), static_argnums=4)(
      v, t, jnp.float32(scale), jnp.float32(bias), gamma)
  np.testing.assert_allclose(got, want[0], rtol=2e-5, atol=1e-6)
  for g, w in zip(grads, want[1:]):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_sigmoid_gamma_zero_is_plain_siglip_and_the_margin_spares_the_positives():
  v, t = _emb(3, b=9)
  scale, bias = jnp.float32(10.0), jnp.float32(-10.0)
  plain = jax.jit(lambda a: losses.sigmoid_rows(a, t, t, scale, bias, 0.0, 0))(v)  # a Python 0: no margin code
  traced = jax.jit(lambda a, g: losses.sigmoid_rows(a, t, t, scale, bias, g, 0))(v, jnp.float32(0.0))  # margin·0
  assert np.asarray(plain).tobytes() == np.asarray(traced).tobytes()
  np.testing.assert_allclose(losses.siglip_loss(v, t, scale, bias), np_sigmoid_reference(v, t, 10.0, -10.0, 0.0)[0],
                             rtol=1e-6)
  # The margin lifts every negative's logit and leaves the positives' alone: with identical captions (Ḡ = 1 off the
  # diagonal) the loss is plain SigLIP's with every negative logit raised by scale·γ.
  same = np.repeat(t[:1], 9, axis=0)
  got = losses.siglip_loss(v, same, 10.0, -10.0, 0.5)
  y = 2 * np.eye(9) - 1
  z = 10.0 * (v.astype(np.float64) @ same.T.astype(np.float64)) - 10.0 + 10.0 * 0.5 * (1 - np.eye(9))
  np.testing.assert_allclose(got, np.sum(np.logaddexp(0.0, -y * z)) / 9, rtol=1e-5)


SIGMOID_SHARDED = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hnclip_jax import losses
r = np.random.default_rng(1)
B = 32
v = r.normal(size=(B, 16)); v /= np.linalg.norm(v, axis=1, keepdims=True)
t = r.normal(size=(B, 16)); t = t[:1] + 0.4 * t; t /= np.linalg.norm(t, axis=1, keepdims=True)
v, t = v.astype(np.float32), t.astype(np.float32)
args = (v, t, jnp.float32(10.0), jnp.float32(-10.0))
grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))
dense = grad(lambda a, b, s, c: losses.siglip_loss(a, b, s, c, 0.5))(*args)
out = {}
for shape in [(8, 1, 1), (2, 4, 1), (2, 2, 2)]:
  mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "fsdp", "tensor"))
  axes = ("data", "fsdp")
  d = shape[0] * shape[1]
  for schedule in ("gather", "ring"):
    def local(a, b, s, c, schedule=schedule):
      off = jax.lax.axis_index(axes) * a.shape[0]
      if schedule == "gather":
        rows = losses.sigmoid_rows(a, b, jax.lax.all_gather(b, axes, tiled=True), s, c, 0.5, off)
      else:
        rows = losses.sigmoid_rows_ring(a, b, s, c, 0.5, off, axes, d)
      return jax.lax.psum(jnp.sum(rows), axes) / B
    f = jax.shard_map(local, mesh=mesh, in_specs=(P(axes), P(axes), P(), P()), out_specs=P())
    sh = NamedSharding(mesh, P(axes))
    val, grads = grad(f)(jax.device_put(v, sh), jax.device_put(t, sh), *args[2:])
    out[f"{schedule} {shape}"] = [abs(float(val) - float(dense[0])) / abs(float(dense[0]))] + [
        float(np.abs(np.asarray(g) - np.asarray(w)).max() / np.abs(np.asarray(w)).max())
        for g, w in zip(grads, dense[1])]
    if schedule == "ring" and shape == (8, 1, 1):
      hlo = jax.jit(f).lower(jax.device_put(v, sh), jax.device_put(t, sh), *args[2:]).compile().as_text()
      out["ring_ops"] = {"all-gather": hlo.count("all-gather-start") + hlo.count(" all-gather("),
                         "collective-permute": hlo.count("collective-permute-start") + hlo.count(" collective-permute(")}
print("RESULT", json.dumps(out))
"""


def test_sigmoid_loss_on_8_devices_equals_one_device_with_both_schedules():
  """The gather schedule (each device's images against all-gathered captions) and the ring (caption chunks passed
  around with ppermute, big_vision's chunked schedule): loss and gradients for images, captions, scale and bias
  equal one device; the ring's program has no all-gather and one collective-permute per hop."""
  proc = run_py(["-c", SIGMOID_SHARDED], devices=8)
  res = __import__("json").loads(proc.stdout.split("RESULT", 1)[1])
  ops = res.pop("ring_ops")
  assert len(res) == 6
  for name, rels in res.items():
    assert max(rels) <= 1e-5, (name, rels)
  assert ops["all-gather"] == 0 and ops["collective-permute"] >= 7, ops
