#!/usr/bin/env bash
# One prepared run of benchmarks 1, 3, 4 (N = 1M), 5, the token term's and each framework's step cost on whatever accelerator JAX sees; < 8 minutes on one
# modern GPU. Results (JSON + the printed tables) go to ${OUT:-accelerator_results}/.
#   bash benchmarks/accelerator.sh            # full sizes
#   bash benchmarks/accelerator.sh --quick    # CPU-sized smoke run (what the tests run)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-accelerator_results}"
mkdir -p "$out"
if [[ "${1:-}" == "--quick" ]]; then
  steps=(--models tiny --batch tiny=16 --reps 2); mem=(--memory_only tiny --batch tiny=16)
  retr=(--sizes 2000 --methods hnclip --argsort_max 0); loss=(--batches 512,1024 --chunk 64 --dim 64 --devices 2)
  tok=(--models tiny --batch tiny=16 --reps 2); fw=(--models tiny --batch tiny=16 --reps 2)
else
  steps=(--models tiny,vit_b16 --batch tiny=1024,vit_b16=256 --reps 10 --peak_n 8192); mem=(--memory_only vit_l14 --batch vit_l14=256)
  retr=(--sizes 100000,1000000 --methods hnclip --argsort_max 0)
  loss=(--batches 1024,4096,16384,65536 --chunk 256 --dim 768 --devices 1)
  tok=(--models tiny,vit_b16 --batch tiny=1024,vit_b16=256 --reps 10)
  fw=(--models tiny,vit_b16 --batch tiny=1024,vit_b16=64 --reps 10)  # StructXLIP: 5 images per example
fi
python -c "import jax; print(jax.devices())" | tee "$out/devices.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true; } >> "$out/devices.txt"
python benchmarks/step_time.py "${steps[@]}" --json "$out/step_time.json" | tee "$out/step_time.txt"
python benchmarks/step_time.py "${mem[@]}" --json "$out/memory.json" | tee "$out/memory.txt"
if [[ "${1:-}" != "--quick" ]]; then  # bf16 fast path: attention written as einsums, XLA's, cuDNN's fused kernel (GPU; non-fatal)
  for impl in einsum xla cudnn; do
    python benchmarks/step_time.py --models vit_b16 --batch vit_b16=256 --reps 5 --peak_n 8192 --dtype bfloat16 \
      --attention "$impl" --json "$out/step_time_bf16_$impl.json" | tee "$out/step_time_bf16_$impl.txt" \
      || echo "bf16 step with attention=$impl failed (see above)"
  done
fi
python benchmarks/objective.py time "${tok[@]}" --json "$out/token_term.json" | tee "$out/token_term.txt"
python benchmarks/frameworks.py "${fw[@]}" --json "$out/frameworks.json" | tee "$out/frameworks.txt"
python benchmarks/retrieval.py "${retr[@]}" --json "$out/retrieval.json" | tee "$out/retrieval.txt"
python benchmarks/loss_memory.py "${loss[@]}" --json "$out/loss_memory.json" | tee "$out/loss_memory.txt"
echo "results in $out"
