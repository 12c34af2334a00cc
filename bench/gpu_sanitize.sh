#!/usr/bin/env bash
# Run on the GPU machine: compute-sanitizer (memcheck, initcheck, racecheck)
# over the GPU kernels, in processes where PyTorch initializes CUDA first,
# under the sanitizer, and the library (with LLVM 19's offload runtime) loads
# after: run directly, an offload binary initializes CUDA before the sanitizer
# attaches and the tool disables itself ("CUDA initialized before the
# Sanitizer", docs/reliability.md). Two workloads:
#   pytest  the Python binding's CUDA tests (device pointers)
#   check   `forkattn check` over every 5th case of tests/check/adversarial.txt
#           (24 cases: odd head_dims, all dtypes and masks) and all of
#           tests/check/mma.txt (16 tensor-core shapes), the CLI loaded as
#           libforkattn_cli_dl.so (offload builds) and entered at forkattn_cli_main
# One log per tool and workload in $OUT; a summary line each on stdout.
# FORKATTN_SANITIZE_TOOLS, FORKATTN_SANITIZE_RUNS pick tools and workloads,
# FORKATTN_SANITIZE_CASES check-batch files to run whole instead of those 40 cases;
# FORKATTN_SANITIZE_TIMEOUT limits each run (seconds).
# Usage: bash bench/gpu_sanitize.sh <offload build dir> [pytest -k expression]
set -uo pipefail
b=${1:-build-gpu}
sel=${2:-cuda}
# The build's library after any the caller puts first: the program gpu_run.sh starts here is
# compute-sanitizer, so it cannot find the build folder from it (libforkattn_cli_dl.so needs it).
LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(cd "$b" && pwd)"
export LD_LIBRARY_PATH
final=${OUT:-gpu-logs}
mkdir -p "$final"
cs=$(command -v compute-sanitizer || find / -xdev -name compute-sanitizer -type f -perm -u+x 2>/dev/null | head -1)
[ -n "$cs" ] || { echo "compute-sanitizer not found" >&2; exit 2; }
export FORKATTN_LIBRARY=$PWD/$b/libforkattn.so PYTHONPATH=$PWD/python PYTHONDONTWRITEBYTECODE=1
export OMP_TARGET_OFFLOAD=mandatory FORKATTN_TEST_INDUCTOR=0
files="python/tests/test_cuda.py python/tests/test_distill.py python/tests/test_dlm_cache.py"
if [ -n "${FORKATTN_SANITIZE_CASES:-}" ]; then # check-batch files (space-separated), every case
  read -r -a case_files <<< "$FORKATTN_SANITIZE_CASES"
  grep -hv '^#' "${case_files[@]}" > /tmp/forkattn-sanitize.txt
else
  { grep -v '^#' tests/check/adversarial.txt | awk 'NF && ++n % 5 == 1'; grep -v '^#' tests/check/mma.txt; } \
    > /tmp/forkattn-sanitize.txt
fi
init="import torch, sys, ctypes; torch.zeros(1, device='cuda')"
pytest_drv="$init; import pytest; \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-k', '$sel'] + '$files'.split()))"
check_drv="$init; cli = ctypes.CDLL('$PWD/$b/libforkattn_cli_dl.so'); \
argv = [b'forkattn', b'check', b'--batch', b'/tmp/forkattn-sanitize.txt']; \
sys.exit(cli.forkattn_cli_main(len(argv), (ctypes.c_char_p * len(argv))(*argv)))"
status=0
for run in ${FORKATTN_SANITIZE_RUNS:-pytest check}; do
  drv=$pytest_drv
  [ "$run" = check ] && drv=$check_drv
  for tool in ${FORKATTN_SANITIZE_TOOLS:-memcheck initcheck racecheck}; do
    log="$final/sanitizer_${run}_$tool.txt"
    # API errors unreported: a direct launch site counts its kernel's parameters by asking for one
    # past the last (cuFuncGetParamInfo fails there by design, gpu_launch_direct.c); the offload
    # runtime reports the failures of its own calls
    FORKATTN_BACKEND=gpu timeout "${FORKATTN_SANITIZE_TIMEOUT:-300}" bash bench/gpu_run.sh "$cs" --tool "$tool" \
      --report-api-errors no --error-exitcode 9 python3 -c "$drv" > "$log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    echo "$run $tool rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|^check:|initialized before' "$log" |
      tr '\n' ' ')"
  done
done
exit $status
