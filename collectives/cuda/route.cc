#include "collectives/cuda/route.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>
#include <time.h>

#include <atomic>

#include "comm/errors.h"

#if defined(CROSSBAR_HAVE_CUDA_COLLECTIVES)
#include <cuda_runtime_api.h>

#include "collectives/cuda/cuda_collectives.h"
#include "symmem/cuda/driver_api.h"
#endif

namespace crossbar {

namespace {

// libcuda's handle if this process has loaded it, else null. A failing
// dlopen(RTLD_NOLOAD) still searches the library path (hundreds of failing openat
// calls, 50-500 us), and every host collective asks for both buffers. The loader's
// count of objects ever added only grows, so a miss stays valid until it changes.
//
// Reading that count takes the loader lock (~200 instructions, a fifth of a small
// call's issue cost), so after a miss the loader is asked again only once
// kDriverRecheckNs have passed. A device pointer needs the driver loaded, initialized
// and a context with an allocation, which takes far longer than that window, so no
// device buffer can reach a call in between.
constexpr int64_t kDriverRecheckNs = 2'000'000;

void* loadedLibcuda() {
  static std::atomic<int64_t> next_look_ns{0};
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);  // vDSO, no system call
  const int64_t now_ns = ts.tv_sec * 1'000'000'000LL + ts.tv_nsec;
  if (now_ns < next_look_ns.load(std::memory_order_relaxed)) return nullptr;
  static std::atomic<unsigned long long> missed_at{~0ull};
  unsigned long long adds = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        *static_cast<unsigned long long*>(data) = info->dlpi_adds;
        return 1;
      },
      &adds);
  void* h = adds == missed_at.load(std::memory_order_relaxed) ? nullptr
                                                               : dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!h) {
    missed_at.store(adds, std::memory_order_relaxed);
    next_look_ns.store(now_ns + kDriverRecheckNs, std::memory_order_relaxed);
  }
  return h;
}

}  // namespace

#if defined(CROSSBAR_HAVE_CUDA_COLLECTIVES)

class CudaRoute {
 public:
  explicit CudaRoute(const std::shared_ptr<Communicator>& comm) : cc(comm) {}
  CudaCollectives cc;
};

namespace {

// Device memory can only exist once this process has loaded the driver; checking for
// it first keeps host-only processes from initializing CUDA on every call.
bool driverLoaded() {
  static std::atomic<bool> loaded{false};
  if (loaded.load(std::memory_order_relaxed)) return true;
  void* h = loadedLibcuda();
  if (!h) return false;
  dlclose(h);
  loaded.store(true, std::memory_order_relaxed);
  return true;
}

}  // namespace

namespace {
// The driver is loaded (driverLoaded()).
MemoryKind askDriver(const void* ptr) {
  if (!ptr) return MemoryKind::kHost;
  cudaPointerAttributes at{};
  if (cudaPointerGetAttributes(&at, ptr) != cudaSuccess) {
    cudaGetLastError();  // unregistered host memory on old runtimes
    return MemoryKind::kHost;
  }
  return at.type == cudaMemoryTypeDevice ? MemoryKind::kCuda : MemoryKind::kHost;
}
}  // namespace

MemoryKind pointerMemoryKind(const void* ptr) {
  return ptr && driverLoaded() ? askDriver(ptr) : MemoryKind::kHost;
}

WorkPtr routeToCuda(std::shared_ptr<CudaRoute>& state, const std::shared_ptr<Communicator>& comm,
                    const CollArgs& a, const CollOptions& o, bool in_group) {
  // One driver check per call (each costs a loader-lock round trip while CUDA is absent).
  const bool device = driverLoaded() && (askDriver(a.send) == MemoryKind::kCuda ||
                                         askDriver(a.recv) == MemoryKind::kCuda);
  if (!device && !o.cuda_stream) return nullptr;
  const char* name = collTypeName(a.coll);
  if (!cuda::driverAvailable())
    throw Unsupported(errorContext(comm->rank(), name) +
                      "CollOptions.cuda_stream is set but there is no usable CUDA driver/device: " +
                      cuda::driverUnavailableReason());
  if (in_group)
    throw Unsupported(errorContext(comm->rank(), name) +
                      "device memory inside Collectives::groupStart()/groupEnd() is not supported; use "
                      "CudaCollectives::groupStart()/groupEnd() (collectives/cuda/cuda_collectives.h)");
  if (!state) state = std::make_shared<CudaRoute>(comm);  // collective: every rank routes this call
  CudaCollectives& cc = state->cc;
  auto stream = static_cast<cudaStream_t>(o.cuda_stream);
  switch (a.coll) {
    case CollType::kAllreduce:
      return cc.allreduce(a.send, a.recv, a.count, a.type, a.op, stream, o);
    case CollType::kAllgather:
      return cc.allgather(a.send, a.recv, a.count, a.type, stream, o);
    case CollType::kReduceScatter:
      return cc.reduceScatter(a.send, a.recv, a.count, a.type, a.op, stream, o);
    case CollType::kBroadcast:
      return cc.broadcast(a.recv, a.count, a.type, a.root, stream, o);
    case CollType::kReduce:
      return cc.reduce(a.send, a.recv, a.count, a.type, a.op, a.root, stream, o);
    case CollType::kAlltoall:
      return cc.alltoall(a.send, a.recv, a.count, a.type, stream, o);
    case CollType::kAlltoallv:
      return cc.alltoallv(a.send, a.send_counts, a.send_displs, a.recv, a.recv_counts, a.recv_displs, a.type,
                          stream, o);
    case CollType::kGather:
      return cc.gather(a.send, a.recv, a.count, a.root, a.type, stream, o);
    case CollType::kScatter:
      return cc.scatter(a.send, a.recv, a.count, a.root, a.type, stream, o);
    case CollType::kBarrier:
      return cc.barrier(stream, o);
    case CollType::kSend:
      return cc.send(a.send, a.count, a.type, a.peer, a.tag, stream, o);
    case CollType::kRecv:
      return cc.recv(a.recv, a.count, a.type, a.peer, a.tag, stream, o);
  }
  throw InternalError(errorContext(comm->rank(), name) + "unknown collective");
}

#else  // no CUDA in this build: device pointers are recognized through the driver, then refused

class CudaRoute {};

// A process holding device memory has loaded libcuda (e.g. torch built with CUDA): ask
// the driver directly, without CUDA headers, so such pointers get a clear error instead
// of a crash in the host algorithms.
namespace {
using GetAttribute = int (*)(void* data, int attribute, unsigned long long ptr);

// libcuda's cuPointerGetAttribute once this process has loaded the driver, else null.
GetAttribute attributeQuery() {
  static std::atomic<GetAttribute> get{nullptr};
  GetAttribute f = get.load(std::memory_order_acquire);
  if (f) return f;
  void* h = loadedLibcuda();  // kept open: f stays valid
  if (!h) return nullptr;
  f = reinterpret_cast<GetAttribute>(dlsym(h, "cuPointerGetAttribute"));
  if (f) get.store(f, std::memory_order_release);
  return f;
}

MemoryKind askDriver(GetAttribute f, const void* ptr) {
  constexpr int kMemoryTypeAttribute = 2;  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
  constexpr unsigned kDeviceMemory = 2;    // CU_MEMORYTYPE_DEVICE
  if (!ptr) return MemoryKind::kHost;
  unsigned type = 0;
  if (f(&type, kMemoryTypeAttribute, reinterpret_cast<unsigned long long>(ptr)) != 0)
    return MemoryKind::kHost;
  return type == kDeviceMemory ? MemoryKind::kCuda : MemoryKind::kHost;
}
}  // namespace

MemoryKind pointerMemoryKind(const void* ptr) {
  GetAttribute f = ptr ? attributeQuery() : nullptr;
  return f ? askDriver(f, ptr) : MemoryKind::kHost;
}

WorkPtr routeToCuda(std::shared_ptr<CudaRoute>&, const std::shared_ptr<Communicator>& comm, const CollArgs& a,
                    const CollOptions& o, bool) {
  GetAttribute f = attributeQuery();  // one driver check per call
  const bool device =
      f && (askDriver(f, a.send) == MemoryKind::kCuda || askDriver(f, a.recv) == MemoryKind::kCuda);
  if (!o.cuda_stream && !device) return nullptr;
  throw Unsupported(errorContext(comm->rank(), collTypeName(a.coll)) +
                    (device ? "a buffer is CUDA device memory" : "CollOptions.cuda_stream is set") +
                    " but this crossbar was built without CUDA (CROSSBAR_WITH_CUDA=OFF or no toolkit); "
                    "rebuild with CUDA for device memory, or pass host buffers");
}

#endif

}  // namespace crossbar
