"""Train HN-CLIP: python train.py --config configs/demo.py --workdir DIR [--config.loss.gamma=0 ...]."""
from __future__ import annotations

if __name__ == "__main__":  # first, before anything imports JAX: re-exec under tcmalloc if HNCLIP_TCMALLOC asks
  from hnclip_jax import hostmem
  hostmem.use_tcmalloc()

import dataclasses
import json
import time

from absl import app, flags
from ml_collections import config_flags

from hnclip_jax.cli import clean_errors, define_distributed_flags, parse_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (get_config()).", lock_config=True)
flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and the tokenizer go. Rerun to resume.")
define_distributed_flags()
flags.mark_flags_as_required(["config", "workdir"])


@clean_errors
def main(argv):
  del argv
  from hnclip_jax import goodput
  # Where the wall time goes (goodput.py): from the OS's start of this process when run as a script, else from now.
  account = goodput.Account(goodput.process_start_time() if __name__ == "__main__" else None)
  try:
    train(account.listen())
  finally:
    account.close()


def train(account):
  import jax
  import numpy as np

  import hnclip_jax
  from hnclip_jax import (checkpoint, config as config_lib, diagnostics, experiment, faults, goodput, hlo, hostmem,
                          optim, paths, preemption, sharding, storage, train_step)
  from hnclip_jax.data import builders, clustering, pipeline
  from hnclip_jax.evaluation import embedding
  from hnclip_jax.evaluation.retrieval import NonFiniteEmbeddings
  from hnclip_jax.metrics import MetricsWriter, Progress, StepProfiler, Throughput, log, quiet_libraries
  from hnclip_jax.workdir import check_model_compatible, config_changes, resolve_path as resolve_workdir

  # ---- The resolved run: config, workdir (held), data, model, tokenizer, framework, objective, mesh -------------
  # (all checks before building data or compiling anything)
  quiet_libraries()
  run = experiment.resolve(FLAGS.config, resolve_workdir(FLAGS.workdir), "train",
                           overrides=config_flags.get_override_values(FLAGS["config"]))
  config, wd, mesh, model_cfg, tokenizer = run.config, run.wd, run.mesh, run.model, run.tokenizer
  lock = run.lock
  log(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} devices, "
      f"{jax.process_count()} process(es){sharding.describe_dcn(mesh, config.mesh)}")
  if jax.devices()[0].platform == "cpu":
    log(hostmem.cpu_allocator_note())
  log(f"{run.data_note}; training on split '{config.data.train_split}', evaluating on '{config.data.eval_split}'")
  train_source, eval_source = run.sources["train"], run.sources["eval"]
  log(experiment.truncation_report(config, tokenizer))
  program = train_step.build_program(run)  # what tools/compile_for compiles, too
  graphdef, tx, shardings, objective = program.graphdef, program.tx, program.shardings, program.objective
  check_data = run.hook("check_data")  # what the framework needs of the data, before compiling
  if check_data is not None and (note := check_data(config, objective)):
    log(note)
  make_inputs = run.hook("inputs")  # the framework's own per-example inputs
  init_from_params = run.init_params

  # ---- State: newest intact checkpoint, else initial (created on its shardings) ----
  ckpt = wd.checkpointer(max_to_keep=config.max_to_keep, async_save=config.async_checkpointing,
                         overlap_steps=config.checkpoint_overlap_steps, frozen=program.frozen)
  try:
    with account.part("restore"):
      latest, state, saved_meta = ckpt.restore_latest_intact(
          program.target(),
          check_meta=lambda meta, where: check_model_compatible(meta.get("model"), model_cfg, where))
  except checkpoint.IncompatibleCheckpoint as e:
    raise experiment.resume_error(e, config, wd) from None
  if state is not None:
    changed = config_changes(saved_meta.get("config"), config)
    log(f"resumed from {ckpt.directory}/{latest} (step {latest})" +
        (f"; settings changed since that checkpoint: {', '.join(changed)}" if changed else ""))
  elif init_from_params is not None:  # fine-tuning start: given weights, fresh optimizer, step 0
    state = train_step.initial_state(tx, shardings, params=init_from_params)
    log(f"initialised from {config.init_from}")
  else:
    state = train_step.initial_state(tx, shardings, model_cfg=model_cfg, seed=config.seed)
  if latest is None and program.frozen is not None:
    ckpt.save_frozen(state["params"])  # once: checkpoints then hold only what trains, and reference these
    log(f"frozen parameters stored once in {ckpt.frozen_dir}")
  start = int(state["step"])
  record = goodput.Recorder(account, wd, start, jax.process_index())
  redone = goodput.redone_note(wd.goodput_records(), start, jax.process_index())
  if redone:
    log(redone)
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  n_trained = sum(x.size for x in jax.tree.leaves(optim.trained_params(state["opt_state"])))
  log(f"model: {n_params / 1e6:.2f}M parameters ({n_trained / 1e6:.3f}M trained, finetune.method="
      f"{config.finetune.method}), {model_cfg}")

  step_fn = program.step
  embed_fn = embedding.make_embed_fn(graphdef, mesh, shardings["params"])
  accum = (config.grad_accum_steps, config.loss.negatives)
  diag_fn = diagnostics.make_batch_diagnostics(graphdef, mesh, objective, *accum) if config.diagnostics.log else None
  compare_fn = (diagnostics.make_gradient_comparison(graphdef, mesh, objective, shardings["params"], *accum)
                if config.diagnostics.every else None)
  meta = {"model": dataclasses.asdict(model_cfg), "tokenizer": tokenizer.kind, "mesh": dict(mesh.shape),
          "config": json.loads(config.to_json()), "code_version": hnclip_jax.code_version()}
  writer = MetricsWriter(wd.metrics, wd.tensorboard)
  writer.truncate_after(start)
  plan = None
  if config.data.batching == "clustered":  # batches of caption neighbours under the start model (data/clustering.py)
    index = clustering.read_index(wd.caption_index, wd.caption_index_meta, len(train_source))
    if index is None and start > 0:
      raise ValueError(f"{wd.caption_index} is missing: this run's clustered batches come from its "
                       "start model's caption embeddings, stored at its first start, and cannot be made again from a "
                       "later checkpoint. Restore the file, or start a new workdir")
    if index is None:
      index = embedding.embed_captions(state["params"], embed_fn, pipeline.caption_lists(builders.data_source(
          config.data, config.data.train_split, decode_images=False)), tokenizer, mesh, config.eval_batch_size)
      if jax.process_index() == 0:
        clustering.write_index(wd.caption_index, wd.caption_index_meta, index,
                               config.init_from or f"initial parameters (seed {config.seed})")
    plan = clustering.ClusteredBatches(index, config.batch_size, config.seed)
    crowd = clustering.mean_in_batch_similarity(index, plan.plan(0))
    spread = clustering.mean_in_batch_similarity(index, clustering.random_plan(len(index), config.batch_size,
                                                                                config.seed, 0))
    log(f"clustered batches: mean in-batch caption similarity (the start model's, epoch 0) {crowd:.3f}, against "
        f"{spread:.3f} for random batches")
  batches = iter(pipeline.train_dataset(
      train_source, tokenizer, image_size=model_cfg.image_size, global_batch=config.batch_size, seed=config.seed,
      start_step=start, rows=sharding.process_rows(mesh, config.batch_size),
      workers=config.workers, extra_inputs=None if make_inputs is None else make_inputs(config, model_cfg, tokenizer),
      family=model_cfg.family, plan=plan))

  eval_captions = None  # read once, at the first eval, without decoding images

  def run_eval(step):
    with account.part("eval"):
      evaluate(step)
    record.write(step)

  def evaluate(step):
    nonlocal eval_captions
    if eval_captions is None:
      eval_captions = pipeline.caption_lists(
          builders.data_source(config.data, config.data.eval_split, decode_images=False))
    try:
      res = embedding.evaluate(state["params"], embed_fn, eval_source, tokenizer, model_cfg, mesh,
                                config.eval_batch_size, eval_captions)
    except NonFiniteEmbeddings as e:
      raise ValueError(f"eval at step {step}: {e}") from None
    scalars = {f"eval/{d}/{k}": v for d in ("t2i", "i2t") for k, v in res[d].items()}
    writer.write(step, scalars)
    log(f"eval @ {step} on {config.data.name}/{config.data.eval_split} ({embedding.describe_counts(res)}): " +
        " ".join(f"{k}={v:.2f}" for k, v in scalars.items()))

  def check_finite(nonfinite_steps=None):
    """With on_nonfinite="error": stop (before any checkpoint could hold a later step) naming the bad step."""
    if nonfinite_steps is None:
      nonfinite_steps = int(state["nonfinite_steps"])
    if config.on_nonfinite == "error" and nonfinite_steps > 0:
      ckpt.wait()  # a save still in flight is the last good one once it is complete
      good = ckpt.finished_steps()
      raise ValueError(f"non-finite loss or gradient at step {int(state['first_nonfinite_step'])} (the update was "
                       f"not applied). Last good checkpoint: "
                       f"{f'{ckpt.directory}/{good[-1]}' if good else 'none yet'}. Lower optimizer.lr, check the "
                       "data, or set config.on_nonfinite=skip to skip such updates.")

  # ---- Training loop ---------------------------------------------------------
  stop = preemption.StopRequest()
  progress = Progress(start, config.total_steps)
  profiler = StepProfiler(config_lib.profile_steps(config), config.profile.processes, wd, start)
  throughput = Throughput(start, jax.devices()[0].device_kind)
  log(f"training steps {start} -> {config.total_steps}, global batch {config.batch_size} "
      f"({config.grad_accum_steps} micro-batches, negatives over the {config.loss.negatives.replace('_', ' ')}), "
      f"gamma={config.loss.gamma}" + (f", token term weight {config.loss.token_weight}"
                                       if objective.needs_tokens else ""))
  step = start
  stopped = False
  record.loop_started()
  try:
    try:
      for step in range(start + 1, config.total_steps + 1):
        t_wait = time.perf_counter()
        with account.part("input_wait"):
          batch = dict(next(batches))
        batch.pop("index")  # host side only (the pipeline and a framework's `inputs`): not an input of the step
        throughput.waited(time.perf_counter() - t_wait)
        if faults.poisoned(step):
          batch = dict(batch, image=batch["image"] * np.nan)
        batch = sharding.to_global(batch, mesh)
        logging_step = step % config.log_every == 0 or step == config.total_steps
        extra = {}  # telemetry on the parameters this step starts from, only on the steps that log it
        if diag_fn is not None and logging_step:
          extra.update(diag_fn(state["params"], batch))
        if compare_fn is not None and step % config.diagnostics.every == 0:
          extra.update(compare_fn(state["params"], batch))
        with profiler.step(step):
          state, metrics = step_fn(state, batch)
        profiler.after(step, state)
        if throughput.flops is None:  # the program just run, from jit's cache: its matmul FLOPs per device
          throughput.flops = hlo.matmul_flops(step_fn.lower(state, batch).compile().as_text())
        faults.maybe_kill("kill", step)
        faults.maybe_kill("kill_after_saves", step, before=ckpt.wait)
        stopping = stop.requested(step)
        ckpt.check(step)  # a failed background save stops the run now (<= checkpoint_overlap_steps later), naming it
        if logging_step or stopping or extra:
          lock.check()  # a bucket lease lost to another run (its renewals stalled): stop before writing
          scalars = {k: float(v) for k, v in jax.device_get({**metrics, **extra}).items()}
          scalars.update(throughput.scalars(step))
          scalars.update(record.scalars())
          writer.write(step, scalars)
          log(progress.line(step, {k.removeprefix("diag/"): v for k, v in scalars.items()
                                   if not k.startswith(("diag/", "goodput/")) or k.endswith("saturated_frac")}))
          check_finite(int(scalars["nonfinite_steps"]))  # on the host already: stop at once, not at the save
        saving = step % config.checkpoint_every == 0 or step == config.total_steps or stopping
        if saving:
          lock.check()
          check_finite()
          with account.part("checkpoint"):
            ckpt.save(step, state, meta, force=True)
          record.checkpoint(step)
        if saving or logging_step:
          record.write(step)
        if stopping:
          with account.part("checkpoint"):
            ckpt.wait()
          log(f"{stop.signal_name}: stopped after step {step}; checkpoint {ckpt.directory}/{step} written. "
              "Rerun the same command to resume.")
          if jax.process_index() > 0:  # each host's own log says where it stopped (process 0's says it above)
            print(f"process {jax.process_index()}: stopped after step {step}", flush=True)
          stopped = True
          break
        if step % config.eval_every == 0 or step == config.total_steps:
          run_eval(step)
      check_finite()
      with account.part("checkpoint"):
        ckpt.wait()
      record.loop_ended()
    except storage.StorageError as e:  # a log or event file: say what survived and what to do
      if isinstance(e, checkpoint.CheckpointError):
        raise
      fix = paths.recovery(wd.path)
      raise storage.StorageError(f"{e}; {ckpt.intact_note()}. {fix} rerun the same command to resume") from e
  except BaseException as e:
    profiler.stop()  # a run that fails inside the traced steps still leaves its trace
    ckpt.close(quiet=True)  # never let a library error while closing hide the one that ended the run
    writer.close(quiet=True)
    record.write_quietly(step, f"error: {type(e).__name__}")
    raise
  finally:
    lock.release()
  ckpt.close()
  writer.close()
  record.write(step, "stopped" if stopped else "done")
  log(account.line())
  log(goodput.run_line(goodput.summarize(wd.goodput_records(), jax.process_index())))
  if stopped:
    return
  log(f"done: {config.total_steps} steps; checkpoints in {ckpt.directory}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
