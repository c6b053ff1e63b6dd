"""Recall@K against a NumPy argsort reference."""
import numpy as np
import pytest

from hnclip_jax.evaluation import recall_at_k


def np_recall(queries, gallery, ks):
  scores = queries @ gallery.T
  gt = np.diag(scores)[:, None]
  rank = (scores > gt).sum(1) + ((scores == gt).sum(1) - 1)  # ties count against the ground truth
  return {f"R@{k}": 100.0 * np.mean(rank < k) for k in ks}


@pytest.mark.parametrize("n,chunk", [(50, 7), (64, 64), (100, 1024), (33, 16)])
def test_matches_numpy(n, chunk):
  r = np.random.default_rng(n)
  img = r.normal(size=(n, 8)).astype(np.float32)
  txt = (img + 0.7 * r.normal(size=(n, 8))).astype(np.float32)
  got = recall_at_k(img, txt, ks=(1, 5, 10), chunk=chunk)
  assert got["t2i"] == pytest.approx(np_recall(txt, img, (1, 5, 10)), abs=1e-9)
  assert got["i2t"] == pytest.approx(np_recall(img, txt, (1, 5, 10)), abs=1e-9)
  assert 0 < got["t2i"]["R@1"] < 100


def test_perfect_and_collapsed():
  e = np.eye(20, dtype=np.float32)
  assert recall_at_k(e, e)["t2i"] == {"R@1": 100.0, "R@5": 100.0, "R@10": 100.0}
  flat = np.ones((20, 4), np.float32)  # every score ties: a collapsed model must not score
  assert recall_at_k(flat, flat, chunk=6) == {"t2i": {"R@1": 0.0, "R@5": 0.0, "R@10": 0.0},
                                               "i2t": {"R@1": 0.0, "R@5": 0.0, "R@10": 0.0}}


def test_shape_error():
  with pytest.raises(ValueError, match="same shape"):
    recall_at_k(np.zeros((3, 4)), np.zeros((4, 4)))
