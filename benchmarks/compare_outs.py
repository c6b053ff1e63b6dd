"""Paired comparison of the same runs in two replicate.py --out directories (e.g. random vs clustered batches from
the same start, issue 55): for each run name, B − A per seed with the 95 % Student-t interval (replicate.paired),
and the interaction of the margin with the change: (γ 0.5 − γ 0 in B) − (γ 0.5 − γ 0 in A), per seed.

  python benchmarks/compare_outs.py --a /tmp/r3c --b /tmp/r3k --seeds 0,1,2,3,4 \
      --runs ft_gamma0.0,ft_gamma0.5,ft_gamma0.5_20pct --json clustered_vs_random.json
"""
import argparse
import importlib.util
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def load_replicate():
  spec = importlib.util.spec_from_file_location("replicate", os.path.join(HERE, "replicate.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def interval(d):
  from scipy import stats  # a dependency of jax
  d = np.asarray(d, float)
  half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None
  return {"mean": float(d.mean()), "ci95": None if half is None else [float(d.mean() - half), float(d.mean() + half)],
          "per_seed": d.tolist()}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--a", required=True, help="the reference --out")
  p.add_argument("--b", required=True, help="the changed --out")
  p.add_argument("--seeds", default="0,1,2,3,4")
  p.add_argument("--runs", default="ft_gamma0.0,ft_gamma0.5", help="run names without _seedN")
  p.add_argument("--json", default="")
  a = p.parse_args()
  rep = load_replicate()
  seeds = [int(s) for s in a.seeds.split(",")]
  runs = [r for r in a.runs.split(",") if r]
  for out in (a.a, a.b):
    missing = [f"{r}_seed{s}" for r in runs for s in seeds if not os.path.exists(os.path.join(out, f"{r}_seed{s}"))]
    if missing:
      raise SystemExit(f"{out} lacks {missing}: run replicate.py with those runs first")
  res = {"a": a.a, "b": a.b, "seeds": seeds, "b_minus_a": {}, "margin_interaction": {}}
  metrics = ("t2i/R@1", "i2t/R@1")
  for r in runs:
    res["b_minus_a"][r] = rep.paired([os.path.join(a.a, f"{r}_seed{s}") for s in seeds],
                                     [os.path.join(a.b, f"{r}_seed{s}") for s in seeds])
  if {"ft_gamma0.0", "ft_gamma0.5"} <= set(runs):
    fr = lambda out, r, s: rep.final_recall(os.path.join(out, f"{r}_seed{s}"))
    for k in metrics:
      res["margin_interaction"][k] = interval(
          [(fr(a.b, "ft_gamma0.5", s)[k] - fr(a.b, "ft_gamma0.0", s)[k])
           - (fr(a.a, "ft_gamma0.5", s)[k] - fr(a.a, "ft_gamma0.0", s)[k]) for s in seeds])
  show = lambda d: f"{d['mean']:+.2f}" + (f" [{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}]" if d["ci95"] else "")
  print(f"B = {a.b}, A = {a.a}, seeds {seeds}")
  for r, d in res["b_minus_a"].items():
    print(f"{r}: B − A  " + "  ".join(f"{k} {show(d[k])}" for k in metrics))
  for k, d in res["margin_interaction"].items():
    print(f"margin effect in B − in A, {k}: {show(d)}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
