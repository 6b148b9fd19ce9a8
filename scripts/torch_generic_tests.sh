#!/usr/bin/env bash
# torch's generic distributed tests against the crossbar backend (CPU tensors).
#   scripts/torch_generic_tests.sh [pytest -k expression]      (default: the collective tests)
# Env: CROSSBAR_BUILD_DIR (default build), WORLD_SIZE (default 2), JUNIT (xml report path),
#   CROSSBAR_UNGATE=0 (keep torch's backend-name gates; see torch_generic_tests.py).
# Not in CI: each test spawns WORLD_SIZE fresh processes; the full suite takes over an hour
# on two cores. Results are recorded in docs/torch-backend.md.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${CROSSBAR_BUILD_DIR:-build}
export PYTHONPATH="$PWD/$BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}"
export BACKEND=crossbar WORLD_SIZE=${WORLD_SIZE:-2}
export TEMP_DIR=${TEMP_DIR:-$(mktemp -d)}
# torch's test harness imports expecttest; pytest-timeout bounds a hung test.
for m in expecttest pytest_timeout; do
  python3 -c "import $m" 2>/dev/null && continue
  echo "torch_generic_tests: pip installing ${m//_/-}"
  python3 -m pip install -q --disable-pip-version-check "${m//_/-}" ||
    python3 -m pip install -q --disable-pip-version-check --break-system-packages "${m//_/-}"
done
FILTER=${1:-"test_all_reduce or test_broadcast or test_reduce or test_all_gather or test_gather or test_scatter or test_all_to_all or test_send_recv or test_isend or test_irecv or test_barrier or test_batch_isend or test_DistributedDataParallel or test_ddp or test_backend or test_get_rank or test_new_group or test_destroy or test_get_backend or test_monitored or test_average or test_coalesc"}
args=(-q -p no:cacheprovider -k "$FILTER" -o "python_files=*.py" --timeout-method=thread)
python3 -c "import pytest_timeout" 2>/dev/null && args+=(--timeout=300) || args=(-q -p no:cacheprovider -k "$FILTER")
[[ -n "${JUNIT:-}" ]] && args+=(--junitxml "$JUNIT")
exec python3 -m pytest "${args[@]}" scripts/torch_generic_tests.py -rs
