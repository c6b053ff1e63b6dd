#!/usr/bin/env bash
# Compile-only TPU layouts for docs/sharding.md: Long-CLIP-L (ViT-L/14, 248 text tokens, bf16) fine-tuning steps
# compiled by XLA's TPU compiler on this CPU host (tools/compile_for; needs libtpu, see README). Rows are appended to
# ${OUT:-tpu_layouts.jsonl} as each compile finishes (minutes each on 2 cores), so it can run in the background; each
# row's optimised program goes to ${HLO_DIR:-tpu_hlo}/ (gzipped HLO) so its FLOPs and collectives can be recounted.
#   PYTHONPATH=~/.cache/hnclip_jax/libtpu bash benchmarks/tpu_layouts.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-tpu_layouts.jsonl}"
hlo="${HLO_DIR:-tpu_hlo}"
run() {  # TOPOLOGY LAYOUTS GRID... (each GRID is KEY=V1,V2)
  local topo="$1" layouts="$2"; shift 2
  local grid=()
  for g in "$@"; do grid+=(--grid "$g"); done
  python -m hnclip_jax.tools.compile_for --config configs/longclip_l.py --topology "$topo" --sweep \
    --layouts "$layouts" --config.dtype=bfloat16 "${grid[@]}" --out "$out" --hlo_dir "$hlo" 2>&1 | grep '^{' | sed "s/^/$topo /"
}
# Every row of docs/sharding.md's TPU table: data parallelism over v5e-16 and v5p-32, with and without remat and
# the token term; accumulation keeps a micro-batch at 64 rows per chip.
run v5e:4x4 16x1x1 batch_size=128 grad_accum_steps=1 remat=none loss.token_weight=0,1
run v5p:2x4x4 32x1x1 batch_size=128 grad_accum_steps=1 remat=full,none loss.token_weight=1
run v5e:4x4 16x1x1 batch_size=1024 grad_accum_steps=1 remat=none,full loss.token_weight=1
run v5p:2x4x4 32x1x1 batch_size=1024 grad_accum_steps=1 remat=none loss.token_weight=0,1
run v5e:4x4 16x1x1 batch_size=1024 grad_accum_steps=1 remat=none loss.token_weight=0
run v5e:4x4 16x1x1 batch_size=8192 grad_accum_steps=8 remat=full loss.token_weight=0,1
run v5p:2x4x4 32x1x1 batch_size=8192 grad_accum_steps=4 remat=full,none loss.token_weight=0,1
run v5e:4x4 16x1x1 batch_size=32768 grad_accum_steps=32 remat=full loss.token_weight=0
run v5p:2x4x4 32x1x1 batch_size=32768 grad_accum_steps=16 remat=full,none loss.token_weight=0,1
# FSDP instead of remat at 1k on v5e-16 (the parameters and AdamW state sharded over 4 or 16 chips).
run v5e:4x4 4x4x1,1x16x1 batch_size=1024 grad_accum_steps=1 remat=none loss.token_weight=1
run v5e:4x4 1x16x1 batch_size=1024 grad_accum_steps=1 remat=full loss.token_weight=1
# The token term's ring schedule (loss.token_schedule=ring) at the sizes where gathering the caption tokens does
# not fit or dominates (docs/sharding.md, "The token term's ring schedule").
run v5e:4x4 16x1x1 batch_size=8192 grad_accum_steps=8 remat=full loss.token_weight=1 loss.token_schedule=ring
run v5e:4x4 16x1x1 batch_size=32768 grad_accum_steps=32 remat=full loss.token_weight=1 loss.token_schedule=ring
run v5p:2x4x4 32x1x1 batch_size=8192 grad_accum_steps=4 remat=full loss.token_weight=1 loss.token_schedule=ring
run v5p:2x4x4 32x1x1 batch_size=32768 grad_accum_steps=16 remat=full loss.token_weight=1 loss.token_schedule=ring
# The token term on groups of 256 examples (loss.token_group=256: B/256 times less token work, no caption tokens
# sent; docs/objective.md) at 32k, where neither schedule of the whole-batch term fits v5e-16.
run v5e:4x4 16x1x1 batch_size=32768 grad_accum_steps=32 remat=full loss.token_weight=1 loss.token_group=256
# The token term on each example's kept half of its tokens (loss.token_keep=0.5: ~4x less token work, half the caption
# tokens gathered) at 32k, where neither schedule of the whole term fits v5e-16.
run v5e:4x4 16x1x1 batch_size=32768 grad_accum_steps=32 remat=full loss.token_weight=1 loss.token_keep=0.5 loss.token_schedule=ring
# ... and at 8k, where the whole term's ring fits, to see what the selection saves or adds.
run v5e:4x4 16x1x1 batch_size=8192 grad_accum_steps=8 remat=full loss.token_weight=1 loss.token_keep=0.5 loss.token_schedule=ring
# HN-SigLIP: a SigLIP So400m/14 (384 px, 196 text tokens) step with the sigmoid loss's ring schedule on v5p-32.
python -m hnclip_jax.tools.compile_for --config configs/siglip.py --topology v5p:2x4x4 --sweep --layouts 32x1x1 \
  --config.dtype=bfloat16 --grid batch_size=1024 --grid grad_accum_steps=1 --grid remat=full --out "$out" \
  --hlo_dir "$hlo" 2>&1 | grep '^{' | sed "s/^/v5p:2x4x4 /"
