// SegmentAllocator: the small backend interface under SymmetricHeap. A backend
// creates this rank's segment of a symmetric buffer, exports it as a POSIX fd plus
// opaque bytes, and maps the segments that local peers exported. The heap does the
// rest (rendezvous over Unix sockets, signal pads, UCX registration), so the CUDA
// backend (symmem/cuda: VMM allocations exported as fds) plugs in without changing
// the heap. The host backend is HostSegmentAllocator (memfd, symmem/host_segment.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace crossbar::symm {

enum class MemoryKind { kHost, kCuda };

// One mapping of a segment in this process: our own (allocate) or a peer's (import).
// Destroying it unmaps (and, for our own, frees once no process maps it any more).
class Segment {
 public:
  virtual ~Segment() = default;
  virtual void* ptr() const = 0;
  virtual size_t size() const = 0;
  // A new fd for a peer; the caller closes it. Only valid until exportDone().
  virtual int exportFd() const = 0;
  // Backend bytes a peer needs besides the fd (sizes, device, handle info).
  virtual std::vector<uint8_t> exportInfo() const { return {}; }
  // Every peer has imported: drop export-only resources (the host backend closes its fd,
  // so a buffer costs no descriptor once mapped everywhere).
  virtual void exportDone() {}
  // Backend-specific description for logs ("memfd 2 MiB huge pages").
  virtual std::string describe() const = 0;
};

struct SegmentRequest {
  size_t bytes = 0;
  std::string name;  // shows in /proc/PID/maps where the backend supports it
  int rank = -1;     // for error messages
};

class SegmentAllocator {
 public:
  virtual ~SegmentAllocator() = default;
  virtual const char* name() const = 0;
  virtual MemoryKind kind() const = 0;
  // True when the CPU may load/store the memory (host signal pads and memcpy puts need it).
  virtual bool hostAccessible() const = 0;
  // Segment sizes are rounded up to a multiple of this.
  virtual size_t granularity() const = 0;
  // Creates and maps this rank's zero-filled segment of at least request.bytes.
  virtual std::unique_ptr<Segment> allocate(const SegmentRequest& request) = 0;
  // Maps a local peer's segment from the fd it exported (not consumed: the caller
  // closes it) and the info bytes that came with it.
  virtual std::unique_ptr<Segment> import(int fd, std::span<const uint8_t> info, size_t bytes, int rank) = 0;
};

struct HostSegmentOptions {
  bool huge_pages = true;  // MFD_HUGETLB when the pool has pages; silent fallback
  bool populate = true;    // fault the pages in now, by the owner: first touch puts them on its NUMA node
  bool bind_numa = true;   // also mbind() them to the owner's current NUMA node (best effort)
};

// memfd segments (comm/shm_segment.h). Options default from CROSSBAR_SYMMEM_HUGEPAGES.
std::unique_ptr<SegmentAllocator> makeHostSegmentAllocator();
std::unique_ptr<SegmentAllocator> makeHostSegmentAllocator(const HostSegmentOptions& options);

}  // namespace crossbar::symm
