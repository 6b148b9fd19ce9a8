// Stream-ordered signals and device handles for symmetric buffers whose memory is
// on a GPU (a SymmetricHeap with makeCudaSegmentAllocator). The signal pad lives in
// device memory in the same allocation as the data; these helpers write and wait on
// the heap's pad slots with cuStreamWriteValue64 / cuStreamWaitValue64, so the copy
// engine and front end signal without a kernel and without an SM.
//
//   cudaMemcpyAsync(buf->peer<char>(peer, off), src, n, cudaMemcpyDefault, s);  // or streamPut()
//   cuda::streamPutSignal(*buf, peer, /*channel=*/0, s);   // after the copy, in stream order
//   ...                                                     // on `peer`:
//   cuda::streamWaitSignal(*buf, sender, 0, s2);           // later work in s2 sees the data
//
// Counters follow the heap's rules: each (channel, sender) counter only grows, one
// streamPutSignal() matches one streamWaitSignal(). The host side only counts (it
// never reads device memory), so the values are decided at enqueue time: enqueue a
// buffer's signals for one (peer, channel) from one thread, in the order they must
// land. Kernels using makeDeviceHandle() on the same channel write the same slots;
// use separate channels for kernel and stream signals unless they agree on values.
//
// The GPU waits without a deadline: bound it on the host (record an event after the
// wait and poll it with a deadline, as CudaCopyEngine::synchronize does).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "symmem/cuda/device_handle.h"
#include "symmem/symmetric_heap.h"

namespace crossbar::cuda {

// Device address of the counter that `sender` writes for `channel` in `owner`'s pad
// (mapped in this process). InvalidArgument for host buffers, bad ranks/channels or
// off-node owners.
uint64_t* signalSlotAddress(const symm::SymmetricBuffer& buffer, int owner, int sender, int channel);

// Adds one to this rank's counter in `peer`'s pad once all earlier work in `stream`
// is done (with a memory barrier: writes by that work are visible to the peer first).
void streamPutSignal(symm::SymmetricBuffer& buffer, int peer, int channel, cudaStream_t stream);

// Later work in `stream` waits for the next signal from `peer` on `channel`.
void streamWaitSignal(symm::SymmetricBuffer& buffer, int peer, int channel, cudaStream_t stream);

// Enqueues a copy of [src, src+bytes) (device or host memory) to `peer`'s buffer at
// `dst_offset` (a copy engine does it), then streamPutSignal() on `channel`.
void streamPutWithSignal(symm::SymmetricBuffer& buffer, int peer, size_t dst_offset, const void* src,
                         size_t bytes, int channel, cudaStream_t stream);

// The buffer as a kernel sees it: peer_ptrs[r] = peerPtr(r), signal_pads[r] = rank
// r's pad slots of `channel` (signal_stride 2: the heap's 16-byte slots). Every
// rank must be on this node and worldSize() <= kMaxLocalRanks; InvalidArgument
// otherwise. Needs no driver (pure address arithmetic).
SymmDeviceHandle makeDeviceHandle(const symm::SymmetricBuffer& buffer, int channel = 0);

}  // namespace crossbar::cuda
