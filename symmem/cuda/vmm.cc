#include "symmem/cuda/vmm.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "comm/errors.h"
#include "comm/log.h"
#include "symmem/cuda/driver_api.h"

namespace crossbar::cuda {

// ---- pure helpers ------------------------------------------------------------------------

size_t roundToGranularity(size_t bytes, size_t granularity) {
  if (granularity == 0) {
    throw InvalidArgument(errorContext(-1, "roundToGranularity") +
                          "granularity is 0; pass the value cuMemGetAllocationGranularity reported");
  }
  const size_t unit = std::lcm(granularity, kMinOffsetAlignment);
  if (bytes == 0) return unit;
  if (bytes > std::numeric_limits<size_t>::max() - (unit - 1)) {
    throw InvalidArgument(
        fmt::format("{}{} bytes cannot be rounded up to a multiple of {} without overflow; "
                    "request a smaller buffer",
                    errorContext(-1, "roundToGranularity"), bytes, unit));
  }
  return (bytes + unit - 1) / unit * unit;
}

size_t alignOffset(size_t offset, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    throw InvalidArgument(
        fmt::format("{}alignment {} is not a power of two", errorContext(-1, "alignOffset"), alignment));
  }
  if (offset > std::numeric_limits<size_t>::max() - (alignment - 1)) {
    throw InvalidArgument(fmt::format("{}offset {} overflows when aligned to {}",
                                      errorContext(-1, "alignOffset"), offset, alignment));
  }
  return (offset + alignment - 1) & ~(alignment - 1);
}

// ---- VmmHandleInfo serialization ---------------------------------------------------------

namespace {

constexpr size_t kHeaderBytes = 8;  // magic u32, version u16, body length u16
constexpr size_t kBodyBytes = 8 + 8 + 4 + 4 + 4 + 4 + 8 + 16 + 64;
constexpr size_t kChecksumBytes = 4;
constexpr size_t kTotalBytes = kHeaderBytes + kBodyBytes + kChecksumBytes;

uint32_t fnv1a(const uint8_t* data, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) h = (h ^ data[i]) * 16777619u;
  return h;
}

template <typename T>
void put(std::vector<uint8_t>& out, T value) {
  auto u = static_cast<std::make_unsigned_t<T>>(value);
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<uint8_t>(u >> (8 * i)));
}

template <typename T>
T get(const uint8_t*& p) {
  std::make_unsigned_t<T> u = 0;
  for (size_t i = 0; i < sizeof(T); ++i) u |= static_cast<std::make_unsigned_t<T>>(p[i]) << (8 * i);
  p += sizeof(T);
  return static_cast<T>(u);
}

[[noreturn]] void corrupt(const std::string& what) {
  throw InvalidArgument(
      errorContext(-1, "VmmHandleInfo::deserialize") + what +
      ". The bytes must come unchanged from VmmHandleInfo::serialize() of the same crossbar "
      "version on the exporting rank; check the exchange (store key, message framing)");
}

}  // namespace

std::vector<uint8_t> VmmHandleInfo::serialize() const {
  std::vector<uint8_t> out;
  out.reserve(kTotalBytes);
  put<uint32_t>(out, kMagic);
  put<uint16_t>(out, kVersion);
  put<uint16_t>(out, static_cast<uint16_t>(kBodyBytes));
  put<uint64_t>(out, size);
  put<uint64_t>(out, granularity);
  put<int32_t>(out, device);
  put<uint32_t>(out, handle_types);
  put<int32_t>(out, pid);
  put<uint32_t>(out, 0);  // reserved
  put<uint64_t>(out, allocation_id);
  out.insert(out.end(), device_uuid.begin(), device_uuid.end());
  out.insert(out.end(), fabric_handle.begin(), fabric_handle.end());
  put<uint32_t>(out, fnv1a(out.data(), out.size()));
  return out;
}

VmmHandleInfo VmmHandleInfo::deserialize(std::span<const uint8_t> bytes) {
  if (bytes.size() < kHeaderBytes)
    corrupt(fmt::format("{} bytes is shorter than the {}-byte header", bytes.size(), kHeaderBytes));
  const uint8_t* p = bytes.data();
  const uint32_t magic = get<uint32_t>(p);
  const uint16_t version = get<uint16_t>(p);
  const uint16_t body = get<uint16_t>(p);
  if (magic != kMagic) corrupt(fmt::format("bad magic {:#010x} (expected {:#010x})", magic, kMagic));
  if (version != kVersion) {
    corrupt(
        fmt::format("format version {} is not supported (this build reads version {}); run the same "
                    "crossbar version on every rank",
                    version, kVersion));
  }
  if (body != kBodyBytes || bytes.size() != kTotalBytes) {
    corrupt(fmt::format("length {} (body {}) does not match the expected {} (body {})", bytes.size(), body,
                        kTotalBytes, kBodyBytes));
  }
  const uint32_t expected = fnv1a(bytes.data(), kTotalBytes - kChecksumBytes);
  const uint8_t* q = bytes.data() + kTotalBytes - kChecksumBytes;
  if (get<uint32_t>(q) != expected) corrupt("checksum mismatch (bytes were altered in transit)");

  VmmHandleInfo info;
  info.size = get<uint64_t>(p);
  info.granularity = get<uint64_t>(p);
  info.device = get<int32_t>(p);
  info.handle_types = get<uint32_t>(p);
  info.pid = get<int32_t>(p);
  (void)get<uint32_t>(p);
  info.allocation_id = get<uint64_t>(p);
  std::memcpy(info.device_uuid.data(), p, 16);
  p += 16;
  std::memcpy(info.fabric_handle.data(), p, 64);

  if (info.size == 0 || info.granularity == 0 || info.size % info.granularity != 0) {
    corrupt(fmt::format("size {} is not a positive multiple of granularity {}", info.size, info.granularity));
  }
  if (info.device < 0) corrupt(fmt::format("device ordinal {} is negative", info.device));
  constexpr uint32_t kKnown = kVmmHandlePosixFd | kVmmHandleFabric;
  if (info.handle_types == 0 || (info.handle_types & ~kKnown) != 0) {
    corrupt(fmt::format("handle types {:#x} are not a non-empty subset of {:#x}", info.handle_types, kKnown));
  }
  if (info.pid <= 0) corrupt(fmt::format("pid {} is not positive", info.pid));
  return info;
}

// ---- allocations ---------------------------------------------------------------------------

namespace {

std::atomic<uint64_t> g_next_id{1};

CUdevice cuDevice(const DriverApi& api, int ordinal, std::string_view op) {
  CUdevice dev = 0;
  checkCu(api.cuDeviceGet(&dev, ordinal), fmt::format("{}: cuDeviceGet", op), ordinal);
  return dev;
}

// RW access for `device` and, optionally, every other local device that can peer-access it.
std::vector<CUmemAccessDesc> accessList(const DriverApi& api, int device, bool peers, std::string_view op) {
  std::vector<CUmemAccessDesc> list;
  auto add = [&](int d) {
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = cuDevice(api, d, op);
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    list.push_back(a);
  };
  add(device);
  if (peers) {
    for (int d = 0; d < deviceCount(); ++d) {
      if (d == device) continue;
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, d, device) == cudaSuccess && can) add(d);
      cudaGetLastError();
    }
  }
  return list;
}

// Tears down what create/import built, in reverse order: unmap, free the VA range,
// release the physical handle. Shared by local and peer allocations.
void releaseMapping(unsigned long long& handle, unsigned long long& ptr, bool& mapped, size_t& size,
                    const char* who) noexcept {
  if (!handle && !ptr) return;
  if (driverAvailable()) {
    const DriverApi& api = driver(who);
    if (mapped) api.cuMemUnmap(ptr, size);
    if (ptr) api.cuMemAddressFree(ptr, size);
    if (handle) api.cuMemRelease(handle);
  }
  handle = 0;
  ptr = 0;
  mapped = false;
  size = 0;
}

}  // namespace

VmmAllocation VmmAllocation::create(size_t bytes, int device, VmmOptions options) {
  constexpr std::string_view kOp = "VmmAllocation::create";
  ensureContext(device, kOp);
  const DriverApi& api = driver(kOp);
  if (!deviceAttribute(device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)) {
    throw Unsupported(
        fmt::format("{}device {} does not support CUDA virtual memory management; use the host "
                    "backend or a newer GPU/driver",
                    errorContext(-1, kOp), device));
  }
  if (!deviceAttribute(device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)) {
    throw Unsupported(
        fmt::format("{}device {} cannot export memory as POSIX file descriptors; intra-node "
                    "symmetric memory needs it (check the driver and that this is Linux)",
                    errorContext(-1, kOp), device));
  }
  const bool fabric =
      options.try_fabric && deviceAttribute(device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED);

  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = cuDevice(api, device, kOp);
  prop.requestedHandleTypes = fabric
                                  ? static_cast<CUmemAllocationHandleType>(
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC)
                                  : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  checkCu(api.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
          "cuMemGetAllocationGranularity", device);

  VmmAllocation a;
  a.device_ = device;
  a.requested_ = bytes;
  a.granularity_ = granularity;
  a.size_ = roundToGranularity(bytes, granularity);
  a.id_ = g_next_id.fetch_add(1);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = api.cuMemCreate(&h, a.size_, &prop, 0);
  if (r != CUDA_SUCCESS && fabric) {
    // Fabric needs an IMEX channel; without one, fall back to fd-only (intra-node is unaffected).
    CB_INFO("symmem", "cuMemCreate with a fabric handle failed on device {} ({}); using POSIX fds only",
            device, cuResultText(r));
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    r = api.cuMemCreate(&h, a.size_, &prop, 0);
    a.handle_types_ = kVmmHandlePosixFd;
  } else {
    a.handle_types_ = fabric ? (kVmmHandlePosixFd | kVmmHandleFabric) : kVmmHandlePosixFd;
  }
  checkCu(r, fmt::format("cuMemCreate({} bytes)", a.size_), device);
  a.handle_ = h;  // from here on, `a`'s destructor undoes partial work

  CUdeviceptr ptr = 0;
  checkCu(api.cuMemAddressReserve(&ptr, a.size_, granularity, 0, 0),
          fmt::format("cuMemAddressReserve({} bytes)", a.size_), device,
          "The process is out of GPU virtual address space; free symmetric buffers");
  a.ptr_ = ptr;
  checkCu(api.cuMemMap(ptr, a.size_, 0, h, 0), "cuMemMap", device);
  a.mapped_ = true;
  auto access = accessList(api, device, options.access_from_peers, kOp);
  checkCu(api.cuMemSetAccess(ptr, a.size_, access.data(), access.size()), "cuMemSetAccess", device);
  CB_TRACE("symmem", "VMM allocation {} bytes on device {} at {:#x} (handles {:#x})", a.size_, device, ptr,
           a.handle_types_);
  return a;
}

VmmAllocation::VmmAllocation(VmmAllocation&& o) noexcept {
  *this = std::move(o);
}

VmmAllocation& VmmAllocation::operator=(VmmAllocation&& o) noexcept {
  if (this != &o) {
    reset();
    handle_ = std::exchange(o.handle_, 0);
    ptr_ = std::exchange(o.ptr_, 0);
    mapped_ = std::exchange(o.mapped_, false);
    size_ = std::exchange(o.size_, 0);
    requested_ = o.requested_;
    granularity_ = o.granularity_;
    device_ = o.device_;
    handle_types_ = o.handle_types_;
    id_ = o.id_;
  }
  return *this;
}

VmmAllocation::~VmmAllocation() {
  reset();
}

void VmmAllocation::reset() noexcept {
  releaseMapping(handle_, ptr_, mapped_, size_, "VmmAllocation::~VmmAllocation");
}

int VmmAllocation::exportFd() const {
  constexpr std::string_view kOp = "VmmAllocation::exportFd";
  if (!valid()) throw InvalidUsage(errorContext(-1, kOp) + "the allocation is empty (moved from?)");
  const DriverApi& api = driver(kOp);
  int fd = -1;
  checkCu(api.cuMemExportToShareableHandle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle(POSIX fd)", device_,
          "Check the open-file limit (ulimit -n) and that the allocation was created with POSIX fd handles");
  return fd;
}

VmmHandleInfo VmmAllocation::info() const {
  constexpr std::string_view kOp = "VmmAllocation::info";
  if (!valid()) throw InvalidUsage(errorContext(-1, kOp) + "the allocation is empty (moved from?)");
  VmmHandleInfo info;
  info.size = size_;
  info.granularity = granularity_;
  info.device = device_;
  info.handle_types = handle_types_;
  info.pid = static_cast<int32_t>(getpid());
  info.allocation_id = id_;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_) == cudaSuccess) {
    std::memcpy(info.device_uuid.data(), prop.uuid.bytes, 16);
  }
  cudaGetLastError();
  if (handle_types_ & kVmmHandleFabric) {
    CUmemFabricHandle fh{};
    CUresult r = driver(kOp).cuMemExportToShareableHandle(&fh, handle_, CU_MEM_HANDLE_TYPE_FABRIC, 0);
    if (r == CUDA_SUCCESS) {
      static_assert(sizeof(fh.data) == 64);
      std::memcpy(info.fabric_handle.data(), fh.data, 64);
    } else {
      info.handle_types &= ~kVmmHandleFabric;  // peers will use the fd
    }
  }
  return info;
}

MappedPeerAllocation MappedPeerAllocation::import(const VmmHandleInfo& info, int fd, int local_device,
                                                  VmmOptions options) {
  const std::string op =
      fmt::format("MappedPeerAllocation::import(pid {} allocation {})", info.pid, info.allocation_id);
  ensureContext(local_device, op);
  const DriverApi& api = driver(op);
  if (info.size == 0 || info.granularity == 0 || info.size % info.granularity != 0) {
    throw InvalidArgument(
        fmt::format("{}size {} is not a positive multiple of granularity {}; the handle info "
                    "is not from VmmAllocation::info()",
                    errorContext(-1, op), info.size, info.granularity));
  }
  MappedPeerAllocation m;
  m.device_ = local_device;
  m.info_ = info;
  m.size_ = info.size;
  CUmemGenericAllocationHandle h = 0;
  if (fd >= 0) {
    checkCu(
        api.cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        fmt::format("{}: cuMemImportFromShareableHandle(fd {})", op, fd), local_device,
        "The fd must come from VmmAllocation::exportFd() in a process on this node (sent with SCM_RIGHTS) "
        "and the exporter must still be alive");
  } else if (info.handle_types & kVmmHandleFabric) {
    CUmemFabricHandle fh{};
    std::memcpy(fh.data, info.fabric_handle.data(), 64);
    checkCu(api.cuMemImportFromShareableHandle(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC),
            fmt::format("{}: cuMemImportFromShareableHandle(fabric)", op), local_device,
            "Fabric import needs an IMEX channel (/dev/nvidia-caps-imex-channels) shared with the exporter");
  } else {
    throw InvalidArgument(errorContext(-1, op) +
                          "no fd was given and the allocation has no fabric handle; send the fd from "
                          "VmmAllocation::exportFd() over a Unix socket");
  }
  m.handle_ = h;
  CUdeviceptr ptr = 0;
  checkCu(api.cuMemAddressReserve(&ptr, m.size_, info.granularity, 0, 0),
          fmt::format("{}: cuMemAddressReserve({} bytes)", op, m.size_), local_device);
  m.ptr_ = ptr;
  checkCu(api.cuMemMap(ptr, m.size_, 0, h, 0), fmt::format("{}: cuMemMap", op), local_device);
  m.mapped_ = true;
  auto access = accessList(api, local_device, options.access_from_peers, op);
  checkCu(api.cuMemSetAccess(ptr, m.size_, access.data(), access.size()),
          fmt::format("{}: cuMemSetAccess", op), local_device,
          "The exporting GPU must be this GPU or one with peer access to it (nvidia-smi topo -p2p rw)");
  return m;
}

MappedPeerAllocation::MappedPeerAllocation(MappedPeerAllocation&& o) noexcept {
  *this = std::move(o);
}

MappedPeerAllocation& MappedPeerAllocation::operator=(MappedPeerAllocation&& o) noexcept {
  if (this != &o) {
    reset();
    handle_ = std::exchange(o.handle_, 0);
    ptr_ = std::exchange(o.ptr_, 0);
    mapped_ = std::exchange(o.mapped_, false);
    size_ = std::exchange(o.size_, 0);
    device_ = o.device_;
    info_ = o.info_;
  }
  return *this;
}

MappedPeerAllocation::~MappedPeerAllocation() {
  reset();
}

void MappedPeerAllocation::reset() noexcept {
  releaseMapping(handle_, ptr_, mapped_, size_, "MappedPeerAllocation::~MappedPeerAllocation");
}

// ---- multicast ----------------------------------------------------------------------------

bool multicastSupported(int device) {
  if (!driverAvailable()) return false;
  const DriverApi& api = driver("multicastSupported");
  if (!api.cuMulticastCreate || !api.cuMulticastBindMem) return false;
  return deviceAttribute(device, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED) != 0;
}

MulticastObject MulticastObject::create(size_t bytes, unsigned num_devices, int device) {
  constexpr std::string_view kOp = "MulticastObject::create";
  ensureContext(device, kOp);
  const DriverApi& api = driver(kOp);
  if (!multicastSupported(device)) {
    throw Unsupported(
        fmt::format("{}device {} does not support multicast (needs NVSwitch/NVLS, CUDA 12.1+ "
                    "driver); use unicast symmetric memory instead",
                    errorContext(-1, kOp), device));
  }
  if (num_devices == 0) throw InvalidArgument(errorContext(-1, kOp) + "num_devices must be at least 1");
  CUmulticastObjectProp prop{};
  prop.numDevices = num_devices;
  prop.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.size = bytes;
  size_t granularity = 0;
  checkCu(api.cuMulticastGetGranularity(&granularity, &prop, CU_MULTICAST_GRANULARITY_RECOMMENDED),
          "cuMulticastGetGranularity", device);
  prop.size = roundToGranularity(bytes, granularity);
  MulticastObject m;
  m.device_ = device;
  m.size_ = prop.size;
  CUmemGenericAllocationHandle h = 0;
  checkCu(api.cuMulticastCreate(&h, &prop),
          fmt::format("cuMulticastCreate({} bytes, {} devices)", prop.size, num_devices), device);
  m.handle_ = h;
  return m;
}

void MulticastObject::addDevice(int device) {
  const DriverApi& api = driver("MulticastObject::addDevice");
  checkCu(api.cuMulticastAddDevice(handle_, cuDevice(api, device, "MulticastObject::addDevice")),
          "cuMulticastAddDevice", device, "Add every device of the team before binding memory");
}

void* MulticastObject::bindAndMap(const VmmAllocation& memory) {
  constexpr std::string_view kOp = "MulticastObject::bindAndMap";
  const DriverApi& api = driver(kOp);
  if (!handle_ || !memory.valid() || memory.size() < size_) {
    throw InvalidArgument(fmt::format("{}memory of {} bytes cannot back a {}-byte multicast object",
                                      errorContext(-1, kOp), memory.size(), size_));
  }
  checkCu(api.cuMulticastBindMem(handle_, 0, memory.handle(), 0, size_, 0), "cuMulticastBindMem", device_);
  bound_ = true;
  CUdeviceptr ptr = 0;
  checkCu(api.cuMemAddressReserve(&ptr, size_, 0, 0, 0), "cuMemAddressReserve(multicast)", device_);
  ptr_ = ptr;
  checkCu(api.cuMemMap(ptr, size_, 0, handle_, 0), "cuMemMap(multicast)", device_);
  mapped_ = true;
  auto access = accessList(api, device_, false, kOp);
  checkCu(api.cuMemSetAccess(ptr, size_, access.data(), access.size()), "cuMemSetAccess(multicast)", device_);
  return reinterpret_cast<void*>(ptr_);
}

MulticastObject::MulticastObject(MulticastObject&& o) noexcept {
  *this = std::move(o);
}

MulticastObject& MulticastObject::operator=(MulticastObject&& o) noexcept {
  if (this != &o) {
    reset();
    handle_ = std::exchange(o.handle_, 0);
    ptr_ = std::exchange(o.ptr_, 0);
    mapped_ = std::exchange(o.mapped_, false);
    bound_ = std::exchange(o.bound_, false);
    size_ = std::exchange(o.size_, 0);
    device_ = o.device_;
  }
  return *this;
}

MulticastObject::~MulticastObject() {
  reset();
}

void MulticastObject::reset() noexcept {
  if (!handle_ && !ptr_) return;
  if (driverAvailable()) {
    const DriverApi& api = driver("MulticastObject::~MulticastObject");
    if (mapped_) api.cuMemUnmap(ptr_, size_);
    if (ptr_) api.cuMemAddressFree(ptr_, size_);
    CUdevice dev = 0;
    if (bound_ && api.cuDeviceGet(&dev, device_) == CUDA_SUCCESS)
      api.cuMulticastUnbind(handle_, dev, 0, size_);
    if (handle_) api.cuMemRelease(handle_);
  }
  handle_ = 0;
  ptr_ = 0;
  mapped_ = false;
  bound_ = false;
  size_ = 0;
}

}  // namespace crossbar::cuda
