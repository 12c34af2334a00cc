#!/usr/bin/env bash
# Is the CPU backend bitwise the same in two builds? Runs tests/bitwise/fingerprint.py (digests of
# every system's outputs on fixed inputs) and the `forkattn check` batches of tests/check with
# each build, each with its own source tree's Python binding, and diffs the listings.
#   bash tests/bitwise/compare.sh OLD_BUILD NEW_BUILD      (exit 0: identical)
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OLD_BUILD NEW_BUILD" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() { # build label
  local build=$(cd "$1" && pwd) src
  src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")
  FORKATTN_LIBRARY="$build/libforkattn.so" PYTHONPATH="$src/python" \
    python3 "$here/fingerprint.py" > "$out/$2.fingerprint"
  for batch in "$here"/../check/*.txt; do
    "$build/forkattn" check --batch "$batch" --backend cpu || true
  done > "$out/$2.check" 2>&1
}
run "$1" old
run "$2" new
status=0
diff "$out/old.fingerprint" "$out/new.fingerprint" || status=1
diff "$out/old.check" "$out/new.check" || status=1
echo "$(wc -l < "$out/new.fingerprint") digests, $(wc -l < "$out/new.check") check lines: \
$([ $status -eq 0 ] && echo identical || echo DIFFERENT)"
exit $status
