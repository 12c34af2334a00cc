#!/usr/bin/env bash
# Pack the shared libraries our binaries need beyond glibc and the LLVM offload
# runtime (OpenBLAS, hwloc, Criterion and their dependencies) into
# .gpu/extra.tar.xz, for a GPU machine that lacks them (e.g. the lent H200,
# Ubuntu 24.04 without these packages). Run from the project root after
# ../shared/tools/gpu-bundle; on the GPU machine use bench/gpu_run.sh.
# Usage: bench/gpu_pack_libs.sh <binary>...
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 <binary>..." >&2; exit 2; }
mkdir -p .gpu
tmp=$(mktemp -d)
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl|librt|libomptarget|libLLVM|libz3|libomp\.so|libforkattn)'
for b in "$@"; do
  ldd "$b" | awk '$3 ~ /^\// {print $1, $3}' | while read -r name path; do
    [[ $name =~ $skip ]] || cp -Ln "$path" "$tmp/$name" 2>/dev/null || true
  done
done
tar -C "$tmp" -cf - . | xz -T0 -6 > .gpu/extra.tar.xz
echo "packed $(ls "$tmp" | wc -l) libraries into .gpu/extra.tar.xz ($(du -h .gpu/extra.tar.xz | cut -f1))"
rm -rf "$tmp"
