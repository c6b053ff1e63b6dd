"""Benchmark 5: per-device temporary memory of the sharded HN-CLIP loss (value + gradient) vs the global batch,
with and without row chunking, from XLA's memory analysis of the compiled program (nothing is run).

  python benchmarks/loss_memory.py [--devices 8] [--dim 768] [--batches 1024,...,65536] [--chunk 256] [--json f]

On CPU the script fakes --devices devices; on an accelerator it uses the real ones.
"""
import argparse
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("--devices", type=int, default=8)
p.add_argument("--dim", type=int, default=768)
p.add_argument("--batches", default="1024,2048,4096,8192,16384,32768,65536")
p.add_argument("--chunk", type=int, default=256)
p.add_argument("--json", default="")
a = p.parse_args()
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={a.devices}").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks.common import dump, table  # noqa: E402
from hnclip_jax.objective import Objective, embedding_outputs  # noqa: E402

n_dev = min(a.devices, jax.device_count())
mesh = Mesh(np.array(jax.devices()[:n_dev]).reshape(n_dev, 1, 1), ("data", "fsdp", "tensor"))
sh = NamedSharding(mesh, P(("data", "fsdp")))
rows = []
for b in [int(x) for x in a.batches.split(",")]:
  row = {"global_batch": b, "rows_per_device": b // n_dev}
  for chunk in (None, a.chunk):
    x = jax.ShapeDtypeStruct((b, a.dim), jnp.float32, sharding=sh)
    f = lambda i, t, c=chunk: Objective.of(gamma=0.5, chunk_size=c or 0)(embedding_outputs(i, t, 30.0), mesh)[0]
    m = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(x, x).compile().memory_analysis()
    row["MB_unchunked" if chunk is None else f"MB_chunk{a.chunk}"] = m.temp_size_in_bytes / 1e6
  row["full_BxB_MB"] = b * b * 4 / 1e6
  rows.append(row)
print(f"sharded loss temp memory per device, {n_dev} {jax.devices()[0].platform} devices, D = {a.dim}")
print(table(rows, list(rows[0])))
dump(a.json, rows)
