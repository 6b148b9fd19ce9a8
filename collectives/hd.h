// Portability macros for per-element math shared by the CPU and CUDA paths.
// Functions marked CROSSBAR_HD compile as host+device code under nvcc and as plain
// inline C++ otherwise; they use no std:: calls that are unavailable in device code.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CROSSBAR_HD __host__ __device__
#else
#define CROSSBAR_HD
#endif

// Inline + host/device: the form every per-element helper uses.
#define CROSSBAR_HDI CROSSBAR_HD inline

namespace crossbar {

// Bit casts between float and its IEEE-754 binary32 pattern. memcpy is the portable
// spelling on the host (compilers turn it into a register move); device code uses the
// intrinsics so nothing touches local memory.
CROSSBAR_HDI uint32_t floatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

CROSSBAR_HDI float bitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

CROSSBAR_HDI bool isNanFloat(float f) {
  return (floatBits(f) & 0x7FFFFFFFu) > 0x7F800000u;
}
CROSSBAR_HDI bool isFiniteFloat(float f) {
  return (floatBits(f) & 0x7F800000u) != 0x7F800000u;
}
CROSSBAR_HDI float absFloat(float f) {
  return bitsFloat(floatBits(f) & 0x7FFFFFFFu);
}

}  // namespace crossbar
