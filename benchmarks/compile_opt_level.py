"""What lower compiler optimisation does to the test suite's cost on CPU: JAX's own `jax_disable_most_optimizations`
(XLA backend optimisation level 0, no expensive LLVM passes, fewer HLO passes), XLA's backend (LLVM) optimisation
level 0 alone (`XLA_FLAGS=--xla_backend_optimization_level=0`), XLA's classic CPU emitters instead of its fusion
emitters (`--xla_cpu_use_fusion_emitters=false`), and both together (what the tests use): compile time and step time
of the tiny train step (configs/demo.py:test's model), and the compile time of a batch of small eager-style programs,
each measured in a fresh process with an empty compilation cache, the settings side by side in one run (issue 52:
the cold test run).

  python benchmarks/compile_opt_level.py [--reps 3]
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, ROOT)
import jax, jax.numpy as jnp, numpy as np
from benchmarks.common import make_step, random_batch
from hnclip_jax import sharding
from hnclip_jax.models import CLIPConfig, init_params
from hnclip_jax import train_step
cfg = CLIPConfig(vocab_size=128, eot_token_id=3, image_size=32, patch_size=8).validate()
mesh = sharding.make_mesh(__import__("hnclip_jax.config", fromlist=["x"]).base_config().mesh, jax.devices()[:1])
t0 = time.perf_counter()
step, tx, sh, _, _ = make_step(cfg, 0.5, mesh)
state = jax.device_put(train_step.init_state(init_params(cfg, 0)[1], tx), sh)
batch = random_batch(cfg, 32, mesh)
t1 = time.perf_counter()
compiled = step.lower(state, batch).compile()
t2 = time.perf_counter()
state, m = compiled(state, batch); jax.block_until_ready(m["loss"])
times = []
for _ in range(10):
  t = time.perf_counter(); state, m = compiled(state, batch); jax.block_until_ready(m["loss"]); times.append(time.perf_counter() - t)
# small programs, as eager code compiles them (one per new shape/op)
t3 = time.perf_counter()
for n in range(40):
  x = jnp.ones((n + 1, 7)); jax.block_until_ready((jnp.tanh(x) @ x.T).sum() + n)
t4 = time.perf_counter()
print("RESULT " + json.dumps({"setup_s": t1 - t0, "compile_s": t2 - t1, "step_ms": 1e3 * float(np.median(times)),
                               "eager_s": t4 - t3, "loss": float(m["loss"])}))
""".replace("ROOT", repr(ROOT))


SETTINGS = {"default": {}, "JAX_DISABLE_MOST_OPTIMIZATIONS=1": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},
            "--xla_backend_optimization_level=0": {"XLA_FLAGS": "--xla_backend_optimization_level=0"},
            "--xla_cpu_use_fusion_emitters=false": {"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"},
            # the test suite's setting (tests/conftest.py TEST_XLA_FLAGS)
            "level 0 + classic emitters": {"XLA_FLAGS": "--xla_backend_optimization_level=0 "
                                                        "--xla_cpu_use_fusion_emitters=false"}}


def child(setting: str) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  env.update(SETTINGS[setting])
  out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True).stdout
  return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=3)
  a = ap.parse_args()
  rows = {s: [] for s in SETTINGS}
  for _ in range(a.reps):  # alternating
    for s in SETTINGS:
      rows[s].append(child(s))
  med = lambda s, k: sorted(r[k] for r in rows[s])[len(rows[s]) // 2]
  print("| setting | train-step compile (s) | step (ms) | 40 small programs (s) | loss after 11 steps | "
        "compile / default | small / default | step / default |")
  print("|---|---|---|---|---|---|---|---|")
  for s in SETTINGS:
    print(f"| {s} | {med(s, 'compile_s'):.2f} | {med(s, 'step_ms'):.1f} | {med(s, 'eager_s'):.2f} | "
          f"{rows[s][0]['loss']:.6f} | {med(s, 'compile_s') / med('default', 'compile_s'):.2f} | "
          f"{med(s, 'eager_s') / med('default', 'eager_s'):.2f} | {med(s, 'step_ms') / med('default', 'step_ms'):.2f} |")


if __name__ == "__main__":
  main()
