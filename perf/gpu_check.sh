#!/usr/bin/env bash
# GPU validation on one machine with one GPU, in about 4 minutes: every GPU test and GPU
# benchmark, then a summary table. Stages (each with its own time limit, skipped with a
# note when the whole-script budget GPU_CHECK_BUDGET_S, default 240 s, runs out):
#   build      gpu_selftest, ce_bandwidth, matmul_overlap built directly with nvcc/g++
#              (CUDA toolkit + g++ only; fmt from third_party); else taken from --prebuilt
#   selftest   perf/gpu/gpu_selftest: VMM across 2 processes, stream signals, copy engine,
#              SymmDeviceHandle kernel, multicast
#   gtest      every test_*_gpu gtest binary in PREBUILT/bin (symmem, CUDA collectives,
#              MoE, FT/NCCL, ...), built elsewhere by perf/gpu/prepare_prebuilt.sh
#   perf       all_reduce_perf / all_gather_perf / alltoall_perf --mem cuda --nranks 2
#              (two processes sharing the GPU; small-message latency and bandwidth), and
#              moe_dispatch_perf --mem cuda --nranks 2 (MoE dispatch/combine, 30 s)
#   mps        the 2-rank small-message perf runs again under the MPS daemon (both ranks'
#              kernels at once, as on two GPUs; skipped where MPS is unavailable)
#   matmul     perf/gpu/matmul_overlap: bf16 matmul alone vs with copy-engine / SM copies
#   ce         perf/gpu/ce_bandwidth: copy-engine bandwidth vs the D2D ceiling
#   torch      perf/gpu/build_torch_ext.sh builds crossbar._C against THIS machine's torch (started
#              in the background at the top, overlapping the GPU stages),
#              then pytest tests/python -k cuda (test_torch_cuda.py, test_moe_cuda.py, test_symm_cuda.py)
#   sanitizer  compute-sanitizer memcheck + racecheck on the selftest kernels
# Logs and JSON results go to $OUT (or build-gpu-check-logs/). GPU_CHECK_BUILD_S (120) and
# GPU_CHECK_TORCH_BUILD_S (150) bound the two builds (raise them on a slow machine).
#
# usage: perf/gpu_check.sh [--prebuilt DIR] [--only STAGE,...] [--skip STAGE,...] [--build-only]
#   --prebuilt DIR  default build-gpu-prebuilt when it exists (perf/gpu/prepare_prebuilt.sh)
# Exit status: 1 when a stage failed, or when nothing ran on a GPU.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOG=${OUT:-$ROOT/build-gpu-check-logs}
mkdir -p "$LOG"
PREBUILT="" ONLY="" SKIP="" BUILD_ONLY=0
[ -d "$ROOT/build-gpu-prebuilt/bin" ] && PREBUILT=$ROOT/build-gpu-prebuilt
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt) PREBUILT=$(cd "$2" 2>/dev/null && pwd) || { echo "no directory $2"; exit 2; }; shift ;;
    --only) ONLY=",$2,"; shift ;;
    --skip) SKIP=",$2,"; shift ;;
    --build-only) BUILD_ONLY=1 ;;
    *) echo "usage: $0 [--prebuilt DIR] [--only STAGE,...] [--skip STAGE,...] [--build-only]"; exit 2 ;;
  esac
  shift
done
BUDGET=${GPU_CHECK_BUDGET_S:-240}
START=$SECONDS
SUMMARY=()
FAILED=0
GPU_RAN=0
note() { echo "[gpu_check +$((SECONDS - START))s] $*"; }
record() {  # stage status detail
  SUMMARY+=("$(printf '%-34s %-5s %s' "$1" "$2" "$3")")
  [ "$2" = FAIL ] && FAILED=1
  # Evidence that a GPU ran something: a selftest check, a perf run or a benchmark passed
  # (builds, gtest binaries with CPU-only tests and sanitizer runs of skipped checks are not).
  [ "$2" = PASS ] && [[ "$1" == check* || "$1" == perf* || "$1" == bench* ]] && GPU_RAN=1
  note "$1: $2 $3"
}
left() { echo $((BUDGET - (SECONDS - START))); }
# limit WANTED: seconds a stage may take, keeping 5 s for the summary; 0 when out of time.
limit() {
  local l=$(( $(left) - 5 ))
  [ "$l" -gt "$1" ] && l=$1
  [ "$l" -lt 10 ] && l=0
  echo $l
}
want() {  # stage: selected by --only / --skip?
  [ -n "$ONLY" ] && [[ "$ONLY" != *",$1,"* ]] && return 1
  [[ "$SKIP" == *",$1,"* ]] && return 1
  return 0
}
first() { grep -m1 -E "$1" "$2" 2>/dev/null | cut -c1-150; }

note "root $ROOT, logs $LOG, budget ${BUDGET}s, prebuilt ${PREBUILT:-none}"
{ timeout 20 nvidia-smi || true; timeout 10 nvidia-smi topo -m || true; } > "$LOG/nvidia-smi.txt" 2>&1
head -12 "$LOG/nvidia-smi.txt"
[ -n "$PREBUILT" ] && [ -f "$PREBUILT/MANIFEST" ] && { echo "prebuilt MANIFEST:"; sed 's/^/  /' "$PREBUILT/MANIFEST"; }

# ---- toolchain --------------------------------------------------------------------------
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=""
if [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC=$CUDA_HOME/bin/nvcc; elif command -v nvcc >/dev/null; then
  NVCC=$(command -v nvcc); CUDA_HOME=$(dirname "$(dirname "$NVCC")"); fi
# Prebuilt binaries: their own libraries first, then this machine's CUDA runtime.
export LD_LIBRARY_PATH=${PREBUILT:+$PREBUILT/lib:}$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
CXX=${CXX:-g++}
command -v "$CXX" >/dev/null || CXX=""
JOBS=$(nproc 2>/dev/null || echo 4)
note "nvcc: ${NVCC:-missing}; c++: ${CXX:-missing}; python: $(command -v python3 || echo missing)"

# ---- torch extension, built in the background while the GPU stages run ----------------------
TORCH_PID="" TEXT=$ROOT/build-torch-ext TORCH_LIMIT=${GPU_CHECK_TORCH_BUILD_S:-150}
if want torch && [ -n "$PREBUILT" ] && [ $BUILD_ONLY = 0 ]; then
  note "building the torch extension in the background (limit ${TORCH_LIMIT}s, log torch-build.log)"
  ( python3 -c 'import torch' >/dev/null 2>&1 || exit 3
    exec timeout "$TORCH_LIMIT" "$ROOT/perf/gpu/build_torch_ext.sh" --prebuilt "$PREBUILT" --out "$TEXT" \
      --jobs $(( JOBS > 8 ? JOBS / 2 : JOBS ))
  ) > "$LOG/torch-build.log" 2>&1 &
  TORCH_PID=$!
fi

# ---- build: direct nvcc/g++ (no CMake, no fmt/hwloc/UCX packages needed) -----------------
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
  local arch="-gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90"
  local pids=() s
  for s in $srcs; do
    "$CXX" $flags -c "$ROOT/$s" -o "$BIN/obj/$(basename "$s").o" &
    pids+=($!)
  done
  "$NVCC" -std=c++17 -O2 $arch -I"$ROOT" -I"$ROOT/tests/symmem_cuda" \
    -c "$ROOT/tests/symmem_cuda/gpu_kernels.cu" -o "$BIN/obj/gpu_kernels.cu.o" &
  pids+=($!)
  "$NVCC" -std=c++20 -O2 $arch -I"$ROOT" -Xcompiler -Wall,-Wextra \
    -c "$ROOT/perf/gpu/matmul_overlap.cu" -o "$BIN/obj/matmul_overlap.cu.o" &
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
  # cuBLAS needs the shared runtime.
  "$CXX" -o "$BIN/matmul_overlap" "$BIN/obj/matmul_overlap.cu.o" $lib -L"$CUDA_HOME/lib64" -lcublas -lcudart \
    -ldl -lpthread -lrt -Wl,-rpath,"$CUDA_HOME/lib64" || return 1
  # Guard the rule "never link libcuda": the driver must come in through the runtime only.
  if command -v ldd >/dev/null && ldd "$BIN/gpu_selftest" | grep -q 'libcuda\.so'; then
    echo "gpu_selftest links libcuda directly"; return 1
  fi
}
tool() {  # name: the directly built tool, else the prebuilt one
  if [ -x "$BIN/$1" ]; then echo "$BIN/$1"; elif [ -n "$PREBUILT" ] && [ -x "$PREBUILT/bin/$1" ]; then
    echo "$PREBUILT/bin/$1"; fi
}
if want build; then
  note "building gpu_selftest, ce_bandwidth, matmul_overlap directly ($JOBS jobs)"
  rm -f "$BIN/gpu_selftest" "$BIN/ce_bandwidth" "$BIN/matmul_overlap"
  t0=$SECONDS
  if timeout "$(limit "${GPU_CHECK_BUILD_S:-120}")" bash -c "$(declare -f build_direct); BIN='$BIN' ROOT='$ROOT' NVCC='$NVCC' CXX='$CXX' CUDA_HOME='$CUDA_HOME' build_direct" \
      > "$LOG/build-direct.log" 2>&1; then
    record "build (nvcc/g++ direct)" PASS "$((SECONDS - t0)) s"
  else
    tail -20 "$LOG/build-direct.log"
    rm -f "$BIN/gpu_selftest" "$BIN/ce_bandwidth" "$BIN/matmul_overlap"
    record "build (nvcc/g++ direct)" FAIL "see build-direct.log; prebuilt tools used where present"
  fi
fi
if [ $BUILD_ONLY = 1 ]; then
  printf '%s\n' "${SUMMARY[@]}"
  exit $FAILED
fi

# ---- selftest -------------------------------------------------------------------------------
SELFTEST=$(tool gpu_selftest)
if want selftest; then
  lim=$(limit 90)
  if [ -z "$SELFTEST" ]; then
    record "selftest" FAIL "no gpu_selftest (build failed, no prebuilt)"
  elif [ "$lim" = 0 ]; then
    record "selftest" SKIP "out of time"
  else
    timeout "$lim" "$SELFTEST" --timeout $((lim - 10)) > "$LOG/selftest.log" 2>&1
    rc=$?
    cat "$LOG/selftest.log"
    while read -r status name rest; do
      record "check $name" "$status" "$(echo "$rest" | cut -c1-120)"
    done < <(grep -E '^(PASS|FAIL|SKIP) ' "$LOG/selftest.log")
    [ "$rc" = 0 ] || [ "$rc" = 1 ] || record "selftest" FAIL "exit code $rc (timeout or crash)"
  fi
fi

# ---- gtest: every test_*_gpu ------------------------------------------------------------------
if want gtest; then
  found=0
  for t in ${PREBUILT:+"$PREBUILT"/bin/test_*_gpu}; do
    [ -x "$t" ] || continue
    found=1
    name=$(basename "$t")
    want_s=100
    [ "$name" = test_moe_cuda_gpu ] && want_s=30  # MoE CUDA dispatch/combine vs the host path, bit for bit
    lim=$(limit $want_s)
    if [ "$lim" = 0 ]; then record "gtest $name" SKIP "out of time"; continue; fi
    note "$name (limit ${lim}s)"
    timeout "$lim" "$t" --gtest_color=no > "$LOG/$name.log" 2>&1
    rc=$?
    counts="$(grep -E '^\[  PASSED  \]|^\[  SKIPPED \] [0-9]|^\[  FAILED  \] [0-9]' "$LOG/$name.log" | tr -s ' ' | tr '\n' ' ')"
    if [ $rc = 0 ] && grep -qE '^\[  PASSED  \] 0 tests' "$LOG/$name.log"; then
      record "gtest $name" SKIP "every test skipped: $(first 'SKIPPED|Skipped' "$LOG/$name.log")"
    elif [ $rc = 0 ]; then
      record "gtest $name" PASS "$counts"
    else
      [ $rc = 124 ] && counts="timeout after ${lim}s; $counts"
      record "gtest $name" FAIL "exit $rc; $counts$(grep -E '^\[  FAILED  \] [A-Za-z]' "$LOG/$name.log" | head -3 | tr '\n' ' ')"
    fi
  done
  [ $found = 1 ] || record "gtest" SKIP "no PREBUILT/bin/test_*_gpu (run perf/gpu/prepare_prebuilt.sh and carry it)"
fi

# ---- perf --mem cuda, 2 ranks on the one GPU ------------------------------------------------
perf_run() {  # label binary args...
  local label=$1 bin=$2; shift 2
  local exe=""
  [ -n "$PREBUILT" ] && [ -x "$PREBUILT/bin/$bin" ] && exe=$PREBUILT/bin/$bin
  if [ -z "$exe" ]; then record "perf $label" SKIP "no $bin in PREBUILT/bin"; return; fi
  local lim
  lim=$(limit 60)
  if [ "$lim" = 0 ]; then record "perf $label" SKIP "out of time"; return; fi
  local log=$LOG/perf-$label.log
  note "$bin $* (limit ${lim}s)"
  timeout "$lim" "$exe" --mem cuda -J "$LOG/perf-$label.json" --json "$LOG/perf-$label.jsonl" "$@" > "$log" 2>&1
  local rc=$?
  cat "$log"
  local oob avg small
  oob=$(sed -n 's/^# Out of bounds values : //p' "$log")
  avg=$(sed -n 's/^# Avg bus bandwidth    : \([0-9.e+-]*\).*/\1/p' "$log")
  # The smallest size's out-of-place time (latency) and the largest's busbw.
  small=$(awk '!/^#/ && NF >= 13 {print $1 " B: " $6 " us"; exit}' "$log")
  local big
  big=$(awk '!/^#/ && NF >= 13 {b=$1; bw=$8} END {if (b) print b " B: " bw " GB/s busbw"}' "$log")
  if [ $rc = 2 ] && grep -q -- '--mem cuda: ' "$log"; then
    record "perf $label" SKIP "$(grep -m1 -- '--mem cuda: ' "$log" | cut -c1-150)"
  elif [ $rc = 0 ] && [ "${oob%% *}" = 0 ]; then
    record "perf $label" PASS "$small; $big; avg busbw $avg"
  else
    record "perf $label" FAIL "exit $rc; oob '${oob}'; $(grep -m2 -iE 'error|failed|unsupported' "$log" | tr '\n' ' ' | cut -c1-160)"
  fi
}
if want perf; then
  perf_run all_reduce_2r all_reduce_perf --nranks 2 -b 8 -e 64M -f 4 -n 20 -w 5 -I 1
  perf_run all_reduce_2r_symm all_reduce_perf --nranks 2 -b 8 -e 1M -f 4 -n 50 -w 10 -R 2
  perf_run all_gather_2r all_gather_perf --nranks 2 -b 1K -e 256M -f 8 -n 10 -w 3
  perf_run alltoall_2r alltoall_perf --nranks 2 -b 1K -e 256M -f 8 -n 10 -w 3
  # Every perf binary once on CUDA memory at small sizes (flags, verification, exit code).
  for b in broadcast reduce reduce_scatter gather scatter sendrecv hypercube; do
    perf_run quick_${b}_2r ${b}_perf --nranks 2 -b 1K -e 16M -f 16 -n 5 -w 2
  done
  # MoE dispatch/combine on CUDA memory, 2 ranks on the one GPU (its own table format).
  MOE=${PREBUILT:+$PREBUILT/bin/moe_dispatch_perf}
  lim=$(limit 30)
  if [ -z "$MOE" ] || [ ! -x "$MOE" ]; then record "perf moe_cuda_2r" SKIP "no moe_dispatch_perf in PREBUILT/bin"
  elif [ "$lim" = 0 ]; then record "perf moe_cuda_2r" SKIP "out of time"
  else
    note "moe_dispatch_perf --mem cuda --nranks 2 (limit ${lim}s)"
    timeout "$lim" "$MOE" --mem cuda --nranks 1 --tokens 128,1024,4096 --hidden 7168 --formats native,fp8,mxfp8,nvfp4 \
      --experts 64 --iters 20 --warmup 5 > "$LOG/perf-moe_cuda_1r.log" 2>&1 && cat "$LOG/perf-moe_cuda_1r.log"
    timeout "$lim" "$MOE" --mem cuda --nranks 2 --tokens 128,1024 --hidden 7168 --formats native,fp8,nvfp4 \
      --experts 64 --iters 10 --warmup 3 > "$LOG/perf-moe_cuda_2r.log" 2>&1
    rc=$?
    cat "$LOG/perf-moe_cuda_2r.log"
    if [ $rc = 0 ]; then
      record "perf moe_cuda_2r" PASS "$(awk '!/^#/ && NF >= 10 {r=$1 " tok " $3 ": disp " $4 " us, cached " $10 " us, comb " $6 " us"} END {print r}' "$LOG/perf-moe_cuda_2r.log")"
    else
      record "perf moe_cuda_2r" FAIL "exit $rc; $(grep -m2 -iE 'error|failed|unsupported' "$LOG/perf-moe_cuda_2r.log" | tr '\n' ' ' | cut -c1-160)"
    fi
  fi
fi

# ---- the same small-message runs under MPS ---------------------------------------------------
# Two processes on one GPU without MPS take turns on it (time slices of a few hundred us to
# ms), so a kernel waiting for the other rank's kernel waits out a slice: the plain 2-rank
# latencies above measure the time slicing. Under the MPS daemon both ranks' kernels run at
# once, as on two GPUs. Skipped where nvidia-cuda-mps-control is missing or fails to start.
if want mps; then
  MPSCTL=$(command -v nvidia-cuda-mps-control || true)
  if [ -z "$MPSCTL" ]; then
    record "perf (MPS)" SKIP "nvidia-cuda-mps-control not found"
  elif [ "$(limit 30)" = 0 ]; then
    record "perf (MPS)" SKIP "out of time"
  else
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/crossbar-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/crossbar-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if timeout 20 "$MPSCTL" -d; then
      sleep 1
      perf_run all_reduce_2r_mps all_reduce_perf --nranks 2 -b 8 -e 64M -f 8 -n 50 -w 10
      perf_run all_reduce_2r_symm_mps all_reduce_perf --nranks 2 -b 8 -e 1M -f 8 -n 200 -w 20 -R 2
      perf_run alltoall_2r_mps alltoall_perf --nranks 2 -b 1K -e 64M -f 8 -n 20 -w 5
      echo quit | timeout 20 "$MPSCTL" || true
      cp "$CUDA_MPS_LOG_DIRECTORY/control.log" "$LOG/mps-control.log" 2>/dev/null
    else
      record "perf (MPS)" SKIP "the MPS daemon did not start"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi

# ---- matmul overlap ---------------------------------------------------------------------------
if want matmul; then
  MM=$(tool matmul_overlap)
  lim=$(limit 90)
  if [ -z "$MM" ]; then
    record "bench matmul_overlap" FAIL "no matmul_overlap (build failed, no prebuilt)"
  elif [ "$lim" = 0 ]; then
    record "bench matmul_overlap" SKIP "out of time"
  elif timeout "$lim" "$MM" --iters 20 --reps 3 > "$LOG/matmul_overlap.log" 2>&1; then
    cat "$LOG/matmul_overlap.log"
    if grep -q '^RESULT ' "$LOG/matmul_overlap.log"; then
      record "bench matmul_overlap" PASS "$(sed -n 's/^RESULT //p' "$LOG/matmul_overlap.log")"
    else
      record "bench matmul_overlap" SKIP "$(head -1 "$LOG/matmul_overlap.log")"
    fi
  else
    cat "$LOG/matmul_overlap.log"
    record "bench matmul_overlap" FAIL "exit $?; see matmul_overlap.log"
  fi
fi

# ---- copy-engine bandwidth -------------------------------------------------------------------
if want ce; then
  CE=$(tool ce_bandwidth)
  lim=$(limit 60)
  if [ -z "$CE" ]; then
    record "bench ce_bandwidth" FAIL "no ce_bandwidth (build failed, no prebuilt)"
  elif [ "$lim" = 0 ]; then
    record "bench ce_bandwidth" SKIP "out of time"
  elif timeout "$lim" "$CE" --iters 10 --chunks 8 --max-mib 1024 > "$LOG/ce_bandwidth.log" 2>&1; then
    cat "$LOG/ce_bandwidth.log"
    if grep -q 'SKIP' "$LOG/ce_bandwidth.log"; then
      record "bench ce_bandwidth" SKIP "$(head -1 "$LOG/ce_bandwidth.log")"
    else
      record "bench ce_bandwidth" PASS "$(awk '$1 == 1024 {print "1 GiB: ceiling " $2 ", CE batch " $3 " GB/s"}' "$LOG/ce_bandwidth.log")"
    fi
  else
    cat "$LOG/ce_bandwidth.log"
    record "bench ce_bandwidth" FAIL "see ce_bandwidth.log"
  fi
fi

# ---- torch extension against this machine's torch, then the CUDA pytest ------------------------
if want torch; then
  if [ -z "$TORCH_PID" ]; then
    record "torch build" SKIP "needs --prebuilt (the crossbar libraries)"
  else
    # The build started in the background at the top (CPU only, overlapping the GPU stages).
    note "waiting for the torch extension build"
    wait "$TORCH_PID"
    rc=$?
    if [ $rc = 3 ]; then
      record "torch build" SKIP "python3 cannot import torch"
    elif [ $rc != 0 ]; then
      tail -20 "$LOG/torch-build.log"
      [ $rc = 124 ] && rc="timeout after ${TORCH_LIMIT}s"
      record "torch build" FAIL "exit $rc; see torch-build.log"
    else
      record "torch build" PASS "$(grep -m1 '^torch ' "$LOG/torch-build.log" | cut -d';' -f1)"
      lim=$(limit 240)  # three CUDA test files, several spawning 2-rank groups
      if [ "$lim" = 0 ]; then
        record "torch pytest -k cuda" SKIP "out of time"
      elif ! python3 -c 'import pytest' 2>/dev/null; then
        record "torch pytest -k cuda" SKIP "pytest is not installed for python3 (pip install pytest)"
      else
        (cd "$ROOT" && CROSSBAR_BUILD_DIR=$TEXT timeout "$lim" python3 -m pytest -q -k cuda \
          -p no:cacheprovider tests/python) > "$LOG/torch-pytest.log" 2>&1
        rc=$?
        tail -15 "$LOG/torch-pytest.log"
        res=$(grep -E '^[0-9]+ (passed|failed|skipped|deselected)|^(FAILED|ERROR) ' "$LOG/torch-pytest.log" | tail -3 | tr '\n' ' ')
        case $rc in
          0) record "torch pytest -k cuda" PASS "$res" ;;
          5) record "torch pytest -k cuda" SKIP "no test matched -k cuda" ;;
          124) record "torch pytest -k cuda" FAIL "timeout after ${lim}s" ;;
          *) record "torch pytest -k cuda" FAIL "exit $rc; $res" ;;
        esac
      fi
    fi
  fi
fi

# ---- compute-sanitizer ------------------------------------------------------------------------
# API errors are not reported: VmmAllocation first asks for a fabric handle and falls back
# to a POSIX fd when the driver answers CUDA_ERROR_NOT_PERMITTED, on purpose.
if want sanitizer; then
  SAN=""
  [ -x "$CUDA_HOME/bin/compute-sanitizer" ] && SAN=$CUDA_HOME/bin/compute-sanitizer
  [ -z "$SAN" ] && command -v compute-sanitizer >/dev/null && SAN=$(command -v compute-sanitizer)
  for tool_name in memcheck racecheck; do
    lim=$(limit 60)
    why=""
    [ "$lim" = 0 ] && why="out of time"
    [ -z "$SELFTEST" ] && why="no gpu_selftest"
    [ -z "$SAN" ] && why="compute-sanitizer not installed"
    if [ -n "$why" ]; then
      record "compute-sanitizer $tool_name" SKIP "$why"
      continue
    fi
    only=kernel_put_signal,copy_engine
    [ $tool_name = racecheck ] && only=kernel_put_signal
    note "compute-sanitizer $tool_name on $only (limit ${lim}s)"
    if timeout "$lim" "$SAN" --tool $tool_name --report-api-errors no --target-processes all --error-exitcode 9 \
        "$SELFTEST" --only $only --timeout $((lim - 5)) > "$LOG/sanitizer-$tool_name.log" 2>&1; then
      record "compute-sanitizer $tool_name" PASS "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/sanitizer-$tool_name.log" | sort | uniq -c | tr -s ' ' | tr '\n' ' ')"
    else
      rc=$?
      record "compute-sanitizer $tool_name" FAIL "exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^FAIL' "$LOG/sanitizer-$tool_name.log" | head -3 | tr '\n' ' ')"
    fi
  done
fi

# A GPU validation where nothing ran on a GPU is a failure, not a green run.
[ $GPU_RAN = 1 ] || record "gpu present" FAIL "no stage passed on a GPU (see nvidia-smi.txt)"
echo
echo "==================== gpu_check summary ($((SECONDS - START)) s of ${BUDGET} s) ===================="
printf '%-34s %-5s %s\n' STAGE STATUS DETAIL
printf '%s\n' "${SUMMARY[@]}" | tee "$LOG/summary.txt"
exit $FAILED
