#!/usr/bin/env bash
# Pack what an offload build needs on a GPU node that lacks LLVM 19's offload runtime or our
# other dependencies, into .gpu/ at the project root (ignored by git):
#   .gpu/runtime.tar.xz  libomptarget, libomp and the libLLVM and libz3 they load (Debian's
#                        clang-19 / libomp-19-dev), rebuilt only when those libraries change;
#   .gpu/extra.tar.xz    every other shared library the given binaries load beyond glibc
#                        (OpenBLAS, hwloc, Criterion, Open MPI and their dependencies);
#   .gpu/run             the runner: `bash .gpu/run <program> [args...]` unpacks both once
#                        into /tmp (again when a tarball changes), puts them on
#                        LD_LIBRARY_PATH and runs the program. bench/gpu_run.sh goes through it.
# Usage: bash bench/gpu_pack.sh [BINARY|BUILD_DIR...]
# A build folder stands for its libforkattn.so, forkattn CLI and tests/test_* binaries; with no
# argument, build-gpu. Copy .gpu/ with the build folder to the node.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$root/.gpu
die() { echo "gpu_pack: $*" >&2; exit 1; }
install_hint="install it with: apt-get install clang-19 libomp-19-dev"

command -v xz > /dev/null || die "xz not found; install it with: apt-get install xz-utils"

# Fingerprint of files (name, size, modification time): the tarballs are rebuilt when it changes.
fingerprint() { stat -L -c '%n %s %Y' "$@" | md5sum | cut -d' ' -f1; }

# Pack FILES into TARBALL (flat, by their names) unless STAMPFILE holds their fingerprint already.
pack() {
  local tarball=$1 stampfile=$2
  shift 2
  local stamp tmp
  stamp=$(fingerprint "$@")
  if [ -f "$tarball" ] && [ "$(cat "$stampfile" 2> /dev/null)" = "$stamp" ]; then
    echo "gpu_pack: ${tarball#"$root"/} is up to date"
    return
  fi
  tmp=$(mktemp -d)
  cp -L "$@" "$tmp/"
  echo "gpu_pack: compressing ${tarball#"$root"/} ($# libraries; a minute or so)..."
  # the files alone, no "./" entry: unpacking one would give the target folder mktemp's mode 0700
  find "$tmp" -maxdepth 1 -type f -printf '%f\n' | tar -C "$tmp" -cf - -T - | xz -T0 -6 > "$tarball.part"
  rm -rf "$tmp"
  mv "$tarball.part" "$tarball"
  echo "$stamp" > "$stampfile"
}

# --- the binaries and the extra libraries they load (checked before any packing)
binaries=()
[ $# -gt 0 ] || set -- "$root/build-gpu"
for arg in "$@"; do
  if [ -d "$arg" ]; then
    for f in "$arg/libforkattn.so" "$arg/forkattn" "$arg"/tests/test_*; do
      [ -f "$f" ] && binaries+=("$f")
    done
  elif [ -f "$arg" ]; then
    binaries+=("$arg")
  else
    die "$arg: no such binary or build folder"
  fi
done
[ ${#binaries[@]} -gt 0 ] || die "no binaries in $* (build the offload build first: docs/build.md)"
# glibc, the offload runtime (packed apart) and our own library (in the build folder) stay out
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl|librt|libomptarget|libomp\.so|libLLVM|libz3|libforkattn)'
declare -A extra=()
for b in "${binaries[@]}"; do
  deps=$(ldd "$b") || die "ldd $b failed (not a dynamically linked binary?)"
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    [[ $name =~ $skip ]] && continue
    if [ "$path" = not ]; then
      echo "gpu_pack: warning: $b needs $name, which is not found here: not packed" >&2
    elif [ -z "${extra[$name]:-}" ]; then
      extra[$name]=$path
    fi
  done <<< "$deps"
done

# --- the offload runtime: libomptarget and libomp from LLVM's libdir, and the libLLVM and libz3
# the loader resolves for libomptarget (Debian keeps those in the system libdir).
llvm_lib=$(llvm-config-19 --libdir 2> /dev/null || echo /usr/lib/llvm-19/lib)
omptarget=$llvm_lib/libomptarget.so.19.1
[ -f "$omptarget" ] || die "LLVM 19's offload runtime ($omptarget) not found; $install_hint"
runtime=("$omptarget")
for name in libomp.so.5 libLLVM.so.19.1 libz3.so.4; do
  path=$(ldd "$omptarget" | awk -v n="$name" '$1 == n && $3 ~ /^\// {print $3}')
  [ -n "$path" ] || die "$name, which LLVM 19's offload runtime loads, not found; $install_hint"
  runtime+=("$path")
done

mkdir -p "$out"
pack "$out/runtime.tar.xz" "$out/runtime.stamp" "${runtime[@]}"
if [ ${#extra[@]} -gt 0 ]; then
  pack "$out/extra.tar.xz" "$out/extra.stamp" "${extra[@]}"
else
  rm -f "$out/extra.tar.xz" "$out/extra.stamp"
fi

# --- the runner, self-contained so that .gpu/ works copied anywhere
cat > "$out/run" << 'RUN'
#!/usr/bin/env bash
# Written by bench/gpu_pack.sh. Usage: bash .gpu/run <program> [args...]
# Unpacks the offload runtime (and the extra libraries, if packed) beside this script into /tmp
# once per packing, puts them first on LD_LIBRARY_PATH and runs the program.
set -e
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# unpack NAME.tar.xz into DIR unless DIR/.ok holds NAME.stamp
unpack() {
  local stamp have f
  stamp=$(cat "$here/$1.stamp")
  [ "$(cat "$2/.ok" 2> /dev/null)" = "$stamp" ] && return
  # one process unpacks, the others (ranks that mpirun starts together) wait for it
  exec 9> "$2.lock"
  flock 9
  if [ "$(cat "$2/.ok" 2> /dev/null)" != "$stamp" ]; then
    rm -rf "$2" && mkdir -p "$2" && tar -C "$2" -xJf "$here/$1.tar.xz"
    if [ "$1" = extra ]; then
      # keep only what this machine lacks: shadowing its own libstdc++, libz, ... breaks tools
      # injected into the process (compute-sanitizer)
      have=$( (ldconfig -p || /sbin/ldconfig -p) 2> /dev/null | awk '{print $1}')
      for f in "$2"/*; do
        if grep -qxF "$(basename "$f")" <<< "$have"; then rm -f "$f"; fi
      done
    fi
    echo "$stamp" > "$2/.ok"
  fi
  exec 9>&-
}
rt=/tmp/forkattn-gpu-rt
unpack runtime "$rt"
path=$rt
if [ -f "$here/extra.tar.xz" ]; then
  unpack extra /tmp/forkattn-gpu-extra
  path=$path:/tmp/forkattn-gpu-extra
fi
export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$@"
RUN
chmod +x "$out/run"
echo "gpu_pack: .gpu ready ($(du -sh "$out" | cut -f1)); on the GPU node: bash .gpu/run <program> [args]"
