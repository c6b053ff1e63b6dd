"""Issue 55's controls of the global term against float64 NumPy: the margin made geometry-free (a constant — the
batch's mean off-diagonal Ḡ or a fixed c —, each row's values shuffled among its negatives, only the top k) and
HN-NCE (Radenovic et al. 2023, Eq. 3). Values and gradients with respect to the embeddings, one device; the mesh,
accumulation and the sigmoid form are tests/test_sharding.py's `controls` section. Settings that would do nothing are
refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from hnclip_jax import config as config_lib, losses, sharding
from hnclip_jax.objective import Objective, embedding_outputs

MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
B, D, S = 10, 8, 14.3


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _emb(seed):
  r = np.random.default_rng(seed)
  v = _unit(r.normal(size=(B, D)))
  t = _unit(r.normal(size=(1, D)) + 0.6 * r.normal(size=(B, D)))  # crowded captions: a wide range of Ḡ
  return v.astype(np.float32), t.astype(np.float32)


def _log_softmax(x, axis):
  m = x.max(axis=axis, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def np_margin_loss(v, t, s, M):
  """½ [CE over the rows of s(S + M), CE over the columns of s(S + Mᵀ)] in float64 — row i of M is example i's
  margins in both directions — with M a constant; -> (loss, dloss/dv, dloss/dt) through S."""
  v, t = v.astype(np.float64), t.astype(np.float64)
  b = v.shape[0]
  S_ = v @ t.T
  lr, lc = _log_softmax(s * (S_ + M), 1), _log_softmax(s * (S_ + M.T), 0)
  loss = 0.5 * (-np.mean(np.diag(lr)) - np.mean(np.diag(lc)))
  dS = s * (np.exp(lr) - np.eye(b) + np.exp(lc) - np.eye(b)) / (2 * b)
  return loss, dS @ t, dS.T @ v


def np_offdiag(t):
  G = t.astype(np.float64) @ t.astype(np.float64).T
  np.fill_diagonal(G, 0.0)
  return G


def ours(v, t, s=S, **kw):
  obj = Objective.of(**{"gamma": 0.5, **kw})
  f = lambda a, b: obj(embedding_outputs(a, b, s), MESH)[0]  # noqa: E731
  loss, (gv, gt) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(v, t)
  return float(loss), np.asarray(gv), np.asarray(gt)


def close(got, want, rtol=2e-5):
  assert abs(got[0] - want[0]) <= rtol * abs(want[0]), (got[0], want[0])
  for g, w in zip(got[1:], want[1:]):
    assert np.abs(g - w).max() <= rtol * 10 * np.abs(w).max(), np.abs(g - w).max() / np.abs(w).max()


@pytest.mark.parametrize("seed", [0, 1])
def test_constant_margin_is_the_batch_mean_or_a_fixed_value(seed):
  v, t = _emb(seed)
  G = np_offdiag(t)
  off = ~np.eye(B, dtype=bool)
  mean = G[off].mean()
  close(ours(v, t, margin="constant"), np_margin_loss(v, t, S, 0.5 * mean * off))
  close(ours(v, t, margin="constant", margin_value=0.4), np_margin_loss(v, t, S, 0.5 * 0.4 * off))
  # the constant is not the geometry: same mean margin, different loss
  geometry = np_margin_loss(v, t, S, 0.5 * G)[0]
  assert abs(ours(v, t, margin="constant")[0] - geometry) > 1e-3 * geometry


@pytest.mark.parametrize("k", [1, 3])
def test_top_k_margin_keeps_each_rows_nearest_captions(k):
  v, t = _emb(2)
  G = np_offdiag(t)
  M = np.zeros_like(G)
  for i in range(B):
    order = [j for j in np.argsort(-G[i]) if j != i][:k]
    M[i, order] = G[i, order]
  close(ours(v, t, margin="topk", margin_topk=k), np_margin_loss(v, t, S, 0.5 * M))


def test_shuffled_margin_permutes_each_rows_values_among_its_negatives():
  """Each row keeps its own off-diagonal Ḡ values (0 at the positive) in a random order, drawn from the seed and
  the step (a later step draws another order); the loss is the reference's with that margin."""
  v, t = _emb(3)
  G = np_offdiag(t)
  obj = Objective.of(gamma=0.5, margin="shuffled", shuffle_seed=7)
  term = obj.global_term
  is_pos = np.eye(B, dtype=bool)
  shape = lambda step: losses.MarginShape("shuffled", key=term.schedule(step), row_offset=0)  # noqa: E731
  M0 = np.asarray(shape(None)(jnp.asarray(G, jnp.float32), is_pos), np.float64)
  M5 = np.asarray(shape(5)(jnp.asarray(G, jnp.float32), is_pos), np.float64)
  assert np.all(np.diag(M0) == 0)
  off = ~is_pos
  for i in range(B):
    np.testing.assert_allclose(np.sort(M0[i][off[i]]), np.sort(G[i][off[i]]), rtol=1e-6)
  moved = np.mean(np.abs(M0[off] - G[off]) > 1e-6)
  assert moved > 0.5 and np.mean(np.abs(M0[off] - M5[off]) > 1e-6) > 0.5
  close(ours(v, t, margin="shuffled", shuffle_seed=7), np_margin_loss(v, t, S, 0.5 * M0))


def test_margin_in_one_direction_only():
  """margin_directions="i2t": the rows' cross-entropies (image→text) get γ·Ḡ, the columns' none; "t2i" the other
  way round."""
  v, t = _emb(5)
  G = np_offdiag(t)
  S_ = v.astype(np.float64) @ t.astype(np.float64).T
  b = B

  def ref(rows_margin, cols_margin):
    lr, lc = _log_softmax(S * (S_ + rows_margin), 1), _log_softmax(S * (S_ + cols_margin.T), 0)
    return 0.5 * (-np.mean(np.diag(lr)) - np.mean(np.diag(lc)))

  zero = np.zeros((b, b))
  assert abs(ours(v, t, margin_directions="i2t")[0] - ref(0.5 * G, zero)) < 2e-5 * ref(0.5 * G, zero)
  assert abs(ours(v, t, margin_directions="t2i")[0] - ref(zero, 0.5 * G)) < 2e-5 * ref(zero, 0.5 * G)
  both = ours(v, t)[0]
  assert abs(both - ref(0.5 * G, 0.5 * G)) < 2e-5 * both


def np_hn_nce(v, t, s, beta, alpha=1.0):
  """HN-NCE (Radenovic et al. 2023, Eq. 3) in float64, both directions averaged: row i of L = s·v tᵀ scores
  −L_ii + log(α e^{L_ii} + Σ_{j≠i} w_ij e^{L_ij}), w_ij = (B−1) e^{β L_ij} / Σ_{k≠i} e^{β L_ik}."""
  L = s * (v.astype(np.float64) @ t.astype(np.float64).T)

  def rows(L):
    b = L.shape[0]
    out = []
    for i in range(b):
      neg = np.arange(b) != i
      w = (b - 1) * np.exp(beta * L[i, neg]) / np.exp(beta * L[i, neg]).sum()
      out.append(-L[i, i] + np.log(alpha * np.exp(L[i, i]) + np.sum(w * np.exp(L[i, neg]))))
    return np.mean(out)

  return 0.5 * (rows(L) + rows(L.T))


def np_grad(f, x, eps=1e-6):
  g = np.zeros_like(x, dtype=np.float64)
  for idx in np.ndindex(*x.shape):
    up, down = x.astype(np.float64).copy(), x.astype(np.float64).copy()
    up[idx] += eps
    down[idx] -= eps
    g[idx] = (f(up) - f(down)) / (2 * eps)
  return g


@pytest.mark.parametrize("beta", [0.25, 1.0])
def test_hn_nce_matches_its_equation_in_float64(beta):
  """Value and gradients (central differences of the float64 equation, the weights differentiated too) with γ = 0."""
  v, t = _emb(4)
  want = (np_hn_nce(v, t, S, beta), np_grad(lambda x: np_hn_nce(x, t, S, beta), v),
          np_grad(lambda x: np_hn_nce(v, x, S, beta), t))
  close(ours(v, t, gamma=0.0, hn_nce_beta=beta), want, rtol=3e-5)  # the check against the reference
  # Two consistency checks, not references: the float64 equation with β = 0 (weights all 1) is the float64 margin
  # loss with a zero margin, i.e. InfoNCE (the reference agrees with itself) ...
  plain = np_margin_loss(v, t, S, np.zeros((B, B)))[0]
  assert abs(np_hn_nce(v, t, S, 0.0) - plain) < 1e-12
  # ... and our HN-NCE path at β = 0 gives what our plain cross-entropy path gives (two of our own code paths).
  is_pos = jnp.eye(B, dtype=bool)
  logits = jnp.asarray(S * (v @ t.T))
  np.testing.assert_allclose(losses.hn_nce(logits, is_pos, 0.0), losses._cross_entropy(logits, is_pos), rtol=1e-6)


def test_telemetry_compares_with_plain_infonce():
  """The saturation telemetry's "infonce" objective drops the control and HN-NCE along with γ."""
  obj = Objective.of(gamma=0.0, hn_nce_beta=0.5)
  plain = obj.plain()
  assert plain.gamma == 0.0 and plain.global_term.hn_nce_beta == 0.0
  assert Objective.of(gamma=0.5, margin="topk", margin_topk=2).plain().global_term.margin == "geometry"


@pytest.mark.parametrize("changes, message", [
    ({"margin": "random"}, "config.loss.margin='random'; choose one of"),
    ({"margin": "constant", "gamma": 0.0}, "config.loss.margin='constant' set, but config.loss.gamma=0"),
    ({"margin_value": 0.3}, "config.loss.margin_value=0.3 set, but config.loss.margin='geometry'"),
    ({"margin": "topk"}, "config.loss.margin='topk' needs config.loss.margin_topk >= 1"),
    ({"margin_topk": 4}, "config.loss.margin_topk=4 set, but config.loss.margin='geometry'"),
    ({"hn_nce_beta": 0.5, "kind": "sigmoid"}, "config.loss.hn_nce_beta=0.5 re-weights the softmax's negatives"),
    ({"margin": "shuffled", "kind": "sigmoid"}, "set config.loss.sigmoid_schedule='gather'"),
    ({"hn_nce_beta": -1.0}, "config.loss.hn_nce_beta=-1.0 must be >= 0"),
    ({"margin_directions": "t2i", "gamma": 0.0}, "config.loss.margin_directions='t2i' set, but it chooses"),
    ({"margin_directions": "up"}, "config.loss.margin_directions='up'; choose one of"),
])
def test_control_settings_that_would_do_nothing_are_refused(changes, message):
  c = config_lib.base_config()
  c.loss.update(changes)
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
                     .replace("[", r"\[")):
    config_lib.validate(c)
