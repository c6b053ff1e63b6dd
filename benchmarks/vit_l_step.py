"""The numbers users compare first: the ViT-L/14 (Long-CLIP-L, 248 tokens) train step at λ = 0 (L_HN alone) and
λ = 1 (L_HN + the FILIP token term), in bfloat16, at the largest batch that fits one device — its time, matmul
TFLOP/s and MFU. The second stage of benchmarks/accelerator.sh (after benchmarks/smoke.py).

  python benchmarks/vit_l_step.py [--batches auto|160,128,96,64] [--lambdas 0,1] [--reps 5] [--json out.json]
  python benchmarks/vit_l_step.py --model tiny --batches 16 --reps 2 --dtype float32    # CPU rehearsal

For each λ the candidate batches are tried largest first: a batch is taken when its compiled program's memory
(XLA's memory analysis: arguments + outputs − aliases + temporaries) fits the device's limit (`memory_stats`;
no limit known: the first; accelerator.sh lets JAX take 95 % of the GPU's memory instead of its default 75 %) and
its first step runs; every compile's time is printed as it ends, so a run cut short
still says where its minutes went. Only the train step is built (the program train.py runs, on random inputs): no
data, no tensorflow-datasets. MFU = the compiled step's matmul FLOPs (every loop iteration counted, remat's
recomputation included: hlo.matmul_flops) / step time / the chip's bf16 peak (metrics.PEAK_FLOPS).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import dump, make_step, matmul_flops, median_time, random_batch, table  # noqa: E402
from hnclip_jax import metrics, sharding, train_step  # noqa: E402
from hnclip_jax.models import PRESETS  # noqa: E402


def say(msg: str) -> None:
  print(f"[vit_l_step {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def program_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def out_of_memory(err: BaseException) -> bool:
  text = str(err)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Out of memory" in text


def measure(a, cfg, mesh, initial, lam: float, b: int, room, peak):
  """One λ at batch `b`: compiled, checked against `room` (the device's bytes; None: no limit known), run and timed
  -> its row, or None when it does not fit. `initial`: (the initial state in host memory, its shardings)."""
  t0 = time.perf_counter()
  step, _, _, _, _ = make_step(cfg, a.gamma, mesh, loss_overrides={"token_weight": lam})
  batch = random_batch(cfg, b, mesh)
  state = jax.device_put(*initial)  # a fresh copy: the step donates its state
  try:
    compiled = step.lower(state, batch).compile()
  except Exception as e:  # noqa: BLE001 — a program too large for the device: the next batch
    if not out_of_memory(e):
      raise
    say(f"λ={lam:g} batch {b}: the compiler refused it ({time.perf_counter() - t0:.1f} s): {str(e)[:200]}")
    return None
  compile_s, need = time.perf_counter() - t0, program_bytes(compiled)
  say(f"λ={lam:g} batch {b}: compiled in {compile_s:.1f} s, {need / 2 ** 30:.2f} GiB")
  if room is not None and need > room:
    say(f"λ={lam:g} batch {b}: {need / 2 ** 30:.2f} GiB > the {room / 2 ** 30:.2f} GiB left: next batch")
    return None
  try:
    t1 = time.perf_counter()
    holder = [jax.block_until_ready(compiled(state, batch)[0])]
    say(f"λ={lam:g} batch {b}: first step {time.perf_counter() - t1:.2f} s")
  except Exception as e:  # noqa: BLE001
    if not out_of_memory(e):
      raise
    say(f"λ={lam:g} batch {b}: out of memory at run time: next batch")
    return None

  def one():
    holder[0] = jax.block_until_ready(compiled(holder[0], batch)[0])
  t = median_time(one, a.reps, warmup=1)
  flops = matmul_flops(compiled)
  row = {"model": a.model, "lambda": lam, "batch": b, "dtype": a.dtype, "step_s": t, "examples_per_s": b / t,
         "compile_s": compile_s, "GiB": need / 2 ** 30, "matmul_TFLOP": flops / 1e12,
         "TFLOP_per_s": flops / t / 1e12, "MFU": flops / t / peak if peak else float("nan")}
  say(f"λ={lam:g} batch {b}: {t * 1e3:.1f} ms/step, {row['TFLOP_per_s']:.1f} TFLOP/s, MFU {row['MFU']:.3f}")
  return row


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="vit_l14")
  p.add_argument("--text_context", type=int, default=248, help="Long-CLIP's 248 tokens")
  p.add_argument("--batches", default="auto",
                 help="candidate batches, tried largest first; auto: by the device's memory (ViT-L/14 bf16 needs "
                      "~17 GB + 0.34 GB per example, compile_for on h100:1x1: docs/benchmarks.md)")
  p.add_argument("--lambdas", default="0,1", help="config.loss.token_weight values")
  p.add_argument("--gamma", type=float, default=0.5)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--remat", default="none", help="config.model.remat")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--json", default="")
  a = p.parse_args()
  dev = jax.devices()[0]
  limit = (dev.memory_stats() or {}).get("bytes_limit") if hasattr(dev, "memory_stats") else None
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1}), jax.devices()[:1])
  base = PRESETS[a.model]
  cfg = base.__class__(**{**base.__dict__, "text_context": a.text_context, "vocab_size": 49408,
                          "eot_token_id": 49407, "dtype": a.dtype, "remat": a.remat})
  peak = metrics.peak_flops(dev.device_kind)
  say(f"{a.model} ({cfg.image_size} px, {cfg.text_context} tokens, {a.dtype}, remat {a.remat}) on 1 × "
      f"{dev.device_kind}; memory limit {limit / 2 ** 30:.1f} GiB" if limit else
      f"{a.model} ({cfg.image_size} px, {cfg.text_context} tokens, {a.dtype}) on 1 × {dev.device_kind}; no limit")
  t0 = time.perf_counter()
  _, tx, sh, _, _ = make_step(cfg, a.gamma, mesh)
  # One init program for all runs (compiled once), its result kept in host memory: each run gets a fresh copy on
  # the device (the step donates its state) and the device holds nothing else between runs.
  state0 = jax.device_get(train_step.initial_state(tx, sh, model_cfg=cfg))
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state0))
  say(f"initial state ({state_bytes / 2 ** 30:.2f} GiB) built and compiled in {time.perf_counter() - t0:.1f} s")
  rows = []
  if a.batches == "auto":
    a.batches = "320,256,192,128" if limit and limit > 100 * 2 ** 30 else "160,128,96,64"
  for lam in (float(x) for x in a.lambdas.split(",")):
    row = None
    for b in sorted((int(x) for x in a.batches.split(",")), reverse=True):
      row = measure(a, cfg, mesh, (state0, sh), lam, b, limit, peak)
      if row is not None:
        break
    if row is None:
      say(f"λ={lam:g}: none of the batches {a.batches} fits")
      row = {"model": a.model, "lambda": lam, "batch": 0, "dtype": a.dtype, **{k: float("nan") for k in (
          "step_s", "examples_per_s", "compile_s", "GiB", "matmul_TFLOP", "TFLOP_per_s", "MFU")}}
    rows.append(row)
  print(f"train step, 1 × {dev.device_kind}, γ = {a.gamma}, jax {jax.__version__}")
  print(table(rows, list(rows[0])))
  dump(a.json, {"device": dev.device_kind, "jax": jax.__version__, "rows": rows})
  if any(np.isnan(r["step_s"]) for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  main()
