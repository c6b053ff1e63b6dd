"""The CPU train step on the system malloc vs tcmalloc (hnclip_jax/hostmem.py): step time, page faults and kernel
time per step. The allocator is fixed when a process starts, so each measurement is a fresh child process
(HNCLIP_TCMALLOC=0 vs the found/given tcmalloc); the two settings alternate for --rounds rounds and the speed-up
is the median of the per-round ratios.

  python benchmarks/host_allocator.py [--model tiny] [--batch 64] [--steps 10] [--rounds 3] [--json out.json]
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hnclip_jax import hostmem  # noqa: E402  (standard library only: no JAX in the parent)


def child(model: str, batch: int, steps: int) -> dict:
  """Times `steps` train steps after 3 warm-up steps in this process; returns medians and per-step rusage deltas."""
  import resource
  import time

  import jax
  import ml_collections
  import numpy as np

  from benchmarks.common import make_step, random_batch
  from hnclip_jax import sharding, train_step
  from hnclip_jax.models import PRESETS, init_params
  cfg = PRESETS[model]
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1}))
  data = random_batch(cfg, batch, mesh)
  _, params = init_params(cfg, 0)
  step, tx, sh, _, _ = make_step(cfg, 0.5, mesh)
  state = jax.jit(lambda: train_step.init_state(params, tx), out_shardings=sh)()
  for _ in range(3):
    state, m = step(state, data)
    jax.block_until_ready(m["loss"])
  times = []
  r0 = resource.getrusage(resource.RUSAGE_SELF)
  for _ in range(steps):
    t = time.perf_counter()
    state, m = step(state, data)
    jax.block_until_ready(m["loss"])
    times.append(time.perf_counter() - t)
  r1 = resource.getrusage(resource.RUSAGE_SELF)
  return {"allocator": hostmem.host_allocator(), "step_s": float(np.median(times)),
          "page_faults_per_step": (r1.ru_minflt - r0.ru_minflt) / steps,
          "kernel_ms_per_step": 1e3 * (r1.ru_stime - r0.ru_stime) / steps,
          "user_ms_per_step": 1e3 * (r1.ru_utime - r0.ru_utime) / steps}


def run_child(setting: str, a) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "_HNCLIP_TCMALLOC_REEXEC")}
  env[hostmem.ENV] = setting
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--model", a.model, "--batch",
                        str(a.batch), "--steps", str(a.steps)], env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="tiny")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--steps", type=int, default=10, help="timed steps per child process (median)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--tcmalloc", default="auto", help="path of the tcmalloc library; 'auto' searches")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--json", default="")
  a = p.parse_args()
  if a.child:
    hostmem.use_tcmalloc()  # re-execs under the library HNCLIP_TCMALLOC names (run_child sets it), unless it is 0
    print(json.dumps(child(a.model, a.batch, a.steps)))
    return
  lib = hostmem.preload_target({hostmem.ENV: a.tcmalloc})
  if lib is None:
    sys.exit("error: no tcmalloc found (apt-get install libtcmalloc-minimal4, or pass --tcmalloc PATH)")
  from benchmarks.common import dump, table
  import numpy as np
  runs = {"system malloc": [], "tcmalloc": []}
  for rnd in range(a.rounds):
    for name in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
      runs[name].append(run_child("0" if name == "system malloc" else lib, a))
  rows = []
  base = np.array([r["step_s"] for r in runs["system malloc"]])
  for name, rs in runs.items():
    ratios = base / np.array([r["step_s"] for r in rs])
    rows.append({"allocator": name, "library": rs[0]["allocator"],
                 "step_s": float(np.median([r["step_s"] for r in rs])),
                 "speedup_vs_system": float(np.median(ratios)), "speedup_min": float(ratios.min()),
                 "speedup_max": float(ratios.max()),
                 **{k: float(np.median([r[k] for r in rs]))
                    for k in ("page_faults_per_step", "kernel_ms_per_step", "user_ms_per_step")}})
  print(f"train step ({a.model}, batch {a.batch}, CPU), {a.rounds} rounds x {a.steps} steps per allocator; "
        f"tcmalloc = {lib}")
  print(table(rows, list(rows[0])))
  dump(a.json, rows)


if __name__ == "__main__":
  main()
