#!/usr/bin/env bash
# The CPU targets, measured side by side in one run (bench, not tests):
#  - N=16, P=2048, R=256, 8/2 heads, d=128, f32: shared fwd+bwd speedup over
#    replicated >= 0.8 x ideal (ideal = replicated / shared useful FLOPs);
#  - shared forward useful FLOP rate >= 50% of OpenBLAS sgemm (same run).
# Usage: bench/cpu_targets.sh [build dir]   (prints a table and JSON lines)
set -euo pipefail
b=${1:-build}
for dtype in f32 bf16; do
  "$b/forkattn" bench prefix --backend cpu --n 16 --p 2048 --r 256 --hq 8 --hkv 2 --d 128 \
    --dtype "$dtype" --repeats 3
done
