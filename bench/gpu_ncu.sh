#!/usr/bin/env bash
# Run on the GPU machine: Nsight Compute on the tensor-core kernels
# (the default) of `forkattn bench prefix` at case 1 of
# bench/RESULTS.md, clocks left as found (--clock-control none). Writes
# $OUT/ncu_case1.txt (the sections below, per kernel launch).
# Usage: bash bench/gpu_ncu.sh <offload build dir> [max launches, default 6]
set -uo pipefail
b=${1:-build-gpu}
count=${2:-6}
final=${OUT:-gpu-logs}
mkdir -p "$final"
export OMP_TARGET_OFFLOAD=mandatory FORKATTN_BACKEND=gpu
sections=""
for s in SpeedOfLight LaunchStats Occupancy WarpStateStats SchedulerStats ComputeWorkloadAnalysis \
  InstructionStats MemoryWorkloadAnalysis_Tables; do sections="$sections --section $s"; done
# shellcheck disable=SC2086
timeout 300 bash bench/gpu_run.sh ncu --clock-control none -k regex:mma --launch-count "$count" $sections \
  "$b/forkattn" bench prefix --backend gpu --no-replicated --n 1 --p 4096 --r 0 --hq 16 --hkv 16 --d 128 \
  --dtype bf16 --repeats 1 > "$final/ncu_case1.txt" 2>&1
# NCU_SOURCE=1: also, per tensor-core kernel of case 1 (forward, dQ, dK/dV), one launch
# with the SourceCounters and WarpStateStats sections, and its SASS with per-instruction
# executed counts and stall samples ($OUT/ncu_sass_<kernel>.csv, from the source page).
if [ -n "${NCU_SOURCE:-}" ]; then
  for k in mma_fwd mma_dq mma_dkv; do
    rep=$(mktemp -u)
    # shellcheck disable=SC2086
    timeout 240 bash bench/gpu_run.sh ncu --clock-control none -k regex:$k --launch-count 1 \
      --section SourceCounters --section WarpStateStats --import-source no -o "$rep" \
      "$b/forkattn" bench prefix --backend gpu --no-replicated --n 1 --p 4096 --r 0 --hq 16 --hkv 16 \
      --d 128 --dtype bf16 --repeats 1 > "$final/ncu_source_$k.txt" 2>&1
    timeout 120 bash bench/gpu_run.sh ncu -i "$rep.ncu-rep" --page source --csv --print-source sass \
      > "$final/ncu_sass_$k.csv" 2>> "$final/ncu_source_$k.txt"
    timeout 60 bash bench/gpu_run.sh ncu -i "$rep.ncu-rep" --page details \
      >> "$final/ncu_source_$k.txt" 2>&1
  done
fi
