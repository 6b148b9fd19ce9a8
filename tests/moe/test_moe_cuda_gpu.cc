// GPU checks of the MoE CUDA building blocks (skip without a device): the payload codec
// kernels produce the same bytes as the host codecs (collectives/quant.h) for fp8 / mxfp8 /
// nvfp4, bf16 and f32 rows, partial blocks, NaN / Inf / zero blocks, strided rows and row
// permutations; decoding on the GPU equals decoding on the host; the tensor amax equals the
// host's. The work runs in a forked child (the gtest process never initializes CUDA).
//
// CUDA dispatch / combine (CudaMoeBuffer) against the host executor (MoeBuffer) on the same
// inputs, bit for bit: received tokens, source ranks / tokens, local expert ids, weights,
// expert-major rows and copies, quantized payloads and scales, counts, byte metrics, the
// cached-handle dispatch, unweighted, weighted and expert-major combine; bf16 / f32 native, fp8, mxfp8,
// nvfp4; random, node-limited, all-to-one-expert (capacity) routing, a rank with no tokens.
// One node (1, 2 and 4 ranks sharing GPU 0 through the CUDA symmetric heap); 2x2 virtual
// nodes need NCCL, which wants one GPU per rank: skipped below 4 GPUs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <vector>

#include "collectives/float_types.h"
#include "collectives/moe/cuda/moe_codec.h"
#include "collectives/moe/cuda/moe_cuda.h"
#include "collectives/moe/moe.h"
#include "collectives/quant.h"
#include "comm/errors.h"
#include "gpu_checks.h"
#include "harness/multiprocess.h"
#include "moe_test_inputs.h"

namespace crossbar::moe {
namespace {

#define CUDA_OK(call)                                                                                     \
  do {                                                                                                    \
    cudaError_t e_ = (call);                                                                              \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorName(e_) << " " << cudaGetErrorString(e_); \
  } while (0)

// Rows with every kind of block: normal values, wide dynamic range, all-zero, NaN, +-Inf.
std::vector<float> makeRows(size_t rows, size_t hidden, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(rows * hidden);
  for (size_t r = 0; r < rows; ++r)
    for (size_t h = 0; h < hidden; ++h) {
      float v = n(g) * std::ldexp(1.0f, static_cast<int>(r % 7) * 6 - 18);
      if (r % 5 == 3 && h < 40) v = 0.0f;
      x[r * hidden + h] = BFloat16::fromFloat(v).toFloat();
    }
  if (rows > 2) {
    x[1 * hidden + 5] = std::numeric_limits<float>::quiet_NaN();
    x[2 * hidden + hidden - 1] = std::numeric_limits<float>::infinity();
  }
  return x;
}

template <class T>
void checkCodec(PayloadCodec codec, size_t hidden) {
  SCOPED_TRACE(::testing::Message() << payloadCodecName(codec) << " hidden " << hidden << " "
                                    << (sizeof(T) == 4 ? "f32" : "bf16"));
  const DataType dt = sizeof(T) == 4 ? DataType::kFloat32 : DataType::kBFloat16;
  const size_t rows = 37;
  std::vector<float> xf = makeRows(rows, hidden, static_cast<uint32_t>(hidden));
  std::vector<T> x(xf.size());
  for (size_t i = 0; i < xf.size(); ++i) x[i] = fromFloat<T>(xf[i]);
  std::vector<int32_t> perm(rows);
  for (size_t i = 0; i < rows; ++i) perm[i] = static_cast<int32_t>((i * 11 + 3) % rows);

  cuda::RowLayout l;
  l.hidden = hidden;
  l.payload_stride = payloadBytes(codec, hidden) + 48;  // strided, as inside a wire record
  l.scale_stride = (scaleBytes(codec, hidden) + 4 + 3) & ~size_t{3};
  // Host reference: row i of the output encodes x[perm[i]] (nvfp4 global scale of x; the
  // poisoned rows make it NaN, so use the finite rows' amax through an explicit value).
  const float g = codec == PayloadCodec::kNvfp4 ? 0.37f : 1.0f;
  std::vector<uint8_t> want_p(rows * l.payload_stride, 0), want_s(rows * l.scale_stride, 0);
  for (size_t i = 0; i < rows; ++i)
    quantizeRow(codec, x.data() + perm[i] * hidden, hidden, want_p.data() + i * l.payload_stride,
                want_s.data() + i * l.scale_stride, g);

  void *dx, *dout;
  uint8_t *dp, *ds;
  int32_t* dperm;
  float* dg;
  CUDA_OK(cudaMalloc(&dx, x.size() * sizeof(T)));
  CUDA_OK(cudaMalloc(&dout, x.size() * sizeof(T)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dp), want_p.size()));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&ds), want_s.size()));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dperm), rows * 4));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dg), rows * 4));
  std::vector<float> gs(rows, g);
  CUDA_OK(cudaMemcpy(dx, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dperm, perm.data(), rows * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dg, gs.data(), rows * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dp, 0, want_p.size()));
  CUDA_OK(cudaMemset(ds, 0, want_s.size()));
  cuda::quantizeRows(codec, dt, dx, dperm, rows, l, dp, ds, g, nullptr);
  std::vector<uint8_t> got_p(want_p.size()), got_s(want_s.size());
  CUDA_OK(cudaMemcpy(got_p.data(), dp, got_p.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(got_s.data(), ds, got_s.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(got_p, want_p);
  EXPECT_EQ(got_s, want_s);

  // Decode on the GPU into the rows' original places (dst_rows = perm): x round-tripped.
  cuda::dequantizeRows(codec, dt, dp, ds, dg, rows, l, dout, dperm, nullptr);
  std::vector<T> got(x.size()), want(x.size());
  CUDA_OK(cudaMemcpy(got.data(), dout, got.size() * sizeof(T), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < rows; ++i)
    dequantizeRow(codec, want_p.data() + i * l.payload_stride, want_s.data() + i * l.scale_stride, hidden,
                  want.data() + perm[i] * hidden, g);
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(T)));

  // Tensor amax (finite values) and the non-finite flag.
  float* damax;
  int* dbad;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&damax), 4));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dbad), 4));
  cuda::tensorAmax(dt, dx, rows, hidden, damax, dbad, nullptr);
  float amax;
  int bad;
  CUDA_OK(cudaMemcpy(&amax, damax, 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(&bad, dbad, 4, cudaMemcpyDeviceToHost));
  BlockAmax ref = blockAmax(x.data(), static_cast<int>(x.size()));
  EXPECT_EQ(amax, ref.amax);
  EXPECT_EQ(bad != 0, ref.nonFinite);
  for (void* p : {dx, dout, static_cast<void*>(dp), static_cast<void*>(ds), static_cast<void*>(dperm),
                  static_cast<void*>(dg), static_cast<void*>(damax), static_cast<void*>(dbad)})
    CUDA_OK(cudaFree(p));
}

TEST(MoeCudaGpu, CodecKernelsMatchHostBytes) {
  if (const std::string& why = gpucheck::gpuUnavailableReason(); !why.empty()) GTEST_SKIP() << why;
  testing::runRanks(1, [](testing::RankEnv&) {
    for (PayloadCodec c : {PayloadCodec::kFp8Block128, PayloadCodec::kMxfp8, PayloadCodec::kNvfp4})
      for (size_t hidden : {size_t{200}, size_t{7168}, size_t{7}}) {
        checkCodec<BFloat16>(c, hidden);
        checkCodec<float>(c, hidden);
      }
    EXPECT_THROW(cuda::quantizeRows(PayloadCodec::kBFloat16, DataType::kBFloat16, nullptr, nullptr, 1,
                                    cuda::RowLayout{8, 16, 0}, nullptr, nullptr, 1.0f, nullptr),
                 InvalidArgument);
  });
}


// ---- CUDA dispatch / combine vs the host executor -------------------------------------------

// Device copy of a host vector (freed with the object).
struct Dev {
  void* p = nullptr;
  Dev() = default;
  Dev(const void* src, size_t bytes) {
    if (bytes == 0) return;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  template <class T>
  explicit Dev(const std::vector<T>& v) : Dev(v.data(), v.size() * sizeof(T)) {}
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() {
    if (p) cudaFree(p);
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <class T>
std::vector<T> down(const void* p, size_t n) {
  std::vector<T> v(n);
  if (n) {
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return v;
}

// Float vectors compared by bits (a NaN equals the same NaN).
template <class T>
void expectSameBytes(const std::vector<T>& host, const std::vector<T>& dev, const char* what) {
  ASSERT_EQ(host.size(), dev.size()) << what;
  EXPECT_TRUE(host.empty() || std::memcmp(host.data(), dev.data(), host.size() * sizeof(T)) == 0)
      << what << " differs from the host path";
}

void checkAgainstHost(Communicator& comm, MoeBuffer& host, CudaMoeBuffer& gpu, testinput::Route route,
                      cudaStream_t s, int salt) {
  const MoeConfig& cfg = host.config();
  const int R = comm.size(), L = comm.localSize(), me = comm.rank();
  const size_t H = cfg.hidden, k = static_cast<size_t>(cfg.topk), es = elementSize(cfg.dtype);
  SCOPED_TRACE(::testing::Message() << payloadFormatName(cfg.format) << (cfg.dtype == DataType::kFloat32 ? " f32" : " bf16")
                                    << " route " << static_cast<int>(route) << " rank " << me << "/" << R
                                    << " capacity " << cfg.expert_capacity);
  testinput::Input in = testinput::makeInput(route, me, R, L, H, cfg.topk, cfg.num_experts / R, salt);
  auto x = testinput::toType(in.xf, cfg.dtype);
  DispatchResult hd = host.dispatch(x.data(), in.tokens, in.idx.data(), in.w.data());
  Dev dx(x), didx(in.idx), dw(in.w);
  const Deadline dl = Deadline::after(Millis(20'000));
  CudaDispatchResult gd = gpu.dispatch(dx.p, in.tokens, didx.as<int64_t>(), dw.as<float>(), s);
  gpu.synchronize(s, dl);
  const size_t n = hd.num_recv;
  ASSERT_EQ(gd.num_recv, n);
  ASSERT_EQ(handleNumRecv(*gd.handle), n);
  expectSameBytes(hd.x, down<uint8_t>(gd.x, n * H * es), "x");
  expectSameBytes(hd.src_rank, down<int32_t>(gd.src_rank, n), "src_rank");
  expectSameBytes(hd.src_token, down<int32_t>(gd.src_token, n), "src_token");
  expectSameBytes(hd.topk_idx, down<int64_t>(gd.topk_idx, n * k), "topk_idx");
  expectSameBytes(hd.topk_weights, down<float>(gd.topk_weights, n * k), "topk_weights");
  EXPECT_EQ(hd.recv_per_rank, gd.recv_per_rank);
  EXPECT_EQ(hd.tokens_per_expert, gd.tokens_per_expert);
  EXPECT_EQ(hd.expert_offsets, gd.expert_offsets);
  expectSameBytes(hd.expert_rows, down<int32_t>(gd.expert_rows, hd.expert_rows.size()), "expert_rows");
  expectSameBytes(hd.expert_weights, down<float>(gd.expert_weights, hd.expert_weights.size()), "expert_weights");
  expectSameBytes(hd.x_expert_major, down<uint8_t>(gd.x_expert_major, hd.x_expert_major.size()), "x_expert_major");
  if (cfg.return_quantized && cfg.format != PayloadFormat::kNative) {
    expectSameBytes(hd.q_payload, down<uint8_t>(gd.q_payload, hd.q_payload.size()), "q_payload");
    expectSameBytes(hd.q_scales, down<uint8_t>(gd.q_scales, hd.q_scales.size()), "q_scales");
    expectSameBytes(hd.q_global_scale, down<float>(gd.q_global_scale, n), "q_global_scale");
  }
  EXPECT_EQ(hd.metrics.inter_node_bytes, gd.metrics.inter_node_bytes);
  EXPECT_EQ(hd.metrics.intra_node_bytes, gd.metrics.intra_node_bytes);
  EXPECT_EQ(hd.metrics.flat_bytes, gd.metrics.flat_bytes);
  EXPECT_EQ(hd.metrics.dropped, gd.metrics.dropped);

  // Cached handle: the same rows again without planning (new x: salt + 1 of the same routing).
  testinput::Input in2 = testinput::makeInput(route, me, R, L, H, cfg.topk, cfg.num_experts / R, salt);
  for (float& v : in2.xf) v = BFloat16::fromFloat(v * -1.5f).toFloat();
  auto x2 = testinput::toType(in2.xf, cfg.dtype);
  DispatchResult hd2 = host.dispatch(x2.data(), in.tokens, in.idx.data(), in.w.data(), hd.handle);
  Dev dx2(x2);
  CudaDispatchResult gd2 = gpu.dispatch(dx2.p, in.tokens, didx.as<int64_t>(), dw.as<float>(), s, gd.handle);
  gpu.synchronize(s, dl);
  expectSameBytes(hd2.x, down<uint8_t>(gd2.x, n * H * es), "x (cached handle)");
  expectSameBytes(hd2.topk_weights, down<float>(gd2.topk_weights, n * k), "topk_weights (cached handle)");

  // Combine y = the received x (in the config dtype), unweighted and weighted per row.
  std::vector<float> rw(n);
  for (size_t i = 0; i < n; ++i) rw[i] = 0.5f + 0.375f * static_cast<float>(i % 5);
  Dev drw(rw);
  CombineResult hc = host.combine(hd.x.data(), cfg.dtype, *hd.handle);
  CombineResult hcw = host.combine(hd.x.data(), cfg.dtype, *hd.handle, rw.data());
  CudaCombineResult gc = gpu.combine(gd.x, cfg.dtype, *gd.handle, s);
  CudaCombineResult gcw = gpu.combine(gd.x, cfg.dtype, *gd.handle, s, drw.as<float>());
  // Expert-major outputs: y = the expert-major copy, weighted by the expert weights.
  CombineResult hem = host.combineExpertMajor(hd.x_expert_major.data(), cfg.dtype, hd, hd.expert_weights.data());
  CudaCombineResult gem = gpu.combineExpertMajor(gd.x_expert_major, cfg.dtype, gd, s, gd.expert_weights);
  gpu.synchronize(s, dl);
  expectSameBytes(hc.out, down<float>(gc.out, in.tokens * H), "combine out");
  expectSameBytes(hem.out, down<float>(gem.out, in.tokens * H), "expert-major combine out");
  expectSameBytes(hcw.out, down<float>(gcw.out, in.tokens * H), "weighted combine out");
  EXPECT_EQ(hc.metrics.inter_node_bytes, gc.metrics.inter_node_bytes);
  EXPECT_EQ(hc.metrics.intra_node_bytes, gc.metrics.intra_node_bytes);

  // DeepEP-style quantized io (session 8): x handed over as codes + scales (quantized here with
  // quant.h's reference codec), the received rows returned only quantized; and pre-quantized
  // in, dequantized out. Bit for bit against the host path's same calls.
  if (cfg.format == PayloadFormat::kNative) return;
  const PayloadCodec c = payloadCodec(cfg.format);
  const size_t pb = payloadBytes(c, H), sb = scaleBytes(c, H);
  std::vector<uint8_t> codes(in.tokens * pb), scales(in.tokens * sb);
  const float g = cfg.format == PayloadFormat::kNvfp4
                      ? nvfp4GlobalScale(blockAmax(in.xf.data(), static_cast<int>(in.xf.size())))
                      : 1.0f;
  std::vector<float> sc(sb / 4 + 1);
  std::vector<BFloat16> rb(H);
  for (size_t tk = 0; tk < in.tokens; ++tk) {
    if (cfg.dtype == DataType::kFloat32) {
      quantizeRow(c, in.xf.data() + tk * H, H, codes.data() + tk * pb, sc.data(), g);
    } else {
      for (size_t h = 0; h < H; ++h) rb[h] = BFloat16::fromFloat(in.xf[tk * H + h]);
      quantizeRow(c, rb.data(), H, codes.data() + tk * pb, sc.data(), g);
    }
    std::memcpy(scales.data() + tk * sb, sc.data(), sb);
  }
  Dev dcodes(codes), dscales(scales);
  QuantizedTokens hq{cfg.format, codes.data(), scales.data(), pb, sb, g};
  QuantizedTokens gq{cfg.format, dcodes.p, dscales.p, pb, sb, g};
  MoeBuffer::DispatchArgs ha;
  ha.tokens = in.tokens;
  ha.x_quantized = &hq;
  ha.topk_idx = in.idx.data();
  ha.topk_weights = in.w.data();
  ha.output = RecvOutput::kQuantized;
  MoeBuffer::DispatchArgs ga = ha;
  ga.x_quantized = &gq;
  ga.topk_idx = didx.as<int64_t>();
  ga.topk_weights = dw.as<float>();
  DispatchResult hq1 = host.dispatch(ha);
  CudaDispatchResult gq1 = gpu.dispatch(ga, s);
  gpu.synchronize(s, dl);
  EXPECT_EQ(gq1.x, nullptr);
  EXPECT_EQ(gq1.x_expert_major, nullptr);
  expectSameBytes(hd.q_payload, down<uint8_t>(gq1.q_payload, n * pb), "q_payload (pre-quantized)");
  expectSameBytes(hd.q_scales, down<uint8_t>(gq1.q_scales, n * sb), "q_scales (pre-quantized)");
  expectSameBytes(hd.q_global_scale, down<float>(gq1.q_global_scale, n), "q_global_scale (pre-quantized)");
  expectSameBytes(hq1.q_payload_expert_major,
                  down<uint8_t>(gq1.q_payload_expert_major, hq1.q_payload_expert_major.size()),
                  "q_payload_expert_major");
  expectSameBytes(hq1.q_scales_expert_major,
                  down<uint8_t>(gq1.q_scales_expert_major, hq1.q_scales_expert_major.size()), "q_scales_expert_major");
  ga.output = RecvOutput::kDequantized;
  CudaDispatchResult gq2 = gpu.dispatch(ga, s, gq1.handle);
  gpu.synchronize(s, dl);
  expectSameBytes(hd.x, down<uint8_t>(gq2.x, n * H * es), "x (pre-quantized, decoded)");
  EXPECT_EQ(gq2.q_payload, nullptr);
  QuantizedTokens wrong = gq;
  wrong.scale_row_bytes = sb + 1;
  ga.x_quantized = &wrong;
  EXPECT_THROW(gpu.dispatch(ga, s), InvalidUsage);
}

void cudaVsHostBody(testing::RankEnv& env) {
  auto comm = env.communicator();
  const int R = comm->size(), L = comm->localSize();
  int ndev = 0;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  // One node: every rank on GPU 0 (the heap maps the processes' memory); several: NCCL, one GPU each.
  const int dev = R / L > 1 ? comm->rank() % ndev : 0;
  CUDA_OK(cudaSetDevice(dev));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct Variant {
    PayloadFormat format;
    DataType dtype;
    size_t hidden;
  };
  const Variant variants[] = {{PayloadFormat::kNative, DataType::kBFloat16, 40},
                              {PayloadFormat::kNative, DataType::kFloat32, 40},
                              {PayloadFormat::kFp8, DataType::kBFloat16, 200},
                              {PayloadFormat::kMxfp8, DataType::kBFloat16, 200},
                              {PayloadFormat::kNvfp4, DataType::kBFloat16, 200},
                              {PayloadFormat::kFp8, DataType::kFloat32, 136},
                              {PayloadFormat::kNvfp4, DataType::kFloat32, 72}};
  int salt = 0;
  for (const Variant& v : variants) {
    MoeConfig cfg;
    cfg.max_tokens = 32;
    cfg.hidden = v.hidden;
    cfg.topk = 4;
    cfg.num_experts = 4 * R;
    cfg.dtype = v.dtype;
    cfg.format = v.format;
    cfg.return_quantized = true;
    // Several nodes: bf16 partial sums on the wire for the bf16 variants.
    if (R / L > 1 && v.dtype == DataType::kBFloat16) cfg.combine_wire = DataType::kBFloat16;
    auto host = MoeBuffer::create(comm, cfg);
    auto gpu = CudaMoeBuffer::create(comm, cfg, CudaMoeBuffer::Options{dev});
    checkAgainstHost(*comm, *host, *gpu, testinput::Route::kRandom, s, salt++);
    checkAgainstHost(*comm, *host, *gpu, testinput::Route::kNodeLimited, s, salt++);
  }
  // Capacity: everything to expert 0, one or two kept.
  MoeConfig capped;
  capped.max_tokens = 32;
  capped.hidden = 40;
  capped.topk = 4;
  capped.num_experts = 4 * R;
  capped.expert_capacity = 2;
  auto host = MoeBuffer::create(comm, capped);
  auto gpu = CudaMoeBuffer::create(comm, capped, CudaMoeBuffer::Options{dev});
  checkAgainstHost(*comm, *host, *gpu, testinput::Route::kOneExpert, s, 0);
  EXPECT_THROW(gpu->dispatch(nullptr, capped.max_tokens + 1, nullptr, nullptr, s), InvalidArgument);
  gpu.reset();
  CUDA_OK(cudaStreamDestroy(s));
}

void runCudaVsHost(int ranks, int per_node) {
  testing::RunOptions o;
  o.timeout = Millis(100'000);
  if (per_node < ranks) o.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(per_node);
  testing::runRanks(ranks, cudaVsHostBody, o);
}

TEST(MoeCudaGpu, DispatchCombineMatchHost1Rank) {
  if (const std::string& why = gpucheck::gpuUnavailableReason(); !why.empty()) GTEST_SKIP() << why;
  runCudaVsHost(1, 1);
}

TEST(MoeCudaGpu, DispatchCombineMatchHost1x2) {
  if (const std::string& why = gpucheck::gpuUnavailableReason(); !why.empty()) GTEST_SKIP() << why;
  runCudaVsHost(2, 2);
}

TEST(MoeCudaGpu, DispatchCombineMatchHost1x4) {
  if (const std::string& why = gpucheck::gpuUnavailableReason(); !why.empty()) GTEST_SKIP() << why;
  runCudaVsHost(4, 4);
}

// Without a device the CUDA buffer refuses to be created (Unsupported, naming the reason);
// a bad config is InvalidArgument first, as on the host path.
TEST(MoeCudaGpu, CreateWithoutDeviceIsUnsupported) {
  if (gpucheck::gpuUnavailableReason().empty()) GTEST_SKIP() << "a GPU is present: the tests above cover creation";
  testing::runRanks(2, [](testing::RankEnv& env) {
    auto comm = env.communicator();
    MoeConfig cfg;
    cfg.max_tokens = 8;
    cfg.hidden = 16;
    cfg.topk = 2;
    cfg.num_experts = 4;
    EXPECT_THROW(CudaMoeBuffer::create(comm, cfg), Unsupported);
    EXPECT_THROW(CudaMoeBuffer::create(comm, cfg, CudaMoeBuffer::Options{0}), Unsupported);
    cfg.num_experts = 3;
    EXPECT_THROW(CudaMoeBuffer::create(comm, cfg), InvalidArgument);
  });
}

// Device count, asked in a forked child (this process never initializes CUDA).
int deviceCountInChild() {
  char path[] = "/tmp/moe_cuda_gpu_count_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return 0;
  close(fd);
  const std::string file = path;
  testing::runRanks(1, [&](testing::RankEnv&) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    std::ofstream(file) << n;
  });
  int n = 0;
  std::ifstream(file) >> n;
  std::remove(path);
  return n;
}

TEST(MoeCudaGpu, DispatchCombineMatchHost2x2) {
  if (const std::string& why = gpucheck::gpuUnavailableReason(); !why.empty()) GTEST_SKIP() << why;
  if (const int n = deviceCountInChild(); n < 4)
    GTEST_SKIP() << "2x2 virtual nodes go through NCCL, which needs one GPU per rank (" << n << " GPUs here)";
  runCudaVsHost(4, 2);
}

}  // namespace
}  // namespace crossbar::moe
