#!/usr/bin/env bash
# Run the Python binding's tests against one build of libforkattn, or against the installed package.
#
#   python/run_tests.sh [BUILD_DIR | path/to/libforkattn.so] [pytest arguments...]
#   python/run_tests.sh --installed [pytest arguments...]
#
# BUILD_DIR defaults to the repository's build/. The interpreter is $PYTHON (default python3).
# --installed: the forkattn that $PYTHON imports (pip install ., with its bundled library), with
# FORKATTN_LIBRARY unset; the tests run from a copy outside the source tree, so that neither
# python/forkattn nor build/ is reachable (tests that need the source tree skip and say so).
# Without PyTorch only the numpy-only tests run (test_lib.py, test_abi_layout.py, test_numpy.py,
# test_alignment.py and the numpy part of test_boundary.py; without numpy test_lib.py and
# test_abi_layout.py alone), and the script says so.
# Exit status: pytest's; 77 (skipped) when pytest itself is missing; 2 when the library is not found.
# FORKATTN_TEST_INDUCTOR=0 skips the one torch.compile test that uses inductor (~25 s).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
py=${PYTHON:-python3}
export PYTHONDONTWRITEBYTECODE=1

if ! "$py" -c "import pytest" 2>/dev/null; then
  echo "run_tests.sh: SKIPPED: pytest is not installed for $py (pip install pytest numpy)" >&2
  exit 77
fi

if [ "${1:-}" = --installed ]; then
  shift
  unset FORKATTN_LIBRARY
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cp -r "$here/tests" "$work/"
  cd "$work"
  if ! lib=$("$py" -c "import sys; sys.modules['torch'] = None; import forkattn; print(forkattn.library_path())"); then
    echo "run_tests.sh: $py cannot load an installed forkattn (pip install $repo)" >&2
    exit 2
  fi
  case "$lib" in
    "$repo"/*) echo "run_tests.sh: the installed forkattn loads $lib, inside the source tree" >&2; exit 2 ;;
  esac
else
  target=${1:-$repo/build}
  [ $# -gt 0 ] && shift
  if [ -d "$target" ]; then
    lib="$target/libforkattn.so"
  else
    lib="$target"
  fi
  if [ ! -e "$lib" ]; then
    echo "run_tests.sh: no library at $lib (build it: cmake -S . -B build && cmake --build build)" >&2
    exit 2
  fi
  lib=$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")
  export FORKATTN_LIBRARY=$lib
  export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
  cd "$here"
fi

files=()
if "$py" -c "import torch" 2>/dev/null; then
  echo "run_tests.sh: $lib, torch $("$py" -c 'import torch; print(torch.__version__)')"
  files=(tests)
elif "$py" -c "import numpy" 2>/dev/null; then
  echo "run_tests.sh: torch is not installed for $py: SKIPPING the torch tests; running the" \
       "numpy-only tests (tests/test_lib.py tests/test_abi_layout.py tests/test_numpy.py" \
       "tests/test_alignment.py tests/test_boundary.py) against $lib"
  files=(tests/test_lib.py tests/test_abi_layout.py tests/test_numpy.py tests/test_alignment.py
         tests/test_boundary.py)
else
  echo "run_tests.sh: neither torch nor numpy is installed for $py: SKIPPING the torch and numpy" \
       "tests; running tests/test_lib.py tests/test_abi_layout.py against $lib"
  files=(tests/test_lib.py tests/test_abi_layout.py)
fi
"$py" -m pytest -q -p no:cacheprovider "${files[@]}" "$@"
