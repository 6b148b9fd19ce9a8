// Kernels of moe_kernels.h. The sums add in the order the host executor does (moe.cc), from
// 0.0f, one rounding per addition, so the results are bit-identical to the host path.
#include <algorithm>
#include <string>

#include "collectives/float_types.h"
#include "collectives/moe/cuda/moe_kernels.h"
#include "collectives/moe/moe_plan.h"
#include "collectives/quant.h"
#include "comm/errors.h"

namespace crossbar::moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxGridY = 65535;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw CudaError(std::string("moe kernels: ") + what + " failed: " + cudaGetErrorName(e) + " (" +
                    cudaGetErrorString(e) + ")");
}

// Rows on grid y (strided past 65535), elements on x.
dim3 rowGrid(size_t rows, size_t per_row, int threads) {
  const size_t x = std::max<size_t>(1, std::min<size_t>((per_row + threads - 1) / threads, 1024));
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(std::min<size_t>(rows, kMaxGridY)));
}

template <class V>
__global__ void copyRowsKernel(const char* src, size_t src_stride, const int32_t* src_idx, char* dst,
                               size_t dst_stride, const int32_t* dst_idx, size_t words, size_t rows) {
  for (size_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const V* s = reinterpret_cast<const V*>(src + static_cast<size_t>(src_idx ? src_idx[r] : r) * src_stride);
    V* d = reinterpret_cast<V*>(dst + static_cast<size_t>(dst_idx ? dst_idx[r] : r) * dst_stride);
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
      d[i] = s[i];
  }
}

__global__ void setGlobalScaleKernel(const float* amax, const int* non_finite, bool nvfp4, float* out) {
  *out = nvfp4 ? nvfp4GlobalScale(BlockAmax{*amax, *non_finite != 0}) : 1.0f;
}

__global__ void packHeadersKernel(uint8_t* records, size_t row, size_t off_topk, size_t off_w, int rank,
                                  const float* gscale, const int64_t* topk_idx, const float* weights, int k,
                                  size_t tokens) {
  const size_t t = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  uint8_t* rec = records + t * row;
  RowHeader h{rank, static_cast<int32_t>(t), *gscale, 0};
  *reinterpret_cast<RowHeader*>(rec) = h;
  // The ids sit at offset 16 (8-aligned); the weights are 4-aligned.
  auto* idx = reinterpret_cast<int64_t*>(rec + off_topk);
  auto* w = reinterpret_cast<float*>(rec + off_w);
  for (int j = 0; j < k; ++j) {
    idx[j] = topk_idx[t * k + j];
    w[j] = weights ? weights[t * k + j] : 1.0f;
  }
}

__global__ void receiveWeightsKernel(const uint8_t* records, size_t row, size_t off_w, const int32_t* out_rows,
                                     size_t rows, int k, const int64_t* out_idx, float* out_w, float* qg) {
  const size_t p = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= rows) return;
  const uint8_t* rec = records + p * row;
  const size_t o = static_cast<size_t>(out_rows[p]);
  const auto* w = reinterpret_cast<const float*>(rec + off_w);
  for (int j = 0; j < k; ++j) out_w[o * k + j] = out_idx[o * k + j] >= 0 ? w[j] : 0.0f;
  if (qg) qg[o] = reinterpret_cast<const RowHeader*>(rec)->global_scale;
}

__global__ void gatherFloatsKernel(const float* in, const int32_t* idx, float* out, size_t n) {
  const size_t p = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p < n) out[p] = in[idx[p]];
}

template <class T>
__global__ void scaleRowsKernel(const T* y, const float* w, const int32_t* rows, size_t n, size_t hidden,
                                float* dst) {
  for (size_t p = blockIdx.y; p < n; p += gridDim.y) {
    const size_t r = static_cast<size_t>(rows[p]);
    const float s = w ? w[r] : 1.0f;
    for (size_t c = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < hidden;
         c += static_cast<size_t>(gridDim.x) * blockDim.x)
      dst[p * hidden + c] = __fmul_rn(toFloat(y[r * hidden + c]), s);
  }
}

template <class T>
__global__ void sumScaledRowsKernel(const T* y, const float* w, const int32_t* first, const int32_t* idx, size_t n,
                                    size_t hidden, float* out) {
  for (size_t i = blockIdx.y; i < n; i += gridDim.y)
    for (size_t c = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < hidden;
         c += static_cast<size_t>(gridDim.x) * blockDim.x) {
      float a = 0.0f;
      for (int32_t q = first[i]; q < first[i + 1]; ++q) {
        const size_t r = static_cast<size_t>(idx[q]);
        a = __fadd_rn(a, __fmul_rn(toFloat(y[r * hidden + c]), w ? w[r] : 1.0f));
      }
      out[i * hidden + c] = a;
    }
}

__global__ void sumRowsKernel(const float* base, const int64_t* offs, const int32_t* first, size_t n,
                              size_t hidden, float* acc, uint16_t* acc16, size_t bf16_from) {
  for (size_t i = blockIdx.y; i < n; i += gridDim.y)
    for (size_t c = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < hidden;
         c += static_cast<size_t>(gridDim.x) * blockDim.x) {
      float a = 0.0f;
      for (int32_t q = first[i]; q < first[i + 1]; ++q) a = __fadd_rn(a, base[offs[q] + static_cast<int64_t>(c)]);
      acc[i * hidden + c] = a;
      if (acc16 && i >= bf16_from) acc16[i * hidden + c] = BFloat16::fromFloat(a).bits;
    }
}

__global__ void sumPartialsKernel(const int64_t* src, const int32_t* first, size_t tokens, size_t hidden,
                                  int own_node, const float* own_acc, size_t own_start, const void* back,
                                  bool back_bf16, size_t back_rows, float* out) {
  for (size_t t = blockIdx.y; t < tokens; t += gridDim.y)
    for (size_t c = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < hidden;
         c += static_cast<size_t>(gridDim.x) * blockDim.x) {
      float a = 0.0f;
      for (int32_t q = first[t]; q < first[t + 1]; ++q) {
        const int node = static_cast<int>(src[q] >> 32);
        const size_t i = static_cast<size_t>(src[q] & 0xFFFFFFFF);
        float v;
        if (node == own_node)
          v = own_acc[(own_start + i) * hidden + c];
        else if (back_bf16)
          v = BFloat16::fromBits(static_cast<const uint16_t*>(back)[(node * back_rows + i) * hidden + c]).toFloat();
        else
          v = static_cast<const float*>(back)[(node * back_rows + i) * hidden + c];
        a = __fadd_rn(a, v);
      }
      out[t * hidden + c] = a;
    }
}

unsigned blocks1d(size_t n) {
  return static_cast<unsigned>(std::max<size_t>(1, (n + kThreads - 1) / kThreads));
}

}  // namespace

void copyRows(const void* src, size_t src_stride, const int32_t* src_idx, void* dst, size_t dst_stride,
              const int32_t* dst_idx, size_t width, size_t rows, cudaStream_t stream) {
  if (rows == 0 || width == 0) return;
  const auto aligned = [&](size_t a) {
    return reinterpret_cast<uintptr_t>(src) % a == 0 && reinterpret_cast<uintptr_t>(dst) % a == 0 &&
           src_stride % a == 0 && dst_stride % a == 0 && width % a == 0;
  };
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  if (aligned(16))
    copyRowsKernel<uint4><<<rowGrid(rows, width / 16, kThreads), kThreads, 0, stream>>>(
        s, src_stride, src_idx, d, dst_stride, dst_idx, width / 16, rows);
  else if (aligned(4))
    copyRowsKernel<uint32_t><<<rowGrid(rows, width / 4, kThreads), kThreads, 0, stream>>>(
        s, src_stride, src_idx, d, dst_stride, dst_idx, width / 4, rows);
  else
    copyRowsKernel<uint8_t><<<rowGrid(rows, width, kThreads), kThreads, 0, stream>>>(s, src_stride, src_idx, d,
                                                                                     dst_stride, dst_idx, width, rows);
  check(cudaGetLastError(), "copyRows launch");
}

void setGlobalScale(const float* amax, const int* non_finite, bool nvfp4, float* global_scale,
                    cudaStream_t stream) {
  setGlobalScaleKernel<<<1, 1, 0, stream>>>(amax, non_finite, nvfp4, global_scale);
  check(cudaGetLastError(), "setGlobalScale launch");
}

void packHeaders(uint8_t* records, size_t row, size_t off_topk, size_t off_w, int rank, const float* global_scale,
                 const int64_t* topk_idx, const float* weights, int topk, size_t tokens, cudaStream_t stream) {
  if (tokens == 0) return;
  packHeadersKernel<<<blocks1d(tokens), kThreads, 0, stream>>>(records, row, off_topk, off_w, rank, global_scale,
                                                               topk_idx, weights, topk, tokens);
  check(cudaGetLastError(), "packHeaders launch");
}

void receiveWeights(const uint8_t* records, size_t row, size_t off_w, const int32_t* out_rows, size_t rows,
                    int topk, const int64_t* out_idx, float* out_w, float* q_global_scale, cudaStream_t stream) {
  if (rows == 0) return;
  receiveWeightsKernel<<<blocks1d(rows), kThreads, 0, stream>>>(records, row, off_w, out_rows, rows, topk, out_idx,
                                                                out_w, q_global_scale);
  check(cudaGetLastError(), "receiveWeights launch");
}

void gatherFloats(const float* in, const int32_t* idx, float* out, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  gatherFloatsKernel<<<blocks1d(n), kThreads, 0, stream>>>(in, idx, out, n);
  check(cudaGetLastError(), "gatherFloats launch");
}

void scaleRowsToF32(const void* y, DataType y_type, const float* w, const int32_t* rows, size_t n, size_t hidden,
                    float* dst, cudaStream_t stream) {
  if (n == 0 || hidden == 0) return;
  const dim3 g = rowGrid(n, hidden, kThreads);
  if (y_type == DataType::kFloat32)
    scaleRowsKernel<<<g, kThreads, 0, stream>>>(static_cast<const float*>(y), w, rows, n, hidden, dst);
  else
    scaleRowsKernel<<<g, kThreads, 0, stream>>>(static_cast<const BFloat16*>(y), w, rows, n, hidden, dst);
  check(cudaGetLastError(), "scaleRowsToF32 launch");
}

void sumScaledRows(const void* y, DataType y_type, const float* w, const int32_t* first, const int32_t* idx,
                   size_t n, size_t hidden, float* out, cudaStream_t stream) {
  if (n == 0 || hidden == 0) return;
  const dim3 g = rowGrid(n, hidden, kThreads);
  if (y_type == DataType::kFloat32)
    sumScaledRowsKernel<<<g, kThreads, 0, stream>>>(static_cast<const float*>(y), w, first, idx, n, hidden, out);
  else
    sumScaledRowsKernel<<<g, kThreads, 0, stream>>>(static_cast<const BFloat16*>(y), w, first, idx, n, hidden, out);
  check(cudaGetLastError(), "sumScaledRows launch");
}

void sumRows(const float* base, const int64_t* offs, const int32_t* first, size_t n, size_t hidden, float* acc,
             uint16_t* acc16, size_t bf16_from, cudaStream_t stream) {
  if (n == 0 || hidden == 0) return;
  sumRowsKernel<<<rowGrid(n, hidden, kThreads), kThreads, 0, stream>>>(base, offs, first, n, hidden, acc, acc16,
                                                                       bf16_from);
  check(cudaGetLastError(), "sumRows launch");
}

void sumPartials(const int64_t* src, const int32_t* first, size_t tokens, size_t hidden, int own_node,
                 const float* own_acc, size_t own_start, const void* back, bool back_bf16, size_t back_rows,
                 float* out, cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return;
  sumPartialsKernel<<<rowGrid(tokens, hidden, kThreads), kThreads, 0, stream>>>(
      src, first, tokens, hidden, own_node, own_acc, own_start, back, back_bf16, back_rows, out);
  check(cudaGetLastError(), "sumPartials launch");
}

}  // namespace crossbar::moe::cuda
