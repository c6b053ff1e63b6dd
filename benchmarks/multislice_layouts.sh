#!/usr/bin/env bash
# Compile-only multi-slice / multi-host layouts for docs/sharding.md "Beyond one slice or host": Long-CLIP-L
# (ViT-L/14, 248 text tokens, bf16) steps compiled for two TPU slices joined by the data-center network
# (compile_for --slices 2) and for H100 hosts, reporting which collective bytes cross the slow network. Rows are
# appended to ${OUT:-multislice_layouts.jsonl} as each compile finishes (tens of minutes each on 2 cores: run it in
# the background; the most wanted rows come first). Needs libtpu (TPU) and JAX's CUDA plugin (GPU), see README.
#   PYTHONPATH=~/.cache/hnclip_jax/libtpu:~/.cache/hnclip_jax/cuda bash benchmarks/multislice_layouts.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-multislice_layouts.jsonl}"
run() {  # TOPOLOGY SLICES LAYOUTS DCN_DATA DCN_FSDP GRID... (each GRID is KEY=V1,V2)
  local topo="$1" slices="$2" layouts="$3" dd="$4" df="$5"; shift 5
  local grid=()
  for g in "$@"; do grid+=(--grid "$g"); done
  python -m hnclip_jax.tools.compile_for --config configs/longclip_l.py --topology "$topo" --slices "$slices" \
    --sweep --layouts "$layouts" --config.dtype=bfloat16 --config.mesh.dcn.data="$dd" --config.mesh.dcn.fsdp="$df" \
    "${grid[@]}" --out "$out" 2>&1 | grep '^{' | sed "s/^/$slices x $topo dcn=$dd,$df /"
}
# 2 × v5p-128 (4x4x8: 128 chips each), data parallelism across the slices and inside them, 8k: 32 rows per chip.
run v5p:4x4x8 2 128x1x1 2 1 batch_size=8192 grad_accum_steps=1 remat=none loss.token_weight=0,1
# 2 × v5e-256 (16x16), 8k: 16 rows per chip.
run v5e:16x16 2 256x1x1 2 1 batch_size=8192 grad_accum_steps=1 remat=none loss.token_weight=0
# FSDP across the DCN instead: each slice keeps half of every weight (fsdp = the 2 slices, data inside).
run v5p:4x4x8 2 128x1x1 1 2 batch_size=8192 grad_accum_steps=1 remat=none loss.token_weight=0
# 4 H100 hosts (8 GPUs each): data parallelism across hosts, 8k: 64 rows per GPU per micro-batch.
run h100:4x8 1 8x1x1 4 1 batch_size=8192 grad_accum_steps=4 remat=none loss.token_weight=0,1
run v5e:16x16 2 256x1x1 2 1 batch_size=8192 grad_accum_steps=1 remat=full loss.token_weight=1
# 32k: 64 rows per chip per micro-batch.
run v5p:4x4x8 2 128x1x1 2 1 batch_size=32768 grad_accum_steps=2 remat=none loss.token_weight=0,1
run v5e:16x16 2 256x1x1 2 1 batch_size=32768 grad_accum_steps=4 remat=full loss.token_weight=0,1
