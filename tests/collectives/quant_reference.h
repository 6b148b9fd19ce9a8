// Test oracle: a frozen copy of the scalar codecs of collectives/float_types.h and
// collectives/quant.h as they were before the host fast paths (commit e713606). The
// exhaustive tests require today's code to give the same bits as this copy, and
// bench_quant times both. Do not "fix" this file: it defines the expected bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "collectives/float_types.h"
#include "collectives/quant.h"

namespace crossbar::quant_ref {

using crossbar::BFloat16;
using crossbar::kE2M1Max;
using crossbar::kE4M3Max;
using crossbar::kE4M3MaxExponent;
using crossbar::kFloatMinNormal;
using crossbar::kFp8BlockSize;
using crossbar::kMxBlockSize;
using crossbar::kNvfp4BlockSize;
using crossbar::Saturate;
using crossbar::ScaleRounding;

// Own statistics type, so argument-dependent lookup never picks crossbar:: functions.
struct BlockAmax {
  float amax = 0.0f;
  bool nonFinite = false;
};

namespace fpdetail {

// Rounds the magnitude |x| (bits without sign; finite) to a binary format with `m`
// mantissa bits whose smallest normal exponent is `emin` (= 1 - bias). Returns the
// format's magnitude code (exponent field << m | mantissa); the result may exceed the
// largest finite code, which the caller treats as overflow.
inline uint32_t roundMagnitude(uint32_t absBits, int m, int emin) {
  int e = static_cast<int>(absBits >> 23);
  uint32_t sig = absBits & 0x7FFFFFu;
  int exp;  // |x| = sig * 2^(exp - 23)
  if (e == 0) {
    exp = -126;  // binary32 subnormal: no implicit bit
  } else {
    exp = e - 127;
    sig |= 0x800000u;
  }
  // The target's quantum at this magnitude is 2^(max(exp, emin) - m); below emin the
  // target is subnormal and the quantum stops shrinking.
  int qexp = exp > emin ? exp : emin;
  int shift = 23 - m + (qexp - exp);
  if (shift > 30) shift = 30;  // sig < 2^24 is below half a quantum: rounds to 0
  uint32_t q = sig >> shift;
  uint32_t rem = sig & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // ties to even
  // Normal: q = 2^m + mantissa, so adding (qexp - emin) << m yields the biased exponent;
  // a mantissa carry (q = 2^(m+1)) or a subnormal rounding up to 2^m both carry into the
  // exponent field naturally.
  return (static_cast<uint32_t>(qexp - emin) << m) + q;
}

// binary32 bits of the finite magnitude code `mag` of a format with m mantissa bits and
// the given exponent bias (all our formats' values are binary32 normals or zero).
inline uint32_t decodeMagnitude(uint32_t mag, int m, int bias) {
  uint32_t exp = mag >> m;
  uint32_t mant = mag & ((1u << m) - 1u);
  if (exp == 0) {
    if (mant == 0) return 0;
    int e = 1 - bias;  // subnormal: mant * 2^(1 - bias - m); normalize
    while (!(mant & (1u << m))) {
      mant <<= 1;
      --e;
    }
    mant &= (1u << m) - 1u;
    return (static_cast<uint32_t>(e + 127) << 23) | (mant << (23 - m));
  }
  return (static_cast<uint32_t>(static_cast<int>(exp) - bias + 127) << 23) | (mant << (23 - m));
}

}  // namespace fpdetail

// ---- IEEE binary16: 1.5.10, bias 15, max 65504 ----------------------------------------
inline uint16_t floatToHalfBits(float f, Saturate sat = Saturate::kNo) {
  uint32_t b = floatBits(f);
  uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((a >> 13) & 0x1FFu);  // quiet
  bool s = sat == Saturate::kFinite;
  if (a == 0x7F800000u) return sign | (s ? 0x7BFFu : 0x7C00u);
  uint32_t code = fpdetail::roundMagnitude(a, 10, -14);
  if (code > 0x7BFFu) code = s ? 0x7BFFu : 0x7C00u;
  return sign | static_cast<uint16_t>(code);
}

inline float halfBitsToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t mag = h & 0x7FFFu;
  if (mag >= 0x7C00u) {  // Inf, or NaN made quiet with its payload kept
    uint32_t mant = mag & 0x3FFu;
    return bitsFloat(sign | 0x7F800000u | (mant ? 0x400000u | (mant << 13) : 0u));
  }
  return bitsFloat(sign | fpdetail::decodeMagnitude(mag, 10, 15));
}

// ---- bfloat16: 1.8.7, the top half of binary32 ---------------------------------------
inline uint16_t floatToBFloat16Bits(float f, Saturate sat = Saturate::kNo) {
  uint32_t b = floatBits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);  // quiet
  // Adding 0x7FFF plus the LSB of the kept half rounds to nearest-even; a carry out of
  // the mantissa bumps the exponent, and past the top it lands exactly on Inf.
  uint16_t r = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  if (sat == Saturate::kFinite && (r & 0x7FFFu) == 0x7F80u) r = (r & 0x8000u) | 0x7F7Fu;
  return r;
}

inline float bfloat16BitsToFloat(uint16_t h) {
  return bitsFloat(static_cast<uint32_t>(h) << 16);
}

// ---- OCP FP8 E4M3 (FN): 1.4.3, bias 7, no Inf, NaN = S.1111.111, max 448 -------------
inline uint8_t floatToE4M3Bits(float f, Saturate sat = Saturate::kNo) {
  uint32_t b = floatBits(f);
  uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7Fu;
  bool s = sat == Saturate::kFinite;
  if (a == 0x7F800000u) return sign | (s ? 0x7Eu : 0x7Fu);  // no Inf: NaN unless saturating
  uint32_t code = fpdetail::roundMagnitude(a, 3, -6);
  if (code > 0x7Eu) code = s ? 0x7Eu : 0x7Fu;  // > 464 rounds past 448
  return sign | static_cast<uint8_t>(code);
}

inline float e4m3BitsToFloat(uint8_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  uint32_t mag = v & 0x7Fu;
  if (mag == 0x7Fu) return bitsFloat(sign | 0x7FC00000u);
  return bitsFloat(sign | fpdetail::decodeMagnitude(mag, 3, 7));
}

// ---- OCP FP8 E5M2: 1.5.2, bias 15, Inf = S.11111.00, NaN = S.11111.{01,10,11}, max 57344
inline uint8_t floatToE5M2Bits(float f, Saturate sat = Saturate::kNo) {
  uint32_t b = floatBits(f);
  uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7Eu;
  bool s = sat == Saturate::kFinite;
  if (a == 0x7F800000u) return sign | (s ? 0x7Bu : 0x7Cu);
  uint32_t code = fpdetail::roundMagnitude(a, 2, -14);
  if (code > 0x7Bu) code = s ? 0x7Bu : 0x7Cu;  // >= 61440 rounds to Inf
  return sign | static_cast<uint8_t>(code);
}

inline float e5m2BitsToFloat(uint8_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  uint32_t mag = v & 0x7Fu;
  if (mag >= 0x7Cu) return bitsFloat(sign | (mag == 0x7Cu ? 0x7F800000u : 0x7FC00000u));
  return bitsFloat(sign | fpdetail::decodeMagnitude(mag, 2, 15));
}

// ---- OCP MX FP4 E2M1: 1.2.1, bias 1; values 0 0.5 1 1.5 2 3 4 6; no Inf/NaN ----------
// A 4-bit code in the low nibble. Conversion always saturates (there is nothing to
// overflow to); NaN has no encoding and becomes +6 (code 0x7), as PTX cvt .satfinite
// does for FP4, so a NaN cannot silently turn into a small value.
inline uint8_t floatToE2M1Bits(float f) {
  uint32_t b = floatBits(f);
  uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7u;
  uint8_t sign = static_cast<uint8_t>((b >> 28) & 0x8u);
  uint32_t code = a == 0x7F800000u ? 0x7u : fpdetail::roundMagnitude(a, 1, 0);
  if (code > 0x7u) code = 0x7u;
  return sign | static_cast<uint8_t>(code);
}

inline float e2m1BitsToFloat(uint8_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x8u) << 28;
  return bitsFloat(sign | fpdetail::decodeMagnitude(v & 0x7u, 1, 1));
}

// ---- OCP MX E8M0 scale: 2^(code - 127), code 0..254; 0xFF = NaN; no sign, no zero ----

inline float e8m0BitsToFloat(uint8_t v) {
  if (v == 0xFFu) return bitsFloat(0x7FC00000u);
  if (v == 0) return bitsFloat(0x00400000u);  // 2^-127 is a binary32 subnormal
  return bitsFloat(static_cast<uint32_t>(v) << 23);
}

// Power-of-two scale for the magnitude of f. Values below 2^-127 (and zero) clamp to the
// smallest code; NaN gives NaN; values past 2^127 give NaN, or 2^127 when saturating.
inline uint8_t floatToE8M0Bits(float f, ScaleRounding r = ScaleRounding::kDown,
                               Saturate sat = Saturate::kNo) {
  uint32_t a = floatBits(f) & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0xFFu;
  uint32_t code;
  if (a >= 0x00800000u) {
    code = a >> 23;  // the biased exponents coincide (bias 127)
    if (r == ScaleRounding::kUp && (a & 0x7FFFFFu) != 0) ++code;
  } else {
    code = (r == ScaleRounding::kUp && a > 0x00400000u) ? 1u : 0u;
  }
  if (code > 0xFEu) code = sat == Saturate::kFinite ? 0xFEu : 0xFFu;
  return static_cast<uint8_t>(code);
}

// Element access through the reference conversions.
inline float toFloat(float v) {
  return v;
}
inline float toFloat(BFloat16 v) {
  return quant_ref::bfloat16BitsToFloat(v.bits);
}
template <class T>
inline T fromFloat(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    static_assert(std::is_same_v<T, BFloat16>);
    return BFloat16{quant_ref::floatToBFloat16Bits(f)};
  }
}

// ---- block statistics ----------------------------------------------------------------

template <class T>
inline BlockAmax blockAmax(const T* x, int count) {
  BlockAmax r;
  for (int i = 0; i < count; ++i) {
    float v = quant_ref::toFloat(x[i]);
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
inline BlockAmax mergeAmax(BlockAmax a, BlockAmax b) {
  return BlockAmax{a.amax > b.amax ? a.amax : b.amax, a.nonFinite || b.nonFinite};
}

// ---- fp8 e4m3, f32 scale per 128 ---------------------------------------------------------
inline float fp8BlockScale(BlockAmax s) {
  if (s.nonFinite) return bitsFloat(0x7FC00000u);
  if (s.amax == 0.0f) return 1.0f;
  float scale = s.amax / kE4M3Max;
  return scale < kFloatMinNormal ? kFloatMinNormal : scale;
}

// Session 7 changed fp8 block-128 from x / scale to x * (448 / amax) (DeepGEMM / DeepEP's
// form, quant.h fp8BlockFactor); the reference follows so that it still checks the
// rounding cores, which stay frozen.
inline float fp8BlockFactor(BlockAmax s) {
  if (s.nonFinite) return bitsFloat(0x7FC00000u);
  if (s.amax == 0.0f) return 1.0f;
  if (s.amax / kE4M3Max < kFloatMinNormal) return 0x1p126f;
  return kE4M3Max / s.amax;
}

inline uint8_t fp8BlockEncode(float x, float factor) {
  if (factor != factor) return 0x7Fu;  // poisoned block: 0x7F whatever x is
  return quant_ref::floatToE4M3Bits(x * factor, Saturate::kFinite);
}

inline float fp8BlockDecode(uint8_t q, float scale) {
  return quant_ref::e4m3BitsToFloat(q) * scale;
}

// Quantizes one block of count (<= 128) values; returns its scale.
template <class T>
inline float fp8BlockQuantize(const T* x, int count, uint8_t* q) {
  const BlockAmax a = quant_ref::blockAmax(x, count);
  const float factor = quant_ref::fp8BlockFactor(a);
  for (int i = 0; i < count; ++i) q[i] = quant_ref::fp8BlockEncode(quant_ref::toFloat(x[i]), factor);
  return quant_ref::fp8BlockScale(a);
}

template <class T>
inline void fp8BlockDequantize(const uint8_t* q, int count, float scale, T* out) {
  for (int i = 0; i < count; ++i) out[i] = quant_ref::fromFloat<T>(quant_ref::fp8BlockDecode(q[i], scale));
}

// ---- MXFP8: e4m3 elements, E8M0 scale per 32 -----------------------------------------
// floor(log2(a)) for finite a > 0, from the bits (exact, subnormals included).
inline int floorLog2(float a) {
  uint32_t b = floatBits(a) & 0x7FFFFFFFu;
  int e = static_cast<int>(b >> 23);
  if (e != 0) return e - 127;
  int msb = 22;
  while (msb > 0 && !(b & (1u << msb))) --msb;
  return msb - 149;  // subnormal: b * 2^-149
}

inline uint8_t mxfp8Scale(BlockAmax s) {
  if (s.nonFinite) return 0xFFu;
  if (s.amax == 0.0f) return 0;  // log2(0) = -inf clamps to the smallest scale
  int code = quant_ref::floorLog2(s.amax) - kE4M3MaxExponent + 127;
  return static_cast<uint8_t>(code < 0 ? 0 : code);  // <= 127 - 8 + 127: never overflows
}

inline uint8_t mxfp8Encode(float x, uint8_t scale) {
  if (scale == 0xFFu) return 0x7Fu;
  // x / 2^(scale - 127), as an exact multiply by 2^(127 - scale) (a binary32 normal for
  // every scale mxfp8Scale produces, 0..246).
  float inv = bitsFloat(static_cast<uint32_t>(254 - scale) << 23);
  return quant_ref::floatToE4M3Bits(x * inv, Saturate::kFinite);
}

inline float mxfp8Decode(uint8_t q, uint8_t scale) {
  return quant_ref::e4m3BitsToFloat(q) * quant_ref::e8m0BitsToFloat(scale);
}

template <class T>
inline uint8_t mxfp8Quantize(const T* x, int count, uint8_t* q) {
  uint8_t scale = quant_ref::mxfp8Scale(quant_ref::blockAmax(x, count));
  for (int i = 0; i < count; ++i) q[i] = quant_ref::mxfp8Encode(quant_ref::toFloat(x[i]), scale);
  return scale;
}

template <class T>
inline void mxfp8Dequantize(const uint8_t* q, int count, uint8_t scale, T* out) {
  for (int i = 0; i < count; ++i) out[i] = quant_ref::fromFloat<T>(quant_ref::mxfp8Decode(q[i], scale));
}

// ---- NVFP4: e2m1 elements, E4M3 scale per 16, f32 per-tensor scale ----------------------
// Per-tensor scale from the tensor's amax (NaN if the tensor holds a non-finite value).
inline float nvfp4GlobalScale(BlockAmax tensor) {
  if (tensor.nonFinite) return bitsFloat(0x7FC00000u);
  if (tensor.amax == 0.0f) return 1.0f;
  float g = tensor.amax / (kE4M3Max * kE2M1Max);
  return g < kFloatMinNormal ? kFloatMinNormal : g;
}

inline uint8_t nvfp4BlockScale(BlockAmax block, float globalScale) {
  if (block.nonFinite || isNanFloat(globalScale)) return 0x7Fu;
  return quant_ref::floatToE4M3Bits(block.amax / (kE2M1Max * globalScale), Saturate::kFinite);
}

// The divisor elements are encoded against: decoded block scale times global scale.
inline float nvfp4Divisor(uint8_t blockScale, float globalScale) {
  return quant_ref::e4m3BitsToFloat(blockScale) * globalScale;
}

// 4-bit code of x for a divisor d (0 when the block scale underflowed to zero or the block
// is poisoned).
inline uint8_t nvfp4Encode(float x, float d) {
  if (!(d > 0.0f) || !isFiniteFloat(d)) return 0;
  return quant_ref::floatToE2M1Bits(x / d);
}

inline float nvfp4Decode(uint8_t code, float d) {
  return quant_ref::e2m1BitsToFloat(code & 0xFu) * d;
}

// Quantizes one block of count (<= 16) values into (count + 1) / 2 packed bytes (low
// nibble first; an odd tail's high nibble is 0); returns the E4M3 block scale.
template <class T>
inline uint8_t nvfp4Quantize(const T* x, int count, float globalScale, uint8_t* packed) {
  uint8_t scale = quant_ref::nvfp4BlockScale(quant_ref::blockAmax(x, count), globalScale);
  float d = quant_ref::nvfp4Divisor(scale, globalScale);
  for (int i = 0; i < count; i += 2) {
    uint8_t lo = quant_ref::nvfp4Encode(quant_ref::toFloat(x[i]), d);
    uint8_t hi = i + 1 < count ? quant_ref::nvfp4Encode(quant_ref::toFloat(x[i + 1]), d) : 0;
    packed[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
  }
  return scale;
}

template <class T>
inline void nvfp4Dequantize(const uint8_t* packed, int count, uint8_t blockScale, float globalScale, T* out) {
  float d = quant_ref::nvfp4Divisor(blockScale, globalScale);
  for (int i = 0; i < count; ++i) {
    uint8_t code = (i & 1) ? (packed[i / 2] >> 4) : (packed[i / 2] & 0xFu);
    out[i] = quant_ref::fromFloat<T>(quant_ref::nvfp4Decode(code, d));
  }
}

// ---- rows ----------------------------------------------------------------------------------
inline int blockCount(size_t hidden, size_t start, int block) {
  return hidden - start < static_cast<size_t>(block) ? static_cast<int>(hidden - start) : block;
}

template <class T>
inline void quantizeRowFp8Block(const T* x, size_t hidden, uint8_t* payload, float* scales) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kFp8BlockSize)
    scales[b] =
        quant_ref::fp8BlockQuantize(x + i, quant_ref::blockCount(hidden, i, kFp8BlockSize), payload + i);
}

template <class T>
inline void dequantizeRowFp8Block(const uint8_t* payload, const float* scales, size_t hidden, T* out) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kFp8BlockSize)
    quant_ref::fp8BlockDequantize(payload + i, quant_ref::blockCount(hidden, i, kFp8BlockSize), scales[b],
                                  out + i);
}

template <class T>
inline void quantizeRowMxfp8(const T* x, size_t hidden, uint8_t* payload, uint8_t* scales) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kMxBlockSize)
    scales[b] = quant_ref::mxfp8Quantize(x + i, quant_ref::blockCount(hidden, i, kMxBlockSize), payload + i);
}

template <class T>
inline void dequantizeRowMxfp8(const uint8_t* payload, const uint8_t* scales, size_t hidden, T* out) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kMxBlockSize)
    quant_ref::mxfp8Dequantize(payload + i, quant_ref::blockCount(hidden, i, kMxBlockSize), scales[b],
                               out + i);
}

template <class T>
inline void quantizeRowNvfp4(const T* x, size_t hidden, float globalScale, uint8_t* payload,
                             uint8_t* scales) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kNvfp4BlockSize)
    scales[b] = quant_ref::nvfp4Quantize(x + i, quant_ref::blockCount(hidden, i, kNvfp4BlockSize),
                                         globalScale, payload + i / 2);
}

template <class T>
inline void dequantizeRowNvfp4(const uint8_t* payload, const uint8_t* scales, float globalScale,
                               size_t hidden, T* out) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += kNvfp4BlockSize)
    quant_ref::nvfp4Dequantize(payload + i / 2, quant_ref::blockCount(hidden, i, kNvfp4BlockSize), scales[b],
                               globalScale, out + i);
}

}  // namespace crossbar::quant_ref
