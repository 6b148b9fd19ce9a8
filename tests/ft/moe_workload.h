// The MoE workload of the fault-tolerance tests and the recovery benchmark: one step is a
// dispatch + combine, checked against a closed-form reference (each rank regenerates every
// rank's tokens and routing from (seed, iteration, rank)).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "collectives/moe/moe.h"
#include "collectives/moe/routing.h"
#include "ft/kill_trial.h"

namespace crossbar::testing {

namespace moe_workload {

inline constexpr size_t kMaxTokens = 24, kHidden = 384;
inline constexpr int kTopk = 4;

// Tokens of `rank` in step (iter, seed): 0 sometimes, up to kMaxTokens.
inline size_t moeTokensOf(int rank, int iter, uint32_t seed) {
  return (static_cast<size_t>(rank) * 7 + static_cast<size_t>(iter) * 5 + seed) % (kMaxTokens + 1);
}

struct MoeTokens {
  size_t n = 0;
  std::vector<float> x;  // [n x kHidden], small integers (exact in f32 sums)
  std::vector<int64_t> idx;
  std::vector<float> w;
};

inline MoeTokens tokensFor(int rank, int iter, uint32_t seed, int experts, int nodes) {
  MoeTokens t;
  t.n = moeTokensOf(rank, iter, seed);
  t.x.resize(t.n * kHidden);
  for (size_t i = 0; i < t.n; ++i)
    for (size_t h = 0; h < kHidden; ++h)
      t.x[i * kHidden + h] =
          static_cast<float>(static_cast<int>((rank * 131 + i * 17 + h * 7 + iter + seed) % 15) - 7);
  moe::RoutingOptions ro;
  ro.num_experts = experts;
  ro.topk = kTopk;
  ro.num_groups = experts % nodes == 0 ? nodes : 1;
  ro.max_groups_per_token = std::max(1, ro.num_groups / 2);  // DeepSeek-V3-style node limit
  ro.seed = seed * 1000 + static_cast<uint64_t>(iter);
  auto r = moe::generateRouting(t.n, rank, ro);
  t.idx = std::move(r.topk_idx);
  t.w = std::move(r.topk_weights);
  for (size_t i = 0; i < t.n; i += 3) t.idx[i * kTopk + kTopk - 1] = -1;  // "no expert" entries
  return t;
}

}  // namespace moe_workload

// Dispatch + combine on two buffers used in turn: f32 as is (bit exact) and fp8 (e4m3,
// one scale per 128 channels: within e4m3's rounding of the source values).
class MoeWorkload : public Workload {
 public:
  using MoeBuffer = moe::MoeBuffer;
  using PayloadFormat = moe::PayloadFormat;
  explicit MoeWorkload(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {
    using namespace moe_workload;
    for (PayloadFormat f : {PayloadFormat::kNative, PayloadFormat::kFp8}) {
      moe::MoeConfig cfg;
      cfg.max_tokens = kMaxTokens;
      cfg.hidden = kHidden;
      cfg.topk = kTopk;
      cfg.num_experts = kExperts;
      cfg.dtype = DataType::kFloat32;
      cfg.format = f;
      cfg.chunk_tokens = 8;  // several pipelined chunks per call
      buffers_.push_back(MoeBuffer::create(comm_, cfg));
    }
  }

  // Nodes the all-to-all runs over (the communicator's nodes, even when they differ in size).
  size_t nodes() const { return buffers_[0]->layout(nullptr, 0, kExperts).tokens_per_node.size(); }

  void step(int iter, uint32_t seed) override {
    using namespace moe_workload;
    const int n = comm_->size(), me = comm_->rank(), nodes = comm_->numNodes();
    const bool fp8 = iter % 2 == 1;
    MoeBuffer& buf = *buffers_[fp8 ? 1 : 0];
    const int per_rank = kExperts / n;
    auto mine = tokensFor(me, iter, seed, kExperts, nodes);
    auto d = buf.dispatch(mine.x.data(), mine.n, mine.idx.data(), mine.w.data());

    // The rows this rank must receive, in (source rank, source token) order.
    const std::string what = fmt::format("rank {} step {} ({})", me, iter, fp8 ? "fp8" : "f32");
    size_t row = 0;
    for (int s = 0; s < n; ++s) {
      auto src = s == me ? mine : tokensFor(s, iter, seed, kExperts, nodes);
      for (size_t t = 0; t < src.n; ++t) {
        bool here = false;
        for (int j = 0; j < kTopk; ++j)
          here |= src.idx[t * kTopk + j] >= 0 && src.idx[t * kTopk + j] / per_rank == me;
        if (!here) continue;
        ASSERT_LT(row, d.num_recv) << what << ": too few rows";
        ASSERT_EQ(d.src_rank[row], s) << what << " row " << row;
        ASSERT_EQ(d.src_token[row], static_cast<int32_t>(t)) << what << " row " << row;
        for (int j = 0; j < kTopk; ++j) {
          const int64_t e = src.idx[t * kTopk + j];
          const bool local = e >= 0 && e / per_rank == me;
          ASSERT_EQ(d.topk_idx[row * kTopk + j], local ? e - static_cast<int64_t>(me) * per_rank : -1)
              << what;
          ASSERT_EQ(d.topk_weights[row * kTopk + j], local ? src.w[t * kTopk + j] : 0.0f) << what;
        }
        const float* got = reinterpret_cast<const float*>(d.x.data()) + row * kHidden;
        for (size_t h = 0; h < kHidden; ++h) {
          const float want = src.x[t * kHidden + h];
          if (fp8 ? std::fabs(got[h] - want) > std::fabs(want) / 16 + 1e-6f : got[h] != want) {
            ADD_FAILURE() << what << " row " << row << " (from rank " << s << " token " << t << ") channel "
                          << h << ": " << got[h] << " != " << want;
            return;
          }
        }
        ++row;
      }
    }
    ASSERT_EQ(row, d.num_recv) << what << ": too many rows";

    // Identity experts: each token comes back as its row times the ranks that received it.
    auto c = buf.combine(d.x.data(), DataType::kFloat32, *d.handle);
    ASSERT_EQ(c.out.size(), mine.n * kHidden) << what;
    for (size_t t = 0; t < mine.n; ++t) {
      std::vector<int> ranks;
      for (int j = 0; j < kTopk; ++j)
        if (mine.idx[t * kTopk + j] >= 0)
          ranks.push_back(static_cast<int>(mine.idx[t * kTopk + j] / per_rank));
      std::sort(ranks.begin(), ranks.end());
      const float copies = static_cast<float>(std::unique(ranks.begin(), ranks.end()) - ranks.begin());
      for (size_t h = 0; h < kHidden; ++h) {
        const float want = copies * mine.x[t * kHidden + h], got = c.out[t * kHidden + h];
        if (fp8 ? std::fabs(got - want) > std::fabs(want) / 16 + 1e-6f : got != want) {
          ADD_FAILURE() << what << " combine token " << t << " channel " << h << ": " << got
                        << " != " << want;
          return;
        }
      }
    }
  }

 private:
  std::shared_ptr<Communicator> comm_;
  // Divisible by every communicator size a trial has (1-9 ranks): the experts are spread
  // again over the survivors.
  static constexpr int kExperts = 2520;
  std::vector<std::unique_ptr<MoeBuffer>> buffers_;
};

inline MakeWorkload moeWorkload() {
  return [](std::shared_ptr<Communicator> comm) { return std::make_unique<MoeWorkload>(std::move(comm)); };
}

}  // namespace crossbar::testing
