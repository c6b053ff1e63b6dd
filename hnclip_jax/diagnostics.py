"""Saturation telemetry: is plain InfoNCE still learning on this batch, and how hard are the negatives?

All functions work on the mesh like the loss: rows of the similarity matrices stay on their devices and only
scalars are reduced. They run only on the steps that log them (see train.py), so other steps pay nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from hnclip_jax import losses, sharding, train_step
from hnclip_jax.objective import GLOBAL_OUTPUTS, Objective

SATURATED = 1e-3  # a per-example loss below this counts as saturated (the paper's threshold)


def margin_stats(txt, mesh, axes=sharding.BATCH_AXES):
  """txt [B, D] normalised text embeddings -> (mean, max of Ḡ off the diagonal, mean hardest-negative similarity)."""
  axes = tuple(axes)
  batch = txt.shape[0]

  def local(t):
    n = t.shape[0]
    t_all = jax.lax.all_gather(t, axes, axis=0, tiled=True)
    g = losses.sims(t.astype(jnp.float32), t_all.astype(jnp.float32), "nd,bd->nb")  # [n, B]
    pos = (jax.lax.axis_index(axes) * n + jnp.arange(n))[:, None] == jnp.arange(batch)[None, :]
    off_sum = jax.lax.psum(jnp.sum(jnp.where(pos, 0.0, g)), axes)
    off_max = jax.lax.pmax(jnp.max(jnp.where(pos, -jnp.inf, g)), axes)
    hardest = jax.lax.psum(jnp.sum(jnp.max(jnp.where(pos, -jnp.inf, g), axis=1)), axes)
    return off_sum / (batch * (batch - 1)), off_max, hardest / batch

  return jax.shard_map(local, mesh=mesh, in_specs=P(axes), out_specs=(P(), P(), P()))(txt)


def _pairs(objective: Objective):
  """The run's objective and the same objective with its plain global term (γ = 0, no HN-NCE weighting or margin
  control): "infonce" for the softmax loss, "siglip" for the sigmoid loss."""
  return (("hn", objective), (objective.plain_name, objective.plain()))


def make_batch_diagnostics(graphdef, mesh, objective: Objective, accum_steps: int = 1,
                           negatives: str = "global_batch"):
  """Jitted (params, batch) -> dict of scalars for the run's objective and, on the same outputs, the objective with
  plain InfoNCE (γ = 0): share of saturated examples, loss, gradient norm w.r.t. the model's outputs (and whether
  it is exactly 0 in fp32), plus Ḡ statistics. Costs one forward pass of the towers, a micro-batch at a time
  (`accum_steps`), with the train step's negatives."""
  outputs_fn = train_step.make_outputs_fn(graphdef, mesh, objective, accum_steps)

  def diag(params, batch):
    floats, masks = train_step.partition_outputs(outputs_fn(params, batch))
    out = {}
    for name, obj in _pairs(objective):
      loss_of = train_step.make_loss_of_outputs(mesh, obj, accum_steps, negatives)
      (value, aux), g = jax.value_and_grad(loss_of, has_aux=True)(floats, masks)
      norm = optax.tree.norm({k: v for k, v in g.items() if k not in GLOBAL_OUTPUTS})
      out[f"diag/{name}/loss"] = value
      out[f"diag/{name}/saturated_frac"] = jnp.mean(aux["per_example"] < SATURATED)
      out[f"diag/{name}/emb_grad_norm"] = norm
      out[f"diag/{name}/emb_grad_zero"] = (norm == 0).astype(jnp.float32)
    mean, mx, hardest = margin_stats(floats["txt"], mesh)
    out.update({"diag/G_offdiag_mean": mean, "diag/G_offdiag_max": mx, "diag/hardest_negative_sim": hardest})
    return out

  batch_sh = sharding.batch_sharding(mesh)
  return jax.jit(diag, in_shardings=(None, batch_sh), out_shardings=sharding.replicated(mesh))


def make_gradient_comparison(graphdef, mesh, objective: Objective, param_shardings, accum_steps: int = 1,
                             negatives: str = "global_batch"):
  """Jitted (params, batch) -> parameter-gradient norms of the run's objective and of its InfoNCE version (γ = 0)
  on the same batch, whether each is exactly 0, their ratio and cosine. Both gradients come from the train
  step's own gradient function (same accumulation, so the same memory); run it every config.diagnostics.every
  steps only."""
  grad_fns = {name: train_step.make_grad_fn(graphdef, mesh, obj, accum_steps, negatives) for name, obj in _pairs(objective)}

  plain = objective.plain_name

  def compare(params, batch):
    hn, nce = (grad_fns[name](params, batch)[1] for name in ("hn", plain))
    dot = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(hn), jax.tree.leaves(nce)))
    n_hn, n_nce = optax.tree.norm(hn), optax.tree.norm(nce)
    return {"diag/hn/param_grad_norm": n_hn, f"diag/{plain}/param_grad_norm": n_nce,
            "diag/hn/param_grad_zero": (n_hn == 0).astype(jnp.float32),
            f"diag/{plain}/param_grad_zero": (n_nce == 0).astype(jnp.float32),
            f"diag/grad_norm_ratio_hn_over_{plain}": n_hn / jnp.maximum(n_nce, 1e-38),
            "diag/grad_cosine": dot / jnp.maximum(n_hn * n_nce, 1e-38)}

  batch_sh = sharding.batch_sharding(mesh)
  return jax.jit(compare, in_shardings=(param_shardings, batch_sh), out_shardings=sharding.replicated(mesh))
