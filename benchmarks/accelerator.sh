#!/usr/bin/env bash
# One prepared run on whatever accelerator JAX sees: first a smoke run of a few seconds (benchmarks/smoke.py: the
# stack's versions, every import, two tiny train steps and a checkpoint restore; when it fails the script stops
# there with one line naming what failed), then the numbers users compare first — the ViT-L/14 train step at λ = 0
# and 1, bf16, the largest batch that fits (benchmarks/vit_l_step.py, each compile's time printed as it ends) —
# then benchmarks 1, 3, 4 (N = 1M), 5, the token term's and each framework's step cost, a profiler trace of three
# ViT-B/16 steps. Results (JSON + the printed tables) go to ${OUT:-accelerator_results}/; stages.tsv lists every
# stage with its exit code and seconds.
#   bash benchmarks/accelerator.sh            # full sizes
#   bash benchmarks/accelerator.sh --quick    # CPU-sized smoke run (what the tests run)
# A lent accelerator is short-lived: the stages run most-wanted first, a failed stage does not stop the ones after it
# (the script exits 1 at the end if any failed), and ACC_BUDGET_S (seconds, optional) bounds the whole run: each
# stage is stopped when the budget is spent, so a run always returns what it finished. ACC_SKIP="name name" leaves
# out stages already measured (names as in stages.tsv).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-accelerator_results}"
mkdir -p "$out"
start=$(date +%s)
budget="${ACC_BUDGET_S:-0}"
failed=0
printf "stage\trc\tseconds\n" > "$out/stages.tsv"
stage() {  # stage NAME OUTFILE CMD...: runs CMD, tees it to OUTFILE, records rc and time
  local name="$1" log="$2"; shift 2
  local t0 rc left=0
  t0=$(date +%s)
  if [[ " ${ACC_SKIP:-} " == *" $name "* ]]; then printf "%s\tskipped (ACC_SKIP)\t0\n" "$name" >> "$out/stages.tsv"; return; fi
  if [[ "$budget" -gt 0 ]]; then
    left=$(( budget - (t0 - start) ))
    if [[ "$left" -le 5 ]]; then printf "%s\tskipped (budget)\t0\n" "$name" >> "$out/stages.tsv"; failed=1; return; fi
    timeout "$left" "$@" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
  else
    "$@" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
  fi
  printf "%s\t%s\t%s\n" "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$out/stages.tsv"
  if [[ "$rc" -ne 0 ]]; then echo "stage $name failed (exit $rc)"; failed=1; fi
}
if [[ "${1:-}" == "--quick" ]]; then
  vitl=(--model tiny --text_context 77 --batches 32,16 --reps 2 --dtype float32)
  steps=(--models tiny --batch tiny=16 --reps 2); mem=(--memory_only tiny --batch tiny=16)
  retr=(--sizes 2000 --methods hnclip --argsort_max 0); loss=(--batches 512,1024 --chunk 64 --dim 64 --devices 2)
  # one framework next to the reference (StructXLIP: the only one whose batch differs, 5 images per example)
  tok=(--models tiny --batch tiny=16 --reps 2); fw=(--models tiny --batch tiny=16 --reps 2 --frameworks structxlip)
else
  vitl=(--batches auto --reps 5)
  steps=(--models tiny,vit_b16 --batch tiny=1024,vit_b16=256 --reps 10 --peak_n 8192); mem=(--memory_only vit_l14 --batch vit_l14=256)
  retr=(--sizes 100000,1000000 --methods hnclip --argsort_max 0)
  loss=(--batches 1024,4096,16384,65536 --chunk 256 --dim 768 --devices 1)
  tok=(--models tiny,vit_b16 --batch tiny=1024,vit_b16=256 --reps 10)
  fw=(--models tiny,vit_b16 --batch tiny=1024,vit_b16=64 --reps 10)  # StructXLIP: 5 images per example
fi
python -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/devices.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || true; } >> "$out/devices.txt"
stage smoke "$out/smoke.txt" python benchmarks/smoke.py
smoke_rc="$(tail -n 1 "$out/stages.tsv" | cut -f2)"
if [[ "$smoke_rc" =~ ^[0-9]+$ && "$smoke_rc" != 0 ]]; then  # the stack cannot run the project: nothing after can
  cat "$out/stages.tsv"; tail -n 1 "$out/smoke.txt"; exit 1
fi
# JAX takes 75 % of a GPU's memory by default: ViT-L/14 at batch 128 (61 GB) would not fit an H100's share.
stage vit_l_step "$out/vit_l_step.txt" env XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}" \
  python benchmarks/vit_l_step.py "${vitl[@]}" --json "$out/vit_l_step.json"
# Step time, margin overhead and MFU, then a profiler trace of three steps of the last model (benchmark 3).
stage step_time "$out/step_time.txt" python benchmarks/step_time.py "${steps[@]}" --json "$out/step_time.json" \
  --trace "$out/trace"
bf16() {  # bf16 fast path, one attention implementation: einsums, XLA's, cuDNN's fused kernel (GPU)
  stage "step_time_bf16_$1" "$out/step_time_bf16_$1.txt" python benchmarks/step_time.py --models vit_b16 \
    --batch vit_b16=256 --reps 5 --peak_n 8192 --dtype bfloat16 --attention "$1" --json "$out/step_time_bf16_$1.json"
}
full() { [[ "${1:-}" != "--quick" ]]; }
if full "${1:-}"; then bf16 cudnn; bf16 einsum; fi
stage token_term "$out/token_term.txt" python benchmarks/objective.py time "${tok[@]}" --json "$out/token_term.json"
stage frameworks "$out/frameworks.txt" python benchmarks/frameworks.py "${fw[@]}" --json "$out/frameworks.json"
stage retrieval "$out/retrieval.txt" python benchmarks/retrieval.py "${retr[@]}" --json "$out/retrieval.json"
stage loss_memory "$out/loss_memory.txt" python benchmarks/loss_memory.py "${loss[@]}" --json "$out/loss_memory.json"
if full "${1:-}"; then bf16 xla; fi
stage memory "$out/memory.txt" python benchmarks/step_time.py "${mem[@]}" --json "$out/memory.json"
cat "$out/stages.tsv"
echo "results in $out"
exit "$failed"
