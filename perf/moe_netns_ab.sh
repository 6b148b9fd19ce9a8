#!/bin/bash
# Interleaved A/B of the two-level MoE dispatch: a saved earlier build ("old") against the
# current one ("new"), alternating per round so a busy machine disturbs both alike.
#   OLD=/path/to/saved/build   (holding bin/moe_netns_bench and lib/, e.g. a copy of
#                               build-moe made before the change: cp -a build-moe/{bin,lib} OLD)
#   NEW=build-moe ROUNDS=4 perf/moe_netns_ab.sh [extra moe_netns_bench flags, e.g. --formats
#                                               bf16,fp8 --fp8-io both]
# Prints, per round and build, the load average, the per-format lines and the dispatch
# phases (--no-flat: the flat all-to-all runs once per format for the check only). Root.
set -euo pipefail
: "${OLD:?set OLD to a saved build directory (bin/ and lib/)}"
NEW=${NEW:-build-moe}
for r in $(seq 1 "${ROUNDS:-4}"); do
  for v in old new; do
    if [ "$v" = old ]; then
      cmd=(env LD_LIBRARY_PATH="$OLD/lib" "$OLD/bin/moe_netns_bench")
    else
      cmd=("$NEW/bin/moe_netns_bench")
    fi
    echo "== round $r $v load $(cut -d' ' -f1-3 /proc/loadavg)"
    "${cmd[@]}" --iters 5 --phases --no-flat "$@" 2>&1 |
      grep -E "^ +(bf16|fp8|mxfp8)(/q)? |2l dispatch|fp8 vs bf16" || true
  done
done
