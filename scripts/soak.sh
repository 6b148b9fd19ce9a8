#!/usr/bin/env bash
# Soak test (not in CI): random collectives, sizes, types, ops, algorithms and rank counts
# (2..max, sometimes split into virtual nodes over UCX; call-check mode random per round)
# for a set time, checking every result on every rank. Prints one line per round and a
# summary; exits non-zero if any round failed (the same --seed replays the same rounds).
#
#   scripts/soak.sh                 10 minutes, seed 1, up to 6 ranks
#   scripts/soak.sh 3600 --seed 7 --max-ranks 8 --max-count 1048576 --ops 100
#   scripts/soak.sh 900 --node-threads 2 --stall-stacks /tmp/stacks   (chase a stall: every
#       round on virtual nodes with threads; stalled ranks' queues and gdb stacks)
#
# Builds bin/crossbar-soak in $CROSSBAR_BUILD_DIR (default build). With sanitizers:
#   CROSSBAR_BUILD_DIR=build-asan scripts/soak.sh 600   (after scripts/sanitize.sh --asan)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
shift || true
dir=${CROSSBAR_BUILD_DIR:-build}
[[ -f $dir/build.ninja ]] || cmake -S . -B "$dir" -G Ninja >/dev/null
ninja -C "$dir" crossbar-soak >/dev/null
export UCX_MEM_EVENTS=${UCX_MEM_EVENTS:-no}
exec "$dir/bin/crossbar-soak" --seconds "$seconds" "$@"
