// GPU checks of the MoE CUDA building blocks (skip without a device): the payload codec
// kernels produce the same bytes as the host codecs (collectives/quant.h) for fp8 / mxfp8 /
// nvfp4, bf16 and f32 rows, partial blocks, NaN / Inf / zero blocks, strided rows and row
// permutations; decoding on the GPU equals decoding on the host; the tensor amax equals the
// host's. The work runs in a forked child (the gtest process never initializes CUDA).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "collectives/float_types.h"
#include "collectives/moe/cuda/moe_codec.h"
#include "collectives/quant.h"
#include "comm/errors.h"
#include "gpu_checks.h"
#include "harness/multiprocess.h"

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

}  // namespace
}  // namespace crossbar::moe
