"""The jitted, sharded train step: forward, the objective, gradients (with optional accumulation over micro-batches,
with micro-batch or global-batch negatives), the optimizer update and its metrics; `Program` bundles what train.py
runs and tools/compile_for compiles ahead of time. The optimizer itself is in `hnclip_jax.optim`."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from hnclip_jax import sharding
from hnclip_jax.config import check_chunk_size, check_negatives
from hnclip_jax.models import abstract_model, bind, init_params
from hnclip_jax.objective import GLOBAL_OUTPUTS, Objective
from hnclip_jax.optim import (SCALE_PARAM, clamp_logit_scale, freeze_patterns, frozen_predicate, logit_scale_max,
                              lr_schedule, make_optimizer, param_path)




def init_state(params, tx) -> dict:
  """The train state: step, params, opt_state, and the count / first step of non-finite updates (skipped)."""
  return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
          "nonfinite_steps": jnp.zeros((), jnp.int32), "first_nonfinite_step": jnp.full((), -1, jnp.int32)}


# Compiler options of the program that makes the initial state, by platform. XLA:GPU hands every kernel's PTX to
# ptxas, whose optimiser needs minutes for the random-initialisation kernels of a large model (ViT-L/14: over 20 min
# on 2 cores, 59 s without its optimisations; ViT-B/16 130 s -> 31 s; docs/benchmarks.md). The program runs once.
INIT_COMPILER_OPTIONS = {"gpu": {"xla_gpu_disable_gpuasm_optimizations": True}}


def initial_state(tx, shardings, *, model_cfg=None, seed: int = 0, params=None) -> dict:
  """The train state at step 0, created on `shardings` by one jitted program: a fresh optimizer state over `params`
  (a fine-tuning start) or over `model_cfg`'s parameters initialised from `seed`."""
  platform = next(iter(jax.tree.leaves(shardings)[0].device_set)).platform
  options = INIT_COMPILER_OPTIONS.get(platform)
  if params is not None:
    return jax.jit(lambda p: init_state(p, tx), out_shardings=shardings, compiler_options=options)(params)
  return jax.jit(lambda: init_state(init_params(model_cfg, seed)[1], tx), out_shardings=shardings,
                 compiler_options=options)()


def check_accumulation(config, mesh) -> None:
  """The global batch splits evenly over the batch shards and micro-batches, and each device's micro-batch into
  loss chunks; raises naming the config keys."""
  check_negatives(config.loss.negatives)
  rows = sharding.check_batch_size(config.batch_size, mesh, accum_steps=config.grad_accum_steps)
  check_chunk_size(config.loss.chunk_size, rows)


def make_forward(graphdef, objective: Objective, frozen=None, mesh=None):
  """(params, inputs, rng=None) -> the model's outputs dict, with what `objective` needs; inputs: the batch
  entries `objective.input_keys` (image [b,H,W,3], tokens [b,L], a framework's inputs), sharded over the batch;
  rng: the adapters' dropout key (None: no dropout). frozen: path -> bool; those parameters pass through
  stop_gradient inside the function that is differentiated, so JAX emits no weight gradient for them (their
  gradient is a zero constant) — LoRA's and a frozen tower's compute saving. mesh: traced under it, so the model's
  activations keep the batch layout (`sharding.constrain_batch`)."""
  def forward(params, inputs, rng=None):
    if frozen is not None:
      params = jax.tree_util.tree_map_with_path(
          lambda p, x: jax.lax.stop_gradient(x) if frozen(param_path(p)) else x, params)
    if mesh is None:
      return objective.forward(bind(graphdef, params), inputs, rng)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return objective.forward(bind(graphdef, params), inputs, rng)

  return forward


def _fold(rng, i):
  return None if rng is None else jax.random.fold_in(rng, i)


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def partition_outputs(outputs):
  """outputs -> (differentiable float leaves, the rest: masks)."""
  return ({k: v for k, v in outputs.items() if _is_float(v)}, {k: v for k, v in outputs.items() if not _is_float(v)})


def _micro_batching(mesh, accum_steps: int):
  """(split, merge) of [B, ...] arrays into [A, B/A, ...] micro-batches and back. Micro-batch k holds rows
  k, k+A, ... so it spans every device."""
  micro_sharding = NamedSharding(mesh, P(None, sharding.BATCH_AXES))

  def split(x):
    x = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x, micro_sharding)

  def merge(x):
    x = x.swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x.reshape(-1, *x.shape[2:]), sharding.batch_sharding(mesh))

  return split, merge


def make_outputs_fn(graphdef, mesh, objective: Objective, accum_steps: int = 1, frozen=None):
  """(params, batch) -> outputs of the whole batch, computed a micro-batch at a time (no activations kept)."""
  forward = make_forward(graphdef, objective, frozen, mesh)
  inputs = lambda batch: {k: batch[k] for k in objective.input_keys}  # noqa: E731
  if accum_steps == 1:
    return lambda params, batch, rng=None: forward(params, inputs(batch), _fold(rng, 0))
  split, merge = _micro_batching(mesh, accum_steps)

  def outputs(params, batch, rng=None):
    _, outs = jax.lax.scan(lambda c, mb: (c, forward(params, mb[1], _fold(rng, mb[0]))), None,
                           (jnp.arange(accum_steps), jax.tree.map(split, inputs(batch))))
    return {k: v[0] if k in GLOBAL_OUTPUTS else merge(v) for k, v in outs.items()}

  return outputs


def make_loss_of_outputs(mesh, objective: Objective, accum_steps: int = 1, negatives: str = "global_batch"):
  """(float outputs, mask outputs) of the whole batch -> (loss, aux) as `objective` returns them, with the
  negatives of `negatives`: the whole batch, or each of the `accum_steps` micro-batches on its own (averaged)."""
  check_negatives(negatives)
  if accum_steps == 1 or negatives == "global_batch":
    return lambda floats, masks, step=None: objective({**floats, **masks}, mesh, step)
  split, merge = _micro_batching(mesh, accum_steps)

  def loss(floats, masks, step=None):
    outs = {k: v if k in GLOBAL_OUTPUTS else split(v) for k, v in {**floats, **masks}.items()}
    glob = {k: outs.pop(k) for k in GLOBAL_OUTPUTS if k in outs}
    values, aux = jax.lax.map(lambda o: objective({**o, **glob}, mesh, step), outs)
    return jnp.mean(values), {"terms": jax.tree.map(jnp.mean, aux["terms"]), "per_example": merge(aux["per_example"])}

  return loss


def make_grad_fn(graphdef, mesh, objective: Objective, accum_steps: int = 1, negatives: str = "micro_batch",
                 frozen=None):
  """(params, batch, rng=None, step=None) -> ((loss, terms), grads). batch: image f32 [B,H,W,3], tokens int32
  [B,L], sharded over the batch axes; terms: the objective's per-term losses; step: the train step (for terms with
  a schedule, e.g. a ramp; None: their full weight).

  accum_steps > 1 splits the batch into micro-batches inside the step:
  - negatives="micro_batch": each micro-batch is its own contrastive batch (its own Ḡ); losses/grads averaged.
  - negatives="global_batch": the outputs of all micro-batches are computed first (no activations kept), the
    objective over the whole batch gives the gradient w.r.t. every output (embeddings, token features, scale),
    then each micro-batch is recomputed and back-propagated with its slice of it (GradCache). The gradient equals
    the un-accumulated one; activation memory is one micro-batch.
  frozen: path -> bool: those parameters get a zero gradient and no weight-gradient computation (`make_forward`).
  """
  forward = make_forward(graphdef, objective, frozen, mesh)
  inputs = lambda batch: {k: batch[k] for k in objective.input_keys}  # noqa: E731

  def loss_fn(params, mb_inputs, rng=None, step=None):
    loss, aux = objective(forward(params, mb_inputs, rng), mesh, step)
    return loss, aux["terms"]

  if accum_steps == 1:
    return lambda params, batch, rng=None, step=None: jax.value_and_grad(loss_fn, has_aux=True)(
        params, inputs(batch), _fold(rng, 0), step)
  check_negatives(negatives)
  split, _ = _micro_batching(mesh, accum_steps)

  def micro_batch_negatives(params, batch, rng=None, step=None):
    def body(acc, mb):
      k, mb_inputs = mb
      return jax.tree.map(jnp.add, acc, jax.value_and_grad(loss_fn, has_aux=True)(params, mb_inputs,
                                                                                  _fold(rng, k), step)), None

    zeros = ((jnp.zeros((), jnp.float32), {k: jnp.zeros((), jnp.float32) for k in objective.term_names}),
             jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(body, zeros, (jnp.arange(accum_steps), jax.tree.map(split, inputs(batch))))
    return jax.tree.map(lambda x: x / accum_steps, total)

  outputs_fn = make_outputs_fn(graphdef, mesh, objective, accum_steps, frozen)
  loss_of_outputs = make_loss_of_outputs(mesh, objective)

  def global_batch_negatives(params, batch, rng=None, step=None):
    floats, masks = partition_outputs(outputs_fn(params, batch, rng))
    (loss, aux), g_out = jax.value_and_grad(loss_of_outputs, has_aux=True)(floats, masks, step)
    # Each micro-batch's cotangent: its rows of the per-example outputs' gradients; the scale's whole gradient
    # goes to micro-batch 0 (the scale is one parameter, computed again in every micro-batch).
    def body(acc, xs):
      k, mb_inputs, g = xs
      g = {**g, **{key: jnp.where(k == 0, g_out[key], 0.0) for key in GLOBAL_OUTPUTS if key in g_out}}
      _, vjp = jax.vjp(lambda p: partition_outputs(forward(p, mb_inputs, _fold(rng, k)))[0], params)
      return jax.tree.map(jnp.add, acc, vjp(g)[0]), None

    xs = (jnp.arange(accum_steps), jax.tree.map(split, inputs(batch)),
          {k: split(v) for k, v in g_out.items() if k not in GLOBAL_OUTPUTS})
    grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), xs)
    return (loss, aux["terms"]), grads

  return micro_batch_negatives if negatives == "micro_batch" else global_batch_negatives


def make_train_step(graphdef, tx, mesh, config, schedule, state_shardings, frozen=None, objective=None):
  """Returns jitted step(state, batch) -> (state, metrics); the state is donated. `objective`: the run's
  (experiment.Run.objective; built from `config` when not given).

  frozen: path -> bool (`frozen_predicate`); those parameters enter the loss through stop_gradient inside the
  differentiated function, so no weight gradient is computed for them (LoRA's saving) and grad_norm is that of the
  trained parameters."""
  objective = Objective.from_config(config.loss, config) if objective is None else objective
  grad_fn = make_grad_fn(graphdef, mesh, objective, config.grad_accum_steps, config.loss.negatives, frozen)
  clamp = config.optimizer.train_logit_scale and not (frozen is not None and frozen(SCALE_PARAM))
  upper = logit_scale_max(config)
  # Adapter dropout: a key per step (and per micro-batch inside it), a pure function of config.seed and the step, so
  # a resumed run draws the same masks.
  dropout = config.finetune.method != "full" and float(config.finetune.dropout) > 0
  base_key = jax.random.key(int(config.seed) + 7919) if dropout else None

  def step(state, batch):
    params = state["params"]
    rng = jax.random.fold_in(base_key, state["step"]) if dropout else None
    (loss, terms), grads = grad_fn(params, batch, rng, state["step"])
    grad_norm = optax.tree.norm(grads)
    # A non-finite loss or gradient leaves parameters and optimizer state as they were; the host decides
    # (config.on_nonfinite) whether that ends the run or is only counted. A cond rather than a select of old vs
    # new: the update then happens in place in the donated buffers, with no second copy of parameters and
    # optimizer state alive at once (the copies and selects were ~15 ms of the tiny model's CPU step).
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(params, opt_state):
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return (clamp_logit_scale(params, upper) if clamp else params), opt_state

    params, opt_state = jax.lax.cond(finite, update, lambda p, o: (p, o), state["params"], state["opt_state"])
    bad = state["nonfinite_steps"] + jnp.where(finite, 0, 1)
    first = jnp.where((state["first_nonfinite_step"] < 0) & ~finite, state["step"] + 1, state["first_nonfinite_step"])
    metrics = {"loss": loss, "lr": schedule(state["step"]), "logit_scale": jnp.exp(state["params"][SCALE_PARAM]),
               "grad_norm": grad_norm, "nonfinite_steps": bad}
    if "logit_bias" in state["params"]:
      metrics["logit_bias"] = state["params"]["logit_bias"]
    if len(terms) > 1:
      metrics.update({f"loss/{k}": v for k, v in terms.items()})
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "nonfinite_steps": bad,
            "first_nonfinite_step": first}, metrics

  batch_sh = sharding.batch_sharding(mesh)
  return jax.jit(step, in_shardings=(state_shardings, batch_sh),
                 out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0,
                 compiler_options=sharding.compiler_options(mesh))


@dataclasses.dataclass
class Program:
  """Everything that defines the train step train.py runs (also compiled ahead of time by tools/compile_for)."""
  graphdef: object
  tx: optax.GradientTransformation
  schedule: object
  abstract_state: dict  # ShapeDtypeStructs of the train state
  shardings: dict  # NamedShardings of the train state
  step: object  # jitted step(state, batch) -> (state, metrics), state donated
  objective: Objective
  frozen: object = None  # parameter path -> True for parameters that never change (stored once by checkpoints)

  def target(self):
    """The state as ShapeDtypeStructs carrying their shardings (restore / ahead-of-time compile target)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract_state,
                        self.shardings)


def build_program(run) -> Program:
  """The train step of a resolved run (experiment.Run: its config, model, mesh, rules and objective): optimizer,
  state shardings, jitted step. train.py runs it; tools/compile_for compiles it."""
  config, model_cfg, mesh = run.config, run.model, run.mesh
  graphdef, abstract_params = abstract_model(model_cfg)
  freeze = freeze_patterns(config, model_cfg)
  tx = make_optimizer(config.optimizer, config.total_steps, freeze)
  schedule = lr_schedule(config.optimizer, config.total_steps)
  abstract_state = jax.eval_shape(lambda p: init_state(p, tx), abstract_params)
  shardings = sharding.state_shardings(abstract_state, "params", mesh, run.rules)
  frozen = frozen_predicate(config.optimizer, freeze) if freeze else None
  step = make_train_step(graphdef, tx, mesh, config, schedule, shardings, frozen=frozen, objective=run.objective)
  return Program(graphdef, tx, schedule, abstract_state, shardings, step, run.objective, frozen)


def abstract_batch(run) -> dict:
  """The global batch a run's step takes, as ShapeDtypeStructs sharded over the batch axes."""
  sh = sharding.batch_sharding(run.mesh)
  b, s, l = run.config.batch_size, run.model.image_size, run.model.text_context
  batch = {"image": jax.ShapeDtypeStruct((b, s, s, 3), jnp.float32, sharding=sh),
           "tokens": jax.ShapeDtypeStruct((b, l), jnp.int32, sharding=sh)}
  for name, (shape, dtype) in run.input_specs().items():  # a framework's own inputs
    batch[name] = jax.ShapeDtypeStruct((b, *shape), jnp.dtype(dtype), sharding=sh)
  return batch
