// Chunked pipelining of MoE dispatch/combine: every chunk size (including sizes that differ
// between ranks and sizes that do not divide the row counts) gives bit-identical dispatch and
// combine results to the unpipelined run (chunk_tokens = 0), fresh and with a cached handle,
// also into recycled (stale, larger or smaller) output buffers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "collectives/float_types.h"
#include "collectives/moe/moe.h"
#include "collectives/moe/routing.h"
#include "comm/errors.h"
#include "harness/multiprocess.h"
#include "moe_test_inputs.h"

namespace crossbar::moe {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;

struct Outcome {
  std::vector<uint8_t> x, q_payload, q_scales;
  std::vector<int32_t> src_rank, src_token;
  std::vector<int64_t> topk_idx;
  std::vector<float> topk_weights, combined, weighted;
  MoeMetrics dispatch_metrics;
};

void expectSame(const Outcome& a, const Outcome& b, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.x, b.x);
  EXPECT_EQ(a.q_payload, b.q_payload);
  EXPECT_EQ(a.q_scales, b.q_scales);
  EXPECT_EQ(a.src_rank, b.src_rank);
  EXPECT_EQ(a.src_token, b.src_token);
  EXPECT_EQ(a.topk_idx, b.topk_idx);
  EXPECT_EQ(a.topk_weights, b.topk_weights);
  ASSERT_EQ(a.combined.size(), b.combined.size());
  // Bitwise: the sums are done in a fixed order whatever the chunking.
  ASSERT_EQ(a.weighted.size(), b.weighted.size());
  // (memcmp of empty vectors would pass null pointers: undefined behavior.)
  if (!a.combined.empty()) {
    EXPECT_EQ(0, std::memcmp(a.combined.data(), b.combined.data(), a.combined.size() * sizeof(float)));
  }
  if (!a.weighted.empty()) {
    EXPECT_EQ(0, std::memcmp(a.weighted.data(), b.weighted.data(), a.weighted.size() * sizeof(float)));
  }
  EXPECT_EQ(a.dispatch_metrics.inter_node_bytes, b.dispatch_metrics.inter_node_bytes);
  EXPECT_EQ(a.dispatch_metrics.intra_node_bytes, b.dispatch_metrics.intra_node_bytes);
}

Outcome runOnce(std::shared_ptr<Communicator> comm, MoeConfig cfg, size_t tokens,
                const std::vector<BFloat16>& x, const Routing& routing) {
  auto buf = MoeBuffer::create(comm, cfg);
  Outcome o;
  std::shared_ptr<const MoeHandle> handle;
  DispatchResult prev;
  // pass 1: cached handle; passes 2, 3, 4: also recycling the previous result, whose buffers
  // hold garbage and are larger (2) or smaller (3) than needed, or have too little capacity
  // (4: they must stay in the recycled result, untouched). Each must give the same again.
  for (int pass = 0; pass < 5; ++pass) {
    DispatchResult* recycle = nullptr;
    const uint8_t* small_x = nullptr;
    size_t small_x_size = 0;
    if (pass >= 2) {
      for (auto* v : {&prev.x, &prev.q_payload, &prev.q_scales}) {
        v->resize(pass == 2 ? v->size() + 5 : v->size() / 2);
        if (pass == 4) v->shrink_to_fit();
        std::fill(v->begin(), v->end(), static_cast<uint8_t>(0xA5));
      }
      if (pass == 4 && prev.x.capacity() > 0) {
        small_x = prev.x.data();
        small_x_size = prev.x.size();
      }
      recycle = &prev;
    }
    DispatchResult d = buf->dispatch(x.data(), tokens, routing.topk_idx.data(), routing.topk_weights.data(),
                                     handle, recycle);
    if (recycle && pass < 4) {
      EXPECT_TRUE(prev.x.empty() && !prev.handle && prev.src_rank.empty()) << "recycled result not emptied";
      if (cfg.return_quantized) {
        EXPECT_TRUE(prev.q_payload.empty() && prev.q_scales.empty());
      }
    }
    if (small_x) {
      EXPECT_TRUE(prev.x.data() == small_x && prev.x.size() == small_x_size &&
                  std::all_of(prev.x.begin(), prev.x.end(), [](uint8_t b) { return b == 0xA5; }))
          << "a recycled x too small for the result was not left untouched in the recycled result";
      EXPECT_TRUE(d.x.data() != small_x);
      EXPECT_TRUE(!prev.handle && prev.src_rank.empty());
    }
    handle = d.handle;
    // y: a row-dependent, non-trivial function of x so the f32 sums have rounding to get wrong.
    std::vector<float> y(d.num_recv * cfg.hidden), w(d.num_recv);
    for (size_t i = 0; i < d.num_recv; ++i) {
      w[i] = 0.3f + 0.01f * static_cast<float>(i % 13);
      for (size_t c = 0; c < cfg.hidden; ++c) {
        BFloat16 b;
        std::memcpy(&b, d.x.data() + (i * cfg.hidden + c) * 2, 2);
        y[i * cfg.hidden + c] =
            b.toFloat() * (1.0f + 0.1f * static_cast<float>(d.src_rank[i] % 3)) + 1e-3f * c;
      }
    }
    Outcome cur;
    cur.x = d.x;
    cur.q_payload = d.q_payload;
    cur.q_scales = d.q_scales;
    cur.src_rank = d.src_rank;
    cur.src_token = d.src_token;
    cur.topk_idx = d.topk_idx;
    cur.topk_weights = d.topk_weights;
    cur.dispatch_metrics = d.metrics;
    cur.combined = buf->combine(y.data(), DataType::kFloat32, *d.handle).out;
    cur.weighted = buf->combine(y.data(), DataType::kFloat32, *d.handle, w.data()).out;
    if (pass == 0)
      o = cur;
    else
      expectSame(o, cur, pass == 1 ? "cached handle" : pass == 4 ? "recycled output too small" : "recycled output");
    prev = std::move(d);
  }
  return o;
}

void body(RankEnv& env) {
  auto comm = env.communicator();
  const int R = comm->size(), me = comm->rank();
  MoeConfig cfg;
  cfg.max_tokens = 37;
  cfg.hidden = 24;
  cfg.topk = 5;
  cfg.num_experts = 3 * R;
  // Odd token counts per rank (one rank sends nothing).
  const size_t tokens = me == 1 ? 0 : 11 + 7 * static_cast<size_t>(me) % 27;
  RoutingOptions ro;
  ro.num_experts = cfg.num_experts;
  ro.topk = cfg.topk;
  ro.num_groups = R / testinput::routingGroupSize(*comm);  // the nodes, or groups within uneven ones
  ro.seed = 5;
  Routing routing = generateRouting(tokens, me, ro);
  for (size_t t = 0; t < tokens; t += 4) routing.topk_idx[t * cfg.topk + 2] = -1;
  std::vector<BFloat16> x(tokens * cfg.hidden);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = BFloat16::fromFloat(static_cast<float>((i * 29 + static_cast<size_t>(me) * 7) % 61) / 7.0f - 4.0f);

  for (PayloadFormat f : {PayloadFormat::kNative, PayloadFormat::kFp8}) {
    cfg.format = f;
    cfg.return_quantized = f != PayloadFormat::kNative;
    cfg.chunk_tokens = 0;
    const Outcome whole = runOnce(comm, cfg, tokens, x, routing);
    for (int64_t chunk : {1, 3, 4, 36, 37, 100}) {
      cfg.chunk_tokens = chunk;
      expectSame(whole, runOnce(comm, cfg, tokens, x, routing), "uniform chunk");
    }
    cfg.chunk_tokens = 1 + me % 3;  // senders and receivers need not agree
    expectSame(whole, runOnce(comm, cfg, tokens, x, routing), "per-rank chunk");
  }
  // bf16 partial sums on the network: still independent of the chunking, and within one
  // bf16 rounding per node partial (|partial| < 40 here) of the f32 wire's sums.
  cfg.format = PayloadFormat::kNative;
  cfg.return_quantized = false;
  cfg.chunk_tokens = 0;
  const Outcome exact = runOnce(comm, cfg, tokens, x, routing);
  cfg.combine_wire = DataType::kBFloat16;
  const Outcome half = runOnce(comm, cfg, tokens, x, routing);
  cfg.chunk_tokens = 3;
  expectSame(half, runOnce(comm, cfg, tokens, x, routing), "bf16 wire, chunked");
  ASSERT_EQ(half.combined.size(), exact.combined.size());
  for (size_t i = 0; i < exact.combined.size(); ++i)
    ASSERT_NEAR(half.combined[i], exact.combined[i], comm->numNodes() * 40.0 / 256) << "element " << i;
  if (comm->numNodes() == 1) {
    EXPECT_EQ(half.combined, exact.combined);  // nothing crosses a network
  }

  MoeConfig bad = cfg;
  bad.combine_wire = DataType::kFloat16;
  EXPECT_THROW(MoeBuffer::create(comm, bad), InvalidArgument);
  bad = cfg;
  bad.chunk_tokens = -2;
  EXPECT_THROW(MoeBuffer::create(comm, bad), InvalidArgument);
}

void runTopology(int ranks, int per_node, const char* net_message_bytes = nullptr) {
  RunOptions o;
  if (per_node < ranks) o.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(per_node);
  if (net_message_bytes) o.env["CROSSBAR_MOE_NET_MESSAGE_BYTES"] = net_message_bytes;
  runRanks(ranks, body, o);
}

TEST(MoeChunks, Topology2x2) {
  runTopology(4, 2);
}
TEST(MoeChunks, Topology3x1) {
  runTopology(3, 1);
}
// Network messages smaller than a row (pieces split rows), and one message per chunk.
TEST(MoeChunks, NetMessagesSplitRows) {
  runTopology(4, 2, "100");
}
TEST(MoeChunks, NetMessagePerChunk) {
  runTopology(3, 1, "0");
}
// Nodes of 2 and 1 ranks: rank 2 forwards for ranks 0 and 1, two chunked streams at once.
TEST(MoeChunks, UnevenNodes2And1) {
  runTopology(3, 2, "100");
}

}  // namespace
}  // namespace crossbar::moe
