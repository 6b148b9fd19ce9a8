#include "collectives/moe/host_codec.h"

#include <array>

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

}  // namespace

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
