#!/usr/bin/env bash
# Sets up, builds and runs the main CPU demo:
#   1. what crossbar sees on this machine (crossbar-info --brief);
#   2. all_reduce_perf, self-launched with 4 ranks (nccl-tests' output format);
#   3. crossbar-demo: 4 ranks in 2 virtual nodes, so traffic crosses both the
#      shared-memory and the UCX transport.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${CROSSBAR_BUILD_DIR:-build}
scripts/setup.sh "$BUILD_DIR"
bin="$BUILD_DIR/bin"
"$bin/crossbar-info" --brief
echo
"$bin/all_reduce_perf" --nranks 4 -b 8 -e 64M -f 4
echo
"$bin/crossbar-demo" --nranks 4 --ranks-per-node 2 --max-bytes 16M
