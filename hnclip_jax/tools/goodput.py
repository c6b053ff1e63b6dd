"""A train.py run's goodput across all its starts (restarts after preemptions included):

  python -m hnclip_jax.tools.goodput --workdir DIR [--process 0] [--json]

DIR may be a bucket URL. Prints one row per process start (its wall time split into parts, the steps it ran, the
steps the next start had to redo and what they had cost) and the whole run's line; --json prints the same as
JSON. Reads WORKDIR/goodput/ (hnclip_jax/goodput.py), written by every train.py process.
"""
from __future__ import annotations

from absl import app, flags

from hnclip_jax.cli import clean_errors

flags.DEFINE_string("workdir", None, "A train.py workdir (local or gs://).")
flags.DEFINE_integer("process", 0, "Whose account: process index of a multi-process run.")
flags.DEFINE_bool("json", False, "Print JSON instead of the table.")
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS


@clean_errors
def main(argv):
  del argv
  from hnclip_jax import goodput
  from hnclip_jax.workdir import Workdir
  wd = Workdir(FLAGS.workdir)
  rows = wd.goodput_records()
  summary = goodput.summarize(rows, FLAGS.process)
  if not summary["attempts"]:
    raise FileNotFoundError(f"no goodput records of process {FLAGS.process} in {wd.goodput}; it is written by "
                            "train.py (from this version on) at every log step")
  print(goodput.to_json(summary) if FLAGS.json else goodput.report(summary))


if __name__ == "__main__":
  app.run(main)
