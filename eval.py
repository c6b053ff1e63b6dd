"""Evaluate a checkpoint: python eval.py --config configs/demo.py --workdir DIR [--step N] [--split S] [--report OUT].

Reads the data the workdir was trained on (DIR/data.json) unless --config.data.* overrides say otherwise, prints
Recall@1/5/10 (text->image, image->text), writes DIR/eval_results.json (this result) and appends it to
DIR/eval_history.jsonl (every result, never rewritten). --report OUT also writes OUT/index.html: the recall table
and, for sampled queries and the failures, the caption, its ground-truth image, the top-k images with their scores
and the near-twin captions (hnclip_jax/evaluation/report.py).
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
flags.DEFINE_enum("score", "cosine", ["cosine", "finelip"],
                  "How captions and images are ranked: 'cosine' of the global embeddings (HN-CLIP, every framework), "
                  "or 'finelip': (1 - w)·cosine + w·late interaction of FineLIP's aggregated tokens, "
                  "w = config.finelip.score_weight (a FineLIP-trained workdir only).")
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
  from hnclip_jax import checkpoint, config as config_lib, experiment, sharding, storage, train_step
  from hnclip_jax.data import builders, pipeline
  from hnclip_jax.metrics import log, quiet_libraries
  from hnclip_jax.models import abstract_model
  from hnclip_jax.workdir import Workdir, check_model_compatible

  quiet_libraries()
  config = config_lib.validate(FLAGS.config)
  workdir = os.path.abspath(os.path.expanduser(FLAGS.workdir))
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir} is a file; pass the directory train.py wrote to")
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"--workdir={workdir} does not exist; pass the directory train.py wrote to")
  # eval.py records its result in the workdir: find out now, not after the embedding pass
  storage.check_writable(workdir, "the workdir, where eval.py records its result (eval_results.json),")
  storage.start_debug_log(workdir)
  wd = Workdir(workdir)
  steps = wd.checkpoint_steps()
  if not steps:
    raise FileNotFoundError(f"no checkpoints in {wd.checkpoints}; train first with train.py --workdir {workdir}")
  step = steps[-1] if FLAGS.step is None else FLAGS.step
  if step not in steps:
    raise ValueError(f"--step={step} has no checkpoint in {wd.checkpoints}; available steps: {steps}")
  config, data_note = experiment.resolve_data(config, wd, config_flags.get_override_values(FLAGS["config"]),
                                              training=False)
  builders.check_data_config(config.data)
  split = FLAGS.split or config.data.eval_split
  experiment.enable_compilation_cache(config.compilation_cache_dir)
  experiment.maybe_initialize_distributed()
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.parse_rules(config.mesh.rules)

  ckpt = wd.checkpointer(read_only=True)
  model_cfg, tokenizer, _ = experiment.resolve_model(config, wd, training=False)
  check_model_compatible(ckpt.read_for_eval(step, ckpt.read_meta).get("model"), model_cfg,
                         f"{ckpt.directory}/{step}")
  sharding.check_model_fits(model_cfg, mesh, rules)
  log(f"{data_note}; split '{split}'")
  source = builders.data_source(config.data, split)
  graphdef, abstract_params = abstract_model(model_cfg)
  param_sh = sharding.state_shardings({"params": abstract_params}, "params", mesh, rules)["params"]
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params, param_sh)
  params = ckpt.read_for_eval(step, lambda s: ckpt.restore_params(s, target))
  encoded = builders.data_source(config.data, split, decode_images=False)  # every process (it may sync hosts)
  captions = pipeline.caption_lists(encoded)
  img, txt, caption_image = experiment.embed_split(params, train_step.make_embed_fn(graphdef, mesh, param_sh), source,
                                                   tokenizer, model_cfg, mesh, config.eval_batch_size, captions)
  res = experiment.retrieval_result(img, txt, caption_image)
  if FLAGS.score == "finelip":
    if not model_cfg.aggregate_tokens:
      raise ValueError(f"--score=finelip needs FineLIP's token aggregators, but {workdir} was trained without them "
                       "(config.framework='finelip' adds them); use --score=cosine")
    from hnclip_jax.evaluation.retrieval import finelip_scores, recall_from_scores
    agg = train_step.make_aggregated_embed_fn(graphdef, mesh, param_sh, int(config.loss.token_layer))
    img_agg, txt_agg, _ = experiment.embed_split(params, agg, source, tokenizer, model_cfg, mesh,
                                                 config.eval_batch_size, captions)
    w = float(config.finelip.score_weight)
    res.update(recall_from_scores(finelip_scores(img, txt, img_agg, txt_agg, w), caption_image))
    log(f"score: {1 - w:g}·cosine + {w:g}·late interaction of the aggregated tokens (config.finelip.score_weight)")
  out = {"step": int(step), "dataset": config.data.name, "split": split, "num_pairs": res["num_pairs"],
         "num_images": res["num_images"], "num_captions": res["num_captions"], "t2i": res["t2i"], "i2t": res["i2t"],
         "score": FLAGS.score}
  for d, name in (("t2i", "text->image"), ("i2t", "image->text")):
    log(f"{name:12s} " + "  ".join(f"{k}={v:6.2f}" for k, v in out[d].items()))
  wd.record_eval(out, {"data": dict(config.data)})
  if FLAGS.report and jax.process_index() == 0:
    from hnclip_jax.evaluation.report import write_report
    page = write_report(
        os.path.abspath(os.path.expanduser(FLAGS.report)), img=img, txt=txt, caption_image=caption_image,
        captions=[c for caps in captions for c in caps], image_bytes=lambda row: encoded[row]["image"],
        recall={"t2i": out["t2i"], "i2t": out["i2t"]}, seed=config.seed, num_samples=FLAGS.report_samples,
        max_failures=FLAGS.report_failures, twin_threshold=FLAGS.report_twin_threshold,
        meta={"workdir": workdir, "step": int(step), "data": experiment.describe_data(config.data), "split": split,
              "images": out["num_images"], "captions": out["num_captions"]})
    log(f"report: {page}")
  log(f"step {step}, {experiment.describe_counts(res)} of {experiment.describe_data(config.data)}, split '{split}'; wrote "
      f"{wd.eval_results} (history: {wd.eval_history})")
  ckpt.close()


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
