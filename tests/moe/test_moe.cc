// MoE dispatch/combine (host path) against a closed-form reference: every rank regenerates
// every rank's tokens and routing from (case, rank), so it knows exactly which rows it must
// receive and what combine must return. One runRanks per topology keeps CI time small.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <numeric>
#include <random>
#include <tuple>

#include "collectives/float_types.h"
#include "collectives/moe/moe.h"
#include "collectives/moe/moe_plan.h"
#include "collectives/moe/routing.h"
#include "comm/errors.h"
#include "harness/multiprocess.h"
#include "moe_test_inputs.h"

namespace crossbar::moe {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;

using testinput::Input;
using testinput::makeInput;
using testinput::Route;
using testinput::toType;
using testinput::tokensOf;
using Case = testinput::InputSpec;

float elemAt(const std::vector<uint8_t>& x, DataType t, size_t i) {
  if (t == DataType::kFloat32) {
    float v;
    std::memcpy(&v, x.data() + 4 * i, 4);
    return v;
  }
  BFloat16 b;
  std::memcpy(&b, x.data() + 2 * i, 2);
  return b.toFloat();
}

// Expected value of a row after the format's round trip (the codec is deterministic).
std::vector<float> roundTrip(const Input& in, size_t t, size_t H, PayloadFormat f, DataType dt) {
  std::vector<float> row(in.xf.begin() + t * H, in.xf.begin() + (t + 1) * H);
  if (f == PayloadFormat::kNative) return row;
  PayloadCodec c = payloadCodec(f);
  float g = 1.0f;
  if (f == PayloadFormat::kNvfp4)
    g = nvfp4GlobalScale(blockAmax(in.xf.data(), static_cast<int>(in.xf.size())));
  std::vector<uint8_t> q(payloadBytes(c, H)), sc(scaleBytes(c, H) + 4);
  std::vector<float> out(H);
  if (dt == DataType::kFloat32) {
    quantizeRow(c, row.data(), H, q.data(), sc.data(), g);
    dequantizeRow(c, q.data(), sc.data(), H, out.data(), g);
  } else {
    std::vector<BFloat16> rb(H), ob(H);
    for (size_t h = 0; h < H; ++h) rb[h] = BFloat16::fromFloat(row[h]);
    quantizeRow(c, rb.data(), H, q.data(), sc.data(), g);
    dequantizeRow(c, q.data(), sc.data(), H, ob.data(), g);
    for (size_t h = 0; h < H; ++h) out[h] = ob[h].toFloat();
  }
  return out;
}

// Dispatch + combine of one case on one buffer; checks everything against the reference.
// node_of: each rank's physical node (Communicator::nodeOf).
void runCase(MoeBuffer& buf, const Case& c, int me, int R, int L, const std::vector<int>& node_of,
             PayloadFormat f, DataType dt) {
  SCOPED_TRACE(::testing::Message() << "route " << static_cast<int>(c.route) << " format "
                                    << payloadFormatName(f));
  const size_t H = c.hidden;
  const int k = c.topk, epr = c.experts_per_rank;
  Input mine = makeInput(c, me, R, L);
  auto xin = toType(mine.xf, dt);

  // Layout agrees with a direct count.
  Layout lay = buf.layout(mine.idx.data(), mine.tokens, epr * R);
  for (int r = 0; r < R; ++r) {
    int cnt = 0;
    for (size_t t = 0; t < mine.tokens; ++t) {
      bool in = false;
      for (int j = 0; j < k; ++j) in |= mine.idx[t * k + j] >= 0 && mine.idx[t * k + j] / epr == r;
      cnt += in;
      EXPECT_EQ(lay.is_token_in_rank[t * R + r], in ? 1 : 0);
    }
    EXPECT_EQ(lay.tokens_per_rank[r], cnt);
  }

  std::shared_ptr<const MoeHandle> handle;
  for (int pass = 0; pass < 2; ++pass) {  // pass 1 reuses the handle (cached layout)
    DispatchResult d = buf.dispatch(xin.data(), mine.tokens, mine.idx.data(), mine.w.data(), handle);
    handle = d.handle;
    // Reference: rows in (source rank, token) order.
    size_t row = 0;
    std::vector<int> per_expert(epr, 0);
    std::vector<double> expect_scale;  // per row: sum of local weights (for the weighted combine)
    for (int s = 0; s < R; ++s) {
      Input in = makeInput(c, s, R, L);
      int got_from_s = 0;
      for (size_t t = 0; t < in.tokens; ++t) {
        bool here = false;
        for (int j = 0; j < k; ++j) here |= in.idx[t * k + j] >= 0 && in.idx[t * k + j] / epr == me;
        if (!here) continue;
        ++got_from_s;
        ASSERT_LT(row, d.num_recv);
        EXPECT_EQ(d.src_rank[row], s);
        EXPECT_EQ(d.src_token[row], static_cast<int>(t));
        double ws = 0;
        for (int j = 0; j < k; ++j) {
          int64_t e = in.idx[t * k + j];
          bool local = e >= 0 && e / epr == me;
          EXPECT_EQ(d.topk_idx[row * k + j], local ? e - me * epr : -1);
          EXPECT_EQ(d.topk_weights[row * k + j], local ? in.w[t * k + j] : 0.0f);
          if (local) ++per_expert[e - me * epr], ws += in.w[t * k + j];
        }
        expect_scale.push_back(ws);
        auto want = roundTrip(in, t, H, f, dt);
        for (size_t h = 0; h < H; ++h) {
          float got = elemAt(d.x, dt, row * H + h);
          ASSERT_EQ(got, want[h]) << "row " << row << " ch " << h;
          // Sanity bound of the codec against the original (relative to the row's max).
          float amax = 0;
          for (size_t q = 0; q < H; ++q) amax = std::max(amax, std::fabs(in.xf[t * H + q]));
          float tol = f == PayloadFormat::kNative  ? 0.0f
                      : f == PayloadFormat::kNvfp4 ? 0.3f * amax
                      : f == PayloadFormat::kMxfp8 ? 0.07f * std::fabs(in.xf[t * H + h]) + 0.13f * amax
                                                   : 0.07f * std::fabs(in.xf[t * H + h]) + 1e-3f * amax;
          ASSERT_LE(std::fabs(got - in.xf[t * H + h]), tol) << "row " << row << " ch " << h;
        }
        ++row;
      }
      EXPECT_EQ(d.recv_per_rank[s], got_from_s);
    }
    ASSERT_EQ(row, d.num_recv);
    EXPECT_EQ(d.tokens_per_expert, per_expert);
    EXPECT_EQ(d.metrics.dropped, 0u);
    // Expert-major rows copy the right tokens.
    for (int e = 0; e < epr; ++e)
      for (int p = d.expert_offsets[e]; p < d.expert_offsets[e + 1]; ++p)
        for (size_t h = 0; h < H; h += 7)
          ASSERT_EQ(elemAt(d.x_expert_major, dt, p * H + h), elemAt(d.x, dt, d.expert_rows[p] * H + h));

    // Combine with y = received x: unweighted, each rank adds x once (so x * #ranks),
    // weighted by the local weight sums: x * (sum of the token's weights).
    std::vector<float> w(d.num_recv);
    for (size_t i = 0; i < d.num_recv; ++i) w[i] = static_cast<float>(expect_scale[i]);
    CombineResult plain = buf.combine(d.x.data(), dt, *d.handle);
    CombineResult weighted = buf.combine(d.x.data(), dt, *d.handle, w.data());
    CombineResult em = buf.combineExpertMajor(d.x_expert_major.data(), dt, d, d.expert_weights.data());
    ASSERT_EQ(plain.out.size(), mine.tokens * H);
    for (size_t t = 0; t < mine.tokens; ++t) {
      std::vector<int> ranks;
      double wsum = 0;
      for (int j = 0; j < k; ++j) {
        int64_t e = mine.idx[t * k + j];
        if (e < 0) continue;
        wsum += mine.w[t * k + j];
        if (std::find(ranks.begin(), ranks.end(), e / epr) == ranks.end())
          ranks.push_back(static_cast<int>(e / epr));
      }
      auto want = roundTrip(mine, t, H, f, dt);
      for (size_t h = 0; h < H; ++h) {
        ASSERT_EQ(plain.out[t * H + h], want[h] * static_cast<float>(ranks.size())) << "token " << t;
        ASSERT_NEAR(weighted.out[t * H + h], want[h] * wsum, 1e-4 * (1 + std::fabs(want[h])));
        ASSERT_NEAR(em.out[t * H + h], want[h] * wsum, 1e-4 * (1 + std::fabs(want[h])));
      }
    }
    if (pass == 0 && R / L > 1) {
      // One network row per (token, remote physical node holding one of its experts).
      uint64_t pairs = 0;
      for (size_t t = 0; t < mine.tokens; ++t) {
        std::vector<int> nodes;
        for (int j = 0; j < k; ++j) {
          const int64_t e = mine.idx[t * k + j];
          if (e < 0) continue;
          const int n = node_of[e / epr];
          if (n != node_of[me] && std::find(nodes.begin(), nodes.end(), n) == nodes.end()) nodes.push_back(n);
        }
        pairs += nodes.size();
      }
      EXPECT_EQ(lay.remote_token_node_pairs, pairs);
      EXPECT_EQ(d.metrics.inter_node_bytes, pairs * buf.rowBytes());
      EXPECT_GE(d.metrics.network_dedup, 1.0);
    }
  }
}

void body(RankEnv& env) {
  auto comm = env.communicator();
  const int R = comm->size(), me = comm->rank();
  MoeConfig cfg;
  cfg.max_tokens = 32;
  cfg.hidden = 40;
  cfg.topk = 4;
  cfg.num_experts = 4 * R;
  // Ranks per routing group of the inputs (the node size, or the gcd of uneven nodes' sizes).
  const int L = testinput::routingGroupSize(*comm);
  std::vector<int> node_of(R);
  for (int r = 0; r < R; ++r) node_of[r] = comm->nodeOf(r);
  const int N = R / L;

  auto bf = MoeBuffer::create(comm, cfg);
  runCase(*bf, Case{}, me, R, L, node_of, PayloadFormat::kNative, DataType::kBFloat16);
  runCase(*bf, Case{.route = Route::kNodeLimited}, me, R, L, node_of, PayloadFormat::kNative,
          DataType::kBFloat16);
  runCase(*bf, Case{.zero_tokens = true}, me, R, L, node_of, PayloadFormat::kNative, DataType::kBFloat16);
  runCase(*bf, Case{.route = Route::kOneExpert}, me, R, L, node_of, PayloadFormat::kNative,
          DataType::kBFloat16);
  if (N <= cfg.topk)
    runCase(*bf, Case{.route = Route::kEveryNode}, me, R, L, node_of, PayloadFormat::kNative,
            DataType::kBFloat16);

  // Invalid inputs (every rank passes the same kind, before any traffic).
  std::vector<int64_t> bad(cfg.topk, 0);
  std::vector<float> x(cfg.hidden, 1.0f), wts(cfg.topk, 1.0f);
  bad[1] = cfg.num_experts;
  EXPECT_THROW(bf->dispatch(x.data(), 1, bad.data(), wts.data()), InvalidArgument);
  bad[1] = -2;
  EXPECT_THROW(bf->layout(bad.data(), 1, cfg.num_experts), InvalidArgument);
  EXPECT_THROW(bf->layout(bad.data(), 0, cfg.num_experts + 1), InvalidArgument);
  EXPECT_THROW(bf->dispatch(x.data(), cfg.max_tokens + 1, bad.data(), wts.data()), InvalidArgument);
  MoeConfig odd = cfg;
  odd.num_experts = 4 * R + 1;
  EXPECT_THROW(MoeBuffer::create(comm, odd), InvalidArgument);
  // Still usable after rejected calls.
  runCase(*bf, Case{}, me, R, L, node_of, PayloadFormat::kNative, DataType::kBFloat16);

  MoeConfig f32 = cfg;
  f32.dtype = DataType::kFloat32;
  runCase(*MoeBuffer::create(comm, f32), Case{.fractional = true}, me, R, L, node_of, PayloadFormat::kNative,
          DataType::kFloat32);

  for (PayloadFormat f : {PayloadFormat::kFp8, PayloadFormat::kMxfp8, PayloadFormat::kNvfp4}) {
    MoeConfig q = cfg;
    q.format = f;
    q.hidden = 200;  // partial last block for every codec
    q.return_quantized = true;
    runCase(*MoeBuffer::create(comm, q), Case{.hidden = 200, .fractional = true}, me, R, L, node_of, f,
            DataType::kBFloat16);
  }

  // Capacity: one assignment per local expert; the rest are dropped and counted.
  MoeConfig capped = cfg;
  capped.expert_capacity = 1;
  auto cb = MoeBuffer::create(comm, capped);
  Input in = makeInput(Case{.route = Route::kOneExpert}, me, R, L);
  auto xin = toType(in.xf, DataType::kBFloat16);
  DispatchResult d = cb->dispatch(xin.data(), in.tokens, in.idx.data(), in.w.data());
  size_t total = 0;
  for (int s = 0; s < R; ++s) total += tokensOf(Case{}, s);
  EXPECT_EQ(d.tokens_per_expert[0], me == 0 && total > 0 ? 1 : 0);
  EXPECT_EQ(d.metrics.dropped, me == 0 && total > 0 ? total - 1 : 0);

  // Without the expert-major copy: the same rows and expert-major index, no copy.
  MoeConfig nocopy = cfg;
  nocopy.expert_major_copy = false;
  auto nb = MoeBuffer::create(comm, nocopy);
  Input nin = makeInput(Case{}, me, R, L);
  auto nx = toType(nin.xf, DataType::kBFloat16);
  DispatchResult with = bf->dispatch(nx.data(), nin.tokens, nin.idx.data(), nin.w.data());
  DispatchResult without = nb->dispatch(nx.data(), nin.tokens, nin.idx.data(), nin.w.data());
  EXPECT_TRUE(without.x_expert_major.empty());
  EXPECT_EQ(with.x, without.x);
  EXPECT_EQ(with.expert_offsets, without.expert_offsets);
  EXPECT_EQ(with.expert_rows, without.expert_rows);
  EXPECT_EQ(with.expert_weights, without.expert_weights);
  EXPECT_EQ(with.x_expert_major.size(), with.expert_rows.size() * cfg.hidden * 2);
}

void runTopology(int ranks, int per_node) {
  RunOptions o;
  if (per_node < ranks) o.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(per_node);
  runRanks(ranks, body, o);
}

TEST(Moe, Topology1x2) {
  runTopology(2, 2);
}
TEST(Moe, Topology1x4) {
  runTopology(4, 4);
}
TEST(Moe, Topology2x2) {
  runTopology(4, 2);
}
TEST(Moe, Topology4x2) {
  runTopology(8, 2);
}
// Nodes of different sizes (a shrunk fault-tolerant communicator): a rank of the smaller node
// forwards for several ranks of the larger one ({0,1} | {2}: rank 2 for 0 and 1; {0-3} |
// {4,5}: 4 for 0 and 2, 5 for 1 and 3), a larger node's ranks 2 and 3 forward only their own
// rows, and each token still crosses the network once per destination node (runCase checks
// the bytes against the layout's remote (token, node) pairs).
TEST(Moe, UnevenNodes2And1) {
  runTopology(3, 2);
}
TEST(Moe, UnevenNodes4And2) {
  runTopology(6, 4);
}
TEST(Moe, UnevenNodes2And2And1) {
  runTopology(5, 2);
}
// {0,1,2} | {3,4,5} | {6,7}: ranks 2 and 5 (local index 2) have no counterpart on the last
// node, which deals them out (2 -> 6, 5 -> 7) instead of giving both to rank 6.
TEST(Moe, UnevenNodes3And3And2) {
  runTopology(8, 3);
}

// Random configurations, the same on every rank (a shared seed; XB_MOE_RANDOM_SEED picks
// another): hidden size (1 to 1000, partial codec blocks), top-k, experts per rank, 0 to 48
// tokens per rank, routing (random, node-limited, one expert, every node), payload format,
// dtype, quantized output or not, chunk size; each checked by runCase against the
// closed-form reference, its handle reused. XB_MOE_RANDOM_ROUNDS sets the rounds (10).
void randomBody(RankEnv& env) {
  auto comm = env.communicator();
  const int R = comm->size(), me = comm->rank();
  const int L = testinput::routingGroupSize(*comm), N = R / L;
  std::vector<int> node_of(R);
  for (int r = 0; r < R; ++r) node_of[r] = comm->nodeOf(r);
  const char* seed_env = std::getenv("XB_MOE_RANDOM_SEED");
  const char* rounds_env = std::getenv("XB_MOE_RANDOM_ROUNDS");
  std::mt19937_64 rng((seed_env ? std::stoull(seed_env) : 19) * 1000 + static_cast<uint64_t>(R * 10 + L));
  auto below = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  const size_t hiddens[] = {1, 8, 40, 128, 200, 264, 1000};
  const int64_t chunks[] = {0, 1, 3, 16, 128};
  const int rounds = rounds_env ? std::stoi(rounds_env) : 10;
  for (int round = 0; round < rounds; ++round) {
    Case c;
    c.hidden = hiddens[below(std::size(hiddens))];
    c.experts_per_rank = 1 + static_cast<int>(below(4));
    c.topk = 1 + static_cast<int>(below(std::min(8, c.experts_per_rank * R)));
    c.route = static_cast<Route>(below(4));
    if (c.route == Route::kEveryNode && N > c.topk) c.route = Route::kNodeLimited;
    // Node-limited routing picks top-k among the experts of at most max(1, N / 2) groups.
    if (c.route == Route::kNodeLimited && c.topk > c.experts_per_rank * L * std::max(1, N / 2))
      c.route = Route::kRandom;
    c.fractional = below(2);
    c.salt = round + 1;
    c.random_tokens = 1 + below(48);
    MoeConfig cfg;
    cfg.max_tokens = c.random_tokens + below(8);
    cfg.hidden = c.hidden;
    cfg.topk = c.topk;
    cfg.num_experts = c.experts_per_rank * R;
    cfg.dtype = below(2) ? DataType::kBFloat16 : DataType::kFloat32;
    cfg.format = static_cast<PayloadFormat>(below(4));
    cfg.return_quantized = cfg.format != PayloadFormat::kNative && below(2);
    cfg.chunk_tokens = chunks[below(std::size(chunks))];
    SCOPED_TRACE(::testing::Message()
                 << "round " << round << ": hidden " << c.hidden << " top-" << c.topk << ", "
                 << c.experts_per_rank << " experts per rank, up to " << c.random_tokens << " tokens, "
                 << dataTypeName(cfg.dtype) << ", chunk " << cfg.chunk_tokens
                 << (cfg.return_quantized ? ", quantized out" : ""));
    auto buf = MoeBuffer::create(comm, cfg);
    runCase(*buf, c, me, R, L, node_of, cfg.format, cfg.dtype);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(Moe, RandomConfigurations) {
  runRanks(3, randomBody);                                // one node
  runRanks(4, randomBody, testing::withRanksPerNode(2));  // 2 x 2
  runRanks(3, randomBody, testing::withRanksPerNode(2));  // nodes of 2 and 1
}

// Who forwards for whom on uneven nodes (moe_plan.h), checked on every rank against the
// rule: the same local index when the node has it, the others dealt round-robin.
void topologyBody(RankEnv& env) {
  auto comm = env.communicator();
  MoeConfig cfg;
  cfg.max_tokens = 4;
  cfg.hidden = 8;
  cfg.topk = 2;
  cfg.num_experts = comm->size();
  const MoeTopology t = makeTopology(*comm, cfg, "test");
  std::vector<int> sources(t.R, 1);
  for (int m = 0; m < t.N; ++m) {
    const auto& there = t.node_ranks[m];
    for (int s = 0; s < t.R; ++s) {
      const int f = t.forwarderOn(m, s);
      ASSERT_EQ(t.node_of[f], m) << "source " << s;
      if (t.node_of[s] == m) {
        EXPECT_EQ(f, s);
        continue;
      }
      ++sources[f];
      if (t.local_of[s] < static_cast<int>(there.size())) {
        EXPECT_EQ(t.local_of[f], t.local_of[s]) << "source " << s;
      }
    }
  }
  EXPECT_EQ(t.max_sources, *std::max_element(sources.begin(), sources.end()));
  // This rank's own lists agree with the table.
  ASSERT_FALSE(t.fwd_sources.empty());
  EXPECT_EQ(t.fwd_sources[0], t.rank);
  EXPECT_EQ(static_cast<int>(t.fwd_sources.size()), sources[t.rank]);
  for (size_t i = 1; i < t.fwd_sources.size(); ++i)
    EXPECT_EQ(t.forwarderOn(t.me_node, t.fwd_sources[i]), t.rank);
  for (int j = 0; j < t.L; ++j)
    for (int s : t.sources_via[j]) EXPECT_EQ(t.forwarderLocal(s), j);
  const char* sizes_env = std::getenv("XB_TEST_NODE_SIZES");
  const std::string sizes = sizes_env ? sizes_env : "";
  if (sizes == "3,3,2") {
    EXPECT_EQ(t.max_sources, 4);  // the last node's ranks forward for 2 + 1 sources each, plus themselves
    if (t.rank >= 6) {
      EXPECT_EQ(t.fwd_sources.size(), 4u);
    }
  } else if (sizes == "4,4,4,3") {
    EXPECT_EQ(t.max_sources, 5);  // three extra sources dealt to ranks 12, 13, 14: one each
  }
}

TEST(MoeTopology, DealsMissingLocalIndicesRoundRobin) {
  for (auto [ranks, per_node, sizes] : {std::tuple{8, 3, "3,3,2"}, std::tuple{15, 4, "4,4,4,3"}}) {
    RunOptions o = testing::withRanksPerNode(per_node);
    o.env["XB_TEST_NODE_SIZES"] = sizes;
    runRanks(ranks, topologyBody, o);
  }
}

TEST(MoeRouting, NodeLimitedAndDeterministic) {
  RoutingOptions o;
  o.num_experts = 256;
  o.topk = 8;
  o.num_groups = 8;
  o.max_groups_per_token = 4;
  o.zipf_s = 1.0;
  o.seed = 7;
  auto a = generateRouting(64, 3, o), b = generateRouting(64, 3, o);
  EXPECT_EQ(a.topk_idx, b.topk_idx);
  for (size_t t = 0; t < 64; ++t) {
    std::vector<int64_t> groups;
    float s = 0;
    for (int j = 0; j < 8; ++j) {
      int64_t e = a.topk_idx[t * 8 + j];
      ASSERT_GE(e, 0);
      ASSERT_LT(e, 256);
      groups.push_back(e / 32);
      s += a.topk_weights[t * 8 + j];
    }
    std::sort(groups.begin(), groups.end());
    EXPECT_LE(std::unique(groups.begin(), groups.end()) - groups.begin(), 4);
    EXPECT_NEAR(s, 1.0f, 1e-5);
  }
  o.topk = 200;
  EXPECT_THROW(generateRouting(1, 0, o), InvalidArgument);
}

}  // namespace
}  // namespace crossbar::moe
