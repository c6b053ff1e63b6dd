"""The objective's costs: the token term's step time, the token term's memory vs the global batch, and the
HN-vs-InfoNCE gradient comparison's memory next to the train step's.

  python benchmarks/objective.py time [--models tiny,vit_b16] [--batch tiny=128,vit_b16=16] [--reps 5] [--flops_only]
  python benchmarks/objective.py memory [--devices 8] [--batches 1024,...,16384] [--chunk 16]   # compile-only
  python benchmarks/objective.py compare_memory [--compare_batch 128] [--accum 8]                         # compile-only

time: the train step with λ = 0 and λ = 1 (both γ = 0.5), compiled in one process and timed alternately; the
  ratio is the median of per-repetition ratios; the matmul FLOPs of both steps (every loop iteration counted) and
  the token term's forward FLOPs by its formula 2·B²·P·L·E beside them. memory: per-device temporaries of the objective's value and
  gradient w.r.t. the model outputs at ViT-L/14 token shapes (256 patches, 248 text tokens, E = 768, bf16 tokens),
  from XLA's memory analysis, on --devices fake CPU devices. compare_memory: temporaries of the train step and of
  diagnostics.make_gradient_comparison at the same accumulation.
"""
import argparse
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("part", choices=("time", "memory", "compare_memory"))
p.add_argument("--models", default="tiny,vit_b16")
p.add_argument("--batch", default="tiny=128,vit_b16=16")
p.add_argument("--reps", type=int, default=5)
p.add_argument("--devices", type=int, default=8)
p.add_argument("--batches", default="1024,2048,4096,8192,16384")
p.add_argument("--chunk", type=int, default=16)
p.add_argument("--accum", type=int, default=8)
p.add_argument("--compare_batch", type=int, default=128)
p.add_argument("--json", default="")
p.add_argument("--flops_only", action="store_true", help="time: compile and count FLOPs; no timing")
a = p.parse_args()
if a.part == "memory" and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={a.devices}").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__" and a.part == "time":  # the allocator train.py runs on (hnclip_jax/hostmem.py)
  from hnclip_jax import hostmem
  hostmem.use_tcmalloc(default="auto")  # measured under tcmalloc when installed, as docs/benchmarks.md says

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks.common import (alternating_times, dump, make_step, matmul_flops, random_batch, table,  # noqa: E402
                               token_term_forward_flops)
from hnclip_jax import diagnostics, hostmem, sharding, train_step  # noqa: E402
from hnclip_jax.models import PRESETS, abstract_model  # noqa: E402
from hnclip_jax.objective import Objective  # noqa: E402


def one_device_mesh():
  return sharding.make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1}), jax.devices()[:1])


def time_token_term():
  batches = dict(kv.split("=") for kv in a.batch.split(","))
  mesh = one_device_mesh()
  rows = []
  for name in a.models.split(","):
    cfg = PRESETS[name].__class__(**{**PRESETS[name].__dict__, "vocab_size": 1024, "eot_token_id": 3})
    b = int(batches[name])
    batch = random_batch(cfg, b, mesh)
    runs, flops = {}, {}
    for slot, lam in (("hn", 0.0), ("hn+tok", 1.0)):
      step, tx, sh, _, _ = make_step(cfg, 0.5, mesh, loss_overrides={"token_weight": lam})
      state = train_step.initial_state(tx, sh, model_cfg=cfg)
      compiled = step.lower(state, batch).compile()
      flops[slot] = matmul_flops(compiled)
      if not a.flops_only:
        state, _ = compiled(state, batch)  # warm-up
        runs[slot] = [compiled, state]

    def run(slot):
      runs[slot][1] = jax.block_until_ready(runs[slot][0](runs[slot][1], batch)[0])

    t = ({s: [float("nan")] for s in flops} if a.flops_only else
         alternating_times({s: (lambda s=s: run(s)) for s in runs}, a.reps))
    ratios = np.array(t["hn+tok"]) / np.array(t["hn"])
    patches = (cfg.image_size // cfg.patch_size) ** 2
    rows.append({"model": name, "batch": b, "step_s_hn": float(np.median(t["hn"])),
                 "step_s_hn+tok": float(np.median(t["hn+tok"])), "ratio": float(np.median(ratios)),
                 "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max()),
                 "GFLOP_hn": flops["hn"] / 1e9, "GFLOP_hn+tok": flops["hn+tok"] / 1e9,
                 "flop_ratio": flops["hn+tok"] / flops["hn"],
                 "token_fwd_GFLOP_formula": token_term_forward_flops(b, patches, cfg.text_context, cfg.embed_dim) / 1e9})
  print(f"train step with / without the token term (γ = 0.5), 1 {jax.devices()[0].platform} device, "
        f"{hostmem.host_allocator()}")
  print(table(rows, list(rows[0])))
  dump(a.json, rows)


def token_memory():
  n_dev = min(a.devices, jax.device_count())
  mesh = Mesh(np.array(jax.devices()[:n_dev]).reshape(n_dev, 1, 1), sharding.MESH_AXES)
  sh = NamedSharding(mesh, P(sharding.BATCH_AXES))
  patches, length, e = 256, 248, 768
  rows = []
  for b in [int(x) for x in a.batches.split(",")]:
    row = {"global_batch": b, "rows_per_device": b // n_dev}
    for lam in (0.0, 1.0):
      out = {"img": jax.ShapeDtypeStruct((b, e), jnp.float32, sharding=sh),
             "txt": jax.ShapeDtypeStruct((b, e), jnp.float32, sharding=sh)}
      if lam:
        out["img_tokens"] = jax.ShapeDtypeStruct((b, patches, e), jnp.bfloat16, sharding=sh)
        out["txt_tokens"] = jax.ShapeDtypeStruct((b, length, e), jnp.bfloat16, sharding=sh)
      mask = jax.ShapeDtypeStruct((b, length), jnp.bool_, sharding=sh)
      obj = Objective.of(gamma=0.5, token_weight=lam, chunk_size=a.chunk)
      f = lambda o, m, obj=obj: obj({**o, "scale": jnp.float32(100.0), **({"txt_mask": m} if obj.needs_tokens else {})},
                                    mesh)[0]
      mem = jax.jit(jax.value_and_grad(f)).lower(out, mask).compile().memory_analysis()
      row["temp_MB_hn" if not lam else "temp_MB_hn+tok"] = mem.temp_size_in_bytes / 1e6
    row["gathered_text_tokens_MB"] = b * length * e * 2 / 1e6  # the whole batch's bf16 text tokens, per device
    row["naive_nxBxPxL_GB"] = (b // n_dev) * b * patches * length * 4 / 1e9
    rows.append(row)
  print(f"objective value+grad temporaries per device, {n_dev} fake {jax.devices()[0].platform} devices, "
        f"chunk {a.chunk}, ViT-L/14 token shapes")
  print(table(rows, list(rows[0])))
  dump(a.json, rows)


def compare_memory():
  mesh = one_device_mesh()
  cfg = PRESETS["tiny"].__class__(**{**PRESETS["tiny"].__dict__, "vocab_size": 1024, "eot_token_id": 3})
  rows = []
  for accum in sorted({1, a.accum}):
    step, tx, sh, graphdef, run_cfg = make_step(cfg, 0.5, mesh, grad_accum_steps=accum)
    state_abs = jax.eval_shape(lambda p: train_step.init_state(p, tx), abstract_model(cfg)[1])
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_abs, sh)
    b = a.compare_batch
    batch = {"image": jax.ShapeDtypeStruct((b, cfg.image_size, cfg.image_size, 3), jnp.float32),
             "tokens": jax.ShapeDtypeStruct((b, cfg.text_context), jnp.int32)}
    step_mem = step.lower(target, batch).compile().memory_analysis().temp_size_in_bytes
    compare = diagnostics.make_gradient_comparison(graphdef, mesh, Objective.of(gamma=0.5), sh["params"], accum,
                                                   "global_batch")
    cmp_mem = compare.lower(target["params"], batch).compile().memory_analysis().temp_size_in_bytes
    rows.append({"batch": b, "grad_accum_steps": accum, "train_step_temp_MB": step_mem / 1e6,
                 "gradient_comparison_temp_MB": cmp_mem / 1e6, "ratio": cmp_mem / step_mem})
  print("compile-only temporaries, tiny model, 1 CPU device")
  print(table(rows, list(rows[0])))
  dump(a.json, rows)


if __name__ == "__main__":
  {"time": time_token_term, "memory": token_memory, "compare_memory": compare_memory}[a.part]()
