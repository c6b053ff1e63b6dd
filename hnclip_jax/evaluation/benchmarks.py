"""The benchmarks an eval job reports (config.eval.benchmarks) and the paper's Table 1 built from their results.

A benchmark is a name, a full data config (the run's, with the benchmark's settings over it) and a split. The table
holds, per benchmark, Recall@1/5/10 text->image and image->text; per direction the average over the benchmarks; and
"both": the average over benchmarks and directions (the paper's "4-benchmark average R@1" is `average/R@1`).
"""
from __future__ import annotations

import dataclasses
import os

import ml_collections
import numpy as np

DIRECTIONS = (("t2i", "text->image"), ("i2t", "image->text"))
DEFAULT_SPLIT = "test"


@dataclasses.dataclass(frozen=True)
class Benchmark:
  name: str
  data: ml_collections.ConfigDict  # a complete config.data for this benchmark
  split: str


def own_data(config, split: str) -> Benchmark:
  """The run's own data (what eval.py evaluates without --benchmarks)."""
  return Benchmark(config.data.name, config.data, split)


def resolve(config, names: str, order: list[str] | None = None) -> list[Benchmark]:
  """--benchmarks: "all" or a comma-separated selection of config.eval.benchmarks -> the benchmarks, in the
  config's order (`order`: the names as the config file lists them; a deep copy of a ConfigDict sorts them) or the
  selection's. Each one's data config is config.data with the entry's keys over it; a relative manual_dir is taken
  inside config.eval.data_root. Raises naming the entry and the fix."""
  listed = dict(config.eval.benchmarks)
  if order is not None:
    listed = {k: listed[k] for k in [*order, *sorted(set(listed) - set(order))] if k in listed}
  if not listed:
    raise ValueError(f"--benchmarks={names} but config.eval.benchmarks is empty: list the benchmarks in the config "
                     "(configs/longclip_l.py names the paper's four), or drop --benchmarks to evaluate the run's own "
                     "data")
  wanted = list(listed) if names == "all" else [n.strip() for n in names.split(",") if n.strip()]
  unknown = [n for n in wanted if n not in listed]
  if unknown or not wanted:
    raise ValueError(f"--benchmarks={names}: {unknown[0] if unknown else 'nothing'} is not in config.eval.benchmarks "
                     f"({', '.join(listed)}); pass 'all' or names from that list")
  root = os.path.expanduser(config.eval.data_root)
  out = []
  for name in wanted:
    entry = dict(listed[name])
    split = entry.pop("split", DEFAULT_SPLIT)
    data = ml_collections.ConfigDict(config.data)  # a copy (the resolved run's config is frozen)
    with data.unlocked():
      data.update({"name": name, "build": "", **entry})  # the run's own build is not this benchmark's
    if data.name != "synthetic" and not (data.build and not entry.get("manual_dir")):
      where = f"config.eval.benchmarks.{name}.manual_dir"
      if not data.manual_dir:
        raise ValueError(f"{where} is empty: set it to the folder that holds {data.name} (absolute, or relative to "
                         f"config.eval.data_root), or config.eval.benchmarks.{name}.build to a build in "
                         "config.data.data_dir")
      if not os.path.isabs(os.path.expanduser(data.manual_dir)):
        if not root:
          raise ValueError(f"{where}={data.manual_dir!r} is relative, but config.eval.data_root is empty: set "
                           "config.eval.data_root=DIR (the folder that holds it) or give an absolute path")
        data.manual_dir = os.path.join(root, data.manual_dir)
    out.append(Benchmark(name, data, split))
  return out


def table(rows: list[dict]) -> dict:
  """Per-benchmark rows of one step (eval.py's results) -> Table 1 as a dict (see the module docstring)."""
  if not rows:
    raise ValueError("table: no results")
  keys = list(rows[0]["t2i"])
  avg = {d: {k: float(np.mean([r[d][k] for r in rows])) for k in keys} for d, _ in DIRECTIONS}
  avg["both"] = {k: float(np.mean([avg[d][k] for d, _ in DIRECTIONS])) for k in keys}
  return {"step": rows[0]["step"], "score": rows[0].get("score", "cosine"),
          "benchmarks": {r["benchmark"]: {k: r[k] for k in ("dataset", "split", "num_images", "num_captions", "t2i",
                                                            "i2t")} for r in rows},
          "average": avg}


def markdown(tab: dict) -> str:
  """Table 1 as Markdown: a row per benchmark, the per-direction averages, and the overall average."""
  keys = list(tab["average"]["t2i"])
  head = "| benchmark | " + " | ".join(f"{name} {k}" for _, name in DIRECTIONS for k in keys) + " |"
  lines = [f"Step {tab['step']} ({tab['score']} score)", "", head, "|---|" + "---:|" * (2 * len(keys))]
  for name, r in tab["benchmarks"].items():
    lines.append(f"| {name} ({r['split']}, {r['num_images']} images) | " +
                 " | ".join(f"{r[d][k]:.2f}" for d, _ in DIRECTIONS for k in keys) + " |")
  lines.append("| **average** | " + " | ".join(f"**{tab['average'][d][k]:.2f}**" for d, _ in DIRECTIONS for k in keys)
               + " |")
  lines += ["", "Average over benchmarks and both directions: " +
            ", ".join(f"{k} {v:.2f}" for k, v in tab["average"]["both"].items())]
  return "\n".join(lines) + "\n"


def metric(tab: dict, name: str) -> float:
  """A number of the table by name: "average/R@1" (benchmarks and directions), "average/t2i/R@5", "NAME/i2t/R@10"."""
  parts = name.split("/")
  try:
    if parts[0] == "average":
      return float(tab["average"]["both" if len(parts) == 2 else parts[1]][parts[-1]])
    if len(parts) == 3:
      return float(tab["benchmarks"][parts[0]][parts[1]][parts[2]])
  except KeyError:
    pass
  raise ValueError(f"config.eval.best_metric={name!r} is not in this table; use 'average/R@K', 'average/t2i/R@K', "
                   f"'average/i2t/R@K' or 'BENCHMARK/t2i|i2t/R@K' with BENCHMARK one of {list(tab['benchmarks'])} "
                   f"and K one of {[k.removeprefix('R@') for k in tab['average']['t2i']]}")
