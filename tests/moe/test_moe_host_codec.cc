// The table-driven host decoder of MoE payloads (collectives/moe/host_codec.h) must give the
// same bytes as collectives/quant.h's dequantizeRow for every element code, block scale
// (NaN, zero, subnormal, large; E8M0 and E4M3 scale codes all 256) and partial blocks.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "collectives/moe/host_codec.h"

namespace crossbar::moe {
namespace {

// The implementation under test: every supported one in turn (EveryIsa* tests), else the
// process default (hostCodecIsa()).
const HostCodecIsa* g_isa = nullptr;

template <class T>
void expectSameAsShared(PayloadCodec c, size_t hidden, const std::vector<uint8_t>& payload,
                        const std::vector<uint8_t>& scales, float global_scale) {
  std::vector<T> want(hidden), got(hidden);
  dequantizeRow(c, payload.data(), scales.data(), hidden, want.data(), global_scale);
  if (g_isa)
    decodeRowHost(*g_isa, c, payload.data(), scales.data(), hidden, got.data(), global_scale);
  else
    decodeRowHost(c, payload.data(), scales.data(), hidden, got.data(), global_scale);
  // Bit for bit, NaNs included: every decoded NaN is the one canonical quiet NaN (the GPU's
  // arithmetic would give other NaN bits than the CPU's otherwise).
  for (size_t i = 0; i < hidden; ++i) {
    const float w = toFloat(want[i]), g = toFloat(got[i]);
    if (std::isnan(w)) {
      const T canonical = fromFloat<T>(std::bit_cast<float>(0x7FC00000u));
      ASSERT_EQ(std::memcmp(&want[i], &canonical, sizeof(T)), 0) << "element " << i << ": not the canonical NaN";
    }
    ASSERT_EQ(std::memcmp(&want[i], &got[i], sizeof(T)), 0)
        << "codec " << static_cast<int>(c) << " hidden " << hidden << " element " << i << ": " << w << " vs "
        << g << " global scale " << global_scale;
  }
}

// Payload cycling through every byte (every code in every position), scales from `pick`.
template <class Pick>
void sweep(PayloadCodec c, size_t hidden, Pick pick, float global_scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> payload(payloadBytes(c, hidden)), scales(scaleBytes(c, hidden) + 4);
  for (int round = 0; round < 256; ++round) {
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7 + round + rng() % 2);
    pick(scales, round, rng);
    expectSameAsShared<float>(c, hidden, payload, scales, global_scale);
    expectSameAsShared<BFloat16>(c, hidden, payload, scales, global_scale);
  }
}

void fp8EveryCodeManyScales() {
  const float special[] = {1.0f, 0.0f, -0.0f, 1e-38f, 1.1754944e-38f, 3.0f / 448.0f, 1e30f, 2.5e-3f};
  // 1072: a last block of 48 codes (a multiple of 16, so the AVX-512 decode takes it).
  for (size_t hidden : {size_t{7168}, size_t{1072}, size_t{200}, size_t{37}})
    sweep(
        PayloadCodec::kFp8Block128, hidden,
        [&](std::vector<uint8_t>& s, int round, std::mt19937& rng) {
          for (size_t b = 0; b < s.size() / 4; ++b) {
            float v = round % 4 == 0 ? special[(b + round) % 8]
                                     : std::ldexp(std::uniform_real_distribution<float>(0.5f, 1.0f)(rng),
                                                  static_cast<int>(rng() % 80) - 60);
            if (round == 5 && b == 1) v = std::numeric_limits<float>::quiet_NaN();
            std::memcpy(s.data() + 4 * b, &v, 4);
          }
        },
        1.0f, 1);
}

TEST(MoeHostCodec, Mxfp8EveryCodeEveryScale) {
  for (size_t hidden : {size_t{7168}, size_t{200}, size_t{37}})
    sweep(
        PayloadCodec::kMxfp8, hidden,
        [](std::vector<uint8_t>& s, int round, std::mt19937&) {
          for (size_t b = 0; b < s.size(); ++b) s[b] = static_cast<uint8_t>(round + 13 * b);
        },
        1.0f, 2);
}

TEST(MoeHostCodec, Nvfp4EveryCodeEveryBlockScale) {
  for (float g : {1.0f, 0.37f, 1.1754944e-38f, 3.0e5f, std::numeric_limits<float>::quiet_NaN()})
    for (size_t hidden : {size_t{7168}, size_t{200}, size_t{37}})
      sweep(
          PayloadCodec::kNvfp4, hidden,
          [](std::vector<uint8_t>& s, int round, std::mt19937&) {
            for (size_t b = 0; b < s.size(); ++b) s[b] = static_cast<uint8_t>(round + 29 * b);
          },
          g, 3);
}

// Blocks without NaN codes and with finite scales (the AVX2 decoder's path without NaN
// selects): every other code in every position, scales from subnormal to huge (products
// overflowing to Inf), zero and negative, partial blocks; then one NaN code or a NaN / Inf
// scale per row to switch blocks back to the general path.
void decodeNanFreeBlocks() {
  std::mt19937 rng(11);
  for (PayloadCodec c : {PayloadCodec::kFp8Block128, PayloadCodec::kMxfp8}) {
    for (size_t hidden : {size_t{7168}, size_t{1072}, size_t{200}, size_t{37}}) {
      std::vector<uint8_t> payload(payloadBytes(c, hidden)), scales(scaleBytes(c, hidden) + 4);
      for (int round = 0; round < 64; ++round) {
        for (size_t i = 0; i < payload.size(); ++i) {
          uint8_t b = static_cast<uint8_t>(i * 5 + static_cast<size_t>(round) + rng() % 3);
          payload[i] = (b & 0x7F) == 0x7F ? static_cast<uint8_t>(b - 1) : b;
        }
        if (round % 4 == 3) payload[rng() % payload.size()] = (rng() % 2) ? 0x7F : 0xFF;
        if (c == PayloadCodec::kFp8Block128) {
          auto* s = reinterpret_cast<float*>(scales.data());
          for (size_t b = 0; b < scaleBytes(c, hidden) / 4; ++b) {
            const float pick[] = {1.0f, 0.0f, -2.5f, std::ldexp(1.3f, -140), std::ldexp(1.7f, 120), 3e38f,
                                  std::ldexp(1.0f, -126), 0.017f};
            s[b] = round % 8 == 5 && b == 1 ? std::numeric_limits<float>::infinity()
                   : round % 8 == 6 && b == 0 ? std::numeric_limits<float>::quiet_NaN()
                                              : pick[(b + static_cast<size_t>(round)) % 8];
          }
        } else {
          for (size_t b = 0; b < scaleBytes(c, hidden); ++b) scales[b] = static_cast<uint8_t>(rng() % 256);
        }
        expectSameAsShared<float>(c, hidden, payload, scales, 1.0f);
        expectSameAsShared<BFloat16>(c, hidden, payload, scales, 1.0f);
      }
    }
  }
}

TEST(MoeHostCodec, Fp8Block128EveryCodeManyScales) {
  fp8EveryCodeManyScales();
}
TEST(MoeHostCodec, DecodeNanFreeBlocksMatchesShared) {
  decodeNanFreeBlocks();
}

// Runs `check` once per codec implementation this CPU and build support, named in the trace.
void forEachSupportedIsa(const std::function<void(HostCodecIsa)>& check) {
  for (HostCodecIsa isa : {HostCodecIsa::kScalar, HostCodecIsa::kAvx2, HostCodecIsa::kAvx512}) {
    if (!hostCodecIsaSupported(isa)) {
      std::printf("skipping %s: not supported by this CPU or build\n", hostCodecIsaName(isa));
      continue;
    }
    SCOPED_TRACE(hostCodecIsaName(isa));
    check(isa);
  }
}

// Each implementation explicitly (the default is only the best one): the AVX-512 decode's
// ordinary blocks, and the AVX2 / scalar paths it falls back to for the others.
TEST(MoeHostCodec, EveryIsaDecodeMatchesShared) {
  forEachSupportedIsa([](HostCodecIsa isa) {
    g_isa = &isa;
    fp8EveryCodeManyScales();
    decodeNanFreeBlocks();
    g_isa = nullptr;
  });
}

template <class T>
void expectEncodeSame(PayloadCodec c, const std::vector<T>& x, size_t hidden, const HostCodecIsa* isa = nullptr) {
  const size_t rows = x.size() / hidden, pb = payloadBytes(c, hidden), sb = scaleBytes(c, hidden) + 4;
  std::vector<uint8_t> wp(pb), ws(sb, 0), gp(pb), gs(sb, 0);
  for (size_t r = 0; r < rows; ++r) {
    quantizeRow(c, x.data() + r * hidden, hidden, wp.data(), ws.data(), 1.0f);
    if (isa)
      encodeRowHost(*isa, c, x.data() + r * hidden, hidden, gp.data(), gs.data(), 1.0f);
    else
      encodeRowHost(c, x.data() + r * hidden, hidden, gp.data(), gs.data(), 1.0f);
    ASSERT_EQ(ws, gs) << "scales, codec " << static_cast<int>(c) << " row " << r << " hidden " << hidden;
    for (size_t i = 0; i < pb; ++i)
      ASSERT_EQ(wp[i], gp[i]) << "codec " << static_cast<int>(c) << " row " << r << " element " << i
                              << " input " << toFloat(x[r * hidden + i]);
  }
}

// Every bf16 pattern (NaN, Inf, subnormals, zeros) in every block position, blocks mixing
// magnitudes so that elements land on both sides of E4M3's subnormal boundary; then
// random f32 rows over many exponents, with ties and exact block maxima.
void encodeMatchesQuantizeRow(const HostCodecIsa* isa) {
  for (PayloadCodec c : {PayloadCodec::kFp8Block128, PayloadCodec::kMxfp8}) {
    for (size_t stride : {size_t{1}, size_t{97}, size_t{4099}}) {
      std::vector<BFloat16> x(65536);
      for (size_t i = 0; i < x.size(); ++i) x[i] = BFloat16::fromBits(static_cast<uint16_t>(i * stride));
      expectEncodeSame(c, x, 128, isa);
      expectEncodeSame(c, x, 200, isa);
      // Rows of whole groups of eight blocks: the SIMD paths' eight-block form (AVX-512's wide
      // encode), plus a partial group after them.
      expectEncodeSame(c, x, 1024, isa);
      expectEncodeSame(c, x, 1024 + 256 + 40, isa);
      // Every bf16 pattern as f32 too, and rows whose last block is partial in every way.
      std::vector<float> xf(x.size());
      for (size_t i = 0; i < x.size(); ++i) xf[i] = x[i].toFloat();
      expectEncodeSame(c, xf, 128, isa);
      expectEncodeSame(c, xf, 1024, isa);
      for (size_t hidden : {size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{127}, size_t{129}, size_t{255}})
        expectEncodeSame(c, std::vector<BFloat16>(x.begin(), x.begin() + static_cast<ptrdiff_t>(hidden * 64)),
                         hidden, isa);
    }
    std::mt19937 rng(5);
    std::vector<float> f(7168 * 16);
    for (size_t i = 0; i < f.size(); ++i) {
      float v = std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng),
                           static_cast<int>(rng() % 40) - 20);
      if (i % 61 == 0) v = std::ldexp(1.0f + static_cast<float>(rng() % 16) / 16.0f, -12);  // ties near 2^-9
      f[i] = v;
    }
    expectEncodeSame(c, f, 7168, isa);
    expectEncodeSame(c, f, 37, isa);
  }
}

TEST(MoeHostCodec, EncodeMatchesQuantizeRow) {
  encodeMatchesQuantizeRow(nullptr);  // the process's implementation (CROSSBAR_MOE_HOST_CODEC)
}

// Each implementation the CPU has, explicitly.
TEST(MoeHostCodec, EveryIsaEncodeMatchesQuantizeRow) {
  forEachSupportedIsa([](HostCodecIsa isa) { encodeMatchesQuantizeRow(&isa); });
}

}  // namespace
}  // namespace crossbar::moe
