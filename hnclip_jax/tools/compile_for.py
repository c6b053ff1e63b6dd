"""Compile the real train step for a TPU topology (or GPU hosts) you do not have; report whether, and how well, it fits.

  python -m hnclip_jax.tools.compile_for --config configs/longclip_l.py:docci --topology v5p:2x4x4 \\
      [--config.mesh.fsdp=8 --config.batch_size=1024 ...] [--json report.json]
  python -m hnclip_jax.tools.compile_for --config ... --topology v5e:4x4 --sweep \\
      [--layouts auto|16x1x1,4x4x1,...] [--grid batch_size=128,1024] [--grid remat=none,full] [--out rows.jsonl]

Needs `libtpu`, not a TPU: `pip install --target ~/.cache/hnclip_jax/libtpu libtpu==0.0.42.1` (the version
jax[tpu]==0.10.2 pins) and PYTHONPATH=~/.cache/hnclip_jax/libtpu for this command (README):
`jax.experimental.topologies` gives the topology's devices and XLA's TPU compiler compiles for them on this host
(JAX_PLATFORMS=cpu). The program is exactly the one train.py runs — `train_step.build_program` with the same
shardings, donation, accumulation and objective — lowered on abstract inputs (nothing is allocated).

Per chip it reports: argument / output / temporary bytes from the compiler's memory analysis and whether their sum
fits the HBM the TPU compiler will fill (`usable_hbm`; nominal sizes in `CHIPS`), XLA's FLOPs per step, the
collectives of the optimised program (count and bytes of all-gather, reduce-scatter, all-reduce, all-to-all,
collective-permute, each weighted by the trip counts of the loops it sits in, i.e. per executed step), a roofline
estimate of the step time (FLOPs at peak plus collective bytes at the ICI bandwidth, no overlap) and the compile
time. When the program does not fit, XLA's own rematerialisation pass recomputes values to shrink it; the report
counts what it added (`compiler_remat`), since those FLOPs are in the step's count. A program that cannot fit even
then is refused by the TPU compiler (RESOURCE_EXHAUSTED); the report says DOES NOT FIT with the compiler's numbers
(`out_of_memory`), and a sweep records the row and goes on.

Beyond one slice or host (`--slices 2` compiles for two slices of the TPU topology joined by the data-center
network; a GPU topology's first number is its hosts; the mesh's DCN part from --config.mesh.dcn.*): the collective
bytes are split into those that cross the slow network (groups spanning slices / hosts, and the TPU compiler's
megascale host transfers) and those that stay inside, and the roofline takes each at its own bandwidth
(`CHIPS` / `GPUS`: dcn_gbit; docs/sharding.md "Beyond one slice or host").

GPUs (`--topology h100:1x8`, hosts x GPUs per host; h100 and a100): XLA's GPU compiler from JAX's CUDA plugin
compiles without a GPU given a target config (`gpu_target_config`, from NVIDIA's data sheets): `pip install
--no-deps --target ~/.cache/hnclip_jax/cuda jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2` and
PYTHONPATH=~/.cache/hnclip_jax/cuda. It returns memory analysis and the optimised program but no cost analysis, so
a GPU report's FLOPs are the whole program's (XLA's HLO cost analysis) divided by the devices, and its roofline
uses NVLink bandwidth inside a host and the network's between hosts.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host; the TPU is only a compile target
# No TPU is opened, so several compiles (a sweep, a test) may load libtpu at once; without this libtpu refuses
# the second process ("multi-process lockfile").
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import copy  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gzip  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from hnclip_jax import experiment, sharding, train_step  # noqa: E402
from hnclip_jax.cli import clean_errors  # noqa: E402
from hnclip_jax.hlo import collective_stats, compiler_remat, matmul_flops  # noqa: E402

# Per chip, from the Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v3, /v4, /v5e, /v5p, /v6e,
# read 2026-11-30): HBM capacity in bytes (as each page states it: "32 GiB" for v3/v4, "16 GB" for v5e, "95 GiB"
# for v5p, "32 GB" for v6e), peak bf16 FLOP/s, bidirectional ICI bandwidth in GB/s (the v3/v4 pages give none).
# A chip's HBM and FLOP/s are split evenly over the JAX devices the topology gives per chip (libtpu's topology
# for v4:2x2x2 has 16 devices on 8 chips; v5e, v5p and v6e have one device per chip).
# dcn_gbit: data-center-network bandwidth per chip, one direction, in Gbit/s: v5p's page states 50 Gbps per chip;
# v5e's gives 2 × 100 Gbps NICs per 8-chip host (= its "6.4 Tbps per 256-chip Pod"), 25 per chip; the v3, v4 and
# v6e pages give none (the DCN share of a roofline is then unknown: NaN).
GIB, GB = 2 ** 30, 10 ** 9
CHIPS = {
    "v3": {"hbm_bytes": 32 * GIB, "peak_tflops": 123, "ici_gbps": None, "dcn_gbit": None},
    "v4": {"hbm_bytes": 32 * GIB, "peak_tflops": 275, "ici_gbps": None, "dcn_gbit": None},
    "v5e": {"hbm_bytes": 16 * GB, "peak_tflops": 197, "ici_gbps": 400, "dcn_gbit": 25},
    "v5p": {"hbm_bytes": 95 * GIB, "peak_tflops": 459, "ici_gbps": 1200, "dcn_gbit": 50},
    "v6e": {"hbm_bytes": 32 * GB, "peak_tflops": 918, "ici_gbps": 800, "dcn_gbit": None},
}
# GPUs, compiled by XLA's GPU compiler from the CUDA PJRT plugin without a GPU: the plugin needs a target config
# (a GpuTargetConfigProto: what XLA would otherwise query from the device). From NVIDIA's data sheets (H100 SXM5
# 80 GB, A100 SXM4 80 GB; read 2026-12-01): SM count, shared memory and registers per SM, L2, clock, memory and
# bandwidth, CUDA compute capability; dense bf16 tensor-core FLOP/s; NVLink bandwidth per GPU (bidirectional).
# dcn_gbit: the network between hosts per GPU, one direction: DGX H100 has one 400 Gb/s ConnectX-7 (NDR
# InfiniBand) per GPU, DGX A100 one 200 Gb/s ConnectX-6 (HDR) per GPU (NVIDIA's DGX user guides).
GPUS = {
    "h100": {"hbm_bytes": 80 * GB, "peak_tflops": 989, "ici_gbps": 900, "dcn_gbit": 400, "name": "NVIDIA H100 80GB HBM3",
             "cc": (9, 0), "sms": 132, "fpus_per_sm": 128, "smem_per_sm": 228 * 1024, "smem_optin": 227 * 1024,
             "l2": 50 * 2 ** 20, "clock_ghz": 1.98, "mem_bw": 3.35e12},
    "a100": {"hbm_bytes": 80 * GB, "peak_tflops": 312, "ici_gbps": 600, "dcn_gbit": 200, "name": "NVIDIA A100-SXM4-80GB",
             "cc": (8, 0), "sms": 108, "fpus_per_sm": 64, "smem_per_sm": 164 * 1024, "smem_optin": 163 * 1024,
             "l2": 40 * 2 ** 20, "clock_ghz": 1.41, "mem_bw": 2.039e12},
}
# Without a device XLA cannot autotune, and its Triton GEMM tiling then fails on some of ViT-L's matmuls ("Couldn't
# find output tile sizes"); cuBLAS GEMMs (what XLA falls back to anyway when autotuning finds nothing better) compile.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
CUDA_PLUGIN = ("pip install --no-deps --target ~/.cache/hnclip_jax/cuda jax-cuda12-plugin==0.10.2 "
               "jax-cuda12-pjrt==0.10.2 (the versions jax[cuda12]==0.10.2 pins; no CUDA libraries or GPU needed) "
               "and rerun with PYTHONPATH=~/.cache/hnclip_jax/cuda")

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command's flags (defined when run as a program, so importing this module defines none)."""
  config_flags.DEFINE_config_file("config", None, "Config file (as for train.py).", lock_config=True)
  flags.DEFINE_string("topology", None, "TPU topology, e.g. v5e:2x2, v5e:4x4, v5p:2x2x2, v4:2x2x1, v6e:4x4; or "
                      "GPUs as HOSTSxGPUS_PER_HOST: h100:1x8, a100:2x8.")
  flags.DEFINE_integer("slices", 1, "TPU: compile for this many slices of --topology joined by the data-center "
                       "network (a multi-slice job; give the mesh's DCN part with --config.mesh.dcn.*). GPU hosts are "
                       "in the topology itself (h100:2x8).")
  flags.DEFINE_string("json", "", "Write the report (or the sweep's rows) to this JSON file.")
  flags.DEFINE_bool("sweep", False, "Compile a grid of layouts and settings; print a table sorted by fit and cost.")
  flags.DEFINE_string("layouts", "auto", "Sweep: mesh layouts DATAxFSDPxTENSOR, comma-separated; 'auto': every "
                      "split of the chips with tensor in {1, 2, 4}.")
  flags.DEFINE_multi_string("grid", [], "Sweep: KEY=V1,V2 over config keys (batch_size, remat, loss.chunk_size, "
                            "loss.token_weight, grad_accum_steps, ...); repeat the flag for more keys.")
  flags.DEFINE_string("out", "", "Sweep: append each row to this JSON-lines file as soon as it is compiled.")
  flags.DEFINE_string("hlo_dir", "", "Sweep: also write each row's optimised program (gzipped HLO text) here, to "
                      "recount FLOPs and collectives (matmul_flops, collective_stats) without recompiling.")
  flags.mark_flags_as_required(["config", "topology"])


def chip_spec(topology: str) -> dict:
  gen = topology.split(":", 1)[0].lower()
  if gen in GPUS:
    return {"generation": gen, "platform": "cuda", **GPUS[gen]}
  if gen not in CHIPS:
    raise ValueError(f"--topology={topology}: unknown TPU generation or GPU {gen!r}; known: {sorted(CHIPS)} "
                     f"(TPU, e.g. v5e:4x4) and {sorted(GPUS)} (GPU, HOSTSxGPUS_PER_HOST, e.g. h100:2x8)")
  return {"generation": gen, "platform": "tpu", **CHIPS[gen]}


def gpu_target_config(spec: dict) -> str:
  """The GpuTargetConfigProto (text) XLA's GPU compiler needs in place of a device."""
  return (f"gpu_device_info {{ cuda_compute_capability {{ major: {spec['cc'][0]} minor: {spec['cc'][1]} }} "
          f"threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
          f"shared_memory_per_block_optin: {spec['smem_optin']} shared_memory_per_core: {spec['smem_per_sm']} "
          f"threads_per_core_limit: 2048 registers_per_core_limit: 65536 registers_per_block_limit: 65536 "
          f"core_count: {spec['sms']} fpus_per_core: {spec['fpus_per_sm']} block_dim_limit_x: 2147483647 "
          f"block_dim_limit_y: 65535 block_dim_limit_z: 65535 memory_bandwidth: {int(spec['mem_bw'])} "
          f"l2_cache_size: {spec['l2']} clock_rate_ghz: {spec['clock_ghz']} "
          f"device_memory_size: {spec['hbm_bytes']} }} platform_name: \"CUDA\" "
          f"runtime_version {{ major: 12 minor: 8 }} dnn_version_info {{ major: 9 minor: 8 }} "
          f"device_description_str: \"{spec['name']}\"")


def chip_count(topology: str, slices: int = 1) -> int:
  return slices * math.prod(int(x) for x in topology.split(":", 1)[1].split("x"))


def topology_devices(topology: str, slices: int = 1):
  """The devices of `topology` (TPU: 'v5e:2x2', from libtpu, `slices` of them joined by the data-center network;
  GPU: 'h100:2x8', hosts x GPUs per host, from the CUDA plugin and a target config), without the hardware."""
  from jax.experimental import topologies
  spec = chip_spec(topology)
  if spec["platform"] == "cuda":
    try:
      plugin = importlib.util.find_spec("jax_plugins.xla_cuda12")
    except ModuleNotFoundError:  # no jax_plugins namespace at all
      plugin = None
    if plugin is None:
      raise FileNotFoundError(f"--topology={topology}: JAX's CUDA plugin is not installed, so there is no GPU "
                              f"compiler: {CUDA_PLUGIN}")
    if slices != 1:
      raise ValueError(f"--slices={slices} applies to TPU topologies; GPU hosts are the topology's first number "
                       f"(e.g. {spec['generation']}:{slices}x8)")
    shape = topology.split(":", 1)[1].split("x")
    if len(shape) != 2 or not all(x.isdigit() and int(x) > 0 for x in shape):
      raise ValueError(f"--topology={topology}: a GPU topology is HOSTSxGPUS_PER_HOST, e.g. {spec['generation']}:1x8")
    return topologies.get_topology_desc(spec["generation"], platform="cuda", target_config=gpu_target_config(spec),
                                        topology=f"1x{shape[0]}x{shape[1]}").devices
  if importlib.util.find_spec("libtpu") is None:
    raise FileNotFoundError("libtpu is not installed, so there is no TPU compiler: pip install --target "
                            "~/.cache/hnclip_jax/libtpu libtpu==0.0.42.1 (the version jax[tpu]==0.10.2 pins) and rerun "
                            "with PYTHONPATH=~/.cache/hnclip_jax/libtpu")
  try:
    if slices < 1:
      raise ValueError(f"--slices={slices}: give 1 or more")
    kw = {"num_slices": slices} if slices > 1 else {}
    return topologies.get_topology_desc(topology_name=topology, platform="tpu", **kw).devices
  except Exception as e:  # libtpu's message names what it could not parse
    raise ValueError(f"--topology={topology}: libtpu cannot build this topology ({e}); use e.g. v5e:2x2, v5p:2x2x2")


@functools.lru_cache(maxsize=None)
def usable_hbm(device):
  """The HBM the TPU compiler will fill on one of `device`'s kind (bytes), read from its refusal of a program far
  too large for any chip (1 TiB; refused at once): libtpu 0.0.42.1 says 15.75 GiB for a v5e chip, 95.74 GiB for
  v5p, 31.25 GiB for v6e, 15.25 GiB per v4 TensorCore — the nominal size less what the runtime keeps. None if the
  compiler does not say (GPU compilers check no memory)."""
  import jax
  import jax.numpy as jnp
  big = jax.ShapeDtypeStruct((2 ** 38,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
  try:
    jax.jit(lambda x: x + 1).lower(big).compile()
  except jax.errors.JaxRuntimeError as e:
    refused = out_of_memory(str(e))
    if refused and refused["usable_hbm_bytes"] == refused["usable_hbm_bytes"]:
      return refused["usable_hbm_bytes"]
  return None


def global_flops(lowered) -> float:
  """FLOPs of the whole (unpartitioned) program by XLA's HLO cost analysis on the host: for targets whose compiler
  returns no cost analysis without a device (GPU). NaN where the analysis is unavailable."""
  try:
    from jax._src import xla_bridge
    from jax._src.lib import xla_client
    module = lowered.compiler_ir("hlo").as_hlo_module()
    return float(xla_client._xla.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)["flops"])
  except Exception:  # a private API: report no FLOPs rather than fail the compile report
    return float("nan")


def step_program(config, devices):
  """The train step train.py builds for `config` on `devices` -> (the resolved run (experiment.resolve, purpose
  "compile"), its train_step.Program, the step's abstract arguments (state, batch) to lower it on)."""
  run = experiment.resolve(config, None, "compile", devices=devices)
  program = train_step.build_program(run)
  return run, program, (program.target(), train_step.abstract_batch(run))


def compile_report(config, topology: str, devices=None, return_compiled: bool = False, slices: int = 1):
  """Compiles train.py's step of `config` for `topology` (× `slices`); returns the per-chip report (see the module
  doc), and the compiled executable too with `return_compiled`."""
  import jax
  devices = topology_devices(topology, slices) if devices is None else devices
  chip = chip_spec(topology)
  run, program, args = step_program(config, devices)
  config, mesh, model_cfg = run.config, run.mesh, run.model
  t0 = time.perf_counter()
  lowered = program.step.lower(*args)
  try:
    compiled = lowered.compile(GPU_COMPILER_OPTIONS if chip["platform"] == "cuda" else None)
  except jax.errors.JaxRuntimeError as e:
    refused = out_of_memory(str(e))
    if refused is None:
      raise
    report = {**_describe(config, topology, devices, mesh, model_cfg, slices), **refused,
              "compile_s": time.perf_counter() - t0, "jax": jax.__version__}
    return (report, None) if return_compiled else report
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  if cost:  # TPU: the partitioned program's FLOPs per device
    xla_flops, flops_source = float(cost.get("flops", float("nan"))), "compiled program per device"
  else:  # GPU without a device: the whole program's FLOPs split evenly
    xla_flops, flops_source = global_flops(lowered) / len(devices), "whole program / devices"
  hlo = compiled.as_text()
  # XLA's cost analysis counts a loop body once (gradient accumulation's micro-batches, remat scans); the dots of
  # the optimised program weighted by trip counts do not. The step's FLOPs: the larger of the two.
  mm_flops = matmul_flops(hlo)
  flops = max(xla_flops, mm_flops) if xla_flops == xla_flops else mm_flops
  granule = sharding.granule_of(mesh)
  coll = collective_stats(hlo, granule)
  xla_remat = compiler_remat(hlo)
  arg, out, alias, temp = (int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp"))
  chips = chip_count(topology, slices)
  per_chip = len(devices) / chips  # JAX devices per chip
  hbm = chip["hbm_bytes"] / per_chip
  usable = (usable_hbm(devices[0]) if chip["platform"] == "tpu" else None) or hbm
  total = arg + out - alias + temp
  coll_bytes = sum(v["bytes"] for v in coll.values())
  dcn_bytes = sum(v["dcn_bytes"] for v in coll.values())
  peak = chip["peak_tflops"] * 1e12 / per_chip
  # Roofline, no overlap: FLOPs at peak + bytes that stay inside a slice / host at the fast network's one-way
  # bandwidth (half the bidirectional figure) + bytes that cross at the slow network's (per chip, one way).
  est_compute = flops / peak
  est_ici = (coll_bytes - dcn_bytes) / (chip["ici_gbps"] * 1e9 / 2) if chip["ici_gbps"] else 0.0
  est_dcn = (dcn_bytes / (chip["dcn_gbit"] * 1e9 / 8) if chip["dcn_gbit"] else float("nan")) if dcn_bytes else 0.0
  est = est_compute + est_ici + est_dcn
  report = {**_describe(config, topology, devices, mesh, model_cfg, slices), "argument_bytes": arg, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
            "total_bytes": total, "hbm_bytes": int(hbm), "usable_hbm_bytes": int(usable), "fits": total <= usable, "flops_per_chip": flops,
            "xla_flops_per_chip": xla_flops, "matmul_flops_per_chip": mm_flops, "flops_source": flops_source,
            "compiler_remat_instructions": xla_remat["instructions"],
            "compiler_remat_flops_per_chip": xla_remat["matmul_flops"], "collectives": coll,
            "collective_bytes": coll_bytes, "dcn_collective_bytes": dcn_bytes,
            "ici_collective_bytes": coll_bytes - dcn_bytes, "est_step_s": est, "est_compute_s": est_compute,
            "est_ici_s": est_ici, "est_dcn_s": est_dcn, "compile_s": compile_s,
            "jax": jax.__version__}
  return (report, compiled) if return_compiled else report


def _describe(config, topology, devices, mesh, model_cfg, slices=1) -> dict:
  kind, groups = sharding.granules(list(devices))
  return {"topology": topology, "slices": slices, "devices": len(devices), "chips": chip_count(topology, slices),
          "granules": len(groups), "granule_kind": "host" if kind == "process" else kind,
          "mesh_dcn": dict(zip(sharding.MESH_AXES, sharding.dcn_sizes(config.mesh))),
          "device_kind": devices[0].device_kind, "mesh": dict(mesh.shape), "batch_size": config.batch_size,
          "grad_accum_steps": config.grad_accum_steps, "dtype": config.dtype, "remat": config.remat,
          "chunk_size": config.loss.chunk_size, "token_weight": config.loss.token_weight,
          "model": dataclasses.asdict(model_cfg)}


_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def out_of_memory(message: str):
  """The TPU compiler refuses a program that cannot fit a chip even after its own rematerialisation
  ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (18.18G) exceeds
  available HBM (15.75G)"; G = GiB, checked against programs of known size). -> the report's verdict, with the two
  sizes when the message gives them; None for any other error."""
  if "RESOURCE_EXHAUSTED" not in message:
    return None
  m = re.search(r"\(([\d.]+)([KMGT]?)i?B?\) exceeds available HBM \(([\d.]+)([KMGT]?)i?B?\)", message)
  need, have = ((float(m.group(1)) * _UNITS[m.group(2)], float(m.group(3)) * _UNITS[m.group(4)]) if m
                else (float("nan"), float("nan")))
  first = next((line.strip() for line in message.splitlines() if "RESOURCE_EXHAUSTED" in line), message.strip())
  return {"fits": False, "compiler_refused": first[:300], "required_bytes": need, "usable_hbm_bytes": have}


def _gb(x):
  return f"{x / 1e9:.3f}"


def _where(r: dict) -> str:
  return r["topology"] if r.get("slices", 1) == 1 else f"{r['slices']} × {r['topology']}"


def print_report(r: dict) -> None:
  m = r["mesh"]
  if "compiler_refused" in r:
    print(f"{r['topology']} ({r['devices']} × {r['device_kind']}), mesh data={m['data']} fsdp={m['fsdp']} "
          f"tensor={m['tensor']}, global batch {r['batch_size']} ({r['grad_accum_steps']} micro-batches), "
          f"{r['dtype']}, remat={r['remat']}, token_weight={r['token_weight']}: DOES NOT FIT — the TPU compiler "
          f"refused it after {r['compile_s']:.1f} s: needs {_gb(r['required_bytes'])} GB per chip, "
          f"{_gb(r['usable_hbm_bytes'])} GB usable ({r['compiler_refused']})")
    return
  print(f"{_where(r)} ({r['devices']} × {r['device_kind']}), mesh data={m['data']} fsdp={m['fsdp']} "
        f"tensor={m['tensor']}, global batch {r['batch_size']} ({r['grad_accum_steps']} micro-batches), "
        f"{r['dtype']}, remat={r['remat']}, token_weight={r['token_weight']}; compiled in {r['compile_s']:.1f} s")
  print(f"per chip: arguments {_gb(r['argument_bytes'])} GB, outputs {_gb(r['output_bytes'])} GB (aliased "
        f"{_gb(r['alias_bytes'])} GB), temporaries {_gb(r['temp_bytes'])} GB -> {_gb(r['total_bytes'])} GB of "
        f"{_gb(r['usable_hbm_bytes'])} GB usable HBM ({_gb(r['hbm_bytes'])} GB nominal): "
        f"{'fits' if r['fits'] else 'DOES NOT FIT'}")
  print(f"XLA FLOPs per chip per step: {r['flops_per_chip'] / 1e12:.3f} TFLOP; roofline step estimate "
        f"{r['est_step_s'] * 1e3:.1f} ms (compute {r['est_compute_s'] * 1e3:.1f} + fast network "
        f"{r['est_ici_s'] * 1e3:.1f} + slow network {r['est_dcn_s'] * 1e3:.1f} ms)")
  if r["compiler_remat_instructions"]:
    print(f"XLA rematerialised {r['compiler_remat_instructions']} instructions to reduce memory (recomputing "
          f"{r['compiler_remat_flops_per_chip'] / 1e12:.3f} TFLOP of matmuls, included above): the program is at "
          f"or over the chip's memory; config.remat or smaller micro-batches usually cost less")
  used = [f"{k} ×{v['count']} ({_gb(v['bytes'])} GB)" for k, v in r["collectives"].items() if v["count"]]
  print("collectives per step: " + (", ".join(used) or "none"))
  if r["granules"] > 1:
    across = [f"{k} ×{v['dcn_count']} ({_gb(v['dcn_bytes'])} GB)" for k, v in r["collectives"].items()
              if v["dcn_count"]]
    print(f"across the {r['granules']} {r['granule_kind']}s (slow network; mesh.dcn {r['mesh_dcn']}): "
          f"{_gb(r['dcn_collective_bytes'])} GB per chip per step: " + (", ".join(across) or "none") +
          f"; inside them: {_gb(r['ici_collective_bytes'])} GB")


def auto_layouts(n: int) -> list:
  out = []
  for tensor in (1, 2, 4):
    for fsdp in (f for f in range(1, n + 1) if n % (f * tensor) == 0):
      if n % (fsdp * tensor) == 0:
        out.append((n // (fsdp * tensor), fsdp, tensor))
  return out


def _typed(value: str, current):
  if isinstance(current, bool):
    return value.lower() in ("1", "true", "yes")
  return type(current)(value) if current is not None else value


def sweep(config, topology: str, slices: int = 1) -> list:
  devices = topology_devices(topology, slices)
  n = len(devices) // math.prod(sharding.dcn_sizes(config.mesh))  # auto layouts: the sizes inside one granule
  layouts = (auto_layouts(n) if FLAGS.layouts == "auto" else
             [tuple(int(x) for x in item.split("x")) for item in FLAGS.layouts.split(",")])
  grid = []
  for item in FLAGS.grid:
    key, values = item.split("=", 1)
    grid.append((key, values.split(",")))
  rows = []
  for layout, combo in itertools.product(layouts, itertools.product(*[v for _, v in grid])):
    c = copy.deepcopy(config)
    c.unlock()
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = layout
    for (key, _), value in zip(grid, combo):
      node, leaf = c, key
      while "." in leaf:
        head, leaf = leaf.split(".", 1)
        node = node[head]
      node[leaf] = _typed(value, node[leaf])
    label = {"topology": topology, "slices": slices, "layout": "x".join(map(str, layout)),
             "dcn": "x".join(map(str, sharding.dcn_sizes(c.mesh))), **{k: v for (k, _), v in zip(grid, combo)}}
    try:
      r, compiled = compile_report(c, topology, devices, return_compiled=True, slices=slices)
    except (ValueError, FileNotFoundError) as e:  # a layout this model or batch cannot use
      r, compiled = None, None
      row = {**label, "fits": False, "error": str(e)[:160]}
    if r is not None and compiled is None:  # the compiler refused it: does not fit
      row = {**label, "fits": False, "total_GB": r["required_bytes"] / 1e9, "compile_s": r["compile_s"],
             "error": f"the TPU compiler refused it: needs {_gb(r['required_bytes'])} GB per chip, "
                      f"{_gb(r['usable_hbm_bytes'])} GB usable"}
    elif r is not None:
      row = {**label, "fits": r["fits"], "total_GB": r["total_bytes"] / 1e9, "temp_GB": r["temp_bytes"] / 1e9,
             "TFLOP": r["flops_per_chip"] / 1e12, "collective_GB": r["collective_bytes"] / 1e9,
             "dcn_GB": r["dcn_collective_bytes"] / 1e9, "est_dcn_ms": r["est_dcn_s"] * 1e3,
             "est_step_ms": r["est_step_s"] * 1e3, "compile_s": r["compile_s"],
             "xla_remat_TFLOP": r["compiler_remat_flops_per_chip"] / 1e12}
      if FLAGS.hlo_dir:  # the optimised program, so its FLOPs / collectives can be recounted without recompiling
        os.makedirs(FLAGS.hlo_dir, exist_ok=True)
        tag = "_".join(f"{k}={v}" for k, v in label.items() if k not in ("topology", "slices"))
        name = (f"{slices}x" if slices > 1 else "") + topology.replace(":", "_") + "_" + tag + ".hlo.gz"
        with gzip.open(os.path.join(FLAGS.hlo_dir, name), "wt") as f:
          f.write(compiled.as_text())
        row["hlo"] = name
    rows.append(row)
    print(json.dumps(row), flush=True)
    if FLAGS.out:
      with open(FLAGS.out, "a") as f:
        f.write(json.dumps(row) + "\n")
  rows.sort(key=lambda r: (not r["fits"], r.get("est_step_ms", float("inf"))))
  cols = [k for k in rows[0] if k != "error"] if rows else []
  print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
  for r in rows:
    print("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, r.get("error", "")))
                            for k in cols) + " |")
  return rows


@clean_errors
def main(argv):
  del argv
  from hnclip_jax import cli, config as config_lib
  from hnclip_jax.metrics import quiet_libraries
  quiet_libraries()
  config = config_lib.validate(FLAGS.config)
  chip_spec(FLAGS.topology)
  cli.enable_compilation_cache(config.compilation_cache_dir)
  if FLAGS.sweep:
    result = sweep(config, FLAGS.topology, FLAGS.slices)
  else:
    result = compile_report(config, FLAGS.topology, slices=FLAGS.slices)
    print_report(result)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  define_flags()
  app.run(main)
