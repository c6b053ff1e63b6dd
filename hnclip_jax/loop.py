"""train.py's training loop: from a started state (experiment.restore_or_start) to the final step, a stop request or
an error — each step's input, telemetry, metrics, checkpoint, eval and the run's goodput record — and what is
written at its end. `TrainLoop(run, program, ckpt, state, account).run()` is the whole of it."""
from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np

import hnclip_jax
from hnclip_jax import (checkpoint, config as config_lib, diagnostics, faults, goodput, optim, paths, preemption,
                        sharding, storage)
from hnclip_jax.data import builders, clustering, pipeline
from hnclip_jax.evaluation import embedding
from hnclip_jax.evaluation.retrieval import NonFiniteEmbeddings
from hnclip_jax.metrics import MetricsWriter, Progress, StepProfiler, Throughput, log


class TrainLoop:
  """One train.py process's loop over steps start+1 .. config.total_steps of `run` (experiment.resolve) with
  `program` (train_step.build_program), from `state` as `ckpt` restored or started it."""

  def __init__(self, run, program, ckpt, state, account):
    self.resolved, self.program, self.ckpt, self.state, self.account = run, program, ckpt, state, account
    config, wd, mesh, model_cfg = run.config, run.wd, run.mesh, run.model
    self.config, self.wd, self.mesh = config, wd, mesh
    self.start = int(state["step"])
    self.record = goodput.Recorder(account, wd, self.start, jax.process_index())
    redone = goodput.redone_note(wd.goodput_records(), self.start, jax.process_index())
    if redone:
      log(redone)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    n_trained = sum(x.size for x in jax.tree.leaves(optim.trained_params(state["opt_state"])))
    log(f"model: {n_params / 1e6:.2f}M parameters ({n_trained / 1e6:.3f}M trained, finetune.method="
        f"{config.finetune.method}), {model_cfg}")
    graphdef, shardings, objective = program.graphdef, program.shardings, program.objective
    self.embed_fn = embedding.make_embed_fn(graphdef, mesh, shardings["params"])
    accum = (config.grad_accum_steps, config.loss.negatives)
    self.diag_fn = (diagnostics.make_batch_diagnostics(graphdef, mesh, objective, *accum) if config.diagnostics.log
                    else None)
    self.compare_fn = (diagnostics.make_gradient_comparison(graphdef, mesh, objective, shardings["params"], *accum)
                       if config.diagnostics.every else None)
    self.meta = {"model": dataclasses.asdict(model_cfg), "tokenizer": run.tokenizer.kind,
                 "mesh": dict(mesh.shape), "config": json.loads(config.to_json()),
                 "code_version": hnclip_jax.code_version()}
    self.writer = MetricsWriter(wd.metrics, wd.tensorboard)
    self.writer.truncate_after(self.start)
    plan = clustering.batch_plan(config, wd, len(run.sources["train"]), self.start, lambda: embedding.embed_captions(
        state["params"], self.embed_fn, pipeline.caption_lists(builders.data_source(
            config.data, config.data.train_split, decode_images=False)), run.tokenizer, mesh, config.eval_batch_size),
        log=log)
    make_inputs = run.hook("inputs")  # the framework's own per-example inputs
    self.batches = iter(pipeline.train_dataset(
        run.sources["train"], run.tokenizer, image_size=model_cfg.image_size, global_batch=config.batch_size,
        seed=config.seed, start_step=self.start, rows=sharding.process_rows(mesh, config.batch_size),
        workers=config.workers,
        extra_inputs=None if make_inputs is None else make_inputs(config, model_cfg, run.tokenizer),
        family=model_cfg.family, plan=plan))
    if builders.reads_in_place(config.data):
      self.batches = pipeline.WatchedReads(self.batches, config.data.data_dir)
    self.eval_captions = None  # read once, at the first eval, without decoding images
    self.stop = preemption.StopRequest()
    self.progress = Progress(self.start, config.total_steps)
    self.profiler = StepProfiler(config_lib.profile_steps(config), config.profile.processes, wd, self.start)
    self.throughput = Throughput(self.start, jax.devices()[0].device_kind)

  # ---- the loop ----
  def run(self) -> bool:
    """Steps to the end (or a stop request: True); on an error, closes what it opened and re-raises."""
    config, ckpt = self.config, self.ckpt
    log(f"training steps {self.start} -> {config.total_steps}, global batch {config.batch_size} "
        f"({config.grad_accum_steps} micro-batches, negatives over the {config.loss.negatives.replace('_', ' ')}), "
        f"gamma={config.loss.gamma}" + (f", token term weight {config.loss.token_weight}"
                                         if self.program.objective.needs_tokens else ""))
    self.step, stopped = self.start, False
    self.record.loop_started()
    try:
      try:
        for step in range(self.start + 1, config.total_steps + 1):
          self.step = step
          if self._step(step):
            stopped = True
            break
        self.check_finite()
        with self.account.part("checkpoint"):
          ckpt.wait()
        self.record.loop_ended()
      except storage.StorageError as e:  # a log or event file: say what survived and what to do
        if isinstance(e, checkpoint.CheckpointError):
          raise
        raise storage.StorageError(f"{e}; {ckpt.intact_note()}. {paths.recovery(self.wd.path)} rerun the same "
                                   "command to resume") from e
    except BaseException as e:
      self.profiler.stop()  # a run that fails inside the traced steps still leaves its trace
      ckpt.close(quiet=True)  # never let a library error while closing hide the one that ended the run
      self.writer.close(quiet=True)
      self.record.write_quietly(self.step, f"error: {type(e).__name__}")
      raise
    finally:
      self.resolved.lock.release()
    return stopped

  def finish(self, stopped: bool) -> None:
    """After run(): the last writes and the run's summary lines."""
    self.ckpt.close()
    self.writer.close()
    self.record.write(self.step, "stopped" if stopped else "done")
    log(self.account.line())
    log(goodput.run_line(goodput.summarize(self.wd.goodput_records(), jax.process_index())))
    if not stopped:
      log(f"done: {self.config.total_steps} steps; checkpoints in {self.ckpt.directory}")

  def _step(self, step: int) -> bool:
    """Train step `step` and what follows it; True when a stop request ends the run here."""
    config, ckpt, lock = self.config, self.ckpt, self.resolved.lock
    batch = self._batch(step)
    logging_step = step % config.log_every == 0 or step == config.total_steps
    extra = {}  # telemetry on the parameters this step starts from, only on the steps that log it
    if self.diag_fn is not None and logging_step:
      extra.update(self.diag_fn(self.state["params"], batch))
    if self.compare_fn is not None and step % config.diagnostics.every == 0:
      extra.update(self.compare_fn(self.state["params"], batch))
    with self.profiler.step(step):
      self.state, metrics = self.program.step(self.state, batch)
    self.profiler.after(step, self.state)
    self.throughput.count_flops(self.program.step, self.state, batch)
    faults.maybe_kill("kill", step)
    faults.maybe_kill("kill_after_saves", step, before=ckpt.wait)
    stopping = self.stop.requested(step)
    ckpt.check(step)  # a failed background save stops the run now (<= checkpoint_overlap_steps later), naming it
    if logging_step or stopping or extra:
      lock.check()  # a bucket lease lost to another run (its renewals stalled): stop before writing
      self._log(step, {**metrics, **extra})
    saving = step % config.checkpoint_every == 0 or step == config.total_steps or stopping
    if saving:
      lock.check()
      self.check_finite()
      with self.account.part("checkpoint"):
        ckpt.save(step, self.state, self.meta, force=True)
      self.record.checkpoint(step)
    if saving or logging_step:
      self.record.write(step)
    if stopping:
      with self.account.part("checkpoint"):
        ckpt.wait()
      log(f"{self.stop.signal_name}: stopped after step {step}; checkpoint {ckpt.directory}/{step} written. "
          "Rerun the same command to resume.")
      if jax.process_index() > 0:  # each host's own log says where it stopped (process 0's says it above)
        print(f"process {jax.process_index()}: stopped after step {step}", flush=True)
      return True
    if step % config.eval_every == 0 or step == config.total_steps:
      with self.account.part("eval"):
        self.evaluate(step)
      self.record.write(step)
    return False

  def _batch(self, step: int) -> dict:
    """The next global batch, on the mesh (the wait for it measured; faults.poisoned: NaN images)."""
    t_wait = time.perf_counter()
    with self.account.part("input_wait"):
      batch = dict(next(self.batches))
    batch.pop("index")  # host side only (the pipeline and a framework's `inputs`): not an input of the step
    self.throughput.waited(time.perf_counter() - t_wait)
    if faults.poisoned(step):
      batch = dict(batch, image=batch["image"] * np.nan)
    return sharding.to_global(batch, self.mesh)

  def _log(self, step: int, values: dict) -> None:
    scalars = {k: float(v) for k, v in jax.device_get(values).items()}
    scalars.update(self.throughput.scalars(step))
    scalars.update(self.record.scalars())
    self.writer.write(step, scalars)
    log(self.progress.line(step, {k.removeprefix("diag/"): v for k, v in scalars.items()
                                  if not k.startswith(("diag/", "goodput/")) or k.endswith("saturated_frac")}))
    self.check_finite(int(scalars["nonfinite_steps"]))  # on the host already: stop at once, not at the save

  def evaluate(self, step: int) -> None:
    """Recall@K on the eval split with the current parameters: metrics and one log line."""
    config, run = self.config, self.resolved

    def evaluate():
      if self.eval_captions is None:
        self.eval_captions = pipeline.caption_lists(
            builders.data_source(config.data, config.data.eval_split, decode_images=False))
      return embedding.evaluate(self.state["params"], self.embed_fn, run.sources["eval"], run.tokenizer, run.model,
                                self.mesh, config.eval_batch_size, self.eval_captions)
    try:
      if builders.reads_in_place(config.data):  # reads that may wait on the bucket: watched, as the train batches
        res = paths.watched(evaluate, config.data.data_dir, f"reading the eval data in {config.data.data_dir}")
      else:
        res = evaluate()
    except NonFiniteEmbeddings as e:
      raise ValueError(f"eval at step {step}: {e}") from None
    scalars = {f"eval/{d}/{k}": v for d in ("t2i", "i2t") for k, v in res[d].items()}
    self.writer.write(step, scalars)
    log(f"eval @ {step} on {config.data.name}/{config.data.eval_split} ({embedding.describe_counts(res)}): " +
        " ".join(f"{k}={v:.2f}" for k, v in scalars.items()))

  def check_finite(self, nonfinite_steps=None) -> None:
    """With on_nonfinite="error": stop (before any checkpoint could hold a later step) naming the bad step."""
    if nonfinite_steps is None:
      nonfinite_steps = int(self.state["nonfinite_steps"])
    if self.config.on_nonfinite == "error" and nonfinite_steps > 0:
      self.ckpt.wait()  # a save still in flight is the last good one once it is complete
      good = self.ckpt.finished_steps()
      raise ValueError(f"non-finite loss or gradient at step {int(self.state['first_nonfinite_step'])} (the update "
                       f"was not applied). Last good checkpoint: "
                       f"{f'{self.ckpt.directory}/{good[-1]}' if good else 'none yet'}. Lower optimizer.lr, check "
                       "the data, or set config.on_nonfinite=skip to skip such updates.")
