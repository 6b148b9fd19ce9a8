// crossbar._C._symm: symmetric-memory tensors (crossbar/symm.py wraps it). A tensor's storage
// is a host symm::SymmetricBuffer from one heap per crossbar communicator, created lazily over
// the very communicator the group's Collectives uses, so one-node allgather/alltoall read such
// inputs in place (docs/symmem.md, zero-copy host collectives). The storage's DataPtr context
// keeps the buffer alive and marks the tensor as symmetric (peer views carry the same context).
// CUDA tensors (CUDA builds against a CUDA torch, CROSSBAR_TORCH_CUDA): a second heap per
// communicator and device over symmem/cuda's VMM allocator; signals, waits and barriers are
// stream memory operations on torch's current stream (symmem/cuda/cuda_symmetric.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "collectives/symm_staging.h"
#include "comm/errors.h"
#include "symmem/cuda/device_handle.h"  // plain C++: the struct's layout is reported in every build
#include "symmem/symmetric_heap.h"
#include "torch_backend/backend.h"
#include "torch_backend/withdraw.h"

#if CROSSBAR_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <thread>

#include "symmem/cuda/cuda_segment_allocator.h"
#include "symmem/cuda/cuda_symmetric.h"
#include "symmem/cuda/driver_api.h"
#endif

namespace py = pybind11;

namespace crossbar::torch_backend {
namespace {

// What a symmetric tensor's storage holds on to.
struct SymmAllocation {
  std::shared_ptr<symm::SymmetricBuffer> buffer;
  int device = -1;                 // CUDA device of the buffer, -1: host memory
  std::vector<std::string> hosts;  // by rank, for errors
  Millis timeout{0};               // the communicator's: default deadline of waits
  // rendezvous()'s pointer tables (buffer_ptrs, signal_pad_ptrs) by byte offset of the tensor
  // into the allocation: built once (on the buffer's device for CUDA) and reused, so a kernel
  // may keep the device address for as long as the tensor lives.
  std::mutex tables_mutex;
  std::map<size_t, std::pair<at::Tensor, at::Tensor>> pointer_tables;
};

void deleteAllocation(void* ctx) {
  delete static_cast<std::shared_ptr<SymmAllocation>*>(ctx);
}
// Storages over a signal pad (SymmHandle.get_signal_pad): they keep the allocation alive like
// deleteAllocation's, but are not symmetric tensors (their data is not the allocation's start).
void deletePadView(void* ctx) {
  delete static_cast<std::shared_ptr<SymmAllocation>*>(ctx);
}

// One heap per communicator and device (-1: host memory; creation is collective, so it happens
// once, at the first allocation or barrier there), plus a small buffer whose signal pads carry
// barrier().
struct HeapEntry {
  symm::SymmetricHeap heap;
  std::shared_ptr<symm::SymmetricBuffer> barrier;
};

struct CommEntry {
  std::weak_ptr<Communicator> comm;
  uint64_t empty_calls = 0;          // crossbar.symm.empty calls so far (alike on every rank)
  std::map<int, HeapEntry> heaps;    // by device
};

struct HeapRegistry {
  std::mutex mutex;
  std::map<const Communicator*, CommEntry> comms;
};

// Leaked on purpose: heaps hold sockets and the store, which must not be torn down by static
// destructors after Python has finalized.
HeapRegistry& registry() {
  static auto* r = new HeapRegistry;
  return *r;
}

std::shared_ptr<Communicator> communicatorOf(const py::object& backend) {
  return backend.cast<CrossbarBackend&>().communicator().shared_from_this();
}

CommEntry& commEntryOf(const std::shared_ptr<Communicator>& comm) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.comms.begin(); it != r.comms.end();)  // communicators gone since: drop their heaps
    it = it->second.comm.expired() ? r.comms.erase(it) : std::next(it);
  auto [it, added] = r.comms.try_emplace(comm.get());
  if (added) it->second.comm = comm;
  return it->second;
}

// The communicator's heap on `device` (-1: host), created (collectively) on first use.
HeapEntry& heapOf(const std::shared_ptr<Communicator>& comm, int device) {
  CommEntry& c = commEntryOf(comm);
  auto it = c.heaps.find(device);
  if (it != c.heaps.end()) return it->second;
  HeapEntry e;
  symm::HeapOptions o;
  o.name = "torch";
#if CROSSBAR_TORCH_CUDA
  if (device >= 0) {
    if (comm->numNodes() > 1)
      throw Unsupported(errorContext(comm->rank(), "crossbar.symm on CUDA") +
                        fmt::format("the group spans {} nodes; CUDA symmetric tensors need every rank of the group "
                                    "on one node (GPU memory is mapped between local processes only): use a group "
                                    "of one node's ranks, or collectives",
                                    comm->numNodes()));
    o.name = "torch-cuda";
    o.allocator = cuda::makeCudaSegmentAllocator(device);
    o.remote_access = false;
  }
#endif
  e.heap = symm::SymmetricHeap::create(comm, o);
  e.barrier = e.heap.allocate(1);
  return c.heaps.emplace(device, std::move(e)).first->second;
}

at::Tensor storageTensor(const std::shared_ptr<SymmAllocation>& alloc, void* data, size_t nbytes,
                         c10::DeleterFnPtr deleter = &deleteAllocation) {
  const c10::Device device = alloc->device < 0
                                 ? c10::Device(c10::kCPU)
                                 : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(alloc->device));
  c10::DataPtr ptr(data, new std::shared_ptr<SymmAllocation>(alloc), deleter, device);
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<int64_t>(nbytes), std::move(ptr),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device))
      .set_(storage, 0, {static_cast<int64_t>(nbytes)}, {1});
}

// The allocation behind symmetric tensor `t` (or one of its views / peer views).
std::shared_ptr<SymmAllocation> allocationOf(const at::Tensor& t, const char* op) {
  if (!t.defined()) throw InvalidArgument(std::string("crossbar.symm.") + op + ": the tensor is undefined");
  if (!t.device().is_cpu() && !(CROSSBAR_TORCH_CUDA && t.device().is_cuda()))
    throw Unsupported(std::string("crossbar.symm.") + op + ": the tensor is on " + t.device().str() +
                      "; symmetric tensors are CPU tensors" +
                      (CROSSBAR_TORCH_CUDA ? " or CUDA tensors" : " (this build has no CUDA symmetric tensors)") +
                      " allocated with crossbar.symm.empty");
  const c10::DataPtr& dp = t.storage().data_ptr();
  if (dp.get_deleter() != &deleteAllocation)
    throw InvalidArgument(std::string("crossbar.symm.") + op +
                          ": the tensor is not a symmetric tensor (allocate it with crossbar.symm.empty)");
  return *static_cast<std::shared_ptr<SymmAllocation>*>(dp.get_context());
}

std::string rankText(const SymmAllocation& a) {
  const int r = a.buffer->rank();
  return "rank " + std::to_string(r) + " (host " + a.hosts[static_cast<size_t>(r)] + ")";
}

void checkPeerRank(const SymmAllocation& a, int peer, const char* op) {
  if (peer < 0 || peer >= a.buffer->worldSize())
    throw InvalidArgument(rankText(a) + ": crossbar.symm." + op + ": peer " + std::to_string(peer) +
                          " is not a rank of the group (size " + std::to_string(a.buffer->worldSize()) + ")");
}

// empty()'s descriptor exchange: an internal tag next to the backend's (monitored_barrier
// kInternalTagBase + 0x200, the GPU ids + 0x201).
constexpr uint32_t kEmptyDescriptorTag = kInternalTagBase + 0x202;
constexpr size_t kMaxDims = 64;

// What one rank asks of crossbar.symm.empty, sent to every other rank before allocating, so
// ranks that disagree (also on dtype or shape at the same byte size) all fail alike.
struct EmptyRequest {
  uint64_t call = 0;  // empty() calls on this communicator before this one
  uint64_t nbytes = 0;
  char dtype[40] = {};  // "torch.float32"
  char device[8] = {};  // "cpu" or "cuda" (ranks may use different GPUs)
  uint64_t ndim = 0;
  int64_t dims[kMaxDims] = {};

  bool sameAs(const EmptyRequest& o) const {
    return nbytes == o.nbytes && std::strncmp(dtype, o.dtype, sizeof(dtype)) == 0 &&
           std::strncmp(device, o.device, sizeof(device)) == 0 && ndim == o.ndim &&
           std::equal(dims, dims + ndim, o.dims);
  }
  std::string text() const {
    std::vector<int64_t> shape(dims, dims + std::min<uint64_t>(ndim, kMaxDims));
    return fmt::format("shape=({}{}), dtype={}, device={} ({} bytes)", fmt::join(shape, ", "),
                       ndim == 1 ? "," : "", std::string(dtype, strnlen(dtype, sizeof(dtype))),
                       std::string(device, strnlen(device, sizeof(device))), nbytes);
  }
};

// Sends this rank's request to every other rank and checks theirs (point to point on an
// internal tag: the group's collectives may be busy). Every rank sees every request, so when
// any two differ, every rank throws InvalidUsage (naming the first rank that differs from it).
void checkSameEmptyRequest(Communicator& comm, CommEntry& e, EmptyRequest mine,
                           const std::vector<std::string>& hosts) {
  const int n = comm.size(), me = comm.rank();
  const char* op = "crossbar.symm.empty";
  mine.call = e.empty_calls++;
  auto all = std::make_shared<std::vector<EmptyRequest>>(static_cast<size_t>(n));
  (*all)[static_cast<size_t>(me)] = mine;
  std::vector<RequestPtr> reqs;
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    reqs.push_back(comm.irecv(&(*all)[static_cast<size_t>(r)], sizeof(EmptyRequest), r, kEmptyDescriptorTag));
    reqs.push_back(comm.isend(&(*all)[static_cast<size_t>(me)], sizeof(EmptyRequest), r, kEmptyDescriptorTag));
  }
  const Deadline deadline = comm.defaultDeadline();
  try {
    comm.waitAll(reqs, deadline);
  } catch (const Timeout&) {
    std::vector<int> late;
    std::vector<std::string> late_hosts;
    for (size_t i = 0; i < reqs.size(); i += 2)
      if (!reqs[i]->done()) {
        late.push_back(static_cast<int>(i / 2) + (static_cast<int>(i / 2) >= me ? 1 : 0));
        late_hosts.push_back(hosts[static_cast<size_t>(late.back())]);
      }
    withdrawAndHold(reqs, all);
    throw Timeout(fmt::format("{}{} did not call it within {} ms (this rank's call #{}: {}); every rank of the "
                              "group must call crossbar.symm.empty with the same shape and dtype, in the same order",
                              errorContext(me, op), formatPeers(late, late_hosts), comm.timeout().count(), mine.call,
                              mine.text()),
                  late);
  } catch (...) {
    withdrawAndHold(reqs, all);
    throw;
  }
  for (int r = 0; r < n; ++r) {
    const EmptyRequest& theirs = (*all)[static_cast<size_t>(r)];
    if (theirs.call != mine.call)
      throw InvalidUsage(fmt::format("{}rank {} (host {}) is at its crossbar.symm.empty call #{} on this group, this "
                                     "rank at #{}: every rank must make the same calls, in the same order (an earlier "
                                     "call failed on some ranks only?)",
                                     errorContext(me, op), r, hosts[static_cast<size_t>(r)], theirs.call, mine.call),
                         {r});
    if (!theirs.sameAs(mine))
      throw InvalidUsage(fmt::format("{}rank {} (host {}) asked for {}, this rank for {}: every rank of the group must "
                                     "call crossbar.symm.empty with the same shape and dtype, in the same order",
                                     errorContext(me, op), r, hosts[static_cast<size_t>(r)], theirs.text(),
                                     mine.text()),
                         {r});
  }
}

// Collective: a zero-filled uint8 tensor over a new symmetric buffer, after every rank
// confirmed it asks for the same shape and dtype.
at::Tensor emptyBytes(const py::object& backend, const std::vector<int64_t>& shape, const std::string& dtype,
                      size_t itemsize, int device) {
  auto comm = communicatorOf(backend);
#if !CROSSBAR_TORCH_CUDA
  if (device >= 0)
    throw Unsupported(errorContext(comm->rank(), "crossbar.symm.empty") +
                      "this build has no CUDA symmetric tensors (crossbar built without CUDA, or against a CPU-only "
                      "torch); allocate on the CPU");
#endif
  auto alloc = std::make_shared<SymmAllocation>();
  alloc->device = device;
  alloc->timeout = comm->timeout();
  for (int r = 0; r < comm->size(); ++r) alloc->hosts.push_back(comm->host(r));
  const char* op = "crossbar.symm.empty";
  EmptyRequest mine;
  if (shape.size() > kMaxDims)
    throw InvalidArgument(fmt::format("{}{} dimensions; symmetric tensors have at most {}",
                                      errorContext(comm->rank(), op), shape.size(), kMaxDims));
  if (dtype.size() >= sizeof(mine.dtype))
    throw InvalidArgument(fmt::format("{}dtype name '{}' is too long", errorContext(comm->rank(), op), dtype));
  size_t nbytes = itemsize;
  for (int64_t d : shape) {
    if (d < 0)
      throw InvalidArgument(fmt::format("{}negative dimension in shape ({})", errorContext(comm->rank(), op),
                                        fmt::join(shape, ", ")));
    if (d > 0 && nbytes > SIZE_MAX / static_cast<size_t>(d))
      throw InvalidArgument(fmt::format("{}shape ({}) is too large", errorContext(comm->rank(), op),
                                        fmt::join(shape, ", ")));
    nbytes *= static_cast<size_t>(d);
  }
  mine.nbytes = nbytes;
  std::memcpy(mine.dtype, dtype.data(), dtype.size());
  mine.ndim = shape.size();
  std::copy(shape.begin(), shape.end(), mine.dims);
  std::strcpy(mine.device, device < 0 ? "cpu" : "cuda");
  {
    py::gil_scoped_release release;
    // Agree first: a heap's creation is collective too, per device.
    checkSameEmptyRequest(*comm, commEntryOf(comm), mine, alloc->hosts);
#if CROSSBAR_TORCH_CUDA
    std::optional<c10::cuda::CUDAGuard> guard;
    if (device >= 0) guard.emplace(static_cast<c10::DeviceIndex>(device));
#endif
    HeapEntry& e = heapOf(comm, device);
    // At least one byte: an empty tensor still takes part in the collective allocation.
    alloc->buffer = e.heap.allocate(nbytes > 0 ? nbytes : 1);
  }
  return storageTensor(alloc, alloc->buffer->localPtr(), nbytes);
}

at::Tensor peerView(const at::Tensor& t, int rank) {
  auto alloc = allocationOf(t, "peer");
  checkPeerRank(*alloc, rank, "peer");
  void* base = alloc->buffer->peerPtr(rank);
  if (!base)
    throw InvalidArgument(rankText(*alloc) + ": crossbar.symm.peer: rank " + std::to_string(rank) +
                          " (host " + alloc->hosts[static_cast<size_t>(rank)] +
                          ") is on another node; only ranks on this node have a mapped view (use "
                          "torch.distributed collectives to reach it)");
  const auto nbytes = static_cast<size_t>(t.storage().nbytes());
  at::Tensor bytes = storageTensor(alloc, base, nbytes);
  return bytes.view(t.scalar_type()).as_strided(t.sizes(), t.strides(), t.storage_offset());
}

Deadline deadlineOf(const SymmAllocation& a, std::optional<double> timeout_s) {
  if (!timeout_s) return Deadline::after(a.timeout);
  if (*timeout_s < 0) throw InvalidArgument(rankText(a) + ": crossbar.symm: timeout must be >= 0 seconds");
  return Deadline::after(Millis(static_cast<int64_t>(*timeout_s * 1000.0)));
}

#if CROSSBAR_TORCH_CUDA
cudaStream_t currentStream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

// Every rank signals every other on `channel` after the stream's earlier work (with a memory
// barrier), then the stream waits for everyone's signal: later work sees all earlier writes.
void streamBarrier(symm::SymmetricBuffer& b, int channel, cudaStream_t stream) {
  for (int p = 0; p < b.worldSize(); ++p)
    if (p != b.rank()) cuda::streamPutSignal(b, p, channel, stream);
  for (int p = 0; p < b.worldSize(); ++p)
    if (p != b.rank()) cuda::streamWaitSignal(b, p, channel, stream);
}

void requireNoTimeout(const SymmAllocation& a, std::optional<double> timeout_s, const char* op) {
  if (timeout_s)
    throw InvalidArgument(rankText(a) + ": crossbar.symm." + op +
                          " on a CUDA tensor is ordered on the current stream and does not block the host, so it "
                          "takes no timeout: bound it with crossbar.symm.synchronize(timeout=...)");
}
#endif

void barrier(const py::object& backend, std::optional<double> timeout_s, int device) {
  auto comm = communicatorOf(backend);
#if CROSSBAR_TORCH_CUDA
  if (device >= 0) {
    if (timeout_s)
      throw InvalidArgument(errorContext(comm->rank(), "crossbar.symm.barrier") +
                            "a CUDA barrier is ordered on the current stream and does not block the host, so it takes "
                            "no timeout: bound it with crossbar.symm.synchronize(timeout=...)");
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    cudaStream_t stream = currentStream(device);
    py::gil_scoped_release release;
    HeapEntry& e = heapOf(comm, device);
    // Every rank signals every other after the stream's earlier work (with a memory barrier),
    // then the stream waits for everyone's signal: later work sees all earlier writes.
    streamBarrier(*e.barrier, 0, stream);
    return;
  }
#else
  if (device >= 0)
    throw Unsupported(errorContext(comm->rank(), "crossbar.symm.barrier") +
                      "this build has no CUDA symmetric tensors (crossbar built without CUDA, or against a CPU-only "
                      "torch)");
#endif
  py::gil_scoped_release release;
  HeapEntry& e = heapOf(comm, -1);
  const Millis t = timeout_s ? Millis(static_cast<int64_t>(*timeout_s * 1000.0)) : comm->timeout();
  e.barrier->barrier(0, Deadline::after(t));
}

void signal(const at::Tensor& t, int peer, int channel) {
  auto a = allocationOf(t, "signal");
  checkPeerRank(*a, peer, "signal");
#if CROSSBAR_TORCH_CUDA
  if (a->device >= 0) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(a->device));
    cuda::streamPutSignal(*a->buffer, peer, channel, currentStream(a->device));
    return;
  }
#endif
  py::gil_scoped_release release;
  a->buffer->putSignal(peer, channel);
}

void waitSignal(const at::Tensor& t, int peer, int channel, std::optional<double> timeout_s) {
  auto a = allocationOf(t, "wait_signal");
  checkPeerRank(*a, peer, "wait_signal");
#if CROSSBAR_TORCH_CUDA
  if (a->device >= 0) {
    requireNoTimeout(*a, timeout_s, "wait_signal");
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(a->device));
    cuda::streamWaitSignal(*a->buffer, peer, channel, currentStream(a->device));
    return;
  }
#endif
  const Deadline d = deadlineOf(*a, timeout_s);
  py::gil_scoped_release release;
  a->buffer->waitSignal(peer, channel, d);
}

// ---- rendezvous(): the addresses a user kernel needs (crossbar.symm.SymmHandle) -------------

// Byte offset of `t`'s first element from the start of its allocation: the same in every
// rank's mapping (a peer view's storage starts at that peer's mapping).
size_t byteOffsetOf(const at::Tensor& t) {
  return static_cast<size_t>(t.storage_offset()) * t.element_size();
}

void checkChannel(const SymmAllocation& a, int channel, const char* op) {
  if (channel < 0 || channel >= a.buffer->channels())
    throw InvalidArgument(rankText(a) + ": crossbar.symm." + op + ": channel " + std::to_string(channel) +
                          " is out of range: the buffer has " + std::to_string(a.buffer->channels()) +
                          " channels (CROSSBAR_SYMMEM_CHANNELS)");
}

// The pointer tables of `a` at byte `offset` (cached): int64 CPU tensors for host memory,
// uint64 tensors on the buffer's GPU for CUDA memory (copied synchronously, so a kernel on any
// stream may read them once this returns).
std::pair<at::Tensor, at::Tensor> pointerTables(SymmAllocation& a, size_t offset, const std::vector<uint64_t>& bufs,
                                                const std::vector<uint64_t>& pads) {
  std::lock_guard<std::mutex> lock(a.tables_mutex);
  auto it = a.pointer_tables.find(offset);
  if (it != a.pointer_tables.end()) return it->second;
  auto table = [&](const std::vector<uint64_t>& v) {
    at::Tensor host = at::empty({static_cast<int64_t>(v.size())},
                                at::TensorOptions().dtype(a.device < 0 ? at::kLong : at::kUInt64));
    std::memcpy(host.data_ptr(), v.data(), v.size() * sizeof(uint64_t));
    if (a.device < 0) return host;
    return host.to(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(a.device)));
  };
  return a.pointer_tables.emplace(offset, std::make_pair(table(bufs), table(pads))).first->second;
}

// What crossbar.symm.rendezvous(t) returns, as a dict: every rank's address of t's first
// element, every rank's signal pad, and the tables of both.
py::dict handleInfo(const at::Tensor& t, const py::object& backend) {
  auto a = allocationOf(t, "rendezvous");
  const symm::SymmetricBuffer& b = *a->buffer;
  if (!backend.is_none() && !b.createdOver(*communicatorOf(backend)))
    throw InvalidArgument(rankText(*a) +
                          ": crossbar.symm.rendezvous: the tensor was allocated on another group than the one "
                          "given; pass the group given to crossbar.symm.empty (or group=None)");
  const size_t nbytes = static_cast<size_t>(t.storage().nbytes());
  const size_t offset = byteOffsetOf(t);
  const int n = b.worldSize();
  std::vector<uint64_t> bufs(static_cast<size_t>(n), 0), pads(static_cast<size_t>(n), 0);
  for (int p = 0; p < n; ++p)
    if (auto* base = static_cast<char*>(b.peerPtr(p))) {  // 0 for ranks on other nodes: not mapped
      bufs[static_cast<size_t>(p)] = reinterpret_cast<uintptr_t>(base + offset);
      pads[static_cast<size_t>(p)] = reinterpret_cast<uintptr_t>(base + b.signalPadOffset());
    }
  auto [buf_table, pad_table] = pointerTables(*a, offset, bufs, pads);
  py::dict d;
  d["rank"] = b.rank();
  d["world_size"] = n;
  d["device"] = a->device;
  d["offset"] = offset;
  d["buffer_size"] = nbytes > offset ? nbytes - offset : 0;
  d["buffer_ptrs"] = bufs;
  d["signal_pad_ptrs"] = pads;
  d["buffer_ptrs_table"] = buf_table;
  d["signal_pad_ptrs_table"] = pad_table;
  d["channels"] = b.channels();
  d["signal_slot_bytes"] = symm::SymmetricBuffer::kSignalSlotBytes;
  // The user channels only: the heap's internal channel (free()) follows them.
  d["signal_pad_size"] = static_cast<size_t>(b.channels()) * static_cast<size_t>(n) *
                         symm::SymmetricBuffer::kSignalSlotBytes;
  return d;
}

// A contiguous `dtype` tensor of `sizes` at element `offset` of `bytes`' storage.
at::Tensor contiguousOver(const at::Tensor& bytes, const std::vector<int64_t>& sizes, at::ScalarType dtype,
                          size_t offset) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * std::max<int64_t>(sizes[i], 1);
  return at::empty({0}, bytes.options().dtype(dtype))
      .set_(bytes.storage(), static_cast<int64_t>(offset), sizes, strides);
}

// SymmHandle.get_buffer: a `dtype` tensor of `sizes` (contiguous) over `rank`'s copy, starting
// `storage_offset` elements after t's first element; it keeps the allocation alive.
at::Tensor peerBuffer(const at::Tensor& t, int rank, const std::vector<int64_t>& sizes, at::ScalarType dtype,
                      int64_t storage_offset) {
  auto a = allocationOf(t, "get_buffer");
  checkPeerRank(*a, rank, "get_buffer");
  const std::string op = rankText(*a) + ": crossbar.symm.SymmHandle.get_buffer: ";
  auto* base = static_cast<char*>(a->buffer->peerPtr(rank));
  if (!base)
    throw InvalidArgument(op + "rank " + std::to_string(rank) + " (host " + a->hosts[static_cast<size_t>(rank)] +
                          ") is on another node; only ranks on this node have a mapped buffer");
  if (storage_offset < 0) throw InvalidArgument(op + fmt::format("storage_offset {} is negative", storage_offset));
  const size_t itemsize = c10::elementSize(dtype);
  size_t numel = 1;
  for (int64_t d : sizes) {
    if (d < 0) throw InvalidArgument(op + fmt::format("negative dimension in sizes ({})", fmt::join(sizes, ", ")));
    numel *= static_cast<size_t>(d);
  }
  const size_t nbytes = static_cast<size_t>(t.storage().nbytes());
  const size_t start = byteOffsetOf(t) + static_cast<size_t>(storage_offset) * itemsize;
  if (start % itemsize != 0)
    throw InvalidArgument(op + fmt::format("byte {} of the allocation (the handle's offset {} + storage_offset {} "
                                           "x {} bytes) is not aligned to {}'s {} bytes",
                                           start, byteOffsetOf(t), storage_offset, itemsize, c10::toString(dtype),
                                           itemsize));
  if (start > nbytes || numel * itemsize > nbytes - start)
    throw InvalidArgument(op + fmt::format("sizes ({}) of {} at storage_offset {} need bytes [{}, {}) of the "
                                           "allocation, which has {} bytes",
                                           fmt::join(sizes, ", "), c10::toString(dtype), storage_offset, start,
                                           start + numel * itemsize, nbytes));
  return contiguousOver(storageTensor(a, base, nbytes), sizes, dtype, start / itemsize);
}

// SymmHandle.get_signal_pad: a `dtype` tensor over `rank`'s signal pad (the user channels'
// slots), `sizes` (default: all of it, 1-D) from element `storage_offset`.
at::Tensor signalPad(const at::Tensor& t, int rank, std::optional<std::vector<int64_t>> sizes, at::ScalarType dtype,
                     int64_t storage_offset) {
  auto a = allocationOf(t, "get_signal_pad");
  checkPeerRank(*a, rank, "get_signal_pad");
  const std::string op = rankText(*a) + ": crossbar.symm.SymmHandle.get_signal_pad: ";
  const symm::SymmetricBuffer& b = *a->buffer;
  auto* base = static_cast<char*>(b.peerPtr(rank));
  if (!base)
    throw InvalidArgument(op + "rank " + std::to_string(rank) + " (host " + a->hosts[static_cast<size_t>(rank)] +
                          ") is on another node; its signal pad is not mapped here");
  const size_t pad_bytes =
      static_cast<size_t>(b.channels()) * static_cast<size_t>(b.worldSize()) * symm::SymmetricBuffer::kSignalSlotBytes;
  const size_t itemsize = c10::elementSize(dtype);
  if (!sizes) sizes = std::vector<int64_t>{static_cast<int64_t>(pad_bytes / itemsize)};
  if (storage_offset < 0) throw InvalidArgument(op + fmt::format("storage_offset {} is negative", storage_offset));
  size_t numel = 1;
  for (int64_t d : *sizes) {
    if (d < 0) throw InvalidArgument(op + fmt::format("negative dimension in sizes ({})", fmt::join(*sizes, ", ")));
    numel *= static_cast<size_t>(d);
  }
  const size_t start = static_cast<size_t>(storage_offset) * itemsize;
  if (start > pad_bytes || numel * itemsize > pad_bytes - start)
    throw InvalidArgument(op + fmt::format("sizes ({}) of {} at storage_offset {} need bytes [{}, {}) of the pad, "
                                           "which has {} bytes ({} channels x {} senders x {})",
                                           fmt::join(*sizes, ", "), c10::toString(dtype), storage_offset, start,
                                           start + numel * itemsize, pad_bytes, b.channels(), b.worldSize(),
                                           symm::SymmetricBuffer::kSignalSlotBytes));
  return contiguousOver(storageTensor(a, base + b.signalPadOffset(), pad_bytes, &deletePadView), *sizes, dtype,
                        storage_offset);
}

// SymmHandle.barrier: every rank signals every other on `channel` of t's own buffer and waits
// for all (host: bounded by the timeout; CUDA: on the current stream).
void bufferBarrier(const at::Tensor& t, int channel, std::optional<double> timeout_s) {
  auto a = allocationOf(t, "barrier");
  checkChannel(*a, channel, "SymmHandle.barrier");
#if CROSSBAR_TORCH_CUDA
  if (a->device >= 0) {
    requireNoTimeout(*a, timeout_s, "SymmHandle.barrier");
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(a->device));
    streamBarrier(*a->buffer, channel, currentStream(a->device));
    return;
  }
#endif
  const Deadline d = deadlineOf(*a, timeout_s);
  py::gil_scoped_release release;
  a->buffer->barrier(channel, d);
}

// SymmHandle.device_handle: the bytes of a cuda::SymmDeviceHandle (symmem/cuda/device_handle.h)
// for `channel`, with every peer pointer at t's first element in that peer's copy.
py::bytes deviceHandleBytes(const at::Tensor& t, int channel) {
  auto a = allocationOf(t, "device_handle");
  checkChannel(*a, channel, "SymmHandle.device_handle");
  if (a->device < 0)
    throw InvalidArgument(rankText(*a) +
                          ": crossbar.symm.SymmHandle.device_handle: the tensor is in host memory; the "
                          "SymmDeviceHandle is for CUDA kernels on CUDA symmetric tensors (host code uses "
                          "buffer_ptrs and signal_pad_ptrs)");
#if CROSSBAR_TORCH_CUDA
  cuda::SymmDeviceHandle h = cuda::makeDeviceHandle(*a->buffer, channel);
  const size_t offset = byteOffsetOf(t), nbytes = static_cast<size_t>(t.storage().nbytes());
  for (int r = 0; r < h.local_size; ++r) h.peer_ptrs[r] = static_cast<char*>(h.peer_ptrs[r]) + offset;
  h.size = nbytes > offset ? nbytes - offset : 0;
  return py::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
#else
  return py::bytes();  // unreachable: host-only builds have no CUDA allocations
#endif
}

// Offsets of SymmDeviceHandle's fields, so Python can check and decode the bytes.
py::dict deviceHandleLayout() {
  using H = cuda::SymmDeviceHandle;
  // Handed to Python as bytes and back to C++ by memcpy: it must stay a plain struct.
  static_assert(std::is_trivially_copyable_v<H> && std::is_standard_layout_v<H>);
  py::dict d;
  d["size"] = sizeof(H);
  d["max_local_ranks"] = cuda::kMaxLocalRanks;
  d["peer_ptrs"] = offsetof(H, peer_ptrs);
  d["signal_pads"] = offsetof(H, signal_pads);
  d["timeout_flag"] = offsetof(H, timeout_flag);
  d["rank"] = offsetof(H, rank);
  d["local_size"] = offsetof(H, local_size);
  d["size_bytes"] = offsetof(H, size);
  d["signal_stride"] = offsetof(H, signal_stride);
  return d;
}

// Blocks the host until the current stream of `device` has finished what is queued on it
// now, or the timeout passes (Timeout: a stream-ordered wait whose signal never came).
void synchronize(int device, double timeout_s) {
#if CROSSBAR_TORCH_CUDA
  const char* op = "crossbar.symm.synchronize";
  if (timeout_s < 0) throw InvalidArgument(errorContext(-1, op) + "timeout must be >= 0 seconds");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaEvent_t ev = nullptr;
  cuda::checkCuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags", device);
  const cudaError_t rec = cudaEventRecord(ev, currentStream(device));
  if (rec != cudaSuccess) {
    cudaEventDestroy(ev);
    cuda::checkCuda(rec, "cudaEventRecord", device);
  }
  const Deadline deadline = Deadline::after(Millis(static_cast<int64_t>(timeout_s * 1000.0)));
  py::gil_scoped_release release;
  while (true) {
    const cudaError_t q = cudaEventQuery(ev);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      cudaEventDestroy(ev);
      cuda::checkCuda(q, "cudaEventQuery", device);
    }
    if (deadline.expired()) {
      cudaEventDestroy(ev);  // released once the stream passes it
      throw Timeout(errorContext(-1, op) +
                    fmt::format("the current stream of cuda:{} did not finish within {} s: a symmetric-memory "
                                "wait_signal/barrier on it is waiting for a peer that has not signaled (hung, slow, "
                                "or not making the same calls); the stream stays blocked until it does",
                                device, timeout_s));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  cudaEventDestroy(ev);
#else
  (void)timeout_s;
  throw Unsupported(errorContext(-1, "crossbar.symm.synchronize") +
                    fmt::format("cuda:{}: this build has no CUDA symmetric tensors", device));
#endif
}

}  // namespace

void bindSymm(py::module_& m) {
  auto s = m.def_submodule("_symm", "symmetric-memory tensors (see crossbar.symm)");
  s.def("empty_bytes", &emptyBytes, py::arg("backend"), py::arg("shape"), py::arg("dtype"), py::arg("itemsize"),
        py::arg("device") = -1,
        "Collective over the backend's group: a zero-filled uint8 tensor of prod(shape) * itemsize bytes in a "
        "symmetric buffer on the CPU (device -1) or CUDA device `device`; InvalidUsage on every rank when ranks ask "
        "for different shapes, dtypes or device types (named).");
  s.def("cuda_available", [] { return CROSSBAR_TORCH_CUDA != 0; },
        "Whether this build has CUDA symmetric tensors (a CUDA build of crossbar against a CUDA torch).");
  s.def("synchronize", &synchronize, py::arg("device"), py::arg("timeout"));
  s.def("peer", &peerView, py::arg("t"), py::arg("rank"));
  s.def("signal", &signal, py::arg("t"), py::arg("peer"), py::arg("channel"));
  s.def("wait_signal", &waitSignal, py::arg("t"), py::arg("peer"), py::arg("channel"),
        py::arg("timeout") = std::nullopt);
  s.def("channels", [](const at::Tensor& t) { return allocationOf(t, "channels")->buffer->channels(); });
  s.def("is_symmetric", [](const at::Tensor& t) {
    return t.defined() && t.has_storage() && t.storage().data_ptr().get_deleter() == &deleteAllocation;
  });
  s.def("barrier", &barrier, py::arg("backend"), py::arg("timeout") = std::nullopt, py::arg("device") = -1);
  s.def("handle_info", &handleInfo, py::arg("t"), py::arg("backend") = py::none(),
        "crossbar.symm.rendezvous's data: every rank's address of t's first element and signal pad, and tables "
        "of both (int64 CPU tensors for host memory, uint64 tensors on the GPU for CUDA memory; cached).");
  s.def("get_buffer", &peerBuffer, py::arg("t"), py::arg("rank"), py::arg("sizes"), py::arg("dtype"),
        py::arg("storage_offset") = 0);
  s.def("get_signal_pad", &signalPad, py::arg("t"), py::arg("rank"), py::arg("sizes"),
        py::arg("dtype"), py::arg("storage_offset") = 0);
  s.def("buffer_barrier", &bufferBarrier, py::arg("t"), py::arg("channel"), py::arg("timeout") = std::nullopt);
  s.def("device_handle", &deviceHandleBytes, py::arg("t"), py::arg("channel"));
  s.def("device_handle_layout", &deviceHandleLayout);
  s.def(
      "direct_reads", [] { return symmDirectReads(); },
      "Blocks this process's collectives read in place from peers' symmetric inputs (zero copy).");
}

}  // namespace crossbar::torch_backend
