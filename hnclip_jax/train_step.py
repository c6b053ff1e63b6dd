"""Optimizer and the jitted, sharded train step (with optional gradient accumulation)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from hnclip_jax import losses, sharding
from hnclip_jax.models import bind

NEGATIVES = ("micro_batch", "global_batch")

# XLA:CPU compiles element-wise producers of a matmul (LayerNorm's scale, softmax's 1/sum) into separate
# materialised broadcasts when its YNNPACK fusions are on; with them off they fuse, the MLP is 7-12% and the whole
# step a few percent faster on CPU (benchmarks/layers.py, docs/benchmarks.md). Step and embed programs on CPU
# meshes only.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options(mesh):
  """XLA compiler options for the programs run on `mesh` (None: XLA's defaults)."""
  return dict(CPU_COMPILER_OPTIONS) if mesh.devices.flat[0].platform == "cpu" else None


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
  """The train state: step, params, opt_state, and the count / first step of non-finite updates (skipped)."""
  return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
          "nonfinite_steps": jnp.zeros((), jnp.int32), "first_nonfinite_step": jnp.full((), -1, jnp.int32)}


def check_accumulation(config, mesh) -> None:
  """Micro-batches must split evenly over the batch shards; raises naming the config keys."""
  a = config.grad_accum_steps
  if config.loss.negatives not in NEGATIVES:
    raise ValueError(f"config.loss.negatives={config.loss.negatives!r}; choose one of {NEGATIVES}")
  shards = sharding.batch_shards(mesh)
  if config.batch_size % (a * shards):
    raise ValueError(f"config.batch_size={config.batch_size} must be divisible by config.grad_accum_steps={a} × "
                     f"the {shards} batch shards = {a * shards}")
  per_device = config.batch_size // (a * shards)
  chunk = config.loss.chunk_size
  if chunk and per_device % chunk and chunk < per_device:
    raise ValueError(f"config.loss.chunk_size={chunk} must divide the per-device micro-batch "
                     f"{per_device} (batch_size / grad_accum_steps / batch shards)")


def _embed(graphdef, params, images, tokens):
  model = bind(graphdef, params)
  return model.encode_image(images), model.encode_text(tokens)  # [b, E] each


def _scale(graphdef, params):
  return bind(graphdef, params).scale()


def make_grad_fn(graphdef, mesh, gamma: float, chunk_size=None, accum_steps: int = 1,
                 negatives: str = "micro_batch"):
  """(params, batch) -> (loss, grads). batch: image f32 [B,H,W,3], tokens int32 [B,L], sharded over the batch axes.

  accum_steps > 1 splits the batch into micro-batches inside the step:
  - negatives="micro_batch": each micro-batch is its own contrastive batch (its own Ḡ); losses/grads averaged.
  - negatives="global_batch": embeddings of all micro-batches are computed first (no activations kept),
    the loss over the whole batch gives embedding gradients, then each micro-batch is recomputed and
    back-propagated (GradCache). The gradient equals the un-accumulated one; activation memory is one micro-batch.
  """

  def loss_of_embeddings(img, txt, scale):
    return losses.sharded_hn_clip_loss(img, txt, scale, gamma, mesh, sharding.BATCH_AXES, chunk_size)[0]

  def loss_fn(params, images, tokens):
    img, txt = _embed(graphdef, params, images, tokens)
    return loss_of_embeddings(img, txt, _scale(graphdef, params))

  if accum_steps == 1:
    return lambda params, batch: jax.value_and_grad(loss_fn)(params, batch["image"], batch["tokens"])

  micro_sharding = NamedSharding(mesh, P(None, sharding.BATCH_AXES))

  def split(x):  # [B, ...] -> [A, B/A, ...]; micro-batch k holds rows k, k+A, ... so it spans every device
    x = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x, micro_sharding)

  def merge(x):  # inverse of split: [A, B/A, ...] -> [B, ...]
    x = x.swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x.reshape(-1, *x.shape[2:]), sharding.batch_sharding(mesh))

  def micro_batch_negatives(params, batch):
    micro = (split(batch["image"]), split(batch["tokens"]))

    def body(acc, mb):
      loss, g = jax.value_and_grad(loss_fn)(params, *mb)
      return jax.tree.map(jnp.add, acc, (loss, g)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(body, zeros, micro)
    return loss / accum_steps, jax.tree.map(lambda g: g / accum_steps, grads)

  def global_batch_negatives(params, batch):
    micro = (split(batch["image"]), split(batch["tokens"]))
    _, (imgs, txts) = jax.lax.scan(lambda c, mb: (c, _embed(graphdef, params, *mb)), None, micro)
    scale, scale_vjp = jax.vjp(lambda p: _scale(graphdef, p), params)
    loss, (g_img, g_txt, g_scale) = jax.value_and_grad(loss_of_embeddings, argnums=(0, 1, 2))(
        merge(imgs), merge(txts), scale)

    def body(acc, xs):
      mb_img, mb_tok, gi, gt = xs
      _, vjp = jax.vjp(lambda p: _embed(graphdef, p, mb_img, mb_tok), params)
      return jax.tree.map(jnp.add, acc, vjp((gi, gt))[0]), None

    grads, _ = jax.lax.scan(body, scale_vjp(g_scale)[0], (*micro, split(g_img), split(g_txt)))
    return loss, grads

  if negatives == "micro_batch":
    return micro_batch_negatives
  if negatives == "global_batch":
    return global_batch_negatives
  raise ValueError(f"config.loss.negatives={negatives!r}; choose one of {NEGATIVES}")


def make_train_step(graphdef, tx, mesh, config, schedule, state_shardings):
  """Returns jitted step(state, batch) -> (state, metrics); the state is donated."""
  grad_fn = make_grad_fn(graphdef, mesh, config.loss.gamma, config.loss.chunk_size or None,
                         config.grad_accum_steps, config.loss.negatives)

  def step(state, batch):
    loss, grads = grad_fn(state["params"], batch)
    grad_norm = optax.tree.norm(grads)
    # A non-finite loss or gradient leaves parameters and optimizer state as they were; the host decides
    # (config.on_nonfinite) whether that ends the run or is only counted. A cond rather than a select of old vs
    # new: the update then happens in place in the donated buffers, with no second copy of parameters and
    # optimizer state alive at once (the copies and selects were ~15 ms of the tiny model's CPU step).
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(params, opt_state):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    params, opt_state = jax.lax.cond(finite, update, lambda p, o: (p, o), state["params"], state["opt_state"])
    bad = state["nonfinite_steps"] + jnp.where(finite, 0, 1)
    first = jnp.where((state["first_nonfinite_step"] < 0) & ~finite, state["step"] + 1, state["first_nonfinite_step"])
    metrics = {"loss": loss, "lr": schedule(state["step"]), "logit_scale": _scale(graphdef, state["params"]),
               "grad_norm": grad_norm, "nonfinite_steps": bad}
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "nonfinite_steps": bad,
            "first_nonfinite_step": first}, metrics

  batch_sh = sharding.batch_sharding(mesh)
  return jax.jit(step, in_shardings=(state_shardings, batch_sh),
                 out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0,
                 compiler_options=compiler_options(mesh))


def make_embed_fn(graphdef, mesh, param_shardings):
  """Jitted (params, images [B,H,W,3], tokens [B,L]) -> (img_emb [B,E], txt_emb [B,E]), batch-sharded."""
  batch_sh = sharding.batch_sharding(mesh)
  return jax.jit(lambda p, i, t: _embed(graphdef, p, i, t), in_shardings=(param_shardings, batch_sh, batch_sh),
                 out_shardings=(batch_sh, batch_sh), compiler_options=compiler_options(mesh))
