// crossbar._C._moe: MoE dispatch/combine (collectives/moe) on CPU torch tensors over a
// crossbar process group's communicator. crossbar/moe.py wraps it (argument checks that
// need torch types, payload views, the expert-major combine).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <memory>
#include <string>

#include "collectives/moe/moe.h"
#include "comm/errors.h"
#include "torch_backend/backend.h"

namespace py = pybind11;

namespace crossbar::torch_backend {
namespace {

using moe::DispatchResult;
using moe::MoeBuffer;
using moe::MoeConfig;
using moe::MoeHandle;
using moe::PayloadFormat;

template <typename T>
at::Tensor toTensor(const std::vector<T>& v, at::ScalarType type, std::vector<int64_t> shape) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
  if (!v.empty()) std::memcpy(t.data_ptr(), v.data(), v.size() * sizeof(T));
  return t;
}

at::ScalarType scalarType(DataType t) {
  return t == DataType::kFloat32 ? at::kFloat : at::kBFloat16;
}

DataType dataTypeOf(const at::Tensor& t, const char* what) {
  if (t.scalar_type() == at::kFloat) return DataType::kFloat32;
  if (t.scalar_type() == at::kBFloat16) return DataType::kBFloat16;
  throw InvalidArgument(std::string(what) + " must be bfloat16 or float32");
}

void requireCpuContiguous(const at::Tensor& t, const char* what) {
  if (!t.device().is_cpu())
    throw Unsupported(std::string(what) + " is on " + t.device().str() +
                      ": crossbar.moe runs on CPU tensors (host path); move it with .cpu()");
  if (!t.is_contiguous())
    throw InvalidArgument(std::string(what) + " must be contiguous (call .contiguous())");
}

PayloadFormat formatOf(const std::string& s) {
  if (s == "native") return PayloadFormat::kNative;
  if (s == "fp8") return PayloadFormat::kFp8;
  if (s == "mxfp8") return PayloadFormat::kMxfp8;
  if (s == "nvfp4") return PayloadFormat::kNvfp4;
  throw InvalidArgument("payload format '" + s + "': use native, fp8, mxfp8 or nvfp4");
}

struct PyHandle {
  std::shared_ptr<const MoeHandle> handle;
};

class PyBuffer {
 public:
  PyBuffer(const py::object& backend, size_t max_tokens, size_t hidden, int topk, int num_experts,
           const std::string& dtype, const std::string& format, bool return_quantized,
           int64_t expert_capacity, int64_t chunk_tokens, int64_t timeout_ms,
           const std::string& combine_wire) {
    auto& b = backend.cast<CrossbarBackend&>();
    MoeConfig cfg;
    cfg.max_tokens = max_tokens;
    cfg.hidden = hidden;
    cfg.topk = topk;
    cfg.num_experts = num_experts;
    if (dtype != "bfloat16" && dtype != "float32")
      throw InvalidArgument("dtype '" + dtype + "': use bfloat16 or float32");
    cfg.dtype = dtype == "float32" ? DataType::kFloat32 : DataType::kBFloat16;
    cfg.format = formatOf(format);
    cfg.return_quantized = return_quantized;
    cfg.expert_capacity = expert_capacity;
    cfg.chunk_tokens = chunk_tokens;
    cfg.timeout = Millis(timeout_ms);
    if (combine_wire != "bfloat16" && combine_wire != "float32")
      throw InvalidArgument("combine_wire '" + combine_wire + "': use bfloat16 or float32");
    cfg.combine_wire = combine_wire == "bfloat16" ? DataType::kBFloat16 : DataType::kFloat32;
    comm_ = b.communicator().shared_from_this();
    py::gil_scoped_release release;
    buf_ = MoeBuffer::create(comm_, cfg);
  }

  py::dict layout(const at::Tensor& topk_idx, int num_experts) const {
    requireIdx(topk_idx);
    moe::Layout l;
    {
      py::gil_scoped_release release;
      l = buf_->layout(topk_idx.data_ptr<int64_t>(), static_cast<size_t>(topk_idx.size(0)), num_experts);
    }
    const int64_t R = comm_->size(), T = topk_idx.size(0);
    py::dict d;
    d["tokens_per_rank"] = toTensor(l.tokens_per_rank, at::kInt, {R});
    d["tokens_per_node"] =
        toTensor(l.tokens_per_node, at::kInt, {static_cast<int64_t>(l.tokens_per_node.size())});
    d["tokens_per_expert"] = toTensor(l.tokens_per_expert, at::kInt, {num_experts});
    d["is_token_in_rank"] = toTensor(l.is_token_in_rank, at::kBool, {T, R});
    d["token_node_pairs"] = l.token_node_pairs;
    d["remote_token_node_pairs"] = l.remote_token_node_pairs;
    return d;
  }

  py::dict dispatch(const at::Tensor& x, const at::Tensor& topk_idx, const std::optional<at::Tensor>& weights,
                    const std::optional<PyHandle>& cached) {
    const auto& cfg = buf_->config();
    requireCpuContiguous(x, "x");
    requireIdx(topk_idx);
    if (x.dim() != 2 || x.size(1) != static_cast<int64_t>(cfg.hidden) || x.size(0) != topk_idx.size(0))
      throw InvalidArgument("x must be [tokens, hidden] with tokens = topk_idx.shape[0] and hidden = " +
                            std::to_string(cfg.hidden));
    if (dataTypeOf(x, "x") != cfg.dtype) throw InvalidArgument("x's dtype differs from the buffer's dtype");
    const float* w = nullptr;
    if (weights) {
      requireCpuContiguous(*weights, "topk_weights");
      if (weights->scalar_type() != at::kFloat || weights->sizes() != topk_idx.sizes())
        throw InvalidArgument("topk_weights must be float32 with topk_idx's shape");
      w = weights->data_ptr<float>();
    }
    DispatchResult r;
    {
      py::gil_scoped_release release;
      r = buf_->dispatch(x.data_ptr(), static_cast<size_t>(x.size(0)), topk_idx.data_ptr<int64_t>(), w,
                         cached ? cached->handle : nullptr);
    }
    const int64_t n = static_cast<int64_t>(r.num_recv), H = static_cast<int64_t>(cfg.hidden), k = cfg.topk;
    const int64_t le = buf_->numLocalExperts(), m = static_cast<int64_t>(r.expert_rows.size());
    const at::ScalarType st = scalarType(cfg.dtype);
    py::dict d;
    d["x"] = toTensor(r.x, at::kByte, {static_cast<int64_t>(r.x.size())}).view(st).view({n, H});
    d["src_rank"] = toTensor(r.src_rank, at::kInt, {n});
    d["src_token"] = toTensor(r.src_token, at::kInt, {n});
    d["recv_per_rank"] = toTensor(r.recv_per_rank, at::kInt, {static_cast<int64_t>(r.recv_per_rank.size())});
    d["topk_idx"] = toTensor(r.topk_idx, at::kLong, {n, k});
    d["topk_weights"] = toTensor(r.topk_weights, at::kFloat, {n, k});
    d["tokens_per_expert"] = toTensor(r.tokens_per_expert, at::kInt, {le});
    d["expert_offsets"] = toTensor(r.expert_offsets, at::kInt, {le + 1});
    d["expert_rows"] = toTensor(r.expert_rows, at::kInt, {m});
    d["expert_weights"] = toTensor(r.expert_weights, at::kFloat, {m});
    d["x_expert_major"] =
        toTensor(r.x_expert_major, at::kByte, {static_cast<int64_t>(r.x_expert_major.size())})
            .view(st)
            .view({m, H});
    if (!r.q_payload.empty() || (cfg.return_quantized && cfg.format != PayloadFormat::kNative)) {
      const int64_t pb = n ? static_cast<int64_t>(r.q_payload.size()) / n : 0;
      const int64_t sb = n ? static_cast<int64_t>(r.q_scales.size()) / n : 0;
      d["q_payload"] = toTensor(r.q_payload, at::kByte, {n, pb});
      d["q_scales"] = toTensor(r.q_scales, at::kByte, {n, sb});
      d["q_global_scale"] = toTensor(r.q_global_scale, at::kFloat, {n});
    }
    py::dict metrics;
    metrics["inter_node_bytes"] = r.metrics.inter_node_bytes;
    metrics["intra_node_bytes"] = r.metrics.intra_node_bytes;
    metrics["flat_bytes"] = r.metrics.flat_bytes;
    metrics["dedup_factor"] = r.metrics.dedup_factor;
    metrics["network_dedup"] = r.metrics.network_dedup;
    metrics["dropped"] = r.metrics.dropped;
    metrics["expert_imbalance"] = r.metrics.expert_imbalance;
    d["metrics"] = metrics;
    d["handle"] = PyHandle{r.handle};
    return d;
  }

  py::tuple combine(const at::Tensor& y, const PyHandle& h, const std::optional<at::Tensor>& weights) {
    const auto& cfg = buf_->config();
    if (!h.handle) throw InvalidArgument("combine: empty handle");
    const int64_t n = static_cast<int64_t>(moe::handleNumRecv(*h.handle)),
                  H = static_cast<int64_t>(cfg.hidden);
    requireCpuContiguous(y, "y");
    if (y.dim() != 2 || y.size(0) != n || y.size(1) != H)
      throw InvalidArgument("y must be [num_recv, hidden] = [" + std::to_string(n) + ", " +
                            std::to_string(H) + "] (the rows dispatch returned)");
    const DataType yt = dataTypeOf(y, "y");
    const float* w = nullptr;
    if (weights) {
      requireCpuContiguous(*weights, "weights");
      if (weights->scalar_type() != at::kFloat || weights->dim() != 1 || weights->size(0) != n)
        throw InvalidArgument("weights must be float32 [num_recv]");
      w = weights->data_ptr<float>();
    }
    moe::CombineResult r;
    {
      py::gil_scoped_release release;
      r = buf_->combine(y.data_ptr(), yt, *h.handle, w);
    }
    py::dict metrics;
    metrics["inter_node_bytes"] = r.metrics.inter_node_bytes;
    metrics["intra_node_bytes"] = r.metrics.intra_node_bytes;
    return py::make_tuple(
        toTensor(r.out, at::kFloat, {static_cast<int64_t>(r.out.size()) / std::max<int64_t>(H, 1), H}),
        metrics);
  }

  int numLocalExperts() const { return buf_->numLocalExperts(); }
  size_t rowBytes() const { return buf_->rowBytes(); }

 private:
  static void requireIdx(const at::Tensor& idx) {
    requireCpuContiguous(idx, "topk_idx");
    if (idx.scalar_type() != at::kLong || idx.dim() != 2)
      throw InvalidArgument("topk_idx must be int64 [tokens, topk]");
  }
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<MoeBuffer> buf_;
};

}  // namespace
}  // namespace crossbar::torch_backend

void bindMoe(py::module_& m) {
  using namespace crossbar::torch_backend;
  auto s = m.def_submodule("_moe", "MoE dispatch/combine (see crossbar.moe)");
  py::class_<PyHandle>(s, "Handle").def_property_readonly("num_recv", [](const PyHandle& h) {
    return h.handle ? crossbar::moe::handleNumRecv(*h.handle) : 0;
  });
  py::class_<PyBuffer>(s, "Buffer")
      .def(py::init<const py::object&, size_t, size_t, int, int, const std::string&, const std::string&, bool,
                    int64_t, int64_t, int64_t, const std::string&>(),
           py::arg("backend"), py::arg("max_tokens"), py::arg("hidden"), py::arg("topk"),
           py::arg("num_experts"), py::arg("dtype"), py::arg("format"), py::arg("return_quantized"),
           py::arg("expert_capacity"), py::arg("chunk_tokens"), py::arg("timeout_ms"),
           py::arg("combine_wire"))
      .def("layout", &PyBuffer::layout)
      .def("dispatch", &PyBuffer::dispatch)
      .def("combine", &PyBuffer::combine)
      .def_property_readonly("num_local_experts", &PyBuffer::numLocalExperts)
      .def_property_readonly("row_bytes", &PyBuffer::rowBytes);
}
