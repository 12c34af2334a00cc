#!/usr/bin/env bash
# Run on the GPU machine (see docs/build.md): the whole test suite of an
# offload build with OMP_TARGET_OFFLOAD=mandatory and FORKATTN_BACKEND=gpu,
# then the GRPO-group benchmark. Logs go to $OUT (or ./gpu-logs).
# Usage: bash bench/gpu_suite.sh <offload build dir>
# FORKATTN_SKIP_SANITIZER=1 leaves out the compute-sanitizer runs.
set -uo pipefail
b=${1:-build-gpu}
final=${OUT:-gpu-logs}
out=$(mktemp -d)  # every log here; the summaries and one tarball go to $final at the end
mkdir -p "$final"
run() { bash bench/gpu_run.sh "$@"; }
export OMP_TARGET_OFFLOAD=mandatory FORKATTN_BACKEND=gpu
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  run "$b/forkattn" info
} 2>&1 | tee "$out/info.txt"
status=0
for t in "$b"/tests/test_*; do
  [ -x "$t" ] || continue
  case "$t" in *slow* | *mpi*) continue ;; esac   # MPI: bench/gpu_mpi.sh runs it under mpirun
  name=$(basename "$t")
  start=$(date +%s.%N)
  run "$t" > "$out/$name.log" 2>&1; rc=$?
  end=$(date +%s.%N)
  printf '%-24s rc=%d  %.1f s  %s\n' "$name" "$rc" "$(awk "BEGIN{print $end - $start}")" \
    "$(grep -o 'Synthesis:.*' "$out/$name.log" | tail -1)" | tee -a "$out/tests.txt"
  [ $rc -eq 0 ] || status=1
done
for sweep in head_dim adversarial tree mma; do
  run "$b/forkattn" check --batch "tests/check/$sweep.txt" > "$out/check_$sweep.log" 2>&1; rc=$?
  printf '%-24s rc=%d  %s\n' "check_$sweep" "$rc" "$(tail -1 "$out/check_$sweep.log")" | tee -a "$out/tests.txt"
  [ $rc -eq 0 ] || status=1
done
# compute-sanitizer (memcheck, initcheck, racecheck) over 24 of the adversarial cases, through
# bench/gpu_sanitize.sh: run on the binary directly, the tool disables itself under LLVM 19's
# runtime, so that script loads the checker after PyTorch has initialized CUDA
if [ -n "${FORKATTN_SKIP_SANITIZER:-}" ]; then
  echo "compute-sanitizer: skipped (FORKATTN_SKIP_SANITIZER set)" | tee -a "$out/tests.txt"
else
  OUT="$out" FORKATTN_SANITIZE_RUNS=check FORKATTN_SANITIZE_TIMEOUT=200 bash bench/gpu_sanitize.sh "$b" 2>&1 |
    sed 's/^/sanitizer /' | tee -a "$out/tests.txt"
fi
for dtype in f32 bf16; do
  run "$b/forkattn" bench prefix --n 16 --p 4096 --r 1024 --hq 32 --hkv 8 --d 128 --dtype $dtype \
    --repeats 2 2>&1 | tee -a "$out/bench.txt"
done
run "$b/forkattn" demo 2>&1 | tee "$out/demo.txt"
cp "$out"/{info,tests,bench,demo}.txt "$final"/ 2>/dev/null
tar -C "$out" -czf "$final/logs.tgz" .
exit $status
