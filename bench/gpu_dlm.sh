#!/usr/bin/env bash
# Run on the GPU machine: the diffusion-LM tests (cached-prefix attention, KV cache
# with device entries, similarity on device memory, the demo model) and the
# distillation suites, the Python binding's tests on CUDA tensors, then
# `forkattn demo dlm` and `forkattn bench dlm` on the GPU backend.
# Usage: bash bench/gpu_dlm.sh <offload build dir>; logs to $OUT (or ./gpu-logs).
set -uo pipefail
b=${1:-build-gpu}
final=${OUT:-gpu-logs}
mkdir -p "$final"
status=0
bash bench/gpu_tests.sh "$b" test_prefix_cached test_kv_cache test_reuse_profile test_dlm test_streamkl \
  test_kept_attn test_prefix_device || status=1
OMP_TARGET_OFFLOAD=mandatory bash bench/gpu_run.sh bash python/run_tests.sh "$b" > "$final/python.log" 2>&1 || status=1
tail -3 "$final/python.log" | tee -a "$final/tests.txt"
export OMP_TARGET_OFFLOAD=mandatory
bash bench/gpu_run.sh "$b/forkattn" demo dlm --backend gpu --requests 32 2>&1 | tee "$final/demo_dlm.txt" || status=1
bash bench/gpu_run.sh "$b/forkattn" bench dlm --backend gpu 2>&1 | tee "$final/bench_dlm.txt" || status=1
exit $status
