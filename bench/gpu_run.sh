#!/usr/bin/env bash
# On the GPU node: run a program of a copied build folder through .gpu/run (the offload runtime
# and extra libraries packed by bench/gpu_pack.sh), with that build folder on LD_LIBRARY_PATH.
# Usage: bash bench/gpu_run.sh <program> [args...]
set -e
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -f "$root/.gpu/run" ] || [ ! -f "$root/.gpu/runtime.stamp" ]; then
  echo "gpu_run: no .gpu bundle from bench/gpu_pack.sh: run bash bench/gpu_pack.sh [build folder]" >&2
  exit 1
fi
# The program's build folder (its own, or the one above for tests/) after the caller's entries,
# which still win (a variant library under test): the binaries' RUNPATH names the folder they
# were linked in, which a build folder copied to this machine is not.
prog=$(command -v "$1" || true)
if [ -n "$prog" ]; then
  for d in "$(dirname "$prog")" "$(dirname "$(dirname "$prog")")"; do
    if [ -f "$d/libforkattn.so.0" ]; then
      LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(cd "$d" && pwd)"
      break
    fi
  done
fi
export LD_LIBRARY_PATH
exec bash "$root/.gpu/run" "$@"
