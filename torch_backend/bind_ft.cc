// crossbar._C.FaultTolerantGroup: comm/ft.h's FaultTolerantComm for torch users. Every
// epoch of the fault-tolerant communicator also gets a ProcessGroupCrossbar backend over
// the survivors (built collectively inside shrink()/grow(), aborted on every revoke), which
// python/crossbar/ft.py wraps into a torch.distributed ProcessGroup.
//
// The rendezvous store is torch's (TCPStore from torchrun or the caller); it must outlive
// every rank. The failure detector gets its own connection (store.clone()).
#include <fmt/format.h>
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/errors.h"
#include "comm/ft.h"
#include "torch_backend/backend.h"

namespace py = pybind11;

namespace crossbar::torch_backend {
namespace {

// The torch backend of the current epoch, as an epoch resource of the FT communicator.
class EpochBackend : public ft::EpochResource {
 public:
  EpochBackend(c10::intrusive_ptr<c10d::Store> store, std::string name, Millis timeout)
      : store_(std::move(store)), name_(std::move(name)), timeout_(timeout) {}

  // Collective over the epoch's members (Communicator::create inside the backend).
  void build(uint64_t epoch, int rank, int size) {
    auto opts = c10::make_intrusive<CrossbarBackend::Options>(std::chrono::milliseconds(timeout_.count()));
    opts->name = fmt::format("{}.e{}", name_, epoch);
    auto prefixed =
        c10::make_intrusive<c10d::PrefixStore>(fmt::format("crossbar/ft/{}/e{}/torch", name_, epoch), store_);
    auto fresh = c10::make_intrusive<CrossbarBackend>(prefixed, rank, size, opts);
    c10::intrusive_ptr<CrossbarBackend> old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      old = std::exchange(backend_, fresh);
      epoch_ = epoch;
    }
    if (old) old->abort();  // its pending work already failed with the revoke
  }

  void abortEpoch(const std::string& reason, std::exception_ptr error) override {
    std::lock_guard<std::mutex> lock(mu_);
    // Communicator::abort is nonblocking: safe from the detector thread.
    if (backend_ && !backend_->communicator().aborted()) backend_->communicator().abort(reason, error);
  }

  void advance(const ft::EpochChange& change) override {
    build(change.new_epoch, change.comm->rank(), change.comm->size());
  }

  c10::intrusive_ptr<CrossbarBackend> backend() const {
    std::lock_guard<std::mutex> lock(mu_);
    return backend_;
  }

  void shutdown() {
    c10::intrusive_ptr<CrossbarBackend> old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      old = std::exchange(backend_, {});
    }
    if (old) old->abort();
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string name_;
  Millis timeout_;
  mutable std::mutex mu_;
  c10::intrusive_ptr<CrossbarBackend> backend_;
  uint64_t epoch_ = 0;
};

class FtGroup {
 public:
  struct Config {
    std::string name = "torch";
    Millis timeout{0};  // operations and transitions; 0: CROSSBAR_TIMEOUT
    Millis detect_timeout{0};
    Millis heartbeat{0};
  };

  static std::unique_ptr<FtGroup> create(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                         const Config& config) {
    std::unique_ptr<FtGroup> g(new FtGroup(store, config));
    g->ft_ =
        ft::FaultTolerantComm::create(std::make_shared<TorchStoreAdapter>(store), rank, size, g->options_);
    g->start();
    return g;
  }

  static std::unique_ptr<FtGroup> join(const c10::intrusive_ptr<c10d::Store>& store, const Config& config) {
    std::unique_ptr<FtGroup> g(new FtGroup(store, config));
    g->ft_ = ft::FaultTolerantComm::join(std::make_shared<TorchStoreAdapter>(store), g->options_);
    g->start();
    return g;
  }

  ~FtGroup() { close(); }

  int rank() const { return comm().rank(); }
  int size() const { return comm().size(); }
  uint64_t epoch() const { return open().epoch(); }
  c10::intrusive_ptr<CrossbarBackend> backend() const { return backend_->backend(); }

  // The faults an operation's error stands for (dead / hung / unreachable); revokes.
  std::vector<ft::PeerFault> handleError(const std::string& code, const std::vector<int>& peers,
                                         const std::string& message) {
    auto& ft = open();
    // `code` is crossbar.errors' .code: errorCodeName() of the C++ error.
    if (code == "Timeout") return ft.handleError(Timeout(message, peers));
    if (code == "PeerFailure") return ft.handleError(PeerFailure(message, peers));
    if (code == "Aborted") return ft.handleError(Aborted(message, peers));
    return ft.handleError(std::runtime_error(message));
  }
  std::vector<ft::PeerFault> faults() const {
    comm();  // a member (the detector exists)
    return open().detector().faults();
  }
  bool revoked() const {
    comm();
    return open().detector().revoked();
  }
  void shrink() { open().shrink(); }
  void grow(int target) { open().grow(target); }
  void abort(const std::string& reason) { open().abort(reason); }

  void close() {
    if (!ft_) return;
    ft_->detach(backend_.get());
    backend_->shutdown();
    ft_->close();
    ft_.reset();
  }

 private:
  FtGroup(const c10::intrusive_ptr<c10d::Store>& store, const Config& config) {
    options_.name = config.name;
    options_.comm.timeout = config.timeout;
    options_.detect_timeout = config.detect_timeout;
    options_.heartbeat_interval = config.heartbeat;
    // The detector's own connection: a heartbeat must not queue behind a long get().
    options_.detector_store = std::make_shared<TorchStoreAdapter>(store->clone());
    backend_ = std::make_shared<EpochBackend>(store, config.name,
                                              config.timeout.count() > 0 ? config.timeout : defaultTimeout());
  }

  void start() {
    backend_->build(ft_->epoch(), ft_->rank(), ft_->size());
    ft_->attach(backend_);
  }

  ft::FaultTolerantComm& open() const {
    if (!ft_) throw InvalidUsage(errorContext(-1, "FaultTolerantGroup") + "the group was closed");
    return *ft_;
  }
  const Communicator& comm() const {
    auto& c = open().comm();
    if (!c)
      throw InvalidUsage(
          errorContext(-1, "FaultTolerantGroup") +
          "this process is no longer a member (excluded by a shrink); join() again as a new member");
    return *c;
  }

  ft::FtOptions options_;
  std::shared_ptr<EpochBackend> backend_;
  std::unique_ptr<ft::FaultTolerantComm> ft_;
};

py::dict faultDict(const ft::PeerFault& f) {
  py::dict d;
  d["rank"] = f.rank;
  d["kind"] = ft::failureKindName(f.kind);
  d["host"] = f.host;
  d["pid"] = f.pid;
  d["reporter"] = f.reporter;
  d["detail"] = f.detail;
  d["description"] = f.describe();
  return d;
}

py::list faultList(const std::vector<ft::PeerFault>& faults) {
  py::list out;
  for (const auto& f : faults) out.append(faultDict(f));
  return out;
}

FtGroup::Config config(const std::string& name, Millis timeout, Millis detect_timeout, Millis heartbeat) {
  return FtGroup::Config{name, timeout, detect_timeout, heartbeat};
}

}  // namespace

void bindFt(py::module_& m) {
  using Ms = std::chrono::milliseconds;
  py::class_<FtGroup>(m, "FaultTolerantGroup")
      .def_static(
          "create",
          [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const std::string& name,
             Ms timeout, Ms detect_timeout, Ms heartbeat) {
            return FtGroup::create(store, rank, size, config(name, timeout, detect_timeout, heartbeat));
          },
          py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("name"), py::arg("timeout"),
          py::arg("detect_timeout"), py::arg("heartbeat"), py::call_guard<py::gil_scoped_release>())
      .def_static(
          "join",
          [](const c10::intrusive_ptr<c10d::Store>& store, const std::string& name, Ms timeout,
             Ms detect_timeout,
             Ms heartbeat) { return FtGroup::join(store, config(name, timeout, detect_timeout, heartbeat)); },
          py::arg("store"), py::arg("name"), py::arg("timeout"), py::arg("detect_timeout"),
          py::arg("heartbeat"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &FtGroup::rank)
      .def_property_readonly("size", &FtGroup::size)
      .def_property_readonly("epoch", &FtGroup::epoch)
      .def_property_readonly("revoked", &FtGroup::revoked)
      .def("backend", &FtGroup::backend)
      .def(
          "handle_error",
          [](FtGroup& g, const std::string& code, const std::vector<int>& peers, const std::string& message) {
            std::vector<ft::PeerFault> faults;
            {
              py::gil_scoped_release release;
              faults = g.handleError(code, peers, message);
            }
            return faultList(faults);
          },
          py::arg("code"), py::arg("peers"), py::arg("message"))
      .def("faults", [](const FtGroup& g) { return faultList(g.faults()); })
      .def("shrink", &FtGroup::shrink, py::call_guard<py::gil_scoped_release>())
      .def("grow", &FtGroup::grow, py::arg("target_size"), py::call_guard<py::gil_scoped_release>())
      .def("abort", &FtGroup::abort, py::arg("reason"), py::call_guard<py::gil_scoped_release>())
      .def("close", &FtGroup::close, py::call_guard<py::gil_scoped_release>());
  // Thrown by shrink()/grow() on a process the survivors left out.
  py::register_exception<ft::Excluded>(m, "Excluded", py::module_::import("crossbar.errors").attr("Aborted"));
}

}  // namespace crossbar::torch_backend
