#!/bin/sh
# check_device_image.sh <binary> [sm_XX]
#
# Checks that every NVPTX device image (cubin) embedded in <binary> carries the ELF header that
# LLVM 19's libomptarget accepts: OS/ABI 0x33, ABI version 7, e_flags = sm | sm<<16 | 0x500
# (plus 0x800 for sm_XXa), and, if given, that sm is the expected one. Exits non-zero on a
# mismatch or when no device image is found. See docs/toolchain-notes.md.
#
# The images live in section .llvm.offloading, each wrapped in an OffloadBinary (magic 10 ff 10
# ad): header {magic, u32 version, u64 size, u64 entry offset, u64 entry size}; entry {u16 image
# kind, u16 offload kind, u32 flags, u64 string offset, u64 string count, u64 image offset, u64
# image size}; string entries {u64 key offset, u64 value offset}; offsets relative to the header.
# If no OffloadBinary is found, ELF headers are located in the section by their magic.
# Needs only readelf (binutils) and od/tail/head/tr (coreutils).
set -u
bin=${1:?usage: check_device_image.sh <binary> [sm_XX]}
want=${2:-}
want=${want#sm_}
want=${want%a}
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT

u() { od -An -tu"$3" -j"$2" -N"$3" "$1" | tr -d ' \n'; }      # u FILE OFFSET BYTES (little endian)
hex() { od -An -tx1 -j"$2" -N"$3" "$1" | tr -d ' \n'; }      # hex FILE OFFSET BYTES
cut_out() { tail -c +$(($2 + 1)) "$1" | head -c "$3"; }       # cut_out FILE OFFSET BYTES
cstr() { cut_out "$1" "$2" 256 | tr '\0' '\n' | head -n 1; }  # NUL-terminated string

# ---- the .llvm.offloading section ---------------------------------------------------------
line=$(readelf -SW "$bin" | sed -n 's/^.*\] *\.llvm\.offloading  *//p')
if [ -z "$line" ]; then
  echo "FAIL: $bin: no .llvm.offloading section (no device image embedded)"
  exit 1
fi
# shellcheck disable=SC2086 # split on purpose
set -- $line                          # type address offset size ...
off=$((0x$3)) size=$((0x$4))
cut_out "$bin" "$off" "$size" > "$tmp/sec"
echo "$bin: .llvm.offloading at file offset $off, $size bytes"

# ---- extract the images -----------------------------------------------------------------
n=0
pos=0
while [ $((pos + 32)) -le "$size" ]; do
  if [ "$(hex "$tmp/sec" "$pos" 4)" != 10ff10ad ]; then
    pos=$((pos + 8)); continue        # alignment padding between OffloadBinaries
  fi
  bsize=$(u "$tmp/sec" $((pos + 8)) 8)
  e=$((pos + $(u "$tmp/sec" $((pos + 16)) 8)))
  strs=$(u "$tmp/sec" $((e + 8)) 8) nstr=$(u "$tmp/sec" $((e + 16)) 8)
  ioff=$(u "$tmp/sec" $((e + 24)) 8) isize=$(u "$tmp/sec" $((e + 32)) 8)
  meta='' i=0
  while [ "$i" -lt "$nstr" ]; do
    k=$(u "$tmp/sec" $((pos + strs + 16 * i)) 8) v=$(u "$tmp/sec" $((pos + strs + 16 * i + 8)) 8)
    meta="$meta $(cstr "$tmp/sec" $((pos + k)))=$(cstr "$tmp/sec" $((pos + v)))"
    i=$((i + 1))
  done
  cut_out "$tmp/sec" $((pos + ioff)) "$isize" > "$tmp/img$n"
  echo "  OffloadBinary at +$pos: image kind $(u "$tmp/sec" "$e" 2), $isize bytes,$meta"
  n=$((n + 1))
  pos=$((pos + (bsize + 7) / 8 * 8))
done
if [ "$n" -eq 0 ]; then               # fallback: ELF64 headers found by their magic
  echo "  no OffloadBinary header (magic 10ff10ad); scanning for ELF headers"
  for p in $(od -An -v -tx1 "$tmp/sec" | tr -d ' \n' | grep -ob 7f454c4602 | cut -d: -f1); do
    [ $((p % 2)) -eq 0 ] || continue
    p=$((p / 2))
    end=$(( $(u "$tmp/sec" $((p + 40)) 8) + $(u "$tmp/sec" $((p + 60)) 2) * $(u "$tmp/sec" $((p + 58)) 2) ))
    ph=$(( $(u "$tmp/sec" $((p + 32)) 8) + $(u "$tmp/sec" $((p + 56)) 2) * $(u "$tmp/sec" $((p + 54)) 2) ))
    [ "$ph" -gt "$end" ] && end=$ph
    cut_out "$tmp/sec" "$p" "$end" > "$tmp/img$n"
    echo "  ELF at +$p, $end bytes"
    n=$((n + 1))
  done
fi

# ---- check each NVPTX cubin -------------------------------------------------------------
found=0 bad=0 i=0
while [ "$i" -lt "$n" ]; do
  img=$tmp/img$i
  i=$((i + 1))
  if [ "$(hex "$img" 0 4)" != 7f454c46 ] || [ "$(u "$img" 18 2)" != 190 ]; then
    echo "  image $((i - 1)): not an NVPTX ELF, skipped"
    continue
  fi
  found=$((found + 1))
  osabi=$(u "$img" 7 1) abiv=$(u "$img" 8 1) flags=$(u "$img" 48 4)
  sm=$((flags & 0xff))
  expect=$((sm | sm << 16 | 0x500))
  readelf -h "$img" | grep -E 'OS/ABI|ABI Version|Flags' | sed "s/^ */  image $((i - 1)): /"
  if [ "$osabi" -eq 65 ]; then        # CUDA 13 ABI: SM in e_flags bits 8-15
    msg=" new CUDA ELF ABI (OS/ABI 0x41) for sm_$(((flags >> 8) & 0xff)), which LLVM 19's"
    msg="$msg libomptarget rejects (linked without the nvlink ELF fix?)"
  else
    msg=''
    [ "$osabi" -eq 51 ] || msg="$msg OS/ABI $(printf 0x%x "$osabi") != 0x33;"
    [ "$abiv" -eq 7 ] || msg="$msg ABI version $abiv != 7;"
    [ $((flags & ~0x800)) -eq "$expect" ] ||
      msg="$msg e_flags $(printf 0x%x "$flags") != sm|sm<<16|0x500 ($(printf 0x%x "$expect"));"
    [ -z "$want" ] || [ "$sm" -eq "$want" ] || msg="$msg sm_$sm != sm_$want;"
  fi
  if [ -n "$msg" ]; then
    echo "  image $((i - 1)): FAIL:$msg"
    bad=$((bad + 1))
  else
    echo "  image $((i - 1)): OK (sm_$sm, old CUDA ELF ABI as LLVM 19's libomptarget expects)"
  fi
done

if [ "$found" -eq 0 ]; then
  echo "FAIL: no NVPTX device image found in $bin"
  exit 1
fi
[ "$bad" -eq 0 ] || { echo "FAIL: $bad of $found NVPTX image(s) have the wrong ELF header"; exit 1; }
echo "PASS: $found NVPTX image(s) with the expected header"
