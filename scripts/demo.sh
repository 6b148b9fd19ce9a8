#!/usr/bin/env bash
# Sets up, builds and runs the main CPU demo: what crossbar sees on this machine,
# then a self-launched 4-rank run over shared memory and UCX.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${CROSSBAR_BUILD_DIR:-build}
scripts/setup.sh "$BUILD_DIR"
"$BUILD_DIR/bin/crossbar-info" --brief
exec "$BUILD_DIR/bin/crossbar-demo" --nranks 4
