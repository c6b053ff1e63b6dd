"""Optimizer and the jitted, sharded train step."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from hnclip_jax import losses, sharding
from hnclip_jax.models import bind


def lr_schedule(opt_cfg, total_steps: int):
  """Linear warmup from 0 to `lr`, then cosine decay to 0 at `total_steps`."""
  warmup = min(int(opt_cfg.warmup_steps), max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(0.0, opt_cfg.lr, warmup_steps=warmup,
                                            decay_steps=max(total_steps, warmup + 1), end_value=0.0)


def make_optimizer(opt_cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW with warmup-cosine schedule; weight decay only on matrices (no biases, norms, scale)."""
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  chain = []
  if opt_cfg.grad_clip_norm and opt_cfg.grad_clip_norm > 0:
    chain.append(optax.clip_by_global_norm(opt_cfg.grad_clip_norm))
  chain.append(optax.adamw(lr_schedule(opt_cfg, total_steps), b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                           weight_decay=opt_cfg.weight_decay, mask=decay_mask))
  return optax.chain(*chain)


def init_state(params, tx) -> dict:
  """The train state: {"step": int32 [], "params": ..., "opt_state": ...}."""
  return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}


def state_shardings(abstract_state, mesh):
  return jax.tree.map(lambda _: sharding.replicated(mesh), abstract_state)


def make_loss_fn(graphdef, mesh, gamma: float):
  """(params, batch) -> (loss, aux). batch: image f32 [B,H,W,3], tokens int32 [B,L], sharded over the batch axes."""

  def loss_fn(params, batch):
    model = bind(graphdef, params)
    img = model.encode_image(batch["image"])  # [B, E]
    txt = model.encode_text(batch["tokens"])  # [B, E]
    scale = model.scale()
    loss, i2t, t2i = losses.sharded_hn_clip_loss(img, txt, scale, gamma, mesh, sharding.BATCH_AXES)
    return loss, {"logit_scale": scale, "i2t": i2t, "t2i": t2i}

  return loss_fn


def make_train_step(graphdef, tx, mesh, gamma: float, schedule, abstract_state):
  """Returns jitted step(state, batch) -> (state, metrics); the state is donated."""
  loss_fn = make_loss_fn(graphdef, mesh, gamma)

  def step(state, batch):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": loss, "lr": schedule(state["step"]), "logit_scale": aux["logit_scale"],
               "grad_norm": optax.global_norm(grads)}
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

  shardings = state_shardings(abstract_state, mesh)
  batch_sh = sharding.batch_sharding(mesh)
  return jax.jit(step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, sharding.replicated(mesh)),
                 donate_argnums=0)


def make_embed_fn(graphdef, mesh):
  """Jitted (params, images [B,H,W,3], tokens [B,L]) -> (img_emb [B,E], txt_emb [B,E]), batch-sharded."""

  def embed(params, images, tokens):
    model = bind(graphdef, params)
    return model.encode_image(images), model.encode_text(tokens)

  batch_sh = sharding.batch_sharding(mesh)
  return jax.jit(embed, in_shardings=(None, batch_sh, batch_sh), out_shardings=(batch_sh, batch_sh))
