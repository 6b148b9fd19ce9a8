// CPU test of the CUDA MoE executor's host side (collectives/moe/cuda/moe_cuda_plan.h): the
// plan exchanged over the host communicator must describe exactly what the host executor
// (moe.h) delivers: received rows in the same (source rank, token) order, the same local
// expert ids (capacity drops included), per-expert counts, expert-major index, byte counts
// and dedup metrics. The forwarding lists must be consistent across ranks: what forwarder f
// writes to rank d is what d expects from f. Topologies 1x1, 1x2, 1x4, 2x2 and nodes of 4 and 2, of 2, 2 and
// 1, and of 3, 3 and 2 ranks (virtual nodes). Then the executor's data movement is emulated on the CPU with
// the plan's and the kernels' index arrays (cudaMoeSumIndex, cudaMoeForwardPhases), in the executor's order
// of operations (several nodes: own rows forwarded / summed while the network phase is in flight), over host
// p2p: the received rows and the plain, weighted and expert-major combines must equal the host executor's bit
// for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "collectives/float_types.h"
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

// Rows [rows[i]] of `src` (rows of `width` bytes), packed.
std::vector<uint8_t> gather(const uint8_t* src, const std::vector<int32_t>& rows, size_t width) {
  std::vector<uint8_t> out(rows.size() * width);
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(out.data() + i * width, src + rows[i] * width, width);
  return out;
}

// Bit-identical float vectors (memcmp of an empty vector's data() would pass null).
bool sameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

float loadF(const uint8_t* y, DataType t, size_t i) {
  if (t == DataType::kFloat32) {
    float v;
    std::memcpy(&v, y + 4 * i, 4);
    return v;
  }
  BFloat16 b;
  std::memcpy(&b, y + 2 * i, 2);
  return b.toFloat();
}

// The CUDA executor's data movement on the CPU (native payloads; f32 combine wire).
void emulateExecutor(Communicator& comm, MoeBuffer& host, const MoeTopology& t, const CudaMoePlan& p,
                     const std::vector<uint8_t>& x, const DispatchResult& d, uint32_t tag) {
  const MoeConfig& cfg = host.config();
  const size_t H = cfg.hidden, es = elementSize(cfg.dtype), xrow = H * es;
  const size_t slot_floats = static_cast<size_t>(t.max_sources) * cfg.max_tokens * H;
  const CudaMoeSumIndex sx = cudaMoeSumIndex(p, slot_floats, H);
  const Deadline dl = comm.defaultDeadline();
  // Dispatch, in the executor's order with several nodes: the remote nodes' blocks of F
  // arrive over the network (NCCL on the executor's second stream) while the own block's rows
  // are delivered to the local ranks (phase 0); the network's rows go after the join (phase
  // 1). F's remote blocks hold garbage until the network is done, so a phase-0 row that
  // needed the network would show up in the received rows.
  const CudaMoeForwardPhases ph = cudaMoeForwardPhases(p, p.fwd_count[0]);
  EXPECT_EQ(p.fwd_start[0], 0u) << "the own block is F's first";
  std::vector<uint8_t> F(sx.nf * xrow, 0xFF);
  {
    auto own = gather(x.data(), p.node_send[t.me_node], xrow);
    if (!own.empty()) std::memcpy(F.data() + p.fwd_start[0] * xrow, own.data(), own.size());
  }
  const size_t S = t.fwd_sources.size();  // F's blocks: [0] own, then one per source
  std::vector<std::vector<uint8_t>> keep(t.N), net_in(S);
  std::vector<RequestPtr> reqs, net;
  for (int m = 0; m < t.N; ++m) {
    if (m == t.me_node) continue;
    keep[m] = gather(x.data(), p.node_send[m], xrow);
    net.push_back(comm.isend(keep[m].data(), keep[m].size(), t.forwarderOn(m, t.rank), tag + 2));
  }
  for (size_t st = 1; st < S; ++st) {
    net_in[st].resize(p.fwd_count[st] * xrow);
    net.push_back(comm.irecv(net_in[st].data(), net_in[st].size(), t.fwd_sources[st], tag + 2));
  }
  std::vector<std::vector<uint8_t>> out_to(t.L), in_from(t.L);
  auto forward = [&](int phase) {
    for (int j = 0; j < t.L; ++j) {
      ASSERT_EQ(ph.src[phase][j].size(), ph.pos[phase][j].size());
      for (size_t q = 0; q < ph.src[phase][j].size(); ++q) {
        EXPECT_EQ(phase == 0, static_cast<size_t>(ph.src[phase][j][q]) < p.fwd_count[0]);
        std::memcpy(out_to[j].data() + ph.pos[phase][j][q] * xrow, F.data() + ph.src[phase][j][q] * xrow,
                    xrow);
      }
    }
  };
  for (int j = 0; j < t.L; ++j) {
    out_to[j].assign(p.fwd_to_local[j].size() * xrow, 0xEE);
    EXPECT_EQ(ph.src[0][j].size() + ph.src[1][j].size(), p.fwd_to_local[j].size()) << "local rank " << j;
  }
  forward(0);
  comm.waitAll(net, dl);
  for (size_t st = 1; st < S; ++st)
    if (!net_in[st].empty())
      std::memcpy(F.data() + p.fwd_start[st] * xrow, net_in[st].data(), net_in[st].size());
  forward(1);
  // Every slot position written once, with the row fwd_to_local says.
  for (int j = 0; j < t.L; ++j)
    EXPECT_EQ(out_to[j], gather(F.data(), p.fwd_to_local[j], xrow))
        << "forwarding phases to local rank " << j;
  // Within the node: each local rank's slot for us, decoded to recv_rows.
  for (int j = 0; j < t.L; ++j) {
    if (t.localRank(j) == t.rank) {
      in_from[j] = out_to[j];
      continue;
    }
    in_from[j].resize(p.recv_rows[j].size() * xrow);
    reqs.push_back(comm.isend(out_to[j].data(), out_to[j].size(), t.localRank(j), tag + 3));
    reqs.push_back(comm.irecv(in_from[j].data(), in_from[j].size(), t.localRank(j), tag + 3));
  }
  comm.waitAll(reqs, dl);
  reqs.clear();
  std::vector<uint8_t> got(p.num_recv * xrow);
  for (int j = 0; j < t.L; ++j)
    for (size_t q = 0; q < p.recv_rows[j].size(); ++q)
      std::memcpy(got.data() + p.recv_rows[j][q] * xrow, in_from[j].data() + q * xrow, xrow);
  EXPECT_EQ(got, d.x) << "emulated dispatch";

  // Combine of f32 rows y (already weighted), as the kernels do it.
  auto combine = [&](const std::vector<float>& yw, uint32_t ctag) {
    std::vector<float> cb(static_cast<size_t>(t.max_node) * slot_floats, 0.0f);
    std::vector<std::vector<float>> send(t.L);
    for (int j = 0; j < t.L; ++j) {
      for (int32_t r : p.recv_rows[j])
        send[j].insert(send[j].end(), yw.begin() + r * H, yw.begin() + (r + 1) * H);
      float* my_slot_there = cb.data() + static_cast<size_t>(t.me_local) * slot_floats;
      if (t.localRank(j) == t.rank) {
        std::copy(send[j].begin(), send[j].end(), my_slot_there);
        continue;
      }
      reqs.push_back(comm.isend(send[j].data(), send[j].size() * 4, t.localRank(j), ctag));
      // Local rank j's rows for us land in slot j.
      reqs.push_back(comm.irecv(cb.data() + static_cast<size_t>(j) * slot_floats,
                                p.fwd_to_local[j].size() * H * 4, t.localRank(j), ctag));
    }
    comm.waitAll(reqs, dl);
    reqs.clear();
    // The forwarder's sums in the executor's order: the other nodes' rows (F rows >= own)
    // first, sent while the own rows are summed. acc starts as NaN: a row sent before its sum
    // would poison the result.
    const size_t own = p.fwd_count[0];
    std::vector<float> acc(sx.nf * H, std::numeric_limits<float>::quiet_NaN());
    auto sumRows = [&](size_t from, size_t to) {
      for (size_t i = from; i < to; ++i)
        for (size_t c = 0; c < H; ++c) {
          float a = 0.0f;
          for (int32_t q = sx.c_first[i]; q < sx.c_first[i + 1]; ++q) a += cb[sx.c_offs[q] + c];
          acc[i * H + c] = a;
        }
    };
    sumRows(own, sx.nf);
    std::vector<std::vector<float>> back(t.N);
    for (size_t st = 1; st < S; ++st)
      reqs.push_back(
          comm.isend(acc.data() + p.fwd_start[st] * H, p.fwd_count[st] * H * 4, t.fwd_sources[st], ctag + 1));
    for (int m = 0; m < t.N; ++m) {
      if (m == t.me_node) continue;
      back[m].resize(p.node_send[m].size() * H);
      reqs.push_back(comm.irecv(back[m].data(), back[m].size() * 4, t.forwarderOn(m, t.rank), ctag + 1));
    }
    sumRows(0, own);
    comm.waitAll(reqs, dl);
    reqs.clear();
    std::vector<float> out(p.tokens * H);
    for (size_t tok = 0; tok < p.tokens; ++tok)
      for (size_t c = 0; c < H; ++c) {
        float a = 0.0f;
        for (int32_t q = sx.t_first[tok]; q < sx.t_first[tok + 1]; ++q) {
          const int node = static_cast<int>(sx.t_src[q] >> 32);
          const size_t i = static_cast<size_t>(sx.t_src[q] & 0xFFFFFFFF);
          a += node == t.me_node ? acc[(p.fwd_start[0] + i) * H + c] : back[node][i * H + c];
        }
        out[tok * H + c] = a;
      }
    return out;
  };
  std::vector<float> rw(d.num_recv);
  for (size_t i = 0; i < d.num_recv; ++i) rw[i] = 0.5f + 0.375f * static_cast<float>(i % 5);
  std::vector<float> y(d.num_recv * H), yw(d.num_recv * H);
  for (size_t i = 0; i < d.num_recv * H; ++i) {
    y[i] = loadF(d.x.data(), cfg.dtype, i);
    yw[i] = y[i] * rw[i / H];
  }
  CombineResult hc = host.combine(d.x.data(), cfg.dtype, *d.handle);
  CombineResult hcw = host.combine(d.x.data(), cfg.dtype, *d.handle, rw.data());
  EXPECT_TRUE(sameFloats(combine(y, tag + 4), hc.out)) << "emulated combine";
  EXPECT_TRUE(sameFloats(combine(yw, tag + 6), hcw.out)) << "emulated weighted combine";
  // Expert-major: the rows of one received row summed first (em CSR), then combine.
  std::vector<float> em(d.num_recv * H, 0.0f);
  for (size_t i = 0; i < d.num_recv; ++i)
    for (size_t c = 0; c < H; ++c) {
      float a = 0.0f;
      for (int32_t q = sx.em_first[i]; q < sx.em_first[i + 1]; ++q)
        a += loadF(d.x_expert_major.data(), cfg.dtype, static_cast<size_t>(sx.em_idx[q]) * H + c) *
             d.expert_weights[sx.em_idx[q]];
      em[i * H + c] = a;
    }
  CombineResult hem = host.combineExpertMajor(d.x_expert_major.data(), cfg.dtype, d, d.expert_weights.data());
  EXPECT_TRUE(sameFloats(combine(em, tag + 8), hem.out)) << "emulated expert-major combine";
}

void checkCase(Communicator& comm, MoeBuffer& host, Route route, uint32_t tag) {
  const MoeConfig& cfg = host.config();
  const MoeTopology topo = makeTopology(comm, cfg, "test");
  const int R = comm.size(), L = routingGroupSize(comm), me = comm.rank();  // L: ranks per routing group
  const size_t k = static_cast<size_t>(cfg.topk);
  const int epr = cfg.num_experts / R;
  SCOPED_TRACE(::testing::Message() << "route " << static_cast<int>(route) << " rank " << me);
  Input in = makeInput(route, me, R, L, cfg.hidden, cfg.topk, epr);
  auto x = toType(in.xf, cfg.dtype);
  DispatchResult d = host.dispatch(x.data(), in.tokens, in.idx.data(), in.w.data());

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
      recv_w[i * k + j] =
          p.topk_idx[i * k + j] >= 0 ? src.w[static_cast<size_t>(d.src_token[i]) * k + j] : 0.0f;
  }
  EXPECT_EQ(recv_w, d.topk_weights);
  ASSERT_EQ(p.expert_major.slots.size(), d.expert_weights.size());
  for (size_t q = 0; q < d.expert_weights.size(); ++q)
    EXPECT_EQ(recv_w[p.expert_major.slots[q]], d.expert_weights[q]);

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
  EXPECT_EQ(p.fwd_start[0], 0u);
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

  if (cfg.format == PayloadFormat::kNative) emulateExecutor(comm, host, topo, p, x, d, tag);
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
  MoeConfig f32 = cfg;
  f32.dtype = DataType::kFloat32;
  f32.expert_capacity = 3;
  auto hf = MoeBuffer::create(comm, f32);
  checkCase(*comm, *hf, Route::kRandom, tag + 32);
  checkCase(*comm, *hf, Route::kOneExpert, tag + 48);
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
// Nodes of different sizes: ranks of the smaller node forward for several sources (moe_plan.h).
TEST(MoeCudaPlan, UnevenNodes4And2) {
  runTopology(6, 4);
}
TEST(MoeCudaPlan, UnevenNodes2And2And1) {
  runTopology(5, 2);
}
TEST(MoeCudaPlan, UnevenNodes3And3And2) {  // the last node deals out local index 2's sources
  runTopology(8, 3);
}

}  // namespace
}  // namespace crossbar::moe
