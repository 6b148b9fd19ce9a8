// Compile-only check that every CROSSBAR_HD helper of the collectives math builds as device
// code. Nothing launches these kernels; correctness is tested on the CPU (same source).
#include <cstddef>
#include <cstdint>

#include "collectives/dtype.h"
#include "collectives/float_types.h"
#include "collectives/quant.h"
#include "collectives/reduce.h"

namespace crossbar {
namespace {

__global__ void floatTypesKernel(const float* in, uint32_t* out) {
  float x = in[threadIdx.x];
  out[0] = floatToHalfBits(x) + floatToHalfBits(x, Saturate::kFinite) + floatToBFloat16Bits(x) +
           floatToBFloat16Bits(x, Saturate::kFinite) + floatToE4M3Bits(x) +
           floatToE4M3Bits(x, Saturate::kFinite) + floatToE5M2Bits(x) +
           floatToE5M2Bits(x, Saturate::kFinite) + floatToE2M1Bits(x) + floatToE8M0Bits(x) +
           floatToE8M0Bits(x, ScaleRounding::kUp, Saturate::kFinite);
  float y = halfBitsToFloat(1) + bfloat16BitsToFloat(2) + e4m3BitsToFloat(3) + e5m2BitsToFloat(4) +
            e2m1BitsToFloat(5) + e8m0BitsToFloat(6);
  y += Float16::fromFloat(x).toFloat() + BFloat16::fromFloat(x).toFloat() +
       Float8E4M3::fromFloat(x).toFloat() + Float8E5M2::fromFloat(x).toFloat() +
       toFloat(fromFloat<BFloat16>(x)) + fromFloat<float>(x);
  y += static_cast<float>(elementSize(DataType::kBFloat16) + isFloating(DataType::kInt8) +
                          isSupported(DataType::kInt8, ReduceOp::kPreMulSum) +
                          isSignedInteger(DataType::kInt32));
  out[1] = floatBits(y) + isNanFloat(y) + isFiniteFloat(y) + floatBits(absFloat(y));
}

template <class T, ReduceOp Op>
__global__ void reduceKernel(T* dst, const T* const* srcs, int nsrc, size_t n, AccumT<T> scalar) {
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] = Reducer<T, Op>::reduceElement(srcs, nsrc, i, scalar, static_cast<uint64_t>(nsrc));
  if (i == 0)
    dst[0] = storeAcc<T>(Reducer<T, Op>::post(
        Reducer<T, Op>::combine(loadAcc(dst[0]), Reducer<T, Op>::pre(loadAcc(dst[1]), scalar)), 2));
}

template <class T>
void instantiateOps() {
  reduceKernel<T, ReduceOp::kSum><<<1, 1>>>(nullptr, nullptr, 0, 0, AccumT<T>(1));
  reduceKernel<T, ReduceOp::kProd><<<1, 1>>>(nullptr, nullptr, 0, 0, AccumT<T>(1));
  reduceKernel<T, ReduceOp::kMin><<<1, 1>>>(nullptr, nullptr, 0, 0, AccumT<T>(1));
  reduceKernel<T, ReduceOp::kMax><<<1, 1>>>(nullptr, nullptr, 0, 0, AccumT<T>(1));
  reduceKernel<T, ReduceOp::kAvg><<<1, 1>>>(nullptr, nullptr, 0, 0, AccumT<T>(1));
  if constexpr (!std::is_integral_v<T>) {
    reduceKernel<T, ReduceOp::kPreMulSum><<<1, 1>>>(nullptr, nullptr, 0, 0, AccumT<T>(1));
  }
}

template <class In, class Out>
__global__ void quantKernel(const In* x, size_t hidden, uint8_t* payload, uint8_t* scales8, float* scales32,
                            Out* out, float g) {
  BlockAmax a = mergeAmax(blockAmax(x, 16), BlockAmax{});
  scales32[0] = fp8BlockQuantize(x, 128, payload);
  fp8BlockDequantize(payload, 128, scales32[0], out);
  scales8[0] = mxfp8Quantize(x, 32, payload);
  mxfp8Dequantize(payload, 32, scales8[0], out);
  scales8[1] = nvfp4Quantize(x, 16, nvfp4GlobalScale(a), payload);
  nvfp4Dequantize(payload, 16, scales8[1], g, out);
  payload[0] = fp8BlockEncode(1.0f, fp8BlockFactor(a)) + static_cast<uint8_t>(fp8BlockScale(a)) +
               mxfp8Encode(1.0f, mxfp8Scale(a)) + nvfp4Encode(1.0f, nvfp4Divisor(nvfp4BlockScale(a, g), g));
  out[0] = fromFloat<Out>(fp8BlockDecode(1, 1.0f) + mxfp8Decode(1, 127) + nvfp4Decode(1, 1.0f) +
                          static_cast<float>(floorLog2(3.0f) + blockCount(hidden, 0, 16) +
                                             numBlocks(PayloadCodec::kNvfp4, hidden) +
                                             payloadBytes(PayloadCodec::kMxfp8, hidden) +
                                             scaleBytes(PayloadCodec::kFp8Block128, hidden)));
  quantizeRowFp8Block(x, hidden, payload, scales32);
  dequantizeRowFp8Block(payload, scales32, hidden, out);
  quantizeRowMxfp8(x, hidden, payload, scales8);
  dequantizeRowMxfp8(payload, scales8, hidden, out);
  quantizeRowNvfp4(x, hidden, g, payload, scales8);
  dequantizeRowNvfp4(payload, scales8, g, hidden, out);
  for (PayloadCodec c :
       {PayloadCodec::kBFloat16, PayloadCodec::kFp8Block128, PayloadCodec::kMxfp8, PayloadCodec::kNvfp4}) {
    quantizeRow(c, x, hidden, payload, scales32, g);
    dequantizeRow(c, payload, scales32, hidden, out, g);
  }
}

}  // namespace

// Host-visible entry so the kernels are odr-used and really compiled.
void crossbarCollectivesCudaCompileCheck() {
  floatTypesKernel<<<1, 1>>>(nullptr, nullptr);
  instantiateOps<double>();
  instantiateOps<float>();
  instantiateOps<Float16>();
  instantiateOps<BFloat16>();
  instantiateOps<Float8E4M3>();
  instantiateOps<Float8E5M2>();
  instantiateOps<int8_t>();
  instantiateOps<uint8_t>();
  instantiateOps<int32_t>();
  instantiateOps<uint32_t>();
  instantiateOps<int64_t>();
  instantiateOps<uint64_t>();
  quantKernel<float, float><<<1, 1>>>(nullptr, 0, nullptr, nullptr, nullptr, nullptr, 1.0f);
  quantKernel<BFloat16, BFloat16><<<1, 1>>>(nullptr, 0, nullptr, nullptr, nullptr, nullptr, 1.0f);
  quantKernel<float, BFloat16><<<1, 1>>>(nullptr, 0, nullptr, nullptr, nullptr, nullptr, 1.0f);
}

}  // namespace crossbar
