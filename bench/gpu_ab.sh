#!/usr/bin/env bash
# Run on the GPU machine: A/B of library builds in one device call. Each
# variant is a folder holding a libforkattn.so.0 (label=folder); the build's
# own `forkattn` binary loads it through LD_LIBRARY_PATH. For ROUNDS rounds
# (default 2), every variant in turn runs case 1 and case 2 of bench/RESULTS.md (and
# case 1 at head_dim 64, "case64") with
# `forkattn bench prefix` and FORKATTN_GPU_TRACE=1, so the variants alternate
# and share the card's state. $OUT/ab.txt: forward and forward+backward per
# run, and the median phase times (µs) of the traced calls per variant.
# A variant may set environment variables for its runs: label=libdir:VAR=value[,VAR=value].
# Usage: bash bench/gpu_ab.sh <offload build dir> label=libdir[:env] [label=libdir[:env] ...]
set -uo pipefail
b=$1
shift
final=${OUT:-gpu-logs}
mkdir -p "$final"
sum="$final/ab.txt"
export OMP_TARGET_OFFLOAD=mandatory FORKATTN_BACKEND=gpu FORKATTN_GPU_TRACE=1
case1="--n 1 --p 4096 --r 0 --hq 16 --hkv 16 --d 128 --dtype bf16 --repeats 20"
case2="--n 16 --p 4096 --r 1024 --hq 32 --hkv 8 --d 128 --dtype bf16 --repeats 5"
case64="--n 1 --p 4096 --r 0 --hq 16 --hkv 16 --d 64 --dtype bf16 --repeats 20"
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader >> "$sum" 2>&1
for round in $(seq "${ROUNDS:-2}"); do
  for v in "$@"; do
    label=${v%%=*} dir=${v#*=} envs=
    if [[ $dir == *:* ]]; then envs=${dir#*:} dir=${dir%%:*}; fi
    for c in case1 case2 case64; do
      log="$final/trace_${label}_${c}.txt"
      # shellcheck disable=SC2086
      env ${envs//,/ } LD_LIBRARY_PATH="$(cd "$dir" && pwd)" timeout 180 bash bench/gpu_run.sh "$b/forkattn" bench prefix \
        --backend gpu --no-replicated --json ${!c} > "$log.out" 2> "$log.r$round" || status=1
      printf '%-10s %-6s round %s: %s\n' "$label" "$c" "$round" \
        "$(grep -o '"shared_fwd_ms":[^,]*,"shared_fwdbwd_ms":[^,]*\|"max_rel_err":[^,]*' "$log.out" | tr '\n' ' ')" >> "$sum"
      cat "$log.r$round" >> "$log"
      rm -f "$log.r$round" "$log.out"
    done
  done
done
# median of each phase over the traced calls of a variant and case
for v in "$@"; do
  label=${v%%=*}
  for c in case1 case2 case64; do
    for call in attn_fwd attn_bwd; do
      grep "forkattn gpu $call " "$final/trace_${label}_${c}.txt" 2>/dev/null | python3 -c '
import sys, statistics
rows = [dict(kv.split("=") for kv in l.split(":", 1)[1].split()) for l in sys.stdin if ":" in l]
if rows:
    keys = list(rows[0])
    print(sys.argv[1], " ".join("%s=%.0f" % (k, statistics.median(float(r[k]) for r in rows if k in r)) for k in keys),
          "(median of %d calls)" % len(rows))' "$label $c $call" >> "$sum"
    done
  done
done
cat "$sum"
exit $status
