#!/usr/bin/env bash
# Run on the GPU machine: the tensor-core kernels (the default)
# through the attention suites that have bf16/f16 cases at head_dim 64/128,
# then case 1 and case 2 of bench/RESULTS.md with `forkattn bench prefix`
# on the tensor-core and on the FP32 kernels side by side, then PyTorch side
# by side (bench/compare_torch.py). One summary: $OUT/summary.txt.
# Usage: bash bench/gpu_mma.sh <offload build dir> [commit]
set -uo pipefail
b=${1:-build-gpu}
commit=${2:-unknown}
final=${OUT:-gpu-logs}
mkdir -p "$final"
sum="$final/summary.txt"
export OMP_TARGET_OFFLOAD=mandatory FORKATTN_BACKEND=gpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader >> "$sum" 2>&1
status=0
suites() {
  FORKATTN_TEST_TIMEOUT=120 bash bench/gpu_tests.sh "$b" "$@" >> "$sum" 2>&1 || status=1
}
# the suite with the most bf16/f16 forward and backward cases first: a hang or a
# wrong kernel shows within two minutes, before the benchmarks
suites test_prefix

bench() { # label, mma (1: tensor cores, 0: FP32 kernels), args...
  local label=$1 mma=$2 kernels=auto
  shift 2
  [ "$mma" = 0 ] && kernels=fp32
  echo "== $label FORKATTN_GPU_KERNELS=$kernels" >> "$sum"
  FORKATTN_GPU_KERNELS=$kernels timeout 120 bash bench/gpu_run.sh "$b/forkattn" bench prefix --backend gpu --no-replicated --json "$@" \
    > "$final/bench_${label}_${mma}.txt" 2>&1 || status=1
  grep -o '"shared_fwd_ms":[^,]*,"shared_fwdbwd_ms":[^,]*\|"max_rel_err":[^,]*' "$final/bench_${label}_${mma}.txt" |
    tr '\n' ' ' >> "$sum"
  echo >> "$sum"
}
case1="--n 1 --p 4096 --r 0 --hq 16 --hkv 16 --d 128 --dtype bf16 --repeats 20"
case2="--n 16 --p 4096 --r 1024 --hq 32 --hkv 8 --d 128 --dtype bf16 --repeats 5"
# shellcheck disable=SC2086
bench case1 1 $case1
# shellcheck disable=SC2086
bench case1 0 $case1
# shellcheck disable=SC2086
bench case2 1 $case2
timeout 240 bash bench/gpu_run.sh python3 bench/compare_torch.py --lib "$b/libforkattn.so" --reps 20 \
  --commit "$commit" --json "$final/compare_torch.json" --results "$final/RESULTS-compare_torch.md" \
  > "$final/compare_torch.txt" 2>&1 || status=1
tail -25 "$final/compare_torch.txt" >> "$sum"
suites test_tree test_nonfinite test_prefix_device test_path_stack test_prefix_cached test_determinism test_streamkl
[ -f "$final/failures.txt" ] && head -60 "$final/failures.txt" >> "$sum"
exit $status
