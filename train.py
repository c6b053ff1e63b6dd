"""Train HN-CLIP: python train.py --config configs/demo.py --workdir DIR [--config.loss.gamma=0 ...]."""
from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags
from ml_collections import config_flags

from hnclip_jax.cli import clean_errors, define_distributed_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (get_config()).", lock_config=True)
flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and the tokenizer go. Rerun to resume.")
define_distributed_flags()
flags.mark_flags_as_required(["config", "workdir"])


@clean_errors
def main(argv):
  del argv
  import jax
  from hnclip_jax import checkpoint, config as config_lib, experiment, sharding, train_step
  from hnclip_jax.data import builders, pipeline
  from hnclip_jax.metrics import MetricsWriter, Progress, log, quiet_libraries
  from hnclip_jax.models import abstract_model, init_params

  # ---- Config, mesh, checks (all before compiling anything) -----------------
  quiet_libraries()
  config = config_lib.validate(FLAGS.config)
  workdir = os.path.abspath(os.path.expanduser(FLAGS.workdir))
  os.makedirs(workdir, exist_ok=True)
  experiment.enable_compilation_cache(config.compilation_cache_dir)
  experiment.maybe_initialize_distributed()
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.parse_rules(config.mesh.rules)
  sharding.check_batch_size(config.batch_size, mesh)
  sharding.check_batch_size(config.eval_batch_size, mesh, "config.eval_batch_size")
  train_step.check_accumulation(config, mesh)
  log(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} devices, "
      f"{jax.process_count()} process(es)")

  # ---- Data and tokenizer ----------------------------------------------------
  train_source = builders.data_source(config.data, config.data.train_split)
  eval_source = builders.data_source(config.data, config.data.eval_split)
  model_cfg, tokenizer, init_from_params = experiment.resolve_model(config, workdir, training=True)
  sharding.check_model_fits(model_cfg, mesh, rules)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=config.max_to_keep)
  latest = ckpt.latest_step()
  if latest is not None:
    experiment.check_compatible(ckpt.read_meta(latest), model_cfg, f"{ckpt.directory}/{latest}")

  # ---- Model, optimizer, state (created directly on its shardings) ----------
  graphdef, abstract_params = abstract_model(model_cfg)
  tx = train_step.make_optimizer(config.optimizer, config.total_steps)
  schedule = train_step.lr_schedule(config.optimizer, config.total_steps)
  abstract_state = jax.eval_shape(lambda p: train_step.init_state(p, tx), abstract_params)
  shardings = sharding.state_shardings(abstract_state, "params", mesh, rules)
  if latest is None and init_from_params is not None:  # fine-tuning start: given weights, fresh optimizer
    state = jax.jit(lambda p: train_step.init_state(p, tx), out_shardings=shardings)(init_from_params)
    start = 0
    log(f"initialised from {config.init_from}")
  elif latest is None:
    state = jax.jit(lambda: train_step.init_state(init_params(model_cfg, config.seed)[1], tx),
                    out_shardings=shardings)()
    start = 0
  else:
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    state = ckpt.restore(latest, target)
    start = int(state["step"])
    log(f"resumed from {ckpt.directory}/{latest} (step {start})")
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  log(f"model: {n_params / 1e6:.2f}M parameters, {model_cfg}")

  step_fn = train_step.make_train_step(graphdef, tx, mesh, config, schedule, shardings)
  embed_fn = train_step.make_embed_fn(graphdef, mesh, shardings["params"])
  meta = {"model": dataclasses.asdict(model_cfg), "tokenizer": tokenizer.kind, "mesh": dict(mesh.shape),
          "config": json.loads(config.to_json())}
  writer = MetricsWriter(workdir)
  writer.truncate_after(start)
  batches = iter(pipeline.train_dataset(
      train_source, tokenizer, image_size=model_cfg.image_size, global_batch=config.batch_size, seed=config.seed,
      start_step=start, process_index=jax.process_index(), process_count=jax.process_count(),
      workers=config.workers))

  def run_eval(step):
    res = experiment.evaluate(state["params"], embed_fn, eval_source, tokenizer, model_cfg, mesh,
                              config.eval_batch_size)
    scalars = {f"eval/{d}/{k}": v for d in ("t2i", "i2t") for k, v in res[d].items()}
    writer.write(step, scalars)
    log(f"eval @ {step} on {config.data.name}/{config.data.eval_split} ({res['num_pairs']} pairs): " +
        " ".join(f"{k}={v:.2f}" for k, v in scalars.items()))

  # ---- Training loop ---------------------------------------------------------
  progress = Progress(start, config.total_steps)
  log(f"training steps {start} -> {config.total_steps}, global batch {config.batch_size} "
      f"({config.grad_accum_steps} micro-batches, negatives over the {config.loss.negatives.replace('_', ' ')}), "
      f"gamma={config.loss.gamma}")
  for step in range(start + 1, config.total_steps + 1):
    state, metrics = step_fn(state, sharding.to_global(next(batches), mesh))
    if step % config.log_every == 0 or step == config.total_steps:
      scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
      writer.write(step, scalars)
      log(progress.line(step, scalars))
    if step % config.checkpoint_every == 0 or step == config.total_steps:
      ckpt.save(step, state, meta, force=True)
    if step % config.eval_every == 0 or step == config.total_steps:
      run_eval(step)
  ckpt.wait()
  ckpt.close()
  writer.close()
  log(f"done: {config.total_steps} steps; checkpoints in {ckpt.directory}")


if __name__ == "__main__":
  app.run(main)
