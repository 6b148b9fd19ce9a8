// Python extension crossbar._C: the backend class for torch.distributed, info(), and
// translation of crossbar's typed C++ errors into crossbar's Python exceptions
// (defined in crossbar/errors.py so they subclass the matching builtins).
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "comm/env.h"
#include "comm/errors.h"
#include "crossbar_build_info.h"
#include "torch_backend/backend.h"

namespace py = pybind11;
using crossbar::torch_backend::CrossbarBackend;

namespace {

const char* pythonErrorName(crossbar::ErrorCode code) {
  switch (code) {
    case crossbar::ErrorCode::kInvalidArgument:
      return "InvalidArgument";
    case crossbar::ErrorCode::kInvalidUsage:
      return "InvalidUsage";
    case crossbar::ErrorCode::kTimeout:
      return "TimeoutError";
    case crossbar::ErrorCode::kPeerFailure:
      return "PeerFailure";
    case crossbar::ErrorCode::kAborted:
      return "Aborted";
    case crossbar::ErrorCode::kUnsupported:
      return "Unsupported";
    case crossbar::ErrorCode::kSystemError:
      return "SystemError";
    case crossbar::ErrorCode::kCudaError:
    case crossbar::ErrorCode::kNcclError:
    case crossbar::ErrorCode::kUcxError:
    case crossbar::ErrorCode::kInternal:
      return "CrossbarError";
  }
  return "CrossbarError";
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const crossbar::Error& e) {
    py::object cls = py::module_::import("crossbar.errors").attr(pythonErrorName(e.code()));
    py::object exc = cls(std::string(e.what()));
    exc.attr("code") = crossbar::errorCodeName(e.code());
    exc.attr("peers") = py::cast(e.peers());
    PyErr_SetObject(cls.ptr(), exc.ptr());
  }
}

}  // namespace

void bindTelemetry(py::module_& m);  // bind_telemetry.cc
void bindMoe(py::module_& m);        // bind_moe.cc
namespace crossbar::torch_backend {
void bindFt(py::module_& m);    // bind_ft.cc
void bindSymm(py::module_& m);  // bind_symm.cc
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "crossbar's torch.distributed backend (C++ part)";
  // c10d's Python types (Backend, Store, Work) must be registered before ours derive from them.
  py::module_::import("torch.distributed");
  py::register_exception_translator(&translate);

  py::class_<CrossbarBackend, c10d::Backend, c10::intrusive_ptr<CrossbarBackend>>(m, "ProcessGroupCrossbar")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, int ranks_per_node, const std::string& name) {
             auto opts = c10::make_intrusive<CrossbarBackend::Options>(timeout);
             opts->ranks_per_node = ranks_per_node;
             opts->name = name;
             return c10::make_intrusive<CrossbarBackend>(store, rank, size, opts);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("ranks_per_node") = -1, py::arg("name") = "", py::call_guard<py::gil_scoped_release>(),
           "Collective: every rank of the group constructs one (rendezvous through `store`).")
      .def_property_readonly("supports_coalescing", [](const CrossbarBackend&) { return true; })
      .def_property_readonly("supports_splitting", [](const CrossbarBackend&) { return true; })
      // new_group() on a device-bound default group (init_process_group(device_id=...)):
      // members split the default group's communicator (_split_for_group, from
      // crossbar._create_backend) and non-members take part here, as with NCCL's
      // ncclCommSplit: Communicator::split is collective over the parent.
      .def(
          "perform_nocolor_split",
          [](CrossbarBackend& b, const py::object& /*device*/) {
            b.split(nullptr, std::vector<int>{}, nullptr);  // not a member: no child
          },
          py::arg("device"), py::call_guard<py::gil_scoped_release>())
      .def(
          "_split_for_group",
          [](CrossbarBackend& b, const std::vector<int>& ranks, std::chrono::milliseconds timeout) {
            // The child shares the parent's transports and topology; only the timeout is its own.
            return b.split(nullptr, ranks, c10::make_intrusive<CrossbarBackend::Options>(timeout));
          },
          py::arg("ranks"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
          "Collective over this group: the backend of the new group `ranks` (this group's ranks; the "
          "position is the new rank), sharing this group's transports; None where this rank is not in `ranks`.")
      .def(
          "_split_members",
          [](CrossbarBackend& b, const std::vector<int>& ranks, std::chrono::milliseconds timeout,
             const std::string& name) { return b.splitMembers(ranks, timeout, name); },
          py::arg("ranks"), py::arg("timeout"), py::arg("name") = "", py::call_guard<py::gil_scoped_release>(),
          "Members only (non-members do not call): the backend of the new group `ranks` (this group's "
          "ranks; the position is the new rank), sharing this group's transports; None where this rank is "
          "not in `ranks`.")
      .def("describe", [](const CrossbarBackend& b) { return b.communicator().describe(); })
      .def("_cuda_p2p_path", &CrossbarBackend::cudaP2pPath,
           "How CUDA point to point runs on this group: '' (no CUDA call yet), 'nccl', or 'host-staged' "
           "(two ranks share a GPU, which NCCL refuses)")
      .def("abort", &CrossbarBackend::abort, py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &CrossbarBackend::shutdown, py::call_guard<py::gil_scoped_release>())
      .def("set_timeout", &CrossbarBackend::setTimeout);

  bindTelemetry(m);
  bindMoe(m);
  crossbar::torch_backend::bindFt(m);
  crossbar::torch_backend::bindSymm(m);
  m.def("_build_info", [] {
    py::dict d;
    d["version"] = CROSSBAR_VERSION;
    d["build_type"] = CROSSBAR_BUILD_TYPE;
    d["compiler"] = CROSSBAR_COMPILER;
    d["cuda"] = static_cast<bool>(CROSSBAR_CUDA_ENABLED);
    d["torch_compiled"] = TORCH_VERSION;
#if CROSSBAR_TORCH_CUDA
    d["cuda_tensors"] = true;  // CUDA tensors run on CudaCollectives
#else
    d["cuda_tensors"] = false;
#endif
    d["transports"] = std::vector<std::string>{"shm", "ucx"};
    return d;
  });
  m.def("_throw_for_test", [](const std::string& kind, const std::string& msg) {
    if (kind == "timeout") throw crossbar::Timeout(msg);
    if (kind == "peer") throw crossbar::PeerFailure(msg, {1});
    if (kind == "unsupported") throw crossbar::Unsupported(msg);
    if (kind == "argument") throw crossbar::InvalidArgument(msg);
    throw crossbar::InvalidUsage(msg);
  });
}
