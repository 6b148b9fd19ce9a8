#include "collectives/moe/routing.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "comm/errors.h"

namespace crossbar::moe {
namespace {

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1), from a hash (order independent, platform independent).
double unit(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  uint64_t h =
      splitmix(splitmix(splitmix(seed ^ 0x5851F42D4C957F2Dull) ^ a) ^ (b * 0x2545F4914F6CDD1Dull) ^ c);
  return (static_cast<double>(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

}  // namespace

Routing generateRouting(size_t tokens, int rank, const RoutingOptions& o) {
  const int E = o.num_experts, G = o.num_groups;
  if (E <= 0 || G <= 0 || E % G != 0)
    throw InvalidArgument(fmt::format("generateRouting: {} experts cannot be split into {} groups", E, G));
  const int per_group = E / G;
  const int M = o.max_groups_per_token < 0 ? G : std::min(o.max_groups_per_token, G);
  if (o.topk <= 0 || o.topk > M * per_group)
    throw InvalidArgument(fmt::format("generateRouting: top-{} needs more than the {} experts of {} groups",
                                      o.topk, M * per_group, M));
  // Popularity: a seed-chosen permutation ranks the experts; weight 1 / (rank+1)^s. The
  // Gumbel-max key log(p) + Gumbel samples experts in proportion to p without replacement.
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return std::make_pair(unit(o.seed, 0xFFFF, a, 7), a) < std::make_pair(unit(o.seed, 0xFFFF, b, 7), b);
  });
  std::vector<double> logp(E);
  for (int i = 0; i < E; ++i) logp[order[i]] = -o.zipf_s * std::log(static_cast<double>(i + 1));

  Routing r;
  r.tokens = tokens;
  r.topk = o.topk;
  r.topk_idx.resize(tokens * o.topk);
  r.topk_weights.resize(tokens * o.topk);
  std::vector<double> key(E);
  std::vector<int> groups(G), cand;
  for (size_t t = 0; t < tokens; ++t) {
    for (int e = 0; e < E; ++e) key[e] = logp[e] - std::log(-std::log(unit(o.seed, rank, t, e)));
    cand.clear();
    if (M < G) {
      std::vector<double> gscore(G);
      for (int g = 0; g < G; ++g) {
        double b1 = -INFINITY, b2 = -INFINITY;
        for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
          if (key[e] > b1) {
            b2 = b1;
            b1 = key[e];
          } else if (key[e] > b2) {
            b2 = key[e];
          }
        }
        gscore[g] = per_group > 1 ? b1 + b2 : b1;
      }
      std::iota(groups.begin(), groups.end(), 0);
      std::partial_sort(groups.begin(), groups.begin() + M, groups.end(), [&](int a, int b) {
        return gscore[a] > gscore[b] || (gscore[a] == gscore[b] && a < b);
      });
      for (int i = 0; i < M; ++i)
        for (int e = groups[i] * per_group; e < (groups[i] + 1) * per_group; ++e) cand.push_back(e);
    } else {
      cand.resize(E);
      std::iota(cand.begin(), cand.end(), 0);
    }
    std::partial_sort(cand.begin(), cand.begin() + o.topk, cand.end(),
                      [&](int a, int b) { return key[a] > key[b] || (key[a] == key[b] && a < b); });
    double mx = key[cand[0]], sum = 0;
    for (int j = 0; j < o.topk; ++j) sum += std::exp(key[cand[j]] - mx);
    for (int j = 0; j < o.topk; ++j) {
      r.topk_idx[t * o.topk + j] = cand[j];
      r.topk_weights[t * o.topk + j] = static_cast<float>(std::exp(key[cand[j]] - mx) / sum);
    }
  }
  return r;
}

}  // namespace crossbar::moe
