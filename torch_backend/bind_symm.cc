// crossbar._C._symm: symmetric-memory tensors (crossbar/symm.py wraps it). A tensor's storage
// is a host symm::SymmetricBuffer from one heap per crossbar communicator, created lazily over
// the very communicator the group's Collectives uses, so one-node allgather/alltoall read such
// inputs in place (docs/symmem.md, zero-copy host collectives). The storage's DataPtr context
// keeps the buffer alive and marks the tensor as symmetric (peer views carry the same context).
// CPU tensors only: CUDA symmetric tensors (symmem/cuda's allocator) are not bound yet.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "collectives/symm_staging.h"
#include "comm/errors.h"
#include "symmem/symmetric_heap.h"
#include "torch_backend/backend.h"
#include "torch_backend/withdraw.h"

namespace py = pybind11;

namespace crossbar::torch_backend {
namespace {

// What a symmetric tensor's storage holds on to.
struct SymmAllocation {
  std::shared_ptr<symm::SymmetricBuffer> buffer;
  std::vector<std::string> hosts;  // by rank, for errors
  Millis timeout{0};               // the communicator's: default deadline of waits
};

void deleteAllocation(void* ctx) {
  delete static_cast<std::shared_ptr<SymmAllocation>*>(ctx);
}

// One heap per communicator (creation is collective, so it happens once, at the first
// allocation on that communicator), plus a small buffer whose signal pads carry barrier().
struct HeapEntry {
  std::weak_ptr<Communicator> comm;
  symm::SymmetricHeap heap;
  std::shared_ptr<symm::SymmetricBuffer> barrier;
  uint64_t empty_calls = 0;  // crossbar.symm.empty calls so far (alike on every rank)
};

struct HeapRegistry {
  std::mutex mutex;
  std::map<const Communicator*, HeapEntry> heaps;
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

// The communicator's heap entry, created (collectively) on first use.
HeapEntry& heapOf(const std::shared_ptr<Communicator>& comm) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.heaps.begin(); it != r.heaps.end();)  // communicators gone since: drop their heaps
    it = it->second.comm.expired() ? r.heaps.erase(it) : std::next(it);
  auto it = r.heaps.find(comm.get());
  if (it != r.heaps.end()) return it->second;
  HeapEntry e;
  e.comm = comm;
  symm::HeapOptions o;
  o.name = "torch";
  e.heap = symm::SymmetricHeap::create(comm, o);
  e.barrier = e.heap.allocate(1);
  return r.heaps.emplace(comm.get(), std::move(e)).first->second;
}

at::Tensor storageTensor(const std::shared_ptr<SymmAllocation>& alloc, void* data, size_t nbytes) {
  c10::DataPtr ptr(data, new std::shared_ptr<SymmAllocation>(alloc), &deleteAllocation,
                   c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<int64_t>(nbytes), std::move(ptr),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(at::kByte))
      .set_(storage, 0, {static_cast<int64_t>(nbytes)}, {1});
}

// The allocation behind symmetric tensor `t` (or one of its views / peer views).
std::shared_ptr<SymmAllocation> allocationOf(const at::Tensor& t, const char* op) {
  if (!t.defined()) throw InvalidArgument(std::string("crossbar.symm.") + op + ": the tensor is undefined");
  if (!t.device().is_cpu())
    throw Unsupported(std::string("crossbar.symm.") + op + ": the tensor is on " + t.device().str() +
                      "; symmetric tensors are CPU tensors for now (allocate with crossbar.symm.empty)");
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
  uint64_t ndim = 0;
  int64_t dims[kMaxDims] = {};

  bool sameAs(const EmptyRequest& o) const {
    return nbytes == o.nbytes && std::strncmp(dtype, o.dtype, sizeof(dtype)) == 0 && ndim == o.ndim &&
           std::equal(dims, dims + ndim, o.dims);
  }
  std::string text() const {
    std::vector<int64_t> shape(dims, dims + std::min<uint64_t>(ndim, kMaxDims));
    return fmt::format("shape=({}{}), dtype={} ({} bytes)", fmt::join(shape, ", "), ndim == 1 ? "," : "",
                       std::string(dtype, strnlen(dtype, sizeof(dtype))), nbytes);
  }
};

// Sends this rank's request to every other rank and checks theirs (point to point on an
// internal tag: the group's collectives may be busy). Every rank sees every request, so when
// any two differ, every rank throws InvalidUsage (naming the first rank that differs from it).
void checkSameEmptyRequest(Communicator& comm, HeapEntry& e, EmptyRequest mine,
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
                      size_t itemsize) {
  auto comm = communicatorOf(backend);
  auto alloc = std::make_shared<SymmAllocation>();
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
  {
    py::gil_scoped_release release;
    HeapEntry& e = heapOf(comm);
    checkSameEmptyRequest(*comm, e, mine, alloc->hosts);
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

void barrier(const py::object& backend, std::optional<double> timeout_s) {
  auto comm = communicatorOf(backend);
  py::gil_scoped_release release;
  HeapEntry& e = heapOf(comm);
  const Millis t = timeout_s ? Millis(static_cast<int64_t>(*timeout_s * 1000.0)) : comm->timeout();
  e.barrier->barrier(0, Deadline::after(t));
}

}  // namespace

void bindSymm(py::module_& m) {
  auto s = m.def_submodule("_symm", "symmetric-memory tensors (see crossbar.symm)");
  s.def("empty_bytes", &emptyBytes, py::arg("backend"), py::arg("shape"), py::arg("dtype"), py::arg("itemsize"),
        "Collective over the backend's group: a zero-filled uint8 CPU tensor of prod(shape) * itemsize bytes in a "
        "symmetric buffer; InvalidUsage on every rank when ranks ask for different shapes or dtypes (named).");
  s.def("peer", &peerView, py::arg("t"), py::arg("rank"));
  s.def(
      "signal",
      [](const at::Tensor& t, int peer, int channel) {
        auto a = allocationOf(t, "signal");
        checkPeerRank(*a, peer, "signal");
        py::gil_scoped_release release;
        a->buffer->putSignal(peer, channel);
      },
      py::arg("t"), py::arg("peer"), py::arg("channel"));
  s.def(
      "wait_signal",
      [](const at::Tensor& t, int peer, int channel, std::optional<double> timeout_s) {
        auto a = allocationOf(t, "wait_signal");
        checkPeerRank(*a, peer, "wait_signal");
        const Deadline d = deadlineOf(*a, timeout_s);
        py::gil_scoped_release release;
        a->buffer->waitSignal(peer, channel, d);
      },
      py::arg("t"), py::arg("peer"), py::arg("channel"), py::arg("timeout") = std::nullopt);
  s.def("channels", [](const at::Tensor& t) { return allocationOf(t, "channels")->buffer->channels(); });
  s.def("is_symmetric", [](const at::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.storage().data_ptr().get_deleter() == &deleteAllocation;
  });
  s.def("barrier", &barrier, py::arg("backend"), py::arg("timeout") = std::nullopt);
  s.def(
      "direct_reads", [] { return symmDirectReads(); },
      "Blocks this process's collectives read in place from peers' symmetric inputs (zero copy).");
}

}  // namespace crossbar::torch_backend
