// Front-end hook of the host Collectives (collectives.cc): calls whose buffers are CUDA
// device memory, or that carry CollOptions::cuda_stream, run on CudaCollectives
// (stream-ordered); everything else stays on the host path. Builds without CUDA keep
// the host behavior and refuse device pointers and cuda_stream with Unsupported.
#pragma once

#include <memory>

#include "collectives/algorithms.h"
#include "collectives/collectives.h"

namespace crossbar {

class CudaRoute;  // per Collectives: its lazily created CudaCollectives

// nullptr: host memory, run on the host path. Otherwise the CUDA Work (the first
// such call creates `state`, collectively: every rank routes the same call).
// `in_group`: inside groupStart()/groupEnd() (not supported for device memory).
WorkPtr routeToCuda(std::shared_ptr<CudaRoute>& state, const std::shared_ptr<Communicator>& comm,
                    const CollArgs& args, const CollOptions& options, bool in_group);

// kCuda when `ptr` is CUDA device memory. kHost without a driver, or before this
// process loaded the driver (no device memory can exist then). Builds without CUDA ask
// the driver through dlsym when libcuda is loaded.
MemoryKind pointerMemoryKind(const void* ptr);

}  // namespace crossbar
