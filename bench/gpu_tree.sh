#!/usr/bin/env bash
# Run on the GPU machine: `forkattn bench tree` (tree vs prompt-only sharing vs
# replicated) on the three shapes, f32 and bf16, device-resident tensors.
# Usage: bash bench/gpu_tree.sh <offload build dir>; logs to $OUT (or ./gpu-logs).
set -uo pipefail
b=${1:-build-gpu}
final=${OUT:-gpu-logs}
mkdir -p "$final"
export OMP_TARGET_OFFLOAD=mandatory FORKATTN_BACKEND=gpu
status=0
for args in "--shape rl --dtype f32" "--shape rl --dtype bf16" "--shape deep --dtype bf16" "--shape wide --dtype bf16"; do
  echo "### forkattn bench tree $args --backend gpu" | tee -a "$final/bench_tree.txt"
  # shellcheck disable=SC2086
  bash bench/gpu_run.sh "$b/forkattn" bench tree $args --backend gpu 2>&1 | tee -a "$final/bench_tree.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
