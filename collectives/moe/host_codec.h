// Host encode/decode of quantized MoE payload rows (fp8 block-128, MXFP8, NVFP4): the bytes
// of collectives/quant.h's quantizeRow / dequantizeRow, faster.
//
// Two implementations, picked once per process (hostCodecIsa()):
//   scalar  portable C++ (the fallback, and the reference the SIMD path is tested against):
//           encode rounds with lane-parallel selects the compiler vectorizes; decode reads
//           each element code's value from a table of the shared decoder.
//   avx2    the same results with AVX2 intrinsics (function-level target attribute, chosen at
//           run time with __builtin_cpu_supports), NVFP4 encode included; full fp8 / MXFP8
//           blocks round with one float addition per value and eight blocks' scales are
//           computed together (host_codec.cc says why the bytes are the same).
//   avx512  avx2, with fp8 / MXFP8 decode to bf16 of ordinary blocks (no NaN, scale in
//           [2^-117, 2^8)) on AVX-512 + AVX512_BF16: sixteen values per step and the hardware
//           bf16 rounding, one call per row (fp8 ~1.9x, MXFP8 ~1.8x avx2's speed); other
//           blocks take the avx2 path. (An AVX-512 encode was tried: no faster than avx2 on
//           this Zen 4, which runs 512-bit operations as two 256-bit halves.)
// CROSSBAR_MOE_HOST_CODEC=scalar forces the scalar path, avx2 the AVX2 one (for comparison);
// auto (default) takes the best the CPU has.
//
// Encode output is bit-identical to quantizeRow for every input (NaN, Inf, subnormals,
// saturation, ties); decode is bit-identical to dequantizeRow except which NaN a NaN code
// times a NaN block scale gives (a product's operand order is the compiler's choice; the
// GPU gives its canonical NaN). test_quant_simd and test_moe_host_codec check this.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives/float_types.h"
#include "collectives/quant.h"

namespace crossbar::moe {

enum class HostCodecIsa { kScalar, kAvx2, kAvx512 };

const char* hostCodecIsaName(HostCodecIsa isa);
// Whether this build and CPU can run `isa` (kScalar always).
bool hostCodecIsaSupported(HostCodecIsa isa);
// The implementation the overloads without an isa use: CROSSBAR_MOE_HOST_CODEC, else the
// best supported (read once; InvalidArgument if the variable asks for an unsupported one).
HostCodecIsa hostCodecIsa();

// codec: kFp8Block128, kMxfp8 or kNvfp4 (others: dequantizeRow). T: float or BFloat16.
template <class T>
void decodeRowHost(PayloadCodec codec, const uint8_t* payload, const void* scales, size_t hidden, T* out,
                   float global_scale);

// Host encode of one row, the bytes of quantizeRow (scales: scaleBytes(codec, hidden) bytes,
// 4-byte aligned for kFp8Block128; global_scale: kNvfp4's nvfp4GlobalScale).
template <class T>
void encodeRowHost(PayloadCodec codec, const T* x, size_t hidden, uint8_t* payload, void* scales,
                   float global_scale);

// blockAmax over n values (for nvfp4GlobalScale of a whole tensor), same result.
template <class T>
BlockAmax tensorAmaxHost(const T* x, size_t n);

// Row kernels of MoE combine, same results as the plain loops they replace (each element's
// operations and their order are the loop's; no fused multiply-add):
//   scaleRowHost  out[c] = toFloat(y[c]) * w
//   addRowHost    acc[c] += toFloat(x[c])
//   roundRowHost  out[c] = BFloat16::fromFloat(x[c])
// (moe.cc is built -O2, where GCC 12 leaves those loops scalar.)
template <class T>
void scaleRowHost(float* out, const T* y, float w, size_t n);
template <class T>
void addRowHost(float* acc, const T* x, size_t n);
void roundRowHost(BFloat16* out, const float* x, size_t n);

// The same with an explicit implementation (tests, benchmarks); InvalidArgument if
// !hostCodecIsaSupported(isa).
template <class T>
void decodeRowHost(HostCodecIsa isa, PayloadCodec codec, const uint8_t* payload, const void* scales,
                   size_t hidden, T* out, float global_scale);
template <class T>
void encodeRowHost(HostCodecIsa isa, PayloadCodec codec, const T* x, size_t hidden, uint8_t* payload,
                   void* scales, float global_scale);
template <class T>
BlockAmax tensorAmaxHost(HostCodecIsa isa, const T* x, size_t n);
template <class T>
void scaleRowHost(HostCodecIsa isa, float* out, const T* y, float w, size_t n);
template <class T>
void addRowHost(HostCodecIsa isa, float* acc, const T* x, size_t n);
void roundRowHost(HostCodecIsa isa, BFloat16* out, const float* x, size_t n);

}  // namespace crossbar::moe
