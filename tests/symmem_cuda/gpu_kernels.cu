#include "gpu_kernels.h"

namespace crossbar::gpucheck {

using crossbar::cuda::SymmDeviceHandle;

__host__ __device__ inline uint32_t pattern(int rank, size_t index, uint64_t epoch) {
  return (static_cast<uint32_t>(rank + 1) * 0x9E3779B1u) ^ static_cast<uint32_t>(index * 2654435761u) ^
         static_cast<uint32_t>(epoch << 24);
}

uint32_t exchangePattern(int rank, size_t index, uint64_t epoch) {
  return pattern(rank, index, epoch);
}

__global__ void exchangeKernel(SymmDeviceHandle h, uint32_t* errors, size_t words, uint64_t epoch,
                               uint64_t expected, long long timeout_cycles, int store_mode) {
  const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (int p = 0; p < h.local_size; ++p) {
    if (p == h.rank) continue;
    uint32_t* dst = h.peer<uint32_t>(p, h.rank * words * sizeof(uint32_t));
    for (size_t i = tid; i < words; i += stride) dst[i] = pattern(h.rank, i, epoch);
  }
  __syncthreads();
  __shared__ int ok;
  if (threadIdx.x == 0) {
    for (int p = 0; p < h.local_size; ++p) {
      if (p == h.rank) continue;
      if (store_mode) {
        h.putSignal(p, epoch);
      } else {
        h.addSignal(p, 1);
      }
    }
    ok = 1;
    for (int p = 0; p < h.local_size; ++p) {
      if (p != h.rank && !h.waitSignal(p, expected, timeout_cycles)) ok = 0;
    }
  }
  __syncthreads();
  if (!ok) return;
  for (int p = 0; p < h.local_size; ++p) {
    if (p == h.rank) continue;
    const uint32_t* src = h.peer<uint32_t>(h.rank, p * words * sizeof(uint32_t));
    for (size_t i = tid; i < words; i += stride) {
      if (src[i] != pattern(p, i, epoch)) atomicAdd(errors, 1u);
    }
  }
}

cudaError_t launchExchange(const SymmDeviceHandle& handle, uint32_t* errors, size_t words, uint64_t epoch,
                           uint64_t expected, long long timeout_cycles, SignalMode mode, int blocks,
                           cudaStream_t stream) {
  if (mode == SignalMode::kStore) blocks = 1;  // one writer per slot: only one block may store
  exchangeKernel<<<blocks, 256, 0, stream>>>(handle, errors, words, epoch, expected, timeout_cycles,
                                             mode == SignalMode::kStore ? 1 : 0);
  return cudaGetLastError();
}

}  // namespace crossbar::gpucheck
