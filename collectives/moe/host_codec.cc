#include "collectives/moe/host_codec.h"

#include <array>
#include <cstring>

namespace crossbar::moe {
namespace {

struct Tables {
  std::array<float, 256> e4m3;  // every E4M3 code's value (NaN codes included)
  std::array<float, 16> e2m1;
  Tables() {
    for (int i = 0; i < 256; ++i) e4m3[i] = e4m3BitsToFloat(static_cast<uint8_t>(i));
    for (int i = 0; i < 16; ++i) e2m1[i] = e2m1BitsToFloat(static_cast<uint8_t>(i));
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

template <class T>
void scaleBlock(const float* lut, const uint8_t* q, int count, float scale, T* out) {
  for (int i = 0; i < count; ++i) out[i] = fromFloat<T>(lut[q[i]] * scale);
}

// binary32 bits of element i (plain integer loads, which the vectorizer handles).
inline uint32_t bitsAt(const float* x, int i) {
  uint32_t b;
  std::memcpy(&b, x + i, 4);
  return b;
}
inline uint32_t bitsAt(const BFloat16* x, int i) {
  uint16_t h;
  std::memcpy(&h, reinterpret_cast<const char*>(x) + 2 * static_cast<size_t>(i), 2);
  return static_cast<uint32_t>(h) << 16;
}
inline uint32_t floatBitsOf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
inline float asFloat(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// blockAmax's result with integer ops: for non-negative binary32 values the bit patterns
// order like the values (zeros, subnormals included).
template <class T>
BlockAmax amaxOf(const T* __restrict x, int count) {
  uint32_t amax = 0, nonfinite = 0;
  for (int i = 0; i < count; ++i) {
    const uint32_t a = bitsAt(x, i) & 0x7FFFFFFFu;
    const bool finite = a < 0x7F800000u;
    nonfinite |= finite ? 0u : 1u;
    const uint32_t m = finite ? a : 0u;
    amax = m > amax ? m : amax;
  }
  return BlockAmax{asFloat(amax), nonfinite != 0};
}

// E4M3 (saturating) code of x * mul or x / div (one of them 1: the shared codecs divide
// for fp8 block-128 and multiply by a power of two for MXFP8), for count elements. Same
// bytes as floatToE4M3Bits(..., Saturate::kFinite): magnitudes at or above 2^-6 round with
// its constant-shift form; below, adding 2^14 (whose ulp is E4M3's subnormal quantum 2^-9)
// rounds to nearest-even exactly as its integer path does, and the bits above 2^14 count
// the quanta.
template <class T>
void e4m3Block(const T* __restrict x, int count, float div, float mul, uint8_t* __restrict q) {
  // 32-bit lanes first (one vector type for the whole computation), then narrowed.
  uint32_t codes[kFp8BlockSize];
  for (int i = 0; i < count; ++i) {
    const uint32_t b = bitsAt(x, i);
    const float v = asFloat(b) * mul / div;
    const uint32_t vb = floatBitsOf(v);
    const uint32_t sign = (vb >> 24) & 0x80u;
    const uint32_t a = vb & 0x7FFFFFFFu;
    const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    const uint32_t sub = floatBitsOf(asFloat(a) + 16384.0f) - 0x46800000u;  // + 2^14
    uint32_t code = a < (121u << 23) ? sub : normal;
    code = code > 0x7Eu ? 0x7Eu : code;  // saturate (Inf included)
    code = a > 0x7F800000u ? 0x7Fu : code;
    codes[i] = sign | code;
  }
  for (int i = 0; i < count; ++i) q[i] = static_cast<uint8_t>(codes[i]);
}

}  // namespace

template <class T>
void encodeRowHost(PayloadCodec codec, const T* x, size_t hidden, uint8_t* payload, void* scales,
                   float global_scale) {
  switch (codec) {
    case PayloadCodec::kFp8Block128: {
      auto* s = static_cast<float*>(scales);
      for (size_t b = 0, i = 0; i < hidden; ++b, i += kFp8BlockSize) {
        const int count = blockCount(hidden, i, kFp8BlockSize);
        s[b] = fp8BlockScale(amaxOf(x + i, count));
        e4m3Block(x + i, count, s[b], 1.0f, payload + i);
      }
      return;
    }
    case PayloadCodec::kMxfp8: {
      auto* s = static_cast<uint8_t*>(scales);
      for (size_t b = 0, i = 0; i < hidden; ++b, i += kMxBlockSize) {
        const int count = blockCount(hidden, i, kMxBlockSize);
        s[b] = mxfp8Scale(amaxOf(x + i, count));
        if (s[b] == 0xFFu) {
          for (int e = 0; e < count; ++e) payload[i + e] = 0x7Fu;
          continue;
        }
        // mxfp8Encode's exact multiply by 2^(127 - scale).
        float inv;
        const uint32_t inv_bits = static_cast<uint32_t>(254 - s[b]) << 23;
        std::memcpy(&inv, &inv_bits, 4);
        e4m3Block(x + i, count, 1.0f, inv, payload + i);
      }
      return;
    }
    default:
      quantizeRow(codec, x, hidden, payload, scales, global_scale);
  }
}

template void encodeRowHost<float>(PayloadCodec, const float*, size_t, uint8_t*, void*, float);
template void encodeRowHost<BFloat16>(PayloadCodec, const BFloat16*, size_t, uint8_t*, void*, float);

template <class T>
void decodeRowHost(PayloadCodec codec, const uint8_t* payload, const void* scales, size_t hidden, T* out,
                   float global_scale) {
  const Tables& t = tables();
  switch (codec) {
    case PayloadCodec::kFp8Block128: {
      const auto* s = static_cast<const float*>(scales);
      for (size_t b = 0, i = 0; i < hidden; ++b, i += kFp8BlockSize)
        scaleBlock(t.e4m3.data(), payload + i, blockCount(hidden, i, kFp8BlockSize), s[b], out + i);
      return;
    }
    case PayloadCodec::kMxfp8: {
      const auto* s = static_cast<const uint8_t*>(scales);
      for (size_t b = 0, i = 0; i < hidden; ++b, i += kMxBlockSize)
        scaleBlock(t.e4m3.data(), payload + i, blockCount(hidden, i, kMxBlockSize), e8m0BitsToFloat(s[b]),
                   out + i);
      return;
    }
    case PayloadCodec::kNvfp4: {
      const auto* s = static_cast<const uint8_t*>(scales);
      for (size_t b = 0, i = 0; i < hidden; ++b, i += kNvfp4BlockSize) {
        const int count = blockCount(hidden, i, kNvfp4BlockSize);
        const float d = nvfp4Divisor(s[b], global_scale);
        const uint8_t* packed = payload + i / 2;
        for (int e = 0; e < count; ++e) {
          const uint8_t code = (e & 1) ? (packed[e / 2] >> 4) : (packed[e / 2] & 0xFu);
          out[i + e] = fromFloat<T>(t.e2m1[code] * d);
        }
      }
      return;
    }
    default:
      dequantizeRow(codec, payload, scales, hidden, out, global_scale);
  }
}

template void decodeRowHost<float>(PayloadCodec, const uint8_t*, const void*, size_t, float*, float);
template void decodeRowHost<BFloat16>(PayloadCodec, const uint8_t*, const void*, size_t, BFloat16*, float);

}  // namespace crossbar::moe
