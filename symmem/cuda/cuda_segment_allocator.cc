#include "symmem/cuda/cuda_segment_allocator.h"

#include <fmt/format.h>

#include <mutex>

#include "comm/errors.h"
#include "symmem/cuda/driver_api.h"
#include "symmem/cuda/vmm.h"

namespace crossbar::cuda {
namespace {

class CudaSegment : public symm::Segment {
 public:
  explicit CudaSegment(VmmAllocation a) : own_(std::move(a)) {}
  explicit CudaSegment(MappedPeerAllocation m) : peer_(std::move(m)) {}

  void* ptr() const override { return own_.valid() ? own_.ptr() : peer_.ptr(); }
  size_t size() const override { return own_.valid() ? own_.size() : peer_.size(); }
  int exportFd() const override {
    if (!own_.valid()) return -1;  // a peer's mapping is never re-exported
    return own_.exportFd();
  }
  std::vector<uint8_t> exportInfo() const override {
    return own_.valid() ? own_.info().serialize() : std::vector<uint8_t>{};
  }
  std::string describe() const override {
    if (own_.valid())
      return fmt::format("CUDA VMM {} bytes on device {} (granularity {})", own_.size(), own_.device(),
                         own_.granularity());
    return fmt::format("CUDA VMM {} bytes of pid {} device {}, mapped on device {} (peer)", peer_.size(),
                       peer_.info().pid, peer_.info().device, peer_.localDevice());
  }

 private:
  VmmAllocation own_;
  MappedPeerAllocation peer_;
};

class CudaSegmentAllocator : public symm::SegmentAllocator {
 public:
  explicit CudaSegmentAllocator(int device) : device_(device) {}
  const char* name() const override { return "cuda"; }
  symm::MemoryKind kind() const override { return symm::MemoryKind::kCuda; }
  bool hostAccessible() const override { return false; }

  size_t granularity() const override {
    // Queried once, lazily: constructing the allocator must not initialize CUDA
    // (a process may build options before it forks its CUDA ranks).
    std::call_once(granularity_once_, [this] {
      constexpr std::string_view kOp = "CUDA segment allocator granularity";
      ensureContext(device_, kOp);
      const DriverApi& api = driver(kOp);
      CUdevice dev = 0;
      checkCu(api.cuDeviceGet(&dev, device_), "cuDeviceGet", device_);
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = dev;
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      size_t g = 0;
      checkCu(api.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
              "cuMemGetAllocationGranularity", device_);
      granularity_ = roundToGranularity(1, g);  // lcm with the offset alignment
    });
    return granularity_;
  }

  std::unique_ptr<symm::Segment> allocate(const symm::SegmentRequest& request) override {
    const std::string op = fmt::format("CUDA symmetric segment '{}' ({} bytes)", request.name, request.bytes);
    VmmAllocation a = VmmAllocation::create(request.bytes, device_);
    // cuMemCreate memory is not zeroed; the heap promises zero-filled buffers and its
    // signal counters must start at 0. Synchronous: peers import only after we return.
    ensureContext(device_, op);
    checkCuda(cudaMemsetAsync(a.ptr(), 0, a.size(), nullptr), fmt::format("cudaMemsetAsync({})", op),
              device_);
    checkCuda(cudaStreamSynchronize(nullptr), fmt::format("cudaStreamSynchronize({})", op), device_);
    (void)request.rank;
    return std::make_unique<CudaSegment>(std::move(a));
  }

  std::unique_ptr<symm::Segment> import(int fd, std::span<const uint8_t> info_bytes, size_t bytes,
                                        int rank) override {
    const std::string op = fmt::format("importing rank {}'s CUDA symmetric segment", rank);
    if (info_bytes.empty())
      throw InvalidArgument(errorContext(rank, op) +
                            "no VmmHandleInfo bytes came with the fd; every local rank must use the CUDA "
                            "allocator (HeapOptions::allocator) for this heap");
    // Parse before touching the driver: malformed bytes are a bug to report as such.
    VmmHandleInfo info = VmmHandleInfo::deserialize(info_bytes);
    if (info.size != bytes)
      throw InvalidArgument(errorContext(rank, op) +
                            fmt::format("the handle describes {} bytes but the heap announced {}; the "
                                        "ranks' allocators disagree (same device type and driver?)",
                                        info.size, bytes));
    if (fd < 0) throw InvalidArgument(errorContext(rank, op) + "no file descriptor came with the handle");
    return std::make_unique<CudaSegment>(MappedPeerAllocation::import(info, fd, device_));
  }

 private:
  int device_;
  mutable std::once_flag granularity_once_;
  mutable size_t granularity_ = 0;
};

}  // namespace

std::shared_ptr<symm::SegmentAllocator> makeCudaSegmentAllocator(int device) {
  if (device < 0)
    throw InvalidArgument(errorContext(-1, "makeCudaSegmentAllocator") +
                          fmt::format("device {} is not a CUDA device ordinal; pass the device this rank "
                                      "uses (e.g. its local rank)",
                                      device));
  return std::make_shared<CudaSegmentAllocator>(device);
}

}  // namespace crossbar::cuda
