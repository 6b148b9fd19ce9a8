// Test kernels for SymmDeviceHandle (compiled by nvcc in gpu_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "symmem/cuda/device_handle.h"

namespace crossbar::gpucheck {

enum class SignalMode { kAdd, kStore };

// Each rank writes a pattern (rank, index, epoch) into region [rank] of every
// peer's buffer, signals it (kAdd: every block atomically adds 1; kStore: a
// single block stores `epoch` with release), waits for every peer's signal to reach
// `expected`, then counts mismatches of the peers' regions in its own buffer into
// *errors. Each region is `words` uint32.
cudaError_t launchExchange(const crossbar::cuda::SymmDeviceHandle& handle, uint32_t* errors, size_t words,
                           uint64_t epoch, uint64_t expected, long long timeout_cycles, SignalMode mode,
                           int blocks, cudaStream_t stream);

// Host copy of the pattern for checks.
uint32_t exchangePattern(int rank, size_t index, uint64_t epoch);

}  // namespace crossbar::gpucheck
