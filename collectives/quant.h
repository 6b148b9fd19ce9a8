// Low-precision payload codecs for the MoE all-to-all (dispatch sends activations in
// fp8/fp4 plus scales; the receiver dequantizes). Each codec is a set of host/device
// functions over ONE block, so a CUDA kernel (a warp per block) and the CPU loops below
// run the same math and produce identical bytes.
//
// Codecs (a row of `hidden` values; the last block may be partial):
//   kFp8Block128  DeepSeek-V3 recipe: per 128 values one f32 scale = amax / 448 and
//                 q = e4m3_sat(x * (448 / amax)) (DeepGEMM's per_token_cast_to_fp8 and
//                 DeepEP: one multiply per element by a per-block factor, not a
//                 division by the scale); dequant q * scale. An all-zero block uses
//                 scale 1 (factor 1); scales never go below FLT_MIN so neither side ever
//                 handles a subnormal scale (a clamped block's factor is 1 / FLT_MIN).
//   kMxfp8        OCP MX v1.0 MXFP8 (E4M3): per 32 values one E8M0 scale
//                 X = 2^(floor(log2(amax)) - 8), 8 being E4M3's largest exponent, and
//                 q = e4m3_sat(x / X); values past 448 * X saturate as the spec says.
//                 An all-zero block gets the smallest scale (2^-127).
//   kNvfp4        NVFP4: per 16 values one E4M3 scale, plus one f32 per-tensor scale
//                 g = amax_tensor / (448 * 6); block scale s = e4m3(amax_block / (6 g));
//                 q = e2m1_sat(x / (s g)) (nearest-even); dequant q * (s g). Packed two
//                 values per byte, LOW NIBBLE FIRST: byte j holds element 2j in bits 0-3
//                 and element 2j+1 in bits 4-7 (torch float4_e2m1fn_x2 order).
//                 The global scale travels once per tensor, not in the row.
//
// Non-finite inputs: a NaN or +-Inf anywhere in a block poisons that block: its scale is
// written as NaN (f32 NaN, E8M0 0xFF, E4M3 0x7F) and its elements as E4M3 NaN (fp4:
// zero), so the whole block dequantizes to NaN. (E4M3 and E2M1 cannot hold Inf, and
// saturating an Inf would silently turn it into a plausible finite value.) This is the
// OCP MX rule "scale NaN => every element NaN", applied to all three codecs.
//
// Identical CPU/GPU bytes need IEEE division on the device (nvcc's default; not
// --use_fast_math / -prec-div=false).
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives/float_types.h"
#include "collectives/hd.h"

namespace crossbar {

enum class PayloadCodec { kBFloat16, kFp8Block128, kMxfp8, kNvfp4 };

inline constexpr int kFp8BlockSize = 128;
inline constexpr int kMxBlockSize = 32;
inline constexpr int kNvfp4BlockSize = 16;
inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE2M1Max = 6.0f;
inline constexpr int kE4M3MaxExponent = 8;  // emax_elem of OCP MX for E4M3 (448 = 1.75 * 2^8)
inline constexpr float kFloatMinNormal = 1.17549435e-38f;

CROSSBAR_HDI constexpr int blockSize(PayloadCodec c) {
  switch (c) {
    case PayloadCodec::kFp8Block128:
      return kFp8BlockSize;
    case PayloadCodec::kMxfp8:
      return kMxBlockSize;
    case PayloadCodec::kNvfp4:
      return kNvfp4BlockSize;
    default:
      return 1;
  }
}

CROSSBAR_HDI constexpr size_t numBlocks(PayloadCodec c, size_t hidden) {
  return c == PayloadCodec::kBFloat16 ? 0 : (hidden + blockSize(c) - 1) / blockSize(c);
}

// Bytes of quantized values for a row of `hidden` values.
CROSSBAR_HDI constexpr size_t payloadBytes(PayloadCodec c, size_t hidden) {
  switch (c) {
    case PayloadCodec::kBFloat16:
      return hidden * 2;
    case PayloadCodec::kNvfp4:
      return (hidden + 1) / 2;
    default:
      return hidden;
  }
}

// Bytes of per-block scales for a row (f32 for kFp8Block128, one byte otherwise).
CROSSBAR_HDI constexpr size_t scaleBytes(PayloadCodec c, size_t hidden) {
  return numBlocks(c, hidden) * (c == PayloadCodec::kFp8Block128 ? 4 : 1);
}

constexpr const char* payloadCodecName(PayloadCodec c) {
  switch (c) {
    case PayloadCodec::kBFloat16:
      return "bf16";
    case PayloadCodec::kFp8Block128:
      return "fp8_block128";
    case PayloadCodec::kMxfp8:
      return "mxfp8";
    case PayloadCodec::kNvfp4:
      return "nvfp4";
  }
  return "unknown";
}

// ---- block statistics ----------------------------------------------------------------
struct BlockAmax {
  float amax = 0.0f;       // max |x| over the finite values
  bool nonFinite = false;  // a NaN or Inf was seen
};

template <class T>
CROSSBAR_HDI BlockAmax blockAmax(const T* x, int count) {
  BlockAmax r;
  for (int i = 0; i < count; ++i) {
    float v = toFloat(x[i]);
    if (!isFiniteFloat(v)) {
      r.nonFinite = true;
    } else {
      float a = absFloat(v);
      r.amax = a > r.amax ? a : r.amax;
    }
  }
  return r;
}

// Combines partial statistics (a kernel's per-lane amax, reduced across the warp).
CROSSBAR_HDI BlockAmax mergeAmax(BlockAmax a, BlockAmax b) {
  return BlockAmax{a.amax > b.amax ? a.amax : b.amax, a.nonFinite || b.nonFinite};
}

// A NaN's sign and payload after arithmetic differ between the CPU (x86 keeps the NaN
// operand's bits) and the GPU (always 0x7FFFFFFF): decoders return this one quiet NaN, so
// both sides give the same bytes.
CROSSBAR_HDI float canonicalNan(float v) { return isNanFloat(v) ? bitsFloat(0x7FC00000u) : v; }

// ---- fp8 e4m3, f32 scale per 128 ---------------------------------------------------------
CROSSBAR_HDI float fp8BlockScale(BlockAmax s) {
  if (s.nonFinite) return bitsFloat(0x7FC00000u);
  if (s.amax == 0.0f) return 1.0f;
  float scale = s.amax / kE4M3Max;
  return scale < kFloatMinNormal ? kFloatMinNormal : scale;
}

// What a block's elements are multiplied by before rounding: 448 / amax (both roundings,
// this division and the product, are IEEE round-to-nearest on both sides). |x| <= amax
// keeps |x * factor| <= 448 (1 + 2^-23), which rounds to 448: nothing in a finite block
// saturates. A clamped scale (amax / 448 < FLT_MIN) gives 2^126 = 1 / FLT_MIN exactly, so
// such a block's codes are x / FLT_MIN, as they were when the encoder divided.
CROSSBAR_HDI float fp8BlockFactor(BlockAmax s) {
  if (s.nonFinite) return bitsFloat(0x7FC00000u);
  if (s.amax == 0.0f) return 1.0f;
  if (s.amax / kE4M3Max < kFloatMinNormal) return 0x1p126f;
  return kE4M3Max / s.amax;
}

// `factor` is fp8BlockFactor's. A poisoned block's (NaN) factor gives 0x7F for every
// element, whatever x's sign or NaN payload: x * NaN's NaN depends on the operand order on
// x86 and is canonical on the GPU, so the product's bits are not used.
CROSSBAR_HDI uint8_t fp8BlockEncode(float x, float factor) {
  if (isNanFloat(factor)) return 0x7Fu;
  return floatToE4M3Bits(x * factor, Saturate::kFinite);
}

CROSSBAR_HDI float fp8BlockDecode(uint8_t q, float scale) {
  return canonicalNan(e4m3BitsToFloat(q) * scale);
}

// Quantizes one block of count (<= 128) values; returns its scale.
template <class T>
CROSSBAR_HDI float fp8BlockQuantize(const T* x, int count, uint8_t* q) {
  const BlockAmax a = blockAmax(x, count);
  const float factor = fp8BlockFactor(a);
  for (int i = 0; i < count; ++i) q[i] = fp8BlockEncode(toFloat(x[i]), factor);
  return fp8BlockScale(a);
}

template <class T>
CROSSBAR_HDI void fp8BlockDequantize(const uint8_t* q, int count, float scale, T* out) {
  for (int i = 0; i < count; ++i) out[i] = fromFloat<T>(fp8BlockDecode(q[i], scale));
}

// ---- MXFP8: e4m3 elements, E8M0 scale per 32 -----------------------------------------
// floor(log2(a)) for finite a > 0, from the bits (exact, subnormals included).
CROSSBAR_HDI int floorLog2(float a) {
  uint32_t b = floatBits(a) & 0x7FFFFFFFu;
  int e = static_cast<int>(b >> 23);
  if (e != 0) return e - 127;
  int msb = 22;
  while (msb > 0 && !(b & (1u << msb))) --msb;
  return msb - 149;  // subnormal: b * 2^-149
}

CROSSBAR_HDI uint8_t mxfp8Scale(BlockAmax s) {
  if (s.nonFinite) return 0xFFu;
  if (s.amax == 0.0f) return 0;  // log2(0) = -inf clamps to the smallest scale
  int code = floorLog2(s.amax) - kE4M3MaxExponent + 127;
  return static_cast<uint8_t>(code < 0 ? 0 : code);  // <= 127 - 8 + 127: never overflows
}

CROSSBAR_HDI uint8_t mxfp8Encode(float x, uint8_t scale) {
  if (scale == 0xFFu) return 0x7Fu;
  // x / 2^(scale - 127), as an exact multiply by 2^(127 - scale) (a binary32 normal for
  // every scale mxfp8Scale produces, 0..246).
  float inv = bitsFloat(static_cast<uint32_t>(254 - scale) << 23);
  return floatToE4M3Bits(x * inv, Saturate::kFinite);
}

CROSSBAR_HDI float mxfp8Decode(uint8_t q, uint8_t scale) {
  return canonicalNan(e4m3BitsToFloat(q) * e8m0BitsToFloat(scale));
}

template <class T>
CROSSBAR_HDI uint8_t mxfp8Quantize(const T* x, int count, uint8_t* q) {
  uint8_t scale = mxfp8Scale(blockAmax(x, count));
  for (int i = 0; i < count; ++i) q[i] = mxfp8Encode(toFloat(x[i]), scale);
  return scale;
}

template <class T>
CROSSBAR_HDI void mxfp8Dequantize(const uint8_t* q, int count, uint8_t scale, T* out) {
  for (int i = 0; i < count; ++i) out[i] = fromFloat<T>(mxfp8Decode(q[i], scale));
}

// ---- NVFP4: e2m1 elements, E4M3 scale per 16, f32 per-tensor scale ----------------------
// Per-tensor scale from the tensor's amax (NaN if the tensor holds a non-finite value).
CROSSBAR_HDI float nvfp4GlobalScale(BlockAmax tensor) {
  if (tensor.nonFinite) return bitsFloat(0x7FC00000u);
  if (tensor.amax == 0.0f) return 1.0f;
  float g = tensor.amax / (kE4M3Max * kE2M1Max);
  return g < kFloatMinNormal ? kFloatMinNormal : g;
}

CROSSBAR_HDI uint8_t nvfp4BlockScale(BlockAmax block, float globalScale) {
  if (block.nonFinite || isNanFloat(globalScale)) return 0x7Fu;
  return floatToE4M3Bits(block.amax / (kE2M1Max * globalScale), Saturate::kFinite);
}

// The divisor elements are encoded against: decoded block scale times global scale.
CROSSBAR_HDI float nvfp4Divisor(uint8_t blockScale, float globalScale) {
  return e4m3BitsToFloat(blockScale) * globalScale;
}

// 4-bit code of x for a divisor d (0 when the block scale underflowed to zero or the block
// is poisoned).
CROSSBAR_HDI uint8_t nvfp4Encode(float x, float d) {
  if (!(d > 0.0f) || !isFiniteFloat(d)) return 0;
  return floatToE2M1Bits(x / d);
}

CROSSBAR_HDI float nvfp4Decode(uint8_t code, float d) {
  return canonicalNan(e2m1BitsToFloat(code & 0xFu) * d);
}

// Quantizes one block of count (<= 16) values into (count + 1) / 2 packed bytes (low
// nibble first; an odd tail's high nibble is 0); returns the E4M3 block scale.
template <class T>
CROSSBAR_HDI uint8_t nvfp4Quantize(const T* x, int count, float globalScale, uint8_t* packed) {
  uint8_t scale = nvfp4BlockScale(blockAmax(x, count), globalScale);
  float d = nvfp4Divisor(scale, globalScale);
  for (int i = 0; i < count; i += 2) {
    uint8_t lo = nvfp4Encode(toFloat(x[i]), d);
    uint8_t hi = i + 1 < count ? nvfp4Encode(toFloat(x[i + 1]), d) : 0;
    packed[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
  }
  return scale;
}

template <class T>
CROSSBAR_HDI void nvfp4Dequantize(const uint8_t* packed, int count, uint8_t blockScale, float globalScale,
                                  T* out) {
  float d = nvfp4Divisor(blockScale, globalScale);
  for (int i = 0; i < count; ++i) {
    uint8_t code = (i & 1) ? (packed[i / 2] >> 4) : (packed[i / 2] & 0xFu);
    out[i] = fromFloat<T>(nvfp4Decode(code, d));
  }
}

// ---- rows ----------------------------------------------------------------------------------
CROSSBAR_HDI int blockCount(size_t hidden, size_t start, int block) {
  return hidden - start < static_cast<size_t>(block) ? static_cast<int>(hidden - start) : block;
}

template <class T>
CROSSBAR_HDI void quantizeRowFp8Block(const T* x, size_t hidden, uint8_t* payload, float* scales) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kFp8BlockSize)
    scales[b] = fp8BlockQuantize(x + i, blockCount(hidden, i, kFp8BlockSize), payload + i);
}

template <class T>
CROSSBAR_HDI void dequantizeRowFp8Block(const uint8_t* payload, const float* scales, size_t hidden, T* out) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kFp8BlockSize)
    fp8BlockDequantize(payload + i, blockCount(hidden, i, kFp8BlockSize), scales[b], out + i);
}

template <class T>
CROSSBAR_HDI void quantizeRowMxfp8(const T* x, size_t hidden, uint8_t* payload, uint8_t* scales) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kMxBlockSize)
    scales[b] = mxfp8Quantize(x + i, blockCount(hidden, i, kMxBlockSize), payload + i);
}

template <class T>
CROSSBAR_HDI void dequantizeRowMxfp8(const uint8_t* payload, const uint8_t* scales, size_t hidden, T* out) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kMxBlockSize)
    mxfp8Dequantize(payload + i, blockCount(hidden, i, kMxBlockSize), scales[b], out + i);
}

template <class T>
CROSSBAR_HDI void quantizeRowNvfp4(const T* x, size_t hidden, float globalScale, uint8_t* payload,
                                   uint8_t* scales) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kNvfp4BlockSize)
    scales[b] = nvfp4Quantize(x + i, blockCount(hidden, i, kNvfp4BlockSize), globalScale, payload + i / 2);
}

template <class T>
CROSSBAR_HDI void dequantizeRowNvfp4(const uint8_t* payload, const uint8_t* scales, float globalScale,
                                     size_t hidden, T* out) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kNvfp4BlockSize)
    nvfp4Dequantize(payload + i / 2, blockCount(hidden, i, kNvfp4BlockSize), scales[b], globalScale, out + i);
}

// One entry point per direction for code that picks the codec at run time. `scales` holds
// scaleBytes(codec, hidden) bytes (4-byte aligned for kFp8Block128); globalScale is used by
// kNvfp4 only (nvfp4GlobalScale over the whole tensor).
template <class T>
CROSSBAR_HDI void quantizeRow(PayloadCodec c, const T* x, size_t hidden, uint8_t* payload, void* scales,
                              float globalScale = 1.0f) {
  switch (c) {
    case PayloadCodec::kBFloat16: {
      auto* out = reinterpret_cast<BFloat16*>(payload);  // payload is 2-byte aligned
      for (size_t i = 0; i < hidden; ++i) out[i] = BFloat16::fromFloat(toFloat(x[i]));
      break;
    }
    case PayloadCodec::kFp8Block128:
      quantizeRowFp8Block(x, hidden, payload, static_cast<float*>(scales));
      break;
    case PayloadCodec::kMxfp8:
      quantizeRowMxfp8(x, hidden, payload, static_cast<uint8_t*>(scales));
      break;
    case PayloadCodec::kNvfp4:
      quantizeRowNvfp4(x, hidden, globalScale, payload, static_cast<uint8_t*>(scales));
      break;
  }
}

template <class T>
CROSSBAR_HDI void dequantizeRow(PayloadCodec c, const uint8_t* payload, const void* scales, size_t hidden,
                                T* out, float globalScale = 1.0f) {
  switch (c) {
    case PayloadCodec::kBFloat16: {
      const auto* in = reinterpret_cast<const BFloat16*>(payload);
      for (size_t i = 0; i < hidden; ++i) out[i] = fromFloat<T>(in[i].toFloat());
      break;
    }
    case PayloadCodec::kFp8Block128:
      dequantizeRowFp8Block(payload, static_cast<const float*>(scales), hidden, out);
      break;
    case PayloadCodec::kMxfp8:
      dequantizeRowMxfp8(payload, static_cast<const uint8_t*>(scales), hidden, out);
      break;
    case PayloadCodec::kNvfp4:
      dequantizeRowNvfp4(payload, static_cast<const uint8_t*>(scales), globalScale, hidden, out);
      break;
  }
}

}  // namespace crossbar
