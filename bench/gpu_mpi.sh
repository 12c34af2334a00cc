#!/usr/bin/env bash
# Run on a machine with two GPUs (kind nvidia-h200-x2): multi-rank tree
# attention, one GPU per rank (device = local rank), against the whole tree
# on one GPU, in the same run (tests/test_tree_mpi.c --bench).
# Usage: bash bench/gpu_mpi.sh <offload build with -DFORKATTN_MPI=ON>; logs to $OUT.
set -uo pipefail
b=${1:-build-gpu}
final=${OUT:-gpu-logs}
mkdir -p "$final"
export OMP_TARGET_OFFLOAD=mandatory FORKATTN_BACKEND=gpu
nvidia-smi -L | tee "$final/mpi.txt"
status=0
for shape in "--prompt 256 --leaves 8 --max-seg 128" \
             "--prompt 4096 --leaves 16 --max-seg 1024 --hq 32 --hkv 8 --d 128"; do
  for np in 1 2; do
    echo "### mpirun -np $np test_tree_mpi --bench $shape" | tee -a "$final/mpi.txt"
    # shellcheck disable=SC2086
    mpirun -np $np --allow-run-as-root -x OMP_TARGET_OFFLOAD -x FORKATTN_BACKEND -x LD_LIBRARY_PATH \
      bash bench/gpu_run.sh "$b/tests/test_tree_mpi" --bench $shape 2>&1 | tee -a "$final/mpi.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
done
exit $status
