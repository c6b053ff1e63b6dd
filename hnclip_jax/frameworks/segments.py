"""What GOAL and StructXLIP share: per-example segments (a box and its caption sentence) in the training data, how
an example's are read and chosen, and the check that the data has them."""
from __future__ import annotations

import numpy as np

from hnclip_jax.data import builders, pipeline


def check_segments(config) -> str:
  """Raises when no training example has a segment (the segment terms would be 0); returns the line train.py logs."""
  fw = config.framework
  have, total = count_segments(config.data, config.data.train_split, fw)
  if not have:
    raise ValueError(f"config.framework={fw!r}: none of the {total} examples of {config.data.name}/"
                     f"{config.data.train_split} has a segment (every 'segments' list is empty); its segment "
                     "terms would be 0. Add segments (docs/frameworks.md) or choose another config.framework")
  return (f"{fw} segments: {have} of {total} training examples have one (the others are left out of the segment "
          "terms)")


def segments_of(ex) -> list[dict]:
  """An example's segments as [{"box": [4] float, "sentence": str, "score": float}] ([] when it has none)."""
  seg = ex.get("segments")
  if seg is None or not len(seg["sentence"]):
    return []
  boxes = np.asarray(seg["box"], np.float32).reshape(-1, 4)
  return [{"box": boxes[j], "sentence": pipeline.text_of(seg["sentence"][j]), "score": float(seg["score"][j])}
          for j in range(len(boxes))]


def segment_choice(segments, seed: int, step: int, index: int) -> int:
  """Which segment training uses at `step`: the best-scoring one (GOAL's choice); ties (exact segments all score
  1) are broken uniformly at random, a pure function of (seed, step, example)."""
  scores = np.asarray([s["score"] for s in segments])
  best = np.flatnonzero(scores == scores.max())
  return int(best[0] if len(best) == 1 else best[np.random.default_rng([seed, step, index, 1]).integers(len(best))])


def top_segments(segments, k: int, seed: int, step: int, index: int) -> list:
  """The `k` best-scoring segments (ties in a random order per step, a pure function of (seed, step, example))."""
  jitter = np.random.default_rng([seed, step, index, 2]).random(len(segments))
  order = sorted(range(len(segments)), key=lambda j: (-segments[j]["score"], jitter[j]))
  return [segments[j] for j in order[:k]]


def count_segments(data_config, split: str, framework: str = "goal") -> tuple[int, int]:
  """(examples of `split` with at least one segment, examples), read without decoding images. Raises naming the
  dataset when it has no segment feature at all (GOAL and StructXLIP need them: docs/frameworks.md)."""
  source = builders.data_source(data_config, split, decode_images=False)
  if "segments" not in source.dataset_info.features:
    raise ValueError(f"config.framework={framework!r} needs per-example segments (a box and its sentence), but "
                     f"config.data.name={data_config.name!r} has none. Use the 'pairs' layout with a 'segments' "
                     "field (python -m hnclip_jax.tools.match_segments makes it from any segmenter's boxes; "
                     "docs/frameworks.md) or the built-in synthetic data")
  with_segments = sum(len(source[i]["segments"]["sentence"]) > 0 for i in range(len(source)))
  return with_segments, len(source)
