"""What GOAL and StructXLIP share: per-example segments (a box and its caption sentence) in the training data."""
from __future__ import annotations


def check_segments(config) -> str:
  """Raises when no training example has a segment (the segment terms would be 0); returns the line train.py logs."""
  from hnclip_jax.data import builders
  fw = config.framework
  have, total = builders.count_segments(config.data, config.data.train_split, fw)
  if not have:
    raise ValueError(f"config.framework={fw!r}: none of the {total} examples of {config.data.name}/"
                     f"{config.data.train_split} has a segment (every 'segments' list is empty); its segment "
                     "terms would be 0. Add segments (docs/frameworks.md) or choose another config.framework")
  return (f"{fw} segments: {have} of {total} training examples have one (the others are left out of the segment "
          "terms)")
