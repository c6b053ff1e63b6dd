"""Forward+backward time of the pieces of a transformer block, for the code choices that make the CPU step fast:
attention implementation (config.attention), the token layout of the dense layers ([B, L, W] vs [B*L, W]) and
XLA:CPU's YNNPACK fusions (sharding.CPU_COMPILER_OPTIONS), with torch 2.13 on the same inputs as the reference.
Every variant is compiled in the same process and timed in alternating order; each row is the median over the
repetitions, the ratio the median of the per-repetition ratios to the first row of its group.

  python benchmarks/layers.py [--batch 64] [--width 128] [--heads 4] [--mlp 512] [--step_batch 64] [--reps 9]
                              [--json out.json]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # tcmalloc when installed (train.py: HNCLIP_TCMALLOC=1): hnclip_jax/hostmem.py
  from hnclip_jax import hostmem
  hostmem.use_tcmalloc(default="auto")  # measured under tcmalloc when installed, as docs/benchmarks.md says

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import alternating_times, dump, table  # noqa: E402
from hnclip_jax import hostmem  # noqa: E402
from hnclip_jax.models.clip import einsum_attention, quick_gelu  # noqa: E402
from hnclip_jax.sharding import CPU_COMPILER_OPTIONS  # noqa: E402


def compile_grad(f, args, options=None):
  g = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.square(f(*a))), argnums=tuple(range(len(args)))))
  c = g.lower(*args).compile(compiler_options=options or {})
  return lambda: jax.block_until_ready(c(*args))


def torch_fns(a, causal, x, w1, w2):
  import torch
  torch.set_num_threads(os.cpu_count())
  q, k, v = (torch.tensor(np.asarray(t)).transpose(1, 2).contiguous().requires_grad_() for t in (a, a, a))

  def attn():
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.square().sum().backward()
    q.grad = k.grad = v.grad = None

  tx, t1, t2 = (torch.tensor(np.asarray(t), requires_grad=True) for t in (x, w1, w2))

  def mlp():
    h = tx @ t1
    ((h * torch.sigmoid(1.702 * h)) @ t2).square().sum().backward()
    tx.grad = t1.grad = t2.grad = None

  return attn, mlp


def step_fns(batch):
  """The whole tiny-model train step, compiled with sharding.CPU_COMPILER_OPTIONS and with XLA's defaults."""
  import ml_collections
  from benchmarks.common import make_step, random_batch
  from hnclip_jax import sharding, train_step
  from hnclip_jax.models import PRESETS, init_params
  cfg = PRESETS["tiny"]
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1}))
  data = random_batch(cfg, batch, mesh)
  _, params = init_params(cfg, 0)
  fns, default = {}, sharding.compiler_options
  for name, options in (("off (CPU_COMPILER_OPTIONS)", default), ("on (XLA default)", lambda mesh: None)):
    sharding.compiler_options = options
    step, tx, sh, _, _ = make_step(cfg, 0.5, mesh)
    sharding.compiler_options = default
    holder = [jax.jit(lambda: train_step.init_state(params, tx), out_shardings=sh)()]

    def run(step=step, holder=holder):
      holder[0], m = step(holder[0], data)
      jax.block_until_ready(m["loss"])
    fns[name] = run
  return fns


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--width", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--mlp", type=int, default=512)
  p.add_argument("--reps", type=int, default=9)
  p.add_argument("--no_torch", action="store_true")
  p.add_argument("--step_batch", type=int, default=64, help="batch of the whole-train-step rows (0: skip them)")
  p.add_argument("--json", default="")
  a = p.parse_args()
  r = np.random.default_rng(0)
  b, w, h = a.batch, a.width, a.heads
  rows = []
  for length, causal in ((65, False), (77, True)):  # the tiny image tower (64 px / 8) and the causal text tower
    qkv = jnp.asarray(r.normal(size=(b, length, h, w // h)).astype(np.float32))
    x3 = jnp.asarray(r.normal(size=(b, length, w)).astype(np.float32))
    w1 = jnp.asarray(r.normal(size=(w, a.mlp)).astype(np.float32) * w ** -0.5)
    w2 = jnp.asarray(r.normal(size=(a.mlp, w)).astype(np.float32) * a.mlp ** -0.5)
    dpa = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    mlp = lambda x, w1, w2: quick_gelu(x @ w1) @ w2
    groups = {
        "attention": {"einsum": compile_grad(lambda q, k, v: einsum_attention(q, k, v, causal), (qkv,) * 3),
                      "xla (jax.nn.dot_product_attention)": compile_grad(dpa, (qkv,) * 3)},
        "MLP": {"[B*L, W] tokens": compile_grad(mlp, (x3.reshape(-1, w), w1, w2)),
                "[B, L, W] tokens": compile_grad(mlp, (x3, w1, w2))},
        "MLP, XLA:CPU YNN fusions": {"off (CPU_COMPILER_OPTIONS)": compile_grad(mlp, (x3.reshape(-1, w), w1, w2),
                                                                                 CPU_COMPILER_OPTIONS),
                                     "on (XLA default)": compile_grad(mlp, (x3.reshape(-1, w), w1, w2))},
    }
    # The batched matmul inside attention (one [L, D] x [D, L] product per example and head), forward only.
    qb = qkv.transpose(0, 2, 1, 3).reshape(b * h, length, w // h)
    bmm = jax.jit(lambda x: x @ x.transpose(0, 2, 1))
    groups["attention scores, batched matmul (forward only)"] = {"XLA": lambda: jax.block_until_ready(bmm(qb))}
    if not a.no_torch:
      import torch
      t_attn, t_mlp = torch_fns(qkv, causal, x3.reshape(-1, w), w1, w2)
      groups["attention"]["torch sdpa"] = t_attn
      groups["MLP"]["torch"] = t_mlp
      tq = torch.tensor(np.asarray(qb))
      groups["attention scores, batched matmul (forward only)"]["torch bmm"] = lambda: torch.bmm(tq, tq.transpose(1, 2))
    if causal and a.step_batch:
      groups["train step (tiny model), XLA:CPU YNN fusions"] = step_fns(a.step_batch)
    for group, fns in groups.items():
      t = alternating_times(fns, a.reps, inner=3, warmup=1)
      first = np.array(t[next(iter(fns))])
      for name, ts in t.items():
        ts = np.array(ts)
        shape = f"{b}x{length}" + (" causal" if causal else "")
        shape = f"batch {a.step_batch}" if group.startswith("train step") else shape
        rows.append({"tokens": shape, "what": group, "variant": name,
                     "fwd_bwd_ms": float(np.median(ts)) * 1e3, "time_vs_first": float(np.median(ts / first))})
  print(f"forward+backward, {jax.devices()[0].device_kind}, fp32, width {w}, {h} heads, MLP {a.mlp}, "
        f"{hostmem.host_allocator()}")
  print(table(rows, list(rows[0])))
  dump(a.json, rows)


if __name__ == "__main__":
  main()
