"""Mesh layouts on 8 fake CPU devices: loss and gradients equal the single-device ones; memory stays per-row."""
import json
import types

import ml_collections
import pytest

from hnclip_jax import config as config_lib, sharding
from conftest import assert_error_exit, run_py


_RESULTS = {}


def section(name):
  """The measurements of one section of tests/sharded_checks.py (a fresh 8-device process, run once per test
  process). Each section's tests form one xdist group, so the sections spread over the suite's workers."""
  if name not in _RESULTS:
    proc = run_py(["tests/sharded_checks.py", name], devices=8, timeout=1500)
    _RESULTS[name] = json.loads(proc.stdout.split("RESULT ", 1)[1])
  return _RESULTS[name]


def group(name):
  return pytest.mark.xdist_group(f"sharded_checks.{name}")


@group("core")
def test_every_layout_matches_one_device():
  checks = section("core")
  assert set(checks["layouts"]) == {"(8, 1, 1)", "(2, 4, 1)", "(1, 8, 1)", "(2, 2, 2)", "(4, 1, 2)"}
  for layout, r in checks["layouts"].items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (layout, r)


@group("controls")
def test_margin_controls_and_hn_nce_every_layout_match_one_device():
  """Issue 55's controls as settings of the global term (constant margin — the batch's mean Ḡ or a fixed c —,
  shuffled, top-k) and HN-NCE, on the model's outputs: (2, 2, 2) and 4 devices with 1-row chunks give the one-device
  loss and gradients, and each changes the loss; so does the sigmoid form (ring and gather); top-k also through the
  towers with global-batch accumulation."""
  checks = section("controls")
  assert len(checks["controls"]) == 6 * 2 + 4 + 1
  for name, r in checks["controls"].items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (name, r)
  for name, d in checks["controls_differ"].items():
    assert d > 1e-4, (name, d)


@group("token")
def test_token_term_every_layout_matches_one_device():
  """The full objective (λ = 1): through the towers on (8, 1, 1), (2, 2, 2) and with global-batch accumulation; on
  the model's outputs on (2, 4, 1), (1, 8, 1), (4, 1, 2) and with 1-row chunks — each the one-device loss and
  gradients."""
  checks = section("token")
  assert checks["token_term_differs"] > 1e-2  # λ = 1 really adds a term
  assert len(checks["token_layouts"]) == 7
  for layout, r in checks["token_layouts"].items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (layout, r)


@group("token")
def test_token_groups_match_one_device():
  """config.loss.token_group=2 with the margin on the token logits, on the model's outputs: the one-device loss and
  gradients on layouts with 2 and 4 rows per device, with 1-row chunks and micro-batch negatives; the groups change
  the term."""
  checks = section("token")
  assert checks["token_group_differs"] > 1e-3
  assert len(checks["token_group_layouts"]) == 4
  for layout, r in checks["token_group_layouts"].items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (layout, r)


@group("token")
def test_token_keep_matches_one_device():
  """config.loss.token_keep=0.5 (half of each example's tokens, chosen before anything is sent): the one-device loss
  and gradients with the gather and the ring schedule and with accumulation; the selection changes the term."""
  checks = section("token")
  assert checks["token_keep_differs"] > 1e-3
  assert len(checks["token_keep_layouts"]) == 3
  for layout, r in checks["token_keep_layouts"].items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (layout, r)


@group("ring")
def test_ring_schedule_every_layout_matches_one_device():
  """config.loss.token_schedule="ring": caption-token tiles passed around the batch axes (its own custom VJP sends
  them around again in the backward pass) give the one-device loss and gradients on every layout, with 1-row chunks
  and micro-batch negatives (on the model's outputs), and through the towers with global-batch accumulation."""
  checks = section("ring")
  assert set(checks["ring_layouts"]) >= {"(8, 1, 1)", "(2, 4, 1)", "(1, 8, 1)", "(2, 2, 2)", "(4, 1, 2)"}
  assert len(checks["ring_layouts"]) == 8
  for layout, r in checks["ring_layouts"].items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (layout, r)


@group("ring")
def test_ring_schedule_holds_no_caption_tokens_that_grow_with_the_global_batch():
  """Compiled value and gradient at 32 rows per device, global batch 128 (4 devices) and 256 (8 devices): under
  "gather" the largest caption-token buffer is the whole batch's [B, L, E]; under "ring" it is one tile [n, L, E]
  at both sizes, and the program passes tiles with collective-permutes."""
  m = section("ring")["ring_memory"]
  for devices in (4, 8):
    g, r = m[f"gather/{devices}"], m[f"ring/{devices}"]
    assert g["largest_token_buffer"] == g["global_batch"] * g["L"] * g["E"]
    assert r["largest_token_buffer"] == r["rows"] * r["L"] * r["E"] and r["collective_permutes"] > 0
  assert m["ring/4"]["largest_token_buffer"] == m["ring/8"]["largest_token_buffer"]


@group("sigmoid")
def test_sigmoid_loss_every_layout_matches_one_device():
  """HN-SigLIP (config.loss.kind="sigmoid") on a SigLIP-family model: through the towers with the ring schedule and
  global-batch accumulation (t, b and both towers' gradients); on the model's outputs the ring schedule on the five
  layouts, the gather schedule on two, 1-row chunks and micro-batch negatives — each the one-device loss and
  gradients; the margin changes the loss and b gets a gradient."""
  checks = section("sigmoid")
  assert checks["sigmoid_margin_differs"] > 1e-3 and checks["sigmoid_bias_grad"] > 1e-3
  assert {f"ring {s}" for s in ("(8, 1, 1)", "(2, 4, 1)", "(1, 8, 1)", "(2, 2, 2)", "(4, 1, 2)")} <= set(
      checks["sigmoid_layouts"])
  assert len(checks["sigmoid_layouts"]) == 10
  for layout, r in checks["sigmoid_layouts"].items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (layout, r)


@group("sigmoid")
def test_sigmoid_loss_holds_no_bxb_logits_and_the_ring_no_gathered_captions():
  """Compiled value and gradient at B = 1024 on 8 devices: neither schedule holds [B, B] logits; "gather" holds the
  [B, D] captions, "ring" at most one device's [B/8, D] chunk, passed with collective-permutes."""
  m = section("sigmoid")["sigmoid_memory"]
  assert not m["gather"]["has_BxB"] and not m["ring"]["has_BxB"]
  assert m["gather"]["largest_emb_rows"] == m["gather"]["B"]
  assert m["ring"]["largest_emb_rows"] == m["ring"]["B"] // 8 and m["ring"]["collective_permutes"] > 0


@group("memory")
def test_token_term_never_materialises_the_pairwise_token_tensor():
  checks = section("memory")
  m = checks["token_memory"]
  # Blocks of TOKEN_BLOCK rows x TOKEN_BLOCK columns x P x L are the largest thing alive ...
  assert m["largest_buffer"] <= m["block"] < m["nxBxPxL"] < m["BxBxPxL"], m


@group("core")
def test_parameters_follow_the_logical_rules():
  checks = section("core")
  assert checks["specs"] == {"q_kernel": "P('fsdp', 'tensor')", "out_kernel": "P('tensor', 'fsdp')",
                             "fc1_kernel": "P('fsdp', 'tensor')", "fc2_kernel": "P('tensor', 'fsdp')",
                             "ln1_scale": "P(None,)", "token_embedding": "P('tensor', 'fsdp')", "logit_scale": "P()"}
  assert checks["opt_mu_q_kernel"] == "P('fsdp', 'tensor')" and checks["opt_count"] == "P()"


@group("adapters")
def test_adapters_every_layout_matches_one_device():
  """DoRA (every adapter leaf) with the token term on (8, 1, 1), (2, 2, 2) and with accumulation, LoRA on
  (2, 2, 2): loss and every gradient (adapters and base) equal one device's; adapter matrices split like the kernels
  they adapt. DoRA on the other three layouts: test_adapters_other_layouts_match_one_device (`-m long`)."""
  checks = section("adapters")
  a = checks["adapters"]
  runs = {k: v for k, v in a.items() if "specs" not in k}
  assert len(runs) == 4 and sum(k.startswith("dora") for k in runs) == 3
  for name, r in runs.items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (name, r)
  for method in ("lora", "dora"):
    assert a[f"{method} specs"] == {"q_lora_a": "P('fsdp', None)", "q_lora_b": "P(None, 'tensor')",
                                    "fc2_lora_a": "P('tensor', None)"}


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
@group("adapters_layouts")
def test_adapters_other_layouts_match_one_device():
  """DoRA with the token term on (2, 4, 1), (1, 8, 1) and (4, 1, 2): the one-device loss and gradients."""
  runs = section("adapters_layouts")["adapters"]
  assert sorted(runs) == ["dora (1, 8, 1)", "dora (2, 4, 1)", "dora (4, 1, 2)"]
  for name, r in runs.items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (name, r)


@group("finelip")
def test_finelip_every_layout_matches_one_device():
  """FineLIP (L_HN + the late-interaction hinge on aggregated tokens, γ·Ḡ on its negatives): the layouts
  that run different code for it (sharded_checks.VARIANTS), global-batch accumulation and 1-row chunks give one
  device's loss and gradients; the aggregators (replicated) get a gradient."""
  checks = section("finelip")
  f = checks["finelip_layouts"]
  runs = {k: v for k, v in f.items() if k != "aggregator spec"}
  assert checks["finelip_differs"] > 1e-2 and len(runs) == 4
  for name, r in runs.items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5 and r["aggregator_grad"] > 0, (name, r)
  assert f["aggregator spec"] == "P(None, None)"


@group("memory")
def test_finelip_hinge_never_materialises_the_pairwise_token_tensor():
  checks = section("memory")
  m = checks["finelip_memory"]
  assert m["largest_buffer"] <= m["block"] < m["nxBxTxT"] < m["BxBxTxT"], m


@group("goal")
def test_goal_every_layout_matches_one_device():
  """GOAL (L_HN + segment InfoNCE with γ·Ḡ of the sentences + patch and span alignments; rows without a segment,
  a box covering no patch, a sentence not in its caption): the layouts of sharded_checks.VARIANTS, global-batch
  accumulation and 1-row chunks give one device's loss and gradients."""
  checks = section("goal")
  g = checks["goal_layouts"]
  assert checks["goal_differs"] > 1e-2 and len(g) == 4
  for name, r in g.items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (name, r)


@group("structxlip")
def test_structxlip_every_layout_matches_one_device():
  """StructXLIP (L_HN + structure InfoNCE with γ·Ḡ + consistency + the local chunk-vs-crop term; rows without
  crops or chunks): the layouts of sharded_checks.VARIANTS, global-batch accumulation and 1-row chunks give one
  device's loss and gradients."""
  checks = section("structxlip")
  x = checks["structxlip_layouts"]
  assert checks["structxlip_differs"] > 1e-2 and len(x) == 4
  for name, r in x.items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (name, r)


@group("memory")
def test_structxlip_local_term_stays_per_row():
  checks = section("memory")
  m = checks["structxlip_memory"]
  assert m["largest_buffer"] <= m["rows"] < m["full"], m


@group("core")
def test_gradient_accumulation():
  checks = section("core")
  assert len(checks["accum"]) == 3
  for name, r in checks["accum"].items():  # global-batch negatives: identical to no accumulation
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (name, r)
  assert checks["micro_batch_loss_rel"] <= 1e-5  # micro-batch negatives: mean of per-micro-batch losses
  assert checks["micro_batch_differs_from_global"] > 1e-3


@group("core")
def test_chunked_loss_matches():
  checks = section("core")
  assert checks["chunked"]["loss_rel"] <= 1e-5 and checks["chunked"]["grad_rel"] <= 1e-5


@group("memory")
def test_no_device_holds_the_full_logits():
  checks = section("memory")
  mem = checks["memory"]
  for key, m in mem.items():
    assert not m["has_full"] and m["has_rows"], key
  # Unchunked: memory ~ n_local × B, so doubling B (and n_local) roughly quadruples it ...
  assert 3.0 < mem["0/4096"]["temp"] / mem["0/2048"]["temp"] < 4.5
  # ... and stays well below one B×B fp32 matrix per device.
  assert mem["0/4096"]["temp"] < 0.95 * 4096 * 4096 * 4
  # Row-chunked: memory ~ chunk × B, linear in B.
  assert 1.8 < mem["32/4096"]["temp"] / mem["32/2048"]["temp"] < 2.2
  assert mem["32/4096"]["temp"] < mem["0/4096"]["temp"] / 4


def test_mesh_shape_resolution_and_errors():
  cfg = lambda d, f, t: ml_collections.ConfigDict({"data": d, "fsdp": f, "tensor": t})
  assert sharding.mesh_shape(cfg(-1, 2, 1), 8) == (4, 2, 1)
  assert sharding.mesh_shape(cfg(2, 2, 2), 8) == (2, 2, 2)
  with pytest.raises(ValueError, match="multiplies to 4 but there are 8 devices"):
    sharding.mesh_shape(cfg(2, 2, 1), 8)
  with pytest.raises(ValueError, match="fixed axes multiply to 3"):
    sharding.mesh_shape(cfg(-1, 3, 1), 8)
  with pytest.raises(ValueError, match="'embed' to 'model'"):
    sharding.parse_rules("embed=model")


def test_hybrid_mesh_granules_and_errors():
  """config.mesh.dcn: the slow network's granules are TPU slices (devices with slice_index) or else processes; a DCN
  axis needs more than one granule, equal granules, and sizes that multiply to their count. (Meshes that span real
  processes: tests/test_multihost.py.)"""
  dev = lambda i, proc, sl=None, platform="cpu": types.SimpleNamespace(  # noqa: E731
      id=i, process_index=proc, platform=platform, **({} if sl is None else {"slice_index": sl}))
  cfg = lambda dcn, ici=(1, 2, 2): ml_collections.ConfigDict(  # noqa: E731
      {**dict(zip(sharding.MESH_AXES, ici)), "dcn": dict(zip(sharding.MESH_AXES, dcn))})
  tpu = [dev(i, i // 2, i // 4, "tpu") for i in range(8)]  # 2 slices of 2 hosts each
  kind, groups = sharding.granules(tpu)
  assert kind == "slice" and [[d.id for d in g] for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  kind, groups = sharding.granules([dev(i, i // 4) for i in range(8)])
  assert kind == "process" and len(groups) == 2
  one = [dev(i, 0) for i in range(8)]
  with pytest.raises(ValueError, match=r"all 8 devices are in one process: there is no slow network to cross"):
    sharding.make_mesh(cfg((2, 1, 1)), one)
  with pytest.raises(ValueError, match=r"all 8 devices are in one slice"):
    sharding.make_mesh(cfg((2, 1, 1)), [dev(i, i // 4, platform="tpu") for i in range(8)])  # 2 hosts, 1 slice
  with pytest.raises(ValueError, match=r"config.mesh.dcn \{'data': 4, 'fsdp': 1, 'tensor': 1\} multiplies to 4 "
                                       r"but there are 2 processes"):
    sharding.make_mesh(cfg((4, 1, 1)), [dev(i, i // 4) for i in range(8)])
  with pytest.raises(ValueError, match=r"config.mesh \(sizes inside one process\) .* multiplies to 2 but there are "
                                       r"4 devices per process"):
    sharding.make_mesh(cfg((2, 1, 1), (1, 2, 1)), [dev(i, i // 4) for i in range(8)])
  with pytest.raises(ValueError, match=r"hold different numbers of devices \(\[3, 5\]\)"):
    sharding.make_mesh(cfg((2, 1, 1)), [dev(i, int(i >= 3)) for i in range(8)])
  with pytest.raises(ValueError, match=r"config.mesh.dcn \(data, fsdp, tensor\) = \(0, 1, 1\)"):
    config = config_lib.base_config()
    config.mesh.dcn.data = 0
    config_lib.validate(config)


@pytest.mark.parametrize("override,message", [
    (["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=1"], "multiplies to 4 but there are 8"),
    (["--config.mesh.data=1", "--config.mesh.tensor=8", "--config.mesh.fsdp=1", "--config.batch_size=16"],
     "config.model.vision_heads=2 cannot be split over mesh axis 'tensor' of size 8"),
    (["--config.mesh.data=8", "--config.batch_size=20"], "config.batch_size=20 is not divisible by the 8"),
    (["--config.grad_accum_steps=3"], "divisible by config.grad_accum_steps=3"),
])
def test_layout_errors_before_compiling(tmp_path, override, message):
  proc = run_py(["train.py", "--config", "configs/demo.py:test", "--workdir", str(tmp_path), *override],
                devices=8, check=False)
  assert_error_exit(proc, message)


@group("plugin")
def test_framework_from_outside_the_package_every_layout_matches_one_device():
  """tests/plugins/patch_align.py (a framework no line of hnclip_jax names: its own per-example input, a model
  output it makes from the image tower, and its term): the layouts of sharded_checks.VARIANTS (like the package's
  frameworks: how the other layouts split the towers' parameters is `core`'s), global-batch accumulation and 1-row
  chunks give the one-device loss and gradients."""
  checks = section("plugin")
  assert checks["plugin_differs"] > 1e-2  # its term really changes the loss
  assert len(checks["plugin_layouts"]) == 4
  assert {k.split(" {")[0] for k in checks["plugin_layouts"]} == {"(8, 1, 1)", "(2, 2, 2)", "(4, 1, 1)"}
  for layout, r in checks["plugin_layouts"].items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (layout, r)
