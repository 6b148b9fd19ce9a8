// Synthetic MoE routing for tests and benchmarks: DeepSeek-V3-style node-limited top-k
// (experts grouped by the node that hosts them; each token picks its M best nodes by the sum
// of their two best expert scores, then its top-k experts inside those nodes), over uniform
// or Zipf-skewed expert popularity. Deterministic from (seed, rank, token): the same call
// gives the same routing on every machine, so any rank can recompute another's routing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace crossbar::moe {

struct RoutingOptions {
  int num_experts = 256;
  int topk = 8;
  int num_groups = 1;             // nodes (experts e live in group e / (num_experts / num_groups))
  int max_groups_per_token = -1;  // M of node-limited routing; -1: no limit
  double zipf_s = 0.0;            // 0: uniform popularity; s > 0: expert popularity ~ 1 / k^s
  uint64_t seed = 1;
};

struct Routing {
  size_t tokens = 0;
  int topk = 0;
  std::vector<int64_t> topk_idx;    // [tokens x topk], distinct experts per token
  std::vector<float> topk_weights;  // [tokens x topk], softmax of the chosen scores (sum 1)
};

// Routing of `tokens` tokens of `rank`. InvalidArgument if topk exceeds the experts the
// group limit leaves, or num_experts is not a multiple of num_groups.
Routing generateRouting(size_t tokens, int rank, const RoutingOptions& options);

}  // namespace crossbar::moe
