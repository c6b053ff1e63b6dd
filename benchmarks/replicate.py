"""Small-scale replication of the paper's claims on the built-in synthetic data (docs/replication.md).

  python benchmarks/replicate.py --out /tmp/hnclip_replication            # two-stage regime (default)
  python benchmarks/replicate.py --out /tmp/r --quick                     # seconds-scale smoke run (the tests)
  python benchmarks/replicate.py --out /tmp/r0 --regime dense_start       # the first design (docs: "before")
  python benchmarks/replicate.py --out /tmp/r3 --regime three_stage --seeds 0,1,2,3,4 --gammas 0,0.25,0.5,0.75,1.0
                                                                          # CLIP -> Long-CLIP -> dense fine-tune

1. Pre-train a tiny CLIP with plain InfoNCE (γ = 0): the "pre-trained initialisation". `two_stage` (default):
   on short alt-text captions of independent scenes, 32 text positions (configs/two_stage.py:pretrain), as CLIP
   was pre-trained on short web captions; `dense_start`: on the dense near-duplicate set itself (configs/demo.py);
   `three_stage`: stage 1 as two_stage's, then a "Long-CLIP" stage (its logit scale learning fast, to CLIP's 100):
   InfoNCE on a second dense-caption domain (configs/three_stage.py:longclip), whose model is the start;
   its recall on the target test set is measured with eval.py before fine-tuning (start_recall.json).
2. Caption geometry of the dense test captions under the pre-trained text encoder (tools/caption_geometry,
   before any fine-tuning; again after fine-tuning with γ 0 and 0.5, seed 0).
3. Fine-tune from it on the dense set with each γ and seed, same budget, saturation telemetry on every logged
   step and the HN-vs-InfoNCE parameter-gradient comparison every few steps.
4. Data efficiency: γ = 0.5 on 20% of the training set vs γ = 0 on 100% (seed 0; every seed under three_stage).
   Optionally (--token_weights, --methods, --frameworks, --frozen_scale) the token term, LoRA/DoRA, a framework or a
   frozen logit scale, γ 0 and 0.5; (--token_groups, --token_keeps) the token term's cheaper options at λ = 1,
   γ = 0.5 next to the whole term. Every γ = 0.5 vs γ = 0 comparison is also reported as a paired difference over
   the seeds (same start, same data order) with its 95% t-interval (results.json "paired").
Writes results.json, table.md, recall_vs_gamma.png, saturation.png, fig4_saturation_per_epoch.png and
fig6_data_efficiency.png to --out (with --report_tag T: results_T.json, table_T.md, ..._T.png; a report of another
set of seeds, γ or extras already in --out is not overwritten: the command stops before training and asks for a tag). Every number comes from the runs'
metrics.jsonl and geometry summary.json files, so the report can be regenerated from a finished --out with
--report_only. Finished runs are skipped when the command is run again.
"""
import argparse
import json
import os
import runpy
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hnclip_jax import workdir  # noqa: E402  (the workdir layout)
from hnclip_jax.config import base_config  # noqa: E402


def config_of(variant):
  """The resolved config of "path.py:arg" (as train.py would build it, without command-line overrides)."""
  path, _, arg = variant.partition(":")
  return runpy.run_path(path)["get_config"](*([arg] if arg else []))


def _diff_keys(old, new, prefix=""):
  """Dotted keys where two nested dicts differ."""
  if not isinstance(old, dict) or not isinstance(new, dict):
    return [prefix.rstrip(".") or "<all>"] if old != new else []
  return [k for key in set(old) | set(new) for k in _diff_keys(old.get(key), new.get(key), f"{prefix}{key}.")]


def _with_new_defaults(old, new, default):
  """`old` (a recorded config) with the keys it lacks and `new` has at the code's default value (`default`: the base
  config) filled in from `new`: a setting added to the code since the record was written, left at its default, is
  no difference between the two."""
  if not isinstance(old, dict) or not isinstance(new, dict) or not isinstance(default, dict):
    return old
  filled = {k: _with_new_defaults(v, new.get(k), default.get(k)) for k, v in old.items()}
  filled.update({k: v for k, v in new.items() if k not in old and k in default and default[k] == v})
  return filled


def python(args, log):
  """`python ARGS` from the repo root, its output in `log`; stops replicate.py if it fails."""
  cmd = [sys.executable, *args]
  with open(log, "w") as f:
    proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
  if proc.returncode != 0:
    raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log}")


def run(args, log):
  """One train.py run."""
  python(["train.py", *args], log)


def finished(workdir, steps) -> bool:
  """The run reached `steps` before (a rerun of replicate.py on the same --out skips it)."""
  return os.path.exists(os.path.join(workdir, "metrics.jsonl")) and bool(rows(workdir)) and \
      rows(workdir)[-1]["step"] >= steps


def rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def final_recall(workdir):
  ev = [r for r in rows(workdir) if "eval/t2i/R@1" in r][-1]
  return {f"{d}/R@{k}": ev[f"eval/{d}/R@{k}"] for d in ("t2i", "i2t") for k in (1, 5, 10)}


def mean_std(workdirs) -> dict:
  """{"t2i/R@1": [mean, std], ...} of the final recalls of runs that differ only in the seed. std is the population
  standard deviation (ddof = 0, NumPy's default; every results*.json so far holds it), a spread to read, not an
  inference: the paired intervals (`paired`) use the sample deviation (ddof = 1) with Student's t."""
  recs = [final_recall(w) for w in workdirs]
  return {k: [float(np.mean([r[k] for r in recs])), float(np.std([r[k] for r in recs]))] for k in recs[0]}


def per_epoch(workdir, steps_per_epoch, key, pred):
  """Fraction of logged steps per epoch where pred(row[key]) holds."""
  out = {}
  for r in rows(workdir):
    if key in r:
      e = (r["step"] - 1) // steps_per_epoch + 1
      out.setdefault(e, []).append(bool(pred(r[key])))
  return {e: float(np.mean(v)) for e, v in sorted(out.items())}


def per_epoch_mean(workdir, steps_per_epoch, key):
  """Mean of row[key] over the logged steps of each epoch."""
  out = {}
  for r in rows(workdir):
    if key in r:
      out.setdefault((r["step"] - 1) // steps_per_epoch + 1, []).append(float(r[key]))
  return {e: float(np.mean(v)) for e, v in sorted(out.items())}


def paired(a_dirs, b_dirs) -> dict:
  """{"t2i/R@1": {"mean": .., "ci95": [lo, hi], "per_seed": [..]}, ...}: recall of b minus recall of a, run by run
  (the same seed, so the same start and data order), with the 95% Student-t interval of the mean difference
  (None with one seed)."""
  from scipy import stats  # a dependency of jax
  ra, rb = [final_recall(w) for w in a_dirs], [final_recall(w) for w in b_dirs]
  out = {}
  for k in ra[0]:
    d = np.array([y[k] - x[k] for x, y in zip(ra, rb)])
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None
    out[k] = {"mean": float(d.mean()), "ci95": None if half is None else [float(d.mean() - half),
                                                                           float(d.mean() + half)],
              "per_seed": [float(x) for x in d]}
  return out


def saturation(w, g, plain, steps_per_epoch, batch) -> dict:
  """What one fine-tuning run's telemetry says about saturation (γ = g; `plain` the global term's name without the
  margin): per-epoch shares (the paper's Fig. 4), the gradient comparison, the loss level and Ḡ statistics."""
  name = "hn" if g else plain
  out = {
      "batch_loss_below_1e-3": per_epoch(w, steps_per_epoch, f"diag/{name}/loss", lambda v: v < 1e-3),
      # share of logged examples whose own loss is below 1e-3 (the paper's Fig. 4 "examples" curve)
      "examples_below_1e-3": per_epoch_mean(w, steps_per_epoch, f"diag/{name}/saturated_frac"),
      # the same share for the other term, computed on the same batches (InfoNCE's under γ > 0, HN's under γ = 0)
      f"{plain}_examples_below_1e-3": per_epoch_mean(w, steps_per_epoch, f"diag/{plain}/saturated_frac"),
      # share of logged batches with more than half of their examples below 1e-3 (not a share of examples)
      "batches_majority_saturated": per_epoch(w, steps_per_epoch, f"diag/{name}/saturated_frac", lambda v: v > 0.5),
      "zero_embedding_gradient": per_epoch(w, steps_per_epoch, f"diag/{name}/emb_grad_zero", lambda v: v == 1),
      f"{plain}_zero_embedding_gradient": per_epoch(w, steps_per_epoch, f"diag/{plain}/emb_grad_zero",
                                                    lambda v: v == 1),
      "G_offdiag_mean": per_epoch_mean(w, steps_per_epoch, "diag/G_offdiag_mean"),
      "logit_scale": per_epoch_mean(w, steps_per_epoch, "logit_scale"),
      f"{plain}_saturated_frac_mean": float(np.mean([r[f"diag/{plain}/saturated_frac"] for r in rows(w)
                                                     if f"diag/{plain}/saturated_frac" in r])),
      "hn_saturated_frac_mean": float(np.mean([r["diag/hn/saturated_frac"] for r in rows(w)
                                               if "diag/hn/saturated_frac" in r])),
  }
  ratio_key = f"diag/grad_norm_ratio_hn_over_{plain}"
  ratios = [r[ratio_key] for r in rows(w) if ratio_key in r]
  cos = [r["diag/grad_cosine"] for r in rows(w) if "diag/grad_cosine" in r]
  out["grad_norm_ratio_median"] = float(np.median(ratios)) if ratios else None
  out["grad_cosine_median"] = float(np.median(cos)) if cos else None
  out["grad_norm_ratio_range"] = [float(min(ratios)), float(max(ratios))] if ratios else None
  out["grad_cosine_range"] = [float(min(cos)), float(max(cos))] if cos else None
  # Every other number docs/replication.md quotes: the loss level, Ḡ statistics, how many examples were logged.
  logged = [r for r in rows(w) if f"diag/{name}/loss" in r]
  out["telemetry"] = {
      "logged_batches": len(logged), "logged_examples": len(logged) * batch,
      **{f"{k}_median": float(np.median([r[k] for r in logged if k in r])) for k in
         (f"diag/{name}/loss", "diag/G_offdiag_mean", "diag/G_offdiag_max", "diag/hardest_negative_sim")
         if any(k in r for r in logged)},
      "last_logged_loss": float(logged[-1][f"diag/{name}/loss"]) if logged else None,
      "first_logged": {k: float(logged[0][k]) for k in ("step", f"diag/{name}/loss", "diag/G_offdiag_mean",
                                                         "diag/hardest_negative_sim") if logged and k in logged[0]},
      "last_logged": {k: float(logged[-1][k]) for k in ("step", "diag/G_offdiag_mean", "diag/hardest_negative_sim")
                      if logged and k in logged[-1]}}
  return out


# the per-epoch telemetry kept for every seed (results.json "saturation" -> "per_seed", "over_seeds")
# --controls: the global term's settings of each control (docs/objective.md "Controls"); γ 0.5 unless it says.
CONTROLS = {"constant": ["--config.loss.gamma=0.5", "--config.loss.margin=constant"],
            "shuffled": ["--config.loss.gamma=0.5", "--config.loss.margin=shuffled"],
            "topk3": ["--config.loss.gamma=0.5", "--config.loss.margin=topk", "--config.loss.margin_topk=3"],
            "hn_nce": ["--config.loss.gamma=0", "--config.loss.hn_nce_beta=0.5"],
            # the margin in one of the softmax's two cross-entropies only (why it costs image→text R@1)
            "i2t_only": ["--config.loss.gamma=0.5", "--config.loss.margin_directions=i2t"],
            "t2i_only": ["--config.loss.gamma=0.5", "--config.loss.margin_directions=t2i"]}
PER_SEED = ("examples_below_1e-3", "batch_loss_below_1e-3", "zero_embedding_gradient", "G_offdiag_mean")


def over_seeds(per_seed) -> dict:
  """{key: {epoch: mean over the seeds}} for the PER_SEED keys of each seed's saturation() summary."""
  per_seed = list(per_seed)
  return {k: {e: float(np.mean([p[k][e] for p in per_seed])) for e in per_seed[0][k]} for k in PER_SEED}


def geometry(config, model, out_dir, data_dir):
  """tools/caption_geometry on the dense test captions with `model` (skipped when its summary exists)."""
  if os.path.exists(os.path.join(out_dir, "summary.json")):
    return
  python(["-m", "hnclip_jax.tools.caption_geometry", "--config", config, "--init_from", model, "--out", out_dir]
         + ([f"--config.data.data_dir={data_dir}"] if data_dir else []), out_dir + ".log")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--regime", default="two_stage", choices=("two_stage", "dense_start", "three_stage"))
  p.add_argument("--report_only", action="store_true")
  p.add_argument("--gammas", default="0,0.25,0.5,1.0")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--data_dir", default="")
  p.add_argument("--token_weights", default="",
                 help="comma-separated λ > 0: also fine-tune with the token term (γ 0 and 0.5, every seed)")
  p.add_argument("--methods", default="",
                 help="comma-separated lora,dora,dora_detached: also fine-tune with adapters (rank 16, the full runs' "
                      "lr x 25 as in the paper: 2e-6 -> 5e-5; dora_detached: DoRA's column norm a constant in the "
                      "backward pass, config.finetune.dora_detach_norm), γ 0 and 0.5, every seed")
  p.add_argument("--frameworks", default="",
                 help="comma-separated finelip,goal,structxlip: also fine-tune with that framework (config.framework; FineLIP's "
                      "hinge ramped in over one epoch, its aggregators at 10x the backbone's lr; GOAL with the "
                      "synthetic data's exact segments), γ 0 and 0.5, every seed; NAME:KEY=VALUE runs NAME with "
                      "config.NAME.KEY=VALUE (e.g. finelip:reduction=mean, its hinge divided by the batch)")
  p.add_argument("--token_groups", default="",
                 help="comma-separated G: also fine-tune with the token term (λ = 1, γ 0.5, every seed) on groups of G "
                      "examples (config.loss.token_group), next to the whole-batch term from the same start")
  p.add_argument("--loss", default="softmax", choices=("softmax", "sigmoid"),
                 help="sigmoid: the same regime with a SigLIP-family tiny model (attention-pooling head, "
                      "bidirectional text, logit bias) and SigLIP's sigmoid loss (config.loss.kind), HN-SigLIP vs "
                      "SigLIP over γ; the telemetry compares against plain SigLIP")
  p.add_argument("--token_keeps", default="",
                 help="comma-separated f in (0, 1): the same with the token term on the fraction f of each example's "
                      "tokens (config.loss.token_keep)")
  p.add_argument("--controls", default="",
                 help="comma-separated controls of the margin (issue 55; docs/objective.md \"Controls\"): constant "
                      "(γ 0.5 × the batch's mean Ḡ on every negative), shuffled (each row's Ḡ permuted among its "
                      "negatives), topk3 (only each row's 3 nearest captions), hn_nce (HN-NCE, β 0.5, γ 0), i2t_only / "
                      "t2i_only (the margin in one cross-entropy); every "
                      "seed, paired with γ 0.5 and γ 0 (both must be in --gammas)")
  p.add_argument("--batching", default="random", choices=("random", "clustered"),
                 help="the fine-tuning runs' batches (config.data.batching): clustered = each batch an example and its "
                      "nearest neighbours by the start model's caption embeddings")
  p.add_argument("--frozen_scale", action="store_true",
                 help="also fine-tune with the logit scale frozen at the start's value "
                      "(config.optimizer.train_logit_scale=False), γ 0 and 0.5, every seed")
  p.add_argument("--report_tag", default="",
                 help="write the report as results_TAG.json, table_TAG.md and *_TAG.png: needed when --out already "
                      "holds the report of another set of seeds, γ or extras (it is not overwritten)")
  a = p.parse_args()
  out = os.path.abspath(a.out)
  os.makedirs(out, exist_ok=True)
  gammas = [float(g) for g in a.gammas.split(",")]
  seeds = [int(s) for s in a.seeds.split(",")]
  test = ",test" if a.quick else ""
  if a.regime == "two_stage":
    pre_variant, variant = f"configs/two_stage.py:pretrain{test}", f"configs/two_stage.py:finetune{test}"
    pre_steps = 4 if a.quick else 600
  elif a.regime == "three_stage":
    pre_variant, variant = f"configs/three_stage.py:pretrain{test}", f"configs/three_stage.py:finetune{test}"
    mid_variant = f"configs/three_stage.py:longclip{test}"
    pre_steps = 4 if a.quick else 600
  else:
    pre_variant = variant = "configs/demo.py:test" if a.quick else "configs/demo.py"
    pre_steps = 4 if a.quick else 300
  # --out holds one regime, size and set of stage configs: reusing it for another would skip "finished" runs of the
  # wrong kind (a changed configs/three_stage.py, say), so the resolved configs are recorded and must match.
  frameworks = [f for f in a.frameworks.split(",") if f]
  for f in frameworks:  # NAME:KEY=VALUE must name one of the framework's settings (checked before any run starts)
    name, _, setting = f.partition(":")
    key = setting.partition("=")[0]
    if setting and ("=" not in setting or key not in config_of(variant).get(name, {})):
      raise SystemExit(f"--frameworks {f!r}: expected NAME or NAME:KEY=VALUE with KEY one of config.{name}'s settings "
                       f"({sorted(config_of(variant).get(name, {}))})")
  stage_variants = [pre_variant, *([mid_variant] if a.regime == "three_stage" else []), variant]
  setup_file = os.path.join(out, "replicate_setup.json")
  setup = {"regime": a.regime, "quick": a.quick, "configs": {v: json.loads(config_of(v).to_json_best_effort())
                                                              for v in stage_variants}}
  if a.batching != "random":  # the fine-tuning runs' directories do not name their batching: one --out per batching
    setup["batching"] = a.batching
  if a.loss != "softmax":
    setup["loss"] = a.loss
    if a.frameworks:
      raise SystemExit("--frameworks with --loss sigmoid: FineLIP, GOAL and StructXLIP are built on CLIP towers")
  if os.path.exists(setup_file):
    with open(setup_file) as f:
      before = json.load(f)
    if isinstance(before.get("configs"), dict):  # settings added to the code since, at their defaults: no difference
      default = json.loads(base_config().to_json_best_effort())
      before["configs"] = {v: _with_new_defaults(c, setup["configs"].get(v), default)
                           for v, c in before["configs"].items()}
    # --report_only trains nothing, so only the kind of run must match (older --out dirs have no "configs")
    keys = [k for k in setup if k != "configs"] if a.report_only else list(setup)
    differ = sorted(k for k in set(keys) | {k for k in before if k in keys or k in ("loss", "batching")}
                    if before.get(k) != setup.get(k))
    if differ:
      detail = {k: (before.get(k), setup.get(k)) for k in differ if k != "configs"}
      if "configs" in differ:
        old, new = before.get("configs") or {}, setup["configs"]
        detail["configs"] = {v: sorted(_diff_keys(old.get(v), new[v])) for v in new if old.get(v) != new[v]}
      raise SystemExit(f"{out} holds a replication run that differs from this command in {differ}: "
                       f"{detail} (recorded, now). Its finished runs would be reused as if they were this "
                       "command's. Use another --out, or restore the configs (nothing was changed).")
  # The report covers the runs these flags select; one of another selection in --out is kept, not overwritten.
  report_of = {"seeds": seeds, "gammas": sorted(gammas), **{k: getattr(a, k) for k in (
      "token_weights", "methods", "frameworks", "token_groups", "token_keeps", "frozen_scale")},
      **({"controls": a.controls} if a.controls else {})}
  sfx = f"_{a.report_tag}" if a.report_tag else ""
  report_file = os.path.join(out, f"results{sfx}.json")
  if os.path.exists(report_file):
    with open(report_file) as f:
      prev = json.load(f).get("report_of")
    if prev != report_of:
      raise SystemExit(
          f"{report_file} is the report of {prev or 'a run set not recorded (an older replicate.py)'}; this command's "
          f"({report_of}) would overwrite it. Pass --report_tag NAME to write results_NAME.json, table_NAME.md and "
          "*_NAME.png beside it (finished runs in --out are reused either way; nothing was changed).")
  if not os.path.exists(setup_file) and not a.report_only:
    with open(setup_file + ".tmp", "w") as f:
      json.dump(setup, f, indent=1)
    os.replace(setup_file + ".tmp", setup_file)  # a crash leaves no torn file that a rerun would fail to read
  ft_steps, log_every = (4, 1) if a.quick else (100, 5)
  if a.regime == "three_stage" and not a.quick:  # the config's length (configs/three_stage.py:FINETUNE_STEPS)
    ft_steps = config_of(variant).total_steps
  num_train, batch = (128, 16) if a.quick else (4096, 128)
  shared = ["--config.log_every=%d" % log_every, "--config.eval_every=100000", "--config.checkpoint_every=100000"] \
      + ([f"--config.data.data_dir={a.data_dir}"] if a.data_dir else [])
  plain = "infonce"  # the telemetry's name for the global term without the margin
  if a.loss == "sigmoid":  # a SigLIP-family model of the configs' size, trained with the sigmoid loss throughout
    width = config_of(variant).model.vision_width
    shared += ["--config.model.family=siglip", "--config.model.logit_bias=True", "--config.model.act=gelu_tanh",
               f"--config.model.embed_dim={width}", "--config.loss.kind=sigmoid"]
    plain = "siglip"
  common = ["--config", variant, *shared] + (["--config.data.batching=clustered"] if a.batching == "clustered" else [])
  pre = os.path.join(out, "pretrain")
  # The fine-tuning start: stage 1's model, or under three_stage the "Long-CLIP" stage's (trained from stage 1).
  mid = os.path.join(out, "longclip") if a.regime == "three_stage" else None
  start = mid or pre
  if a.regime == "three_stage":  # the config's small lr (configs/three_stage.py:FINETUNE_LR)
    ft_lr, mid_steps = config_of(variant).optimizer.lr, config_of(mid_variant).total_steps
  else:
    ft_lr = 2e-4
  # the parameter-gradient telemetry (an extra backward pass): under three_stage 4 times an epoch, for Fig. 4
  diag_every = 2 if a.quick else 8 if a.regime == "three_stage" else 25
  # Saturation telemetry (config.diagnostics) only in the runs whose telemetry results.json reports (γ, frozen scale,
  # controls); the others (pre-training, token term, adapters, frameworks, 20 %) are compared on recall alone, so
  # they neither compile nor run the telemetry's extra forward and backward passes.
  telemetry = [f"--config.diagnostics.every={diag_every}", "--config.diagnostics.log=True"]
  no_telemetry = ["--config.diagnostics.every=0", "--config.diagnostics.log=False"]
  ft_args = [f"--config.optimizer.lr={ft_lr}", "--config.optimizer.warmup_steps=0", f"--config.total_steps={ft_steps}",
             f"--config.init_from={start}"]
  runs = {(g, s): os.path.join(out, f"ft_gamma{g}_seed{s}") for g in gammas for s in seeds}
  token_weights = [float(x) for x in a.token_weights.split(",") if x]
  tok_runs = {(lam, g, s): os.path.join(out, f"ft_tok{lam}_gamma{g}_seed{s}")
              for lam in token_weights for g in (0.0, 0.5) for s in seeds}
  methods = [m for m in a.methods.split(",") if m]
  peft_runs = {(m, g, s): os.path.join(out, f"ft_{m}_gamma{g}_seed{s}") for m in methods for g in (0.0, 0.5)
               for s in seeds}
  scale_runs = {(g, s): os.path.join(out, f"ft_frozenscale_gamma{g}_seed{s}") for g in (0.0, 0.5) for s in seeds} \
      if a.frozen_scale else {}
  fw_runs = {(f, g, s): os.path.join(out, f"ft_fw_{f.replace(':', '_').replace('=', '-')}_gamma{g}_seed{s}")
             for f in frameworks for g in (0.0, 0.5)
             for s in seeds}
  # The token term's cost options (docs/objective.md), λ = 1 and γ = 0.5, against the whole term from the same start
  # (its runs are the --token_weights 1 runs of γ 0.5: one directory, run once).
  cost = {"full": []} if a.token_groups or a.token_keeps else {}
  cost.update({f"group{int(x)}": [f"--config.loss.token_group={int(x)}"] for x in a.token_groups.split(",") if x})
  cost.update({f"keep{float(x)}": [f"--config.loss.token_keep={float(x)}"] for x in a.token_keeps.split(",") if x})
  cost_runs = {(c, s): os.path.join(out, "ft_tok1.0_gamma0.5_seed%d" % s if c == "full" else
                                    f"ft_tok1.0_{c}_gamma0.5_seed{s}") for c in cost for s in seeds}
  controls = [c for c in a.controls.split(",") if c]
  unknown = [c for c in controls if c not in CONTROLS]
  if unknown:
    raise SystemExit(f"--controls: unknown {unknown}; choose from {list(CONTROLS)}")
  if controls and not {0.0, 0.5} <= set(gammas):
    raise SystemExit("--controls are paired with the γ 0 and γ 0.5 runs: add both to --gammas")
  ctl_runs = {(c, s): os.path.join(out, f"ft_ctl_{c}_seed{s}") for c in controls for s in seeds}
  small = os.path.join(out, "ft_gamma0.5_20pct")
  # three_stage: the 20% run for every seed (a paired comparison with γ = 0 on 100%); otherwise seed 0 only
  smalls = {s: small if s == 0 and a.regime != "three_stage" else f"{small}_seed{s}"
            for s in (seeds if a.regime == "three_stage" else [0])}
  start_recall = os.path.join(out, "start_recall.json")
  if not a.report_only:
    if not os.path.exists(os.path.join(pre, workdir.MODEL_JSON)) or not rows(pre)[-1:] or \
        rows(pre)[-1]["step"] < pre_steps:
      run(["--config", pre_variant, *shared, *no_telemetry, "--workdir", pre, "--config.loss.gamma=0",
           f"--config.total_steps={pre_steps}", f"--config.eval_every={pre_steps}"], os.path.join(out, "pretrain.log"))
    if mid and not (os.path.exists(os.path.join(mid, workdir.MODEL_JSON)) and finished(mid, mid_steps)):
      run(["--config", mid_variant, *shared, *no_telemetry, "--workdir", mid, f"--config.init_from={pre}"],
          os.path.join(out, "longclip.log"))
    if mid and not os.path.exists(start_recall):
      # the start's recall on the target's test set (eval.py with the fine-tuning config's data)
      d = config_of(variant).data
      python(["eval.py", "--config", variant, "--workdir", mid, *shared[3:]]
             + [f"--config.data.{k}={d[k]}" for k in ("captions", "group_size", "seed", "num_train", "num_test")],
             os.path.join(out, "start_recall.log"))
      with open(os.path.join(mid, "eval_results.json")) as f, open(start_recall + ".tmp", "w") as g:
        json.dump(json.load(f), g)
      os.replace(start_recall + ".tmp", start_recall)  # a crash leaves no torn file that a rerun would trust
    geometry(variant, start, os.path.join(out, "geometry_pretrained"), a.data_dir)
    for (g, s), w in runs.items():
      if finished(w, ft_steps):
        continue
      run([*common, *ft_args, *telemetry, "--workdir", w, f"--config.loss.gamma={g}", f"--config.seed={s}"], w + ".log")
    for (lam, g, s), w in tok_runs.items():
      if finished(w, ft_steps):
        continue
      run([*common, *ft_args, *no_telemetry, "--workdir", w, f"--config.loss.gamma={g}", f"--config.seed={s}",
           f"--config.loss.token_weight={lam}"], w + ".log")
    for (c, s), w in cost_runs.items():
      if finished(w, ft_steps):
        continue
      run([*common, *ft_args, *no_telemetry, "--workdir", w, "--config.loss.gamma=0.5", f"--config.seed={s}",
           "--config.loss.token_weight=1.0", *cost[c]], w + ".log")
    for (m, g, s), w in peft_runs.items():
      if finished(w, ft_steps):
        continue
      detach = ["--config.finetune.dora_detach_norm=True"] if m == "dora_detached" else []
      run([*common, *ft_args, *no_telemetry, f"--config.optimizer.lr={25 * ft_lr:g}", "--workdir", w,
           f"--config.loss.gamma={g}",
           f"--config.seed={s}", f"--config.finetune.method={m.removesuffix('_detached')}", *detach,
           "--config.finetune.rank=16", "--config.finetune.alpha=16"], w + ".log")
    for (g, s), w in scale_runs.items():
      if finished(w, ft_steps):
        continue
      run([*common, *ft_args, *telemetry, "--workdir", w, f"--config.loss.gamma={g}", f"--config.seed={s}",
           "--config.optimizer.train_logit_scale=False"], w + ".log")
    for (f, g, s), w in fw_runs.items():
      if finished(w, ft_steps):
        continue
      name, _, setting = f.partition(":")  # NAME or NAME:KEY=VALUE (one of the framework's own settings)
      fw_args = ["--config.optimizer.lr_multipliers=((r'^(image|text)_aggregator/', 10.0),)"] if name == "finelip" else []
      run([*common, *ft_args, *no_telemetry, "--workdir", w, f"--config.loss.gamma={g}", f"--config.seed={s}",
           f"--config.framework={name}", *fw_args, *([f"--config.{name}.{setting}"] if setting else [])], w + ".log")
    for (c, s), w in ctl_runs.items():
      if finished(w, ft_steps):
        continue
      run([*common, *ft_args, *telemetry, "--workdir", w, f"--config.seed={s}", *CONTROLS[c]], w + ".log")
    for s, w in smalls.items():
      if not finished(w, ft_steps):
        run([*common, *ft_args, *no_telemetry, "--workdir", w, "--config.loss.gamma=0.5", f"--config.seed={s}",
             f"--config.data.num_train={num_train // 5}"], w + ".log")
    for g in (0.0, 0.5):
      if (g, seeds[0]) in runs:
        geometry(variant, runs[(g, seeds[0])], os.path.join(out, f"geometry_finetuned_gamma{g}"), a.data_dir)

  steps_per_epoch = max(1, num_train // batch)
  results = {"report_of": report_of, "pretrain": final_recall(pre), "by_gamma": {}, "saturation": {}, "paired": {},
             "setup": {
      "regime": a.regime, "loss": a.loss, "pretrain_steps": pre_steps, "finetune_steps": ft_steps, "batch": batch,
      "num_train": num_train, "seeds": seeds, "gammas": gammas, "pretrain_config": pre_variant, "config": variant}}
  results["geometry"] = {name: json.load(open(os.path.join(out, name, "summary.json")))
                         for name in ["geometry_pretrained"] + [f"geometry_finetuned_gamma{g}" for g in (0.0, 0.5)]
                         if os.path.exists(os.path.join(out, name, "summary.json"))}
  if mid:
    results["longclip"] = final_recall(mid)  # on its own domain's test set
    with open(start_recall) as f:
      ev = json.load(f)
    results["start_on_target"] = {f"{d}/R@{k}": ev[d][f"R@{k}"] for d in ("t2i", "i2t") for k in (1, 5, 10)}
  for g in sorted(gammas):  # ascending, whatever order --gammas ran them in (the table and the plot read it)
    results["by_gamma"][str(g)] = mean_std([runs[(g, s)] for s in seeds])
    if g and 0.0 in gammas:
      results["paired"][f"gamma{g}_vs_0"] = paired([runs[(0.0, s)] for s in seeds], [runs[(g, s)] for s in seeds])
  results["token_term"] = {}
  for lam in token_weights:
    for g in (0.0, 0.5):
      results["token_term"][f"lambda{lam}_gamma{g}"] = mean_std([tok_runs[(lam, g, s)] for s in seeds])
  results["token_cost"] = {c: mean_std([cost_runs[(c, s)] for s in seeds]) for c in cost}
  results["adapters"] = {}
  for m in methods:
    for g in (0.0, 0.5):
      results["adapters"][f"{m}_gamma{g}"] = mean_std([peft_runs[(m, g, s)] for s in seeds])
  results["frameworks"] = {}
  for f in frameworks:
    for g in (0.0, 0.5):
      results["frameworks"][f"{f}_gamma{g}"] = mean_std([fw_runs[(f, g, s)] for s in seeds])
  for g in (0.0, 0.5):
    if (g, seeds[0]) in runs:
      results["saturation"][str(g)] = saturation(runs[(g, seeds[0])], g, plain, steps_per_epoch, batch)
      # the per-epoch shares of every seed (Fig. 4 over seeds)
      results["saturation"][str(g)]["per_seed"] = {
          s: {k: v for k, v in saturation(runs[(g, s)], g, plain, steps_per_epoch, batch).items()
              if k in PER_SEED}
          for s in seeds if (g, s) in runs}
      # their mean over the seeds, epoch by epoch (what Fig. 4 plots)
      results["saturation"][str(g)]["over_seeds"] = over_seeds(results["saturation"][str(g)]["per_seed"].values())
    if (g, seeds[0]) in scale_runs:
      results["saturation"][f"{g}_frozen_scale"] = saturation(scale_runs[(g, seeds[0])], g, plain, steps_per_epoch,
                                                              batch)
  results["controls"] = {c: mean_std([ctl_runs[(c, s)] for s in seeds]) for c in controls}
  for c in controls:
    for g in (0.5, 0.0):
      results["paired"][f"control_{c}_vs_gamma{g}"] = paired([runs[(g, s)] for s in seeds],
                                                             [ctl_runs[(c, s)] for s in seeds])
    # the run's own objective ("hn": the control / HN-NCE) against plain InfoNCE on the same batches
    results["saturation"][f"control_{c}"] = saturation(ctl_runs[(c, seeds[0])], 1.0, plain, steps_per_epoch, batch)
    results["saturation"][f"control_{c}"]["per_seed"] = {
        s: {k: v for k, v in saturation(ctl_runs[(c, s)], 1.0, plain, steps_per_epoch, batch).items()
            if k in PER_SEED} for s in seeds}
    results["saturation"][f"control_{c}"]["over_seeds"] = over_seeds(
        results["saturation"][f"control_{c}"]["per_seed"].values())
  results["frozen_scale"] = {f"gamma{g}": mean_std([scale_runs[(g, s)] for s in seeds])
                             for g in (0.0, 0.5) if scale_runs}
  # γ = 0.5 vs γ = 0 on the same seeds, for every configuration that ran both
  for key, group in (("token_lambda%s", {(lam,): tok_runs for lam in token_weights}),
                     ("%s", {(m,): peft_runs for m in methods}), ("framework_%s", {(f,): fw_runs for f in frameworks})):
    for (x,), rs in group.items():
      results["paired"][key % x + "_gamma0.5_vs_0"] = paired([rs[(x, 0.0, s)] for s in seeds],
                                                             [rs[(x, 0.5, s)] for s in seeds])
  if scale_runs:
    results["paired"]["frozen_scale_gamma0.5_vs_0"] = paired([scale_runs[(0.0, s)] for s in seeds],
                                                             [scale_runs[(0.5, s)] for s in seeds])
    for g in (0.0, 0.5):
      if (g, seeds[0]) in runs:
        results["paired"][f"gamma{g}_frozen_vs_learned_scale"] = paired([runs[(g, s)] for s in seeds],
                                                                        [scale_runs[(g, s)] for s in seeds])
  if len(smalls) > 1 and all((0.0, s) in runs for s in smalls):
    results["paired"]["gamma0.5_20pct_vs_gamma0_100pct"] = paired([runs[(0.0, s)] for s in smalls],
                                                                  list(smalls.values()))
  results["data_efficiency"] = {"gamma0.5_20pct": final_recall(smalls[min(smalls)]),
                                "gamma0_100pct": results["by_gamma"].get("0.0")}
  if len(smalls) > 1:
    results["data_efficiency"]["gamma0.5_20pct_over_seeds"] = mean_std(list(smalls.values()))
  with open(report_file + ".tmp", "w") as f:
    json.dump(results, f, indent=2)
  os.replace(report_file + ".tmp", report_file)

  lines = ["Mean ± population standard deviation (ddof = 0) over seeds; the paired differences' 95 % intervals use the "
           "sample deviation (ddof = 1).", "",
           "| γ | t2i R@1 | t2i R@5 | t2i R@10 | i2t R@1 | i2t R@5 | i2t R@10 |", "|---|---|---|---|---|---|---|"]
  pr = results["pretrain"]
  lines.append(f"| pre-trained (γ=0){', its own test split' if mid else ''} | " + " | ".join(f"{pr[f'{d}/R@{k}']:.2f}" for d in ("t2i", "i2t")
                                                    for k in (1, 5, 10)) + " |")
  if "start_on_target" in results:  # three_stage: the fine-tuning start ("Long-CLIP") on the target's test split
    st = results["start_on_target"]
    lines.append("| start (\"Long-CLIP\"), on the target | " + " | ".join(
        f"{st[f'{d}/R@{k}']:.2f}" for d in ("t2i", "i2t") for k in (1, 5, 10)) + " |")
  for g, r in results["by_gamma"].items():
    lines.append(f"| {g} | " + " | ".join(f"{r[f'{d}/R@{k}'][0]:.2f} ± {r[f'{d}/R@{k}'][1]:.2f}"
                                          for d in ("t2i", "i2t") for k in (1, 5, 10)) + " |")
  for name, r in results["token_term"].items():
    lam, g = name.removeprefix("lambda").split("_gamma")
    lines.append(f"| {g}, token term λ={lam} | " + " | ".join(f"{r[f'{d}/R@{k}'][0]:.2f} ± {r[f'{d}/R@{k}'][1]:.2f}"
                                                              for d in ("t2i", "i2t") for k in (1, 5, 10)) + " |")
  for c, r in results["token_cost"].items():
    lines.append(f"| 0.5, token term λ=1, {c} | " + " | ".join(f"{r[f'{d}/R@{k}'][0]:.2f} ± {r[f'{d}/R@{k}'][1]:.2f}"
                                                              for d in ("t2i", "i2t") for k in (1, 5, 10)) + " |")
  for name, r in results["adapters"].items():
    m, g = name.split("_gamma")
    lines.append(f"| {g}, {m.upper()} rank 16 | " + " | ".join(f"{r[f'{d}/R@{k}'][0]:.2f} ± {r[f'{d}/R@{k}'][1]:.2f}"
                                                          for d in ("t2i", "i2t") for k in (1, 5, 10)) + " |")
  for name, r in results["frameworks"].items():
    f, g = name.split("_gamma")
    lines.append(f"| {g}, framework {f} | " + " | ".join(f"{r[f'{d}/R@{k}'][0]:.2f} ± {r[f'{d}/R@{k}'][1]:.2f}"
                                                         for d in ("t2i", "i2t") for k in (1, 5, 10)) + " |")
  for name, r in results["frozen_scale"].items():
    lines.append(f"| {name.removeprefix('gamma')}, logit scale frozen | " + " | ".join(
        f"{r[f'{d}/R@{k}'][0]:.2f} ± {r[f'{d}/R@{k}'][1]:.2f}" for d in ("t2i", "i2t") for k in (1, 5, 10)) + " |")
  for c, r in results["controls"].items():
    lines.append(f"| control {c} | " + " | ".join(f"{r[f'{d}/R@{k}'][0]:.2f} ± {r[f'{d}/R@{k}'][1]:.2f}"
                                                   for d in ("t2i", "i2t") for k in (1, 5, 10)) + " |")
  de = results["data_efficiency"]["gamma0.5_20pct"]
  lines.append(f"| 0.5, 20% data, seed {min(smalls)} | " + " | ".join(f"{de[f'{d}/R@{k}']:.2f}" for d in ("t2i", "i2t")
                                                       for k in (1, 5, 10)) + " |")
  with open(os.path.join(out, f"table{sfx}.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  gs = [float(g) for g in results["by_gamma"]]
  for d in ("t2i", "i2t"):
    m = [results["by_gamma"][str(g)][f"{d}/R@1"][0] for g in gs]
    sd = [results["by_gamma"][str(g)][f"{d}/R@1"][1] for g in gs]
    ax.errorbar(gs, m, yerr=sd, marker="o", capsize=3, label=f"{d} R@1")
  ax.set(xlabel="γ", ylabel="R@1 (%)", title={"two_stage": "fine-tuned from short-caption pre-training",
                                                "three_stage": "fine-tuned from a 'Long-CLIP' start"}.get(
                                                    a.regime, "fine-tuned from InfoNCE pre-training"))
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, f"recall_vs_gamma{sfx}.png"), dpi=120)
  plt.close(fig)
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for g in [g for g in ("0.0", "0.5") if g in results["saturation"]]:
    v = [r.get(f"diag/{plain}/saturated_frac" if g == "0.0" else "diag/hn/saturated_frac")
         for r in rows(runs[(float(g), seeds[0])])]
    steps = [r["step"] for r in rows(runs[(float(g), seeds[0])])]
    xs = [s for s, x in zip(steps, v) if x is not None]
    ax.plot(xs, [x for x in v if x is not None], label=f"γ={g}")
  ax.set(xlabel="fine-tuning step", ylabel="share of examples with loss < 1e-3", title="saturation")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, f"saturation{sfx}.png"), dpi=120)
  plt.close(fig)
  if "0.0" in results["saturation"] and "0.5" in results["saturation"]:  # the paper's Fig. 4, per epoch
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for g, label in (("0.0", "InfoNCE (γ=0)" if plain == "infonce" else "SigLIP (γ=0)"), ("0.5", "γ=0.5")):
      sat = results["saturation"][g]["over_seeds"]
      for key, style, what in (("batch_loss_below_1e-3", "-o", "batches"), ("examples_below_1e-3", "--s", "examples")):
        ep = sorted(sat[key], key=int)
        axes[0].plot([int(e) for e in ep], [100 * sat[key][e] for e in ep], style, label=f"{label}, {what}")
      ep = sorted(sat["zero_embedding_gradient"], key=int)
      axes[1].plot([int(e) for e in ep], [100 * sat["zero_embedding_gradient"][e] for e in ep], "-o", label=label)
    n = f"mean of {len(seeds)} seeds" if len(seeds) > 1 else f"seed {seeds[0]}"
    axes[0].set(xlabel="epoch", ylabel="% with loss < 1e-3",
                title=f"saturation, {n} (paper: 80% of batches, epoch 1)")
    axes[1].set(xlabel="epoch", ylabel="% of measurements", title="embedding gradient exactly 0 (paper: 47%)")
    for ax in axes:
      ax.set_ylim(-2, 102)
      ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"fig4_saturation_per_epoch{sfx}.png"), dpi=120)
    plt.close(fig)
  de = results["data_efficiency"]  # the paper's Fig. 6: γ = 0.5 on 20% of the data vs γ = 0 on 100%
  if de["gamma0_100pct"]:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    small_ms = de.get("gamma0.5_20pct_over_seeds") or {k: [v, 0.0] for k, v in de["gamma0.5_20pct"].items()}
    for i, (name, ms) in enumerate((("γ=0, 100% data", de["gamma0_100pct"]), ("γ=0.5, 20% data", small_ms))):
      ax.bar([j + 0.38 * i for j in range(2)], [ms[f"{d}/R@1"][0] for d in ("t2i", "i2t")], 0.38,
             yerr=[ms[f"{d}/R@1"][1] for d in ("t2i", "i2t")], capsize=3, label=name)
    ax.set_xticks([0.19, 1.19], ["t2i R@1", "i2t R@1"])
    ax.set(ylabel="R@1 (%)", title=f"data efficiency ({len(smalls)} seed{'s' * (len(smalls) > 1)})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"fig6_data_efficiency{sfx}.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
  try:
    main()
  except SystemExit as e:  # a refusal (SystemExit with a message): one `error:` line and exit 2, as train.py
    if not isinstance(e.code, str):
      raise
    print(f"error: {e.code}", file=sys.stderr, flush=True)
    sys.exit(2)
