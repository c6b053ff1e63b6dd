"""Saturation telemetry, caption-geometry report and the replication script."""
import json
import os
import runpy
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from hnclip_jax import diagnostics, losses
from hnclip_jax.objective import Objective, embedding_outputs
from hnclip_jax.tools.caption_geometry import bucket_shares, similarity_stats
from conftest import ROOT, assert_error_exit, run_entry, run_py

MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))


def test_margin_stats_match_numpy():
  t = np.random.default_rng(0).normal(size=(12, 5)).astype(np.float32)
  t /= np.linalg.norm(t, axis=1, keepdims=True)
  mean, mx, hardest = jax.jit(lambda x: diagnostics.margin_stats(x, MESH))(t)
  g = t.astype(np.float64) @ t.T
  off = g[~np.eye(12, dtype=bool)]
  np.testing.assert_allclose([mean, mx], [off.mean(), off.max()], rtol=1e-5)
  np.fill_diagonal(g, -np.inf)
  np.testing.assert_allclose(hardest, g.max(1).mean(), rtol=1e-5)


def _embedding_diag(img, txt, scale, gamma):
  """The telemetry of make_batch_diagnostics, on given embeddings (no towers)."""
  out = {}
  for name, obj in diagnostics._pairs(Objective.of(gamma=gamma)):
    def loss(i, t, obj=obj):
      v, aux = obj(embedding_outputs(i, t, scale), MESH)
      return v, aux["per_example"]
    (v, per), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(img, txt)
    out[name] = (float(v), float(jnp.mean(per < diagnostics.SATURATED)),
                 float(jnp.sqrt(sum(jnp.sum(x * x) for x in grads))))
  return out


def test_saturated_infonce_has_exactly_zero_gradient_while_the_margin_keeps_learning():
  """Two pairs whose captions are 0.36-similar; image→caption gaps of 1.13 cosine at s = 100.
  InfoNCE: exp(-113) underflows in fp32, so the loss and its gradient are exactly 0. With γ = 3 the margin
  lifts the negatives by s·γ·Ḡ = 108 logits and the loss is ~1e-2: still learning."""
  th = 0.6
  txt = np.array([[np.cos(th), np.sin(th), 0], [np.cos(th), -np.sin(th), 0]], np.float32)
  img = np.array([[0, 1, 0], [0, -1, 0]], np.float32)
  d = _embedding_diag(img, txt, 100.0, 3.0)
  assert d["infonce"] == (0.0, 1.0, 0.0)
  assert d["hn"][0] > 1e-3 and d["hn"][1] == 0.0 and d["hn"][2] > 0
  # The dense reference agrees on the margin loss.
  np.testing.assert_allclose(d["hn"][0], float(losses.hn_clip_loss(img, txt, 100.0, 3.0)), rtol=1e-5)


def test_similarity_stats_and_buckets():
  e = np.random.default_rng(1).normal(size=(50, 8)).astype(np.float32)
  e /= np.linalg.norm(e, axis=1, keepdims=True)
  counts, edges, hardest = similarity_stats(e, chunk=7)
  g = e @ e.T
  iu = np.triu_indices(50, 1)
  np.testing.assert_array_equal(counts, np.histogram(np.clip(g[iu], -1, 1), edges)[0])
  np.fill_diagonal(g, -np.inf)
  np.testing.assert_allclose(hardest, g.max(1), rtol=1e-6)
  shares = bucket_shares(np.array([[1, 0.96, 0.1], [0.96, 1, 0.75], [0.1, 0.75, 1]]))
  assert shares == pytest.approx({"<0.5": 1 / 3, "0.5-0.7": 0, "0.7-0.8": 1 / 3, "0.8-0.9": 0, "0.9-0.95": 0,
                                  ">=0.95": 1 / 3})


def load_replicate():
  """benchmarks/replicate.py as a module."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("replicate", os.path.join(ROOT, "benchmarks", "replicate.py"))
  rep = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(rep)
  return rep


@pytest.fixture(scope="module")
def replication(tmp_path_factory, tfds_dir):
  """`python benchmarks/replicate.py --quick ...`: its main in this process, and the train.py and caption-geometry
  runs it starts too (through conftest.run_entry, the flag parser and main `python train.py` / `python -m` runs,
  instead of `replicate.python`'s subprocess: nine fresh interpreters and JAX imports saved). The script as a real
  process is run below (another regime for the same --out)."""
  out = tmp_path_factory.mktemp("replication")
  rep = load_replicate()

  def python(args, log):  # replicate.python, in this process
    proc = run_entry(args[0], args[1:])
    with open(log, "w") as f:
      f.write(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"python {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"

  rep.python = python
  argv = sys.argv
  sys.argv = ["benchmarks/replicate.py", "--quick", "--out", str(out), "--regime", "three_stage", "--seeds", "0",
              "--gammas", "0,0.5", "--frameworks", "finelip:reduction=mean", "--token_groups", "4",
              "--methods", "dora_detached", "--frozen_scale", f"--data_dir={tfds_dir}"]
  try:
    rep.main()
  finally:
    sys.argv = argv
  return out


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
def test_replicate_quick_writes_its_outputs(replication):
  res = json.load(open(replication / "results.json"))
  assert set(res["by_gamma"]) == {"0.0", "0.5"}
  assert set(res["saturation"]) == {"0.0", "0.5", "0.0_frozen_scale", "0.5_frozen_scale"}
  assert res["saturation"]["0.5"]["over_seeds"] == res["saturation"]["0.5"]["per_seed"]["0"]  # one seed
  # Three stages: short-caption pre-training at 32 text positions, a "Long-CLIP" stage at 68 (Long-CLIP's stretch)
  # on another dense caption set (other scenes, no near-duplicate groups), then the dense near-duplicate fine-tune;
  # the dense captions' geometry is measured before fine-tuning and after it, and results.json carries it.
  assert res["setup"]["regime"] == "three_stage"
  mid_data = json.load(open(replication / "longclip" / "data.json"))["data"]
  ft_data = json.load(open(replication / "ft_gamma0.0_seed0" / "data.json"))["data"]
  three_stage = runpy.run_path(os.path.join(ROOT, "configs", "three_stage.py"))
  assert mid_data["captions"] == three_stage["LONGCLIP_CAPTIONS"] and mid_data["group_size"] == 1, mid_data
  assert mid_data["seed"] != ft_data["seed"] and ft_data["group_size"] == 4, (mid_data, ft_data)
  assert json.load(open(replication / "longclip" / "model.json"))["text_context"] == 68
  # the start's recall on the target: eval.py of the Long-CLIP model on the fine-tuning data (its test split)
  ev = json.load(open(replication / "start_recall.json"))
  assert ev["num_pairs"] == 40 and res["start_on_target"]["t2i/R@1"] == ev["t2i"]["R@1"]
  # fine-tuning starts from the Long-CLIP stage's model
  for w in ("ft_gamma0.0_seed0", "ft_frozenscale_gamma0.5_seed0", "ft_gamma0.5_20pct_seed0"):
    assert f"initialised from {replication / 'longclip'}" in open(replication / f"{w}.log").read(), w
  # --frozen_scale: the logit scale stays where the start left it; --methods dora_detached: DoRA adapters
  frozen = [r["logit_scale"] for r in map(json.loads, open(replication / "ft_frozenscale_gamma0.5_seed0" /
                                                           "metrics.jsonl")) if "logit_scale" in r]
  assert len(set(frozen)) == 1 and set(res["frozen_scale"]) == {"gamma0.0", "gamma0.5"}
  assert json.load(open(replication / "ft_dora_detached_gamma0.5_seed0" / "model.json"))["adapter"] == "dora"
  assert "| 0.5, DORA_DETACHED rank 16 |" in open(replication / "table.md").read()
  # every γ = 0.5 vs γ = 0 comparison, paired over the seeds (one seed here: no interval)
  assert set(res["paired"]) == {"gamma0.5_vs_0", "dora_detached_gamma0.5_vs_0",
                                "framework_finelip:reduction=mean_gamma0.5_vs_0",
                                "frozen_scale_gamma0.5_vs_0",
                                "gamma0.0_frozen_vs_learned_scale", "gamma0.5_frozen_vs_learned_scale"}
  d = res["paired"]["gamma0.5_vs_0"]["t2i/R@1"]
  assert d["ci95"] is None and d["per_seed"] == [pytest.approx(res["by_gamma"]["0.5"]["t2i/R@1"][0]
                                                               - res["by_gamma"]["0.0"]["t2i/R@1"][0])]
  # The same --out for the other regime stops and changes nothing (it would reuse the wrong pre-training).
  before = sorted(os.listdir(replication))
  other = run_py(["benchmarks/replicate.py", "--quick", "--out", str(replication), "--regime", "dense_start"],
                 check=False)
  assert_error_exit(other, "'regime': ('three_stage', 'dense_start')")
  assert sorted(os.listdir(replication)) == before
  # So does a stage config changed since (here stage 2's steps, as an edit of configs/three_stage.py would): the
  # finished stage-2 run would otherwise be reused as this config's. A setting the record lacks (added to the code
  # since) at its default value is no difference (here the margin's directions, removed from two stages' records).
  changed = replication.parent / (replication.name + "_changed")
  changed.mkdir()
  setup = json.load(open(replication / "replicate_setup.json"))
  setup["configs"]["configs/three_stage.py:longclip,test"]["total_steps"] += 1
  for stage in ("pretrain", "longclip"):
    del setup["configs"][f"configs/three_stage.py:{stage},test"]["loss"]["margin_directions"]
  json.dump(setup, open(changed / "replicate_setup.json", "w"))
  argv, sys.argv = sys.argv, ["benchmarks/replicate.py", "--quick", "--out", str(changed), "--regime", "three_stage"]
  try:
    with pytest.raises(SystemExit, match=r"differs from this command in \['configs'\].*longclip,test': \['total_steps'\]\}") as e:
      load_replicate().main()
    assert "pretrain" not in str(e.value) and "margin_directions" not in str(e.value), e.value
  finally:
    sys.argv = argv
  assert os.listdir(changed) == ["replicate_setup.json"]
  # A report of another selection of runs (γ 0 alone) stops rather than overwrite this one, and with --report_tag
  # is written beside it.
  report = sorted(os.listdir(replication))
  only0 = ["benchmarks/replicate.py", "--quick", "--out", str(replication), "--regime", "three_stage", "--seeds", "0",
           "--gammas", "0", "--report_only"]
  for extra in ([], ["--report_tag", "g0"]):
    argv, sys.argv = sys.argv, only0 + extra
    try:
      if extra:
        load_replicate().main()
      else:
        with pytest.raises(SystemExit, match=r"results.json is the report of .*'gammas': \[0.0, 0.5\].*--report_tag"):
          load_replicate().main()
        assert sorted(os.listdir(replication)) == report
    finally:
      sys.argv = argv
  assert json.load(open(replication / "results.json")) == res
  g0 = json.load(open(replication / "results_g0.json"))
  assert set(g0["by_gamma"]) == {"0.0"} and g0["by_gamma"]["0.0"] == res["by_gamma"]["0.0"]
  assert set(os.listdir(replication)) - set(report) == {"results_g0.json", "table_g0.md", "recall_vs_gamma_g0.png",
                                                          "saturation_g0.png", "fig6_data_efficiency_g0.png"}
  pre_model = json.load(open(replication / "pretrain" / "model.json"))
  ft_model = json.load(open(replication / "ft_gamma0.5_seed0" / "model.json"))
  assert pre_model["text_context"] == 32 and ft_model["text_context"] == 68
  assert set(res["geometry"]) == {"geometry_pretrained", "geometry_finetuned_gamma0.0", "geometry_finetuned_gamma0.5"}
  for name, g in res["geometry"].items():
    assert g == json.load(open(replication / name / "summary.json")) and g["text_context"] == 68

  assert all(len(v) == 2 for v in res["by_gamma"]["0.5"].values())  # mean, std (over seeds: the test below)
  # --frameworks finelip:reduction=mean: FineLIP runs from the same start with config.finelip.reduction="mean" (what
  # the run's checkpoint records: replicate passed the setting), their rows in results.json and the table. (What
  # the setting does to the hinge: tests/test_frameworks.py.)
  assert set(res["frameworks"]) == {f"finelip:reduction=mean_gamma{g}" for g in (0.0, 0.5)}
  w = replication / "ft_fw_finelip_reduction-mean_gamma0.5_seed0"
  meta = json.load(open(w / "checkpoints" / "4" / "meta" / "metadata"))
  assert meta["config"]["framework"] == "finelip" and meta["config"]["finelip"]["reduction"] == "mean", meta["config"]
  assert any("loss/fine" in r for r in map(json.loads, open(w / "metrics.jsonl")))
  assert "| 0.5, framework finelip:reduction=mean |" in open(replication / "table.md").read()
  assert dict(json.load(open(w / "model.json"))["part_settings"])["tokens"] == 39
  # --token_groups 4: the token term's cost option next to the whole term, same start and seeds.
  assert set(res["token_cost"]) == {"full", "group4"}
  table = open(replication / "table.md").read()
  for c in ("full", "group4"):
    w = replication / ("ft_tok1.0_gamma0.5_seed0" if c == "full" else f"ft_tok1.0_{c}_gamma0.5_seed0")
    assert res["token_cost"][c]["t2i/R@1"][0] == load_replicate().final_recall(str(w))["t2i/R@1"]
    assert f"| 0.5, token term λ=1, {c} |" in table
  # The same first batch from the same start: 3 negatives per example instead of 15 lower the token term's first
  # value.
  first = lambda c: next(r for r in map(json.loads, open(replication / f"ft_tok1.0{c}_gamma0.5_seed0" /
                                                            "metrics.jsonl")) if "loss/tok" in r)["loss/tok"]
  assert first("_group4") < first("")
  # Telemetry only where results.json reads it: the γ and frozen-scale runs log it, the others do not.
  for w in ("ft_tok1.0_gamma0.5_seed0", "ft_dora_detached_gamma0.5_seed0", "ft_gamma0.5_20pct_seed0",
            "ft_fw_finelip_reduction-mean_gamma0.0_seed0", "longclip"):
    assert not any(k.startswith("diag/") for r in map(json.loads, open(replication / w / "metrics.jsonl")) for k in r), w
  assert any("diag/grad_cosine" in r for r in map(json.loads, open(replication / "ft_frozenscale_gamma0.5_seed0" /
                                                                    "metrics.jsonl")))
  for name in ("table.md", "recall_vs_gamma.png", "saturation.png", "fig4_saturation_per_epoch.png",
               "fig6_data_efficiency.png"):
    assert os.path.getsize(replication / name) > 0
  rows = [json.loads(line) for line in open(replication / "ft_gamma0.5_seed0" / "metrics.jsonl")]
  logged = [r for r in rows if "diag/hn/saturated_frac" in r]
  assert len(logged) == 4 and all("diag/G_offdiag_mean" in r for r in logged)
  # Fig. 4's example share: per epoch (8 steps of 16 out of 128 here, so one), the mean of the logged shares.
  assert res["saturation"]["0.5"]["examples_below_1e-3"] == {
      "1": pytest.approx(float(np.mean([r["diag/hn/saturated_frac"] for r in logged])))}
  # results.json carries every telemetry number the docs quote, equal to what the run logged.
  tel = res["saturation"]["0.5"]["telemetry"]
  assert tel["logged_batches"] == 4
  assert tel["diag/G_offdiag_mean_median"] == pytest.approx(float(np.median([r["diag/G_offdiag_mean"] for r in logged])))
  assert tel["last_logged_loss"] == logged[-1]["diag/hn/loss"]
  assert tel["first_logged"] == {k: pytest.approx(float(logged[0][k])) for k in
                                 ("step", "diag/hn/loss", "diag/G_offdiag_mean", "diag/hardest_negative_sim")}
  compared = [r for r in rows if "diag/grad_cosine" in r]
  assert [r["step"] for r in compared] == [2, 4]
  lo, hi = res["saturation"]["0.5"]["grad_cosine_range"]
  assert (lo, hi) == (min(r["diag/grad_cosine"] for r in compared), max(r["diag/grad_cosine"] for r in compared))
  for r in compared:  # the comparison's HN gradient is the train step's gradient on the same batch
    assert r["diag/hn/param_grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
    assert -1 <= r["diag/grad_cosine"] <= 1


def test_replicate_refuses_a_framework_setting_it_does_not_know(tmp_path):
  """--frameworks NAME:KEY=VALUE: KEY must be one of config.NAME's settings, checked before anything runs."""
  for spec, match in (("finelip:reductio=mean", r"'finelip:reductio=mean'.*config.finelip's settings.*'reduction'"),
                      ("finelip:reduction", r"expected NAME or NAME:KEY=VALUE")):
    argv, sys.argv = sys.argv, ["benchmarks/replicate.py", "--quick", "--out", str(tmp_path / "r"), "--regime",
                                "three_stage", "--frameworks", spec]
    try:
      with pytest.raises(SystemExit, match=match):
        load_replicate().main()
    finally:
      sys.argv = argv
    assert os.listdir(tmp_path / "r") == []


def test_replication_summaries_over_seeds_and_epochs_match_numpy(tmp_path):
  """replicate.py's arithmetic on hand-written metrics.jsonl files: mean and std over seeds of the final eval row,
  per-epoch shares and means of logged telemetry (the smoke run above has one seed and one epoch)."""
  rep = load_replicate()
  r = np.random.default_rng(0)
  finals, dirs = [], []
  for seed in range(3):
    w = tmp_path / f"seed{seed}"
    w.mkdir()
    recall = {f"eval/{d}/R@{k}": float(r.uniform(0, 100)) for d in ("t2i", "i2t") for k in (1, 5, 10)}
    early = {k: v / 2 for k, v in recall.items()}  # an earlier eval row: only the last one counts
    logs = [{"step": s, "diag/hn/loss": float(r.uniform(0, 2e-3)), "diag/hn/saturated_frac": float(r.uniform())}
            for s in range(1, 9)]
    with open(w / "metrics.jsonl", "w") as f:
      for row in [*logs[:4], {"step": 4, **early}, *logs[4:], {"step": 8, **recall}]:
        f.write(json.dumps(row) + "\n")
    finals.append(recall)
    dirs.append(str(w))
  got = rep.mean_std(dirs)
  for k in ("t2i/R@1", "i2t/R@10"):
    vals = np.array([f[f"eval/{k}"] for f in finals], np.float64)
    np.testing.assert_allclose(got[k], [vals.mean(), np.sqrt(((vals - vals.mean()) ** 2).mean())], rtol=1e-12)
  rows = [json.loads(line) for line in open(tmp_path / "seed0" / "metrics.jsonl") if "diag/hn/loss" in line]
  losses_ = np.array([row["diag/hn/loss"] for row in rows])
  fracs = np.array([row["diag/hn/saturated_frac"] for row in rows])
  # 3 steps per epoch: steps 1-3, 4-6, 7-8
  assert rep.per_epoch(dirs[0], 3, "diag/hn/loss", lambda v: v < 1e-3) == pytest.approx(
      {1: np.mean(losses_[:3] < 1e-3), 2: np.mean(losses_[3:6] < 1e-3), 3: np.mean(losses_[6:] < 1e-3)})
  assert rep.per_epoch_mean(dirs[0], 3, "diag/hn/saturated_frac") == pytest.approx(
      {1: fracs[:3].mean(), 2: fracs[3:6].mean(), 3: fracs[6:].mean()})
  # Fig. 4 over seeds: each key's per-epoch share averaged over the seeds
  per_seed = [{k: {1: float(r.uniform()), 2: float(r.uniform())} for k in rep.PER_SEED} for _ in range(3)]
  mean = rep.over_seeds(per_seed)
  for k in rep.PER_SEED:
    assert mean[k] == pytest.approx({e: np.mean([p[k][e] for p in per_seed]) for e in (1, 2)}, rel=1e-12)
  # paired differences over the seeds: run b minus run a per seed, the mean and its 95% Student-t interval
  # (t_{0.975, 2} = 4.302652729911275 from the table)
  got = rep.paired(dirs[:2] + dirs[2:], dirs[1:] + dirs[:1])
  for k in ("t2i/R@1", "i2t/R@5"):
    d = np.array([finals[(i + 1) % 3][f"eval/{k}"] - finals[i][f"eval/{k}"] for i in range(3)])
    half = 4.302652729911275 * d.std(ddof=1) / np.sqrt(3)
    assert got[k]["per_seed"] == pytest.approx(list(d), abs=1e-9)
    assert got[k]["mean"] == pytest.approx(d.mean(), abs=1e-9)
    assert got[k]["ci95"] == pytest.approx([d.mean() - half, d.mean() + half], rel=1e-9)


def test_caption_geometry_report(tmp_path, tfds_dir):
  """The report of a short-caption start (a few steps of configs/two_stage.py:pretrain, as replicate.py trains it),
  on the dense captions, against NumPy."""
  start, out = tmp_path / "pretrain", tmp_path / "geometry"
  run_py(["train.py", "--config", "configs/two_stage.py:pretrain,test", f"--config.data.data_dir={tfds_dir}",
          "--workdir", str(start), "--config.loss.gamma=0", "--config.total_steps=4", "--config.eval_every=4",
          "--config.checkpoint_every=4", "--config.log_every=2"])
  run_py(["-m", "hnclip_jax.tools.caption_geometry", "--config", "configs/two_stage.py:finetune,test",
          f"--config.data.data_dir={tfds_dir}", "--init_from", str(start), "--split", "test", "--out", str(out)])
  summary = json.load(open(out / "summary.json"))
  assert summary["num_captions"] == 40 and summary["batch_size"] == 16
  # Against NumPy on the same encoder (stretched to the fine-tuning context, as train.py would start from it):
  # the exact mean over all pairs (the tool's comes from 0.01-wide histogram bins) and the hardest negatives.
  from hnclip_jax import pretrained
  from hnclip_jax.data import builders, pipeline
  import ml_collections
  data = ml_collections.ConfigDict(dict(name="synthetic", data_dir=tfds_dir, train_split="train", eval_split="test",
                                        manual_dir="", on_bad_example="error", num_train=128, num_test=40,
                                        group_size=4, image_size=32, seed=0, captions="dense"))
  caps = pipeline.read_captions(builders.data_source(data, "test", decode_images=False))
  emb = pretrained.load(str(start)).with_text_context(68).encode_texts(caps).astype(np.float64)
  sims = emb @ emb.T
  off = sims[~np.eye(len(caps), dtype=bool)]
  assert summary["mean_pairwise_similarity"] == pytest.approx(off.mean(), abs=0.006)
  np.fill_diagonal(sims, -np.inf)
  assert summary["mean_hardest_negative_similarity"] == pytest.approx(sims.max(1).mean(), abs=1e-4)
  assert -1 <= summary["mean_pairwise_similarity"] <= summary["mean_hardest_negative_similarity"] <= 1
  assert sum(summary["batch_negative_share_by_similarity"].values()) == pytest.approx(1.0)
  for name in ("pairwise_similarity.png", "hardest_negative.png", "batch_G.png"):
    assert os.path.getsize(out / name) > 1000


def test_telemetry_and_gradient_comparison_honour_accumulation():
  """With grad_accum_steps = 2 (global-batch negatives) the telemetry and the gradient comparison run a
  micro-batch at a time through the train step's own paths and give the un-accumulated numbers; the token term
  is included in both objectives."""
  from hnclip_jax import sharding
  from hnclip_jax.models import CLIPConfig, init_params
  cfg = CLIPConfig(embed_dim=16, image_size=16, patch_size=8, vision_width=32, vision_layers=1, vision_heads=4,
                   vision_mlp_dim=64, text_context=8, vocab_size=64, text_width=32, text_layers=1, text_heads=4,
                   text_mlp_dim=64, eot_token_id=3)
  graphdef, params = init_params(cfg, 0)
  r = np.random.default_rng(0)
  tokens = np.concatenate([np.full((8, 1), 2), r.integers(4, 64, (8, 6)), np.full((8, 1), 3)], 1).astype(np.int32)
  batch = {"image": r.normal(size=(8, 16, 16, 3)).astype(np.float32), "tokens": tokens}
  psh = jax.tree.map(lambda _: sharding.replicated(MESH), params)
  obj = Objective.of(gamma=0.5, token_weight=1.0)
  got = {}
  for accum in (1, 2):
    d = diagnostics.make_batch_diagnostics(graphdef, MESH, obj, accum, "global_batch")(params, batch)
    c = diagnostics.make_gradient_comparison(graphdef, MESH, obj, psh, accum, "global_batch")(params, batch)
    got[accum] = {k: float(v) for k, v in {**d, **c}.items()}
  assert got[1].keys() == got[2].keys() and "diag/grad_cosine" in got[1]
  for k in got[1]:
    assert got[2][k] == pytest.approx(got[1][k], rel=1e-5, abs=1e-7), k
  assert got[1]["diag/hn/loss"] > got[1]["diag/infonce/loss"]  # γ = 0.5 vs 0 on the same outputs
