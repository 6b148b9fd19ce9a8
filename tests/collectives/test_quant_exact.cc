// The fast host codecs of collectives/float_types.h and collectives/quant.h must give the
// same bits as the original scalar code (frozen in quant_reference.h): the CUDA kernels
// run the same functions and the wire format must not change. Exhaustive over every
// bf16 / half pattern and every 8-bit code, plus rounding ties, subnormals, NaN/Inf and
// random binary32; then whole rows of every codec (payload, scales and dequantized output).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "collectives/quant.h"
#include "quant_reference.h"

namespace {

using namespace crossbar;
namespace ref = crossbar::quant_ref;

// Every encoder in every mode against the oracle for one binary32 input.
void expectEncodersMatch(uint32_t bits) {
  float f = bitsFloat(bits);
  for (Saturate s : {Saturate::kNo, Saturate::kFinite}) {
    ASSERT_EQ(floatToE4M3Bits(f, s), ref::floatToE4M3Bits(f, s)) << std::hex << "e4m3 0x" << bits;
    ASSERT_EQ(floatToE5M2Bits(f, s), ref::floatToE5M2Bits(f, s)) << std::hex << "e5m2 0x" << bits;
    ASSERT_EQ(floatToHalfBits(f, s), ref::floatToHalfBits(f, s)) << std::hex << "half 0x" << bits;
    ASSERT_EQ(floatToBFloat16Bits(f, s), ref::floatToBFloat16Bits(f, s)) << std::hex << "bf16 0x" << bits;
    for (ScaleRounding r : {ScaleRounding::kDown, ScaleRounding::kUp})
      ASSERT_EQ(floatToE8M0Bits(f, r, s), ref::floatToE8M0Bits(f, r, s)) << std::hex << "e8m0 0x" << bits;
  }
  ASSERT_EQ(floatToE2M1Bits(f), ref::floatToE2M1Bits(f)) << std::hex << "e2m1 0x" << bits;
}

TEST(QuantExact, EncodersOnEveryBFloat16TimesTieAndEdgeLowHalves) {
  // Low halves around the rounding points of every format: fp8/e2m1 ties sit in the high
  // half (covered by enumerating it), half's at bit 12, bf16's at bit 15.
  const uint32_t lows[] = {0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x7FFF, 0x8000, 0x8001, 0xFFFF};
  for (uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (uint32_t lo : lows) expectEncodersMatch(hi << 16 | lo);
}

TEST(QuantExact, EncodersOnRandomBinary32) {
  std::mt19937 rng(12345);
  for (int i = 0; i < 2000000; ++i) expectEncodersMatch(static_cast<uint32_t>(rng()));
}

// The rounding cores against the oracle on every finite binary32 magnitude, for each
// format's (mantissa bits, emin); the encoders around them only add sign, NaN/Inf and
// overflow handling, unchanged and covered above. About a minute of CPU; run by hand:
// test_quant_exact --gtest_also_run_disabled_tests --gtest_filter='*EveryBinary32*'
TEST(QuantExact, DISABLED_RoundingOnEveryBinary32Magnitude) {
  const struct { int m, emin; } formats[] = {{3, -6}, {2, -14}, {10, -14}, {1, 0}};
  for (auto f : formats) {
    uint64_t mismatches = 0;
    for (uint32_t a = 0; a < 0x7F800000u; ++a) {
      uint32_t want = ref::fpdetail::roundMagnitude(a, f.m, f.emin);
      mismatches += fpdetail::roundMagnitude(a, f.m, f.emin) != want;
      mismatches += fpdetail::roundMagnitudeBranchFree(a, f.m, f.emin) != want;
    }
    EXPECT_EQ(mismatches, 0u) << "m " << f.m << " emin " << f.emin;
  }
}

void expectSameFloatBits(float a, float b, const char* what, uint32_t code) {
  ASSERT_EQ(floatBits(a), floatBits(b)) << what << " code 0x" << std::hex << code;
}

TEST(QuantExact, DecodersOnEveryCode) {
  for (uint32_t c = 0; c < 0x10000u; ++c) {
    auto h = static_cast<uint16_t>(c);
    expectSameFloatBits(halfBitsToFloat(h), ref::halfBitsToFloat(h), "half", c);
    expectSameFloatBits(bfloat16BitsToFloat(h), ref::bfloat16BitsToFloat(h), "bf16", c);
  }
  for (uint32_t c = 0; c < 0x100u; ++c) {
    auto v = static_cast<uint8_t>(c);
    expectSameFloatBits(e4m3BitsToFloat(v), ref::e4m3BitsToFloat(v), "e4m3", c);
    expectSameFloatBits(e5m2BitsToFloat(v), ref::e5m2BitsToFloat(v), "e5m2", c);
    expectSameFloatBits(e8m0BitsToFloat(v), ref::e8m0BitsToFloat(v), "e8m0", c);
  }
  for (uint32_t c = 0; c < 0x10u; ++c)
    expectSameFloatBits(e2m1BitsToFloat(static_cast<uint8_t>(c)),
                        ref::e2m1BitsToFloat(static_cast<uint8_t>(c)), "e2m1", c);
}

// Values that stress the block codecs: normals of many magnitudes, binary32 subnormals,
// zeros of both signs, exact fp8 / fp4 midpoints under power-of-two scales, and (when
// asked) NaN / Inf poisoning some blocks.
std::vector<float> stressRow(std::mt19937& rng, size_t n, bool nonFinite) {
  std::uniform_int_distribution<int> kind(0, 9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) {
    switch (kind(rng)) {
      case 0:
        v = bitsFloat(static_cast<uint32_t>(rng()) & 0x807FFFFFu);  // subnormal or zero
        break;
      case 1:  // odd multiples of 1/16 times 2^k: e4m3 / e2m1 rounding ties after scaling
        v = static_cast<float>(2 * static_cast<int>(rng() % 64) + 1) / 16.0f *
            bitsFloat(static_cast<uint32_t>(110 + rng() % 30) << 23);
        break;
      case 2:
        v = bitsFloat(static_cast<uint32_t>(rng()) & 0xBFFFFFFFu);  // any finite-ish magnitude
        if (!isFiniteFloat(v)) v = 0.0f;
        break;
      case 3:
        v = (rng() & 1) ? -0.0f : 0.0f;
        break;
      case 4:
        v = nonFinite && rng() % 16 == 0 ? bitsFloat((rng() & 1) ? 0x7F800000u : 0xFFC00001u) : nd(rng);
        break;
      default:
        v = nd(rng) * 1000.0f;
    }
  }
  return x;
}

template <class T>
void expectRowsMatch(PayloadCodec c, const std::vector<float>& xf, size_t hidden) {
  std::vector<T> x(xf.size());
  for (size_t i = 0; i < xf.size(); ++i) x[i] = fromFloat<T>(xf[i]);
  const size_t pb = payloadBytes(c, hidden), sb = scaleBytes(c, hidden);
  std::vector<float> s1((sb + 3) / 4 + 1), s2((sb + 3) / 4 + 1);
  std::vector<uint8_t> p1(pb + 1), p2(pb + 1);
  auto* sc1 = reinterpret_cast<uint8_t*>(s1.data());
  auto* sc2 = reinterpret_cast<uint8_t*>(s2.data());
  BlockAmax tensor = blockAmax(x.data(), static_cast<int>(hidden));
  float g = nvfp4GlobalScale(tensor);
  ASSERT_EQ(floatBits(g), floatBits(ref::nvfp4GlobalScale(ref::BlockAmax{tensor.amax, tensor.nonFinite})));
  quantizeRow(c, x.data(), hidden, p1.data(), sc1, g);
  if (c == PayloadCodec::kFp8Block128)
    ref::quantizeRowFp8Block(x.data(), hidden, p2.data(), s2.data());
  else if (c == PayloadCodec::kMxfp8)
    ref::quantizeRowMxfp8(x.data(), hidden, p2.data(), sc2);
  else
    ref::quantizeRowNvfp4(x.data(), hidden, g, p2.data(), sc2);
  for (size_t i = 0; i < pb; ++i) ASSERT_EQ(p1[i], p2[i]) << payloadCodecName(c) << " payload byte " << i;
  for (size_t i = 0; i < sb; ++i) ASSERT_EQ(sc1[i], sc2[i]) << payloadCodecName(c) << " scale byte " << i;
  std::vector<T> o1(hidden), o2(hidden);
  dequantizeRow(c, p1.data(), sc1, hidden, o1.data(), g);
  if (c == PayloadCodec::kFp8Block128)
    ref::dequantizeRowFp8Block(p2.data(), s2.data(), hidden, o2.data());
  else if (c == PayloadCodec::kMxfp8)
    ref::dequantizeRowMxfp8(p2.data(), sc2, hidden, o2.data());
  else
    ref::dequantizeRowNvfp4(p2.data(), sc2, g, hidden, o2.data());
  // Decoded NaNs: the reference keeps whatever NaN the x86 product gave; today's decoders
  // return the one canonical quiet NaN (quant.h canonicalNan, the GPU's bytes too).
  const T canonical = fromFloat<T>(bitsFloat(0x7FC00000u));
  for (size_t i = 0; i < hidden; ++i) {
    if (isNanFloat(toFloat(o2[i]))) {
      ASSERT_EQ(std::memcmp(&o1[i], &canonical, sizeof(T)), 0) << payloadCodecName(c) << " output " << i
                                                                << ": not the canonical NaN";
      continue;
    }
    ASSERT_EQ(std::memcmp(&o1[i], &o2[i], sizeof(T)), 0) << payloadCodecName(c) << " output " << i;
  }
}

TEST(QuantExact, RowsOfEveryCodecMatchReference) {
  std::mt19937 rng(99);
  const PayloadCodec codecs[] = {PayloadCodec::kFp8Block128, PayloadCodec::kMxfp8, PayloadCodec::kNvfp4};
  for (size_t hidden : {1, 7, 16, 31, 32, 33, 127, 128, 129, 1000, 7168}) {
    for (int trial = 0; trial < 8; ++trial) {
      std::vector<float> x = stressRow(rng, hidden, trial % 4 == 3);
      if (trial == 1) x.assign(hidden, 0.0f);  // all-zero blocks
      if (trial == 2)
        for (auto& v : x) v *= 1e-30f;  // tiny blocks: scales clamp to FLT_MIN / E8M0 code 0
      for (PayloadCodec c : codecs) {
        SCOPED_TRACE(testing::Message() << payloadCodecName(c) << " hidden " << hidden << " trial " << trial);
        expectRowsMatch<float>(c, x, hidden);
        expectRowsMatch<BFloat16>(c, x, hidden);
      }
    }
  }
}

}  // namespace
