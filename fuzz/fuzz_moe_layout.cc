// MoE routing input: MoeBuffer::layout() on arbitrary topk_idx (what a model hands to
// dispatch, which runs the same validation and statistics), and generateRouting() on
// arbitrary options. Layout runs on a buffer of 4 ranks in 2 virtual nodes, created
// once in this process (ranks are threads over the shm transport), so the per-rank
// and per-node statistics are exercised.
//
// Input: byte 0 picks the target (even: layout, odd: routing); for layout, byte 1
// picks num_experts (the buffer's 16, or a value that does not divide over the ranks)
// and the rest are topk_idx entries, one signed byte each (values in [-26, 20], so
// valid ids, -1 and out-of-range ids all occur), topk 3 per token.
// Invariants checked: a layout's counters agree with each other and with
// is_token_in_rank; a routing's experts are distinct, in range and weights sum to 1.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "collectives/moe/moe.h"
#include "collectives/moe/routing.h"
#include "comm/errors.h"
#include "comm/file_store.h"

using namespace crossbar;

namespace {

constexpr int kRanks = 4, kTopk = 3, kExperts = 16;

struct World {
  std::vector<std::shared_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<moe::MoeBuffer>> buffers;
};

World* world() {
  static World* w = [] {
    auto* out = new World;
    setenv("CROSSBAR_TRANSPORT", "shm", 1);  // virtual nodes of one process: no UCX needed
    const std::string dir =
        std::filesystem::temp_directory_path() / ("crossbar-fuzz-moe-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir);
    auto store = std::make_shared<FileStore>(dir + "/store");
    out->comms.resize(kRanks);
    out->buffers.resize(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r)
      threads.emplace_back([&, r] {
        CommOptions o;
        o.ranks_per_node = 2;
        out->comms[r] = Communicator::create(store, r, kRanks, o);
        moe::MoeConfig c;
        c.max_tokens = 64;
        c.hidden = 16;
        c.topk = kTopk;
        c.num_experts = kExperts;
        c.dtype = DataType::kFloat32;
        out->buffers[r] = moe::MoeBuffer::create(out->comms[r], c);
      });
    for (auto& t : threads) t.join();
    std::filesystem::remove_all(dir);
    return out;
  }();
  return w;
}

void check(bool ok) {
  if (!ok) std::abort();
}

void fuzzLayout(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const int rank = data[0] / 2 % kRanks;
  const int choices[] = {kExperts, 8, 32, 4, 6, 0, -4};
  const int experts = choices[data[1] % 7];
  const size_t tokens = (size - 2) / kTopk;
  std::vector<int64_t> idx(tokens * kTopk);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int8_t>(data[2 + i]) % 24 - 3;
  moe::Layout l;
  try {
    l = world()->buffers[rank]->layout(idx.empty() ? nullptr : idx.data(), tokens, experts);
  } catch (const InvalidArgument&) {
    return;
  }
  // Accepted: every entry was -1 or a valid id, and experts divide over the ranks.
  check(experts > 0 && experts % kRanks == 0);
  size_t pairs = 0, in_rank = 0, per_rank = 0, per_node = 0, per_expert = 0;
  for (int64_t e : idx) {
    check(e >= -1 && e < experts);
    pairs += e >= 0;
  }
  for (uint8_t v : l.is_token_in_rank) in_rank += v;
  for (int v : l.tokens_per_rank) {
    check(v >= 0 && static_cast<size_t>(v) <= tokens);
    per_rank += v;
  }
  for (int v : l.tokens_per_node) per_node += v;
  for (int v : l.tokens_per_expert) per_expert += v;
  check(l.tokens == tokens && l.is_token_in_rank.size() == tokens * kRanks);
  check(l.tokens_per_expert.size() == static_cast<size_t>(experts) && l.tokens_per_node.size() == 2);
  check(l.token_expert_pairs == pairs && per_expert == pairs);
  check(l.token_rank_pairs == in_rank && per_rank == in_rank);
  check(l.token_node_pairs == per_node && per_node <= in_rank && in_rank <= pairs);
  check(l.remote_token_node_pairs <= l.token_node_pairs && l.remote_token_expert_pairs <= pairs);
}

void fuzzRouting(const uint8_t* data, size_t size) {
  if (size < 8) return;
  moe::RoutingOptions o;
  o.num_experts = static_cast<int8_t>(data[1]);
  o.topk = static_cast<int8_t>(data[2]) % 16;
  o.num_groups = static_cast<int8_t>(data[3]) % 16;
  o.max_groups_per_token = static_cast<int8_t>(data[4]) % 16;
  o.zipf_s = data[5] / 64.0;
  o.seed = data[6];
  const size_t tokens = data[7] % 32;
  moe::Routing r;
  try {
    r = moe::generateRouting(tokens, data[0] % 8, o);
  } catch (const InvalidArgument&) {
    return;
  }
  check(r.tokens == tokens && r.topk == o.topk);
  check(r.topk_idx.size() == tokens * o.topk && r.topk_weights.size() == tokens * o.topk);
  for (size_t t = 0; t < tokens; ++t) {
    std::set<int64_t> seen;
    double sum = 0;
    for (int j = 0; j < o.topk; ++j) {
      const int64_t e = r.topk_idx[t * o.topk + j];
      check(e >= 0 && e < o.num_experts && seen.insert(e).second);
      const float w = r.topk_weights[t * o.topk + j];
      check(std::isfinite(w) && w >= 0);
      sum += w;
    }
    check(o.topk == 0 || std::fabs(sum - 1.0) < 1e-3);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0)
    fuzzLayout(data, size);
  else
    fuzzRouting(data, size);
  return 0;
}
