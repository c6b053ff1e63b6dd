"""Cost of the saturation telemetry: a logging step (diagnostics + train step) vs a plain train step, and the
every-N gradient comparison, measured interleaved in one process. Steps that do not log run the plain program.

  python benchmarks/diagnostics_overhead.py [--batch 128] [--reps 7]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import make_step, median_time  # noqa: E402
from hnclip_jax import diagnostics, sharding, train_step  # noqa: E402
from hnclip_jax.models import PRESETS, init_params  # noqa: E402
from hnclip_jax.objective import Objective  # noqa: E402


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--log_every", type=int, default=50)
  a = p.parse_args()
  cfg = PRESETS["tiny"].__class__(**{**PRESETS["tiny"].__dict__, "vocab_size": 128, "eot_token_id": 3})
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1}))
  step, tx, sh, graphdef, _ = make_step(cfg, 0.5, mesh)
  _, params = init_params(cfg, 0)
  objective = Objective.of(gamma=0.5)
  diag = diagnostics.make_batch_diagnostics(graphdef, mesh, objective)
  compare = diagnostics.make_gradient_comparison(graphdef, mesh, objective, sh["params"])
  r = np.random.default_rng(0)
  b = a.batch
  batch = sharding.to_global({"image": r.normal(size=(b, 64, 64, 3)).astype(np.float32),
                              "tokens": np.concatenate([np.full((b, 1), 2), r.integers(4, 120, (b, 60)),
                                                        np.full((b, 1), 3), np.zeros((b, 14), np.int64)], 1)
                              .astype(np.int32)}, mesh)
  holder = [jax.jit(lambda: train_step.init_state(params, tx), out_shardings=sh)()]

  def plain():
    holder[0], m = step(holder[0], batch)
    jax.block_until_ready(m)

  def logged():
    d = diag(holder[0]["params"], batch)
    holder[0], m = step(holder[0], batch)
    jax.block_until_ready((d, m))

  def compared():
    jax.block_until_ready(compare(holder[0]["params"], batch))

  for f in (plain, logged, compared):
    f()
  t = {"plain": [], "logged": [], "compare": []}
  for _ in range(a.reps):
    t["plain"].append(median_time(plain, 1, 0))
    t["logged"].append(median_time(logged, 1, 0))
    t["compare"].append(median_time(compared, 1, 0))
  m = {k: float(np.median(v)) for k, v in t.items()}
  per_log = m["logged"] / m["plain"] - 1
  print(f"tiny model, batch {b}, CPU: plain step {m['plain']*1e3:.0f} ms; logging step {m['logged']*1e3:.0f} ms "
        f"(+{100 * per_log:.0f}%); gradient comparison {m['compare']*1e3:.0f} ms "
        f"({m['compare'] / m['plain']:.2f}× a step)")
  print(f"amortised over log_every={a.log_every}: +{100 * per_log / a.log_every:.2f}% of training time; "
        "steps that do not log run the unchanged train step (0%)")


if __name__ == "__main__":
  main()
