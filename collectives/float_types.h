// Software narrow floating-point formats: IEEE binary16, bfloat16, OCP FP8 (E4M3, E5M2),
// OCP MX FP4 (E2M1) and the E8M0 power-of-two scale. Conversions are integer bit
// manipulation only, so CPU and GPU produce identical bits (no dependence on FTZ flags,
// fast-math or hardware converters), and round to nearest, ties to even.
//
// Overflow (Saturate): kNo follows each format's IEEE/OCP non-saturating rule (to Inf
// where the format has one, else NaN); kFinite clamps finite overflow and +-Inf to the
// largest finite value, like PTX cvt .satfinite and the OCP MX "saturating" conversion.
// NaN always converts to NaN (formats without NaN document their choice).
#pragma once

#include <cstdint>
#include <type_traits>

#include "collectives/hd.h"

namespace crossbar {

enum class Saturate : bool { kNo = false, kFinite = true };

namespace fpdetail {

// Rounds the magnitude |x| (bits without sign; finite) to a binary format with `m`
// mantissa bits whose smallest normal exponent is `emin` (= 1 - bias). Returns the
// format's magnitude code (exponent field << m | mantissa); the result may exceed the
// largest finite code, which the caller treats as overflow.
// Branch-free: selects instead of branches, because the round-up decision depends on the
// data and a branch on it mispredicts about half the time. Bit-identical to the original
// branchy version kept as the oracle in tests/collectives/quant_reference.h.
CROSSBAR_HDI uint32_t roundMagnitudeBranchFree(uint32_t absBits, int m, int emin) {
  uint32_t e = absBits >> 23;
  uint32_t sig = (absBits & 0x7FFFFFu) | (e != 0 ? 0x800000u : 0u);  // implicit bit
  int exp = (e != 0 ? static_cast<int>(e) : 1) - 127;                // |x| = sig * 2^(exp - 23)
  // The target's quantum at this magnitude is 2^(max(exp, emin) - m); below emin the
  // target is subnormal and the quantum stops shrinking.
  int qexp = exp > emin ? exp : emin;
  int shift = 23 - m + (qexp - exp);
  shift = shift > 30 ? 30 : shift;  // sig < 2^24 is below half a quantum: rounds to 0
  // Round to nearest, ties to even: adding half - 1 plus the kept LSB carries into the
  // kept bits exactly when the remainder is above half, or equal to it with an odd LSB.
  uint32_t half = 1u << (shift - 1);
  uint32_t q = (sig + (half - 1u) + ((sig >> shift) & 1u)) >> shift;
  // Normal: q = 2^m + mantissa, so adding (qexp - emin) << m yields the biased exponent;
  // a mantissa carry (q = 2^(m+1)) or a subnormal rounding up to 2^m both carry into the
  // exponent field naturally.
  return (static_cast<uint32_t>(qexp - emin) << m) + q;
}

// Same result; faster when most inputs are normals of the target (fp8 / half payloads
// scaled to their block maximum): one predictable branch, then constant shifts on the
// binary32 bits themselves. E2M1 uses the branch-free form (half its values are subnormal).
CROSSBAR_HDI uint32_t roundMagnitude(uint32_t absBits, int m, int emin) {
  if (static_cast<int>(absBits >> 23) - 127 < emin) return roundMagnitudeBranchFree(absBits, m, emin);
  // The quantum is 2^(23 - m) units of absBits; a mantissa carry rounds into the exponent
  // field, and rebiasing the exponent (127 -> 1 - emin) gives the target code.
  uint32_t keep = static_cast<uint32_t>(23 - m);
  uint32_t r = (absBits + ((1u << (keep - 1)) - 1u) + ((absBits >> keep) & 1u)) >> keep;
  return r - (static_cast<uint32_t>(127 + emin - 1) << m);
}

// binary32 bits of the finite magnitude code `mag` of a format with m mantissa bits and
// the given exponent bias (all our formats' values are binary32 normals or zero).
// Branch-free (fp4 payloads are half subnormals): a subnormal is mant * 2^(1 - bias - m),
// an exact product of binary32 normals (no rounding, no FTZ/DAZ effect), so it equals the
// normalized bit pattern the oracle builds with a loop.
CROSSBAR_HDI uint32_t decodeMagnitude(uint32_t mag, int m, int bias) {
  uint32_t exp = mag >> m;
  uint32_t mant = mag & ((1u << m) - 1u);
  uint32_t normal = (static_cast<uint32_t>(static_cast<int>(exp) - bias + 127) << 23) | (mant << (23 - m));
  float quantum = bitsFloat(static_cast<uint32_t>(127 + 1 - bias - m) << 23);
  uint32_t subnormal = floatBits(static_cast<float>(mant) * quantum);
  return exp == 0 ? subnormal : normal;
}

}  // namespace fpdetail

// ---- IEEE binary16: 1.5.10, bias 15, max 65504 ----------------------------------------
CROSSBAR_HDI uint16_t floatToHalfBits(float f, Saturate sat = Saturate::kNo) {
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

CROSSBAR_HDI float halfBitsToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t mag = h & 0x7FFFu;
  if (mag >= 0x7C00u) {  // Inf, or NaN made quiet with its payload kept
    uint32_t mant = mag & 0x3FFu;
    return bitsFloat(sign | 0x7F800000u | (mant ? 0x400000u | (mant << 13) : 0u));
  }
  return bitsFloat(sign | fpdetail::decodeMagnitude(mag, 10, 15));
}

// ---- bfloat16: 1.8.7, the top half of binary32 ---------------------------------------
CROSSBAR_HDI uint16_t floatToBFloat16Bits(float f, Saturate sat = Saturate::kNo) {
  uint32_t b = floatBits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);  // quiet
  // Adding 0x7FFF plus the LSB of the kept half rounds to nearest-even; a carry out of
  // the mantissa bumps the exponent, and past the top it lands exactly on Inf.
  uint16_t r = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  if (sat == Saturate::kFinite && (r & 0x7FFFu) == 0x7F80u) r = (r & 0x8000u) | 0x7F7Fu;
  return r;
}

CROSSBAR_HDI float bfloat16BitsToFloat(uint16_t h) {
  return bitsFloat(static_cast<uint32_t>(h) << 16);
}

// ---- OCP FP8 E4M3 (FN): 1.4.3, bias 7, no Inf, NaN = S.1111.111, max 448 -------------
CROSSBAR_HDI uint8_t floatToE4M3Bits(float f, Saturate sat = Saturate::kNo) {
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

CROSSBAR_HDI float e4m3BitsToFloat(uint8_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  uint32_t mag = v & 0x7Fu;
  if (mag == 0x7Fu) return bitsFloat(sign | 0x7FC00000u);
  return bitsFloat(sign | fpdetail::decodeMagnitude(mag, 3, 7));
}

// ---- OCP FP8 E5M2: 1.5.2, bias 15, Inf = S.11111.00, NaN = S.11111.{01,10,11}, max 57344
CROSSBAR_HDI uint8_t floatToE5M2Bits(float f, Saturate sat = Saturate::kNo) {
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

CROSSBAR_HDI float e5m2BitsToFloat(uint8_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  uint32_t mag = v & 0x7Fu;
  if (mag >= 0x7Cu) return bitsFloat(sign | (mag == 0x7Cu ? 0x7F800000u : 0x7FC00000u));
  return bitsFloat(sign | fpdetail::decodeMagnitude(mag, 2, 15));
}

// ---- OCP MX FP4 E2M1: 1.2.1, bias 1; values 0 0.5 1 1.5 2 3 4 6; no Inf/NaN ----------
// A 4-bit code in the low nibble. Conversion always saturates (there is nothing to
// overflow to); NaN has no encoding and becomes +6 (code 0x7), as PTX cvt .satfinite
// does for FP4, so a NaN cannot silently turn into a small value.
CROSSBAR_HDI uint8_t floatToE2M1Bits(float f) {
  uint32_t b = floatBits(f);
  uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7u;
  uint8_t sign = static_cast<uint8_t>((b >> 28) & 0x8u);
  uint32_t code = a == 0x7F800000u ? 0x7u : fpdetail::roundMagnitudeBranchFree(a, 1, 0);
  if (code > 0x7u) code = 0x7u;
  return sign | static_cast<uint8_t>(code);
}

CROSSBAR_HDI float e2m1BitsToFloat(uint8_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x8u) << 28;
  return bitsFloat(sign | fpdetail::decodeMagnitude(v & 0x7u, 1, 1));
}

// ---- OCP MX E8M0 scale: 2^(code - 127), code 0..254; 0xFF = NaN; no sign, no zero ----
enum class ScaleRounding { kDown, kUp };  // floor / ceil of log2 (PTX cvt.rz / cvt.rp)

CROSSBAR_HDI float e8m0BitsToFloat(uint8_t v) {
  if (v == 0xFFu) return bitsFloat(0x7FC00000u);
  if (v == 0) return bitsFloat(0x00400000u);  // 2^-127 is a binary32 subnormal
  return bitsFloat(static_cast<uint32_t>(v) << 23);
}

// Power-of-two scale for the magnitude of f. Values below 2^-127 (and zero) clamp to the
// smallest code; NaN gives NaN; values past 2^127 give NaN, or 2^127 when saturating.
CROSSBAR_HDI uint8_t floatToE8M0Bits(float f, ScaleRounding r = ScaleRounding::kDown,
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

// ---- typed wrappers ---------------------------------------------------------------------
// Trivially copyable storage types with the size of the format, for buffers, dispatch
// and kernels. Arithmetic is done in float (see reduce.h's accumulator traits).
struct Float16 {
  uint16_t bits;
  CROSSBAR_HDI static Float16 fromBits(uint16_t b) { return Float16{b}; }
  CROSSBAR_HDI static Float16 fromFloat(float f, Saturate s = Saturate::kNo) {
    return Float16{floatToHalfBits(f, s)};
  }
  CROSSBAR_HDI float toFloat() const { return halfBitsToFloat(bits); }
};

struct BFloat16 {
  uint16_t bits;
  CROSSBAR_HDI static BFloat16 fromBits(uint16_t b) { return BFloat16{b}; }
  CROSSBAR_HDI static BFloat16 fromFloat(float f, Saturate s = Saturate::kNo) {
    return BFloat16{floatToBFloat16Bits(f, s)};
  }
  CROSSBAR_HDI float toFloat() const { return bfloat16BitsToFloat(bits); }
};

struct Float8E4M3 {
  uint8_t bits;
  CROSSBAR_HDI static Float8E4M3 fromBits(uint8_t b) { return Float8E4M3{b}; }
  CROSSBAR_HDI static Float8E4M3 fromFloat(float f, Saturate s = Saturate::kNo) {
    return Float8E4M3{floatToE4M3Bits(f, s)};
  }
  CROSSBAR_HDI float toFloat() const { return e4m3BitsToFloat(bits); }
};

struct Float8E5M2 {
  uint8_t bits;
  CROSSBAR_HDI static Float8E5M2 fromBits(uint8_t b) { return Float8E5M2{b}; }
  CROSSBAR_HDI static Float8E5M2 fromFloat(float f, Saturate s = Saturate::kNo) {
    return Float8E5M2{floatToE5M2Bits(f, s)};
  }
  CROSSBAR_HDI float toFloat() const { return e5m2BitsToFloat(bits); }
};

static_assert(sizeof(Float16) == 2 && sizeof(BFloat16) == 2);
static_assert(sizeof(Float8E4M3) == 1 && sizeof(Float8E5M2) == 1);

// Generic float access for code templated on the element type (float passes through).
CROSSBAR_HDI float toFloat(float v) {
  return v;
}
CROSSBAR_HDI float toFloat(Float16 v) {
  return v.toFloat();
}
CROSSBAR_HDI float toFloat(BFloat16 v) {
  return v.toFloat();
}
CROSSBAR_HDI float toFloat(Float8E4M3 v) {
  return v.toFloat();
}
CROSSBAR_HDI float toFloat(Float8E5M2 v) {
  return v.toFloat();
}

template <class T>
CROSSBAR_HDI T fromFloat(float f, Saturate s = Saturate::kNo) {
  if constexpr (std::is_same_v<T, float>) {
    (void)s;
    return f;
  } else {
    return T::fromFloat(f, s);
  }
}

}  // namespace crossbar
