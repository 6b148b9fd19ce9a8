// Narrow float conversions: hand-checked values, then exhaustive checks of every code
// against a reference built a different way (ldexp decoding, and nearest-value search
// over the sorted table of all finite values for encoding).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "collectives/dtype.h"
#include "collectives/float_types.h"

namespace crossbar {
namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// ---- hand-checked values ---------------------------------------------------------------

TEST(FloatTypes, E4M3HandChecked) {
  // 448 = 1.75 * 2^8: exponent 8+7 = 0b1111, mantissa 0b110 -> 0.1111.110 = 0x7E.
  EXPECT_EQ(floatToE4M3Bits(448.0f), 0x7E);
  EXPECT_EQ(floatToE4M3Bits(-448.0f), 0xFE);
  // 1.0: exponent 7 = 0b0111 -> 0x38. 2^-6 (smallest normal) -> 0x08.
  EXPECT_EQ(floatToE4M3Bits(1.0f), 0x38);
  EXPECT_EQ(floatToE4M3Bits(0.015625f), 0x08);
  // 2^-9 = 0.001953125 is the smallest subnormal (0.0000.001).
  EXPECT_EQ(floatToE4M3Bits(0.001953125f), 0x01);
  EXPECT_EQ(e4m3BitsToFloat(0x01), 0.001953125f);
  // 2^-10 is halfway between 0 and 2^-9: ties to even -> 0; just above -> 0x01.
  EXPECT_EQ(floatToE4M3Bits(0.0009765625f), 0x00);
  EXPECT_EQ(floatToE4M3Bits(std::nextafter(0.0009765625f, 1.0f)), 0x01);
  // 7.5 * 2^-9 sits between the largest subnormal 0x07 (odd) and 2^-6 (0x08, even).
  EXPECT_EQ(floatToE4M3Bits(7.5f * 0.001953125f), 0x08);
  // 1 + 2^-4 is halfway between 1.0 (0x38, even) and 1.125 (0x39): -> 0x38.
  // 1.1875 is halfway between 1.125 (0x39, odd) and 1.25 (0x3A): -> 0x3A.
  EXPECT_EQ(floatToE4M3Bits(1.0625f), 0x38);
  EXPECT_EQ(floatToE4M3Bits(1.1875f), 0x3A);
  // Overflow: 464 is halfway between 448 (mantissa 110, even) and the missing 480, so it
  // rounds to 448; beyond it there is no finite value: NaN, or 448 when saturating.
  EXPECT_EQ(floatToE4M3Bits(464.0f), 0x7E);
  EXPECT_EQ(floatToE4M3Bits(std::nextafter(464.0f, 1000.0f)), 0x7F);
  EXPECT_EQ(floatToE4M3Bits(480.0f), 0x7F);
  EXPECT_EQ(floatToE4M3Bits(480.0f, Saturate::kFinite), 0x7E);
  EXPECT_EQ(floatToE4M3Bits(-1e30f, Saturate::kFinite), 0xFE);
  // No Inf in E4M3: Inf -> NaN, or max when saturating (satfinite).
  EXPECT_EQ(floatToE4M3Bits(kInf), 0x7F);
  EXPECT_EQ(floatToE4M3Bits(kInf, Saturate::kFinite), 0x7E);
  EXPECT_EQ(floatToE4M3Bits(-kInf, Saturate::kFinite), 0xFE);
  // NaN stays NaN even when saturating; both signs of S.1111.111 decode as NaN.
  EXPECT_EQ(floatToE4M3Bits(kNaN), 0x7F);
  EXPECT_EQ(floatToE4M3Bits(kNaN, Saturate::kFinite), 0x7F);
  EXPECT_EQ(floatToE4M3Bits(-kNaN), 0xFF);
  EXPECT_TRUE(std::isnan(e4m3BitsToFloat(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3BitsToFloat(0xFF)));
  // 0x7E is finite (unlike IEEE, the all-ones exponent holds normals): 448.
  EXPECT_EQ(e4m3BitsToFloat(0x78), 256.0f);
  // Signed zero.
  EXPECT_EQ(floatToE4M3Bits(-0.0f), 0x80);
  EXPECT_TRUE(std::signbit(e4m3BitsToFloat(0x80)));
}

TEST(FloatTypes, E5M2HandChecked) {
  // 57344 = 1.75 * 2^15 -> 0.11110.11 = 0x7B; 1.0 -> 0.01111.00 = 0x3C.
  EXPECT_EQ(floatToE5M2Bits(57344.0f), 0x7B);
  EXPECT_EQ(floatToE5M2Bits(1.0f), 0x3C);
  // 61440 is halfway between 57344 (odd mantissa) and 2^16 (Inf, even): IEEE -> Inf.
  EXPECT_EQ(floatToE5M2Bits(61440.0f), 0x7C);
  EXPECT_EQ(floatToE5M2Bits(61439.0f), 0x7B);
  EXPECT_EQ(floatToE5M2Bits(61440.0f, Saturate::kFinite), 0x7B);
  EXPECT_EQ(floatToE5M2Bits(kInf), 0x7C);
  EXPECT_EQ(floatToE5M2Bits(-kInf), 0xFC);
  EXPECT_EQ(floatToE5M2Bits(kInf, Saturate::kFinite), 0x7B);
  EXPECT_EQ(e5m2BitsToFloat(0x7C), kInf);
  EXPECT_EQ(e5m2BitsToFloat(0xFC), -kInf);
  for (uint8_t nan : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) EXPECT_TRUE(std::isnan(e5m2BitsToFloat(nan)));
  EXPECT_EQ(floatToE5M2Bits(kNaN) & 0x7F, 0x7E);
  // Smallest subnormal 2^-16.
  EXPECT_EQ(floatToE5M2Bits(1.52587890625e-05f), 0x01);
  EXPECT_EQ(floatToE5M2Bits(-0.0f), 0x80);
}

TEST(FloatTypes, HalfHandChecked) {
  EXPECT_EQ(floatToHalfBits(1.0f), 0x3C00);
  EXPECT_EQ(floatToHalfBits(65504.0f), 0x7BFF);
  // 65520 is halfway between 65504 (odd) and 2^16 (Inf): -> Inf.
  EXPECT_EQ(floatToHalfBits(65520.0f), 0x7C00);
  EXPECT_EQ(floatToHalfBits(65519.99f), 0x7BFF);
  EXPECT_EQ(floatToHalfBits(65520.0f, Saturate::kFinite), 0x7BFF);
  // 1 + 2^-11 ties to 1.0; 1 + 3 * 2^-11 ties up to 1 + 2^-9 (0x3C02).
  EXPECT_EQ(floatToHalfBits(1.0f + 0x1p-11f), 0x3C00);
  EXPECT_EQ(floatToHalfBits(1.0f + 3 * 0x1p-11f), 0x3C02);
  // Subnormals: 2^-24 is the smallest, 2^-25 ties to 0, 1.5 * 2^-25 rounds up.
  EXPECT_EQ(floatToHalfBits(0x1p-24f), 0x0001);
  EXPECT_EQ(floatToHalfBits(0x1p-25f), 0x0000);
  EXPECT_EQ(floatToHalfBits(1.5f * 0x1p-25f), 0x0001);
  EXPECT_EQ(halfBitsToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(halfBitsToFloat(0x03FF), 1023 * 0x1p-24f);
  EXPECT_EQ(floatToHalfBits(-0.0f), 0x8000);
  EXPECT_EQ(floatToHalfBits(kInf), 0x7C00);
  EXPECT_EQ(floatToHalfBits(-kInf), 0xFC00);
  EXPECT_EQ(floatToHalfBits(kNaN) & 0x7E00, 0x7E00);
  EXPECT_TRUE(std::isnan(halfBitsToFloat(0x7C01)));
}

TEST(FloatTypes, BFloat16HandChecked) {
  EXPECT_EQ(floatToBFloat16Bits(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between 1.0 (even) and 1 + 2^-7: -> 1.0; a hair above goes up.
  EXPECT_EQ(floatToBFloat16Bits(1.0f + 0x1p-8f), 0x3F80);
  EXPECT_EQ(floatToBFloat16Bits(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);
  // 1 + 3 * 2^-8 is halfway between 0x3F81 (odd) and 0x3F82: -> 0x3F82.
  EXPECT_EQ(floatToBFloat16Bits(1.0f + 3 * 0x1p-8f), 0x3F82);
  // FLT_MAX rounds past the largest bfloat16 (0x7F7F) to Inf, or clamps when saturating.
  EXPECT_EQ(floatToBFloat16Bits(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(floatToBFloat16Bits(std::numeric_limits<float>::max(), Saturate::kFinite), 0x7F7F);
  EXPECT_EQ(floatToBFloat16Bits(-kInf, Saturate::kFinite), 0xFF7F);
  EXPECT_EQ(floatToBFloat16Bits(kNaN), 0x7FC0);
  // A NaN whose payload lives only in the dropped half must stay NaN (not become Inf).
  uint32_t lowNaN = 0x7F800001u;
  float f;
  std::memcpy(&f, &lowNaN, 4);
  EXPECT_TRUE(std::isnan(bfloat16BitsToFloat(floatToBFloat16Bits(f))));
  // bfloat16 keeps binary32's subnormals: 2^-133 is exact.
  EXPECT_EQ(bfloat16BitsToFloat(floatToBFloat16Bits(0x1p-133f)), 0x1p-133f);
  EXPECT_EQ(floatToBFloat16Bits(-0.0f), 0x8000);
}

TEST(FloatTypes, E2M1HandChecked) {
  const float values[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(e2m1BitsToFloat(c), values[c]);
    EXPECT_EQ(e2m1BitsToFloat(c | 8), -values[c]);
    EXPECT_EQ(floatToE2M1Bits(values[c]), c);
  }
  // Ties to the even code: 0.25 -> 0 (code 0), 0.75 -> 1.0 (2), 1.25 -> 1.0 (2),
  // 1.75 -> 2.0 (4), 2.5 -> 2.0 (4), 3.5 -> 4.0 (6), 5.0 -> 4.0 (6).
  EXPECT_EQ(floatToE2M1Bits(0.25f), 0);
  EXPECT_EQ(floatToE2M1Bits(0.75f), 2);
  EXPECT_EQ(floatToE2M1Bits(1.25f), 2);
  EXPECT_EQ(floatToE2M1Bits(1.75f), 4);
  EXPECT_EQ(floatToE2M1Bits(2.5f), 4);
  EXPECT_EQ(floatToE2M1Bits(3.5f), 6);
  EXPECT_EQ(floatToE2M1Bits(5.0f), 6);
  EXPECT_EQ(floatToE2M1Bits(5.01f), 7);
  // Always saturating; no NaN encoding: NaN -> +6.
  EXPECT_EQ(floatToE2M1Bits(7.0f), 7);
  EXPECT_EQ(floatToE2M1Bits(-1e9f), 0xF);
  EXPECT_EQ(floatToE2M1Bits(-kInf), 0xF);
  EXPECT_EQ(floatToE2M1Bits(kNaN), 0x7);
  EXPECT_EQ(floatToE2M1Bits(-0.0f), 0x8);
}

TEST(FloatTypes, E8M0HandChecked) {
  EXPECT_EQ(e8m0BitsToFloat(127), 1.0f);
  EXPECT_EQ(e8m0BitsToFloat(0), 0x1p-127f);
  EXPECT_EQ(e8m0BitsToFloat(254), 0x1p127f);
  EXPECT_TRUE(std::isnan(e8m0BitsToFloat(0xFF)));
  EXPECT_EQ(floatToE8M0Bits(1.0f), 127);
  EXPECT_EQ(floatToE8M0Bits(3.0f), 128);                      // floor: 2
  EXPECT_EQ(floatToE8M0Bits(3.0f, ScaleRounding::kUp), 129);  // ceil: 4
  EXPECT_EQ(floatToE8M0Bits(4.0f, ScaleRounding::kUp), 129);  // exact stays
  EXPECT_EQ(floatToE8M0Bits(0.0f), 0);                        // clamps to 2^-127
  EXPECT_EQ(floatToE8M0Bits(0x1p-127f), 0);
  EXPECT_EQ(floatToE8M0Bits(0x1p-127f, ScaleRounding::kUp), 0);
  EXPECT_EQ(floatToE8M0Bits(0x1.8p-127f, ScaleRounding::kUp), 1);
  EXPECT_EQ(floatToE8M0Bits(kNaN), 0xFF);
  EXPECT_EQ(floatToE8M0Bits(kInf), 0xFF);
  EXPECT_EQ(floatToE8M0Bits(kInf, ScaleRounding::kDown, Saturate::kFinite), 0xFE);
  EXPECT_EQ(floatToE8M0Bits(0x1.8p127f, ScaleRounding::kUp), 0xFF);
  for (int c = 0; c < 255; ++c) EXPECT_EQ(floatToE8M0Bits(e8m0BitsToFloat(c)), c) << c;
}

// ---- exhaustive checks against an independent reference ----------------------------------

struct Format {
  const char* name;
  int bits, ebits, mbits, bias;
  bool ieeeSpecials;  // all-ones exponent = Inf/NaN (else only all-ones code is NaN, or none)
  bool hasNaN;
  std::function<float(uint32_t)> decode;
  std::function<uint32_t(float, Saturate)> encode;
};

// Value of a code by the textbook formula, in double via ldexp. NaN/Inf per format.
double refDecode(const Format& f, uint32_t code) {
  uint32_t sign = code >> (f.bits - 1);
  uint32_t exp = (code >> f.mbits) & ((1u << f.ebits) - 1);
  uint32_t mant = code & ((1u << f.mbits) - 1);
  uint32_t mag = code & ((1u << (f.bits - 1)) - 1);
  double v;
  if (f.ieeeSpecials && exp == (1u << f.ebits) - 1) {
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (!f.ieeeSpecials && f.hasNaN && mag == (1u << (f.bits - 1)) - 1) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), 1 - f.bias - f.mbits);
  } else {
    v = std::ldexp(static_cast<double>(mant + (1u << f.mbits)), static_cast<int>(exp) - f.bias - f.mbits);
  }
  return sign ? -v : v;
}

// Largest finite positive code (magnitude codes are monotonic in value).
uint32_t maxFiniteCode(const Format& f) {
  uint32_t c = (1u << (f.bits - 1)) - 1;
  while (!std::isfinite(refDecode(f, c))) --c;
  return c;
}

// Nearest finite value by search over the sorted table of all positive values; ties to the
// even code. Past the top, IEEE rounding acts as if one more code (max + ulp) existed:
// reaching it means overflow.
uint32_t refEncode(const Format& f, const std::vector<double>& table, double x, Saturate sat) {
  uint32_t signBit = std::signbit(x) ? 1u << (f.bits - 1) : 0;
  double a = std::fabs(x);
  uint32_t top = static_cast<uint32_t>(table.size()) - 1;
  double virt = table[top] + (table[top] - table[top - 1]);
  uint32_t overflow = f.ieeeSpecials ? top + 1 : (f.hasNaN ? (1u << (f.bits - 1)) - 1 : top);
  if (sat == Saturate::kFinite || !f.hasNaN) overflow = top;
  uint32_t code;
  if (a >= virt) {
    code = overflow;
  } else if (a > table[top]) {
    double dlo = a - table[top], dhi = virt - a;
    code = (dlo < dhi || (dlo == dhi && (top & 1) == 0)) ? top : overflow;
  } else {
    auto it = std::upper_bound(table.begin(), table.end(), a);
    uint32_t hi = static_cast<uint32_t>(it - table.begin());
    if (hi == 0) return signBit;  // unreachable: table[0] = 0
    uint32_t lo = hi - 1;
    if (hi > top || table[lo] == a) {
      code = lo;
    } else {
      double dlo = a - table[lo], dhi = table[hi] - a;
      code = (dlo < dhi || (dlo == dhi && (lo & 1) == 0)) ? lo : hi;
    }
  }
  return signBit | code;
}

std::vector<Format> formats() {
  return {
      {"e4m3", 8, 4, 3, 7, false, true, [](uint32_t c) { return e4m3BitsToFloat(c); },
       [](float x, Saturate s) -> uint32_t { return floatToE4M3Bits(x, s); }},
      {"e5m2", 8, 5, 2, 15, true, true, [](uint32_t c) { return e5m2BitsToFloat(c); },
       [](float x, Saturate s) -> uint32_t { return floatToE5M2Bits(x, s); }},
      {"half", 16, 5, 10, 15, true, true, [](uint32_t c) { return halfBitsToFloat(c); },
       [](float x, Saturate s) -> uint32_t { return floatToHalfBits(x, s); }},
      {"bfloat16", 16, 8, 7, 127, true, true, [](uint32_t c) { return bfloat16BitsToFloat(c); },
       [](float x, Saturate s) -> uint32_t { return floatToBFloat16Bits(x, s); }},
      {"e2m1", 4, 2, 1, 1, false, false, [](uint32_t c) { return e2m1BitsToFloat(c); },
       [](float x, Saturate) -> uint32_t { return floatToE2M1Bits(x); }},
  };
}

bool isNanCode(const Format& f, uint32_t c) {
  return std::isnan(refDecode(f, c));
}

TEST(FloatTypes, ExhaustiveDecodeMatchesLdexpReference) {
  for (const Format& f : formats()) {
    for (uint32_t c = 0; c < (1u << f.bits); ++c) {
      double ref = refDecode(f, c);
      float got = f.decode(c);
      if (std::isnan(ref)) {
        EXPECT_TRUE(std::isnan(got)) << f.name << " code " << c;
      } else {
        EXPECT_EQ(static_cast<double>(got), ref) << f.name << " code " << c;
        EXPECT_EQ(std::signbit(got), std::signbit(ref)) << f.name << " code " << c;
      }
    }
  }
}

TEST(FloatTypes, ExhaustiveRoundTripEveryCode) {
  for (const Format& f : formats()) {
    for (uint32_t c = 0; c < (1u << f.bits); ++c) {
      float v = f.decode(c);
      for (Saturate s : {Saturate::kNo, Saturate::kFinite}) {
        uint32_t back = f.encode(v, s);
        if (isNanCode(f, c)) {
          EXPECT_TRUE(isNanCode(f, back)) << f.name << " code " << c;
        } else if (std::isinf(v) && s == Saturate::kFinite) {
          EXPECT_EQ(back, (c & (1u << (f.bits - 1))) | maxFiniteCode(f)) << f.name << " code " << c;
        } else {
          EXPECT_EQ(back, c) << f.name << " code " << c;
        }
      }
    }
  }
}

// Every rounding boundary: each value, each midpoint between neighbours, and one binary32
// ulp either side of it, for both signs and both overflow modes.
TEST(FloatTypes, ExhaustiveRoundingAtEveryMidpoint) {
  for (const Format& f : formats()) {
    std::vector<double> table;
    uint32_t top = maxFiniteCode(f);
    for (uint32_t c = 0; c <= top; ++c) table.push_back(refDecode(f, c));
    std::vector<double> probes;
    for (size_t i = 0; i + 1 < table.size(); ++i) probes.push_back((table[i] + table[i + 1]) / 2);
    probes.push_back(table[top] + (table[top] - table[top - 1]) / 2);  // overflow threshold
    probes.push_back(table[top] * 4);
    size_t checked = 0;
    for (double p : probes) {
      float mid = static_cast<float>(p);
      if (!std::isfinite(mid)) continue;  // bfloat16's top reaches past binary32
      ASSERT_EQ(static_cast<double>(mid), p) << "midpoint must be exact in binary32";
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, kInf)}) {
        for (float sx : {x, -x}) {
          for (Saturate s : {Saturate::kNo, Saturate::kFinite}) {
            uint32_t want = refEncode(f, table, sx, s);
            ASSERT_EQ(f.encode(sx, s), want) << f.name << " x=" << sx << " sat=" << static_cast<int>(s);
            ++checked;
          }
        }
      }
    }
    EXPECT_GT(checked, 12 * (table.size() - 1));
  }
}

TEST(FloatTypes, RandomFloatsMatchReference) {
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (const Format& f : formats()) {
    std::vector<double> table;
    uint32_t top = maxFiniteCode(f);
    for (uint32_t c = 0; c <= top; ++c) table.push_back(refDecode(f, c));
    for (int i = 0; i < 200000; ++i) {
      uint32_t bits = static_cast<uint32_t>(next());
      float x;
      std::memcpy(&x, &bits, 4);
      if (std::isnan(x)) {
        EXPECT_TRUE(f.hasNaN ? isNanCode(f, f.encode(x, Saturate::kNo)) : f.encode(x, Saturate::kNo) == 7);
        continue;
      }
      for (Saturate s : {Saturate::kNo, Saturate::kFinite}) {
        uint32_t want = refEncode(f, table, x, s);
        ASSERT_EQ(f.encode(x, s), want) << f.name << " bits=" << std::hex << bits;
      }
    }
  }
}

// ---- wrappers and dtype tables ------------------------------------------------------------

TEST(FloatTypes, WrappersMatchFreeFunctions) {
  EXPECT_EQ(Float16::fromFloat(1.5f).bits, floatToHalfBits(1.5f));
  EXPECT_EQ(BFloat16::fromFloat(1.5f).toFloat(), 1.5f);
  EXPECT_EQ(Float8E4M3::fromFloat(1e6f, Saturate::kFinite).bits, 0x7E);
  EXPECT_EQ(Float8E5M2::fromFloat(1e6f).bits, 0x7C);
  EXPECT_EQ(toFloat(Float8E4M3{0x38}), 1.0f);
  EXPECT_EQ(fromFloat<float>(2.5f), 2.5f);
  EXPECT_EQ(fromFloat<BFloat16>(2.5f).bits, 0x4020);
}

TEST(DataTypes, NamesSizesAndSupport) {
  const char* names[] = {"double", "float", "half",  "bfloat16", "f8e4m3", "f8e5m2",
                         "int8",   "uint8", "int32", "uint32",   "int64",  "uint64"};
  const size_t sizes[] = {8, 4, 2, 2, 1, 1, 1, 1, 4, 4, 8, 8};
  for (int i = 0; i < kNumDataTypes; ++i) {
    auto t = static_cast<DataType>(i);
    EXPECT_STREQ(dataTypeName(t), names[i]);
    EXPECT_EQ(elementSize(t), sizes[i]);
    EXPECT_EQ(parseDataType(names[i]), t);
    for (int o = 0; o < kNumReduceOps; ++o) {
      auto op = static_cast<ReduceOp>(o);
      EXPECT_EQ(isSupported(t, op), op != ReduceOp::kPreMulSum || i < 6) << names[i];
    }
  }
  EXPECT_EQ(parseDataType("float32"), DataType::kFloat32);
  EXPECT_EQ(parseDataType("bf16"), DataType::kBFloat16);
  EXPECT_EQ(parseDataType("float8_e4m3fn"), DataType::kFloat8E4M3);
  EXPECT_EQ(parseDataType("float128"), std::nullopt);
  const char* ops[] = {"sum", "prod", "min", "max", "avg", "premulsum"};
  for (int o = 0; o < kNumReduceOps; ++o) {
    EXPECT_STREQ(reduceOpName(static_cast<ReduceOp>(o)), ops[o]);
    EXPECT_EQ(parseReduceOp(ops[o]), static_cast<ReduceOp>(o));
  }
  EXPECT_EQ(parseReduceOp("bor"), std::nullopt);
}

}  // namespace
}  // namespace crossbar
