"""Train HN-CLIP: python train.py --config configs/demo.py --workdir DIR [--config.loss.gamma=0 ...]."""
from __future__ import annotations

if __name__ == "__main__":  # first, before anything imports JAX: re-exec under tcmalloc if HNCLIP_TCMALLOC asks
  from hnclip_jax import hostmem
  hostmem.use_tcmalloc()

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
  """The steps of a run: resolve it (config, workdir held, data, model, tokenizer, framework, mesh: every check
  before anything is built or compiled), build its program, restore or start its state, run the loop, finish."""
  from hnclip_jax import experiment, train_step
  from hnclip_jax.loop import TrainLoop
  from hnclip_jax.metrics import quiet_libraries
  from hnclip_jax.workdir import resolve_path as resolve_workdir

  quiet_libraries()
  run = experiment.resolve(FLAGS.config, resolve_workdir(FLAGS.workdir), "train",
                           overrides=config_flags.get_override_values(FLAGS["config"]))
  experiment.log_run(run)
  program = train_step.build_program(run)  # what tools/compile_for compiles, too
  experiment.check_framework_data(run, program)
  ckpt, state = experiment.restore_or_start(run, program, account)
  loop = TrainLoop(run, program, ckpt, state, account)
  stopped = loop.run()
  loop.finish(stopped)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
