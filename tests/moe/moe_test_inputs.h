// Inputs shared by the CUDA MoE tests (plan on the CPU, executor on the GPU): every rank's
// tokens and routing are a function of (case, rank), with "no expert" entries, skewed
// node-limited routing, all-to-one-expert and zero-token ranks.
#pragma once

#include <cstring>
#include <map>
#include <numeric>
#include <vector>

#include "collectives/dtype.h"
#include "collectives/float_types.h"
#include "collectives/moe/routing.h"
#include "comm/communicator.h"

namespace crossbar::moe::testinput {

enum class Route { kRandom, kNodeLimited, kOneExpert };

struct Input {
  size_t tokens = 0;
  std::vector<float> xf;  // [tokens x hidden], bf16-representable, fractional
  std::vector<int64_t> idx;
  std::vector<float> w;
};

// Ranks per routing group of the generated inputs (node-limited routing, "every node"): the
// gcd of the node sizes, the same on every rank when nodes differ in size (each group lies in
// one node, so a route over every group reaches every node).
inline int routingGroupSize(const Communicator& comm) {
  std::map<int, int> per_node;
  for (int r = 0; r < comm.size(); ++r) ++per_node[comm.nodeOf(r)];
  int g = 0;
  for (const auto& [node, n] : per_node) g = std::gcd(g, n);
  return g;
}

inline size_t tokensOf(int rank) {
  return rank == 1 ? 0 : 5 + 3 * static_cast<size_t>(rank);
}

inline Input makeInput(Route route, int rank, int R, int L, size_t hidden, int topk, int experts_per_rank,
                       int salt = 0) {
  Input in;
  in.tokens = tokensOf(rank);
  const int E = experts_per_rank * R, N = R / L, k = topk;
  in.xf.resize(in.tokens * hidden);
  for (size_t t = 0; t < in.tokens; ++t)
    for (size_t h = 0; h < hidden; ++h) {
      float v = static_cast<float>(static_cast<int>((rank * 131 + t * 17 + h * 7 + salt) % 15) - 7);
      v = v * 0.37f + 0.01f * static_cast<float>(h % 9) * (t % 2 ? 1.0f : 100.0f);
      in.xf[t * hidden + h] = BFloat16::fromFloat(v).toFloat();
    }
  if (route == Route::kOneExpert) {
    in.idx.assign(in.tokens * k, -1);
    in.w.assign(in.tokens * k, 0.0f);
    for (size_t t = 0; t < in.tokens; ++t) {
      in.idx[t * k] = 0;
      in.w[t * k] = 0.75f;
    }
    return in;
  }
  RoutingOptions ro;
  ro.num_experts = E;
  ro.topk = k;
  ro.num_groups = N;
  ro.max_groups_per_token = route == Route::kNodeLimited ? std::max(1, N / 2) : -1;
  ro.zipf_s = route == Route::kNodeLimited ? 1.2 : 0.0;
  ro.seed = 42 + static_cast<uint64_t>(salt);
  auto r = generateRouting(in.tokens, rank, ro);
  in.idx = r.topk_idx;
  in.w = r.topk_weights;
  for (size_t t = 0; t < in.tokens; t += 3) in.idx[t * k + k - 1] = -1;  // "no expert" entries
  return in;
}

inline std::vector<uint8_t> toType(const std::vector<float>& xf, DataType t) {
  std::vector<uint8_t> out(xf.size() * elementSize(t));
  for (size_t i = 0; i < xf.size(); ++i) {
    if (t == DataType::kFloat32) {
      std::memcpy(out.data() + 4 * i, &xf[i], 4);
    } else {
      auto b = BFloat16::fromFloat(xf[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  }
  return out;
}

}  // namespace crossbar::moe::testinput
