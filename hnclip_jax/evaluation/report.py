"""A retrieval report a person can look at (`eval.py --report DIR`): one self-contained HTML page (images copied
next to it) with the Recall@K table and, for a sample of text→image queries and the failures, the caption, its
ground-truth image, the top-k images with their scores, the rank of the ground truth, and the retrieved images whose
captions are near-twins of the query by the text encoder's own similarity (the paper's Fig. 3 / A10).
"""
from __future__ import annotations

import html
import json
import os

import numpy as np

from hnclip_jax.evaluation.retrieval import check_finite

REPORT_FILE = "index.html"


def text_to_image_ranks(img, txt, caption_image, k: int, chunk: int = 1024):
  """-> (rank [N_cap] of each caption's image, ties against it; top [N_cap, k] image rows; their scores)."""
  n = len(txt)
  ranks, tops, scores = np.zeros(n, np.int64), np.zeros((n, k), np.int64), np.zeros((n, k), np.float32)
  for s in range(0, n, chunk):
    sc = np.asarray(txt[s:s + chunk], np.float32) @ np.asarray(img, np.float32).T  # [c, N_img]
    rows = np.arange(len(sc))
    gt = sc[rows, caption_image[s:s + chunk]]
    ranks[s:s + chunk] = (sc >= gt[:, None]).sum(1) - 1
    top = np.argsort(-sc, axis=1, kind="stable")[:, :k]
    tops[s:s + chunk], scores[s:s + chunk] = top, np.take_along_axis(sc, top, 1)
  return ranks, tops, scores


def select_queries(ranks, num_samples: int, max_failures: int, seed: int):
  """A seeded sample of captions plus the failures (ground truth not first), worst first; each listed once."""
  r = np.random.default_rng(seed)
  sample = sorted(r.choice(len(ranks), size=min(num_samples, len(ranks)), replace=False).tolist())
  failures = [int(i) for i in np.argsort(-ranks, kind="stable") if ranks[i] > 0][:max_failures]
  return sample, [i for i in failures if i not in set(sample)]


def _ext(data: bytes) -> str:
  return ".png" if data[:8] == b"\x89PNG\r\n\x1a\n" else ".jpg"


def write_report(out_dir: str, *, img, txt, caption_image, captions, image_bytes, recall: dict, meta: dict,
                 k: int = 5, num_samples: int = 20, max_failures: int = 50, twin_threshold: float = 0.9,
                 seed: int = 0) -> str:
  """Writes out_dir/index.html and out_dir/images/; returns the page's path.

  img [N_img, E], txt [N_cap, E] (L2-normalised), caption_image [N_cap] (each caption's image row), captions
  (N_cap strings), image_bytes(row) -> the encoded image. A retrieved image is marked a near-twin of the query
  when one of its captions has cosine similarity >= twin_threshold with the query caption (text encoder).
  """
  check_finite(**{"image embeddings": img, "caption embeddings": txt})
  caption_image = np.asarray(caption_image)
  k = min(k, len(img))
  ranks, tops, scores = text_to_image_ranks(img, txt, caption_image, k)
  sample, failures = select_queries(ranks, num_samples, max_failures, seed)
  os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
  files = {}

  def image_file(row: int) -> str:
    if row not in files:
      data = image_bytes(row)
      name = f"images/{row}{_ext(data)}"
      with open(os.path.join(out_dir, name), "wb") as f:
        f.write(data)
      files[row] = name
    return files[row]

  def card(q: int) -> str:
    t = np.asarray(txt, np.float32)
    sim = t @ t[q]  # the text encoder's own similarity of every caption to the query
    sim[q] = -np.inf
    own = caption_image[q]
    twin_of = {}  # image row -> its most query-like caption's similarity
    for c in np.nonzero(sim >= twin_threshold)[0]:
      if caption_image[c] != own:
        twin_of[int(caption_image[c])] = max(twin_of.get(int(caption_image[c]), -1.0), float(sim[c]))
    nearest = [int(c) for c in np.argsort(-sim, kind="stable")[:3] if caption_image[c] != own]
    cells = []
    for j, (row, score) in enumerate(zip(tops[q], scores[q])):
      cls = ["hit"] if row == own else []
      label = f"#{j + 1} · {score:.3f}"
      if row in twin_of:
        cls.append("twin")
        label += f" · near-twin caption ({twin_of[int(row)]:.2f})"
      cells.append(f'<figure class="{" ".join(cls)}"><img src="{image_file(int(row))}" alt="image {row}" '
                   f'onload="this.dataset.loaded=1" onerror="this.dataset.loaded=0"><figcaption>{html.escape(label)}'
                   "</figcaption></figure>")
    twins = "".join(f"<li>{html.escape(captions[c])} <span class=sim>(text similarity {sim[c]:.2f}"
                    f"{', near-twin' if sim[c] >= twin_threshold else ''})</span></li>" for c in nearest)
    status = "hit" if ranks[q] == 0 else "miss"
    return (f'<section class="query {status}" data-rank="{int(ranks[q])}"><h3>caption {q} · ground truth rank '
            f'{int(ranks[q]) + 1}</h3><p class=caption>{html.escape(captions[q])}</p><div class=row>'
            f'<figure class=gt><img src="{image_file(int(own))}" alt="ground truth {own}" '
            f'onload="this.dataset.loaded=1" onerror="this.dataset.loaded=0"><figcaption>ground truth</figcaption>'
            f'</figure>{"".join(cells)}</div><details><summary>most similar other captions</summary><ul>{twins}'
            "</ul></details></section>")

  table = "".join(f"<tr><th>{name}</th>" + "".join(f'<td data-key="{d}/{key}">{v:.2f}</td>'
                                                    for key, v in recall[d].items()) + "</tr>"
                  for d, name in (("t2i", "text → image"), ("i2t", "image → text")))
  heads = "".join(f"<th>{key}</th>" for key in recall["t2i"])
  info = html.escape(", ".join(f"{key}: {v}" for key, v in meta.items()))
  page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Retrieval report</title><style>
body {{ font-family: sans-serif; margin: 1.5em; max-width: 1400px; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 4px 10px; text-align: right; }}
.row {{ display: flex; gap: 8px; flex-wrap: wrap; }} figure {{ margin: 0; border: 3px solid #ddd; padding: 2px; }}
figure img {{ width: 150px; height: 150px; object-fit: cover; display: block; }}
figcaption {{ font-size: 12px; max-width: 150px; }} .gt {{ border-color: #333; }} .hit {{ border-color: #2a2; }}
.twin {{ border-color: #e80; }} .query {{ border-top: 1px solid #999; padding: 8px 0; }}
.query.miss h3 {{ color: #b00; }} .caption {{ max-width: 1100px; }} .sim {{ color: #666; }}
</style></head><body>
<h1>Retrieval report</h1><p>{info}</p>
<table id="recall"><tr><th></th>{heads}</tr>{table}</table>
<p>Text → image queries: {len(sample)} sampled (seed {seed}) and {len(failures)} more failures (ground truth not
first, worst first). Green: the ground truth; orange: a retrieved image with a caption whose text similarity to the
query is ≥ {twin_threshold} (a near-twin caption: the text encoder can hardly tell them apart).</p>
<h2>Sampled queries</h2>{"".join(card(q) for q in sample)}
<h2>Failures</h2>{"".join(card(q) for q in failures) or "<p>none</p>"}
</body></html>
"""
  path = os.path.join(out_dir, REPORT_FILE)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(page)
  os.replace(path + ".tmp", path)
  with open(os.path.join(out_dir, "queries.json"), "w") as f:
    json.dump({"sampled": sample, "failures": failures, "ranks": {str(q): int(ranks[q]) for q in sample + failures}},
              f)
  return path
