#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang in build-fuzz and runs each for N seconds.
#
#   scripts/fuzz.sh            every target 30 s
#   scripts/fuzz.sh 20         every target 20 s (the CI option)
#   scripts/fuzz.sh 300 store_server rankinfo
#
# Seeds come from fuzz/corpus/<target>/ (read only); new inputs go to build-fuzz/corpus/,
# crashes to build-fuzz/artifacts/<target>/ (reproduce: build-fuzz/bin/fuzz_<target> FILE).
# Installs clang-14 + libclang-rt-14-dev with apt-get when no clang is found.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-30}
shift || true
all_targets=(store_server store_reply env_parse rankinfo bootstrap moe_layout)
targets=("$@")
((${#targets[@]})) || targets=("${all_targets[@]}")
dir=${FUZZ_BUILD_DIR:-build-fuzz}

find_clang() {
  for v in "" -14 -15 -16 -17 -18; do
    if command -v "clang++$v" >/dev/null && command -v "clang$v" >/dev/null; then
      echo "clang$v clang++$v"
      return 0
    fi
  done
  return 1
}
if ! compilers=$(find_clang); then
  echo "fuzz.sh: no clang; installing clang-14 and libclang-rt-14-dev" >&2
  sudo_cmd=""
  [[ $(id -u) == 0 ]] || sudo_cmd=sudo
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq clang-14 libclang-rt-14-dev
  compilers=$(find_clang)
fi
read -r cc cxx <<<"$compilers"
# libFuzzer ships in libclang-rt-*-dev on Debian; check it links before configuring.
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe/p.cc"
if ! "$cxx" -fsanitize=fuzzer "$probe/p.cc" -o "$probe/p" 2>"$probe/err"; then
  cat "$probe/err" >&2
  echo "fuzz.sh: $cxx cannot link libFuzzer; install libclang-rt-14-dev (or your clang's compiler-rt)" >&2
  exit 1
fi

t0=$(date +%s)
# The library is built with fuzzer-no-link too, so libFuzzer sees coverage inside it.
CC=$cc CXX=$cxx cmake -S . -B "$dir" -G Ninja -DCROSSBAR_WITH_CUDA=OFF -DCROSSBAR_BUILD_PYTHON=OFF \
  -DCROSSBAR_BUILD_TESTS=OFF -DCROSSBAR_BUILD_BENCHMARKS=OFF -DCROSSBAR_BUILD_FUZZERS=ON \
  -DCROSSBAR_SANITIZE=address,undefined,fuzzer-no-link -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C "$dir" "${targets[@]/#/fuzz_}"
echo "== fuzz build took $(($(date +%s) - t0)) s"

export UCX_MEM_EVENTS=no
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
for t in "${targets[@]}"; do
  mkdir -p "$dir/corpus/$t" "$dir/artifacts/$t"
  echo "== fuzz_$t for $seconds s"
  if ! "$dir/bin/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
      -print_final_stats=1 -artifact_prefix="$dir/artifacts/$t/" "$dir/corpus/$t" "fuzz/corpus/$t" \
      2>"$dir/fuzz_$t.log"; then
    echo "!! fuzz_$t found a problem; see $dir/fuzz_$t.log and $dir/artifacts/$t/" >&2
    tail -40 "$dir/fuzz_$t.log" >&2
    status=1
  fi
  grep -E "stat::number_of_executed_units|stat::new_units_added" "$dir/fuzz_$t.log" | tr '\n' ' '
  echo
done
exit $status
