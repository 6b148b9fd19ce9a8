#include "symmem/cuda/cuda_symmetric.h"

#include <fmt/format.h>

#include "comm/errors.h"
#include "symmem/cuda/driver_api.h"
#include "symmem/cuda/stream_signal.h"

namespace crossbar::cuda {
namespace {

static_assert(symm::SymmetricBuffer::kSignalSlotBytes % sizeof(uint64_t) == 0);
constexpr int kSlotWords = static_cast<int>(symm::SymmetricBuffer::kSignalSlotBytes / sizeof(uint64_t));

void requireCudaBuffer(const symm::SymmetricBuffer& buffer, std::string_view op) {
  if (buffer.freed())
    throw InvalidUsage(errorContext(buffer.rank(), op) + fmt::format("buffer #{} was freed", buffer.id()));
  if (buffer.memoryKind() != symm::MemoryKind::kCuda)
    throw InvalidArgument(errorContext(buffer.rank(), op) +
                          fmt::format("buffer #{} is host memory; use its own putSignal()/waitSignal(), or "
                                      "allocate from a heap with makeCudaSegmentAllocator()",
                                      buffer.id()));
}

void requireRank(const symm::SymmetricBuffer& buffer, int r, std::string_view what, std::string_view op) {
  if (r < 0 || r >= buffer.worldSize())
    throw InvalidArgument(
        errorContext(buffer.rank(), op) +
        fmt::format("{} {} is not a rank of this {}-rank buffer", what, r, buffer.worldSize()));
}

int currentDevice() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return d;
}

}  // namespace

uint64_t* signalSlotAddress(const symm::SymmetricBuffer& buffer, int owner, int sender, int channel) {
  constexpr std::string_view kOp = "signalSlotAddress";
  requireCudaBuffer(buffer, kOp);
  requireRank(buffer, owner, "owner", kOp);
  requireRank(buffer, sender, "sender", kOp);
  if (channel < 0 || channel >= buffer.channels())
    throw InvalidArgument(
        errorContext(buffer.rank(), kOp) +
        fmt::format("channel {} is out of range: the heap has {} channels", channel, buffer.channels()));
  char* base = static_cast<char*>(buffer.peerPtr(owner));
  if (!base)
    throw InvalidArgument(errorContext(buffer.rank(), kOp) +
                          fmt::format("rank {} is on another node: its GPU memory is not mapped here (use "
                                      "NCCL for off-node peers)",
                                      owner));
  return reinterpret_cast<uint64_t*>(base + buffer.signalPadOffset() +
                                     buffer.signalSlot(sender, channel) *
                                         symm::SymmetricBuffer::kSignalSlotBytes);
}

void streamPutSignal(symm::SymmetricBuffer& buffer, int peer, int channel, cudaStream_t stream) {
  uint64_t* slot = signalSlotAddress(buffer, peer, buffer.rank(), channel);
  // Count only once the address is valid, so a rejected call does not skew the counters.
  streamWriteValue64(stream, slot, buffer.reserveSignal(peer, channel));
}

void streamWaitSignal(symm::SymmetricBuffer& buffer, int peer, int channel, cudaStream_t stream) {
  const uint64_t* slot = signalSlotAddress(buffer, buffer.rank(), peer, channel);
  if (!buffer.isLocalPeer(peer))
    throw InvalidArgument(errorContext(buffer.rank(), "streamWaitSignal") +
                          fmt::format("rank {} is on another node and cannot signal this pad", peer));
  streamWaitValue64(stream, slot, buffer.reserveWait(peer, channel), WaitCond::kGeq);
}

void streamPutWithSignal(symm::SymmetricBuffer& buffer, int peer, size_t dst_offset, const void* src,
                         size_t bytes, int channel, cudaStream_t stream) {
  constexpr std::string_view kOp = "streamPutWithSignal";
  (void)signalSlotAddress(buffer, peer, buffer.rank(), channel);  // validates before anything is enqueued
  if (dst_offset > buffer.size() || bytes > buffer.size() - dst_offset)
    throw InvalidArgument(errorContext(buffer.rank(), kOp) +
                          fmt::format("[{}, {}+{}) is outside the {}-byte buffer #{} (peer {})", dst_offset,
                                      dst_offset, bytes, buffer.size(), buffer.id(), peer));
  if (bytes > 0)
    checkCuda(cudaMemcpyAsync(buffer.peer<char>(peer, dst_offset), src, bytes, cudaMemcpyDefault, stream),
              fmt::format("{}: cudaMemcpyAsync of {} bytes to rank {}", kOp, bytes, peer), currentDevice(),
              "src must be device memory or host memory the device can read; the stream must belong to the "
              "buffer's device");
  streamPutSignal(buffer, peer, channel, stream);
}

SymmDeviceHandle makeDeviceHandle(const symm::SymmetricBuffer& buffer, int channel) {
  constexpr std::string_view kOp = "makeDeviceHandle";
  requireCudaBuffer(buffer, kOp);
  if (buffer.worldSize() > kMaxLocalRanks)
    throw InvalidArgument(errorContext(buffer.rank(), kOp) +
                          fmt::format("{} ranks; a device handle addresses at most {} (one node's GPUs)",
                                      buffer.worldSize(), kMaxLocalRanks));
  SymmDeviceHandle h{};
  for (int r = 0; r < buffer.worldSize(); ++r) {
    h.peer_ptrs[r] = buffer.peerPtr(r);
    h.signal_pads[r] = signalSlotAddress(buffer, r, 0, channel);  // slot of sender 0; others at stride
  }
  h.signal_stride = kSlotWords;
  h.timeout_flag = nullptr;
  h.rank = buffer.rank();
  h.local_size = buffer.worldSize();
  h.size = buffer.size();
  return h;
}

}  // namespace crossbar::cuda
