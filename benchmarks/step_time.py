"""Benchmarks 1 and 3: margin overhead (γ = 0.5 vs γ = 0) and model FLOP utilisation of the train step.

  python benchmarks/step_time.py [--models tiny,vit_b16] [--batch tiny=128,vit_b16=16] [--reps 5] [--json out.json]
  python benchmarks/step_time.py --memory_only vit_l14 --batch vit_l14=128     # compile-only memory (no run)

Both γ variants are compiled and timed in the same process, interleaved: each repetition probes the peak fp32
matmul FLOP/s (a 2048³ jnp.dot), then times one γ = 0 and one γ = 0.5 step (in alternating order). The margin overhead is the median of
the per-repetition ratios t(γ=0.5)/t(γ=0) and MFU the median of analytic train-step FLOPs / t(γ=0.5) / that
repetition's peak, so a shared machine's drifting speed cancels out of both. The FLOPs the margin adds are also
read from XLA's cost analysis of the two compiled programs (exact, no timing noise). `--baseline_gamma 0.5`
times two separately compiled copies of the γ = 0.5 step instead: an A/A control showing the harness's noise floor.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # tcmalloc when installed (train.py: HNCLIP_TCMALLOC=1): hnclip_jax/hostmem.py
  from hnclip_jax import hostmem
  hostmem.use_tcmalloc(default="auto")  # measured under tcmalloc when installed, as docs/benchmarks.md says

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (alternating_times, clip_train_flops, dump, make_step, matmul_flops,  # noqa: E402
                               peak_matmul_probe, table)
from hnclip_jax import hostmem, sharding, train_step  # noqa: E402
from hnclip_jax.models import PRESETS, abstract_model  # noqa: E402


def build(cfg, batch, gamma, mesh):
  step, tx, sh, graphdef, _ = make_step(cfg, gamma, mesh)
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
  p.add_argument("--attention", default="auto", help="config.attention: auto | einsum | xla | cudnn (GPU, bfloat16)")
  p.add_argument("--peak_n", type=int, default=2048, help="size of the square matmul that probes the peak")
  p.add_argument("--baseline_gamma", type=float, default=0.0,
                 help="γ of the baseline program; 0.5 gives an A/A control (two copies of the same step)")
  p.add_argument("--trace", default="",
                 help="after timing, write a jax.profiler trace of --trace_steps γ = 0.5 steps of the last model here "
                      "(TensorBoard's profile plugin or Perfetto)")
  p.add_argument("--trace_steps", type=int, default=3)
  p.add_argument("--json", default="")
  a = p.parse_args()
  batches = dict(kv.split("=") for kv in a.batch.split(","))
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1}))
  dev = f"{jax.device_count()}× {jax.devices()[0].device_kind}"
  results = {"device": dev, "dtype": a.dtype, "attention": a.attention, "models": []}
  if a.memory_only:
    for name in a.memory_only.split(","):
      cfg = PRESETS[name].__class__(**{**PRESETS[name].__dict__, "vocab_size": 49408, "dtype": a.dtype,
                                                          "attention": a.attention})
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
  def progress(what, t0):  # where the time goes, as it goes: a lent accelerator's run may be cut short
    print(f"[step_time] {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  probe = peak_matmul_probe(a.peak_n)
  progress(f"peak probe ({a.peak_n}³ matmul) compiled and run", t0)
  peaks = []
  rows = []
  for name in a.models.split(","):
    cfg = PRESETS[name].__class__(**{**PRESETS[name].__dict__, "vocab_size": 49408 if name != "tiny" else 1024,
                                     "eot_token_id": 3, "dtype": a.dtype, "attention": a.attention})
    b = int(batches[name])
    r = np.random.default_rng(0)
    batch = sharding.to_global({"image": r.normal(size=(b, cfg.image_size, cfg.image_size, 3)).astype(np.float32),
                                "tokens": np.concatenate([np.full((b, 1), 2), r.integers(4, 1000, (b, cfg.text_context - 2)),
                                                          np.full((b, 1), 3)], 1).astype(np.int32)}, mesh)
    xla_flops, runs = {}, {}
    gammas = {"base": a.baseline_gamma, "hn": 0.5}  # baseline_gamma=0.5: an A/A control of the harness's noise
    for slot, gamma in gammas.items():
      step, state_abs, sh, tx, batch_abs = build(cfg, b, gamma, mesh)
      t0 = time.perf_counter()
      state = jax.block_until_ready(
          train_step.initial_state(tx, sh, model_cfg=cfg))
      progress(f"{name} batch {b}: state initialised", t0)
      t0 = time.perf_counter()
      compiled = step.lower(state, batch).compile()
      progress(f"{name} batch {b} γ={gamma}: train step compiled", t0)
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, list) else cost
      # XLA's cost analysis counts a loop body once: complete only for a program without loops (this step at
      # chunk_size 0 and no accumulation has none); otherwise the matmul count over every iteration.
      loops = compiled.as_text().count(" while(")
      xla_flops[slot] = float(cost.get("flops", float("nan"))) if not loops else matmul_flops(compiled)
      runs[slot] = [compiled, state]
    for slot in gammas:  # warm-up both
      runs[slot][1], _ = runs[slot][0](runs[slot][1], batch)
    peak_at = []

    def run(g):
      runs[g][1] = jax.block_until_ready(runs[g][0](runs[g][1], batch)[0])
    # Interleaved, order alternating, with the peak probed at the start of every repetition.
    samples = alternating_times({"base": lambda: run("base"), "hn": lambda: run("hn")}, a.reps,
                                each_rep=lambda: peak_at.append(probe()))
    peaks += peak_at
    flops = clip_train_flops(cfg, b)
    ratios = np.array(samples["hn"]) / np.array(samples["base"])
    mfu = flops / np.array(samples["hn"]) / np.array(peak_at)
    rows.append({"model": name, "batch": b, "baseline_gamma": a.baseline_gamma,
                 "step_s_baseline": float(np.median(samples["base"])), "step_s_gamma0.5": float(np.median(samples["hn"])),
                 "margin_overhead_pct": float(100 * (np.median(ratios) - 1)),
                 "overhead_min_pct": float(100 * (ratios.min() - 1)), "overhead_max_pct": float(100 * (ratios.max() - 1)),
                 "margin_xla_flops_pct": 100 * (xla_flops["hn"] / xla_flops["base"] - 1),
                 "analytic_TFLOP": flops / 1e12, "xla_TFLOP": xla_flops["hn"] / 1e12,
                 "TFLOP/s": flops / float(np.median(samples["hn"])) / 1e12,
                 "peak_TFLOPs": float(np.median(peak_at)) / 1e12, "MFU_pct": float(100 * np.median(mfu))})
  if a.trace:  # a few steps of the last model's γ = 0.5 program, each a named step in the trace
    with jax.profiler.trace(a.trace):
      for i in range(a.trace_steps):
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
          run("hn")
    results["trace"] = {"dir": a.trace, "model": rows[-1]["model"], "steps": a.trace_steps}
  results["models"] = rows
  results["peak_matmul_TFLOPs"] = float(np.median(peaks)) / 1e12
  results["peak_matmul_TFLOPs_range"] = [min(peaks) / 1e12, max(peaks) / 1e12]
  print(f"train step, {dev}, {a.dtype}, attention={a.attention}; peak matmul ({a.peak_n}³) {min(peaks) / 1e12:.3f}-{max(peaks) / 1e12:.3f} "
        f"TFLOP/s measured between the steps; {hostmem.host_allocator()}")
  print(table(rows, list(rows[0])))
  dump(a.json, results)


if __name__ == "__main__":
  main()
