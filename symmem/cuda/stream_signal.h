// Stream-ordered signals without kernels (and without SMs): the copy engine /
// front end writes or waits on a 32/64-bit word in GPU-visible memory
// (device memory, a mapped peer allocation, or registered host memory).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace crossbar::cuda {

enum class WaitCond {
  kGeq,  // (int32/int64)(*addr - value) >= 0, i.e. wrap-aware "reached value"
  kEq,   // *addr == value
};

// Writes `value` to `addr` once all prior work in `stream` is done (with a memory
// barrier, so earlier writes by that work are visible first).
void streamWriteValue32(cudaStream_t stream, uint32_t* addr, uint32_t value);
void streamWriteValue64(cudaStream_t stream, uint64_t* addr, uint64_t value);

// Later work in `stream` waits until `*addr` satisfies `cond` against `value`.
// The GPU waits without a deadline; pair it with a host-side deadline on an event
// recorded after it (CudaCopyEngine::synchronize) so a missing peer is reported.
void streamWaitValue32(cudaStream_t stream, const uint32_t* addr, uint32_t value, WaitCond cond);
void streamWaitValue64(cudaStream_t stream, const uint64_t* addr, uint64_t value, WaitCond cond);

// Whether the device supports 64-bit stream memory operations (false without a driver).
bool streamMemOps64Supported(int device);

}  // namespace crossbar::cuda
