"""Evaluate checkpoints: python eval.py --config CONFIG --workdir DIR [--step N] [--split S] [--report OUT]
                                        [--benchmarks=all|NAME,...] [--watch]

Reads the data the workdir was trained on (DIR/data.json) unless --config.data.* overrides say otherwise, prints
Recall@1/5/10 (text->image, image->text), writes DIR/eval_results.json (this result) and appends it to
DIR/eval_history.jsonl (every result, never rewritten). --report OUT also writes OUT/index.html: the recall table
and, for sampled queries and the failures, the caption, its ground-truth image, the top-k images with their scores
and the near-twin captions (hnclip_jax/evaluation/report.py).

--benchmarks evaluates on the benchmarks config.eval.benchmarks lists, in one process, and writes the paper's Table 1
(DIR/eval_table.md and .json; eval_results.json is that table). --watch follows a training run on the same workdir:
every new checkpoint is evaluated once, TensorBoard scalars go to DIR/tensorboard/eval, the best step's parameters to
DIR/best (hnclip_jax/evaluation/job.py; docs/evaluation.md).
"""
from __future__ import annotations

if __name__ == "__main__":  # first, before anything imports JAX: re-exec under tcmalloc if HNCLIP_TCMALLOC asks
  from hnclip_jax import hostmem
  hostmem.use_tcmalloc()


import os

from absl import app, flags
from ml_collections import config_flags

from hnclip_jax.cli import clean_errors, define_distributed_flags, parse_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file the run was trained with.", lock_config=True)
flags.DEFINE_string("workdir", None, "The training workdir (checkpoints/ and tokenizer/).")
flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the latest).")
flags.DEFINE_string("split", None, "Split to evaluate (default: config.data.eval_split).")
flags.DEFINE_string("score", "cosine",
                    "How captions and images are ranked: 'cosine' of the global embeddings (HN-CLIP, every framework), "
                    "or a score the workdir's framework defines for the model parts it adds (docs/frameworks.md; "
                    "docs/evaluation.md lists the built-in ones).")
flags.DEFINE_string("benchmarks", None,
                    "Evaluate on benchmarks listed in config.eval.benchmarks: 'all' or NAME,NAME,... One process, "
                    "encoders compiled once; writes Table 1 (WORKDIR/eval_table.md and .json). Default: the run's "
                    "own data (config.data, the split from --split).")
flags.DEFINE_bool("watch", False,
                  "Follow a training run: evaluate each new complete checkpoint once, in step order, write "
                  "TensorBoard scalars to WORKDIR/tensorboard/eval and keep the best step in WORKDIR/best; ends when "
                  "the final step is evaluated or after --watch_timeout_s without a new checkpoint.")
flags.DEFINE_float("watch_poll_s", 10.0, "--watch: seconds between looks at the checkpoint directory.")
flags.DEFINE_float("watch_timeout_s", 3600.0, "--watch: stop after this many seconds without a new checkpoint.")
flags.DEFINE_bool("watch_newest_only", False,
                  "--watch: when several checkpoints wait, evaluate only the newest (the others are skipped and "
                  "logged).")
flags.DEFINE_string("report", None, "Also write a browsable HTML report (index.html + images/) into this directory.")
flags.DEFINE_integer("report_samples", 20, "Text->image queries sampled (seeded by config.seed) for the report.")
flags.DEFINE_integer("report_failures", 50, "At most this many failed queries (worst first) in the report.")
flags.DEFINE_float("report_twin_threshold", 0.9, "Caption cosine similarity (text encoder) marking a near-twin.")
define_distributed_flags()
flags.mark_flags_as_required(["config", "workdir"])


@clean_errors
def main(argv):
  del argv
  import jax
  from hnclip_jax import config as config_lib, experiment, paths, storage
  from hnclip_jax.data import builders
  from hnclip_jax.evaluation import benchmarks as bench_lib, embedding, job
  from hnclip_jax.metrics import log, quiet_libraries
  from hnclip_jax.workdir import Workdir, resolve_path as resolve_workdir

  quiet_libraries()
  config_lib.validate(FLAGS.config)  # a bad setting first, before the workdir is looked at
  workdir = resolve_workdir(FLAGS.workdir)
  if paths.isfile(workdir):
    raise ValueError(f"--workdir={workdir} is a file; pass the directory train.py wrote to")
  if FLAGS.watch and FLAGS.step is None:  # an eval job may start before the training job has set up its workdir
    job.wait_for_run(workdir, FLAGS.watch_poll_s, FLAGS.watch_timeout_s)
  if not paths.isdir(workdir):
    raise FileNotFoundError(f"--workdir={workdir} does not exist; pass the directory train.py wrote to")
  if FLAGS.watch and FLAGS.step is not None:
    raise ValueError(f"--step={FLAGS.step} and --watch: --watch evaluates every new checkpoint as training writes "
                     "it; pass one of them")
  if FLAGS.watch and FLAGS.report:
    raise ValueError("--report with --watch: the report is for one checkpoint; run eval.py --step=N --report=DIR "
                     "on the step you want to look at")
  if FLAGS.benchmarks and FLAGS.split:
    raise ValueError(f"--split={FLAGS.split} with --benchmarks: each benchmark's split is "
                     "config.eval.benchmarks.NAME.split (default 'test'); set it there")
  # eval.py records its result in the workdir: find out now, not after the embedding pass
  storage.check_writable(workdir, "the workdir, where eval.py records its result (eval_results.json),")
  steps = Workdir(workdir).checkpoint_steps()
  if not steps and not FLAGS.watch:
    raise FileNotFoundError(f"no checkpoints in {Workdir(workdir).checkpoints}; train first with train.py "
                            f"--workdir {workdir}")
  step = None
  if not FLAGS.watch:
    step = steps[-1] if FLAGS.step is None else FLAGS.step
    if step not in steps:
      raise ValueError(f"--step={step} has no checkpoint in {Workdir(workdir).checkpoints}; available steps: {steps}")
  # the resolved run: the data (the workdir's, or the command line's), model, tokenizer, framework, mesh
  run = experiment.resolve(FLAGS.config, workdir, "eval", overrides=config_flags.get_override_values(FLAGS["config"]))
  config, wd = run.config, run.wd
  if FLAGS.benchmarks:
    benchmarks = bench_lib.resolve(config, FLAGS.benchmarks, order=list(FLAGS.config.eval.benchmarks))
  else:
    benchmarks = [bench_lib.own_data(config, FLAGS.split or config.data.eval_split)]
  for b in benchmarks:
    builders.check_data_config(b.data)
  if FLAGS.watch and jax.process_count() > 1:
    raise ValueError(f"--watch runs as one process ({jax.process_count()} joined): give it its own devices or a CPU "
                     "host (docs/evaluation.md)")
  ev = job.Evaluator(run, benchmarks, FLAGS.score)
  if FLAGS.benchmarks:
    log("benchmarks: " + "; ".join(f"{b.name}: {experiment.describe_data(b.data)}, split '{b.split}'"
                                   for b in benchmarks))
  else:
    log(f"{run.data_note}; split '{benchmarks[0].split}'")
  if ev.scorer is not None:
    log(f"score: {ev.scorer.describe(config)}")
  if FLAGS.watch:
    if FLAGS.benchmarks:  # the metric must exist before the first (long) evaluation
      bench_lib.metric(bench_lib.table([_placeholder(b) for b in benchmarks]), config.eval.best_metric)
    log(f"watching {wd.checkpoints} (every {FLAGS.watch_poll_s:g} s; ends after the final step, or "
        f"{FLAGS.watch_timeout_s:g} s without a new checkpoint); best by {config.eval.best_metric} -> "
        f"{wd.best}")
    summary = job.watch(ev, poll_s=FLAGS.watch_poll_s, timeout_s=FLAGS.watch_timeout_s,
                        newest_only=FLAGS.watch_newest_only, metric=config.eval.best_metric)
    best = summary["best"]
    log(f"evaluated steps {summary['evaluated']}" + (f", skipped {summary['skipped']}" if summary["skipped"] else "")
        + (f", missed {summary['missed']} (deleted before this job saw them)" if summary["missed"] else "")
        + (f"; best: step {best['step']} ({config.eval.best_metric} {best['value']:.2f}) in {wd.best}"
           if best else "") + f"; history: {wd.eval_history}, TensorBoard: {wd.eval_tensorboard}")
    ev.close()
    return
  _meta, params = ev.read(step)
  rows, embedded = [], []
  for b in benchmarks:
    row, emb = ev.evaluate(params, step, b)
    rows.append(row)
    embedded.append(emb)
  job.log_rows(rows, named=bool(FLAGS.benchmarks))
  if FLAGS.benchmarks:
    tab = bench_lib.table(rows)
    for i, (r, b) in enumerate(zip(rows, benchmarks)):  # eval_results.json: the table (a failed write: one line)
      wd.record_eval(r, {"data": dict(b.data)}, latest=tab if i == len(rows) - 1 else False)
    md = job.write_table(wd, tab)
    if jax.process_index() == 0:
      print(md, flush=True)
  else:
    wd.record_eval(rows[0], {"data": dict(benchmarks[0].data)})
  if FLAGS.report and jax.process_index() == 0:
    from hnclip_jax.evaluation.report import write_report
    for r, b, (img, txt, caption_image) in zip(rows, benchmarks, embedded):
      _, encoded, captions = ev.data(b)
      out = paths.resolve(FLAGS.report, "--report")
      target = paths.join(out, b.name) if FLAGS.benchmarks else out
      with paths.staged_dir(target) as local:  # a bucket: written locally, then uploaded
        page = write_report(
          local, img=img, txt=txt, caption_image=caption_image,
          captions=[c for caps in captions for c in caps], image_bytes=lambda row, e=encoded: e[row]["image"],
          recall={"t2i": r["t2i"], "i2t": r["i2t"]}, seed=config.seed, num_samples=FLAGS.report_samples,
          max_failures=FLAGS.report_failures, twin_threshold=FLAGS.report_twin_threshold,
          meta={"workdir": workdir, "step": int(step), "data": experiment.describe_data(b.data), "split": b.split,
                "images": r["num_images"], "captions": r["num_captions"]})
      log(f"report: {paths.join(target, os.path.basename(page))}")
  what = (f"{len(rows)} benchmarks; wrote {wd.eval_table('md')}, {wd.eval_table('json')} and {wd.eval_results}"
          if FLAGS.benchmarks else
          f"{embedding.describe_counts(rows[0])} of {experiment.describe_data(benchmarks[0].data)}, split "
          f"'{benchmarks[0].split}'; wrote {wd.eval_results}")
  log(f"step {step}, {what} (history: {wd.eval_history})")
  ev.close()


def _placeholder(b) -> dict:
  """A result row of zeros (to check config.eval.best_metric against the table's names before evaluating)."""
  zeros = {f"R@{k}": 0.0 for k in (1, 5, 10)}
  return {"step": 0, "benchmark": b.name, "dataset": b.data.name, "split": b.split, "num_images": 0,
          "num_captions": 0, "t2i": zeros, "i2t": zeros}


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
