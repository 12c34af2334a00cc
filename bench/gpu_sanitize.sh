#!/usr/bin/env bash
# Run on the GPU machine: compute-sanitizer (memcheck, racecheck, initcheck) over
# the Python binding's CUDA tests, which drive the GPU kernels through device
# pointers. PyTorch initializes CUDA first, under the sanitizer, and the
# library (and LLVM 19's offload runtime) loads after: run directly, an
# offload binary initializes CUDA before the sanitizer attaches and the tool
# disables itself ("CUDA initialized before the Sanitizer", docs/reliability.md).
# One log per tool in $OUT; the last line of each says what it found.
# FORKATTN_SANITIZE_TOOLS picks tools, FORKATTN_SANITIZE_TIMEOUT limits each run (s).
# Usage: bash bench/gpu_sanitize.sh <offload build dir> [pytest -k expression]
set -uo pipefail
b=${1:-build-gpu}
sel=${2:-cuda}
final=${OUT:-gpu-logs}
mkdir -p "$final"
cs=$(command -v compute-sanitizer || find / -xdev -name compute-sanitizer -type f -perm -u+x 2>/dev/null | head -1)
[ -n "$cs" ] || { echo "compute-sanitizer not found" >&2; exit 2; }
export FORKATTN_LIBRARY=$PWD/$b/libforkattn.so PYTHONPATH=$PWD/python PYTHONDONTWRITEBYTECODE=1
export OMP_TARGET_OFFLOAD=mandatory FORKATTN_TEST_INDUCTOR=0
files="python/tests/test_cuda.py python/tests/test_distill.py python/tests/test_dlm_cache.py"
status=0
for tool in ${FORKATTN_SANITIZE_TOOLS:-memcheck initcheck racecheck}; do
  drv="import torch, sys; torch.zeros(1, device='cuda'); import pytest; \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-k', '$sel'] + '$files'.split()))"
  timeout "${FORKATTN_SANITIZE_TIMEOUT:-300}" bash bench/gpu_run.sh "$cs" --tool "$tool" --error-exitcode 9 \
    python3 -c "$drv" > "$final/sanitizer_$tool.txt" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$tool rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|initialized before' \
    "$final/sanitizer_$tool.txt" | tr '\n' ' ')"
done
exit $status
