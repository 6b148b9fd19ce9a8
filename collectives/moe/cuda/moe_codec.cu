// Kernels of moe_codec.h: one thread per scale block of one row (the block functions of
// collectives/quant.h, which the host runs too), rows spread over the grid's y dimension.
#include <algorithm>
#include <string>

#include "collectives/moe/cuda/moe_codec.h"
#include "comm/errors.h"

namespace crossbar::moe::cuda {
namespace {

constexpr int kThreads = 128;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw CudaError(std::string("moe codec: ") + what + " failed: " + cudaGetErrorName(e) + " (" +
                    cudaGetErrorString(e) + ")");
}

template <class T>
__global__ void quantizeKernel(PayloadCodec codec, const T* x, const int32_t* src_rows, size_t rows,
                               RowLayout l, uint8_t* payload, uint8_t* scales, float global_scale_value,
                               const float* global_scale_ptr) {
  const float global_scale = global_scale_ptr ? *global_scale_ptr : global_scale_value;
  const size_t row = blockIdx.y;
  const size_t b = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows || b >= numBlocks(codec, l.hidden)) return;
  const int bs = blockSize(codec);
  const size_t i = b * bs;
  const int count = blockCount(l.hidden, i, bs);
  const T* src = x + static_cast<size_t>(src_rows ? src_rows[row] : row) * l.hidden + i;
  uint8_t* p = payload + row * l.payload_stride;
  uint8_t* s = scales + row * l.scale_stride;
  switch (codec) {
    case PayloadCodec::kFp8Block128:
      reinterpret_cast<float*>(s)[b] = fp8BlockQuantize(src, count, p + i);
      break;
    case PayloadCodec::kMxfp8:
      s[b] = mxfp8Quantize(src, count, p + i);
      break;
    case PayloadCodec::kNvfp4:
      s[b] = nvfp4Quantize(src, count, global_scale, p + i / 2);
      break;
    default:
      break;
  }
}

template <class T>
__global__ void dequantizeKernel(PayloadCodec codec, const uint8_t* payload, const uint8_t* scales,
                                 const float* global_scales, size_t rows, RowLayout l, T* out,
                                 const int32_t* dst_rows) {
  const size_t row = blockIdx.y;
  const size_t b = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows || b >= numBlocks(codec, l.hidden)) return;
  const int bs = blockSize(codec);
  const size_t i = b * bs;
  const int count = blockCount(l.hidden, i, bs);
  const uint8_t* p = payload + row * l.payload_stride;
  const uint8_t* s = scales + row * l.scale_stride;
  T* dst = out + static_cast<size_t>(dst_rows ? dst_rows[row] : row) * l.hidden + i;
  switch (codec) {
    case PayloadCodec::kFp8Block128:
      fp8BlockDequantize(p + i, count, reinterpret_cast<const float*>(s)[b], dst);
      break;
    case PayloadCodec::kMxfp8:
      mxfp8Dequantize(p + i, count, s[b], dst);
      break;
    case PayloadCodec::kNvfp4:
      nvfp4Dequantize(p + i / 2, count, s[b],
                      global_scales ? *reinterpret_cast<const float*>(reinterpret_cast<const char*>(global_scales) +
                                                                      row * l.global_scale_stride)
                                    : 1.0f,
                      dst);
      break;
    default:
      break;
  }
}

// amax over finite values as the float's bit pattern (non-negative floats order like
// their bits, so an integer atomicMax works).
template <class T>
__global__ void amaxKernel(const T* x, size_t n, unsigned int* amax_bits, int* non_finite) {
  float a = 0.0f;
  int bad = 0;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v = toFloat(x[i]);
    if (!isFiniteFloat(v))
      bad = 1;
    else
      a = fmaxf(a, fabsf(v));
  }
  if (a > 0.0f) atomicMax(amax_bits, __float_as_uint(a));
  if (bad) atomicExch(non_finite, 1);
}

void validate(PayloadCodec codec, DataType dtype, const RowLayout& l, const char* op) {
  if (codec != PayloadCodec::kFp8Block128 && codec != PayloadCodec::kMxfp8 && codec != PayloadCodec::kNvfp4)
    throw InvalidArgument(std::string("moe codec ") + op + ": codec " + payloadCodecName(codec) +
                          " has no kernel (copy bf16 rows as is)");
  if (dtype != DataType::kBFloat16 && dtype != DataType::kFloat32)
    throw InvalidArgument(std::string("moe codec ") + op + ": rows must be bfloat16 or float32");
  if (l.payload_stride < payloadBytes(codec, l.hidden) || l.scale_stride < scaleBytes(codec, l.hidden))
    throw InvalidArgument(std::string("moe codec ") + op + ": strides (" + std::to_string(l.payload_stride) +
                          ", " + std::to_string(l.scale_stride) +
                          ") are smaller than a row's payload and scales (" +
                          std::to_string(payloadBytes(codec, l.hidden)) + ", " +
                          std::to_string(scaleBytes(codec, l.hidden)) + ")");
}

dim3 gridFor(PayloadCodec codec, const RowLayout& l, size_t rows) {
  if (rows > 65535) throw InvalidArgument("moe codec: at most 65535 rows per launch");
  const size_t blocks = numBlocks(codec, l.hidden);
  return dim3(static_cast<unsigned>((blocks + kThreads - 1) / kThreads), static_cast<unsigned>(rows));
}

}  // namespace

namespace {
void quantizeLaunch(PayloadCodec codec, DataType dtype, const void* x, const int32_t* src_rows, size_t rows,
                    const RowLayout& l, uint8_t* payload, uint8_t* scales, float global_scale,
                    const float* global_scale_ptr, cudaStream_t stream) {
  validate(codec, dtype, l, "quantize");
  if (rows == 0 || l.hidden == 0) return;
  const dim3 grid = gridFor(codec, l, rows);
  if (dtype == DataType::kFloat32)
    quantizeKernel<<<grid, kThreads, 0, stream>>>(codec, static_cast<const float*>(x), src_rows, rows, l,
                                                  payload, scales, global_scale, global_scale_ptr);
  else
    quantizeKernel<<<grid, kThreads, 0, stream>>>(codec, static_cast<const BFloat16*>(x), src_rows, rows, l,
                                                  payload, scales, global_scale, global_scale_ptr);
  check(cudaGetLastError(), "quantize launch");
}
}  // namespace

void quantizeRows(PayloadCodec codec, DataType dtype, const void* x, const int32_t* src_rows, size_t rows,
                  const RowLayout& l, uint8_t* payload, uint8_t* scales, float global_scale,
                  cudaStream_t stream) {
  quantizeLaunch(codec, dtype, x, src_rows, rows, l, payload, scales, global_scale, nullptr, stream);
}

void quantizeRows(PayloadCodec codec, DataType dtype, const void* x, const int32_t* src_rows, size_t rows,
                  const RowLayout& l, uint8_t* payload, uint8_t* scales, const float* global_scale,
                  cudaStream_t stream) {
  quantizeLaunch(codec, dtype, x, src_rows, rows, l, payload, scales, 1.0f, global_scale, stream);
}

void dequantizeRows(PayloadCodec codec, DataType dtype, const uint8_t* payload, const uint8_t* scales,
                    const float* global_scales, size_t rows, const RowLayout& l, void* out,
                    const int32_t* dst_rows, cudaStream_t stream) {
  validate(codec, dtype, l, "dequantize");
  if (rows == 0 || l.hidden == 0) return;
  const dim3 grid = gridFor(codec, l, rows);
  if (dtype == DataType::kFloat32)
    dequantizeKernel<<<grid, kThreads, 0, stream>>>(codec, payload, scales, global_scales, rows, l,
                                                    static_cast<float*>(out), dst_rows);
  else
    dequantizeKernel<<<grid, kThreads, 0, stream>>>(codec, payload, scales, global_scales, rows, l,
                                                    static_cast<BFloat16*>(out), dst_rows);
  check(cudaGetLastError(), "dequantize launch");
}

void tensorAmax(DataType dtype, const void* x, size_t rows, size_t hidden, float* amax, int* non_finite,
                cudaStream_t stream) {
  if (dtype != DataType::kBFloat16 && dtype != DataType::kFloat32)
    throw InvalidArgument("moe codec amax: rows must be bfloat16 or float32");
  check(cudaMemsetAsync(amax, 0, sizeof(float), stream), "amax reset");
  check(cudaMemsetAsync(non_finite, 0, sizeof(int), stream), "amax reset");
  const size_t n = rows * hidden;
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 1024));
  auto* bits = reinterpret_cast<unsigned int*>(amax);
  if (dtype == DataType::kFloat32)
    amaxKernel<<<blocks, 256, 0, stream>>>(static_cast<const float*>(x), n, bits, non_finite);
  else
    amaxKernel<<<blocks, 256, 0, stream>>>(static_cast<const BFloat16*>(x), n, bits, non_finite);
  check(cudaGetLastError(), "amax launch");
}

}  // namespace crossbar::moe::cuda
