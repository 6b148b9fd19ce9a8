// crossbar._C._symm: symmetric-memory tensors (crossbar/symm.py wraps it). A tensor's storage
// is a host symm::SymmetricBuffer from one heap per crossbar communicator, created lazily over
// the very communicator the group's Collectives uses, so one-node allgather/alltoall read such
// inputs in place (docs/symmem.md, zero-copy host collectives). The storage's DataPtr context
// keeps the buffer alive and marks the tensor as symmetric (peer views carry the same context).
// CPU tensors only: CUDA symmetric tensors (symmem/cuda's allocator) are not bound yet.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

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

at::Tensor emptyBytes(const py::object& backend, size_t nbytes) {
  auto comm = communicatorOf(backend);
  auto alloc = std::make_shared<SymmAllocation>();
  alloc->timeout = comm->timeout();
  for (int r = 0; r < comm->size(); ++r) alloc->hosts.push_back(comm->host(r));
  {
    py::gil_scoped_release release;
    HeapEntry& e = heapOf(comm);
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
  s.def(
      "empty_bytes", &emptyBytes, py::arg("backend"), py::arg("nbytes"),
      "Collective over the backend's group: a zero-filled uint8 CPU tensor of nbytes in a symmetric buffer.");
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
