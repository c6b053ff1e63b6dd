"""Saturation telemetry: is plain InfoNCE still learning on this batch, and how hard are the negatives?

All functions work on the mesh like the loss: rows of the similarity matrices stay on their devices and only
scalars are reduced. They run only on the steps that log them (see train.py), so other steps pay nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from hnclip_jax import losses, sharding
from hnclip_jax.models import bind

SATURATED = 1e-3  # a per-example loss below this counts as saturated (the paper's threshold)


def margin_stats(txt, mesh, axes=sharding.BATCH_AXES):
  """txt [B, D] normalised text embeddings -> (mean, max of Ḡ off the diagonal, mean hardest-negative similarity)."""
  axes = tuple(axes)
  batch = txt.shape[0]

  def local(t):
    n = t.shape[0]
    t_all = jax.lax.all_gather(t, axes, axis=0, tiled=True)
    g = t.astype(jnp.float32) @ t_all.astype(jnp.float32).T  # [n, B]
    pos = (jax.lax.axis_index(axes) * n + jnp.arange(n))[:, None] == jnp.arange(batch)[None, :]
    off_sum = jax.lax.psum(jnp.sum(jnp.where(pos, 0.0, g)), axes)
    off_max = jax.lax.pmax(jnp.max(jnp.where(pos, -jnp.inf, g)), axes)
    hardest = jax.lax.psum(jnp.sum(jnp.max(jnp.where(pos, -jnp.inf, g), axis=1)), axes)
    return off_sum / (batch * (batch - 1)), off_max, hardest / batch

  return jax.shard_map(local, mesh=mesh, in_specs=P(axes), out_specs=(P(), P(), P()))(txt)


def make_batch_diagnostics(graphdef, mesh, gamma: float):
  """Jitted (params, batch) -> dict of scalars for the HN-CLIP loss and, on the same logits without the margin,
  plain InfoNCE: share of saturated examples, loss, gradient norm w.r.t. the embeddings (and whether it is exactly
  0 in fp32), plus Ḡ statistics. Costs one forward pass of the towers."""

  def diag(params, batch):
    model = bind(graphdef, params)
    img, txt, scale = model.encode_image(batch["image"]), model.encode_text(batch["tokens"]), model.scale()
    out = {}
    for name, g in (("hn", gamma), ("infonce", 0.0)):
      def loss(i, t, g=g):
        value, i2t, t2i = losses.sharded_hn_clip_loss(i, t, scale, g, mesh, sharding.BATCH_AXES)
        return value, 0.5 * (i2t + t2i)
      (value, per_example), (gi, gt) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(img, txt)
      norm = optax.tree.norm((gi, gt))
      out[f"diag/{name}/loss"] = value
      out[f"diag/{name}/saturated_frac"] = jnp.mean(per_example < SATURATED)
      out[f"diag/{name}/emb_grad_norm"] = norm
      out[f"diag/{name}/emb_grad_zero"] = (norm == 0).astype(jnp.float32)
    mean, mx, hardest = margin_stats(txt, mesh)
    out.update({"diag/G_offdiag_mean": mean, "diag/G_offdiag_max": mx, "diag/hardest_negative_sim": hardest})
    return out

  batch_sh = sharding.batch_sharding(mesh)
  return jax.jit(diag, in_shardings=(None, batch_sh), out_shardings=sharding.replicated(mesh))


def make_gradient_comparison(graphdef, mesh, gamma: float, param_shardings):
  """Jitted (params, batch) -> parameter-gradient norms of HN-CLIP and InfoNCE on the same batch, whether each is
  exactly 0, their ratio and cosine. Two backward passes: run it every config.diagnostics.every steps only."""

  def grads(params, batch, g):
    def loss(p):
      model = bind(graphdef, p)
      return losses.sharded_hn_clip_loss(model.encode_image(batch["image"]), model.encode_text(batch["tokens"]),
                                         model.scale(), g, mesh, sharding.BATCH_AXES)[0]
    return jax.grad(loss)(params)

  def compare(params, batch):
    hn, nce = grads(params, batch, gamma), grads(params, batch, 0.0)
    dot = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(hn), jax.tree.leaves(nce)))
    n_hn, n_nce = optax.tree.norm(hn), optax.tree.norm(nce)
    return {"diag/hn/param_grad_norm": n_hn, "diag/infonce/param_grad_norm": n_nce,
            "diag/hn/param_grad_zero": (n_hn == 0).astype(jnp.float32),
            "diag/infonce/param_grad_zero": (n_nce == 0).astype(jnp.float32),
            "diag/grad_norm_ratio_hn_over_infonce": n_hn / jnp.maximum(n_nce, 1e-38),
            "diag/grad_cosine": dot / jnp.maximum(n_hn * n_nce, 1e-38)}

  batch_sh = sharding.batch_sharding(mesh)
  return jax.jit(compare, in_shardings=(param_shardings, batch_sh), out_shardings=sharding.replicated(mesh))
