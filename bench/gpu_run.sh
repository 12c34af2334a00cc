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
export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec bash "$root/.gpu/run" "$@"
