"""Benchmarks 1 and 3: margin overhead (γ = 0.5 vs γ = 0) and model FLOP utilisation of the train step.

  python benchmarks/step_time.py [--models tiny,vit_b16] [--batch tiny=128,vit_b16=16] [--reps 5] [--json out.json]
  python benchmarks/step_time.py --memory_only vit_l14 --batch vit_l14=128     # compile-only memory (no run)

Both γ variants are compiled and timed in the same process, interleaved, median of --reps. MFU = analytic
train-step FLOPs (checked against XLA's cost analysis) / step time / peak fp32 matmul FLOP/s measured in the run.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import clip_train_flops, dump, make_step, median_time, peak_matmul_flops, table  # noqa: E402
from hnclip_jax import sharding, train_step  # noqa: E402
from hnclip_jax.models import PRESETS, abstract_model, init_params  # noqa: E402


def build(cfg, batch, gamma, mesh):
  step, tx, sh, graphdef = make_step(cfg, gamma, mesh)
  _, abstract = abstract_model(cfg)
  state_abs = jax.eval_shape(lambda p: train_step.init_state(p, tx), abstract)
  batch_abs = {"image": jax.ShapeDtypeStruct((batch, cfg.image_size, cfg.image_size, 3), jnp.float32),
               "tokens": jax.ShapeDtypeStruct((batch, cfg.text_context), jnp.int32)}
  return step, state_abs, sh, tx, batch_abs


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--models", default="tiny,vit_b16")
  p.add_argument("--batch", default="tiny=128,vit_b16=16,vit_l14=128")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--memory_only", default="")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--json", default="")
  a = p.parse_args()
  batches = dict(kv.split("=") for kv in a.batch.split(","))
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1}))
  dev = f"{jax.device_count()}× {jax.devices()[0].device_kind}"
  results = {"device": dev, "models": []}
  if a.memory_only:
    for name in a.memory_only.split(","):
      cfg = PRESETS[name].__class__(**{**PRESETS[name].__dict__, "vocab_size": 49408, "dtype": a.dtype})
      b = int(batches[name])
      for gamma in (0.0, 0.5):
        step, state_abs, sh, _, batch_abs = build(cfg, b, gamma, mesh)
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_abs, sh)
        m = step.lower(target, batch_abs).compile().memory_analysis()
        results["models"].append({"model": name, "batch": b, "gamma": gamma,
                                  "temp_GB": m.temp_size_in_bytes / 1e9, "args_GB": m.argument_size_in_bytes / 1e9})
    print(f"compile-only memory per device ({dev}, {a.dtype})")
    print(table(results["models"], ["model", "batch", "gamma", "temp_GB", "args_GB"]))
    dump(a.json, results)
    return
  peak = peak_matmul_flops()
  rows = []
  for name in a.models.split(","):
    cfg = PRESETS[name].__class__(**{**PRESETS[name].__dict__, "vocab_size": 49408 if name != "tiny" else 1024,
                                     "eot_token_id": 3, "dtype": a.dtype})
    b = int(batches[name])
    r = np.random.default_rng(0)
    batch = sharding.to_global({"image": r.normal(size=(b, cfg.image_size, cfg.image_size, 3)).astype(np.float32),
                                "tokens": np.concatenate([np.full((b, 1), 2), r.integers(4, 1000, (b, cfg.text_context - 2)),
                                                          np.full((b, 1), 3)], 1).astype(np.int32)}, mesh)
    times, xla_flops = {}, None
    runs = {}
    for gamma in (0.0, 0.5):
      step, state_abs, sh, tx, batch_abs = build(cfg, b, gamma, mesh)
      state = jax.jit(lambda: train_step.init_state(init_params(cfg, 0)[1], tx), out_shardings=sh)()
      compiled = step.lower(state, batch).compile()
      if gamma == 0.5:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        xla_flops = float(cost.get("flops", float("nan")))
      runs[gamma] = [compiled, state]
    for gamma in (0.0, 0.5):  # warm-up both
      runs[gamma][1], _ = runs[gamma][0](runs[gamma][1], batch)
    samples = {0.0: [], 0.5: []}
    for _ in range(a.reps):  # interleaved, so drift on a shared machine hits both alike
      for gamma in (0.0, 0.5):
        t = median_time(lambda g=gamma: runs[g].__setitem__(1, jax.block_until_ready(runs[g][0](runs[g][1], batch)[0])),
                        reps=1, warmup=0)
        samples[gamma].append(t)
    times = {g: float(np.median(v)) for g, v in samples.items()}
    flops = clip_train_flops(cfg, b)
    rows.append({"model": name, "batch": b, "step_s_gamma0": times[0.0], "step_s_gamma0.5": times[0.5],
                 "margin_overhead_pct": 100 * (times[0.5] / times[0.0] - 1), "analytic_TFLOP": flops / 1e12,
                 "xla_TFLOP": xla_flops / 1e12, "TFLOP/s": flops / times[0.5] / 1e12,
                 "MFU_pct": 100 * flops / times[0.5] / peak})
  results["models"] = rows
  results["peak_matmul_TFLOPs"] = peak / 1e12
  print(f"train step, {dev}, {a.dtype}; peak fp32 matmul {peak / 1e12:.3f} TFLOP/s measured in this run")
  print(table(rows, list(rows[0])))
  dump(a.json, results)


if __name__ == "__main__":
  main()
