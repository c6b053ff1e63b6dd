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
  """The steps of an eval: check the request, resolve the run (the workdir's model, tokenizer, data), then follow
  the training run (--watch) or evaluate one checkpoint."""
  del argv
  from hnclip_jax import config as config_lib, experiment
  from hnclip_jax.evaluation import job
  from hnclip_jax.metrics import quiet_libraries
  from hnclip_jax.workdir import resolve_path as resolve_workdir

  quiet_libraries()
  config_lib.validate(FLAGS.config)  # a bad setting first, before the workdir is looked at
  request = job.Request(workdir=resolve_workdir(FLAGS.workdir), step=FLAGS.step, watch=FLAGS.watch,
                        benchmarks=FLAGS.benchmarks, split=FLAGS.split, report=FLAGS.report, score=FLAGS.score,
                        poll_s=FLAGS.watch_poll_s, timeout_s=FLAGS.watch_timeout_s,
                        newest_only=FLAGS.watch_newest_only, report_samples=FLAGS.report_samples,
                        report_failures=FLAGS.report_failures, report_twin_threshold=FLAGS.report_twin_threshold)
  step = job.check_request(request)  # None with --watch
  run = experiment.resolve(FLAGS.config, request.workdir, "eval",
                           overrides=config_flags.get_override_values(FLAGS["config"]))
  ev = job.start(run, request, order=list(FLAGS.config.eval.benchmarks))
  if request.watch:
    job.follow(ev, request)
  else:
    job.evaluate_step(ev, step, request)
  ev.close()


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
