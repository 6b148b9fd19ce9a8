// crossbar._C.FaultTolerantGroup: comm/ft.h's FaultTolerantComm for torch users. Every
// epoch of the fault-tolerant communicator also gets a ProcessGroupCrossbar backend over
// the survivors (built collectively inside shrink()/grow(), aborted on every revoke), which
// python/crossbar/ft.py wraps into a torch.distributed ProcessGroup.
//
// The rendezvous store is torch's (TCPStore from torchrun or the caller); it must outlive
// every rank. The failure detector gets its own connection (store.clone()).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "comm/errors.h"
#include "comm/ft.h"
#include "torch_backend/backend.h"

namespace py = pybind11;

namespace crossbar::torch_backend {
namespace {

// The torch backend of the current epoch, as an epoch resource of the FT communicator.
// It runs over the epoch's own Communicator (no second bootstrap per epoch: the
// transports the FT layer built for the survivors are the backend's too), so a revoke
// fails its pending work with the epoch's error.
class EpochBackend : public ft::EpochResource {
 public:
  EpochBackend(std::string name, Millis timeout) : name_(std::move(name)), timeout_(timeout) {}

  void build(const std::shared_ptr<Communicator>& comm, const std::vector<int>& excluded) {
    auto opts = c10::make_intrusive<CrossbarBackend::Options>(std::chrono::milliseconds(timeout_.count()));
    opts->name = fmt::format("{}.e{}", name_, comm->epoch());
    auto fresh = c10::make_intrusive<CrossbarBackend>(comm, opts);
    c10::intrusive_ptr<CrossbarBackend> old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fresh->setShrinkHandler(shrink_handler_);
      old = std::exchange(backend_, fresh);
      excluded_ = excluded;
    }
    if (old) {
      old->setShrinkHandler(nullptr);  // a stale group cannot shrink again
      old->abort();                    // its communicator is the old epoch's, already aborted
    }
  }

  void abortEpoch(const std::string& reason, std::exception_ptr error) override {
    std::lock_guard<std::mutex> lock(mu_);
    // Communicator::abort is nonblocking: safe from the detector thread.
    if (backend_ && !backend_->communicator().aborted()) backend_->communicator().abort(reason, error);
  }

  void advance(const ft::EpochChange& change) override { build(change.comm, change.excluded); }

  c10::intrusive_ptr<CrossbarBackend> backend() const {
    std::lock_guard<std::mutex> lock(mu_);
    return backend_;
  }
  // Old ranks the last transition left out (ascending).
  std::vector<int> excluded() const {
    std::lock_guard<std::mutex> lock(mu_);
    return excluded_;
  }

  // torch.distributed.shrink_group on the current (and every later) backend calls this.
  void setShrinkHandler(CrossbarBackend::ShrinkHandler handler) {
    std::lock_guard<std::mutex> lock(mu_);
    shrink_handler_ = std::move(handler);
    if (backend_) backend_->setShrinkHandler(shrink_handler_);
  }

  void shutdown() {
    c10::intrusive_ptr<CrossbarBackend> old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      shrink_handler_ = nullptr;
      old = std::exchange(backend_, {});
    }
    if (old) {
      old->setShrinkHandler(nullptr);
      old->abort();
    }
  }

 private:
  std::string name_;
  Millis timeout_;
  mutable std::mutex mu_;
  c10::intrusive_ptr<CrossbarBackend> backend_;
  std::vector<int> excluded_;
  CrossbarBackend::ShrinkHandler shrink_handler_;
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
  // torch.distributed.shrink_group(ranks, group=g.group): the same agreement as shrink();
  // torch builds its new ProcessGroup from the list it was given, so the agreed
  // exclusions must be exactly those.
  c10::intrusive_ptr<c10d::Backend> shrinkForTorch(const std::vector<int64_t>& requested) {
    std::optional<py::gil_scoped_release> no_gil;
    if (PyGILState_Check()) no_gil.emplace();  // the agreement blocks; torch may hold the GIL
    auto& ft = open();
    const uint64_t epoch = ft.epoch();
    ft.shrink();  // Excluded on a rank the survivors left out
    std::vector<int> want(requested.begin(), requested.end());
    std::sort(want.begin(), want.end());
    auto agreed = backend_->excluded();
    if (agreed != want)
      throw InvalidUsage(fmt::format(
          "{}the survivors of epoch {} agreed to exclude ranks [{}], not the [{}] passed to shrink_group. "
          "The communicator did shrink (this process is rank {} of {} in epoch {}); take "
          "FaultTolerantGroup.group for the agreed group, and pass the ranks from handle_error()/faults()",
          errorContext(ft.rank(), "shrink_group"), epoch, fmt::join(agreed, ", "), fmt::join(want, ", "),
          ft.rank(), ft.size(), ft.epoch()));
    return backend_->backend();
  }
  void grow(int target) { open().grow(target); }
  void abort(const std::string& reason) { open().abort(reason); }

  void close() {
    if (!ft_) return;
    ft_->detach(backend_.get());
    // Announce leaving before the backend aborts the shared communicator, so peers do
    // not take the closed transports for a failure.
    ft_->close();
    backend_->shutdown();
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
    backend_ = std::make_shared<EpochBackend>(config.name,
                                              config.timeout.count() > 0 ? config.timeout : defaultTimeout());
  }

  void start() {
    backend_->build(ft_->comm(), {});
    // Cleared by close() (through shutdown()) before this object goes.
    backend_->setShrinkHandler([this](const std::vector<int64_t>& ranks) { return shrinkForTorch(ranks); });
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
