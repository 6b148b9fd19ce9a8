// Planning shared by the host and CUDA executors of the MoE all-to-all (moe.h,
// cuda/moe_cuda.h): config checks, the node topology, the wire record layout, the routing
// statistics (layout), which tokens go to which node, the receive-side rewrite of top-k
// indices to local experts (with the capacity limit), the expert-major index and the
// metrics. Both executors call these, so they agree on every count and byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "collectives/moe/moe.h"

namespace crossbar::moe {

// Nodes in order of their first rank (they may differ in size: a shrunk fault-tolerant
// communicator, an uneven launch). Expert e lives on rank e / epr. Rank s's tokens for node m
// cross the network once, to one rank of m, which writes them into the buffers of the ranks of
// m holding their experts: that rank forwards for s. It is the rank with s's local index when
// m has one (always, on even nodes); the sources whose local index m lacks are dealt round-robin
// over m's ranks, so on {8,8,8,7} each of three ranks of the small node forwards one extra
// source instead of one rank forwarding three (max_sources, which sizes every buffer: 5, not 7).
struct MoeTopology {
  int rank = 0, R = 1, N = 1, me_node = 0, me_local = 0, epr = 1;
  int L = 1;            // ranks on this rank's node
  int max_node = 1;     // ranks on the largest node (sizes the symmetric buffers alike everywhere)
  int max_sources = 1;  // the most sources any rank forwards for (its own rows included)
  std::vector<std::vector<int>> node_ranks;  // [node index][local index] -> rank
  std::vector<int> node_of;                  // rank -> node index
  std::vector<int> local_of;                 // rank -> local index in its node
  // [0] this rank, then the remote ranks whose tokens for this node it forwards, in rank order.
  std::vector<int> fwd_sources;
  // [local j]: the ranks (any node) whose rows local rank j forwards to this node's ranks.
  std::vector<std::vector<int>> sources_via;
  // forwarderOn for the sources whose local index the node lacks (uneven nodes only):
  // key m * R + s. Everything else follows the local index, so even nodes keep no table.
  std::unordered_map<int64_t, int> extra_forwarder;
  int rankOfExpert(int64_t e) const { return static_cast<int>(e / epr); }
  // The rank of this rank's node with local index j.
  int localRank(int j) const { return node_ranks[me_node][j]; }
  // The rank of node m that forwards `src`'s tokens for m (src itself when it is on m).
  int forwarderOn(int m, int src) const {
    const auto& there = node_ranks[m];
    const size_t l = static_cast<size_t>(local_of[src]);
    return l < there.size() ? there[l] : extra_forwarder.at(static_cast<int64_t>(m) * R + src);
  }
  // Local index (on this rank's node) of the rank that forwards `src`'s rows here.
  int forwarderLocal(int src) const { return local_of[forwarderOn(me_node, src)]; }
};

// Validates cfg for `comm` (InvalidArgument / Unsupported naming rank and operation) and
// builds the topology.
MoeTopology makeTopology(const Communicator& comm, const MoeConfig& cfg, const char* op);

// One token on the wire: [RowHeader 16 B][top-k ids, int64][weights, f32][scales][payload],
// each part 16-aligned where it matters.
struct RowHeader {
  int32_t src_rank;
  int32_t src_token;
  float global_scale;  // nvfp4's per-tensor scale of the source rank
  int32_t reserved;    // host path: the row's index among its source's rows for the receiver
};
static_assert(sizeof(RowHeader) == 16);

struct RowFormat {
  size_t es = 2;  // element size of cfg.dtype
  size_t off_topk = 0, off_w = 0, off_scales = 0, off_payload = 0;
  size_t scale_bytes = 0, payload_bytes = 0;
  size_t row = 0;  // record size
};
RowFormat makeRowFormat(const MoeConfig& cfg);

// Dispatch arguments both executors check the same way (InvalidUsage with `ctx`, before any
// traffic): a pre-quantized x must match the buffer's format and row sizes, and non-null
// arrays with tokens.
void checkQuantizedInput(const MoeConfig& cfg, const RowFormat& f, const QuantizedTokens& xq, size_t tokens,
                         const std::string& ctx);
// Which forms of the received rows a dispatch with `output` returns (InvalidUsage for a
// quantized form of a native buffer).
struct RecvForms {
  bool x = true, q = false;
};
RecvForms recvForms(const MoeConfig& cfg, RecvOutput output, const std::string& ctx);

// Routing statistics of topk_idx (InvalidArgument for ids outside [-1, num_experts)).
Layout computeLayout(const MoeTopology& t, int topk, const int64_t* topk_idx, size_t tokens, int num_experts,
                     const std::string& ctx);

// [node]: this rank's tokens with an expert on that node, in token order (each once).
std::vector<std::vector<int32_t>> nodeSendLists(const MoeTopology& t, const Layout& l);

// [local j]: for the routed rows `rows` (each an int64 [topk] id list, in forwarding order),
// the indices of the rows going to local rank j (each row once per rank holding one of its
// experts), in order.
std::vector<std::vector<int32_t>> localTargets(const MoeTopology& t, int topk, int num_experts,
                                               const int64_t* topk_rows, size_t rows);

// Receive-side rewrite of one row's top-k ids to this rank's local experts, in (source rank,
// token) order (the capacity drops the later assignments).
class ExpertAssigner {
 public:
  ExpertAssigner(const MoeTopology& t, int topk, int64_t capacity)
      : first_(static_cast<int64_t>(t.rank) * t.epr),
        epr_(t.epr),
        k_(topk),
        capacity_(capacity),
        tokens_per_expert_(t.epr, 0) {}
  // out_idx[j]: local expert or -1; out_w[j] (when both w and out_w are given): w[j] or 0.
  void assign(const int64_t* idx, const float* w, int64_t* out_idx, float* out_w);
  const std::vector<int>& tokensPerExpert() const { return tokens_per_expert_; }
  uint64_t dropped() const { return dropped_; }

 private:
  int64_t first_;
  int epr_, k_;
  int64_t capacity_;
  std::vector<int> tokens_per_expert_;
  uint64_t dropped_ = 0;
};

// Expert-major index of rewritten ids ([n x topk]): rows of local expert e are
// [offsets[e], offsets[e+1]); rows[p] is the received row, slots[p] = row * topk + j (where
// its weight is).
struct ExpertMajorIndex {
  std::vector<int> offsets;
  std::vector<int32_t> rows, slots;
};
ExpertMajorIndex expertMajorIndex(const std::vector<int64_t>& topk_idx, size_t n, int topk,
                                  const std::vector<int>& tokens_per_expert);

// Dispatch metrics derivable from the plan: flat bytes, dedup factors, expert imbalance
// (inter/intra bytes and dropped must be set already).
void finishDispatchMetrics(MoeMetrics& m, const MoeTopology& t, const Layout& stats, size_t row,
                           const std::vector<int>& tokens_per_expert);

}  // namespace crossbar::moe
