"""tools/compile_for: train.py's step compiled for a TPU topology on this CPU host (libtpu, no TPU)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, assert_error_exit, run_py
from hnclip_jax import experiment
from hnclip_jax.tools import compile_for

# libtpu (the TPU compiler; the version jax[tpu]==0.10.2 pins) is installed here with pip --target on first use,
# outside the test environment: a libtpu next to a CPU-only jax makes every process print TPU initialisation
# errors, so only the compile subprocess sees it.
LIBTPU_DIR = os.environ.get("HNCLIP_LIBTPU_DIR", os.path.expanduser("~/.cache/hnclip_jax/libtpu"))
LIBTPU = "libtpu==0.0.42.1"
# JAX's CUDA plugin (the GPU compiler; no CUDA libraries or GPU needed to compile), installed the same way.
CUDA_DIR = os.environ.get("HNCLIP_CUDA_PLUGIN_DIR", os.path.expanduser("~/.cache/hnclip_jax/cuda"))
CUDA_PLUGIN = ["jax-cuda12-plugin==0.10.2", "jax-cuda12-pjrt==0.10.2"]


def libtpu_path():
  """A PYTHONPATH entry holding libtpu ("" if it is importable already), installing it if needed; None if it
  cannot be installed."""
  if importlib.util.find_spec("libtpu") is not None:
    return ""
  if not os.path.isdir(os.path.join(LIBTPU_DIR, "libtpu")):
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", LIBTPU_DIR, LIBTPU],
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
      return None
  return LIBTPU_DIR


def cuda_plugin_path():
  """A PYTHONPATH entry holding JAX's CUDA plugin, installing it if needed; None if it cannot be installed."""
  if not os.path.isdir(os.path.join(CUDA_DIR, "jax_plugins", "xla_cuda12")):
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", CUDA_DIR,
                           *CUDA_PLUGIN], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
      return None
  return CUDA_DIR

HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%inner (q: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %q = (s32[], f32[8,4]) parameter(0)
  %rs = bf16[2,4]{1,0} reduce-scatter(bf16[8,4]{1,0} %z), channel_id=3, dimensions={0}, to_apply=%add
  %d1 = f32[8,16]{1,0} dot(f32[8,4]{1,0} %x, f32[4,16]{1,0} %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t2 = (s32[], f32[8,4]) tuple(%i, %x)
}

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]) parameter(0)
  %ag = f32[32,4]{1,0} all-gather(f32[8,4]{1,0} %x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %w2 = (s32[], f32[8,4]) while((s32[], f32[8,4]) %p), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (s32[], f32[8,4]) tuple(%i, %x)
}

%fused_mm (a: bf16[2,3,7], b: bf16[2,7,5]) -> bf16[2,3,5] {
  %a = bf16[2,3,7]{2,1,0} parameter(0)
  %b = bf16[2,7,5]{2,1,0} parameter(1)
  ROOT %d2 = bf16[2,3,5]{2,1,0} dot(bf16[2,3,7]{2,1,0} %a, bf16[2,7,5]{2,1,0} %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%cond (c: (s32[], f32[8,4])) -> pred[] {
  %c = (s32[], f32[8,4]) parameter(0)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

ENTRY %main (a: f32[8,4]) -> f32[16] {
  %w = (s32[], f32[8,4]) while((s32[], f32[8,4]) %t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
  %ar = (f32[16]{0}, f32[4]{0}) all-reduce-start(f32[16]{0} %y, f32[4]{0} %v), channel_id=2, to_apply=%add
  %ard = (f32[16]{0}, f32[4]{0}) all-reduce-done((f32[16]{0}, f32[4]{0}) %ar)
  %f = bf16[2,3,5]{2,1,0} fusion(bf16[2,3,7]{2,1,0} %p0, bf16[2,7,5]{2,1,0} %p1), kind=kOutput, calls=%fused_mm
  %ags = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(bf16[4,8]{1,0} %u), channel_id=4, dimensions={0}
  %agd = bf16[16,8]{1,0} all-gather-done((bf16[4,8]{1,0}, bf16[16,8]{1,0}) %ags)
  ROOT %r = f32[16]{0} copy(%ard)
}
"""


def test_matmul_flops_are_counted_per_executed_step():
  """A dot in a loop nested 8 x 3 deep runs 24 times (2 x 8x16 outputs x 4 contracted each); a batched dot in a
  fusion called once from the entry computation counts once (2 x 30 outputs x 7)."""
  assert compile_for.matmul_flops(HLO) == 24 * 2 * 8 * 16 * 4 + 2 * 2 * 3 * 5 * 7


def test_the_counter_counts_every_iteration_of_compiled_cpu_programs():
  """What the CPU benchmarks report (benchmarks/common.py: matmul_flops): a scan of 64 matmuls of 256³ is 64 x
  2 x 256³ FLOPs, and the token term's forward, tiled by scans of [block, block] pairs, is its formula 2·n·B·P·L·E
  (XLA's cost analysis counts a loop body once: its numbers are not the step's)."""
  import jax
  import jax.numpy as jnp
  from hnclip_jax import losses
  x = jnp.ones((256, 256), jnp.float32)
  scan = jax.jit(lambda w: jax.lax.scan(lambda c, _: (c @ w, None), w, None, length=64)[0]).lower(x).compile()
  assert compile_for.matmul_flops(scan.as_text()) == 64 * 2 * 256 ** 3
  n, p, l, e = 64, 16, 12, 8
  r = jax.random.split(jax.random.key(0), 2)
  img, txt = jax.random.normal(r[0], (n, p, e)), jax.random.normal(r[1], (n, l, e))
  fwd = jax.jit(lambda i, t: losses.token_rows(i, t, jnp.ones((n, l), bool), jnp.float32(10.0), 0, block=16))
  assert compile_for.matmul_flops(fwd.lower(img, txt).compile().as_text()) == 2 * n * n * p * l * e


# TPU's optimised HLO prints no known_trip_count: the loop bound is read from the condition (counter < constant).
TPU_COND = """
%tcond (c: (s32[], f32[8,4])) -> pred[] {
  %constant.7 = s32[]{:T(128)} constant(8)
  %c = (s32[], f32[8,4]) parameter(0)
  %gte = s32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt.1 = pred[]{:T(512)} compare(%gte, %constant.7), direction=LT, backend_config={"flag_configs":[]}
}
"""
OUTER = 'condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}'


# Batched matmuls as TPU writes them: convolutions whose "spatial" dims are batch dims. (a) The window as large as
# the lhs dilation (each output meets one real element per window); (b) a window over a padded input of extent 1.
TPU_CONVS = """
ENTRY %main (a: f32[8,4]) -> f32[16] {
  %lhs = f32[2,3,4,1]{3,2,1,0} parameter(0)
  %rhs = f32[1,6,4,5]{3,2,1,0} parameter(1)
  %cv = f32[2,3,5,6]{3,2,1,0} convolution(%lhs, %rhs), window={size=1x5 pad=0_0x4_4 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
  %dl = bf16[64,2,77,16]{2,3,1,0} convolution(bf16[1,1,7,64]{3,2,1,0} %p, bf16[64,2,7,16]{3,2,1,0} %q), window={size=64x2 stride=63x1 lhs_dilate=64x2}, dim_labels=01bf_01io->01bf
  ROOT %r = f32[16]{0} copy(%x)
}
"""


def test_tpu_batched_matmul_convolutions_count_only_real_elements():
  """(a) 2 x 180 outputs x 4 features (one real element under the 1x5 window: counting the whole window gave 5x);
  (b) 2 x 64·2·77·16 outputs x 64 features (window 64x2 = the lhs dilation: one element)."""
  assert compile_for.matmul_flops(TPU_CONVS) == 2 * (2 * 3 * 5 * 6) * 4 + 2 * (64 * 2 * 77 * 16) * 64


def test_tpu_loops_without_a_known_trip_count_use_their_condition_bound():
  assert OUTER in HLO
  tpu = TPU_COND + HLO.replace(OUTER, "condition=%tcond, body=%body")
  assert compile_for.matmul_flops(tpu) == compile_for.matmul_flops(HLO)
  assert compile_for.collective_stats(tpu) == compile_for.collective_stats(HLO)
  unknown = HLO.replace(OUTER, "condition=%cond, body=%body")  # `i < n` with n not a constant: counted once
  assert compile_for.matmul_flops(unknown) == 3 * 2 * 8 * 16 * 4 + 2 * 2 * 3 * 5 * 7


# What XLA's rematerialisation pass leaves in a program that did not fit: clones named "<original>.remat" — here a
# fusion (its own copy of the fused computation) in the 8-iteration loop body and a dot in the entry computation.
REMAT = HLO.replace(
    "  ROOT %t = (s32[], f32[8,4]) tuple(%i, %x)\n}\n\n%fused_mm",
    "  %f.remat = bf16[2,3,5]{2,1,0} fusion(bf16[2,3,7]{2,1,0} %p0, bf16[2,7,5]{2,1,0} %p1), kind=kOutput, "
    "calls=%fused_mm.clone\n  ROOT %t = (s32[], f32[8,4]) tuple(%i, %x)\n}\n\n"
    "%fused_mm.clone (a: bf16[2,3,7], b: bf16[2,7,5]) -> bf16[2,3,5] {\n"
    "  %a.1 = bf16[2,3,7]{2,1,0} parameter(0)\n  %b.1 = bf16[2,7,5]{2,1,0} parameter(1)\n"
    "  ROOT %d2.1 = bf16[2,3,5]{2,1,0} dot(bf16[2,3,7]{2,1,0} %a.1, bf16[2,7,5]{2,1,0} %b.1), lhs_batch_dims={0}, "
    "lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}\n}\n\n%fused_mm").replace(
    "  ROOT %r = f32[16]{0} copy(%ard)",
    "  %d9.remat2 = f32[8,16]{1,0} dot(f32[8,4]{1,0} %x, f32[4,16]{1,0} %w), lhs_contracting_dims={1}, "
    "rhs_contracting_dims={0}\n  %c.remat_compressed = f32[8,4]{1,0} copy(%x)\n  ROOT %r = f32[16]{0} copy(%ard)")


def test_compiler_rematerialisation_is_counted():
  """Three clones; the fusion's dot runs 8 times (2 x 30 outputs x 7 each), the entry's dot once (2 x 128 x 4)."""
  assert REMAT != HLO and "%d2.remat" not in REMAT
  assert compile_for.compiler_remat(HLO) == {"instructions": 0, "matmul_flops": 0.0}
  r = compile_for.compiler_remat(REMAT)
  assert r == {"instructions": 3, "matmul_flops": 8 * 2 * 30 * 7 + 2 * 8 * 16 * 4}, r
  # matmul_flops counts the recomputed matmuls as part of the step
  assert compile_for.matmul_flops(REMAT) == compile_for.matmul_flops(HLO) + r["matmul_flops"]


def test_the_compilers_refusal_is_read():
  """The TPU compiler's out-of-memory message (as libtpu 0.0.42.1 words it; its 'G' is GiB: a 17.0e9-byte program
  was refused as 15.83G, a 16.85e9-byte one compiled) -> the report's verdict; any other error is not a verdict."""
  msg = ("INTERNAL: something\nRESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (18.18G) exceeds available HBM (15.75G).\nmore")
  r = compile_for.out_of_memory(msg)
  assert r["fits"] is False and r["compiler_refused"].startswith("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
  assert r["required_bytes"] == 18.18 * 2 ** 30 and r["usable_hbm_bytes"] == 15.75 * 2 ** 30
  assert compile_for.out_of_memory("RESOURCE_EXHAUSTED: (3.05T) exceeds available HBM (512M)")["required_bytes"] \
      == 3.05 * 2 ** 40
  vague = compile_for.out_of_memory("RESOURCE_EXHAUSTED: out of memory")
  assert vague["fits"] is False and vague["required_bytes"] != vague["required_bytes"]  # NaN: not given
  assert compile_for.out_of_memory("INVALID_ARGUMENT: bad sharding") is None


# The SPMD partitioner's windowed matmul loops (FSDP weight gathers overlapped with the matmuls) as TPU prints them:
# an unsigned counter, two matmul steps per iteration (counter += 2), started from a copied constant.
WINDOWED = """
%wcond (c: (u32[], f32[8,4])) -> pred[] {
  %constant.1 = u32[]{:T(128)} constant(8)
  %c = (u32[], f32[8,4]) parameter(0)
  %gte = u32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt = pred[]{:T(512)} compare(%gte, %constant.1), direction=LT
}

%wbody (p: (u32[], f32[8,4])) -> (u32[], f32[8,4]) {
  %p = (u32[], f32[8,4]) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  %two = u32[]{:T(128)} constant(2)
  %next = u32[]{:T(128)} add(%i, %two)
  %x = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %d = f32[8,16]{1,0} dot(f32[8,4]{1,0} %x, f32[4,16]{1,0} %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (u32[], f32[8,4]) tuple(%next, /*index=1*/%x)
}

ENTRY %main (a: f32[8,4]) -> f32[8,4] {
  %zero = u32[]{:T(128)} constant(0)
  %start = u32[]{:T(128)} copy(%zero)
  %a = f32[8,4]{1,0} parameter(0)
  %init = (u32[], f32[8,4]) tuple(%start, %a)
  %w = (u32[], f32[8,4]) while(%init), condition=%wcond, body=%wbody
  ROOT %r = f32[8,4]{1,0} get-tuple-element(%w), index=1
}
"""


def test_windowed_matmul_loops_count_their_iterations():
  """Counter 0, 2, 4, 6 < 8: four iterations of the 8x16x4 dot. Read as `counter < 8` alone it was 8; before the
  unsigned counter was read at all, 1 (the FSDP program of docs/sharding.md showed 52 of its 74 TFLOP)."""
  mm = 2 * 8 * 16 * 4
  assert compile_for.matmul_flops(WINDOWED) == 4 * mm
  assert compile_for.matmul_flops(WINDOWED.replace("constant(0)", "constant(2)")) == 3 * mm
  assert compile_for.matmul_flops(WINDOWED.replace("constant(2)\n  %next", "constant(1)\n  %next")) == 8 * mm


def test_collectives_are_counted_per_executed_step():
  """Loop bodies count once per iteration (nested loops multiply); async start/done pairs count once; bytes are
  the collective's outputs (all of a combined collective's; an async all-gather's result minus its input)."""
  s = compile_for.collective_stats(HLO)
  assert s["all-gather"] == {"count": 8 + 1, "bytes": 8 * 32 * 4 * 4 + 16 * 8 * 2}
  assert s["reduce-scatter"] == {"count": 24, "bytes": 24 * 2 * 4 * 2}
  assert s["all-reduce"] == {"count": 1, "bytes": (16 + 4) * 4}
  assert s["all-to-all"]["count"] == 0 and s["collective-permute"]["count"] == 0


def test_layouts_and_chip_table():
  assert compile_for.auto_layouts(4) == [(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]
  assert compile_for.chip_spec("v5e:2x2")["hbm_bytes"] == 16 * 10 ** 9
  assert compile_for.chip_spec("h100:2x8")["platform"] == "cuda" and compile_for.chip_count("h100:2x8") == 16
  with pytest.raises(ValueError, match="unknown TPU generation or GPU 'v9x'"):
    compile_for.chip_spec("v9x:2x2")


def test_compiled_model_is_the_runs_model_with_its_adapters():
  """config.finetune reaches the compiled program (LoRA/DoRA leaves, rank, dropout), as in train.py."""
  import sys
  sys.path.insert(0, ROOT)
  from configs.longclip_l import get_config
  c = get_config("dora")
  cfg = experiment.compile_model(c)
  assert (cfg.adapter, cfg.adapter_rank, cfg.text_context, cfg.vision_layers) == ("dora", 16, 248, 24)
  assert experiment.compile_model(get_config("")).adapter == "none"


def test_a_fine_tuning_start_is_built_as_train_py_builds_it(tmp_path):
  """compile_for and train.py build the architecture of a config.init_from start through the same function
  (experiment.pretrained_start): stretched text positions, the run's adapters and compute settings."""
  import sys
  sys.path.insert(0, ROOT)
  from configs.demo import get_config
  from hnclip_jax import pretrained
  from hnclip_jax.data.tokenizer import WordTokenizer
  from hnclip_jax.models import init_params
  from hnclip_jax.workdir import Workdir
  c = get_config("test")
  tok = WordTokenizer.fit(["a red circle left of a square", "a blue square"], context_length=c.model.text_context)
  base = experiment.model_config(c, tok)
  pretrained.Pretrained(base, init_params(base, 0)[1], tok, "a start").save(str(tmp_path / "start"))
  c.init_from, c.model.text_context, c.dtype = str(tmp_path / "start"), 248, "bfloat16"
  c.finetune.method, c.finetune.rank = "lora", 4
  want, _, _ = experiment.resolve_model(c, Workdir(str(tmp_path / "w")), training=True)
  assert experiment.compile_model(c) == want
  assert (want.text_context, want.adapter, want.adapter_rank, want.dtype) == (248, "lora", 4, "bfloat16")


def test_clear_errors_without_a_tpu_compiler(tmp_path):
  proc = run_py(["-m", "hnclip_jax.tools.compile_for", "--config", "configs/demo.py:test", "--topology", "v9x:2x2"],
                check=False)
  assert_error_exit(proc, "unknown TPU generation or GPU 'v9x'")
  if importlib.util.find_spec("libtpu") is None:  # the usual test environment: libtpu is not importable here
    proc = run_py(["-m", "hnclip_jax.tools.compile_for", "--config", "configs/demo.py:test", "--topology",
                   "v5e:2x2"], check=False)
    assert_error_exit(proc, "libtpu is not installed", "libtpu==0.0.42.1")
  try:
    has_plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:
    has_plugin = False
  if not has_plugin:
    proc = run_py(["-m", "hnclip_jax.tools.compile_for", "--config", "configs/demo.py:test", "--topology",
                   "h100:1x8"], check=False)
    assert_error_exit(proc, "CUDA plugin is not installed", "jax-cuda12-pjrt==0.10.2")


SCRIPT = r"""
import json, sys
from hnclip_jax.tools import compile_for
from configs.demo import get_config
c = get_config("test")
c.dtype, c.mesh.data, c.mesh.fsdp, c.loss.token_weight = "bfloat16", 1, 4, 1.0
c.model.vocab_size, c.model.eot_token_id = 128, 3
r, compiled = compile_for.compile_report(c, "v5e:2x2", return_compiled=True)
compile_for.print_report(r)
m = compiled.memory_analysis()
cost = compiled.cost_analysis()
cost = cost[0] if isinstance(cost, list) else cost
text = compiled.as_text()
c.grad_accum_steps = 2
accum = compile_for.compile_report(c, "v5e:2x2")
print("RESULT " + json.dumps({"report": r, "memory": {k: getattr(m, k + "_size_in_bytes") for k in
      ("argument", "output", "alias", "temp")}, "flops": cost["flops"],
      "static_all_gathers": text.count(" all-gather(") + text.count(" all-gather-start("), "accum": accum}))
"""


def run_tpu_script(script: str):
  """Runs `python -c script` with libtpu on its path (failing, and saying why, if libtpu cannot be installed: these
  tests are `registry` ones, run where the registry is reachable); -> (the JSON printed after "RESULT ", the process)."""
  path = libtpu_path()
  if path is None:
    pytest.fail(f"{LIBTPU} could not be installed into {LIBTPU_DIR} (pip failed): the TPU compile is not tested")
  proc = run_py(["-c", script], env_extra={"PYTHONPATH": os.pathsep.join(filter(None, [path, ROOT]))}, timeout=900)
  return json.loads(proc.stdout.split("RESULT ", 1)[1]), proc


@pytest.mark.registry
def test_tiny_model_compiles_for_v5e_2x2_and_the_report_is_the_compilers():
  res, proc = run_tpu_script(SCRIPT)
  r, mem = res["report"], res["memory"]
  assert r["device_kind"].startswith("TPU v5") and r["devices"] == 4 and r["mesh"] == {"data": 1, "fsdp": 4,
                                                                                       "tensor": 1}
  assert (r["argument_bytes"], r["output_bytes"], r["alias_bytes"], r["temp_bytes"]) == (
      mem["argument"], mem["output"], mem["alias"], mem["temp"])
  assert r["total_bytes"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] > 0
  # fits: against what libtpu will fill (15.75 GiB, read from its refusal of a 1 TiB program), not the nominal 16 GB
  assert r["usable_hbm_bytes"] == int(15.75 * 2 ** 30) and compile_for.chip_spec("v5e:2x2")["hbm_bytes"] == 16e9
  assert r["fits"] and r["hbm_bytes"] == 16 * 10 ** 9 and r["xla_flops_per_chip"] == res["flops"] > 0
  # The dots, counted per execution, dominate; XLA's count visits the token term's block loop once, so the dots'
  # count can exceed it. The report takes the larger.
  assert r["matmul_flops_per_chip"] > 0.5 * res["flops"]
  # Two micro-batches: more matmul work than one (GradCache's extra forward pass of the towers: up to 4/3; the
  # token term, a large share of this tiny model's work, is computed once either way — 1.18 measured), counted
  # through the loop (TPU's HLO has no known_trip_count; the bound comes from the loop condition). Counting the
  # loop body once gave about 0.6 of it.
  a = res["accum"]
  assert 1.1 < a["matmul_flops_per_chip"] / r["matmul_flops_per_chip"] < 1.45, (a["matmul_flops_per_chip"], r)
  assert r["flops_per_chip"] == max(res["flops"], r["matmul_flops_per_chip"])
  assert r["compiler_remat_instructions"] == 0 and r["compiler_remat_flops_per_chip"] == 0  # it fits with room
  # FSDP over 4 chips gathers the weights: at least the program's static all-gathers, with their bytes.
  assert r["collectives"]["all-gather"]["count"] >= res["static_all_gathers"] > 0
  assert r["collectives"]["all-gather"]["bytes"] > 0 and r["token_weight"] == 1.0
  assert "fits" in proc.stdout and "collectives per step" in proc.stdout


FSDP_SCRIPT = r"""
import json, math
import jax
from hnclip_jax import experiment
from hnclip_jax.tools import compile_for
from hnclip_jax.models import abstract_model
from configs.demo import get_config
c = get_config("test")
c.model.update(dict(vocab_size=128, eot_token_id=3, image_size=64, patch_size=8, vision_width=256, vision_layers=1,
                    vision_heads=4, vision_mlp_dim=1024, text_width=256, text_layers=1, text_heads=4,
                    text_mlp_dim=1024, embed_dim=256))
c.data.image_size, c.batch_size, c.dtype, c.loss.token_weight = 64, 256, "bfloat16", 0.0
c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 4, 1
r = compile_for.compile_report(c, "v5e:2x2")
n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_model(experiment.compile_model(c))[1]))
print("RESULT " + json.dumps({"collectives": r["collectives"], "n_params": n_params}))
"""


@pytest.mark.registry
def test_fsdp_gathers_weights_not_activations():
  """FSDP over 4 v5e chips, a one-block model 256 wide, 64 examples per chip: the step should all-gather weights
  (a few copies of the parameters) and never the blocks' activations. Without the batch constraint on the residual
  stream (sharding.constrain_batch) XLA's partitioner all-gathered activations for the weight gradients: 1,087 MB
  of all-gathers, 38 MB of all-to-all and 73 MB of all-reduce per step here (31 / 0 / 0.4 MB with it); at ViT-B/16
  batch 256, 54 GB of collectives per step."""
  res, _ = run_tpu_script(FSDP_SCRIPT)
  coll, param_bytes = res["collectives"], 4 * res["n_params"]
  assert 0 < coll["all-gather"]["bytes"] < 8 * param_bytes, (coll, param_bytes)
  assert coll["all-to-all"]["bytes"] == 0 and coll["all-reduce"]["bytes"] < 0.1 * param_bytes, (coll, param_bytes)


@pytest.mark.registry
def test_a_sweep_records_what_the_tpu_compiler_refuses(tmp_path):
  """A million-example batch needs terabytes per chip: libtpu refuses it at once (seconds); the sweep records each
  layout as not fitting, with the compiler's numbers, and goes on to the next instead of stopping."""
  path = libtpu_path()
  if path is None:
    pytest.fail(f"{LIBTPU} could not be installed into {LIBTPU_DIR} (pip failed): the TPU compile is not tested")
  out = tmp_path / "rows.jsonl"
  run_py(["-m", "hnclip_jax.tools.compile_for", "--config", "configs/demo.py:test", "--topology", "v5e:2x2",
          "--sweep", "--layouts", "1x4x1,4x1x1", "--grid", "batch_size=1048576", "--out", str(out)],
         env_extra={"PYTHONPATH": os.pathsep.join(filter(None, [path, ROOT]))}, timeout=600)
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["layout"] for r in rows] == ["1x4x1", "4x1x1"], rows
  assert [(r["topology"], r["slices"], r["dcn"]) for r in rows] == [("v5e:2x2", 1, "1x1x1")] * 2
  for r in rows:
    assert r["fits"] is False and "refused" in r["error"] and r["total_GB"] > 100, r
    assert "16.911 GB usable" in r["error"], r  # libtpu's 15.75 GiB of a v5e chip


GPU_SCRIPT = r"""
import json, math
import jax
from hnclip_jax import experiment
from hnclip_jax.tools import compile_for
from hnclip_jax.models import abstract_model
from configs.demo import get_config
c = get_config("test")
c.mesh.data = 8
r, compiled = compile_for.compile_report(c, "h100:1x8", return_compiled=True)
compile_for.print_report(r)
m = compiled.memory_analysis()
n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_model(experiment.compile_model(c))[1]))
c.grad_accum_steps = 2
accum = compile_for.compile_report(c, "h100:1x8")
print("RESULT " + json.dumps({"report": r, "memory": {k: getattr(m, k + "_size_in_bytes") for k in
      ("argument", "output", "alias", "temp")}, "n_params": n_params, "accum": accum}))
"""


@pytest.mark.registry
def test_tiny_model_compiles_for_eight_h100s_without_a_gpu():
  """The CUDA plugin's compiler with a target config in place of a device: the report is its memory analysis;
  data parallelism all-reduces every fp32 gradient (bytes >= parameters x 4); FLOPs come from the whole program."""
  path = cuda_plugin_path()
  if path is None:
    pytest.fail(f"{CUDA_PLUGIN} could not be installed into {CUDA_DIR} (pip failed): the GPU compile is not tested")
  proc = run_py(["-c", GPU_SCRIPT], env_extra={"PYTHONPATH": os.pathsep.join([path, ROOT])}, timeout=900)
  res = json.loads(proc.stdout.split("RESULT ", 1)[1])
  r, mem = res["report"], res["memory"]
  assert r["device_kind"] == "NVIDIA H100 80GB HBM3" and r["devices"] == r["chips"] == 8
  assert (r["argument_bytes"], r["output_bytes"], r["alias_bytes"], r["temp_bytes"]) == (
      mem["argument"], mem["output"], mem["alias"], mem["temp"])
  assert r["fits"] and r["hbm_bytes"] == 80 * 10 ** 9 and r["total_bytes"] > 0
  assert r["collectives"]["all-reduce"]["bytes"] >= 4 * res["n_params"] > 0
  assert r["flops_source"] == "whole program / devices" and r["flops_per_chip"] > 0
  # The dots the GPU compiler kept (cuBLAS calls and fusions), counted from its optimised program: most of the
  # whole program's FLOPs per device.
  assert 0.5 * r["xla_flops_per_chip"] < r["matmul_flops_per_chip"] <= 1.05 * r["xla_flops_per_chip"], r
  # Two micro-batches (GradCache: a forward pass without gradients, then forward + backward per micro-batch) do
  # about 4/3 of the un-accumulated step's matmul work; XLA's cost analysis, one loop iteration, about 2/3 of it.
  a = res["accum"]
  assert 1.2 < a["matmul_flops_per_chip"] / r["matmul_flops_per_chip"] < 1.45, a["matmul_flops_per_chip"]
  assert a["xla_flops_per_chip"] < 0.8 * r["xla_flops_per_chip"] and a["flops_per_chip"] == a["matmul_flops_per_chip"]


PLUGIN_SCRIPT = r"""
import importlib.util, json, sys
sys.path.insert(0, "tests/plugins")
from hnclip_jax.tools import compile_for
spec = importlib.util.spec_from_file_location("cfg", "tests/plugins/patch_align_config.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
reports = {}
for framework in ("patch_align:PatchAlign", "longclip"):
  c = mod.get_config()
  c.framework = framework
  if framework == "longclip":
    del c["patch_align"]
  c.mesh.data, c.mesh.fsdp, c.grad_accum_steps = 2, 2, 2
  c.model.vocab_size, c.model.eot_token_id = 128, 3
  reports[framework] = compile_for.compile_report(c, "v5e:2x2")
print("RESULT " + json.dumps(reports))
"""


@pytest.mark.registry
def test_a_framework_from_outside_the_package_compiles_for_tpu():
  """tests/plugins/patch_align.py's framework (its input, its second image-tower pass and its term) compiled by
  libtpu for a v5e 2x2 (data 2 x fsdp 2, two accumulated micro-batches), next to L_HN alone."""
  res, _ = run_tpu_script(PLUGIN_SCRIPT)
  plug, plain = res["patch_align:PatchAlign"], res["longclip"]
  assert plug["fits"] and plug["devices"] == 4 and plug["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
  # The extra image-tower pass (and its backward) and the term's B×B scores are in the program: more matmul work
  # than L_HN alone (1.10x here: 16 patches against 77 text positions, so the image tower is the small one).
  assert plug["matmul_flops_per_chip"] > 1.05 * plain["matmul_flops_per_chip"] > 0


def test_replica_groups_and_slow_network_transfers_are_read():
  """Which collectives cross the slow network: groups read in every form XLA prints, a group spanning granules
  crosses, and a multi-slice TPU program's host transfers (megascale `send`s) count as DCN bytes of the
  collective they implement."""
  from hnclip_jax import hlo
  assert hlo.replica_groups("%a = f32[8] all-reduce(%y), replica_groups=[2,4]<=[8], to_apply=%add") == [
      [0, 1, 2, 3], [4, 5, 6, 7]]
  assert hlo.replica_groups("%a = f32[8] all-reduce(%y), replica_groups=[4,2]<=[2,2,2]T(1,0,2), "
                            "use_global_device_ids=true") == [[0, 1], [4, 5], [2, 3], [6, 7]]
  assert hlo.replica_groups("%a = f32[8] all-gather(%y), replica_groups={{0,2},{1,3}}, dimensions={0}") == [[0, 2],
                                                                                                           [1, 3]]
  permute = "%a = f32[8] collective-permute(%y), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}"
  assert hlo.replica_groups(permute) == [[0, 1], [1, 2], [2, 3], [3, 0]]
  halves = [0, 0, 1, 1]
  assert hlo.crosses(permute, halves) and not hlo.crosses(permute, [0, 0, 0, 0])
  assert not hlo.crosses("%a = f32[8] all-gather(%y), replica_groups={{0,1},{2,3}}", halves)
  assert hlo.crosses("%a = f32[8] all-reduce(%y), replica_groups={}, to_apply=%add", halves)
  text = """HloModule m

ENTRY %main (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  %ag = f32[128]{0} all-gather(f32[64]{0} %p), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}
  %ar = f32[64]{0} all-reduce(f32[64]{0} %p), channel_id=2, replica_groups={{0,2},{1,3}}, to_apply=%add
  %tok = token[] after-all()
  %send = (bf16[4,32]{1,0:T(8,128)(2,1)}, u32[], token[]) send(%p, %tok), channel_id=9, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ALL_REDUCE"}
  ROOT %r = f32[64]{0} add(%ar, %p)
}
"""
  stats = hlo.collective_stats(text, halves)
  assert stats["all-gather"] == {"count": 1, "bytes": 512, "dcn_count": 0, "dcn_bytes": 0}
  # The all-reduce between chips 0-2 and 1-3 crosses (256 B), and the megascale send of 4 x 32 bf16 (256 B) is DCN.
  assert stats["all-reduce"] == {"count": 2, "bytes": 512, "dcn_count": 2, "dcn_bytes": 512}
  assert hlo.collective_stats(text)["all-reduce"] == {"count": 2, "bytes": 512}  # no granules: totals only


MULTISLICE_SCRIPT = r"""
import json
from hnclip_jax.tools import compile_for
from configs.demo import get_config
out = {}
for name, topology, slices, ici, dcn in [("data", "v5e:2x2", 2, (2, 2, 1), (2, 1, 1)),
                                         ("tensor", "v5e:2x2", 2, (2, 2, 1), (1, 1, 2)),
                                         ("one slice", "v5e:2x4", 1, (4, 2, 1), (1, 1, 1)),
                                         ("fsdp both", "v5e:2x2", 2, (2, 2, 1), (1, 2, 1))]:
  c = get_config("test")
  c.dtype, c.loss.token_weight = "bfloat16", 1.0
  c.model.vocab_size, c.model.eot_token_id = 128, 3
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = ici
  c.mesh.dcn.data, c.mesh.dcn.fsdp, c.mesh.dcn.tensor = dcn
  try:
    out[name] = compile_for.compile_report(c, topology, slices=slices)
    compile_for.print_report(out[name])
  except ValueError as e:
    out[name] = {"error": str(e)}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.registry
def test_multi_slice_reports_what_crosses_the_data_center_network():
  """Two v5e:2x2 slices joined by the DCN (--slices; JAX's topology description with num_slices), the tiny model
  with the token term: data parallelism across the slices sends the gradient reduction and the margin's gathers
  over the DCN; tensor parallelism across them sends more (activations in every layer); one slice of the same 8
  chips sends nothing over it. The roofline's DCN share is those bytes at v5e's 25 Gbit/s per chip."""
  res, proc = run_tpu_script(MULTISLICE_SCRIPT)
  data, tensor, one = res["data"], res["tensor"], res["one slice"]
  assert data["slices"] == 2 and data["granules"] == 2 and data["granule_kind"] == "slice" and data["chips"] == 8
  assert data["mesh"] == {"data": 4, "fsdp": 2, "tensor": 1} and data["mesh_dcn"] == {"data": 2, "fsdp": 1,
                                                                                      "tensor": 1}
  coll = data["collectives"]
  assert coll["all-reduce"]["dcn_count"] > 0 and coll["all-gather"]["dcn_count"] > 0
  assert 0 < data["dcn_collective_bytes"] < data["collective_bytes"]
  assert data["ici_collective_bytes"] == data["collective_bytes"] - data["dcn_collective_bytes"] > 0
  assert data["est_dcn_s"] == pytest.approx(data["dcn_collective_bytes"] / (25e9 / 8))
  assert data["est_step_s"] == pytest.approx(data["est_compute_s"] + data["est_ici_s"] + data["est_dcn_s"])
  assert tensor["dcn_collective_bytes"] > 2 * data["dcn_collective_bytes"]
  assert one["granules"] == 1 and one["dcn_collective_bytes"] == 0 and one["est_dcn_s"] == 0
  assert "an fsdp axis both inside and across TPU slices" in res["fsdp both"]["error"]
  assert "across the 2 slices (slow network" in proc.stdout and "2 × v5e:2x2 (8 × TPU v5" in proc.stdout


TRAIN_FOR_HLO = {"goal": ["--config.framework=goal"],
                 "finelip": ["--config.framework=finelip", "--config.finelip.tokens=4"]}


@pytest.mark.parametrize("framework", ["finelip", "goal"])
def test_compile_for_lowers_the_program_train_py_runs(framework, tfds_dir, tmp_path, monkeypatch):
  """One resolved run: the step train.py ran — caught as it ran, with the shapes, dtypes and shardings of the state
  and batch it was called with — lowers to the same program text as tools/compile_for's for the same config (its
  epoch-given settings resolved from the same built data; the vocabulary the workdir's tokenizer gave, which a
  compile without data cannot know, passed as config.model settings). train.py resolved its framework once, and
  nothing can change the resolved run."""
  import dataclasses
  import jax
  from hnclip_jax import frameworks, train_step
  from conftest import run_entry
  seen = {}
  build = train_step.build_program

  class Spy:  # the jitted step, recording what train.py calls it with
    def __init__(self, step):
      self.step = step

    def __call__(self, state, batch):
      seen.setdefault("args", jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                           (state, batch)))
      return self.step(state, batch)

    def lower(self, *args):
      return self.step.lower(*args)

  def spying(run):
    program = build(run)
    seen["run"], seen["step"], program.step = run, program.step, Spy(program.step)
    return program

  monkeypatch.setattr(train_step, "build_program", spying)
  monkeypatch.setattr(frameworks, "_RESOLVED", {})
  monkeypatch.setattr(frameworks, "RESOLUTIONS", [0])
  proc = run_entry("train.py", ["--config", "configs/demo.py:test", f"--config.data.data_dir={tfds_dir}",
                                "--config.total_steps=1", "--config.eval_every=100", *TRAIN_FOR_HLO[framework],
                                "--workdir", str(tmp_path / "w")])
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert frameworks.RESOLUTIONS[0] == 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    seen["run"].objective = None
  train_text = seen["step"].lower(*seen["args"]).as_text()

  with open(tmp_path / "w" / "model.json") as f:
    model = json.load(f)
  sys.path.insert(0, ROOT)
  from configs.demo import get_config
  config = get_config("test")
  config.data.data_dir, config.total_steps, config.eval_every = tfds_dir, 1, 100
  config.model.vocab_size, config.model.eot_token_id = model["vocab_size"], model["eot_token_id"]
  config.framework = framework
  if framework == "finelip":
    config.finelip.tokens = 4
  run, program, abstract = compile_for.step_program(config, jax.devices())
  assert run.model == seen["run"].model and run.objective == seen["run"].objective
  describe = lambda tree: [(a.shape, a.dtype, a.sharding.spec) for a in jax.tree.leaves(tree)]
  assert jax.tree.structure(abstract) == jax.tree.structure(seen["args"])
  assert describe(abstract) == describe(seen["args"])
  assert program.step.lower(*abstract).as_text() == train_text
