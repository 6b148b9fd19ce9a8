// CUDA backend of the symmetric heap: every rank's segment is a VMM allocation
// (symmem/cuda/vmm.h) exported as a POSIX fd plus VmmHandleInfo bytes, so
//
//   auto heap = symm::SymmetricHeap::create(comm, {.allocator = cuda::makeCudaSegmentAllocator(dev)});
//
// gives cross-process GPU symmetric buffers through the heap's own fd exchange.
// peerPtr(r) is then a device address (usable by kernels, cudaMemcpy* and stream
// memory operations on `device`), and the signal pad lives in device memory in the
// same allocation: signal from streams or kernels (symmem/cuda/cuda_symmetric.h);
// the heap's host-side put/get/signal calls raise Unsupported for this backend.
#pragma once

#include <memory>

#include "symmem/segment_allocator.h"

namespace crossbar::cuda {

// Segments on CUDA device `device` (an ordinal of this process), mapped RW on it.
// Creating the allocator touches no driver; allocate(), import() and granularity()
// raise Unsupported without a driver/device (or without VMM / fd export support).
// Segments are zero-filled (the heap's signal counters start at 0).
std::shared_ptr<symm::SegmentAllocator> makeCudaSegmentAllocator(int device);

}  // namespace crossbar::cuda
