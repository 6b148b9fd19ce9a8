#!/usr/bin/env bash
# Builds, on a machine with the project's dependencies (no GPU needed), every GPU binary
# and the shared libraries they need into one directory that travels to a GPU machine
# lacking fmt/hwloc/UCX development packages, where perf/gpu_check.sh --prebuilt DIR
# runs them:
#   DIR/bin      every test_*_gpu gtest binary, the perf binaries (for --mem cuda),
#                gpu_selftest, ce_bandwidth, matmul_overlap (stripped of debug info)
#   DIR/lib      libcrossbar_*.so.0 and the non-system libraries they load (fmt, hwloc,
#                UCX, numa, udev, ...); CUDA, NCCL, cuBLAS, libc/libstdc++ are the GPU
#                machine's own
#   DIR/include  crossbar_build_info.h (perf/gpu/build_torch_ext.sh compiles against it)
#   DIR/MANIFEST what was built from which commit, and whether the CUDA collectives are in
# The directory must stay small enough to carry (default limit 60 MiB; fails above it).
#
# usage: perf/gpu/prepare_prebuilt.sh [--build-dir DIR] [--out DIR] [--max-mib N] [--no-build]
#                                     [--clean-tree DIR]
#   --build-dir DIR  CMake build tree (default build-gpu-build; configured with CUDA ON if new)
#   --out DIR        default build-gpu-prebuilt
#   --no-build       only collect what DIR already holds
#   --targets "A B"  only these targets, from any build tree (CUDA or not): the collection
#                    itself, as test perf.prepare_prebuilt_collects checks on a CPU build
#   --clean-tree DIR export the committed HEAD (git archive) into DIR (inside the checkout, and
#                    ignored, e.g. gpu-tree listed in .git/info/exclude), build it there, and put
#                    the prebuilt in DIR/build-gpu-prebuilt: uncommitted edits in the checkout stay
#                    out of the GPU run. Then carry DIR and run from it:
#                      run(command="cd gpu-tree && perf/gpu_check.sh --prebuilt build-gpu-prebuilt",
#                          carry=["gpu-tree"])
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$ROOT/build-gpu-build OUT=$ROOT/build-gpu-prebuilt MAX_MIB=60 DO_BUILD=1 CLEAN_TREE="" ONLY_TARGETS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --clean-tree) CLEAN_TREE=$2; shift ;;
    --build-dir) BUILD=$2; shift ;;
    --out) OUT=$2; shift ;;
    --max-mib) MAX_MIB=$2; shift ;;
    --no-build) DO_BUILD=0 ;;
    --targets) ONLY_TARGETS=$2; shift ;;
    *) echo "usage: $0 [--build-dir DIR] [--out DIR] [--max-mib N] [--no-build] [--targets \"A B\"]" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$CLEAN_TREE" ]; then
  case "$CLEAN_TREE" in /*) ;; *) CLEAN_TREE=$ROOT/$CLEAN_TREE ;; esac
  rm -rf "$CLEAN_TREE"
  mkdir -p "$CLEAN_TREE"
  git -C "$ROOT" archive HEAD | tar -x -C "$CLEAN_TREE"
  echo "exported $(git -C "$ROOT" rev-parse --short HEAD) into $CLEAN_TREE"
  # The build tree stays outside the exported one (it is not carried).
  args=(--out "$CLEAN_TREE/build-gpu-prebuilt" --max-mib "$MAX_MIB")
  [ "$BUILD" = "$ROOT/build-gpu-build" ] && BUILD=$ROOT/build-gpu-clean
  case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
  [ $DO_BUILD = 1 ] || args+=(--no-build)
  exec "$CLEAN_TREE/perf/gpu/prepare_prebuilt.sh" --build-dir "$BUILD" "${args[@]}"
fi
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
case "$OUT" in /*) ;; *) OUT=$ROOT/$OUT ;; esac

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  [ $DO_BUILD = 1 ] || { echo "$0: $BUILD is not a configured build tree" >&2; exit 2; }
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCROSSBAR_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
if [ -n "$ONLY_TARGETS" ]; then
  GTESTS="" TOOLS=$ONLY_TARGETS
else
  grep -q '^CROSSBAR_WITH_CUDA:STRING=\(ON\|AUTO\)' "$BUILD/CMakeCache.txt" ||
    { echo "$0: $BUILD is configured without CUDA (CROSSBAR_WITH_CUDA=OFF)" >&2; exit 2; }
  # What to build: every test_*_gpu target, the perf binaries, the GPU tools.
  ALL_TARGETS=$(ninja -C "$BUILD" -t targets all | sed -n 's/^\([A-Za-z0-9_]*\): phony$/\1/p')
  GTESTS=$(grep -E '^test_[a-z0-9_]+_gpu$' <<<"$ALL_TARGETS" || true)
  TOOLS=$(grep -E '^(gpu_selftest|ce_bandwidth|matmul_overlap|[a-z_]+_perf)$' <<<"$ALL_TARGETS" | grep -v '^cmake_' || true)
  [ -n "$GTESTS" ] || { echo "$0: no test_*_gpu targets in $BUILD (CUDA not found at configure?)" >&2; exit 1; }
fi
TARGETS=$(echo $GTESTS $TOOLS)
if [ $DO_BUILD = 1 ]; then
  echo "building: $TARGETS"
  # shellcheck disable=SC2086
  cmake --build "$BUILD" --target $TARGETS
fi

rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/lib" "$OUT/include"
for t in $TARGETS; do
  [ -x "$BUILD/bin/$t" ] || { echo "$0: $BUILD/bin/$t missing" >&2; exit 1; }
  cp "$BUILD/bin/$t" "$OUT/bin/"
done
# The GPU machine's own: CUDA, NCCL, cuBLAS, the C/C++ runtime.
SYSTEM='^(linux-vdso|ld-linux-[a-z0-9_-]*|libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libcuda|libcudart|libnccl|libcublas|libcublasLt|libnvidia-[a-z0-9_-]*)\.so'
# ldd the build tree's binaries: the copies' RPATH ($ORIGIN/../lib) points at $OUT/lib, which
# is still empty here, so their crossbar libraries would read "not found" and be skipped.
for t in $TARGETS; do
  ldd "$BUILD/bin/$t" | awk '/=> \//{print $1, $3}' | while read -r name path; do
    grep -qE "$SYSTEM" <<<"$name" && continue
    [ -e "$OUT/lib/$name" ] || cp -L "$path" "$OUT/lib/$name"
  done
done
ls "$OUT/lib"/libcrossbar_comm.so* >/dev/null 2>&1 || { echo "$0: libcrossbar_comm was not collected" >&2; exit 1; }
# The copies must load from $OUT alone (plus this machine's CUDA and C runtime).
missing=$(for f in "$OUT"/bin/*; do ldd "$f" | awk -v b="$(basename "$f")" '/not found/{print b ": " $1}'; done)
[ -z "$missing" ] || { echo "$0: libraries the copies cannot find:" >&2; echo "$missing" >&2; exit 1; }
# Debug info is most of the size; symbols stay for backtraces.
strip --strip-debug "$OUT"/bin/* "$OUT"/lib/*
cp "$(find "$BUILD" -name crossbar_build_info.h -path '*generated*' | head -1)" "$OUT/include/"

cuda_collectives=0
grep -q 'CROSSBAR_HAVE_CUDA_COLLECTIVES' "$BUILD/build.ninja" && cuda_collectives=1
{
  echo "commit=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
  if [ "$(git -C "$ROOT" rev-parse --show-toplevel 2>/dev/null)" = "$ROOT" ]; then
    echo "dirty=$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null | wc -l)"
  else
    echo "dirty=0 (exported with --clean-tree)"
  fi
  echo "date=$(date -u +%FT%TZ)"
  echo "build_dir=$BUILD"
  echo "cuda_collectives=$cuda_collectives"
  echo "gtests=$(echo $GTESTS)"
  echo "tools=$(echo $TOOLS)"
} > "$OUT/MANIFEST"

size_kib=$(du -sk "$OUT" | cut -f1)
echo "prebuilt: $OUT, $((size_kib / 1024)) MiB ($(ls "$OUT/bin" | wc -l) binaries, $(ls "$OUT/lib" | wc -l) libraries)"
cat "$OUT/MANIFEST"
if [ "$size_kib" -gt $((MAX_MIB * 1024)) ]; then
  du -sk "$OUT"/bin/* "$OUT"/lib/* | sort -n | tail -8
  echo "$0: $OUT is over ${MAX_MIB} MiB" >&2
  exit 1
fi
