// CUDA virtual memory management (cuMem*) allocations that other processes map:
// an allocation is exported as a POSIX file descriptor (sent over a Unix socket,
// see comm/fd_exchange.h) plus a small VmmHandleInfo describing it; the peer
// imports both into a MappedPeerAllocation. Fabric handles are requested too
// where the device supports them (multi-node NVLink), with a fallback to fd only.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace crossbar::cuda {

// Offsets inside symmetric buffers are aligned to at least this.
inline constexpr size_t kMinOffsetAlignment = 4096;

// Rounds `bytes` up to a multiple of lcm(granularity, kMinOffsetAlignment); 0 bytes
// gives one unit. Throws InvalidArgument for granularity 0 or on overflow.
size_t roundToGranularity(size_t bytes, size_t granularity);

// Rounds an offset up to `alignment` (a power of two >= 1).
size_t alignOffset(size_t offset, size_t alignment = kMinOffsetAlignment);

enum VmmHandleTypeBits : uint32_t {
  kVmmHandlePosixFd = 1u << 0,
  kVmmHandleFabric = 1u << 1,
};

// What a peer needs, besides the fd, to import an allocation. Serialized as
// versioned little-endian bytes with a checksum.
struct VmmHandleInfo {
  static constexpr uint32_t kMagic = 0x4D4D5658;  // "XVMM"
  static constexpr uint16_t kVersion = 1;

  uint64_t size = 0;           // bytes, a multiple of granularity
  uint64_t granularity = 0;    // recommended granularity used when creating
  int32_t device = -1;         // ordinal in the exporting process
  uint32_t handle_types = 0;   // VmmHandleTypeBits the allocation can be exported as
  int32_t pid = 0;             // exporting process (diagnostics, pidfd_getfd)
  uint64_t allocation_id = 0;  // unique per exporting process, for matching fds to infos
  std::array<uint8_t, 16> device_uuid{};
  std::array<uint8_t, 64> fabric_handle{};  // valid when handle_types has kVmmHandleFabric

  std::vector<uint8_t> serialize() const;
  // Throws InvalidArgument naming what is wrong (truncated, bad magic/version/checksum, bad field).
  static VmmHandleInfo deserialize(std::span<const uint8_t> bytes);
  bool operator==(const VmmHandleInfo&) const = default;
};

struct VmmOptions {
  bool try_fabric = true;         // also request a fabric handle if the device supports it
  bool access_from_peers = true;  // grant RW to every local device that can peer-access this one
};

// Device memory from cuMemCreate, mapped at ptr() in this process. Move-only; the
// destructor unmaps, frees the VA range and releases the handle (in that order).
class VmmAllocation {
 public:
  // Requires a driver; Unsupported without one or without VMM/posix-fd support.
  static VmmAllocation create(size_t bytes, int device, VmmOptions options = {});

  VmmAllocation() = default;
  VmmAllocation(VmmAllocation&& other) noexcept;
  VmmAllocation& operator=(VmmAllocation&& other) noexcept;
  VmmAllocation(const VmmAllocation&) = delete;
  VmmAllocation& operator=(const VmmAllocation&) = delete;
  ~VmmAllocation();

  void* ptr() const { return reinterpret_cast<void*>(ptr_); }
  size_t size() const { return size_; }  // rounded size
  size_t requestedSize() const { return requested_; }
  size_t granularity() const { return granularity_; }
  int device() const { return device_; }
  uint32_t handleTypes() const { return handle_types_; }
  bool valid() const { return handle_ != 0; }
  unsigned long long handle() const { return handle_; }  // CUmemGenericAllocationHandle

  // A new POSIX fd for this allocation; the caller owns (and closes) it.
  int exportFd() const;
  // Everything the peer needs besides the fd (includes the fabric handle when available).
  VmmHandleInfo info() const;

 private:
  void reset() noexcept;
  unsigned long long handle_ = 0;
  unsigned long long ptr_ = 0;
  bool mapped_ = false;
  size_t size_ = 0;
  size_t requested_ = 0;
  size_t granularity_ = 0;
  int device_ = -1;
  uint32_t handle_types_ = 0;
  uint64_t id_ = 0;
};

// A peer's allocation mapped into this process on `local_device`.
class MappedPeerAllocation {
 public:
  // Imports from a POSIX fd (not consumed: the caller still closes it; the import
  // holds its own reference). fd < 0 imports info.fabric_handle instead.
  static MappedPeerAllocation import(const VmmHandleInfo& info, int fd, int local_device,
                                     VmmOptions options = {});

  MappedPeerAllocation() = default;
  MappedPeerAllocation(MappedPeerAllocation&& other) noexcept;
  MappedPeerAllocation& operator=(MappedPeerAllocation&& other) noexcept;
  MappedPeerAllocation(const MappedPeerAllocation&) = delete;
  MappedPeerAllocation& operator=(const MappedPeerAllocation&) = delete;
  ~MappedPeerAllocation();

  void* ptr() const { return reinterpret_cast<void*>(ptr_); }
  size_t size() const { return size_; }
  int localDevice() const { return device_; }
  const VmmHandleInfo& info() const { return info_; }
  bool valid() const { return handle_ != 0; }

 private:
  void reset() noexcept;
  unsigned long long handle_ = 0;
  unsigned long long ptr_ = 0;
  bool mapped_ = false;
  size_t size_ = 0;
  int device_ = -1;
  VmmHandleInfo info_;
};

// CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (false without a driver; never throws).
bool multicastSupported(int device);

// A multicast object over `num_devices` devices (NVLS). Minimal: create, add the
// local device, bind a VmmAllocation, map the multicast address. Single-process
// teams only for now (exporting the multicast handle to peers is future work).
class MulticastObject {
 public:
  static MulticastObject create(size_t bytes, unsigned num_devices, int device);
  MulticastObject() = default;
  MulticastObject(MulticastObject&& other) noexcept;
  MulticastObject& operator=(MulticastObject&& other) noexcept;
  MulticastObject(const MulticastObject&) = delete;
  MulticastObject& operator=(const MulticastObject&) = delete;
  ~MulticastObject();

  void addDevice(int device);
  // Binds `memory` (whole size) at offset 0 and maps the multicast range; returns its address.
  void* bindAndMap(const VmmAllocation& memory);
  size_t size() const { return size_; }
  void* ptr() const { return reinterpret_cast<void*>(ptr_); }

 private:
  void reset() noexcept;
  unsigned long long handle_ = 0;
  unsigned long long ptr_ = 0;
  bool mapped_ = false;
  size_t size_ = 0;
  int device_ = -1;
  bool bound_ = false;
};

}  // namespace crossbar::cuda
