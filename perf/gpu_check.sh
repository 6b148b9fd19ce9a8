#!/usr/bin/env bash
# GPU validation for symmem/cuda on one machine with one GPU, in about 6 minutes:
#   1. builds the GPU self-test and the copy-engine benchmark directly with nvcc/g++
#      (needs only the CUDA toolkit and g++; fmt from third_party/ if missing),
#   2. runs every GPU check (perf/gpu/gpu_selftest: VMM across 2 processes, stream
#      signals, copy engine, SymmDeviceHandle kernel, multicast),
#   3. runs the copy-engine bandwidth benchmark (perf/gpu/ce_bandwidth),
#   4. if cmake+ninja and the project's dependencies are present: builds and runs the
#      gtest binaries test_symmem_cuda and test_symmem_cuda_gpu (the latter also holds the
#      checks that need the whole library: SymmetricHeap with the CUDA allocator across 2
#      processes, stream signals on heap pads, makeDeviceHandle kernels, and a one-rank NCCL
#      communicator with a registered window + allreduce; the direct build cannot run those),
#   5. runs compute-sanitizer memcheck on the kernel check if available,
# then prints a summary table. Logs go to $OUT (or ./build-gpu-check-logs).
#
# usage: perf/gpu_check.sh [--build-only] [--no-cmake] [--no-sanitizer] [--prebuilt DIR]
#   --prebuilt DIR  use gpu_selftest/ce_bandwidth from DIR when nvcc is missing or the build fails
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOG=${OUT:-$ROOT/build-gpu-check-logs}
mkdir -p "$LOG"
BUILD_ONLY=0 USE_CMAKE=1 USE_SANITIZER=1 PREBUILT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build-only) BUILD_ONLY=1 ;;
    --no-cmake) USE_CMAKE=0 ;;
    --no-sanitizer) USE_SANITIZER=0 ;;
    --prebuilt) PREBUILT=$2; shift ;;
    *) echo "usage: $0 [--build-only] [--no-cmake] [--no-sanitizer] [--prebuilt DIR]"; exit 2 ;;
  esac
  shift
done
BUDGET=${GPU_CHECK_BUDGET_S:-360}  # whole-script target; later stages are skipped past it
START=$SECONDS
SUMMARY=()
FAILED=0
note() { echo "[gpu_check +$((SECONDS - START))s] $*"; }
record() {  # stage status detail
  SUMMARY+=("$(printf '%-28s %-6s %s' "$1" "$2" "$3")")
  [ "$2" = FAIL ] && FAILED=1
  note "$1: $2 $3"
}
left() { echo $((BUDGET - (SECONDS - START))); }

note "root $ROOT, logs $LOG, budget ${BUDGET}s"
{ nvidia-smi || true; nvidia-smi topo -m || true; } > "$LOG/nvidia-smi.txt" 2>&1
head -15 "$LOG/nvidia-smi.txt"

# ---- toolchain --------------------------------------------------------------------------
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=""
if [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC=$CUDA_HOME/bin/nvcc; elif command -v nvcc >/dev/null; then
  NVCC=$(command -v nvcc); CUDA_HOME=$(dirname "$(dirname "$NVCC")"); fi
CXX=${CXX:-g++}
command -v "$CXX" >/dev/null || CXX=""
JOBS=$(nproc 2>/dev/null || echo 4)
note "nvcc: ${NVCC:-missing}; c++: ${CXX:-missing}; cmake: $(command -v cmake || echo missing); ninja: $(command -v ninja || echo missing)"

# ---- 1. direct build (nvcc + g++, static cudart, header-only fmt) -----------------------
BIN=$ROOT/build-gpu-direct
build_direct() {
  [ -n "$NVCC" ] && [ -n "$CXX" ] || { echo "nvcc or g++ missing"; return 1; }
  local fmt_inc=""
  if ! echo '#include <fmt/format.h>' | "$CXX" -E -x c++ - >/dev/null 2>&1; then
    [ -f "$ROOT/third_party/fmt/include/fmt/format.h" ] || { echo "fmt missing and no third_party/fmt"; return 1; }
    fmt_inc="-isystem $ROOT/third_party/fmt/include"
    echo "fmt: using third_party/fmt (header-only)"
  fi
  mkdir -p "$BIN/obj"
  local flags="-std=c++20 -O2 -g -Wall -Wextra -DFMT_HEADER_ONLY $fmt_inc -I$ROOT -I$ROOT/tests/symmem_cuda -isystem $CUDA_HOME/include"
  local srcs="comm/errors.cc comm/env.cc comm/log.cc symmem/cuda/driver_api.cc symmem/cuda/vmm.cc
    symmem/cuda/stream_signal.cc symmem/cuda/copy_engine_cuda.cc tests/symmem_cuda/gpu_checks.cc
    perf/gpu/gpu_selftest.cc perf/gpu/ce_bandwidth.cc"
  local pids=() s
  for s in $srcs; do
    "$CXX" $flags -c "$ROOT/$s" -o "$BIN/obj/$(basename "$s").o" &
    pids+=($!)
  done
  "$NVCC" -std=c++17 -O2 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
    -I"$ROOT" -I"$ROOT/tests/symmem_cuda" -c "$ROOT/tests/symmem_cuda/gpu_kernels.cu" -o "$BIN/obj/gpu_kernels.cu.o" &
  pids+=($!)
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ $rc = 0 ] || return 1
  local lib="$BIN/obj/errors.cc.o $BIN/obj/env.cc.o $BIN/obj/log.cc.o $BIN/obj/driver_api.cc.o $BIN/obj/vmm.cc.o
    $BIN/obj/stream_signal.cc.o $BIN/obj/copy_engine_cuda.cc.o"
  local ldflags="-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart_static -ldl -lpthread -lrt"
  "$CXX" -o "$BIN/gpu_selftest" "$BIN/obj/gpu_selftest.cc.o" "$BIN/obj/gpu_checks.cc.o" "$BIN/obj/gpu_kernels.cu.o" \
    $lib $ldflags || return 1
  "$CXX" -o "$BIN/ce_bandwidth" "$BIN/obj/ce_bandwidth.cc.o" $lib $ldflags || return 1
  # Guard the rule "never link libcuda": the driver must come in through the runtime only.
  if command -v ldd >/dev/null && ldd "$BIN/gpu_selftest" | grep -q 'libcuda\.so'; then
    echo "gpu_selftest links libcuda directly"; return 1
  fi
}
note "building gpu_selftest + ce_bandwidth directly ($JOBS jobs)"
if build_direct > "$LOG/build-direct.log" 2>&1; then
  record "build (nvcc/g++ direct)" PASS "$((SECONDS - START))s"
else
  tail -30 "$LOG/build-direct.log"
  if [ -n "$PREBUILT" ] && [ -x "$PREBUILT/gpu_selftest" ]; then
    BIN=$PREBUILT
    record "build (nvcc/g++ direct)" FAIL "using prebuilt $PREBUILT; see build-direct.log"
  else
    record "build (nvcc/g++ direct)" FAIL "see build-direct.log"
    BIN=""
  fi
fi

if [ $BUILD_ONLY = 1 ]; then
  printf '%s\n' "${SUMMARY[@]}"
  exit $FAILED
fi

# ---- 2. GPU checks -----------------------------------------------------------------------
if [ -n "$BIN" ]; then
  "$BIN/gpu_selftest" --list > "$LOG/selftest-list.txt" 2>&1
  timeout 300 "$BIN/gpu_selftest" --timeout 120 2>&1 | tee "$LOG/selftest.log"
  rc=${PIPESTATUS[0]}
  while read -r status name rest; do
    case "$status" in PASS|FAIL|SKIP) record "check $name" "$status" "$(echo "$rest" | cut -c1-160)" ;; esac
  done < <(grep -E '^(PASS|FAIL|SKIP) ' "$LOG/selftest.log")
  [ "$rc" = 0 ] || [ "$rc" = 1 ] || record "gpu_selftest" FAIL "exit code $rc (timeout or crash)"
  # This script validates a GPU machine: nothing having run on a GPU is a failure, not a green run.
  grep -qE '^PASS ' "$LOG/selftest.log" || record "gpu present" FAIL "no check ran on a GPU (see selftest.log)"
fi

# ---- 3. copy-engine bandwidth -------------------------------------------------------------
if [ -n "$BIN" ] && [ "$(left)" -gt 60 ]; then
  if timeout 120 "$BIN/ce_bandwidth" --iters 10 --chunks 8 --max-mib 1024 2>&1 | tee "$LOG/ce_bandwidth.log"; then
    record "bench ce_bandwidth" PASS "see table above / ce_bandwidth.log"
  else
    record "bench ce_bandwidth" FAIL "see ce_bandwidth.log"
  fi
fi

# ---- 4. CMake + gtest ------------------------------------------------------------------
if [ $USE_CMAKE = 1 ] && command -v cmake >/dev/null && command -v ninja >/dev/null && [ "$(left)" -gt 120 ]; then
  CB=$ROOT/build-gpu-check
  note "cmake configure (the full project's dependencies are needed; skipped otherwise)"
  if timeout 90 cmake -S "$ROOT" -B "$CB" -G Ninja -DCROSSBAR_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCROSSBAR_BUILD_BENCHMARKS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$LOG/cmake-configure.log" 2>&1; then
    if timeout $(( $(left) - 60 > 30 ? $(left) - 60 : 30 )) ninja -C "$CB" -j "$JOBS" test_symmem_cuda test_symmem_cuda_gpu \
        > "$LOG/cmake-build.log" 2>&1; then
      record "build (cmake/ninja)" PASS ""
      for t in test_symmem_cuda test_symmem_cuda_gpu; do
        # Both binaries include the heap/NCCL tests (test_symmem_cuda_heap*.cc); list them for the log.
        "$CB/bin/$t" --gtest_list_tests > "$LOG/$t.list" 2>&1 || true
        if timeout 240 "$CB/bin/$t" --gtest_color=no > "$LOG/$t.log" 2>&1; then
          record "gtest $t" PASS "$(grep -E '^\[  (PASSED|SKIPPED) ' "$LOG/$t.log" | tr '\n' ' ')"
        else
          record "gtest $t" FAIL "$(grep -E '^\[  FAILED  \]' "$LOG/$t.log" | head -3 | tr '\n' ' ')"
        fi
      done
    else
      record "build (cmake/ninja)" FAIL "see cmake-build.log"
    fi
  else
    record "build (cmake/ninja)" SKIP "configure failed (missing deps?), see cmake-configure.log"
  fi
else
  record "build (cmake/ninja)" SKIP "cmake/ninja missing, --no-cmake, or out of time"
fi

# ---- 4b. prebuilt gtest binaries ---------------------------------------------------------
# When the GPU machine lacks the project's dependencies, gtest binaries built elsewhere can
# travel in $PREBUILT/gtest (with their shared libraries in $PREBUILT/gtest/lib).
if [ -n "$PREBUILT" ] && [ -d "$PREBUILT/gtest" ]; then
  for t in "$PREBUILT"/gtest/test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    lim=$(( $(left) - 60 < 120 ? $(left) - 60 : 120 ))
    if [ "$lim" -lt 20 ]; then record "gtest $name (prebuilt)" SKIP "out of time"; continue; fi
    note "running prebuilt $name (limit ${lim}s)"
    if LD_LIBRARY_PATH="$PREBUILT/gtest/lib:${LD_LIBRARY_PATH:-}" timeout "$lim" "$t" > "$LOG/$name.log" 2>&1; then
      record "gtest $name (prebuilt)" PASS "$(grep -E '^\[  PASSED  \]|SKIPPED' "$LOG/$name.log" | tr '\n' ' ')"
    else
      record "gtest $name (prebuilt)" FAIL "exit $?; $(grep -E '^\[  FAILED  \]' "$LOG/$name.log" | head -3 | tr '\n' ' ')"
    fi
  done
fi

# ---- 5. compute-sanitizer ------------------------------------------------------------------
# API errors are not reported: VmmAllocation first asks for a fabric handle and falls back
# to a POSIX fd when the driver answers CUDA_ERROR_NOT_PERMITTED, on purpose.
SAN=""
[ -x "$CUDA_HOME/bin/compute-sanitizer" ] && SAN=$CUDA_HOME/bin/compute-sanitizer
[ -z "$SAN" ] && command -v compute-sanitizer >/dev/null && SAN=$(command -v compute-sanitizer)
for tool in memcheck racecheck; do
  if [ $USE_SANITIZER = 1 ] && [ -n "$SAN" ] && [ -n "$BIN" ] && [ "$(left)" -gt 40 ]; then
    lim=$(( $(left) - 10 < 120 ? $(left) - 10 : 120 ))
    only=kernel_put_signal,copy_engine
    [ $tool = racecheck ] && only=kernel_put_signal
    note "compute-sanitizer $tool on $only (limit ${lim}s)"
    if timeout "$lim" "$SAN" --tool $tool --report-api-errors no --target-processes all --error-exitcode 9 \
        "$BIN/gpu_selftest" --only $only --timeout $((lim - 5)) > "$LOG/sanitizer-$tool.log" 2>&1; then
      record "compute-sanitizer $tool" PASS "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/sanitizer-$tool.log" | sort | uniq -c | tr -s ' ' | tr '\n' ' ')"
    else
      rc=$?
      record "compute-sanitizer $tool" FAIL "exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^FAIL' "$LOG/sanitizer-$tool.log" | head -3 | tr '\n' ' ')"
    fi
  else
    record "compute-sanitizer $tool" SKIP "not installed, disabled, or out of time"
  fi
done

echo
echo "==================== gpu_check summary ($((SECONDS - START)) s) ===================="
printf '%-28s %-6s %s\n' STAGE STATUS DETAIL
printf '%s\n' "${SUMMARY[@]}" | tee "$LOG/summary.txt"
[ -f "$LOG/ce_bandwidth.log" ] && { echo; cat "$LOG/ce_bandwidth.log"; }
exit $FAILED
