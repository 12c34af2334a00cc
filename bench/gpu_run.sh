#!/usr/bin/env bash
# On the GPU machine: unpack .gpu/extra.tar.xz (see gpu_pack_libs.sh) once,
# put it after the offload runtime on LD_LIBRARY_PATH, and run the command
# through .gpu/run (the LLVM 19 offload runtime bundle).
# Usage: bash bench/gpu_run.sh <program> [args...]
set -e
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
extra=/tmp/forkattn-gpu-extra
if [ -f "$root/.gpu/extra.tar.xz" ] && [ ! -f "$extra/.ok" ]; then
  mkdir -p "$extra" && tar -C "$extra" -xJf "$root/.gpu/extra.tar.xz"
  # keep only what the machine lacks: shadowing its own libc++/libstdc++/... breaks
  # tools injected into the process (compute-sanitizer)
  for f in "$extra"/*; do
    if ldconfig -p | grep -qF "$(printf '\t%s ' "$(basename "$f")")"; then rm -f "$f"; fi
  done
  touch "$extra/.ok"
fi
export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec bash "$root/.gpu/run" "$@"
