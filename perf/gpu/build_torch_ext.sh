#!/usr/bin/env bash
# Builds the torch extension crossbar._C against the torch that PYTHON imports, without
# CMake: g++ on torch_backend/*.cc with torch's and Python's include paths, the project's
# headers, third_party/fmt (header-only) and the CUDA toolkit's headers, linked against
# prebuilt crossbar shared libraries. For a GPU machine whose torch/Python differ from the
# machine that built the libraries (an extension is tied to one torch and one Python), and
# which lacks fmt/hwloc/UCX development packages (CMake cannot configure there).
#
# usage: perf/gpu/build_torch_ext.sh --prebuilt DIR [--out DIR] [--python PY] [--jobs N]
#   --prebuilt DIR  from perf/gpu/prepare_prebuilt.sh: DIR/lib (libcrossbar_*.so and the
#                   libraries they need), DIR/include/crossbar_build_info.h, DIR/MANIFEST
#   --out DIR       build tree to create (default build-torch-ext); the package lands in
#                   DIR/python/crossbar, so `CROSSBAR_BUILD_DIR=DIR pytest tests/python` uses it
# Prints the import check's result; exits non-zero when the build or `import crossbar` fails.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PREBUILT="" OUT=$ROOT/build-torch-ext PY=${PYTHON:-python3} JOBS=$(nproc 2>/dev/null || echo 4)
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt) PREBUILT=$(cd "$2" && pwd); shift ;;
    --out) OUT=$2; shift ;;
    --python) PY=$2; shift ;;
    --jobs) JOBS=$2; shift ;;
    *) echo "usage: $0 --prebuilt DIR [--out DIR] [--python PY] [--jobs N]" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$PREBUILT" ] || { echo "$0: --prebuilt DIR is required (perf/gpu/prepare_prebuilt.sh makes one)" >&2; exit 2; }
for f in "$PREBUILT/include/crossbar_build_info.h" "$PREBUILT/lib/libcrossbar_comm.so.0"; do
  [ -e "$f" ] || { echo "$0: $f is missing; rerun perf/gpu/prepare_prebuilt.sh" >&2; exit 2; }
done
mkdir -p "$OUT/obj" "$OUT/python/crossbar"
OUT=$(cd "$OUT" && pwd)

# torch's and Python's layout, asked from them (as torch_backend/CMakeLists.txt does).
INFO=$("$PY" - <<'EOF'
import os, sysconfig, torch, torch.utils.cpp_extension as ce
root = os.path.dirname(torch.__file__)
flags = getattr(ce, "_get_pybind11_abi_build_flags", lambda: [])()
print(root)
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__version__)
print(sysconfig.get_paths()["include"])
print(sysconfig.get_config_var("EXT_SUFFIX"))
print(" ".join(flags))
print(int(torch.cuda.is_available()))
EOF
) || { echo "$0: '$PY -c import torch' failed" >&2; exit 1; }
TORCH_ROOT=$(sed -n 1p <<<"$INFO")
CXX11_ABI=$(sed -n 2p <<<"$INFO")
TORCH_VERSION=$(sed -n 3p <<<"$INFO")
PY_INC=$(sed -n 4p <<<"$INFO")
EXT_SUFFIX=$(sed -n 5p <<<"$INFO")
PYBIND_FLAGS=$(sed -n 6p <<<"$INFO")
echo "torch $TORCH_VERSION at $TORCH_ROOT; python include $PY_INC; extension _C$EXT_SUFFIX"
[ "$CXX11_ABI" = 1 ] || { echo "$0: torch $TORCH_VERSION uses the pre-C++11 ABI; crossbar needs the cxx11 ABI" >&2; exit 1; }

CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
DEFS="-D_GLIBCXX_USE_CXX11_ABI=1 -DFMT_HEADER_ONLY=1"
# The prebuilt libraries' CUDA collectives (collectives/CMakeLists.txt makes this PUBLIC), and
# CUDA tensors in the backend when this torch is a CUDA build (as torch_backend/CMakeLists.txt).
TORCH_CUDA=0 CUDA_LINK=""
if grep -q '^cuda_collectives=1' "$PREBUILT/MANIFEST" 2>/dev/null; then
  DEFS="$DEFS -DCROSSBAR_HAVE_CUDA_COLLECTIVES=1"
  if [ -e "$TORCH_ROOT/lib/libc10_cuda.so" ]; then
    TORCH_CUDA=1
    DEFS="$DEFS -DCROSSBAR_TORCH_CUDA=1"
    CUDA_LINK="$TORCH_ROOT/lib/libc10_cuda.so -L$CUDA_HOME/lib64 -lcudart -Wl,-rpath,$CUDA_HOME/lib64"
  fi
fi
echo "CUDA tensors: $([ $TORCH_CUDA = 1 ] && echo enabled || echo "disabled (no CUDA collectives in the prebuilt libraries or a CPU torch)")"
INCS="-I$ROOT -I$PREBUILT/include -isystem $ROOT/third_party/fmt/include -isystem $TORCH_ROOT/include
  -isystem $TORCH_ROOT/include/torch/csrc/api/include -isystem $PY_INC"
[ -d "$CUDA_HOME/include" ] && INCS="$INCS -isystem $CUDA_HOME/include"
CXXFLAGS="-std=c++20 -O2 -g0 -fPIC -fvisibility=hidden -Wall -Wextra $DEFS $PYBIND_FLAGS"

# The extension's sources as torch_backend/CMakeLists.txt lists them (else every .cc there).
SRCS=""
for f in $(sed -n 's/.*Python3_add_library(crossbar_torch_ext MODULE WITH_SOABI \([^)]*\)).*/\1/p' \
    "$ROOT/torch_backend/CMakeLists.txt"); do
  SRCS="$SRCS $ROOT/torch_backend/$f"
done
[ -n "$SRCS" ] || SRCS=$(ls "$ROOT"/torch_backend/*.cc)
echo "compiling $(echo $SRCS | wc -w) sources with $JOBS jobs"
pids=() objs=()
for s in $SRCS; do
  o=$OUT/obj/$(basename "$s" .cc).o
  objs+=("$o")
  # shellcheck disable=SC2086
  g++ $CXXFLAGS $INCS -c "$s" -o "$o" &
  pids+=($!)
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 0.2; done
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
[ $rc = 0 ] || { echo "$0: compilation failed" >&2; exit 1; }

# crossbar's libraries in link order (those present), then torch's.
LIBS=""
for l in moe collectives telemetry symmem_cuda symmem comm; do
  [ -e "$PREBUILT/lib/libcrossbar_$l.so.0" ] && LIBS="$LIBS $PREBUILT/lib/libcrossbar_$l.so.0"
done
TLIBS="$TORCH_ROOT/lib/libtorch.so $TORCH_ROOT/lib/libtorch_cpu.so $TORCH_ROOT/lib/libc10.so $TORCH_ROOT/lib/libtorch_python.so"
EXT=$OUT/python/crossbar/_C$EXT_SUFFIX
# shellcheck disable=SC2086
g++ -shared -o "$EXT" "${objs[@]}" $LIBS $TLIBS $CUDA_LINK -Wl,-rpath,"$PREBUILT/lib" -Wl,-rpath,"$TORCH_ROOT/lib"
for f in "$ROOT"/python/crossbar/*.py; do ln -sf "$f" "$OUT/python/crossbar/$(basename "$f")"; done
echo "built $EXT"

# The package must import with this torch (undefined symbols show up here, not at link time).
PYTHONPATH=$OUT/python${PYTHONPATH:+:$PYTHONPATH} LD_LIBRARY_PATH=$PREBUILT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  "$PY" -c "import torch, crossbar; print('import crossbar OK:', crossbar.__file__, 'torch', torch.__version__)"
