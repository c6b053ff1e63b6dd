"""Per-step cost of the multi-process stop check: JAX's preemption sync point (what train.py uses) vs all-gathering
a stop flag every step (the fallback when `jax_enable_preemption_service=False`) vs no check at all.

  python benchmarks/stop_check.py [--processes 2] [--steps 200] [--reps 5] [--width 512] [--json out.json]

Starts a multi-process JAX job on 127.0.0.1 (one CPU device per process). Each process runs a small jitted step on a
global batch sharded across the processes, `--steps` times per timing, with each kind of check after every step;
the three kinds are timed interleaved, median of `--reps`. Process 0 prints the table.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import dump, table  # noqa: E402


def child(a):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P

  jax.distributed.initialize(a.coordinator, a.processes, a.process_id)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  rows = NamedSharding(mesh, P("data"))
  w = jax.device_put(jnp.eye(a.width) * 0.5, NamedSharding(mesh, P()))
  x = jax.make_array_from_process_local_data(rows, np.ones((256, a.width), np.float32))

  @jax.jit
  def step(x, w):
    y = jnp.tanh(x @ w)
    return y, jnp.mean(y)  # the mean is a cross-process reduction, like a loss

  checks = {
      "none": lambda i: False,
      "allgather": lambda i: bool(np.max(multihost_utils.process_allgather(np.int32(0)))),
      "sync_point": lambda i: multihost_utils.reached_preemption_sync_point(i),
  }
  counter = 0

  def timed(check):
    nonlocal x, counter
    t = time.perf_counter()
    for _ in range(a.steps):
      counter += 1
      x, _ = step(x, w)
      check(counter)
    jax.block_until_ready(x)
    return (time.perf_counter() - t) / a.steps * 1e3

  for check in checks.values():  # compile and warm up
    timed(check)
  times = {k: [] for k in checks}
  for _ in range(a.reps):
    for k, check in checks.items():
      times[k].append(timed(check))
  if a.process_id == 0:
    med = {k: statistics.median(v) for k, v in times.items()}
    print("RESULT " + json.dumps({"processes": a.processes, "steps": a.steps, "reps": a.reps, "ms_per_step": med}))
  jax.distributed.shutdown()


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--processes", type=int, default=2)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--json", default="")
  p.add_argument("--child", action="store_true")
  p.add_argument("--coordinator", default="")
  p.add_argument("--process_id", type=int, default=0)
  a = p.parse_args()
  if a.child:
    child(a)
    return
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  procs = [subprocess.Popen([sys.executable, __file__, "--child", f"--coordinator=127.0.0.1:{port}",
                             f"--processes={a.processes}", f"--process_id={i}", f"--steps={a.steps}",
                             f"--reps={a.reps}", f"--width={a.width}"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(a.processes)]
  outs = [p.communicate(timeout=900) for p in procs]
  if any(p.returncode for p in procs) or "RESULT " not in outs[0][0]:
    sys.exit("a process failed:\n" + "\n".join(err[-2000:] for _, err in outs))
  r = json.loads(outs[0][0].split("RESULT ", 1)[1])
  ms = r["ms_per_step"]
  print(f"stop check after every step, {a.processes} processes x 1 CPU device, {a.steps} steps, median of {a.reps}")
  print(table([{"check": k, "ms/step": v, "vs no check": v / ms["none"]} for k, v in ms.items()],
              ["check", "ms/step", "vs no check"]))
  dump(a.json, r)


if __name__ == "__main__":
  main()
