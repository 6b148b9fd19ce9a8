#include "collectives/moe/host_codec.h"

#include <array>
#include <cstring>
#include <string>
#include <type_traits>

#include "comm/env.h"
#include "comm/errors.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CROSSBAR_HOST_CODEC_HAVE_AVX2 1
#endif

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

// ==== scalar (portable; the fallback, and the reference the SIMD path is tested against) ====
namespace scalar {

template <class T>
void scaleBlock(const float* lut, const uint8_t* q, int count, float scale, T* out) {
  for (int i = 0; i < count; ++i) out[i] = fromFloat<T>(canonicalNan(lut[q[i]] * scale));
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

// E4M3 (saturating) code of x * mul (fp8 block-128: fp8BlockFactor; MXFP8: a power of
// two), for count elements. Same
// bytes as floatToE4M3Bits(..., Saturate::kFinite): magnitudes at or above 2^-6 round with
// its constant-shift form; below, adding 2^14 (whose ulp is E4M3's subnormal quantum 2^-9)
// rounds to nearest-even exactly as its integer path does, and the bits above 2^14 count
// the quanta.
template <class T>
void e4m3Block(const T* __restrict x, int count, float mul, uint8_t* __restrict q) {
  // 32-bit lanes first (one vector type for the whole computation), then narrowed.
  uint32_t codes[kFp8BlockSize];
  for (int i = 0; i < count; ++i) {
    const uint32_t b = bitsAt(x, i);
    const float v = asFloat(b) * mul;
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

template <class T>
void encodeRow(PayloadCodec codec, const T* x, size_t hidden, uint8_t* payload, void* scales,
               float global_scale) {
  switch (codec) {
    case PayloadCodec::kFp8Block128: {
      auto* s = static_cast<float*>(scales);
      for (size_t b = 0, i = 0; i < hidden; ++b, i += kFp8BlockSize) {
        const int count = blockCount(hidden, i, kFp8BlockSize);
        const BlockAmax a = amaxOf(x + i, count);
        s[b] = fp8BlockScale(a);
        if (a.nonFinite)  // fp8BlockEncode: every code of a poisoned block is 0x7F
          std::memset(payload + i, 0x7F, static_cast<size_t>(count));
        else
          e4m3Block(x + i, count, fp8BlockFactor(a), payload + i);
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
        e4m3Block(x + i, count, asFloat(static_cast<uint32_t>(254 - s[b]) << 23), payload + i);
      }
      return;
    }
    default:
      quantizeRow(codec, x, hidden, payload, scales, global_scale);
  }
}

template <class T>
void decodeRow(PayloadCodec codec, const uint8_t* payload, const void* scales, size_t hidden, T* out,
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
          out[i + e] = fromFloat<T>(canonicalNan(t.e2m1[code] * d));
        }
      }
      return;
    }
    default:
      dequantizeRow(codec, payload, scales, hidden, out, global_scale);
  }
}

template <class T>
BlockAmax tensorAmax(const T* x, size_t n) {
  BlockAmax r;
  for (size_t i = 0; i < n; i += 4096)
    r = mergeAmax(r, amaxOf(x + i, static_cast<int>(n - i < 4096 ? n - i : 4096)));
  return r;
}

template <class T>
void scaleRow(float* __restrict out, const T* __restrict y, float w, size_t n) {
  for (size_t c = 0; c < n; ++c) out[c] = toFloat(y[c]) * w;
}
template <class T>
void addRow(float* __restrict acc, const T* __restrict x, size_t n) {
  for (size_t c = 0; c < n; ++c) acc[c] += toFloat(x[c]);
}
inline void roundRow(BFloat16* __restrict out, const float* __restrict x, size_t n) {
  for (size_t c = 0; c < n; ++c) out[c] = BFloat16::fromFloat(x[c]);
}

}  // namespace scalar

// ==== AVX2 =====================================================================================
// The scalar formulas above, eight binary32 lanes at a time. Every step is either an integer
// operation or one IEEE operation (division, multiply, add) that SIMD rounds exactly as
// scalar code does under the same MXCSR, so the bytes are the scalar path's. Blocks are
// processed in full vectors; a block's tail (fewer than 8 elements) is copied into a
// zero-padded vector (zeros change neither an amax nor the other lanes' codes) and only its
// real elements are stored.
#if defined(CROSSBAR_HOST_CODEC_HAVE_AVX2)
namespace avx2 {

#define CROSSBAR_AVX2 __attribute__((target("avx2")))

CROSSBAR_AVX2 inline __m256i set1(uint32_t v) {
  return _mm256_set1_epi32(static_cast<int>(v));
}

// Eight elements' binary32 bits (bf16: widened into the top half).
CROSSBAR_AVX2 inline __m256i bits8(const float* x) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
}
CROSSBAR_AVX2 inline __m256i bits8(const BFloat16* x) {
  return _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16);
}
// The same for a tail: n < 8 reads only n elements and zero-fills the other lanes.
template <class T>
CROSSBAR_AVX2 inline __m256i bits8(const T* x, int n) {
  if (n >= 8) return bits8(x);
  T tmp[8];
  std::memset(tmp, 0, sizeof tmp);
  std::memcpy(tmp, x, sizeof(T) * static_cast<size_t>(n));
  return bits8(tmp);
}

// scalar::amaxOf: max of the finite magnitudes' bits (signed max is fine: < 2^31), and
// whether a lane held a NaN or Inf.
template <class T>
CROSSBAR_AVX2 BlockAmax amaxOf(const T* x, int count) {
  const __m256i abs_mask = set1(0x7FFFFFFFu), below_inf = set1(0x7F7FFFFFu);
  __m256i amax0 = _mm256_setzero_si256(), amax1 = amax0, bad = amax0;
  int i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256i a0 = _mm256_and_si256(bits8(x + i), abs_mask);
    const __m256i a1 = _mm256_and_si256(bits8(x + i + 8), abs_mask);
    const __m256i nf0 = _mm256_cmpgt_epi32(a0, below_inf), nf1 = _mm256_cmpgt_epi32(a1, below_inf);
    bad = _mm256_or_si256(bad, _mm256_or_si256(nf0, nf1));
    amax0 = _mm256_max_epi32(amax0, _mm256_andnot_si256(nf0, a0));
    amax1 = _mm256_max_epi32(amax1, _mm256_andnot_si256(nf1, a1));
  }
  for (; i < count; i += 8) {
    const __m256i a = _mm256_and_si256(bits8(x + i, count - i), abs_mask);
    const __m256i nf = _mm256_cmpgt_epi32(a, below_inf);
    bad = _mm256_or_si256(bad, nf);
    amax0 = _mm256_max_epi32(amax0, _mm256_andnot_si256(nf, a));
  }
  __m256i m = _mm256_max_epi32(amax0, amax1);
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return BlockAmax{scalar::asFloat(static_cast<uint32_t>(_mm_cvtsi128_si32(h))),
                   _mm256_movemask_epi8(bad) != 0};
}

// scalar::e4m3Block's code for eight already-scaled values that are not NaN (32-bit lanes,
// 0..255): the general form, for block tails (poisoned blocks never get here: their codes
// are all 0x7F).
CROSSBAR_AVX2 inline __m256i e4m3Codes(__m256 v) {
  const __m256i vb = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(vb, 24), set1(0x80u));
  const __m256i a = _mm256_and_si256(vb, set1(0x7FFFFFFFu));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 20), set1(1u));
  const __m256i normal = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, set1(0x7FFFFu)), lsb), 20), set1(120u << 3));
  const __m256i sub =
      _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(16384.0f))),
                       set1(0x46800000u));
  const __m256i is_sub = _mm256_cmpgt_epi32(set1(121u << 23), a);
  __m256i code = _mm256_blendv_epi8(normal, sub, is_sub);
  code = _mm256_min_epu32(code, set1(0x7Eu));  // saturate (Inf included)
  return _mm256_or_si256(sign, code);
}

// Low bytes of four vectors of 32-bit codes (each 0..255), in element order.
CROSSBAR_AVX2 inline __m256i narrow32(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
// Low bytes of one vector of 32-bit codes: 8 bytes in element order.
CROSSBAR_AVX2 inline uint64_t narrow8(__m256i c) {
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c, c), c);  // lane k: bytes 0..3 = c[4k..4k+3]
  const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  return static_cast<uint32_t>(_mm_cvtsi128_si32(lo)) |
         static_cast<uint64_t>(static_cast<uint32_t>(_mm_cvtsi128_si32(hi))) << 32;
}

// e4m3Codes of x * mul for count elements (a block's tail), nothing read or written past it.
template <class T>
CROSSBAR_AVX2 void e4m3Block(const T* x, int count, float mul, uint8_t* q) {
  const __m256 vm = _mm256_set1_ps(mul);
  for (int i = 0; i < count; i += 8) {
    const int n = count - i < 8 ? count - i : 8;
    const uint64_t bytes = narrow8(e4m3Codes(_mm256_mul_ps(_mm256_castsi256_ps(bits8(x + i, n)), vm)));
    std::memcpy(q + i, &bytes, static_cast<size_t>(n));
  }
}

// ---- the fast E4M3 encode (full 32-element chunks of a block without NaN/Inf) ----
// E4M3 magnitude code of each lane's a (0 <= a <= 448, not NaN) in the lane's LOW BYTE (the
// bytes above it are garbage), with one float addition doing the rounding: for
// e = max(floor(log2 a), -6), c = 2^(e + 20) has ulp 2^(e - 3), which is E4M3's quantum in
// a's binade (and its subnormal quantum 2^-9 below 2^-6), so a + c rounds a to nearest-even
// in units of that quantum: bits(a + c) = bits(c) + m, m = the rounded a in quanta (0..16;
// 16 is the next binade's first code), and the code is 8 (e + 6) + m. c carries 56 in its
// low mantissa bits: even, so the parity of the rounded sum (ties-to-even) and its binade
// are unchanged, and chosen so the low byte comes out right without a subtraction:
// 56 + m + (bits(2^e) >> 20) = 56 + m + 8 (e + 127) = 8 (e + 6) + m + 1024.
// Same codes as scalar::e4m3Block / floatToE4M3Bits (test_quant_simd checks every boundary).
CROSSBAR_AVX2 inline __m256i e4m3LowByte(__m256 a) {
  const __m256i expo = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(a), set1(0x7F800000u)),
                                        set1(121u << 23));  // 2^e, e >= -6
  const __m256i c = _mm256_add_epi32(expo, set1((20u << 23) + 56u));
  const __m256i sum = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(c)));
  return _mm256_and_si256(_mm256_add_epi32(sum, _mm256_srli_epi32(expo, 20)), set1(0xFFu));
}

// |x| * factor's E4M3 magnitude codes (32-bit lanes, 0..126). kSaturate: clamp to 448 first
// (MXFP8's values reach 512); fp8 block-128's never pass 448 (1 + 2^-23), which rounds to 448.
template <bool kSaturate>
CROSSBAR_AVX2 inline __m256i e4m3Magnitudes(__m256i abs_bits, __m256 factor) {
  __m256 a = _mm256_mul_ps(_mm256_castsi256_ps(abs_bits), factor);  // = |x * factor|
  if constexpr (kSaturate) a = _mm256_min_ps(a, _mm256_set1_ps(kE4M3Max));
  return e4m3LowByte(a);
}

// 32 codes of x * factor (x finite; factor > 0 finite), signs from x: the sign bytes come
// from packing x's bits with signed saturation (a negative lane stays negative), in the same
// lane order as the magnitudes' packs.
template <bool kSaturate>
CROSSBAR_AVX2 inline void e4m3Chunk32(const BFloat16* x, __m256 factor, uint8_t* q) {
  const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  const __m256i sign =
      _mm256_and_si256(_mm256_packs_epi16(h0, h1), _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i abs16 = _mm256_set1_epi16(0x7FFF), zero = _mm256_setzero_si256();
  const __m256i a0 = _mm256_and_si256(h0, abs16), a1 = _mm256_and_si256(h1, abs16);
  // bf16 -> binary32 bits by interleaving with zeros: per 128-bit lane, elements 0-3 | 8-11 etc.
  const __m256i c0 = e4m3Magnitudes<kSaturate>(_mm256_unpacklo_epi16(zero, a0), factor);
  const __m256i c1 = e4m3Magnitudes<kSaturate>(_mm256_unpackhi_epi16(zero, a0), factor);
  const __m256i c2 = e4m3Magnitudes<kSaturate>(_mm256_unpacklo_epi16(zero, a1), factor);
  const __m256i c3 = e4m3Magnitudes<kSaturate>(_mm256_unpackhi_epi16(zero, a1), factor);
  // Both packs leave 64-bit groups in the order 0-7, 16-23 | 8-15, 24-31.
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permute4x64_epi64(_mm256_or_si256(b, sign), 0xD8));
}
template <bool kSaturate>
CROSSBAR_AVX2 inline void e4m3Chunk32(const float* x, __m256 factor, uint8_t* q) {
  const __m256i v0 = bits8(x), v1 = bits8(x + 8), v2 = bits8(x + 16), v3 = bits8(x + 24);
  const __m256i sign =
      _mm256_and_si256(_mm256_packs_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3)),
                       _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i abs_mask = set1(0x7FFFFFFFu);
  const __m256i c0 = e4m3Magnitudes<kSaturate>(_mm256_and_si256(v0, abs_mask), factor);
  const __m256i c1 = e4m3Magnitudes<kSaturate>(_mm256_and_si256(v1, abs_mask), factor);
  const __m256i c2 = e4m3Magnitudes<kSaturate>(_mm256_and_si256(v2, abs_mask), factor);
  const __m256i c3 = e4m3Magnitudes<kSaturate>(_mm256_and_si256(v3, abs_mask), factor);
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
  _mm256_storeu_si256(
      reinterpret_cast<__m256i*>(q),
      _mm256_permutevar8x32_epi32(_mm256_or_si256(b, sign), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// Largest |x| bit pattern over count elements, NaN and Inf included (>= 0x7F800000 means the
// block is poisoned; otherwise it is blockAmax's amax). bf16 works on 16-bit lanes.
CROSSBAR_AVX2 inline uint32_t absMaxBits(const BFloat16* x, int count) {
  const __m256i abs16 = _mm256_set1_epi16(0x7FFF);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  int i = 0;
  for (; i + 32 <= count; i += 32) {
    m0 = _mm256_max_epu16(
        m0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), abs16));
    m1 = _mm256_max_epu16(
        m1, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 16)), abs16));
  }
  for (; i + 16 <= count; i += 16)
    m0 = _mm256_max_epu16(
        m0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), abs16));
  m0 = _mm256_max_epu16(m0, m1);
  // Horizontal max of 16 lanes: minpos finds the smallest of the complements.
  const __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m0), _mm256_extracti128_si256(m0, 1));
  const __m128i mp = _mm_minpos_epu16(_mm_xor_si128(h, _mm_set1_epi32(-1)));
  uint32_t amax = (~static_cast<uint32_t>(_mm_cvtsi128_si32(mp)) & 0xFFFFu) << 16;
  for (; i < count; ++i) {
    const uint32_t a = scalar::bitsAt(x, i) & 0x7FFFFFFFu;
    amax = a > amax ? a : amax;
  }
  return amax;
}
CROSSBAR_AVX2 inline uint32_t absMaxBits(const float* x, int count) {
  const __m256i abs_mask = set1(0x7FFFFFFFu);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  int i = 0;
  for (; i + 16 <= count; i += 16) {
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(bits8(x + i), abs_mask));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(bits8(x + i + 8), abs_mask));
  }
  const __m256i m = _mm256_max_epu32(m0, m1);
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xB1));
  uint32_t amax = static_cast<uint32_t>(_mm_cvtsi128_si32(h));
  for (; i < count; ++i) {
    const uint32_t a = scalar::bitsAt(x, i) & 0x7FFFFFFFu;
    amax = a > amax ? a : amax;
  }
  return amax;
}

// One fp8 block-128 block (count <= 128): codes and scale, as fp8BlockQuantize.
template <class T>
CROSSBAR_AVX2 float fp8Block(const T* x, int count, uint8_t* q) {
  const uint32_t amax_bits = absMaxBits(x, count);
  if (amax_bits >= 0x7F800000u) {  // a NaN or Inf: every code NaN, scale NaN (fp8BlockEncode)
    std::memset(q, 0x7F, static_cast<size_t>(count));
    return fp8BlockScale(BlockAmax{0.0f, true});
  }
  const BlockAmax a{scalar::asFloat(amax_bits), false};
  const float factor = fp8BlockFactor(a);
  const __m256 vf = _mm256_set1_ps(factor);
  int i = 0;
  for (; i + 32 <= count; i += 32) e4m3Chunk32<false>(x + i, vf, q + i);
  if (i < count) e4m3Block(x + i, count - i, factor, q + i);
  return fp8BlockScale(a);
}

// Eight full fp8 block-128 blocks: their amaxes first, then the eight scales and factors
// with vector divisions (vdivps rounds as the scalar division does; the selects are
// fp8BlockScale's and fp8BlockFactor's), then the codes. No block waits for its own scalar
// divisions, and the encode loop runs from a table of factors.
template <class T>
CROSSBAR_AVX2 void fp8Blocks8(const T* x, uint8_t* q, float* scales) {
  alignas(32) uint32_t amax_bits[8];
  alignas(32) float factors[8];
  for (int k = 0; k < 8; ++k) amax_bits[k] = absMaxBits(x + k * kFp8BlockSize, kFp8BlockSize);
  const __m256i bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(amax_bits));
  const __m256 amax = _mm256_castsi256_ps(bits), e4m3_max = _mm256_set1_ps(kE4M3Max);
  const __m256 ratio = _mm256_div_ps(amax, e4m3_max);  // amax / 448
  const __m256 tiny = _mm256_cmp_ps(ratio, _mm256_set1_ps(kFloatMinNormal), _CMP_LT_OQ);
  const __m256 zero = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_EQ_OQ);
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 scale = _mm256_blendv_ps(ratio, _mm256_set1_ps(kFloatMinNormal), tiny);
  scale = _mm256_blendv_ps(scale, one, zero);
  const __m256 poisoned = _mm256_castsi256_ps(_mm256_cmpgt_epi32(bits, set1(0x7F7FFFFFu)));
  scale = _mm256_blendv_ps(scale, _mm256_castsi256_ps(set1(0x7FC00000u)), poisoned);
  __m256 factor = _mm256_blendv_ps(_mm256_div_ps(e4m3_max, amax), _mm256_set1_ps(0x1p126f), tiny);
  factor = _mm256_blendv_ps(factor, one, zero);
  _mm256_storeu_ps(scales, scale);
  _mm256_store_ps(factors, factor);
  const int poisoned_mask = _mm256_movemask_ps(poisoned);
  for (int k = 0; k < 8; ++k) {
    const T* xb = x + k * kFp8BlockSize;
    uint8_t* qb = q + k * kFp8BlockSize;
    if (poisoned_mask >> k & 1) {  // fp8BlockEncode: every code 0x7F
      std::memset(qb, 0x7F, kFp8BlockSize);
      continue;
    }
    const __m256 vf = _mm256_broadcast_ss(factors + k);
    for (int i = 0; i < kFp8BlockSize; i += 32) e4m3Chunk32<false>(xb + i, vf, qb + i);
  }
}

// One MXFP8 block (count <= 32): codes and E8M0 scale, as mxfp8Quantize.
template <class T>
CROSSBAR_AVX2 uint8_t mxfp8Block(const T* x, int count, uint8_t* q) {
  const uint32_t amax_bits = absMaxBits(x, count);
  if (amax_bits >= 0x7F800000u) {  // poisoned: mxfp8Scale's 0xFF, every code NaN
    std::memset(q, 0x7F, static_cast<size_t>(count));
    return 0xFFu;
  }
  const uint8_t scale = mxfp8Scale(BlockAmax{scalar::asFloat(amax_bits), false});
  // mxfp8Encode's exact multiply by 2^(127 - scale).
  const float factor = scalar::asFloat(static_cast<uint32_t>(254 - scale) << 23);
  if (count == kMxBlockSize)
    e4m3Chunk32<true>(x, _mm256_set1_ps(factor), q);
  else
    e4m3Block(x, count, factor, q);
  return scale;
}

// Eight full MXFP8 blocks: amaxes, then the eight E8M0 scales at once (mxfp8Scale of a
// finite amax is max(biased exponent - 8, 0): subnormals and zero give 0), then the codes.
template <class T>
CROSSBAR_AVX2 void mxfp8Blocks8(const T* x, uint8_t* q, uint8_t* scales) {
  alignas(32) uint32_t amax_bits[8];
  alignas(32) uint32_t factor_bits[8];
  for (int k = 0; k < 8; ++k) amax_bits[k] = absMaxBits(x + k * kMxBlockSize, kMxBlockSize);
  const __m256i bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(amax_bits));
  const __m256i poisoned = _mm256_cmpgt_epi32(bits, set1(0x7F7FFFFFu));
  __m256i scale =
      _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), set1(8u)), _mm256_setzero_si256());
  // mxfp8Encode's exact multiply by 2^(127 - scale) (poisoned blocks do not use theirs).
  _mm256_store_si256(reinterpret_cast<__m256i*>(factor_bits),
                     _mm256_slli_epi32(_mm256_sub_epi32(set1(254u), scale), 23));
  scale = _mm256_or_si256(scale, _mm256_and_si256(poisoned, set1(0xFFu)));
  const uint64_t scale_bytes = narrow8(scale);
  std::memcpy(scales, &scale_bytes, 8);
  const int poisoned_mask = _mm256_movemask_ps(_mm256_castsi256_ps(poisoned));
  for (int k = 0; k < 8; ++k) {
    if (poisoned_mask >> k & 1) {  // every code NaN
      std::memset(q + k * kMxBlockSize, 0x7F, kMxBlockSize);
      continue;
    }
    e4m3Chunk32<true>(x + k * kMxBlockSize,
                      _mm256_broadcast_ss(reinterpret_cast<const float*>(factor_bits + k)),
                      q + k * kMxBlockSize);
  }
}

// floatToE2M1Bits of eight values (32-bit lanes, 0..15): |v| >= 1 rounds with
// roundMagnitude's constant shift (2 codes per binade), below 1 by adding 2^22 (ulp 0.5,
// E2M1's subnormal quantum); NaN gives +6 (code 7, no sign) as the shared encoder does.
CROSSBAR_AVX2 inline __m256i e2m1Codes(__m256 v) {
  const __m256i vb = _mm256_castps_si256(v);
  const __m256i a = _mm256_and_si256(vb, set1(0x7FFFFFFFu));
  const __m256i is_nan = _mm256_cmpgt_epi32(a, set1(0x7F800000u));
  const __m256i sign = _mm256_andnot_si256(is_nan, _mm256_and_si256(_mm256_srli_epi32(vb, 28), set1(0x8u)));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 22), set1(1u));
  const __m256i normal = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, set1(0x1FFFFFu)), lsb), 22), set1(252u));
  const __m256i sub =
      _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(4194304.0f))),
                       set1(0x4A800000u));
  const __m256i is_sub = _mm256_cmpgt_epi32(set1(0x3F800000u), a);
  __m256i code = _mm256_blendv_epi8(normal, sub, is_sub);
  code = _mm256_min_epu32(code, set1(0x7u));  // saturate (Inf included); NaN: 7
  return _mm256_or_si256(sign, code);
}

// One NVFP4 block (count <= 16): scale byte, and (count + 1) / 2 packed bytes, low nibble
// first, like nvfp4Quantize.
// nvfp4Encode's packed codes of count (<= 16) values for a divisor d > 0, finite.
template <class T>
CROSSBAR_AVX2 void nvfp4Codes(const T* x, int count, float d, uint8_t* packed) {
  const size_t bytes = static_cast<size_t>(count + 1) / 2;
  const __m256 vd = _mm256_set1_ps(d);
  const __m256i c0 = e2m1Codes(_mm256_div_ps(_mm256_castsi256_ps(bits8(x, count)), vd));
  const __m256i c1 = count > 8 ? e2m1Codes(_mm256_div_ps(_mm256_castsi256_ps(bits8(x + 8, count - 8)), vd))
                               : _mm256_setzero_si256();
  // 16 code bytes, then byte pairs (2j, 2j+1) as 16-bit lanes -> lo | hi << 4.
  const __m256i b = narrow32(c0, c1, c0, c1);
  const __m128i w = _mm256_castsi256_si128(b);
  const __m128i nib = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16(0x0F)),
                                   _mm_and_si128(_mm_srli_epi16(w, 4), _mm_set1_epi16(0xF0)));
  const uint64_t out = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_packus_epi16(nib, nib)));
  std::memcpy(packed, &out, bytes);
}

template <class T>
CROSSBAR_AVX2 uint8_t nvfp4Block(const T* x, int count, float global_scale, uint8_t* packed) {
  const uint8_t scale = nvfp4BlockScale(amaxOf(x, count), global_scale);
  const float d = nvfp4Divisor(scale, global_scale);
  if (!(d > 0.0f) || !isFiniteFloat(d))  // nvfp4Encode: every element 0
    std::memset(packed, 0, static_cast<size_t>(count + 1) / 2);
  else
    nvfp4Codes(x, count, d, packed);
  return scale;
}

CROSSBAR_AVX2 inline __m256 e4m3Values(__m256i q);

// Eight full NVFP4 blocks (128 values) for a global scale g that is finite and > 0: the
// amaxes, then the eight E4M3 block scales e4m3(amax / (6 g)) (one vdivps, the general E4M3
// rounding) and divisors e4m3 value * g at once, as nvfp4BlockScale / nvfp4Divisor do one
// by one, then the codes.
template <class T>
CROSSBAR_AVX2 void nvfp4Blocks8(const T* x, float global_scale, uint8_t* packed, uint8_t* scales) {
  alignas(32) uint32_t amax_bits[8];
  alignas(32) float divisors[8];
  for (int k = 0; k < 8; ++k) amax_bits[k] = absMaxBits(x + k * kNvfp4BlockSize, kNvfp4BlockSize);
  const __m256i bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(amax_bits));
  const __m256i poisoned = _mm256_cmpgt_epi32(bits, set1(0x7F7FFFFFu));
  const float den = kE2M1Max * global_scale;
  __m256i scale = e4m3Codes(_mm256_div_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(den)));
  scale = _mm256_blendv_epi8(scale, set1(0x7Fu), poisoned);
  const __m256 d = _mm256_mul_ps(e4m3Values(scale), _mm256_set1_ps(global_scale));
  _mm256_store_ps(divisors, d);
  const __m256 usable = _mm256_and_ps(_mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_GT_OQ),
                                      _mm256_cmp_ps(d, _mm256_castsi256_ps(set1(0x7F800000u)), _CMP_LT_OQ));
  const int usable_mask = _mm256_movemask_ps(usable);
  const uint64_t scale_bytes = narrow8(scale);
  std::memcpy(scales, &scale_bytes, 8);
  for (int k = 0; k < 8; ++k) {
    uint8_t* p = packed + k * kNvfp4BlockSize / 2;
    if (usable_mask >> k & 1)
      nvfp4Codes(x + k * kNvfp4BlockSize, kNvfp4BlockSize, divisors[k], p);
    else
      std::memset(p, 0, kNvfp4BlockSize / 2);  // nvfp4Encode: every element 0
  }
}

template <class T>
CROSSBAR_AVX2 void encodeRow(PayloadCodec codec, const T* x, size_t hidden, uint8_t* payload, void* scales,
                             float global_scale) {
  switch (codec) {
    case PayloadCodec::kFp8Block128: {
      auto* s = static_cast<float*>(scales);
      size_t b = 0, i = 0;
      for (; i + 8 * kFp8BlockSize <= hidden; b += 8, i += 8 * kFp8BlockSize)
        fp8Blocks8(x + i, payload + i, s + b);
      for (; i < hidden; ++b, i += kFp8BlockSize)
        s[b] = fp8Block(x + i, blockCount(hidden, i, kFp8BlockSize), payload + i);
      return;
    }
    case PayloadCodec::kMxfp8: {
      auto* s = static_cast<uint8_t*>(scales);
      size_t b = 0, i = 0;
      for (; i + 8 * kMxBlockSize <= hidden; b += 8, i += 8 * kMxBlockSize)
        mxfp8Blocks8(x + i, payload + i, s + b);
      for (; i < hidden; ++b, i += kMxBlockSize)
        s[b] = mxfp8Block(x + i, blockCount(hidden, i, kMxBlockSize), payload + i);
      return;
    }
    case PayloadCodec::kNvfp4: {
      auto* s = static_cast<uint8_t*>(scales);
      size_t b = 0, i = 0;
      if (global_scale > 0.0f && isFiniteFloat(global_scale))
        for (; i + 8 * kNvfp4BlockSize <= hidden; b += 8, i += 8 * kNvfp4BlockSize)
          nvfp4Blocks8(x + i, global_scale, payload + i / 2, s + b);
      for (; i < hidden; ++b, i += kNvfp4BlockSize)
        s[b] = nvfp4Block(x + i, blockCount(hidden, i, kNvfp4BlockSize), global_scale, payload + i / 2);
      return;
    }
    default:
      scalar::encodeRow(codec, x, hidden, payload, scales, global_scale);
  }
}

// e4m3BitsToFloat of eight codes (32-bit lanes): normal codes rebias their bits, subnormal
// ones are mant * 2^-9 (an exact product), S.1111.111 is NaN.
CROSSBAR_AVX2 inline __m256 e4m3Values(__m256i q) {
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(q, set1(0x80u)), 24);
  const __m256i mag = _mm256_and_si256(q, set1(0x7Fu));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), set1(120u << 23));
  const __m256i sub = _mm256_castps_si256(
      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(mag, set1(7u))), _mm256_set1_ps(1.0f / 512.0f)));
  const __m256i is_sub = _mm256_cmpgt_epi32(set1(8u), mag);
  __m256i v = _mm256_blendv_epi8(normal, sub, is_sub);
  v = _mm256_blendv_epi8(v, set1(0x7FC00000u), _mm256_cmpeq_epi32(mag, set1(0x7Fu)));
  return _mm256_castsi256_ps(_mm256_or_si256(v, sign));
}

// floatToBFloat16Bits (kNo) of eight values, in 32-bit lanes.
CROSSBAR_AVX2 inline __m256i bf16Bits(__m256 f) {
  const __m256i b = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), set1(1u));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, set1(0x7FFFu)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(b, 16), set1(0x40u));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, set1(0x7FFFFFFFu)), set1(0x7F800000u));
  return _mm256_blendv_epi8(rounded, quiet, is_nan);
}

// Stores eight values as T; n < 8 stores the first n.
CROSSBAR_AVX2 inline void store8(float* out, __m256 v, int n) {
  if (n >= 8) {
    _mm256_storeu_ps(out, v);
    return;
  }
  float tmp[8];
  _mm256_storeu_ps(tmp, v);
  std::memcpy(out, tmp, sizeof(float) * static_cast<size_t>(n));
}
CROSSBAR_AVX2 inline void store8(BFloat16* out, __m256 v, int n) {
  const __m256i h = bf16Bits(v);
  const __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), p);
    return;
  }
  uint16_t tmp[8];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), p);
  std::memcpy(out, tmp, 2 * static_cast<size_t>(n));
}

// a * b with any NaN result replaced by canonicalNan's (quant.h): the GPU's bytes.
CROSSBAR_AVX2 inline __m256 mulCanonical(__m256 a, __m256 b) {
  const __m256 p = _mm256_mul_ps(a, b);
  return _mm256_blendv_ps(p, _mm256_castsi256_ps(set1(0x7FC00000u)), _mm256_cmp_ps(p, p, _CMP_UNORD_Q));
}

// Eight code bytes widened to 32-bit lanes; n < 8 reads n.
CROSSBAR_AVX2 inline __m256i codes8(const uint8_t* q, int n) {
  uint64_t v = 0;
  std::memcpy(&v, q, n >= 8 ? 8 : static_cast<size_t>(n));
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(v)));
}

// Whether no element of the block can decode to NaN: a finite scale (Inf x 0 is NaN) and no
// NaN code (S.1111.111). Then the NaN selects of the loop below change nothing and are skipped.
CROSSBAR_AVX2 inline bool nanFreeBlock(const uint8_t* q, int count, float scale) {
  if ((scalar::floatBitsOf(scale) & 0x7F800000u) == 0x7F800000u) return false;  // NaN or Inf
  const __m256i low7 = _mm256_set1_epi8(0x7F);
  __m256i nan_code = _mm256_setzero_si256();
  int i = 0;
  for (; i + 32 <= count; i += 32)
    nan_code = _mm256_or_si256(
        nan_code,
        _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i)), low7),
                          low7));
  for (; i < count; ++i)
    if ((q[i] & 0x7F) == 0x7F) return false;
  return _mm256_movemask_epi8(nan_code) == 0;
}

// floatToBFloat16Bits of eight values that are not NaN (bf16Bits without its NaN select).
CROSSBAR_AVX2 inline void storeBf16NoNan(BFloat16* out, __m256 f) {
  const __m256i b = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), set1(1u));
  const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, set1(0x7FFFu)), lsb), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}
CROSSBAR_AVX2 inline void storeBf16NoNan(float* out, __m256 f) {
  _mm256_storeu_ps(out, f);
}

// ---- AVX-512 (kAvx512: the AVX2 code plus this) ----
// fp8 / MXFP8 decode of a NaN-free block to bf16, sixteen values per step: one product and
// the hardware's bf16 conversion (VCVTNEPS2BF16) instead of AVX2's integer rounding, about
// twice as fast (decode is what fp8 dispatch spends most of its extra CPU on). Same bytes as
// the scalar path under these conditions (wideBlockOk):
//   * products are normal or zero: VCVTNEPS2BF16 reads a subnormal input as zero, where
//     floatToBFloat16Bits rounds it. The smallest non-zero code is 2^-9, so |scale| >= 2^-117.
//   * scale x 2^120 is exact (|scale| < 2^8): the code's bits as a binary32 times 2^120 is
//     its value (e4m3Decode below), so (bits x (2^120 scale)) is value x scale rounded once,
//     the scalar product.
//   * no NaN operand and no NaN code (the canonical-NaN select is skipped), MXCSR.DAZ clear
//     (E4M3 subnormal codes are binary32 subnormal operands); its RNE and the integer
//     rounding agree on every other input, Inf included.
#define CROSSBAR_AVX512 __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512bf16")))
inline bool wideBlockOk(int count, float scale) {
  const uint32_t e = (scalar::floatBitsOf(scale) >> 23) & 0xFFu;  // biased exponent of |scale|
  return count % 16 == 0 && e >= 127 - 117 && e <= 127 + 7;
}
CROSSBAR_AVX512 inline void e4m3DecodeWide(const uint8_t* q, int count, float scale, BFloat16* out) {
  const __m512 s = _mm512_set1_ps(scale * 0x1p120f);
  const __m512i keep = _mm512_set1_epi32(static_cast<int>(0x87F00000u));  // sign, E4M3 magnitude << 20
  // The zero-masked forms: GCC 12's unmasked ones pass an "undefined" vector that
  // -Wmaybe-uninitialized reports.
  const __mmask16 all = 0xFFFF;
  for (int i = 0; i < count; i += 16) {
    // The code sign-extended, shifted by 20: its magnitude lands on bits 20-26 and copies of
    // its sign on 27-31; the mask keeps the magnitude and bit 31.
    const __m512i c =
        _mm512_maskz_cvtepi8_epi32(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    const __m512i v = _mm512_and_si512(_mm512_maskz_slli_epi32(all, c, 20), keep);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_castsi512_ps(v), s));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<const __m256i&>(h));
  }
}
// Whether count (<= 128) codes hold no NaN (S.1111.111); the bytes past count are not read.
CROSSBAR_AVX512 inline bool nanFreeCodes(const uint8_t* q, int count) {
  const __m512i low7 = _mm512_set1_epi8(0x7F);
  __mmask64 nan = 0;
  for (int i = 0; i < count; i += 64) {
    const __mmask64 n = count - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (count - i)) - 1;
    const __m512i v = _mm512_maskz_loadu_epi8(n, q + i);  // zeros past count: never 0x7F
    nan |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(v, low7), low7);
  }
  return nan == 0;
}

template <class T>
CROSSBAR_AVX2 void e4m3Decode(const uint8_t* q, int count, float scale, bool daz, T* out) {
  const __m256 s = _mm256_set1_ps(scale);
  int i = 0;
  if (!daz && nanFreeBlock(q, count, scale)) {
    // The loop below without its NaN selects (same products, same rounding).
    const __m256 rebias = _mm256_set1_ps(0x1p120f);
    for (; i + 8 <= count; i += 8) {
      const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
      const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(c, 24), set1(0x80000000u));
      const __m256i mag = _mm256_srli_epi32(_mm256_slli_epi32(c, 25), 5);
      const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(mag, sign)), rebias);
      storeBf16NoNan(out + i, _mm256_mul_ps(v, s));
    }
  } else if (!daz) {
    // The code's bits placed as a binary32 (exponent field = E4M3's, mantissa on top; an
    // E4M3 subnormal lands on a binary32 subnormal) times 2^(127 - 7) is its value,
    // exactly: the same operand for the same single rounding by the scale as the table.
    // Needs subnormal inputs honoured (MXCSR.DAZ clear; checked by the caller).
    const __m256 rebias = _mm256_set1_ps(0x1p120f);
    const __m256i nan_mag = set1(0x7Fu << 20);
    for (; i + 8 <= count; i += 8) {
      const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
      const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(c, 24), set1(0x80000000u));
      const __m256i mag = _mm256_srli_epi32(_mm256_slli_epi32(c, 25), 5);
      __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(mag, sign)), rebias);
      v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_or_si256(sign, set1(0x7FC00000u))),
                           _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, nan_mag)));
      store8(out + i, mulCanonical(v, s), 8);
    }
  }
  for (; i < count; i += 8) {
    const int n = count - i < 8 ? count - i : 8;
    store8(out + i, mulCanonical(e4m3Values(codes8(q + i, n)), s), n);
  }
}

// kAvx512's fp8 block-128 / MXFP8 decode of a whole row to bf16 (MXCSR.DAZ clear): blocks
// that wideBlockOk and hold no NaN code take e4m3DecodeWide, the others e4m3Decode's AVX2
// path; one call per row, the checks inline (per-block calls cost as much as the products
// for MXFP8's 32-value blocks).
template <class ScaleOf>
CROSSBAR_AVX512 void e4m3DecodeRowWide(const uint8_t* q, size_t hidden, int bs, ScaleOf scaleOf,
                                       BFloat16* out) {
  for (size_t b = 0, i = 0; i < hidden; ++b, i += static_cast<size_t>(bs)) {
    const int count = blockCount(hidden, i, bs);
    const float scale = scaleOf(b);
    if (wideBlockOk(count, scale) && nanFreeCodes(q + i, count))  // (wideBlockOk: scale finite)
      e4m3DecodeWide(q + i, count, scale, out + i);
    else
      e4m3Decode(q + i, count, scale, false, out + i);
  }
}

// `values`: e2m1BitsToFloat of the magnitudes 0..7, picked per lane; the sign goes on as a bit.
template <class T>
CROSSBAR_AVX2 void nvfp4Decode(const uint8_t* packed, int count, float d, __m256 values, T* out) {
  const __m256 vd = _mm256_set1_ps(d);
  uint64_t raw = 0;
  std::memcpy(&raw, packed, static_cast<size_t>(count + 1) / 2);
  const __m128i b = _mm_cvtsi64_si128(static_cast<long long>(raw));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  const __m128i codes = _mm_unpacklo_epi8(lo, hi);  // element order
  for (int half = 0; half * 8 < count; ++half) {
    const __m256i c = _mm256_cvtepu8_epi32(half == 0 ? codes : _mm_srli_si128(codes, 8));
    const __m256 mag = _mm256_permutevar8x32_ps(values, c);  // uses the low 3 bits
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, set1(0x8u)), 28);
    const __m256 v = _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
    const int n = count - half * 8 < 8 ? count - half * 8 : 8;
    store8(out + half * 8, mulCanonical(v, vd), n);
  }
}

// kWide: kAvx512's decode (e4m3DecodeRowWide for bf16 output).
template <bool kWide, class T>
CROSSBAR_AVX2 void decodeRow(PayloadCodec codec, const uint8_t* payload, const void* scales, size_t hidden,
                             T* out, float global_scale) {
  const bool daz = (_mm_getcsr() & 0x40u) != 0;  // MXCSR.DAZ: subnormal operands read as zero
  switch (codec) {
    case PayloadCodec::kFp8Block128: {
      const auto* s = static_cast<const float*>(scales);
      if constexpr (kWide && std::is_same_v<T, BFloat16>)
        if (!daz)
          return e4m3DecodeRowWide(
              payload, hidden, kFp8BlockSize, [s](size_t b) { return s[b]; }, out);
      for (size_t b = 0, i = 0; i < hidden; ++b, i += kFp8BlockSize)
        e4m3Decode(payload + i, blockCount(hidden, i, kFp8BlockSize), s[b], daz, out + i);
      return;
    }
    case PayloadCodec::kMxfp8: {
      const auto* s = static_cast<const uint8_t*>(scales);
      if constexpr (kWide && std::is_same_v<T, BFloat16>)
        if (!daz)
          return e4m3DecodeRowWide(
              payload, hidden, kMxBlockSize, [s](size_t b) { return e8m0BitsToFloat(s[b]); }, out);
      for (size_t b = 0, i = 0; i < hidden; ++b, i += kMxBlockSize)
        e4m3Decode(payload + i, blockCount(hidden, i, kMxBlockSize), e8m0BitsToFloat(s[b]), daz, out + i);
      return;
    }
    case PayloadCodec::kNvfp4: {
      const auto* s = static_cast<const uint8_t*>(scales);
      const __m256 values = _mm256_loadu_ps(tables().e2m1.data());
      for (size_t b = 0, i = 0; i < hidden; ++b, i += kNvfp4BlockSize)
        nvfp4Decode(payload + i / 2, blockCount(hidden, i, kNvfp4BlockSize), nvfp4Divisor(s[b], global_scale),
                    values, out + i);
      return;
    }
    default:
      scalar::decodeRow(codec, payload, scales, hidden, out, global_scale);
  }
}

template <class T>
CROSSBAR_AVX2 BlockAmax tensorAmax(const T* x, size_t n) {
  BlockAmax r;
  for (size_t i = 0; i < n; i += 4096)
    r = mergeAmax(r, amaxOf(x + i, static_cast<int>(n - i < 4096 ? n - i : 4096)));
  return r;
}

template <class T>
CROSSBAR_AVX2 void scaleRow(float* out, const T* y, float w, size_t n) {
  const __m256 vw = _mm256_set1_ps(w);
  size_t c = 0;
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_castsi256_ps(bits8(y + c)), vw));
  scalar::scaleRow(out + c, y + c, w, n - c);
}
template <class T>
CROSSBAR_AVX2 void addRow(float* acc, const T* x, size_t n) {
  size_t c = 0;
  for (; c + 8 <= n; c += 8)
    _mm256_storeu_ps(acc + c, _mm256_add_ps(_mm256_loadu_ps(acc + c), _mm256_castsi256_ps(bits8(x + c))));
  scalar::addRow(acc + c, x + c, n - c);
}
CROSSBAR_AVX2 void roundRow(BFloat16* out, const float* x, size_t n) {
  size_t c = 0;
  for (; c + 8 <= n; c += 8) store8(out + c, _mm256_loadu_ps(x + c), 8);
  scalar::roundRow(out + c, x + c, n - c);
}

#undef CROSSBAR_AVX512
#undef CROSSBAR_AVX2
}  // namespace avx2
#endif  // CROSSBAR_HOST_CODEC_HAVE_AVX2

HostCodecIsa selectIsa() {
  const std::string want = env::getEnum("CROSSBAR_MOE_HOST_CODEC");
  if (want == "scalar") return HostCodecIsa::kScalar;
  const bool avx2 = hostCodecIsaSupported(HostCodecIsa::kAvx2);
  if (want == "avx2" && !avx2)
    throw InvalidArgument(
        "moe host codec: CROSSBAR_MOE_HOST_CODEC=avx2 but this CPU (or build) has no AVX2; unset it or use "
        "'scalar'");
  if (want == "avx2") return HostCodecIsa::kAvx2;  // AVX2 only: no AVX-512 paths (for comparison)
  if (want == "avx512" && !hostCodecIsaSupported(HostCodecIsa::kAvx512))
    throw InvalidArgument(
        "moe host codec: CROSSBAR_MOE_HOST_CODEC=avx512 but this CPU (or build) lacks AVX-512 F/BW/VL/BF16; "
        "unset it or use 'avx2' or 'scalar'");
  if (hostCodecIsaSupported(HostCodecIsa::kAvx512)) return HostCodecIsa::kAvx512;
  return avx2 ? HostCodecIsa::kAvx2 : HostCodecIsa::kScalar;
}

void requireSupported(HostCodecIsa isa) {
  if (!hostCodecIsaSupported(isa))
    throw InvalidArgument(std::string("moe host codec: ") + hostCodecIsaName(isa) +
                          " requested but this CPU (or build) does not support it");
}

}  // namespace

const char* hostCodecIsaName(HostCodecIsa isa) {
  switch (isa) {
    case HostCodecIsa::kAvx2:
      return "avx2";
    case HostCodecIsa::kAvx512:
      return "avx512";
    default:
      return "scalar";
  }
}

bool hostCodecIsaSupported(HostCodecIsa isa) {
  if (isa == HostCodecIsa::kScalar) return true;
#if defined(CROSSBAR_HOST_CODEC_HAVE_AVX2)
  if (isa == HostCodecIsa::kAvx2) return __builtin_cpu_supports("avx2");
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

HostCodecIsa hostCodecIsa() {
  static const HostCodecIsa isa = selectIsa();
  return isa;
}

#if defined(CROSSBAR_HOST_CODEC_HAVE_AVX2)
// The AVX2 kernels serve the AVX-512 level too: it adds only its own row decode (an
// AVX-512 encode was not faster on Zen 4; docs/moe.md).
constexpr bool usesAvx2Kernels(HostCodecIsa isa) {
  return isa == HostCodecIsa::kAvx2 || isa == HostCodecIsa::kAvx512;
}
#endif

template <class T>
void encodeRowHost(HostCodecIsa isa, PayloadCodec codec, const T* x, size_t hidden, uint8_t* payload,
                   void* scales, float global_scale) {
#if defined(CROSSBAR_HOST_CODEC_HAVE_AVX2)
  if (usesAvx2Kernels(isa)) {
    requireSupported(isa);
    return avx2::encodeRow(codec, x, hidden, payload, scales, global_scale);
  }
#endif
  requireSupported(isa);
  scalar::encodeRow(codec, x, hidden, payload, scales, global_scale);
}

template <class T>
void encodeRowHost(PayloadCodec codec, const T* x, size_t hidden, uint8_t* payload, void* scales,
                   float global_scale) {
  encodeRowHost(hostCodecIsa(), codec, x, hidden, payload, scales, global_scale);
}

template <class T>
void decodeRowHost(HostCodecIsa isa, PayloadCodec codec, const uint8_t* payload, const void* scales,
                   size_t hidden, T* out, float global_scale) {
#if defined(CROSSBAR_HOST_CODEC_HAVE_AVX2)
  if (isa == HostCodecIsa::kAvx2) {
    requireSupported(isa);
    return avx2::decodeRow<false>(codec, payload, scales, hidden, out, global_scale);
  }
  if (isa == HostCodecIsa::kAvx512) {
    requireSupported(isa);
    return avx2::decodeRow<true>(codec, payload, scales, hidden, out, global_scale);
  }
#endif
  requireSupported(isa);
  scalar::decodeRow(codec, payload, scales, hidden, out, global_scale);
}

template <class T>
void decodeRowHost(PayloadCodec codec, const uint8_t* payload, const void* scales, size_t hidden, T* out,
                   float global_scale) {
  decodeRowHost(hostCodecIsa(), codec, payload, scales, hidden, out, global_scale);
}

template <class T>
BlockAmax tensorAmaxHost(HostCodecIsa isa, const T* x, size_t n) {
#if defined(CROSSBAR_HOST_CODEC_HAVE_AVX2)
  if (usesAvx2Kernels(isa)) {
    requireSupported(isa);
    return avx2::tensorAmax(x, n);
  }
#endif
  requireSupported(isa);
  return scalar::tensorAmax(x, n);
}

template <class T>
BlockAmax tensorAmaxHost(const T* x, size_t n) {
  return tensorAmaxHost(hostCodecIsa(), x, n);
}

template <class T>
void scaleRowHost(HostCodecIsa isa, float* out, const T* y, float w, size_t n) {
  requireSupported(isa);
#if defined(CROSSBAR_HOST_CODEC_HAVE_AVX2)
  if (usesAvx2Kernels(isa)) return avx2::scaleRow(out, y, w, n);
#endif
  scalar::scaleRow(out, y, w, n);
}
template <class T>
void scaleRowHost(float* out, const T* y, float w, size_t n) {
  scaleRowHost(hostCodecIsa(), out, y, w, n);
}

template <class T>
void addRowHost(HostCodecIsa isa, float* acc, const T* x, size_t n) {
  requireSupported(isa);
#if defined(CROSSBAR_HOST_CODEC_HAVE_AVX2)
  if (usesAvx2Kernels(isa)) return avx2::addRow(acc, x, n);
#endif
  scalar::addRow(acc, x, n);
}
template <class T>
void addRowHost(float* acc, const T* x, size_t n) {
  addRowHost(hostCodecIsa(), acc, x, n);
}

void roundRowHost(HostCodecIsa isa, BFloat16* out, const float* x, size_t n) {
  requireSupported(isa);
#if defined(CROSSBAR_HOST_CODEC_HAVE_AVX2)
  if (usesAvx2Kernels(isa)) return avx2::roundRow(out, x, n);
#endif
  scalar::roundRow(out, x, n);
}
void roundRowHost(BFloat16* out, const float* x, size_t n) {
  roundRowHost(hostCodecIsa(), out, x, n);
}

#define CROSSBAR_HOST_CODEC_INSTANTIATE(T)                                                              \
  template void encodeRowHost<T>(PayloadCodec, const T*, size_t, uint8_t*, void*, float);               \
  template void encodeRowHost<T>(HostCodecIsa, PayloadCodec, const T*, size_t, uint8_t*, void*, float); \
  template void decodeRowHost<T>(PayloadCodec, const uint8_t*, const void*, size_t, T*, float);         \
  template void decodeRowHost<T>(HostCodecIsa, PayloadCodec, const uint8_t*, const void*, size_t, T*,   \
                                 float);                                                                \
  template BlockAmax tensorAmaxHost<T>(const T*, size_t);                                               \
  template BlockAmax tensorAmaxHost<T>(HostCodecIsa, const T*, size_t);                                 \
  template void scaleRowHost<T>(float*, const T*, float, size_t);                                       \
  template void scaleRowHost<T>(HostCodecIsa, float*, const T*, float, size_t);                         \
  template void addRowHost<T>(float*, const T*, size_t);                                                \
  template void addRowHost<T>(HostCodecIsa, float*, const T*, size_t);
CROSSBAR_HOST_CODEC_INSTANTIATE(float)
CROSSBAR_HOST_CODEC_INSTANTIATE(BFloat16)
#undef CROSSBAR_HOST_CODEC_INSTANTIATE

}  // namespace crossbar::moe
