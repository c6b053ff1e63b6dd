"""Step time of each fine-tuning framework (config.framework) relative to plain HN-CLIP (framework "longclip", the
global term only), measured side by side in one process: the programs train.py builds (train_step.build_program),
timed in alternating order, plus the matmul FLOPs of each compiled step (no timing noise; every loop iteration
counted, benchmarks/common.py: matmul_flops).

  python benchmarks/frameworks.py [--models tiny,vit_b16] [--batch tiny=128,vit_b16=8] [--reps 5] [--json out.json]
                                  [--frameworks finelip,goal,structxlip] [--flops_only]

Every compared program and its train state stay alive for the alternating timing: at ViT-B/16 batch 8 all four
need ~23 GB of host memory on CPU; on a smaller host compare fewer at a time (--frameworks goal,structxlip).

The paper reports training time relative to HN-CLIP for GOAL (2.4x) and StructXLIP (5.4x). GOAL's step includes its
second forward/backward pass (segment crops and sentences), StructXLIP's its passes over the edge map, the top-3
segment crops' edge maps and the structure caption; neither includes the host's work (crops, Canny edge maps, caption
filtering and chunking happen in the input pipeline, which overlaps the step; `config.workers` adds processes).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # tcmalloc when installed, like the other step-time benchmarks (hnclip_jax/hostmem.py)
  from hnclip_jax import hostmem
  hostmem.use_tcmalloc(default="auto")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import alternating_times, dump, matmul_flops, random_batch, table  # noqa: E402
from hnclip_jax.frameworks import REGISTRY  # noqa: E402

FRAMEWORKS = tuple(REGISTRY)  # the built-in frameworks ("longclip" first: the reference)


def program_for(preset: str, framework: str, batch: int):
  """The program train.py would build for model `preset` and `framework` (experiment.resolve, one device)."""
  from hnclip_jax import config as config_lib, experiment, train_step
  config = config_lib.base_config()
  config.model = config_lib.model_config(preset)
  config.framework, config.batch_size, config.total_steps = framework, batch, 1000
  config.optimizer.warmup_steps = 1
  if framework == "finelip":
    config.finelip.ramp_steps = 0  # the hinge at full weight (the same program either way)
  if framework == "structxlip":
    config.structxlip.steps_per_epoch = 0  # the weights' schedule does not change the program
  config.diagnostics.log = False
  run = experiment.resolve(config, None, "compile", devices=jax.devices()[:1])
  return train_step.build_program(run), run


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", default="tiny,vit_b16")
  ap.add_argument("--batch", default="tiny=128,vit_b16=8")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--frameworks", default=",".join(FRAMEWORKS[1:]),
                  help="compared with plain HN-CLIP (longclip), each side by side in the same run")
  ap.add_argument("--json", default="")
  ap.add_argument("--flops_only", action="store_true", help="compile and count FLOPs; no timing")
  a = ap.parse_args()
  batches = {k: int(v) for k, v in (kv.split("=") for kv in a.batch.split(","))}
  from hnclip_jax import train_step
  from hnclip_jax.models import init_params
  rows = []
  for name in a.models.split(","):
    batch = batches[name]
    steps, flops = {}, {}
    frameworks = ["longclip"] + [f for f in a.frameworks.split(",") if f and f != "longclip"]
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown:
      raise SystemExit(f"--frameworks: unknown {unknown}; choose from {list(FRAMEWORKS[1:])}")
    for fw in frameworks:
      program, run = program_for(name, fw, batch)
      model_cfg = run.model
      data = random_batch(model_cfg, batch, run.mesh, extra=train_step.abstract_batch(run))
      compiled = program.step.lower(program.target(), data).compile()
      flops[fw] = matmul_flops(compiled)
      if a.flops_only:
        del compiled
        continue
      state = jax.jit(lambda p, tx=program.tx: train_step.init_state(p, tx),
                      out_shardings=program.shardings)(init_params(model_cfg, 0)[1])
      box = {"state": state}

      def run(box=box, compiled=compiled, data=data):
        box["state"], m = compiled(box["state"], data)
        jax.block_until_ready(m["loss"])
      run()  # warm-up
      steps[fw] = run
    times = {fw: [float("nan")] for fw in frameworks} if a.flops_only else alternating_times(steps, a.reps)
    base = np.array(times["longclip"])
    for fw in frameworks:
      t = np.array(times[fw])
      rows.append({"model": name, "batch": batch, "framework": fw, "step (s, median)": float(np.median(t)),
                   "time vs HN-CLIP (median of per-rep ratios)": float(np.median(t / base)),
                   "matmul TFLOP/step": flops[fw] / 1e12, "matmul FLOPs vs HN-CLIP": flops[fw] / flops["longclip"]})
    print(table([r for r in rows if r["model"] == name], list(rows[0])), flush=True)
  dump(a.json, {"device": f"{jax.device_count()}x {jax.devices()[0].device_kind}", "rows": rows})


if __name__ == "__main__":
  main()
