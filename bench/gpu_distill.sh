#!/usr/bin/env bash
# Run on the GPU machine: the distillation tests (StreamKL, kept-set attention, KV
# policies, determinism) and the attention suites the kept mask touched, with
# OMP_TARGET_OFFLOAD=mandatory and FORKATTN_BACKEND=gpu; the Python binding's
# tests; `forkattn bench kl` on device memory.
# Usage: bash bench/gpu_distill.sh <offload build dir>; logs to $OUT (or ./gpu-logs).
set -uo pipefail
b=${1:-build-gpu}
final=${OUT:-gpu-logs}
mkdir -p "$final"
export OMP_TARGET_OFFLOAD=mandatory FORKATTN_BACKEND=gpu
status=0
bash bench/gpu_tests.sh "$b" test_streamkl test_kept_attn test_kv_policy test_determinism test_prefix test_tree \
  test_prefix_device test_nonfinite test_path_stack || status=1
bash bench/gpu_run.sh bash python/run_tests.sh "$b" > "$final/python.log" 2>&1 || status=1
tail -3 "$final/python.log" | tee -a "$final/tests.txt"
for args in "--seq 4096 --heads 16 --d 128" "--seq 4096 --heads 16 --d 128 --reverse" \
            "--seq 4096 --heads 16 --d 128 --keep 0.5"; do
  # shellcheck disable=SC2086
  bash bench/gpu_run.sh "$b/forkattn" bench kl $args --backend gpu 2>&1 | tee -a "$final/bench_kl.txt"
done
exit $status
