"""Why does the margin cost image→text R@1 in the three-stage regime? (issue 55)

For each seed of a replicate.py --out, embeds the target's test split with the γ = 0 and the γ = 0.5 fine-tuned
models (and the start), and compares image→text retrieval image by image:

- which images flip (right at γ = 0, wrong at γ = 0.5) and which flip back;
- for each flipped image, whether the caption ranked first instead is a near-duplicate (same synthetic group) and
  its Ḡ with the true caption under the start's text encoder (what the margin added to it during training);
- how the margin moved the two directions' similarity structure: mean image–caption similarity of the positive, of
  the same-group negatives and of the other negatives, and the mean Ḡ within groups, under each model.

  python benchmarks/i2t_flips.py --out /tmp/r3c [--seeds 0,1,2,3,4] [--json flips.json]
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hnclip_jax import pretrained  # noqa: E402
from hnclip_jax.data import builders, pipeline  # noqa: E402
from hnclip_jax.workdir import Workdir  # noqa: E402


def test_split(workdir: str):
  """The run's data (data.json) test split: (images, captions, group ids)."""
  import ml_collections
  from hnclip_jax.config import base_config
  data = base_config().data
  data.update(Workdir(workdir).data())
  source = builders.data_source(ml_collections.ConfigDict(dict(data)), data.eval_split)
  images = [source[i]["image"] for i in range(len(source))]
  captions = [pipeline.text_of(source[i]["caption"]) for i in range(len(source))]
  groups = np.array([int(source[i]["group_id"]) for i in range(len(source))])
  return images, captions, groups


def embed(path, images, captions):
  m = pretrained.load(path)
  return m.encode_images(images).astype(np.float64), m.encode_texts(captions).astype(np.float64)


def structure(img, txt, groups):
  S = img @ txt.T
  same = groups[:, None] == groups[None, :]
  eye = np.eye(len(groups), dtype=bool)
  G = txt @ txt.T
  return {"positive": float(S[eye].mean()), "same_group_negative": float(S[same & ~eye].mean()),
          "other_negative": float(S[~same].mean()), "G_same_group": float(G[same & ~eye].mean()),
          "G_other": float(G[~same].mean())}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--seeds", default="0,1,2,3,4")
  p.add_argument("--json", default="")
  a = p.parse_args()
  start = os.path.join(a.out, "longclip")
  w0 = os.path.join(a.out, "ft_gamma0.0_seed0")
  images, captions, groups = test_split(w0)
  n = len(captions)
  v_s, t_s = embed(start, images, captions)
  G_start = t_s @ t_s.T
  report = {"test_pairs": n, "group_size": int(np.bincount(groups).max()), "start": structure(v_s, t_s, groups),
            "seeds": {}}
  for seed in [int(s) for s in a.seeds.split(",")]:
    runs = {g: os.path.join(a.out, f"ft_gamma{g}_seed{seed}") for g in ("0.0", "0.5")}
    emb = {g: embed(w, images, captions) for g, w in runs.items()}
    top = {g: np.argmax(v @ t.T, axis=1) for g, (v, t) in emb.items()}  # i2t: each image's first caption
    top_t2i = {g: np.argmax(t @ v.T, axis=1) for g, (v, t) in emb.items()}
    right = {g: top[g] == np.arange(n) for g in top}
    lost = np.flatnonzero(right["0.0"] & ~right["0.5"])
    won = np.flatnonzero(~right["0.0"] & right["0.5"])
    wrong = top["0.5"][lost]
    same = groups[wrong] == groups[lost]
    # the i2t margin of an image: its positive's similarity minus the best negative's (> 0: retrieved)
    def gap(v, t):
      S = v @ t.T
      neg = np.where(np.eye(n, dtype=bool), -np.inf, S).max(axis=1)
      return np.diag(S) - neg
    report["seeds"][seed] = {
        "i2t_R@1": {g: float(100 * right[g].mean()) for g in right},
        "t2i_R@1": {g: float(100 * np.mean(top_t2i[g] == np.arange(n))) for g in top_t2i},
        "i2t_lost": int(len(lost)), "i2t_won": int(len(won)),
        "lost_to_same_group": float(same.mean()) if len(lost) else None,
        "G_start_true_vs_taken_lost": float(G_start[lost, wrong].mean()) if len(lost) else None,
        "G_start_same_group_all": float(G_start[(groups[:, None] == groups[None, :]) & ~np.eye(n, dtype=bool)].mean()),
        "i2t_gap_median": {g: float(np.median(gap(*emb[g]))) for g in emb},
        "structure": {g: structure(*emb[g], groups) for g in emb}}
    print(seed, json.dumps(report["seeds"][seed]), flush=True)
  seeds = list(report["seeds"].values())
  report["over_seeds"] = {
      "i2t_lost_mean": float(np.mean([s["i2t_lost"] for s in seeds])),
      "i2t_won_mean": float(np.mean([s["i2t_won"] for s in seeds])),
      "lost_to_same_group_mean": float(np.mean([s["lost_to_same_group"] for s in seeds
                                                if s["lost_to_same_group"] is not None])),
      **{f"{k}_{g}": float(np.mean([s["structure"][g][k] for s in seeds]))
         for g in ("0.0", "0.5") for k in seeds[0]["structure"]["0.0"]}}
  print(json.dumps(report["over_seeds"], indent=1))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
