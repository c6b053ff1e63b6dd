"""Recall@K against a NumPy argsort reference."""
import os

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
  with pytest.raises(ValueError, match="have no caption"):
    recall_at_k(np.zeros((3, 4)), np.zeros((4, 4)), caption_image=[0, 0, 1, 1])


def np_recall_multi(img, txt, caption_image, ks):
  """COCO protocol by full sorting: t2i ranks the caption's image; i2t the best of the image's captions. Ties
  count against the ground truth: a tied non-ground-truth item is placed first (stable sort on negated score,
  ground truth last among equals)."""
  scores = img @ txt.T  # [N_img, N_cap]
  t2i, i2t = [], []
  for c in range(len(txt)):
    s = scores[:, c]
    order = np.lexsort((np.arange(len(img)) == caption_image[c], -s))  # by score, ground truth after ties
    t2i.append(int(np.where(order == caption_image[c])[0][0]))
  for i in range(len(img)):
    gt = caption_image == i
    order = np.lexsort((gt, -scores[i]))
    positions = np.where(gt[order])[0]
    i2t.append(int(positions[0]))  # items before the first ground truth are all other images' captions
  r = lambda ranks: {f"R@{k}": 100.0 * np.mean(np.asarray(ranks) < k) for k in ks}  # noqa: E731
  return {"t2i": r(t2i), "i2t": r(i2t)}


@pytest.mark.parametrize("chunk", [3, 1024])
def test_several_captions_per_image_match_numpy_with_ties(chunk):
  """1-5 captions per image (COCO-like); scores quantised so ties are frequent, plus hand-made ties."""
  r = np.random.default_rng(0)
  n_img = 30
  counts = r.integers(1, 6, n_img)
  caption_image = np.repeat(np.arange(n_img), counts)
  r.shuffle(caption_image)
  img = np.round(r.normal(size=(n_img, 6)) * 2) / 2
  txt = np.round((img[caption_image] + r.normal(size=(len(caption_image), 6))) * 2) / 2
  txt[5] = txt[6]  # two identical captions (of whatever images)
  img[3] = img[4]  # two identical images
  img, txt = img.astype(np.float32), txt.astype(np.float32)
  ks = (1, 5, 10)
  got = recall_at_k(img, txt, ks, chunk=chunk, caption_image=caption_image)
  want = np_recall_multi(img, txt, caption_image, ks)
  assert got["t2i"] == pytest.approx(want["t2i"], abs=1e-9) and got["i2t"] == pytest.approx(want["i2t"], abs=1e-9)
  assert 0 < got["i2t"]["R@1"] < 100 and 0 < got["t2i"]["R@1"] < 100
  # Hand-made: image 0 has captions 0 and 1; caption 1 ties with image 1's caption 2 on image 0.
  img = np.array([[1, 0], [0, 1]], np.float32)
  txt = np.array([[-1, 0], [0.6, 0.8], [0.6, 0.8]], np.float32)
  res = recall_at_k(img, txt, (1, 2), caption_image=[0, 0, 1])
  # i2t: image 0's best own caption (score 0.6) ties with caption 2 -> rank 1, so a miss at K=1, a hit at K=2.
  # image 1: its caption 2 scores 0.8, tied with image 0's caption 1 -> rank 1 too.
  assert res["i2t"] == {"R@1": 0.0, "R@2": 100.0}
  # t2i: caption 0 prefers image 1 (0 > -1): rank 1; caption 1 ranks image 1 (0.8) above image 0 (0.6): rank 1;
  # caption 2 ranks its image 1 first: rank 0.
  assert res["t2i"] == pytest.approx({"R@1": 100 / 3, "R@2": 100.0})


def test_report_ranks_and_near_twins(tmp_path):
  """The report's ranks equal the NumPy reference's; a retrieved image whose caption is a near-twin of the query
  (by text similarity) is marked, another one is not."""
  from hnclip_jax.evaluation.report import text_to_image_ranks, write_report
  r = np.random.default_rng(1)
  caption_image = np.repeat(np.arange(12), 2)
  img = r.normal(size=(12, 8)).astype(np.float32)
  txt = (img[caption_image] + 0.8 * r.normal(size=(24, 8))).astype(np.float32)
  img /= np.linalg.norm(img, axis=1, keepdims=True)
  txt /= np.linalg.norm(txt, axis=1, keepdims=True)
  ranks, tops, scores = text_to_image_ranks(img, txt, caption_image, k=5, chunk=7)
  scores_full = txt @ img.T
  want = [int((scores_full[c] >= scores_full[c, caption_image[c]]).sum() - 1) for c in range(24)]
  assert ranks.tolist() == want and np.allclose(scores, np.sort(scores_full, 1)[:, ::-1][:, :5], atol=1e-6)
  # Caption 0 (image 0) gets a near-twin: caption 2 (image 1) made almost equal to it, and image 1 made the top hit.
  txt[2] = txt[0] + 0.01
  txt[2] /= np.linalg.norm(txt[2])
  img[1] = txt[0]
  png = b"\x89PNG\r\n\x1a\n" + b"0" * 10
  page = write_report(str(tmp_path), img=img, txt=txt, caption_image=caption_image,
                      captions=[f"caption {c}" for c in range(24)], image_bytes=lambda row: png,
                      recall=recall_at_k(img, txt, caption_image=caption_image), meta={"test": 1}, num_samples=24,
                      max_failures=0, twin_threshold=0.95)
  text = open(page).read()
  card0 = text.split("<h3>caption 0 ·")[1].split("</section>")[0]
  assert 'class="twin"' in card0 and 'alt="image 1"' in card0 and "near-twin caption (" in card0
  card5 = text.split("<h3>caption 5 ·")[1].split("</section>")[0]
  assert "twin" not in card5.split("<details>")[0]
  assert sorted(os.listdir(tmp_path / "images")) == sorted(f"{i}.png" for i in range(12))
