// Inputs shared by the MoE tests (host path, CUDA plan on the CPU, executor on the GPU):
// every rank's tokens and routing are a function of (spec, rank), with "no expert" entries,
// skewed node-limited routing, all-to-one-expert, every-node and zero-token ranks.
#pragma once

#include <cstring>
#include <numeric>
#include <vector>

#include "collectives/dtype.h"
#include "collectives/float_types.h"
#include "collectives/moe/routing.h"
#include "comm/communicator.h"

namespace crossbar::moe::testinput {

enum class Route {
  kRandom,
  kNodeLimited,
  kOneExpert,
  kEveryNode,  // one expert on every node (needs topk >= nodes), spread over local ranks
};

struct Input {
  size_t tokens = 0;
  std::vector<float> xf;  // [tokens x hidden], bf16-representable
  std::vector<int64_t> idx;
  std::vector<float> w;
};

// What makeInput generates. Integer values (fractional = false) keep every sum exact in bf16.
struct InputSpec {
  Route route = Route::kRandom;
  size_t hidden = 40;
  int topk = 4;
  int experts_per_rank = 4;
  bool zero_tokens = false;  // every rank sends nothing
  bool fractional = false;
  int salt = 0;  // another set of values and routes
  // > 0: each rank sends 0..random_tokens tokens, a function of (rank, salt).
  size_t random_tokens = 0;
};

// Ranks per routing group of the generated inputs (node-limited routing, "every node"): the
// gcd of the node sizes, the same on every rank when nodes differ in size (each group lies in
// one node, so a route over every group reaches every node).
inline int routingGroupSize(const Communicator& comm) {
  int g = 0;
  for (const auto& node : comm.nodes()) g = std::gcd(g, static_cast<int>(node.size()));
  return g;
}

// Rank 1 sends nothing; the others different counts (or random counts, random_tokens).
inline size_t tokensOf(const InputSpec& c, int rank) {
  if (c.random_tokens > 0 && !c.zero_tokens) {
    uint64_t h = (static_cast<uint64_t>(rank) << 32) ^ static_cast<uint64_t>(c.salt) * 0x9E3779B97F4A7C15ull;
    h = (h ^ (h >> 31)) * 0xBF58476D1CE4E5B9ull;
    return static_cast<size_t>((h ^ (h >> 29)) % (c.random_tokens + 1));
  }
  return c.zero_tokens || rank == 1 ? 0 : 5 + 3 * static_cast<size_t>(rank);
}

// Rank `rank`'s tokens and routing, among R ranks in routing groups of L.
inline Input makeInput(const InputSpec& c, int rank, int R, int L) {
  Input in;
  in.tokens = tokensOf(c, rank);
  const int E = c.experts_per_rank * R, N = R / L, k = c.topk;
  in.xf.resize(in.tokens * c.hidden);
  for (size_t t = 0; t < in.tokens; ++t)
    for (size_t h = 0; h < c.hidden; ++h) {
      float v = static_cast<float>(static_cast<int>((rank * 131 + t * 17 + h * 7 + c.salt) % 15) - 7);
      if (c.fractional) v = v * 0.37f + 0.01f * static_cast<float>(h % 9) * (t % 2 ? 1.0f : 100.0f);
      in.xf[t * c.hidden + h] = BFloat16::fromFloat(v).toFloat();
    }
  if (c.route == Route::kRandom || c.route == Route::kNodeLimited) {
    RoutingOptions ro;
    ro.num_experts = E;
    ro.topk = k;
    ro.num_groups = N;
    ro.max_groups_per_token = c.route == Route::kNodeLimited ? std::max(1, N / 2) : -1;
    ro.zipf_s = c.route == Route::kNodeLimited ? 1.2 : 0.0;
    ro.seed = 42 + static_cast<uint64_t>(c.salt);
    auto r = generateRouting(in.tokens, rank, ro);
    in.idx = r.topk_idx;
    in.w = r.topk_weights;
    for (size_t t = 0; t < in.tokens; t += 3) in.idx[t * k + k - 1] = -1;  // "no expert" entries
    return in;
  }
  in.idx.assign(in.tokens * k, -1);
  in.w.assign(in.tokens * k, 0.0f);
  for (size_t t = 0; t < in.tokens; ++t)
    for (int j = 0; j < k; ++j) {
      if (c.route == Route::kOneExpert) {
        if (j > 0) continue;  // the other entries stay "no expert", weight 0
        in.idx[t * k] = 0;
      } else {
        const int node = j % N, dst = node * L + static_cast<int>((t + j) % L);
        in.idx[t * k + j] = static_cast<int64_t>(dst) * c.experts_per_rank + (t % c.experts_per_rank);
      }
      in.w[t * k + j] = 0.25f + 0.125f * j;
    }
  return in;
}

// The CUDA tests' inputs: fractional values.
inline Input makeInput(Route route, int rank, int R, int L, size_t hidden, int topk, int experts_per_rank,
                       int salt = 0) {
  return makeInput(InputSpec{.route = route,
                             .hidden = hidden,
                             .topk = topk,
                             .experts_per_rank = experts_per_rank,
                             .fractional = true,
                             .salt = salt},
                   rank, R, L);
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
