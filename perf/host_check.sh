#!/bin/bash
# The whole check of the host collectives against issue 4's targets, in one go: latency
# (8 B-4 KiB) and bus bandwidth (64 KiB-256 MiB) of allreduce, allgather, reduce_scatter and
# alltoall at 2 and 4 ranks against OpenMPI, private user buffers, then the summary tables
# (perf/compare_summary). Run it on a quiet machine; it takes about 15 minutes on 2 cores.
# It also prints each library's share of the busbw ceiling (copy_ceiling in perf/compare).
#   perf/host_check.sh [build-dir (default build)] [out-dir (default out/host-check)]
# Environment: ROUNDS (bandwidth rounds per size, default 2), LAT_ROUNDS (default 5).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-out/host-check}
mkdir -p "$OUT"
for b in all_reduce_perf all_gather_perf reduce_scatter_perf alltoall_perf mpi_bench cacheline_pingpong; do
  [[ -x $BUILD/bin/$b ]] || { echo "host_check: $BUILD/bin/$b is missing (build it first)" >&2; exit 2; }
done
echo "host_check: $(date -u +%H:%M) UTC, HEAD $(git rev-parse --short HEAD), load $(cut -d' ' -f1-3 /proc/loadavg)"
for c in all_reduce all_gather reduce_scatter alltoall; do
  for n in 2 4; do
    iters=$((n == 2 ? 20000 : 5000))
    perf/compare -c "$c" --nranks "$n" -b 8 -e 4K -f 8 -n "$iters" -w 500 --no-gloo --bin-dir "$BUILD/bin" \
      --rounds "${LAT_ROUNDS:-5}" --json "$OUT/lat-$c-$n.json" >"$OUT/lat-$c-$n.txt"
    perf/compare -c "$c" --nranks "$n" -b 64K -e 256M -f 4 -n 50 -w 5 --no-gloo --bin-dir "$BUILD/bin" \
      --rounds "${ROUNDS:-2}" --json "$OUT/bw-$c-$n.json" >"$OUT/bw-$c-$n.txt"
    echo "host_check: $c $n ranks done, load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
echo "## latency: MPI time / crossbar time (> 1: crossbar faster; target >= 1)"
perf/compare_summary --metric speedup --target 1 "$OUT"/lat-*.json
echo
echo "## busbw: crossbar / MPI (target >= 1.5)"
perf/compare_summary --target 1.5 "$OUT"/bw-*.json
echo
echo "## busbw as a fraction of the run's memcpy bandwidth"
perf/compare_summary --metric fraction "$OUT"/bw-*.json
echo
echo "## busbw / the run's ceiling for private buffers out of cache (copy_ceiling in perf/compare): crossbar"
perf/compare_summary --metric ceiling "$OUT"/bw-*.json
echo
echo "## the same for MPI: where it is above 0.67, 1.5x MPI is beyond the ceiling"
perf/compare_summary --metric ceiling --peer mpi-ceiling --target 0.667 "$OUT"/bw-*.json
