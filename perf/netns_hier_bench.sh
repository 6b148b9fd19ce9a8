#!/bin/bash
# netns_hier_bench.sh: the nccl-tests style perf binaries over 2 virtual nodes that are real
# network namespaces on a bridge, each node's link rate-limited both ways with tc tbf (as
# perf/moe_netns_bench does for MoE), so the inter-node phase of the hierarchical collectives
# runs over a slow network (UCX over TCP) while the intra-node phases use shared memory.
# Usage (root, iproute2, tc tbf): CROSSBAR_BUILD_DIR=build perf/netns_hier_bench.sh <rate, e.g. 2gbit> <algo> [perf args...]
#   e.g. CROSSBAR_COLL_HIER_CHUNK=4M perf/netns_hier_bench.sh 2gbit hier_pipelined -b 4M -e 64M -f 4 -n 10 -w 2 -c 0
# PERF_BIN=all_gather_perf (etc.) runs another nccl-tests style binary. Exit 77: no namespaces here.
# Rank outputs: $OUT_DIR (default /tmp)/netns_r<rank>.out; rank 0's table is printed.
set -u
RATE=$1; ALGO=$2; shift 2
P=cbxh$$; SW=${P}sw; NODES=2; RPN=2; N=$((NODES*RPN))
BIN=${CROSSBAR_BUILD_DIR:-build}/bin/${PERF_BIN:-all_reduce_perf}
bits=$(python3 -c "r='$RATE';import re;m=re.match(r'([0-9.]+)(\w+)',r);v=float(m.group(1))*{'kbit':1e3,'mbit':1e6,'gbit':1e9}[m.group(2)];print(max(262144,int(v/8/100)))")
cleanup() { for m in $(seq 0 $((NODES-1))); do ip netns del ${P}n$m 2>/dev/null; done; ip netns del $SW 2>/dev/null; }
trap cleanup EXIT
ip netns add $SW && ip -n $SW link add br0 type bridge && ip -n $SW link set br0 up && ip -n $SW link set lo up || exit 77
for m in $(seq 0 $((NODES-1))); do
  ns=${P}n$m; a=h$$a$m; b=h$$b$m
  ip netns add $ns; ip link add $a type veth peer name $b
  ip link set $a netns $ns; ip link set $b netns $SW
  ip -n $ns link set $a name cbx0; ip -n $ns addr add 10.78.0.$((m+1))/24 dev cbx0
  ip -n $ns link set lo up; ip -n $ns link set cbx0 up
  ip -n $SW link set $b master br0; ip -n $SW link set $b up
  tbf="tbf rate $RATE burst $bits latency 200ms"
  ip netns exec $ns tc qdisc add dev cbx0 root $tbf; ip netns exec $SW tc qdisc add dev $b root $tbf
done
pids=()
for r in $(seq 0 $((N-1))); do
  m=$((r/RPN))
  ip netns exec ${P}n$m env RANK=$r WORLD_SIZE=$N LOCAL_RANK=$((r%RPN)) LOCAL_WORLD_SIZE=$RPN \
    MASTER_ADDR=10.78.0.1 MASTER_PORT=29517 CROSSBAR_RANKS_PER_NODE=$RPN CROSSBAR_UCX_TLS=tcp UCX_NET_DEVICES=cbx0 \
    $BIN --algo $ALGO "$@" > ${OUT_DIR:-/tmp}/netns_r$r.out 2>&1 &
  pids+=($!)
done
rc=0; for p in "${pids[@]}"; do wait $p || rc=$?; done
cat ${OUT_DIR:-/tmp}/netns_r0.out | grep -E '^ +[0-9]|rror|failed' ; for r in 1 2 3; do grep -iE "error|fail" ${OUT_DIR:-/tmp}/netns_r$r.out | head -3; done
exit $rc
