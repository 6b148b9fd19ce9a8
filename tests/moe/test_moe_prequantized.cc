// DeepEP-style quantized dispatch (host path): x handed over already quantized
// (QuantizedTokens) and/or the received tokens returned only as codes + scales
// (RecvOutput::kQuantized), against the encode-in-dispatch path of the same buffer:
//   * pre-quantized input (quantized here with quant.h's quantizeRow, the reference codec)
//     delivers byte-identical codes, scales and nvfp4 global scales, and, decoded, the same x
//     bytes as dispatching x itself;
//   * every received row's codes are the source's quantizeRow of that token (each rank
//     regenerates every rank's inputs);
//   * quantized output allocates no x, and its expert-major copies are the rows of the
//     expert-major index; cached handles, recycled results and combine keep working;
//   * bad inputs (format, row byte counts, x given twice, quantized forms on a native buffer)
//     are InvalidUsage on every rank before any traffic: the buffer works afterwards.
#include <gtest/gtest.h>

#include <cstring>

#include "collectives/float_types.h"
#include "collectives/moe/moe.h"
#include "collectives/quant.h"
#include "comm/errors.h"
#include "harness/multiprocess.h"
#include "moe_test_inputs.h"

namespace crossbar::moe {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;
using testinput::Input;
using testinput::Route;

// A rank's x quantized row by row with the reference codec, in QuantizedTokens' layout.
struct Quantized {
  std::vector<uint8_t> payload, scales;
  float global_scale = 1.0f;
  QuantizedTokens view(PayloadFormat f) const {
    QuantizedTokens q;
    q.format = f;
    q.payload = payload.data();
    q.scales = scales.data();
    const PayloadCodec c = payloadCodec(f);
    q.payload_row_bytes = payload.size() / std::max<size_t>(1, rows);
    q.scale_row_bytes = scales.size() / std::max<size_t>(1, rows);
    if (rows == 0) {
      q.payload_row_bytes = payloadBytes(c, hidden);
      q.scale_row_bytes = scaleBytes(c, hidden);
    }
    q.global_scale = global_scale;
    return q;
  }
  size_t rows = 0, hidden = 0;
};

Quantized quantize(const Input& in, size_t H, PayloadFormat f, DataType dt) {
  const PayloadCodec c = payloadCodec(f);
  const size_t pb = payloadBytes(c, H), sb = scaleBytes(c, H);
  Quantized q;
  q.rows = in.tokens;
  q.hidden = H;
  q.payload.resize(in.tokens * pb);
  q.scales.resize(in.tokens * sb);
  if (f == PayloadFormat::kNvfp4)
    q.global_scale = nvfp4GlobalScale(blockAmax(in.xf.data(), static_cast<int>(in.xf.size())));
  std::vector<float> sc((sb + 3) / 4 + 1);  // 4-byte aligned scratch for f32 scales
  std::vector<BFloat16> rb(H);
  for (size_t t = 0; t < in.tokens; ++t) {
    const float* row = in.xf.data() + t * H;
    if (dt == DataType::kFloat32) {
      quantizeRow(c, row, H, q.payload.data() + t * pb, sc.data(), q.global_scale);
    } else {
      for (size_t h = 0; h < H; ++h) rb[h] = BFloat16::fromFloat(row[h]);
      quantizeRow(c, rb.data(), H, q.payload.data() + t * pb, sc.data(), q.global_scale);
    }
    std::memcpy(q.scales.data() + t * sb, sc.data(), sb);
  }
  return q;
}

// Rows `rows` of `from` (`bytes` each), in that order.
std::vector<uint8_t> gather(const std::vector<uint8_t>& from, const std::vector<int32_t>& rows, size_t bytes) {
  std::vector<uint8_t> out(rows.size() * bytes);
  for (size_t p = 0; p < rows.size(); ++p)
    std::memcpy(out.data() + p * bytes, from.data() + static_cast<size_t>(rows[p]) * bytes, bytes);
  return out;
}

void expectSameRouting(const DispatchResult& a, const DispatchResult& b) {
  EXPECT_EQ(a.num_recv, b.num_recv);
  EXPECT_EQ(a.src_rank, b.src_rank);
  EXPECT_EQ(a.src_token, b.src_token);
  EXPECT_EQ(a.topk_idx, b.topk_idx);
  EXPECT_EQ(a.topk_weights, b.topk_weights);
  EXPECT_EQ(a.tokens_per_expert, b.tokens_per_expert);
  EXPECT_EQ(a.expert_rows, b.expert_rows);
  EXPECT_EQ(a.metrics.inter_node_bytes, b.metrics.inter_node_bytes);
  EXPECT_EQ(a.metrics.intra_node_bytes, b.metrics.intra_node_bytes);
}

void runFormat(std::shared_ptr<Communicator> comm, PayloadFormat f, DataType dt, Route route, bool no_tokens) {
  SCOPED_TRACE(::testing::Message() << payloadFormatName(f) << (dt == DataType::kFloat32 ? " f32" : " bf16")
                                    << " route " << static_cast<int>(route) << (no_tokens ? " no tokens" : ""));
  const int R = comm->size(), L = comm->localSize(), me = comm->rank();
  MoeConfig cfg;
  cfg.max_tokens = 32;
  cfg.hidden = 200;  // a partial last block for every codec
  cfg.topk = 4;
  cfg.num_experts = 4 * R;
  cfg.dtype = dt;
  cfg.format = f;
  cfg.timeout = Millis(20000);
  // Reference calls on `buf`, the calls under test on a buffer of their own (`pbuf`): stale
  // bytes of an earlier identical call in the staging memory cannot hide a row not written.
  auto buf = MoeBuffer::create(comm, cfg), pbuf = MoeBuffer::create(comm, cfg);
  const size_t H = cfg.hidden;
  const PayloadCodec c = payloadCodec(f);
  const size_t pb = payloadBytes(c, H), sb = scaleBytes(c, H), es = elementSize(dt);

  auto inputOf = [&](int rank) {
    Input in = testinput::makeInput(route, rank, R, L, H, cfg.topk, 4);
    if (no_tokens) in = Input{};
    return in;
  };
  const Input mine = inputOf(me);
  const auto x = testinput::toType(mine.xf, dt);
  const Quantized q = quantize(mine, H, f, dt);
  const QuantizedTokens xq = q.view(f);

  MoeBuffer::DispatchArgs a;
  a.tokens = mine.tokens;
  a.topk_idx = mine.idx.data();
  a.topk_weights = mine.w.data();

  // The reference: x itself, encoded in dispatch, both forms returned.
  a.x = x.data();
  a.output = RecvOutput::kBoth;
  const DispatchResult ref = buf->dispatch(a);
  ASSERT_EQ(ref.x.size(), ref.num_recv * H * es);
  ASSERT_EQ(ref.q_payload.size(), ref.num_recv * pb);
  ASSERT_EQ(ref.q_scales.size(), ref.num_recv * sb);
  EXPECT_EQ(ref.q_payload_expert_major, gather(ref.q_payload, ref.expert_rows, pb));
  EXPECT_EQ(ref.q_scales_expert_major, gather(ref.q_scales, ref.expert_rows, sb));

  // Every received row carries its source's codes for that token.
  std::vector<Quantized> sources;
  for (int s = 0; s < R; ++s) sources.push_back(quantize(inputOf(s), H, f, dt));
  for (size_t i = 0; i < ref.num_recv; ++i) {
    const Quantized& src = sources[ref.src_rank[i]];
    const size_t t = static_cast<size_t>(ref.src_token[i]);
    ASSERT_EQ(0, std::memcmp(ref.q_payload.data() + i * pb, src.payload.data() + t * pb, pb)) << "row " << i;
    ASSERT_EQ(0, std::memcmp(ref.q_scales.data() + i * sb, src.scales.data() + t * sb, sb)) << "row " << i;
    ASSERT_EQ(ref.q_global_scale[i], src.global_scale);
  }

  // Pre-quantized in, quantized out: no codec work; the same bytes, no x.
  a.x = nullptr;
  a.x_quantized = &xq;
  a.output = RecvOutput::kQuantized;
  DispatchResult qq = pbuf->dispatch(a);
  expectSameRouting(qq, ref);
  EXPECT_TRUE(qq.x.empty());
  EXPECT_TRUE(qq.x_expert_major.empty());
  EXPECT_EQ(qq.q_payload, ref.q_payload);
  EXPECT_EQ(qq.q_scales, ref.q_scales);
  EXPECT_EQ(qq.q_global_scale, ref.q_global_scale);
  EXPECT_EQ(qq.q_payload_expert_major, ref.q_payload_expert_major);
  EXPECT_EQ(qq.q_scales_expert_major, ref.q_scales_expert_major);

  // Pre-quantized in, dequantized out (decode only): today's x bytes.
  a.output = RecvOutput::kDequantized;
  const DispatchResult qx = pbuf->dispatch(a);
  expectSameRouting(qx, ref);
  EXPECT_EQ(qx.x, ref.x);
  EXPECT_EQ(qx.x_expert_major, ref.x_expert_major);
  EXPECT_TRUE(qx.q_payload.empty());
  EXPECT_TRUE(qx.q_payload_expert_major.empty());

  // x in, quantized out (encode only).
  a.x = x.data();
  a.x_quantized = nullptr;
  a.output = RecvOutput::kQuantized;
  const DispatchResult xqo = pbuf->dispatch(a);
  expectSameRouting(xqo, ref);
  EXPECT_TRUE(xqo.x.empty());
  EXPECT_EQ(xqo.q_payload, ref.q_payload);
  EXPECT_EQ(xqo.q_scales, ref.q_scales);

  // Cached handle + recycled quantized result: the same bytes again.
  a.x = nullptr;
  a.x_quantized = &xq;
  a.cached = qq.handle;
  a.recycle = &qq;
  const DispatchResult cached = pbuf->dispatch(a);
  expectSameRouting(cached, ref);
  EXPECT_EQ(cached.q_payload, ref.q_payload);
  EXPECT_EQ(cached.q_scales, ref.q_scales);
  EXPECT_EQ(cached.q_scales_expert_major, ref.q_scales_expert_major);

  // Combine with the handles of quantized dispatches: the reference's sums, bit for bit.
  std::vector<float> rw(ref.num_recv);
  for (size_t i = 0; i < rw.size(); ++i) rw[i] = 0.5f + 0.25f * static_cast<float>(i % 3);
  const CombineResult cref = buf->combine(ref.x.data(), dt, *ref.handle, rw.data());
  const CombineResult cq = pbuf->combine(ref.x.data(), dt, *cached.handle, rw.data());
  ASSERT_EQ(cq.out.size(), mine.tokens * H);
  ASSERT_EQ(cref.out.size(), cq.out.size());
  if (!cq.out.empty()) {
    EXPECT_EQ(0, std::memcmp(cq.out.data(), cref.out.data(), cq.out.size() * 4));
  }
  const CombineResult em_ref = buf->combineExpertMajor(ref.x_expert_major.data(), dt, ref);
  const CombineResult em_q = pbuf->combineExpertMajor(ref.x_expert_major.data(), dt, xqo);
  ASSERT_EQ(em_q.out.size(), em_ref.out.size());
  if (!em_q.out.empty()) {
    EXPECT_EQ(0, std::memcmp(em_q.out.data(), em_ref.out.data(), em_q.out.size() * 4));
  }
}

// Bad inputs, the same on every rank: rejected before any traffic, then a good call works.
void rejectBadInputs(std::shared_ptr<Communicator> comm) {
  const int R = comm->size(), L = comm->localSize(), me = comm->rank();
  MoeConfig cfg;
  cfg.max_tokens = 32;
  cfg.hidden = 200;
  cfg.topk = 4;
  cfg.num_experts = 4 * R;
  cfg.format = PayloadFormat::kFp8;
  cfg.timeout = Millis(20000);
  auto buf = MoeBuffer::create(comm, cfg);
  const Input in = testinput::makeInput(Route::kRandom, me, R, L, cfg.hidden, cfg.topk, 4);
  const auto x = testinput::toType(in.xf, DataType::kBFloat16);
  const Quantized q = quantize(in, cfg.hidden, PayloadFormat::kFp8, DataType::kBFloat16);
  MoeBuffer::DispatchArgs a;
  a.tokens = in.tokens;
  a.topk_idx = in.idx.data();
  a.topk_weights = in.w.data();
  auto expectUsage = [&](const MoeBuffer::DispatchArgs& bad, const char* needle) {
    try {
      buf->dispatch(bad);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const InvalidUsage& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(needle), std::string::npos) << m;
      EXPECT_NE(m.find("moe dispatch"), std::string::npos) << m;
      EXPECT_NE(m.find("rank " + std::to_string(me)), std::string::npos) << m;
    }
  };
  QuantizedTokens xq = q.view(PayloadFormat::kFp8);
  a.x_quantized = &xq;
  QuantizedTokens wrong = xq;
  wrong.scale_row_bytes = 4 * cfg.hidden / 128;  // floor instead of ceil: one scale short
  a.x_quantized = &wrong;
  expectUsage(a, "scale bytes per token");
  wrong = xq;
  wrong.payload_row_bytes = cfg.hidden / 2;
  expectUsage(a, "payload");
  wrong = xq;
  wrong.format = PayloadFormat::kMxfp8;
  expectUsage(a, "is mxfp8 but the buffer's payload format is fp8");
  wrong = xq;
  wrong.payload = nullptr;
  if (in.tokens > 0) expectUsage(a, "null");
  a.x_quantized = &xq;
  const uint8_t not_null = 0;  // a rank without tokens has no x memory, but passes "an x"
  a.x = x.empty() ? &not_null : x.data();
  expectUsage(a, "both x and a pre-quantized x");

  MoeConfig native = cfg;
  native.format = PayloadFormat::kNative;
  auto nb = MoeBuffer::create(comm, native);
  MoeBuffer::DispatchArgs n = a;
  n.x = nullptr;
  EXPECT_THROW(nb->dispatch(n), InvalidUsage);
  n.x = x.data();
  n.x_quantized = nullptr;
  n.output = RecvOutput::kQuantized;
  EXPECT_THROW(nb->dispatch(n), InvalidUsage);
  n.output = RecvOutput::kDequantized;  // the only form a native buffer has: fine
  const DispatchResult nd = nb->dispatch(n);
  EXPECT_EQ(nd.x.size(), nd.num_recv * cfg.hidden * 2);

  // Both buffers still work (no rank sent anything for the rejected calls).
  a.x = nullptr;
  a.x_quantized = &xq;
  a.output = RecvOutput::kQuantized;
  const DispatchResult d = buf->dispatch(a);
  EXPECT_EQ(d.q_payload.size(), d.num_recv * cfg.hidden);
  EXPECT_TRUE(d.x.empty());
}

void body(RankEnv& env) {
  auto comm = env.communicator();
  for (PayloadFormat f : {PayloadFormat::kFp8, PayloadFormat::kMxfp8, PayloadFormat::kNvfp4})
    runFormat(comm, f, DataType::kBFloat16, Route::kRandom, false);
  runFormat(comm, PayloadFormat::kFp8, DataType::kFloat32, Route::kNodeLimited, false);
  runFormat(comm, PayloadFormat::kNvfp4, DataType::kBFloat16, Route::kOneExpert, false);
  runFormat(comm, PayloadFormat::kFp8, DataType::kBFloat16, Route::kRandom, /*no_tokens=*/true);
  rejectBadInputs(comm);
}

void runTopology(int ranks, int per_node) {
  RunOptions o;
  if (per_node < ranks) o.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(per_node);
  runRanks(ranks, body, o);
}

TEST(MoePrequantized, Topology1x2) {
  runTopology(2, 2);
}
TEST(MoePrequantized, Topology1x4) {
  runTopology(4, 4);
}
TEST(MoePrequantized, Topology2x2) {
  runTopology(4, 2);
}

}  // namespace
}  // namespace crossbar::moe
