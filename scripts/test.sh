#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (C++ via ctest, Python via pytest).
#   scripts/test.sh [ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${CROSSBAR_BUILD_DIR:-build}
scripts/setup.sh "$BUILD_DIR"

status=0
echo "==== C++ tests (ctest) ===="
# Multi-rank tests fork up to 8 processes each; run them one at a time so they
# do not starve each other on small machines.
(cd "$BUILD_DIR" && ctest --output-on-failure --timeout 900 "$@") || status=1

if compgen -G "tests/python/test_*.py" >/dev/null; then
  echo "==== Python tests (pytest) ===="
  CROSSBAR_BUILD_DIR="$BUILD_DIR" python3 -m pytest -q tests/python || status=1
fi
exit $status
