// Host cost of the MoE payload codecs, ns per element, four implementations interleaved in
// one run so a loaded machine affects all alike:
//   ref     the frozen original scalar code (quant_reference.h)
//   shared  collectives/quant.h's quantizeRow / dequantizeRow (what the CUDA kernels run)
//   scalar  the MoE host codec's portable path (collectives/moe/host_codec.h)
//   avx2    its AVX2 path (absent where the CPU lacks AVX2)
// Not a test; usage: bench_quant [hidden] [rows] [reps]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "collectives/moe/host_codec.h"
#include "collectives/quant.h"
#include "quant_reference.h"

namespace {

using namespace crossbar;
using moe::HostCodecIsa;

template <class F>
double bestNsPerElement(F&& f, size_t elements, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count() / elements);
  }
  return best;
}

constexpr int kImpls = 4;
const char* const kImplNames[kImpls] = {"ref", "shared", "scalar", "avx2"};

template <class T>
void benchType(const char* tname, size_t hidden, size_t rows, int reps) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<T> x(hidden * rows);
  for (auto& v : x) v = fromFloat<T>(nd(rng));
  std::vector<T> out(hidden * rows);
  const size_t n = hidden * rows;
  const bool avx2 = moe::hostCodecIsaSupported(HostCodecIsa::kAvx2);
  const PayloadCodec codecs[] = {PayloadCodec::kFp8Block128, PayloadCodec::kMxfp8, PayloadCodec::kNvfp4};
  for (PayloadCodec c : codecs) {
    const size_t pb = payloadBytes(c, hidden), sb = scaleBytes(c, hidden);
    std::vector<uint8_t> payload(pb * rows);
    std::vector<float> scaleStore((sb * rows + 3) / 4 + 1);
    auto* scales = reinterpret_cast<uint8_t*>(scaleStore.data());
    // sb is a multiple of 4 for fp8 block-128 (f32 scales), so every row's scales stay aligned.
    auto encode = [&](int impl) {
      for (size_t r = 0; r < rows; ++r) {
        const T* xr = x.data() + r * hidden;
        uint8_t* p = payload.data() + r * pb;
        uint8_t* s = scales + r * sb;
        if (impl == 0) {
          if (c == PayloadCodec::kFp8Block128)
            quant_ref::quantizeRowFp8Block(xr, hidden, p, reinterpret_cast<float*>(s));
          else if (c == PayloadCodec::kMxfp8)
            quant_ref::quantizeRowMxfp8(xr, hidden, p, s);
          else
            quant_ref::quantizeRowNvfp4(xr, hidden, 1.0f, p, s);
        } else if (impl == 1) {
          quantizeRow(c, xr, hidden, p, s, 1.0f);
        } else {
          moe::encodeRowHost(impl == 2 ? HostCodecIsa::kScalar : HostCodecIsa::kAvx2, c, xr, hidden, p, s,
                             1.0f);
        }
      }
    };
    auto decode = [&](int impl) {
      for (size_t r = 0; r < rows; ++r) {
        const uint8_t* p = payload.data() + r * pb;
        const uint8_t* s = scales + r * sb;
        T* o = out.data() + r * hidden;
        if (impl == 0) {
          if (c == PayloadCodec::kFp8Block128)
            quant_ref::dequantizeRowFp8Block(p, reinterpret_cast<const float*>(s), hidden, o);
          else if (c == PayloadCodec::kMxfp8)
            quant_ref::dequantizeRowMxfp8(p, s, hidden, o);
          else
            quant_ref::dequantizeRowNvfp4(p, s, 1.0f, hidden, o);
        } else if (impl == 1) {
          dequantizeRow(c, p, s, hidden, o, 1.0f);
        } else {
          moe::decodeRowHost(impl == 2 ? HostCodecIsa::kScalar : HostCodecIsa::kAvx2, c, p, s, hidden, o,
                             1.0f);
        }
      }
    };
    double enc[kImpls], dec[kImpls];
    std::fill(enc, enc + kImpls, 1e30);
    std::fill(dec, dec + kImpls, 1e30);
    const int impls = avx2 ? kImpls : kImpls - 1;
    for (int round = 0; round < 3; ++round)  // interleave so load spikes hit all alike
      for (int i = 0; i < impls; ++i) {
        enc[i] = std::min(enc[i], bestNsPerElement([&] { encode(i); }, n, reps));
        dec[i] = std::min(dec[i], bestNsPerElement([&] { decode(i); }, n, reps));
      }
    std::printf("%-5s %-13s encode", tname, payloadCodecName(c));
    for (int i = 0; i < impls; ++i) std::printf(" %s %6.2f", kImplNames[i], enc[i]);
    if (avx2) std::printf(" (avx2 x%.1f of scalar)", enc[2] / enc[3]);
    std::printf("   decode");
    for (int i = 0; i < impls; ++i) std::printf(" %s %6.2f", kImplNames[i], dec[i]);
    if (avx2) std::printf(" (x%.1f)", dec[2] / dec[3]);
    std::printf("\n");
  }
}

// Combine's row kernels (addRowHost, scaleRowHost, roundRowHost), scalar vs avx2.
void benchCombine(size_t hidden, size_t rows, int reps) {
  if (!moe::hostCodecIsaSupported(HostCodecIsa::kAvx2)) return;
  const size_t n = hidden * rows;
  std::vector<float> acc(n, 1.0f), x(n, 0.5f);
  std::vector<BFloat16> xb(n, BFloat16::fromFloat(0.25f)), out16(n);
  for (HostCodecIsa isa : {HostCodecIsa::kScalar, HostCodecIsa::kAvx2}) {
    double add32 = 1e30, add16 = 1e30, scale16 = 1e30, round16 = 1e30;
    for (int round = 0; round < 3; ++round) {
      add32 =
          std::min(add32, bestNsPerElement([&] { moe::addRowHost(isa, acc.data(), x.data(), n); }, n, reps));
      add16 =
          std::min(add16, bestNsPerElement([&] { moe::addRowHost(isa, acc.data(), xb.data(), n); }, n, reps));
      scale16 = std::min(
          scale16,
          bestNsPerElement([&] { moe::scaleRowHost(isa, acc.data(), xb.data(), 0.5f, n); }, n, reps));
      round16 = std::min(
          round16, bestNsPerElement([&] { moe::roundRowHost(isa, out16.data(), acc.data(), n); }, n, reps));
    }
    std::printf("combine %-6s add f32 %5.2f  add bf16 %5.2f  scale bf16 %5.2f  round to bf16 %5.2f\n",
                moe::hostCodecIsaName(isa), add32, add16, scale16, round16);
  }
}

}  // namespace

int main(int argc, char** argv) {
  size_t hidden = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 7168;
  size_t rows = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 32;
  int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  std::printf("hidden %zu, rows %zu, best of %d x 3 interleaved rounds, ns per element\n", hidden, rows,
              reps);
  benchType<float>("f32", hidden, rows, reps);
  benchType<BFloat16>("bf16", hidden, rows, reps);
  benchCombine(hidden, rows, reps);
  return 0;
}
