#!/usr/bin/env bash
# Real-NCCL check of the crossbar NCCL plugins on a GPU machine: builds the profiler and
# tuner plugins and tests/telemetry/nccl_plugin_check.cc with g++ alone (no CMake, no
# fmt/hwloc/UCX packages: fmt comes header-only from third_party/; the profiler carries
# its own copy of the telemetry core), then runs NCCL allreduces with
# NCCL_PROFILER_PLUGIN / NCCL_TUNER_PLUGIN set and checks what the plugins saw.
#
# usage: tests/telemetry/nccl_plugin_check.sh [--build-only | --no-build]
#   --no-build  run what an earlier --build-only left in $OUT/bin (carried prebuilt)
#   env: CUDA_HOME (default /usr/local/cuda), NCCL_HOME (nccl.h/libnccl.so when they are
#        not in CUDA_HOME or /usr), CXX (default g++), OUT (logs + build; default
#        build-nccl-plugin-check/)
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUTDIR=${OUT:-$ROOT/build-nccl-plugin-check}
BIN=$OUTDIR/bin
mkdir -p "$BIN"
CXX=${CXX:-g++}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
inc=(-I"$ROOT" -isystem "$CUDA_HOME/include")
lib=(-L"$CUDA_HOME/lib64" -L/usr/lib/x86_64-linux-gnu)
if [ -n "${NCCL_HOME:-}" ]; then inc+=(-isystem "$NCCL_HOME/include"); lib+=(-L"$NCCL_HOME/lib"); fi
fmt=()
if ! echo '#include <fmt/format.h>' | "$CXX" -std=c++20 -E -x c++ - >/dev/null 2>&1; then
  fmt=(-isystem "$ROOT/third_party/fmt/include")
fi
flags=(-std=c++20 -O2 -g -Wall -Wextra -fPIC -DFMT_HEADER_ONLY "${fmt[@]}")

MODE=${1:-}
set -e
if [ "$MODE" = "--no-build" ]; then
  echo "[nccl_plugin_check] using prebuilt $BIN"
else
echo "[nccl_plugin_check] building in $BIN"
# Profiler: the plugin + the telemetry core + the three comm sources it uses, one .so
# exporting only ncclProfiler_v5 and the stats function.
"$CXX" "${flags[@]}" -I"$ROOT" -fvisibility=hidden -shared -Wl,--no-undefined \
  "$ROOT/plugins/nccl/profiler.cc" "$ROOT/telemetry/telemetry.cc" \
  "$ROOT/comm/env.cc" "$ROOT/comm/log.cc" "$ROOT/comm/errors.cc" \
  -o "$BIN/libnccl-profiler-crossbar.so" -lpthread
"$CXX" "${flags[@]}" -I"$ROOT" -fvisibility=hidden -shared -Wl,--no-undefined \
  "$ROOT/plugins/nccl/tuner.cc" -o "$BIN/libnccl-tuner-crossbar.so"
"$CXX" -std=c++17 -O2 -g -Wall -Wextra "${inc[@]}" "$ROOT/tests/telemetry/nccl_plugin_check.cc" \
  -o "$BIN/nccl_plugin_check" "${lib[@]}" -lnccl -lcudart -ldl -Wl,-rpath,"$CUDA_HOME/lib64"
for so in "$BIN"/libnccl-*-crossbar.so; do
  exported=$(nm -D --defined-only "$so" | awk '{print $3}' | grep -v '^_' | sort | tr '\n' ' ')
  echo "  $(basename "$so") exports: $exported"
done
fi
[ "$MODE" = "--build-only" ] && exit 0
set +e

cat > "$OUTDIR/tuning.csv" <<'CSV'
collective,min_bytes,max_bytes,nranks,nnodes,algorithm,protocol,channels
allreduce,0,64K,*,*,ring,ll,2
allreduce,64K,*,*,*,ring,simple,0
CSV
echo "[nccl_plugin_check] running"
NCCL_PROFILER_PLUGIN=$BIN/libnccl-profiler-crossbar.so NCCL_TUNER_PLUGIN=$BIN/libnccl-tuner-crossbar.so \
  CROSSBAR_TELEMETRY=1 CROSSBAR_TELEMETRY_DIR=$OUTDIR/telemetry CROSSBAR_TUNER_TABLE=$OUTDIR/tuning.csv \
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV,TUNING NCCL_DEBUG_FILE=$OUTDIR/nccl-debug.%p.log \
  timeout 180 "$BIN/nccl_plugin_check"
rc=$?
echo "[nccl_plugin_check] NCCL's own lines about the plugins:"
grep -hiE "profiler|tuner" "$OUTDIR"/nccl-debug.*.log 2>/dev/null | head -20
echo "[nccl_plugin_check] exit $rc"
exit $rc
