// crossbar._C._moe: MoE dispatch/combine (collectives/moe) on torch tensors over a crossbar
// process group's communicator: CPU tensors through MoeBuffer (host path), CUDA tensors
// through CudaMoeBuffer (CUDA builds against a CUDA torch) on torch's current stream, with
// every result and per-call temporary allocated by torch's caching allocator (stream-ordered:
// no cudaFree, no device synchronization). crossbar/moe.py wraps it (argument checks that need
// torch types, payload views, the expert-major combine).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <memory>
#include <string>

#include "collectives/moe/host_codec.h"
#include "collectives/moe/moe.h"
#include "collectives/moe/moe_plan.h"
#include "comm/errors.h"
#include "torch_backend/backend.h"

// CROSSBAR_TORCH_CUDA implies a CUDA build of crossbar, whose MoE layer has the CUDA executor
// (collectives/moe/CMakeLists.txt); perf/gpu/build_torch_ext.sh sets only the former.
#if CROSSBAR_TORCH_CUDA
#define CROSSBAR_MOE_CUDA_TENSORS 1
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "collectives/moe/cuda/moe_cuda.h"
#else
#define CROSSBAR_MOE_CUDA_TENSORS 0
#endif

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

// `t` must live where the buffer works: the CPU (cuda_device < 0) or that CUDA device.
void requireOnDevice(const at::Tensor& t, int cuda_device, const char* what) {
  if (cuda_device < 0 && !t.device().is_cpu())
    throw Unsupported(std::string(what) + " is on " + t.device().str() +
                      ": this crossbar.moe Buffer runs on CPU tensors; create it with device='cuda' for CUDA "
                      "tensors, or move the tensor with .cpu()");
  if (cuda_device >= 0 && (!t.is_cuda() || t.device().index() != cuda_device))
    throw InvalidArgument(std::string(what) + " is on " + t.device().str() +
                          ": this crossbar.moe Buffer runs on cuda:" + std::to_string(cuda_device) +
                          "; move the tensor there (.to('cuda:" + std::to_string(cuda_device) + "'))");
  if (!t.is_contiguous())
    throw InvalidArgument(std::string(what) + " must be contiguous (call .contiguous())");
}

py::dict metricsDict(const moe::MoeMetrics& m) {
  py::dict metrics;
  metrics["inter_node_bytes"] = m.inter_node_bytes;
  metrics["intra_node_bytes"] = m.intra_node_bytes;
  metrics["flat_bytes"] = m.flat_bytes;
  metrics["dedup_factor"] = m.dedup_factor;
  metrics["network_dedup"] = m.network_dedup;
  metrics["dropped"] = m.dropped;
  metrics["expert_imbalance"] = m.expert_imbalance;
  return metrics;
}

#if CROSSBAR_MOE_CUDA_TENSORS
// CudaMoeBuffer's per-call memory as torch tensors: the deleter owns the tensor, so the
// storage goes back to the caching allocator (into the stream it came from) with its last
// owner, and results can be handed out as views of it.
struct TensorKeeper {
  at::Tensor tensor;
  void operator()(void*) const {}
};

moe::DeviceStorage allocateTensor(size_t bytes, int device) {
  // at::empty on a CUDA device allocates for that device's current stream: the buffer's
  // calls run on it (PyBuffer passes getCurrentCUDAStream).
  at::Tensor t = at::empty(
      {static_cast<int64_t>(bytes)},
      at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  void* p = t.data_ptr();
  return moe::DeviceStorage(p, TensorKeeper{std::move(t)});
}

const at::Tensor* keptTensor(const moe::DeviceStorage& s) {
  const auto* k = std::get_deleter<TensorKeeper>(s);
  return k ? &k->tensor : nullptr;
}

// The result array at `ptr` (`shape` of `type`) as a view of the tensor among `owners` that
// holds it; an empty tensor on the device when there is nothing.
at::Tensor viewOf(const void* ptr, at::ScalarType type, std::vector<int64_t> shape,
                  const std::vector<moe::DeviceStorage>& owners, int device) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const auto opts = at::TensorOptions().dtype(type).device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  if (numel == 0 || !ptr) return at::empty(shape, opts);
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(type));
  for (const auto& o : owners) {
    const at::Tensor* t = keptTensor(o);
    if (!t) continue;
    const auto* base = static_cast<const uint8_t*>(t->data_ptr());
    const auto* p = static_cast<const uint8_t*>(ptr);
    if (p >= base && p + bytes <= base + t->numel())
      return t->narrow(0, p - base, bytes).view(type).view(shape);
  }
  throw InternalError("crossbar.moe (cuda): a result array is not in memory from torch's allocator");
}

// The caller's stream works on `t` (allocated on any stream): its memory is not reused before
// the stream gets there.
void recordUse(const at::Tensor& t, const c10::cuda::CUDAStream& stream) {
  if (t.defined() && t.numel() > 0)
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
}
#endif

PayloadFormat formatOf(const std::string& s) {
  if (s == "native") return PayloadFormat::kNative;
  if (s == "fp8") return PayloadFormat::kFp8;
  if (s == "mxfp8") return PayloadFormat::kMxfp8;
  if (s == "nvfp4") return PayloadFormat::kNvfp4;
  throw InvalidArgument("payload format '" + s + "': use native, fp8, mxfp8 or nvfp4");
}

// The large arrays of a CPU dispatch result: its tensors view them without a copy and keep
// this alive. dispatch(out=...) passes them to the next dispatch as MoeBuffer's `recycle`,
// which takes only arrays whose capacity suffices (never reallocating them); what it takes
// moves to the next result's memory, which this one keeps alive from then on (its tensors
// still view it, now with the new result's bytes: torch's out= semantics).
struct ResultMemory {
  std::vector<uint8_t> x, x_expert_major, q_payload, q_scales, q_payload_expert_major, q_scales_expert_major;
  std::vector<std::shared_ptr<ResultMemory>> heirs;  // hold memory handed on by out=
};

// Moves the large arrays between a ResultMemory and a DispatchResult (either way).
template <class From, class To>
void moveArrays(From& from, To& to) {
  to.x = std::move(from.x);
  to.x_expert_major = std::move(from.x_expert_major);
  to.q_payload = std::move(from.q_payload);
  to.q_scales = std::move(from.q_scales);
  to.q_payload_expert_major = std::move(from.q_payload_expert_major);
  to.q_scales_expert_major = std::move(from.q_scales_expert_major);
}

moe::RecvOutput recvOutputOf(const std::string& s) {
  if (s == "config") return moe::RecvOutput::kConfig;
  if (s == "dequantized") return moe::RecvOutput::kDequantized;
  if (s == "quantized") return moe::RecvOutput::kQuantized;
  if (s == "both") return moe::RecvOutput::kBoth;
  throw InvalidArgument("output '" + s + "': use config, dequantized, quantized or both");
}
struct PyResultMemory {
  std::shared_ptr<ResultMemory> memory;
};

// Which forms a dispatch returns (moe::RecvOutput): the dequantized x, the quantized rows, or both.
struct ReturnedForms {
  bool x = false;
  bool quantized = false;
};
ReturnedForms returnedForms(const MoeConfig& cfg, moe::RecvOutput recv) {
  ReturnedForms f;
  f.x = recv != moe::RecvOutput::kQuantized;
  f.quantized = cfg.format != PayloadFormat::kNative &&
                (recv == moe::RecvOutput::kQuantized || recv == moe::RecvOutput::kBoth ||
                 (recv == moe::RecvOutput::kConfig && cfg.return_quantized));
  return f;
}

// The arguments both executors take: x, or the pre-quantized x when x is absent.
MoeBuffer::DispatchArgs dispatchArgs(const at::Tensor& topk_idx, const std::optional<at::Tensor>& x,
                                     const moe::QuantizedTokens& xq, const float* weights,
                                     moe::RecvOutput recv) {
  MoeBuffer::DispatchArgs a;
  a.tokens = static_cast<size_t>(topk_idx.size(0));
  a.x = x ? x->data_ptr() : nullptr;
  a.x_quantized = x ? nullptr : &xq;
  a.topk_idx = topk_idx.data_ptr<int64_t>();
  a.topk_weights = weights;
  a.output = recv;
  return a;
}


// A byte tensor viewing `v` (owned by `keep`, which the tensor keeps alive).
at::Tensor viewBytes(std::vector<uint8_t>& v, const std::shared_ptr<void>& keep) {
  if (v.empty()) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
  return at::from_blob(
      v.data(), {static_cast<int64_t>(v.size())}, [keep](void*) {}, at::TensorOptions().dtype(at::kByte));
}

// `v` as a tensor of `type` and `shape`, without a copy (the tensor owns the vector).
template <typename T>
at::Tensor ownedTensor(std::vector<T>&& v, at::ScalarType type, std::vector<int64_t> shape) {
  if (v.empty()) return at::empty(shape, at::TensorOptions().dtype(type));
  auto owner = std::make_shared<std::vector<T>>(std::move(v));
  void* data = owner->data();
  return at::from_blob(data, shape, [owner](void*) {}, at::TensorOptions().dtype(type));
}

struct PyHandle {
  std::shared_ptr<const MoeHandle> handle;  // CPU buffers
#if CROSSBAR_MOE_CUDA_TENSORS
  std::shared_ptr<const moe::CudaMoeHandle> cuda;  // CUDA buffers
#endif
  size_t numRecv() const {
#if CROSSBAR_MOE_CUDA_TENSORS
    if (cuda) return moe::handleNumRecv(*cuda);
#endif
    return handle ? moe::handleNumRecv(*handle) : 0;
  }
};

class PyBuffer {
 public:
  PyBuffer(const py::object& backend, size_t max_tokens, size_t hidden, int topk, int num_experts,
           const std::string& dtype, const std::string& format, bool return_quantized,
           int64_t expert_capacity, int64_t chunk_tokens, int64_t timeout_ms, const std::string& combine_wire,
           int cuda_device)
      : cuda_device_(cuda_device) {
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
    if (cuda_device < 0) {
      py::gil_scoped_release release;
      buf_ = MoeBuffer::create(comm_, cfg);
      return;
    }
#if CROSSBAR_MOE_CUDA_TENSORS
    // No CUDAGuard here: without a usable device, create() raises crossbar's Unsupported with
    // the reason, where torch's guard would raise a bare CUDA error.
    moe::CudaMoeBuffer::Options o;
    o.device = cuda_device;
    o.allocate = [cuda_device](size_t bytes, cudaStream_t) { return allocateTensor(bytes, cuda_device); };
    py::gil_scoped_release release;
    cuda_ = moe::CudaMoeBuffer::create(comm_, cfg, std::move(o));
#else
    throw Unsupported(
        "crossbar.moe on CUDA tensors: this crossbar build has no CUDA MoE path (built without "
        "CUDA, or against a CPU-only torch); use CPU tensors (device='cpu')");
#endif
  }

  const MoeConfig& config() const {
#if CROSSBAR_MOE_CUDA_TENSORS
    if (cuda_) return cuda_->config();
#endif
    return buf_->config();
  }

  py::dict layout(const at::Tensor& topk_idx, int num_experts) const {
    requireIdx(topk_idx);
    moe::Layout l;
    {
      py::gil_scoped_release release;
      const auto* idx = topk_idx.data_ptr<int64_t>();
      const auto tokens = static_cast<size_t>(topk_idx.size(0));
#if CROSSBAR_MOE_CUDA_TENSORS
      if (cuda_)
        l = cuda_->layout(idx, tokens, num_experts);
      else
#endif
        l = buf_->layout(idx, tokens, num_experts);
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

  // x: [tokens, hidden] in the buffer's dtype, or none with xq_payload / xq_scales: a
  // pre-quantized x as byte tensors [tokens, bytes per row] (crossbar/moe.py views the caller's
  // float8 / float32 tensors as bytes; MoeBuffer checks the row sizes against the format).
  // output: "config", "dequantized", "quantized" or "both" (moe::RecvOutput).
  py::dict dispatch(const std::optional<at::Tensor>& x, const at::Tensor& topk_idx,
                    const std::optional<at::Tensor>& weights, const std::optional<PyHandle>& cached,
                    const std::optional<PyResultMemory>& out, const std::optional<at::Tensor>& xq_payload,
                    const std::optional<at::Tensor>& xq_scales, double xq_global_scale, const std::string& output) {
    const auto& cfg = config();
    requireIdx(topk_idx, cuda_device_);
    const moe::RecvOutput recv = recvOutputOf(output);
    moe::QuantizedTokens xq;
    if (x.has_value() == (xq_payload.has_value() || xq_scales.has_value()))
      throw InvalidUsage("dispatch: pass x or a pre-quantized x (codes, scales), one of them");
    if (x) {
      requireOnDevice(*x, cuda_device_, "x");
      if (x->dim() != 2 || x->size(1) != static_cast<int64_t>(cfg.hidden) || x->size(0) != topk_idx.size(0))
        throw InvalidArgument("x must be [tokens, hidden] with tokens = topk_idx.shape[0] and hidden = " +
                              std::to_string(cfg.hidden));
      if (dataTypeOf(*x, "x") != cfg.dtype) throw InvalidArgument("x's dtype differs from the buffer's dtype");
    } else {
      if (!xq_payload || !xq_scales) throw InvalidUsage("dispatch: a pre-quantized x needs codes and scales");
      for (const at::Tensor* t : {&*xq_payload, &*xq_scales}) {
        requireOnDevice(*t, cuda_device_, t == &*xq_payload ? "x's codes" : "x's scales");
        if (t->scalar_type() != at::kByte || t->dim() != 2 || t->size(0) != topk_idx.size(0))
          throw InvalidUsage(std::string("dispatch: pre-quantized x's ") + (t == &*xq_payload ? "codes" : "scales") +
                             " must be [tokens, ...] with tokens = topk_idx.shape[0] = " +
                             std::to_string(topk_idx.size(0)));
      }
      xq.format = cfg.format;  // crossbar/moe.py matched the tensors' dtypes to the buffer's format
      xq.payload = xq_payload->data_ptr();
      xq.scales = xq_scales->data_ptr();
      xq.payload_row_bytes = static_cast<size_t>(xq_payload->size(1));
      xq.scale_row_bytes = static_cast<size_t>(xq_scales->size(1));
      xq.global_scale = static_cast<float>(xq_global_scale);
    }
    const float* w = nullptr;
    if (weights) {
      requireOnDevice(*weights, cuda_device_, "topk_weights");
      if (weights->scalar_type() != at::kFloat || weights->sizes() != topk_idx.sizes())
        throw InvalidArgument("topk_weights must be float32 with topk_idx's shape");
      w = weights->data_ptr<float>();
    }
#if CROSSBAR_MOE_CUDA_TENSORS
    if (cuda_) return dispatchCuda(x, xq_payload, xq_scales, xq, recv, topk_idx, weights, w, cached);
#endif
    DispatchResult r;
    auto mem = std::make_shared<ResultMemory>();
    {
      py::gil_scoped_release release;
      DispatchResult spare;
      ResultMemory* old = out && out->memory ? out->memory.get() : nullptr;
      if (old) moveArrays(*old, spare);
      MoeBuffer::DispatchArgs a = dispatchArgs(topk_idx, x, xq, w, recv);
      a.cached = cached ? cached->handle : nullptr;
      a.recycle = old ? &spare : nullptr;
      try {
        r = buf_->dispatch(a);
      } catch (...) {
        // A dispatch that throws leaves the recycled arrays in `spare` (moe.h): back to the
        // old tensors' memory.
        if (old) moveArrays(spare, *old);
        throw;
      }
      moveArrays(r, *mem);
      if (old) {
        // What dispatch did not take stays with the old tensors; what it took (never
        // reallocated) now belongs to `mem`, which the old tensors then need alive.
        moveArrays(spare, *old);
        old->heirs.push_back(mem);
      }
    }
    const int64_t n = static_cast<int64_t>(r.num_recv), H = static_cast<int64_t>(cfg.hidden), k = cfg.topk;
    const int64_t le = buf_->numLocalExperts(), m = static_cast<int64_t>(r.expert_rows.size());
    const at::ScalarType st = scalarType(cfg.dtype);
    py::dict d;
    const ReturnedForms forms = returnedForms(cfg, recv);
    const bool has_x = forms.x, has_q = forms.quantized;
    if (has_x) d["x"] = viewBytes(mem->x, mem).view(st).view({n, H});
    d["src_rank"] = toTensor(r.src_rank, at::kInt, {n});
    d["src_token"] = toTensor(r.src_token, at::kInt, {n});
    d["recv_per_rank"] = toTensor(r.recv_per_rank, at::kInt, {static_cast<int64_t>(r.recv_per_rank.size())});
    d["topk_idx"] = toTensor(r.topk_idx, at::kLong, {n, k});
    d["topk_weights"] = toTensor(r.topk_weights, at::kFloat, {n, k});
    d["tokens_per_expert"] = toTensor(r.tokens_per_expert, at::kInt, {le});
    d["expert_offsets"] = toTensor(r.expert_offsets, at::kInt, {le + 1});
    d["expert_rows"] = toTensor(r.expert_rows, at::kInt, {m});
    d["expert_weights"] = toTensor(r.expert_weights, at::kFloat, {m});
    if (has_x) d["x_expert_major"] = viewBytes(mem->x_expert_major, mem).view(st).view({m, H});
    if (has_q) {
      // Widths from the row format (also right for n = 0, where the caller's dtype views of
      // the scales need a whole number of elements per row).
      const moe::RowFormat rf = moe::makeRowFormat(cfg);
      const auto pb = static_cast<int64_t>(rf.payload_bytes), sb = static_cast<int64_t>(rf.scale_bytes);
      d["q_payload"] = viewBytes(mem->q_payload, mem).view({n, pb});
      d["q_scales"] = viewBytes(mem->q_scales, mem).view({n, sb});
      d["q_global_scale"] = toTensor(r.q_global_scale, at::kFloat, {n});
      if (cfg.expert_major_copy) {
        d["q_payload_expert_major"] = viewBytes(mem->q_payload_expert_major, mem).view({m, pb});
        d["q_scales_expert_major"] = viewBytes(mem->q_scales_expert_major, mem).view({m, sb});
      }
    }
    d["metrics"] = metricsDict(r.metrics);
    PyHandle h;
    h.handle = r.handle;
    d["handle"] = h;
    d["memory"] = PyResultMemory{mem};
    return d;
  }

  py::tuple combine(const at::Tensor& y, const PyHandle& h, const std::optional<at::Tensor>& weights) {
    const auto& cfg = config();
    const int64_t n = static_cast<int64_t>(h.numRecv()), H = static_cast<int64_t>(cfg.hidden);
    requireHandle(h, "combine");
    requireOnDevice(y, cuda_device_, "y");
    if (y.dim() != 2 || y.size(0) != n || y.size(1) != H)
      throw InvalidArgument("y must be [num_recv, hidden] = [" + std::to_string(n) + ", " +
                            std::to_string(H) + "] (the rows dispatch returned)");
    const DataType yt = dataTypeOf(y, "y");
    const float* w = nullptr;
    if (weights) {
      requireOnDevice(*weights, cuda_device_, "weights");
      if (weights->scalar_type() != at::kFloat || weights->dim() != 1 || weights->size(0) != n)
        throw InvalidArgument("weights must be float32 [num_recv]");
      w = weights->data_ptr<float>();
    }
#if CROSSBAR_MOE_CUDA_TENSORS
    if (cuda_) return combineCuda(y, yt, h, weights, w, false);
#endif
    moe::CombineResult r;
    {
      py::gil_scoped_release release;
      r = buf_->combine(y.data_ptr(), yt, *h.handle, w);
    }
    py::dict metrics;
    metrics["inter_node_bytes"] = r.metrics.inter_node_bytes;
    metrics["intra_node_bytes"] = r.metrics.intra_node_bytes;
    const int64_t rows = static_cast<int64_t>(r.out.size()) / std::max<int64_t>(H, 1);
    return py::make_tuple(ownedTensor(std::move(r.out), at::kFloat, {rows, H}), metrics);
  }

  // CUDA buffers only (crossbar/moe.py sums CPU tensors itself): combine of expert-major rows
  // y [expert_rows, hidden], each token's rows summed on the device in the host path's order.
  py::tuple combineExpertMajor(const at::Tensor& y, const PyHandle& h,
                               const std::optional<at::Tensor>& weights) {
#if CROSSBAR_MOE_CUDA_TENSORS
    if (cuda_) {
      requireHandle(h, "combine_expert_major");
      requireOnDevice(y, cuda_device_, "y");
      const DataType yt = dataTypeOf(y, "y");
      if (y.dim() != 2 || y.size(1) != static_cast<int64_t>(config().hidden))
        throw InvalidArgument("y must be [expert_rows, hidden]");
      const float* w = nullptr;
      if (weights) {
        requireOnDevice(*weights, cuda_device_, "weights");
        if (weights->scalar_type() != at::kFloat || weights->dim() != 1 || weights->size(0) != y.size(0))
          throw InvalidArgument("weights must be float32 [expert_rows]");
        w = weights->data_ptr<float>();
      }
      return combineCuda(y, yt, h, weights, w, true);
    }
#endif
    (void)y;
    (void)h;
    (void)weights;
    throw InvalidUsage(
        "combine_expert_major in C++ is for CUDA buffers (crossbar.moe sums CPU tensors itself)");
  }

  int numLocalExperts() const {
#if CROSSBAR_MOE_CUDA_TENSORS
    if (cuda_) return cuda_->numLocalExperts();
#endif
    return buf_->numLocalExperts();
  }
  size_t rowBytes() const {
#if CROSSBAR_MOE_CUDA_TENSORS
    if (cuda_) return cuda_->rowBytes();
#endif
    return buf_->rowBytes();
  }
  int device() const {
    return cuda_device_;
  }

 private:
  // layout() reads topk_idx on the host (crossbar/moe.py copies CUDA indices there).
  static void requireIdx(const at::Tensor& idx, int cuda_device = -1) {
    requireOnDevice(idx, cuda_device, "topk_idx");
    if (idx.scalar_type() != at::kLong || idx.dim() != 2)
      throw InvalidArgument("topk_idx must be int64 [tokens, topk]");
  }
  void requireHandle(const PyHandle& h, const char* what) const {
    bool ok = h.handle != nullptr;
#if CROSSBAR_MOE_CUDA_TENSORS
    if (cuda_) ok = h.cuda != nullptr;
#endif
    if (!ok)
      throw InvalidArgument(std::string(what) + ": the handle is empty or comes from a " +
                            (cuda_device_ >= 0 ? "CPU" : "CUDA") + " Buffer");
  }

#if CROSSBAR_MOE_CUDA_TENSORS
  py::dict dispatchCuda(const std::optional<at::Tensor>& x, const std::optional<at::Tensor>& xq_payload,
                        const std::optional<at::Tensor>& xq_scales, const moe::QuantizedTokens& xq,
                        moe::RecvOutput recv, const at::Tensor& topk_idx, const std::optional<at::Tensor>& weights,
                        const float* w, const std::optional<PyHandle>& cached) {
    const auto& cfg = cuda_->config();
    if (cached && !cached->cuda) throw InvalidArgument("dispatch: the cached handle comes from a CPU Buffer");
    const auto dev = static_cast<c10::DeviceIndex>(cuda_device_);
    c10::cuda::CUDAGuard guard(dev);
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(dev);
    for (const auto* t : {&x, &xq_payload, &xq_scales, &weights})
      if (*t) recordUse(**t, stream);
    recordUse(topk_idx, stream);
    moe::CudaDispatchResult r;
    {
      py::gil_scoped_release release;
      r = cuda_->dispatch(dispatchArgs(topk_idx, x, xq, w, recv), stream.stream(), cached ? cached->cuda : nullptr);
    }
    const int64_t n = static_cast<int64_t>(r.num_recv), H = static_cast<int64_t>(cfg.hidden), k = cfg.topk;
    const int64_t le = cuda_->numLocalExperts(),
                  m = r.expert_offsets.empty() ? 0 : static_cast<int64_t>(r.expert_offsets.back());
    const at::ScalarType st = scalarType(cfg.dtype);
    const auto& own = r.storage;
    const int d = cuda_device_;
    py::dict out;
    const ReturnedForms forms = returnedForms(cfg, recv);
    const bool has_x = forms.x, has_q = forms.quantized;
    if (has_x) out["x"] = viewOf(r.x, st, {n, H}, own, d);
    // These four live in the handle's routing indices: copies (on the stream), so that changing
    // them cannot change the handle, as with the CPU path's independent tensors.
    out["src_rank"] = viewOf(r.src_rank, at::kInt, {n}, own, d).clone();
    out["src_token"] = viewOf(r.src_token, at::kInt, {n}, own, d).clone();
    out["topk_idx"] = viewOf(r.topk_idx, at::kLong, {n, k}, own, d).clone();
    out["expert_rows"] = viewOf(r.expert_rows, at::kInt, {m}, own, d).clone();
    out["topk_weights"] = viewOf(r.topk_weights, at::kFloat, {n, k}, own, d);
    out["expert_weights"] = viewOf(r.expert_weights, at::kFloat, {m}, own, d);
    if (has_x) out["x_expert_major"] = viewOf(r.x_expert_major, st, {cfg.expert_major_copy ? m : 0, H}, own, d);
    // Counts are known on the host when dispatch returns: CPU tensors (reading them never syncs).
    out["recv_per_rank"] =
        toTensor(r.recv_per_rank, at::kInt, {static_cast<int64_t>(r.recv_per_rank.size())});
    out["tokens_per_expert"] = toTensor(r.tokens_per_expert, at::kInt, {le});
    out["expert_offsets"] = toTensor(r.expert_offsets, at::kInt, {le + 1});
    if (has_q) {
      const moe::RowFormat f = moe::makeRowFormat(cfg);
      // Shapes as the CPU path's ([0, 0] when nothing arrived).
      const int64_t pb = n ? static_cast<int64_t>(f.payload_bytes) : 0,
                    sb = n ? static_cast<int64_t>(f.scale_bytes) : 0;
      out["q_payload"] = viewOf(r.q_payload, at::kByte, {n, pb}, own, d);
      out["q_scales"] = viewOf(r.q_scales, at::kByte, {n, sb}, own, d);
      out["q_global_scale"] = viewOf(r.q_global_scale, at::kFloat, {n}, own, d);
      if (cfg.expert_major_copy) {
        out["q_payload_expert_major"] = viewOf(r.q_payload_expert_major, at::kByte, {m, pb}, own, d);
        out["q_scales_expert_major"] = viewOf(r.q_scales_expert_major, at::kByte, {m, sb}, own, d);
      }
    }
    out["metrics"] = metricsDict(r.metrics);
    PyHandle h;
    h.cuda = r.handle;
    out["handle"] = h;
    return out;
  }

  py::tuple combineCuda(const at::Tensor& y, DataType yt, const PyHandle& h,
                        const std::optional<at::Tensor>& weights, const float* w, bool expert_major) {
    const auto dev = static_cast<c10::DeviceIndex>(cuda_device_);
    c10::cuda::CUDAGuard guard(dev);
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(dev);
    recordUse(y, stream);
    if (weights) recordUse(*weights, stream);
    // The handle's indices may come from a dispatch on another stream.
    if (const at::Tensor* t = keptTensor(moe::handleStorage(*h.cuda))) recordUse(*t, stream);
    moe::CudaCombineResult r;
    {
      py::gil_scoped_release release;
      if (expert_major) {
        moe::CudaDispatchResult d;
        d.handle = h.cuda;
        r = cuda_->combineExpertMajor(y.data_ptr(), yt, d, stream.stream(), w);
      } else {
        r = cuda_->combine(y.data_ptr(), yt, *h.cuda, stream.stream(), w);
      }
    }
    const int64_t H = static_cast<int64_t>(cuda_->config().hidden);
    // combineExpertMajor's storage keeps its temporary alive through an aliasing owner: find
    // the output through the result pointer either way.
    const int64_t tokens = static_cast<int64_t>(moe::handleTokens(*h.cuda));
    at::Tensor out = viewOf(r.out, at::kFloat, {tokens, H}, {r.storage}, cuda_device_);
    py::dict metrics;
    metrics["inter_node_bytes"] = r.metrics.inter_node_bytes;
    metrics["intra_node_bytes"] = r.metrics.intra_node_bytes;
    return py::make_tuple(out, metrics);
  }
#endif

  int cuda_device_ = -1;
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<MoeBuffer> buf_;
#if CROSSBAR_MOE_CUDA_TENSORS
  std::unique_ptr<moe::CudaMoeBuffer> cuda_;
#endif
};

// crossbar.moe.quantize: x [tokens, hidden] (CPU bf16 / f32) with the host encoder MoeBuffer
// uses (same bytes): (codes [tokens, payload bytes], scales [tokens, scale bytes], nvfp4
// global scale of the whole tensor, else 1).
py::tuple quantizeTokens(const at::Tensor& x, const std::string& format) {
  const PayloadFormat f = formatOf(format);
  if (f == PayloadFormat::kNative) throw InvalidArgument("quantize: 'native' has no quantized form");
  requireOnDevice(x, -1, "x");
  const DataType dt = dataTypeOf(x, "x");
  if (x.dim() != 2) throw InvalidArgument("quantize: x must be [tokens, hidden]");
  const PayloadCodec c = moe::payloadCodec(f);
  const auto T = static_cast<size_t>(x.size(0)), H = static_cast<size_t>(x.size(1));
  const size_t pb = payloadBytes(c, H), sb = scaleBytes(c, H);
  at::Tensor codes = at::empty({static_cast<int64_t>(T), static_cast<int64_t>(pb)}, at::kByte);
  at::Tensor scales = at::empty({static_cast<int64_t>(T), static_cast<int64_t>(sb)}, at::kByte);
  float g = 1.0f;
  {
    py::gil_scoped_release release;
    const auto* bf = dt == DataType::kBFloat16 ? static_cast<const BFloat16*>(x.data_ptr()) : nullptr;
    const auto* f32 = dt == DataType::kFloat32 ? x.data_ptr<float>() : nullptr;
    if (f == PayloadFormat::kNvfp4)
      g = nvfp4GlobalScale(bf ? moe::tensorAmaxHost(bf, T * H) : moe::tensorAmaxHost(f32, T * H));
    std::vector<float> sc(sb / 4 + 1);  // 4-byte aligned scales of one row
    for (size_t t = 0; t < T; ++t) {
      uint8_t* p = codes.data_ptr<uint8_t>() + t * pb;
      if (bf)
        moe::encodeRowHost(c, bf + t * H, H, p, sc.data(), g);
      else
        moe::encodeRowHost(c, f32 + t * H, H, p, sc.data(), g);
      std::memcpy(scales.data_ptr<uint8_t>() + t * sb, sc.data(), sb);
    }
  }
  return py::make_tuple(codes, scales, g);
}

// crossbar.moe.dequantize: the host decoder MoeBuffer uses; global_scale f32 [tokens].
at::Tensor dequantizeTokens(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& global_scale,
                            const std::string& format, const std::string& dtype) {
  const PayloadFormat f = formatOf(format);
  if (f == PayloadFormat::kNative) throw InvalidArgument("dequantize: 'native' has no quantized form");
  const PayloadCodec c = moe::payloadCodec(f);
  const int64_t T = codes.size(0);
  const size_t pb = static_cast<size_t>(codes.size(1)), sb = static_cast<size_t>(scales.size(1));
  const size_t H = f == PayloadFormat::kNvfp4 ? 2 * pb : pb;
  if (scales.size(0) != T || sb != scaleBytes(c, H) || global_scale.numel() != T ||
      global_scale.scalar_type() != at::kFloat)
    throw InvalidUsage("dequantize: codes [tokens, " + std::to_string(pb) + " B] need scales [tokens, " +
                       std::to_string(scaleBytes(c, H)) + " B] and a float32 global scale per token");
  const bool f32 = dtype == "float32";
  at::Tensor out = at::empty({T, static_cast<int64_t>(H)}, f32 ? at::kFloat : at::kBFloat16);
  py::gil_scoped_release release;
  std::vector<float> sc(sb / 4 + 1);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(sc.data(), scales.data_ptr<uint8_t>() + t * sb, sb);
    const uint8_t* p = codes.data_ptr<uint8_t>() + t * pb;
    const float g = global_scale.data_ptr<float>()[t];
    if (f32)
      moe::decodeRowHost(c, p, sc.data(), H, out.data_ptr<float>() + t * H, g);
    else
      moe::decodeRowHost(c, p, sc.data(), H, static_cast<BFloat16*>(out.data_ptr()) + t * H, g);
  }
  return out;
}

}  // namespace
}  // namespace crossbar::torch_backend

void bindMoe(py::module_& m) {
  using namespace crossbar::torch_backend;
  auto s = m.def_submodule("_moe", "MoE dispatch/combine (see crossbar.moe)");
  s.attr("cuda") = py::bool_(CROSSBAR_MOE_CUDA_TENSORS != 0);  // CUDA tensors supported by this build
  s.def("quantize", &quantizeTokens, py::arg("x"), py::arg("format"));
  s.def("dequantize", &dequantizeTokens, py::arg("codes"), py::arg("scales"), py::arg("global_scale"),
        py::arg("format"), py::arg("dtype"));
  py::class_<PyHandle>(s, "Handle").def_property_readonly("num_recv", &PyHandle::numRecv);
  py::class_<PyResultMemory>(s, "ResultMemory");  // opaque: Dispatched._memory, for dispatch(out=)
  py::class_<PyBuffer>(s, "Buffer")
      .def(py::init<const py::object&, size_t, size_t, int, int, const std::string&, const std::string&, bool,
                    int64_t, int64_t, int64_t, const std::string&, int>(),
           py::arg("backend"), py::arg("max_tokens"), py::arg("hidden"), py::arg("topk"),
           py::arg("num_experts"), py::arg("dtype"), py::arg("format"), py::arg("return_quantized"),
           py::arg("expert_capacity"), py::arg("chunk_tokens"), py::arg("timeout_ms"),
           py::arg("combine_wire"), py::arg("cuda_device") = -1)
      .def("layout", &PyBuffer::layout)
      .def("dispatch", &PyBuffer::dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("weights"),
           py::arg("cached"), py::arg("out") = std::nullopt, py::arg("xq_payload") = std::nullopt,
           py::arg("xq_scales") = std::nullopt, py::arg("xq_global_scale") = 1.0,
           py::arg("output") = "config")
      .def("combine", &PyBuffer::combine)
      .def("combine_expert_major", &PyBuffer::combineExpertMajor)
      .def_property_readonly("device", &PyBuffer::device)
      .def_property_readonly("num_local_experts", &PyBuffer::numLocalExperts)
      .def_property_readonly("row_bytes", &PyBuffer::rowBytes);
}
