// MoE payload codecs: hand-checked blocks, per-element error bounds on random data,
// non-finite poisoning, layouts and the bf16 input/output paths.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "collectives/quant.h"

namespace crossbar {
namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// Random activations: normal values whose magnitude changes per block by up to 10^+-4,
// (default; NVFP4 gets 10^+-2, its range with one per-tensor scale), with occasional outliers and exact
// zeros, so scales span many binades. The hidden size is DeepSeek-V3's 7168 plus a partial tail block.
std::vector<float> randomRow(size_t hidden, uint32_t seed, float decades = 4.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> expo(-decades, decades);
  std::vector<float> x(hidden);
  float mag = 1.0f;
  for (size_t i = 0; i < hidden; ++i) {
    if (i % 16 == 0) mag = std::pow(10.0f, expo(rng));
    float v = normal(rng) * mag;
    if (rng() % 97 == 0) v *= 30.0f;
    if (rng() % 53 == 0) v = 0.0f;
    x[i] = v;
  }
  return x;
}

constexpr size_t kHidden = 7168 + 40;

TEST(Quant, Layouts) {
  EXPECT_EQ(payloadBytes(PayloadCodec::kFp8Block128, 7168), 7168u);
  EXPECT_EQ(scaleBytes(PayloadCodec::kFp8Block128, 7168), 56u * 4);
  EXPECT_EQ(payloadBytes(PayloadCodec::kMxfp8, 7168), 7168u);
  EXPECT_EQ(scaleBytes(PayloadCodec::kMxfp8, 7168), 224u);
  EXPECT_EQ(payloadBytes(PayloadCodec::kNvfp4, 7168), 3584u);
  EXPECT_EQ(scaleBytes(PayloadCodec::kNvfp4, 7168), 448u);
  EXPECT_EQ(payloadBytes(PayloadCodec::kBFloat16, 7168), 14336u);
  EXPECT_EQ(scaleBytes(PayloadCodec::kBFloat16, 7168), 0u);
  // Partial tail blocks round up; odd fp4 counts take a whole byte.
  EXPECT_EQ(scaleBytes(PayloadCodec::kFp8Block128, 129), 8u);
  EXPECT_EQ(scaleBytes(PayloadCodec::kMxfp8, 33), 2u);
  EXPECT_EQ(payloadBytes(PayloadCodec::kNvfp4, 17), 9u);
  EXPECT_EQ(scaleBytes(PayloadCodec::kNvfp4, 17), 2u);
}

// ---- fp8 block-128 ---------------------------------------------------------------------------

TEST(Quant, Fp8BlockHandChecked) {
  // amax 448 -> scale exactly 1, so codes are plain E4M3 conversions.
  std::vector<float> x(128, 0.0f);
  x[0] = 448.0f;
  x[1] = -1.0f;
  x[2] = 1.0625f;  // tie -> 1.0 (0x38)
  x[3] = 0.001953125f;
  std::vector<uint8_t> q(128);
  float scale = fp8BlockQuantize(x.data(), 128, q.data());
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[1], 0xB8);
  EXPECT_EQ(q[2], 0x38);
  EXPECT_EQ(q[3], 0x01);
  EXPECT_EQ(q[4], 0x00);
  // amax 896 -> scale 2: 896 -> 448 (0x7E); 3 -> 1.5 (0x3C).
  x[0] = 896.0f;
  x[1] = 3.0f;
  scale = fp8BlockQuantize(x.data(), 128, q.data());
  EXPECT_EQ(scale, 2.0f);
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[1], 0x3C);
  EXPECT_EQ(fp8BlockDecode(q[1], scale), 3.0f);
  // All zero: scale 1 (documented), codes zero, dequant zero.
  std::vector<float> z(128, 0.0f);
  EXPECT_EQ(fp8BlockQuantize(z.data(), 128, q.data()), 1.0f);
  for (uint8_t c : q) EXPECT_EQ(c, 0);
  // Tiny amax: the scale stays a binary32 normal.
  z[5] = 1e-40f;
  EXPECT_EQ(fp8BlockQuantize(z.data(), 128, q.data()), kFloatMinNormal);
}

// Elements are multiplied by 448 / amax (DeepGEMM / DeepEP), not divided by amax / 448; the
// two differ next to an E4M3 midpoint. amax 5, x = 0x3AF00001 = 15728641 * 2^-33:
//   factor = RN(448 / 5) = 11744051 * 2^-17 = 0x42B33333 (448 / 5 * 2^17 = 11744051.2);
//   x * factor = 15728641 * 11744051 * 2^-50 = 184717962064691 * 2^-50 exactly, which is
//   8598323 * 2^-50 above the midpoint 0.1640625 = 21 * 2^-7 = 184717953466368 * 2^-50
//   between 0.15625 (0x22) and 0.171875 (0x23); binary32's ulp there is 2^-26 = 16777216 *
//   2^-50, so 0.51 ulp above rounds to 0x3E280001, above the midpoint: code 0x23.
//   The division this replaced: scale = RN(5 / 448) = 11983726 * 2^-30 = 0x3C36DB6E, and
//   x / scale = 15728641 / (8 * 11983726) = 11010048.4375 * 2^-26, 0.44 ulp above the
//   midpoint (11010048 * 2^-26), rounds to the midpoint itself, which ties to even: 0x22.
TEST(Quant, Fp8BlockMultipliesByTheInverseScale) {
  std::vector<float> x(128, 0.0f);
  x[0] = 5.0f;
  x[1] = bitsFloat(0x3AF00001u);
  x[2] = -bitsFloat(0x3AF00001u);
  EXPECT_EQ(floatBits(fp8BlockFactor(BlockAmax{5.0f, false})), 0x42B33333u);
  EXPECT_EQ(floatBits(x[1] * fp8BlockFactor(BlockAmax{5.0f, false})), 0x3E280001u);
  std::vector<uint8_t> q(128);
  const float scale = fp8BlockQuantize(x.data(), 128, q.data());
  EXPECT_EQ(floatBits(scale), 0x3C36DB6Eu);
  EXPECT_EQ(floatBits(x[1] / scale), 0x3E280000u);  // the old encoder's operand: the midpoint
  EXPECT_EQ(q[0], 0x7E);                            // 5 * factor = 448 (rounded) -> 448
  EXPECT_EQ(q[1], 0x23);
  EXPECT_EQ(q[2], 0xA3);
  // A poisoned block's codes are all 0x7F, negative and NaN inputs included.
  x[3] = -std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(fp8BlockQuantize(x.data(), 128, q.data())));
  for (uint8_t c : q) EXPECT_EQ(c, 0x7F);
}

// |x - dq| <= half an E4M3 ulp of x/s (2^-4 relative in the normal range, 2^-10 absolute
// in the subnormal range) times s, plus any saturation past 448 s, plus a few binary32
// roundings of the scale arithmetic.
double e4m3Bound(double x, double s) {
  double ax = std::fabs(x);
  double sat = std::max(0.0, ax - 448.0 * s);
  return (ax * 0x1p-4 + s * 0x1p-10 + sat) * (1 + 1e-6) + 1e-45;
}

TEST(Quant, Fp8BlockErrorBound) {
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    auto x = randomRow(kHidden, seed);
    std::vector<uint8_t> payload(payloadBytes(PayloadCodec::kFp8Block128, kHidden));
    std::vector<float> scales(numBlocks(PayloadCodec::kFp8Block128, kHidden));
    quantizeRowFp8Block(x.data(), kHidden, payload.data(), scales.data());
    std::vector<float> dq(kHidden);
    dequantizeRowFp8Block(payload.data(), scales.data(), kHidden, dq.data());
    for (size_t i = 0; i < kHidden; ++i) {
      double s = scales[i / kFp8BlockSize];
      ASSERT_LE(std::fabs(x[i] - dq[i]), e4m3Bound(x[i], s)) << "i=" << i;
    }
    // Per block: the largest element keeps 2^-4 relative accuracy (no saturation, since
    // amax / scale is 448 up to a binary32 rounding).
    for (size_t b = 0; b < scales.size(); ++b) {
      float amax = 0, err = 0;
      for (size_t i = b * 128; i < std::min(kHidden, (b + 1) * 128); ++i) {
        amax = std::max(amax, std::fabs(x[i]));
        err = std::max(err, std::fabs(x[i] - dq[i]));
      }
      EXPECT_LE(err, amax * 0x1p-4 * (1 + 1e-6)) << "block " << b;
    }
  }
}

// ---- MXFP8 -------------------------------------------------------------------------------------

TEST(Quant, Mxfp8HandChecked) {
  std::vector<float> x(32, 0.0f);
  // amax 1.0: floor(log2 1) - 8 = -8 -> code 119, X = 2^-8; 1.0 / X = 256 -> 0x78.
  x[0] = 1.0f;
  x[1] = -0.5f;     // 128 -> 0xF0 (sign | exp 14 << 3)
  x[2] = 0x1p-17f;  // 2^-9 after scaling: smallest subnormal 0x01
  std::vector<uint8_t> q(32);
  uint8_t s = mxfp8Quantize(x.data(), 32, q.data());
  EXPECT_EQ(s, 119);
  EXPECT_EQ(e8m0BitsToFloat(s), 0x1p-8f);
  EXPECT_EQ(q[0], 0x78);
  EXPECT_EQ(q[1], 0xF0);
  EXPECT_EQ(q[2], 0x01);
  EXPECT_EQ(mxfp8Decode(q[1], s), -0.5f);
  // amax 500: floor(log2 500) = 8 -> X = 1; 500 saturates to 448 as the spec clamps.
  x[0] = 500.0f;
  s = mxfp8Quantize(x.data(), 32, q.data());
  EXPECT_EQ(s, 127);
  EXPECT_EQ(q[0], 0x7E);
  // amax 511.9 (just under 2^9) still X = 1; amax 512 -> X = 2.
  x[0] = 512.0f;
  EXPECT_EQ(mxfp8Quantize(x.data(), 32, q.data()), 128);
  // All zero: smallest scale (log2 0 = -inf clamps), zero codes.
  std::vector<float> z(32, 0.0f);
  EXPECT_EQ(mxfp8Quantize(z.data(), 32, q.data()), 0);
  for (uint8_t c : q) EXPECT_EQ(c, 0);
  // Subnormal binary32 amax: floor(log2 2^-140) - 8 clamps to 2^-127.
  z[0] = 0x1p-140f;
  EXPECT_EQ(floorLog2(0x1p-140f), -140);
  EXPECT_EQ(floorLog2(0x1p-149f), -149);
  EXPECT_EQ(floorLog2(0x1.8p-148f), -148);
  EXPECT_EQ(mxfp8Quantize(z.data(), 32, q.data()), 0);
  // Largest binary32: floor(log2) = 127 -> code 246, elements fit.
  z[0] = std::numeric_limits<float>::max();
  EXPECT_EQ(mxfp8Quantize(z.data(), 32, q.data()), 246);
  EXPECT_EQ(q[0], 0x7E);  // 1.99.. * 2^8 saturates
}

TEST(Quant, Mxfp8ErrorBound) {
  for (uint32_t seed = 11; seed <= 15; ++seed) {
    auto x = randomRow(kHidden, seed);
    std::vector<uint8_t> payload(kHidden), scales(numBlocks(PayloadCodec::kMxfp8, kHidden));
    quantizeRowMxfp8(x.data(), kHidden, payload.data(), scales.data());
    std::vector<float> dq(kHidden);
    dequantizeRowMxfp8(payload.data(), scales.data(), kHidden, dq.data());
    for (size_t i = 0; i < kHidden; ++i) {
      double X = e8m0BitsToFloat(scales[i / kMxBlockSize]);
      ASSERT_LE(std::fabs(x[i] - dq[i]), e4m3Bound(x[i], X)) << "i=" << i;
    }
    // Per block: amax / X lies in [256, 512), so the worst relative error of the largest
    // element is the saturation (512 - 448) / 512 = 1/8.
    for (size_t b = 0; b < scales.size(); ++b) {
      float amax = 0, err = 0;
      for (size_t i = b * 32; i < std::min(kHidden, (b + 1) * 32); ++i) {
        amax = std::max(amax, std::fabs(x[i]));
        err = std::max(err, std::fabs(x[i] - dq[i]));
      }
      EXPECT_LE(err, amax * 0.125f) << "block " << b;
    }
  }
}

// ---- NVFP4 -------------------------------------------------------------------------------------

TEST(Quant, Nvfp4HandChecked) {
  // Tensor amax 2688 = 448 * 6 -> global scale 1.
  EXPECT_EQ(nvfp4GlobalScale(BlockAmax{2688.0f, false}), 1.0f);
  EXPECT_EQ(nvfp4GlobalScale(BlockAmax{0.0f, false}), 1.0f);
  EXPECT_TRUE(std::isnan(nvfp4GlobalScale(BlockAmax{1.0f, true})));
  // Block amax 6: block scale e4m3(6 / 6) = 1.0 (0x38), divisor 1.
  float x[16] = {6.0f, -3.0f, 0.75f, 0.25f, 5.0f, -0.0f, 1.75f, 100.0f};
  x[7] = 6.0f;
  uint8_t packed[8];
  uint8_t s = nvfp4Quantize(x, 16, 1.0f, packed);
  EXPECT_EQ(s, 0x38);
  // Low nibble first: [6 -> 0x7, -3 -> 0xD] = 0xD7; [0.75 -> 1.0 (2, tie to even),
  // 0.25 -> 0 (tie)] = 0x02; [5 -> 4.0 (6), -0 -> 0x8] = 0x86; [1.75 -> 2.0 (4), 6 -> 7] = 0x74.
  EXPECT_EQ(packed[0], 0xD7);
  EXPECT_EQ(packed[1], 0x02);
  EXPECT_EQ(packed[2], 0x86);
  EXPECT_EQ(packed[3], 0x74);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(packed[i], 0);
  float out[16];
  nvfp4Dequantize(packed, 16, s, 1.0f, out);
  EXPECT_EQ(out[0], 6.0f);
  EXPECT_EQ(out[1], -3.0f);
  EXPECT_EQ(out[2], 1.0f);
  EXPECT_EQ(out[4], 4.0f);
  EXPECT_TRUE(std::signbit(out[5]));
  // Block amax 3 with global 1: block scale e4m3(0.5) = 0x30, divisor 0.5: 3 -> 6.
  float y[3] = {3.0f, 1.0f, -0.25f};
  uint8_t p2[2];
  s = nvfp4Quantize(y, 3, 1.0f, p2);
  EXPECT_EQ(s, 0x30);
  EXPECT_EQ(p2[0], 0x47);  // 3 / 0.5 = 6 -> code 7 (low); 1 / 0.5 = 2 -> code 4 (high)
  EXPECT_EQ(p2[1], 0x09);  // -0.25/0.5 = -0.5 -> 0x9; odd tail: high nibble 0
}

TEST(Quant, Nvfp4ErrorBound) {
  for (uint32_t seed = 21; seed <= 25; ++seed) {
    auto x = randomRow(kHidden, seed, 2.0f);
    BlockAmax tensor = blockAmax(x.data(), static_cast<int>(kHidden));
    float g = nvfp4GlobalScale(tensor);
    std::vector<uint8_t> payload(payloadBytes(PayloadCodec::kNvfp4, kHidden));
    std::vector<uint8_t> scales(numBlocks(PayloadCodec::kNvfp4, kHidden));
    quantizeRowNvfp4(x.data(), kHidden, g, payload.data(), scales.data());
    std::vector<float> dq(kHidden);
    dequantizeRowNvfp4(payload.data(), scales.data(), g, kHidden, dq.data());
    size_t underflowed = 0;
    for (size_t b = 0; b < scales.size(); ++b) {
      double d = nvfp4Divisor(scales[b], g);
      float amax = 0;
      for (size_t i = b * 16; i < std::min(kHidden, (b + 1) * 16); ++i)
        amax = std::max(amax, std::fabs(x[i]));
      for (size_t i = b * 16; i < std::min(kHidden, (b + 1) * 16); ++i) {
        double err = std::fabs(x[i] - dq[i]);
        if (d == 0) {
          // The block scale underflowed E4M3 (amax / (6 g) < 2^-10): everything is 0.
          ++underflowed;
          ASSERT_LE(amax, 6.0 * g * 0x1p-9) << "i=" << i;
          ASSERT_EQ(dq[i], 0.0f);
          continue;
        }
        // E2M1 rounding error of y = x/d is <= 0.25 max(|y|, 1) (half a step: 0.25 below 2,
        // 0.5 in [2, 4), 1 in [4, 6]), plus saturation past 6 (the E4M3 block scale can
        // round down by up to 2^-4, so |y| may reach ~6.4).
        double y = std::fabs(x[i]) / d;
        double bound = d * (0.25 * std::max(y, 1.0) + std::max(0.0, y - 6.0)) * (1 + 1e-6);
        ASSERT_LE(err, bound) << "i=" << i << " x=" << x[i] << " dq=" << dq[i];
      }
      if (scales[b] >= 0x08) {
        // With a normal E4M3 block scale s = t (1 + e), |e| <= 2^-4, t = amax / (6 g), the
        // largest element lands at y = 6 / (1 + e) <= 6.4: saturation stays bounded.
        EXPECT_LE(amax / d, 6.4 * (1 + 1e-6)) << "block " << b;
      }
    }
    EXPECT_LT(underflowed, kHidden / 4);  // most blocks are representable
  }
}

// ---- non-finite inputs poison their block only -----------------------------------------------

TEST(Quant, NonFinitePoisonsItsBlockOnly) {
  for (float bad : {kNaN, kInf, -kInf}) {
    std::vector<float> x(256, 1.5f);
    x[40] = bad;  // block 0 for fp8 (128), block 1 for mxfp8 (32), block 2 for nvfp4 (16)
    std::vector<float> dq(256);
    {
      std::vector<uint8_t> p(256);
      std::vector<float> s(2);
      quantizeRowFp8Block(x.data(), 256, p.data(), s.data());
      EXPECT_TRUE(std::isnan(s[0]));
      dequantizeRowFp8Block(p.data(), s.data(), 256, dq.data());
      for (size_t i = 0; i < 128; ++i) EXPECT_TRUE(std::isnan(dq[i]));
      for (size_t i = 128; i < 256; ++i) EXPECT_EQ(dq[i], 1.5f);
    }
    {
      std::vector<uint8_t> p(256), s(8);
      quantizeRowMxfp8(x.data(), 256, p.data(), s.data());
      EXPECT_EQ(s[1], 0xFF);
      for (size_t i = 32; i < 64; ++i) EXPECT_EQ(p[i], 0x7F);
      dequantizeRowMxfp8(p.data(), s.data(), 256, dq.data());
      for (size_t i = 0; i < 256; ++i) EXPECT_EQ(std::isnan(dq[i]), i >= 32 && i < 64) << i;
      for (size_t i = 0; i < 32; ++i) EXPECT_EQ(dq[i], 1.5f);
    }
    {
      BlockAmax t = blockAmax(x.data(), 256);
      EXPECT_TRUE(t.nonFinite);
      EXPECT_EQ(t.amax, 1.5f);
      // The per-tensor scale comes from finite values only if the caller wants the other
      // blocks to survive; with the raw tensor amax, everything is NaN.
      EXPECT_TRUE(std::isnan(nvfp4GlobalScale(t)));
      float g = nvfp4GlobalScale(BlockAmax{t.amax, false});
      std::vector<uint8_t> p(128), s(16);
      quantizeRowNvfp4(x.data(), 256, g, p.data(), s.data());
      EXPECT_EQ(s[2], 0x7F);
      dequantizeRowNvfp4(p.data(), s.data(), g, 256, dq.data());
      for (size_t i = 0; i < 256; ++i) EXPECT_EQ(std::isnan(dq[i]), i >= 32 && i < 48) << i;
      for (size_t i = 0; i < 32; ++i) EXPECT_EQ(dq[i], 1.5f);
      quantizeRowNvfp4(x.data(), 256, nvfp4GlobalScale(t), p.data(), s.data());
      dequantizeRowNvfp4(p.data(), s.data(), nvfp4GlobalScale(t), 256, dq.data());
      for (size_t i = 0; i < 256; ++i) EXPECT_TRUE(std::isnan(dq[i]));
    }
  }
}

// ---- bf16 in/out and the run-time codec entry points -----------------------------------------

TEST(Quant, BFloat16InputAndOutput) {
  auto xf = randomRow(kHidden, 99);
  std::vector<BFloat16> xb(kHidden);
  for (size_t i = 0; i < kHidden; ++i) {
    xb[i] = BFloat16::fromFloat(xf[i]);
    xf[i] = xb[i].toFloat();  // same values in both inputs
  }
  float g = nvfp4GlobalScale(blockAmax(xf.data(), static_cast<int>(kHidden)));
  for (PayloadCodec c :
       {PayloadCodec::kBFloat16, PayloadCodec::kFp8Block128, PayloadCodec::kMxfp8, PayloadCodec::kNvfp4}) {
    SCOPED_TRACE(payloadCodecName(c));
    std::vector<uint8_t> pf(payloadBytes(c, kHidden)), pb(payloadBytes(c, kHidden));
    std::vector<float> sf((scaleBytes(c, kHidden) + 3) / 4 + 1), sb(sf.size());
    quantizeRow(c, xf.data(), kHidden, pf.data(), sf.data(), g);
    quantizeRow(c, xb.data(), kHidden, pb.data(), sb.data(), g);
    EXPECT_EQ(pf, pb);
    EXPECT_EQ(0, std::memcmp(sf.data(), sb.data(), scaleBytes(c, kHidden)));
    std::vector<float> of(kHidden);
    std::vector<BFloat16> ob(kHidden);
    dequantizeRow(c, pf.data(), sf.data(), kHidden, of.data(), g);
    dequantizeRow(c, pf.data(), sf.data(), kHidden, ob.data(), g);
    for (size_t i = 0; i < kHidden; ++i) ASSERT_EQ(ob[i].bits, BFloat16::fromFloat(of[i]).bits) << i;
    if (c == PayloadCodec::kBFloat16) {
      for (size_t i = 0; i < kHidden; ++i) ASSERT_EQ(of[i], xf[i]);  // lossless for bf16 data
    }
  }
  // The run-time entry point writes exactly what the per-codec one does.
  std::vector<uint8_t> p1(kHidden), p2(kHidden), s1(kHidden / 32 + 1), s2(s1.size());
  quantizeRow(PayloadCodec::kMxfp8, xf.data(), kHidden, p1.data(), s1.data());
  quantizeRowMxfp8(xf.data(), kHidden, p2.data(), s2.data());
  EXPECT_EQ(p1, p2);
  EXPECT_EQ(s1, s2);
}

}  // namespace
}  // namespace crossbar
