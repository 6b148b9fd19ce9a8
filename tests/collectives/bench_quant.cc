// Host cost of the MoE payload codecs, ns per element: today's collectives/quant.h against
// the frozen reference copy (quant_reference.h), interleaved in one run so a loaded machine
// affects both alike. Not a test; usage: bench_quant [hidden] [rows] [reps]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "collectives/quant.h"
#include "quant_reference.h"

namespace {

using namespace crossbar;

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

template <class T>
void benchType(const char* tname, size_t hidden, size_t rows, int reps) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<T> x(hidden * rows);
  for (auto& v : x) v = fromFloat<T>(nd(rng));
  std::vector<T> out(hidden * rows);
  const size_t n = hidden * rows;
  const PayloadCodec codecs[] = {PayloadCodec::kFp8Block128, PayloadCodec::kMxfp8, PayloadCodec::kNvfp4};
  for (PayloadCodec c : codecs) {
    const size_t pb = payloadBytes(c, hidden), sb = scaleBytes(c, hidden);
    std::vector<uint8_t> payload(pb * rows);
    std::vector<float> scaleStore((sb * rows + 3) / 4);
    auto* scales = reinterpret_cast<uint8_t*>(scaleStore.data());
    auto refEncode = [&] {
      for (size_t r = 0; r < rows; ++r) {
        const T* xr = x.data() + r * hidden;
        uint8_t* p = payload.data() + r * pb;
        uint8_t* s = scales + r * sb;
        if (c == PayloadCodec::kFp8Block128)
          quant_ref::quantizeRowFp8Block(xr, hidden, p, reinterpret_cast<float*>(s));
        else if (c == PayloadCodec::kMxfp8)
          quant_ref::quantizeRowMxfp8(xr, hidden, p, s);
        else
          quant_ref::quantizeRowNvfp4(xr, hidden, 1.0f, p, s);
      }
    };
    auto newEncode = [&] {
      for (size_t r = 0; r < rows; ++r)
        quantizeRow(c, x.data() + r * hidden, hidden, payload.data() + r * pb, scales + r * sb, 1.0f);
    };
    auto refDecode = [&] {
      for (size_t r = 0; r < rows; ++r) {
        const uint8_t* p = payload.data() + r * pb;
        const uint8_t* s = scales + r * sb;
        T* o = out.data() + r * hidden;
        if (c == PayloadCodec::kFp8Block128)
          quant_ref::dequantizeRowFp8Block(p, reinterpret_cast<const float*>(s), hidden, o);
        else if (c == PayloadCodec::kMxfp8)
          quant_ref::dequantizeRowMxfp8(p, s, hidden, o);
        else
          quant_ref::dequantizeRowNvfp4(p, s, 1.0f, hidden, o);
      }
    };
    auto newDecode = [&] {
      for (size_t r = 0; r < rows; ++r)
        dequantizeRow(c, payload.data() + r * pb, scales + r * sb, hidden, out.data() + r * hidden, 1.0f);
    };
    double re = 1e30, ne = 1e30, rd = 1e30, nd2 = 1e30;
    for (int round = 0; round < 3; ++round) {  // interleave so load spikes hit both
      re = std::min(re, bestNsPerElement(refEncode, n, reps));
      ne = std::min(ne, bestNsPerElement(newEncode, n, reps));
      rd = std::min(rd, bestNsPerElement(refDecode, n, reps));
      nd2 = std::min(nd2, bestNsPerElement(newDecode, n, reps));
    }
    std::printf(
        "%-5s %-13s encode ref %6.2f new %6.2f ns/elem (x%.1f)   decode ref %6.2f new %6.2f (x%.1f)\n", tname,
        payloadCodecName(c), re, ne, re / ne, rd, nd2, rd / nd2);
  }
}

}  // namespace

int main(int argc, char** argv) {
  size_t hidden = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 7168;
  size_t rows = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 32;
  int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  std::printf("hidden %zu, rows %zu, best of %d x 3 interleaved rounds\n", hidden, rows, reps);
  benchType<float>("f32", hidden, rows, reps);
  benchType<BFloat16>("bf16", hidden, rows, reps);
  return 0;
}
