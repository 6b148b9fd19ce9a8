// CPU test of the CUDA MoE executor's host side (collectives/moe/cuda/moe_cuda_plan.h): the
// plan exchanged over the host communicator must describe exactly what the host executor
// (moe.h) delivers: received rows in the same (source rank, token) order, the same local
// expert ids (capacity drops included), per-expert counts, expert-major index, byte counts
// and dedup metrics. The forwarding lists must be consistent across ranks: what forwarder f
// writes to rank d is what d expects from f. Topologies 1x1, 1x2, 1x4, 2x2 (virtual nodes).
#include <gtest/gtest.h>

#include <algorithm>

#include "collectives/moe/cuda/moe_cuda_plan.h"
#include "collectives/moe/moe.h"
#include "collectives/moe/moe_plan.h"
#include "harness/multiprocess.h"
#include "moe_test_inputs.h"

namespace crossbar::moe {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;
using namespace testinput;

constexpr uint32_t kTag = 0x1000;

void checkCase(Communicator& comm, MoeBuffer& host, Route route, uint32_t tag) {
  const MoeConfig& cfg = host.config();
  const int R = comm.size(), L = comm.localSize(), me = comm.rank();
  const size_t k = static_cast<size_t>(cfg.topk);
  const int epr = cfg.num_experts / R;
  SCOPED_TRACE(::testing::Message() << "route " << static_cast<int>(route) << " rank " << me);
  Input in = makeInput(route, me, R, L, cfg.hidden, cfg.topk, epr);
  auto x = toType(in.xf, cfg.dtype);
  DispatchResult d = host.dispatch(x.data(), in.tokens, in.idx.data(), in.w.data());

  const MoeTopology topo = makeTopology(comm, cfg, "test");
  const RowFormat fmt = makeRowFormat(cfg);
  EXPECT_EQ(fmt.row, host.rowBytes());
  CudaMoePlan p =
      exchangeCudaMoePlan(comm, topo, cfg, fmt.row, in.idx.data(), in.tokens, tag, comm.defaultDeadline());

  ASSERT_EQ(p.num_recv, d.num_recv);
  EXPECT_EQ(p.src_rank, d.src_rank);
  EXPECT_EQ(p.src_token, d.src_token);
  EXPECT_EQ(p.recv_per_rank, d.recv_per_rank);
  EXPECT_EQ(p.topk_idx, d.topk_idx);
  EXPECT_EQ(p.tokens_per_expert, d.tokens_per_expert);
  EXPECT_EQ(p.dropped, d.metrics.dropped);
  EXPECT_EQ(p.expert_major.offsets, d.expert_offsets);
  EXPECT_EQ(p.expert_major.rows, d.expert_rows);
  // The weights the CUDA path gathers (received weight j of row i, 0 where dropped / not
  // local) through expert_major.slots are the host's expert weights.
  std::vector<float> recv_w(d.num_recv * k);
  for (size_t i = 0; i < d.num_recv; ++i) {
    Input src = makeInput(route, d.src_rank[i], R, L, cfg.hidden, cfg.topk, epr);
    for (size_t j = 0; j < k; ++j)
      recv_w[i * k + j] = p.topk_idx[i * k + j] >= 0 ? src.w[static_cast<size_t>(d.src_token[i]) * k + j] : 0.0f;
  }
  EXPECT_EQ(recv_w, d.topk_weights);
  ASSERT_EQ(p.expert_major.slots.size(), d.expert_weights.size());
  for (size_t q = 0; q < d.expert_weights.size(); ++q) EXPECT_EQ(recv_w[p.expert_major.slots[q]], d.expert_weights[q]);

  // Bytes and derived metrics are the host executor's.
  EXPECT_EQ(p.inter_node_bytes, d.metrics.inter_node_bytes);
  EXPECT_EQ(p.intra_node_bytes, d.metrics.intra_node_bytes);
  MoeMetrics m;
  m.inter_node_bytes = p.inter_node_bytes;
  m.intra_node_bytes = p.intra_node_bytes;
  finishDispatchMetrics(m, topo, p.stats, fmt.row, p.tokens_per_expert);
  EXPECT_EQ(m.flat_bytes, d.metrics.flat_bytes);
  EXPECT_EQ(m.dedup_factor, d.metrics.dedup_factor);
  EXPECT_EQ(m.network_dedup, d.metrics.network_dedup);
  EXPECT_EQ(m.expert_imbalance, d.metrics.expert_imbalance);

  // Forwarding consistency: F holds each token once per node; what this rank writes to local
  // rank j (fwd_to_local[j]) has the size j expects from it (its recv_rows[me_local]).
  size_t nf = 0;
  for (size_t c : p.fwd_count) nf += c;
  EXPECT_EQ(p.fwd_start[topo.me_node], 0u);
  for (int j = 0; j < topo.L; ++j) {
    const int peer = topo.localRank(j);
    uint64_t mine[2] = {p.fwd_to_local[j].size(), p.recv_rows[j].size()}, theirs[2] = {0, 0};
    for (int32_t f : p.fwd_to_local[j]) ASSERT_LT(static_cast<size_t>(f), nf);
    if (peer == me) {
      EXPECT_EQ(mine[0], mine[1]);
      continue;
    }
    auto r = comm.irecv(theirs, sizeof theirs, peer, tag + 7);
    comm.send(mine, sizeof mine, peer, tag + 7);
    comm.waitAll({r}, comm.defaultDeadline());
    EXPECT_EQ(mine[0], theirs[1]) << "to local rank " << peer;
    EXPECT_EQ(mine[1], theirs[0]) << "from local rank " << peer;
  }
  // Every received row is placed exactly once.
  std::vector<int32_t> all;
  for (const auto& rows : p.recv_rows) all.insert(all.end(), rows.begin(), rows.end());
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int32_t>(i));
  EXPECT_EQ(all.size(), p.num_recv);
}

void body(RankEnv& env) {
  auto comm = env.communicator();
  MoeConfig cfg;
  cfg.max_tokens = 32;
  cfg.hidden = 24;
  cfg.topk = 4;
  cfg.num_experts = 4 * comm->size();
  auto host = MoeBuffer::create(comm, cfg);
  uint32_t tag = kTag;
  for (Route r : {Route::kRandom, Route::kNodeLimited, Route::kOneExpert}) {
    checkCase(*comm, *host, r, tag);
    tag += 16;
  }
  MoeConfig capped = cfg;
  capped.expert_capacity = 2;
  capped.format = PayloadFormat::kFp8;  // another row size
  capped.hidden = 200;
  auto hc = MoeBuffer::create(comm, capped);
  checkCase(*comm, *hc, Route::kOneExpert, tag);
  checkCase(*comm, *hc, Route::kNodeLimited, tag + 16);
}

void runTopology(int ranks, int per_node) {
  RunOptions o;
  if (per_node < ranks) o.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(per_node);
  runRanks(ranks, body, o);
}

TEST(MoeCudaPlan, Topology1x1) {
  runTopology(1, 1);
}
TEST(MoeCudaPlan, Topology1x2) {
  runTopology(2, 2);
}
TEST(MoeCudaPlan, Topology1x4) {
  runTopology(4, 4);
}
TEST(MoeCudaPlan, Topology2x2) {
  runTopology(4, 2);
}

}  // namespace
}  // namespace crossbar::moe
