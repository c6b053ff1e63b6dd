"""Helpers shared by the benchmark scripts: timing, model FLOPs, peak matmul rate, tables."""
import json
import statistics
import time

import jax
import jax.numpy as jnp


def median_time(fn, reps: int, warmup: int = 1) -> float:
  """Median wall time of fn() (which must block until done) over `reps` runs after `warmup` runs."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def alternating_times(fns, reps: int, inner: int = 1, warmup: int = 0, each_rep=None) -> dict:
  """Times {name: fn} side by side: `reps` repetitions, the order reversed every other one so that a shared machine's
  drift hits all alike; each entry is median_time(fn, inner, warmup). `each_rep()` runs at the start of every
  repetition. Returns {name: [seconds, one per repetition]}."""
  out = {n: [] for n in fns}
  names = list(fns)
  for rep in range(reps):
    if each_rep is not None:
      each_rep()
    for n in (names if rep % 2 == 0 else names[::-1]):
      out[n].append(median_time(fns[n], inner, warmup))
  return out


def peak_matmul_probe(n: int = 2048):
  """A function that returns the FLOP/s of a large fp32 jnp.dot on the default device, measured when called
  (compiled once, so it can be called between timed steps to track a shared machine's drifting speed)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  return lambda reps=3: 2 * n ** 3 / median_time(lambda: f(a).block_until_ready(), reps, warmup=0)


def peak_matmul_flops(n: int = 2048, reps: int = 5) -> float:
  """FLOP/s of a large fp32 jnp.dot on the default device, measured now."""
  return peak_matmul_probe(n)(reps)


def tower_flops(tokens: int, width: int, layers: int, mlp: int) -> float:
  """Forward matmul FLOPs of a transformer tower on one sequence (q,k,v,out projections, attention, MLP)."""
  per_layer = 2 * tokens * (4 * width * width + 2 * width * mlp) + 2 * 2 * tokens * tokens * width
  return layers * per_layer


def clip_train_flops(cfg, batch: int) -> float:
  """Analytic FLOPs of one HN-CLIP train step (forward + backward ≈ 3 × forward, plus the loss matrices)."""
  patches = (cfg.image_size // cfg.patch_size) ** 2
  img = (tower_flops(patches + 1, cfg.vision_width, cfg.vision_layers, cfg.vision_mlp_dim)
         + 2 * patches * cfg.patch_size ** 2 * 3 * cfg.vision_width + 2 * cfg.vision_width * cfg.embed_dim)
  txt = (tower_flops(cfg.text_context, cfg.text_width, cfg.text_layers, cfg.text_mlp_dim)
         + 2 * cfg.text_width * cfg.embed_dim)
  loss = 3 * 2 * batch * batch * cfg.embed_dim  # S, Sᵀ, Ḡ
  return 3 * (batch * (img + txt) + loss)


def matmul_flops(compiled) -> float:
  """Matmul FLOPs of one execution of a compiled program, every loop iteration counted (the HLO walk
  tools/compile_for uses; `compiled.cost_analysis()` counts a scan or while body once, so a chunked or tiled term,
  gradient accumulation or the token term's blocks are under-counted by their trip counts)."""
  from hnclip_jax import hlo
  return hlo.matmul_flops(compiled.as_text())


def token_term_forward_flops(batch: int, patches: int, tokens: int, dim: int) -> float:
  """The token term's forward FLOPs (paper Eq. 3, FILIP): one [P, L] similarity of E-dim features per image-caption
  pair of the batch, both directions from it: 2·B²·P·L·E."""
  return 2.0 * batch * batch * patches * tokens * dim


def table(rows, cols) -> str:
  out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    out.append("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
  return "\n".join(out)


def dump(path, obj):
  if path:
    with open(path, "w") as f:
      json.dump(obj, f, indent=2)


def make_step(cfg, gamma: float, mesh, opt_overrides=None, loss_overrides=None, grad_accum_steps: int = 1):
  """The train step train.py runs (train_step.build_program of a run.Run) for model config `cfg` on `mesh`,
  with config.loss.gamma = gamma and the given config.optimizer / config.loss overrides -> (step, tx, state
  shardings, graphdef, run config)."""
  from hnclip_jax import run, train_step  # not experiment: no data packages for a step on random inputs
  from hnclip_jax.config import base_config
  run_cfg = base_config()
  run_cfg.total_steps = 1000
  run_cfg.optimizer.update({**dict(lr=1e-4, weight_decay=0.1, warmup_steps=1, b1=0.9, b2=0.98, eps=1e-6,
                                   grad_clip_norm=1.0), **(opt_overrides or {})})
  run_cfg.loss.update({"gamma": gamma, "chunk_size": 0, "negatives": "global_batch", **(loss_overrides or {})})
  run_cfg.grad_accum_steps = grad_accum_steps
  program = train_step.build_program(run.Run.of(run_cfg, cfg, mesh))
  return program.step, program.tx, program.shardings, program.graphdef, run_cfg


def random_batch(cfg, batch: int, mesh, seed: int = 0, extra=None):
  """A global batch for model config `cfg` on `mesh`: normal-noise images and full-length token rows
  (BOS id 1, random ids, EOT); `extra`: a framework's further inputs as {name: ShapeDtypeStruct [batch, ...]}
  (`train_step.abstract_batch`), filled by kind: images (a trailing [S, S, 3]) with noise, token rows with the
  captions rolled by one, other floats (masks) with 1 on a random quarter, bools with True."""
  import numpy as np
  from hnclip_jax import sharding
  r = np.random.default_rng(seed)
  ids = np.concatenate([np.full((batch, 1), 1), r.integers(4, cfg.vocab_size - 1, (batch, cfg.text_context - 2)),
                        np.full((batch, 1), cfg.eot_token_id)], 1).astype(np.int32)
  data = {"image": r.normal(size=(batch, cfg.image_size, cfg.image_size, 3)).astype(np.float32), "tokens": ids}
  for name, spec in (extra or {}).items():
    if name in data:
      continue
    shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
    if dtype == np.bool_:
      data[name] = np.ones(shape, bool)
    elif np.issubdtype(dtype, np.integer):
      data[name] = np.roll(ids, 1, axis=0).astype(dtype)
    elif shape[-3:] == (cfg.image_size, cfg.image_size, 3):
      data[name] = r.normal(size=shape).astype(dtype)
    else:
      data[name] = (r.random(shape) < 0.25).astype(dtype)
  return sharding.to_global(data, mesh)
