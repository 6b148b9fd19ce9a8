// Host-side routing plan of a CUDA MoE dispatch (cuda/moe_cuda.h). The CUDA executor moves
// rows to precomputed places, so every rank first learns, on the host, where each of its
// rows goes and where each row it receives lands. The plan is built from moe_plan.h (the
// host executor's planning) plus a metadata exchange over the Communicator's host p2p that
// follows the data's two-level route:
//   1. each rank sends its forwarder on every remote node (MoeTopology::forwarderOn: the
//      rank there with its local index when nodes are even) the (token, top-k ids) of the
//      tokens bound for that node;
//   2. each forwarder sends every rank of its node the (source rank, token, top-k ids) of the
//      rows it will write into that rank's buffer, in order.
// Metadata is (1 + topk) int64 per row, a small fraction of a row of activations. No device
// memory is touched here (CPU tested: test_moe_cuda_plan).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collectives/moe/moe_plan.h"
#include "comm/deadline.h"

namespace crossbar::moe {

struct CudaMoePlan {
  size_t tokens = 0;
  Layout stats;                                 // counts only (is_token_in_rank emptied)
  std::vector<std::vector<int32_t>> node_send;  // [node]: own tokens bound for it, in order
  // Forwarder: F = own rows for this node, then the rows of each source it forwards for
  // (blocks in MoeTopology::fwd_sources order; [0] is the own block).
  std::vector<size_t> fwd_start, fwd_count;        // [stream]
  std::vector<std::vector<int32_t>> fwd_to_local;  // [local j]: F rows written to local rank j, in order
  // Receiver: rows in (source rank, token) order.
  size_t num_recv = 0;
  std::vector<std::vector<int32_t>> recv_rows;  // [local j]: output row of forwarder j's p-th row
  std::vector<int32_t> src_rank, src_token;     // [num_recv]
  std::vector<int> recv_per_rank;               // [ranks]
  std::vector<int64_t> topk_idx;                // [num_recv x topk]: local expert or -1 (capacity applied)
  std::vector<int> tokens_per_expert;           // [local experts]
  ExpertMajorIndex expert_major;
  uint64_t dropped = 0;
  uint64_t inter_node_bytes = 0, intra_node_bytes = 0;  // rows of `row_bytes` this rank sends
};

// Index arrays of the executor's sum kernels, derived from a plan (CPU side of the handle):
//   forwarder: contributions of F row i are c_offs[c_first[i] .. c_first[i+1]), float offsets
//     j * slot_floats + q * hidden into the forwarder's combine buffer (slot j = local rank j,
//     row q = its q-th row for us), in local-rank order;
//   source: partials of token t are t_src[t_first[t] .. t_first[t+1]) = node << 32 | index in
//     node_send[node], in node order;
//   expert-major combine: expert-major rows of received row i are em_idx[em_first[i] ..
//     em_first[i+1]), ascending.
struct CudaMoeSumIndex {
  size_t nf = 0;  // rows of F
  std::vector<int32_t> c_first, t_first, em_first, em_idx;
  std::vector<int64_t> c_offs, t_src;
};
CudaMoeSumIndex cudaMoeSumIndex(const CudaMoePlan& plan, size_t slot_floats, size_t hidden);

// Overlap of a dispatch's network and intra-node phases (several nodes): F's first `own_rows`
// rows (the own node's tokens) need no network, so the forwarder writes them into the local
// ranks' slots while NCCL is in flight (phase 0), the remote nodes' rows once it is done
// (phase 1). For local rank j, F row src[ph][j][q] goes to slot position pos[ph][j][q]; the two
// phases together are fwd_to_local[j] (F row fwd_to_local[j][q] at position q), each position
// once. Combine mirrors it: the remote rows' sums (F rows >= own_rows) are computed first so
// that they can go out while the own rows are summed.
struct CudaMoeForwardPhases {
  size_t own_rows = 0;
  std::vector<std::vector<int32_t>> src[2], pos[2];  // [phase][local j]
};
CudaMoeForwardPhases cudaMoeForwardPhases(const CudaMoePlan& plan, size_t own_rows);

// Collective over comm (same call order on every rank; uses tags [tag, tag + 2)).
// topk_idx: host [tokens x topk].
CudaMoePlan exchangeCudaMoePlan(Communicator& comm, const MoeTopology& topo, const MoeConfig& cfg,
                                size_t row_bytes, const int64_t* topk_idx, size_t tokens, uint32_t tag,
                                Deadline deadline);

}  // namespace crossbar::moe
