#!/usr/bin/env bash
# Run on the GPU machine: the named test binaries of an offload build with
# OMP_TARGET_OFFLOAD=mandatory and FORKATTN_BACKEND=gpu, one log each, a
# summary line each in $OUT/tests.txt and the failing excerpts in
# $OUT/failures.txt; each binary is stopped after FORKATTN_TEST_TIMEOUT seconds
# (300 by default, rc 124). Usage: bash bench/gpu_tests.sh <build dir> test_a test_b ...
set -uo pipefail
b=$1
shift
final=${OUT:-gpu-logs}
mkdir -p "$final"
export OMP_TARGET_OFFLOAD=mandatory FORKATTN_BACKEND=gpu
status=0
for name in "$@"; do
  start=$(date +%s.%N)
  timeout "${FORKATTN_TEST_TIMEOUT:-300}" bash bench/gpu_run.sh "$b/tests/$name" > "$final/$name.log" 2>&1; rc=$?
  end=$(date +%s.%N)
  printf '%-20s rc=%d  %.1f s  %s\n' "$name" "$rc" "$(awk "BEGIN{print $end - $start}")" \
    "$(grep -o 'Synthesis:.*' "$final/$name.log" | tail -1)" | tee -a "$final/tests.txt"
  if [ $rc -ne 0 ]; then
    status=1
    { echo "### $name"; grep -B2 -A12 -E "FAIL|Assertion|failed" "$final/$name.log" | head -80; } >> "$final/failures.txt"
  fi
done
exit $status
