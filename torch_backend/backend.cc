// torch.distributed backend over crossbar: tensor checks and staging, dtype/op mapping,
// the Work objects and their completion threads. See backend.h.
#include "torch_backend/backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>

#include "comm/errors.h"
#include "comm/log.h"
#include "comm/progress.h"
#include "comm/thread_name.h"

#if CROSSBAR_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "collectives/cuda/cuda_collectives.h"
#include "symmem/cuda/stream_signal.h"
#endif

namespace crossbar::torch_backend {

namespace {

// ---- store ----------------------------------------------------------------------------

// At least 1 ms: a c10d store reads a zero timeout as "wait forever".
std::chrono::milliseconds storeTimeout(Deadline d) {
  return std::max(d.remaining(), Millis(1));
}

// c10d's store errors as crossbar's typed ones. A wait's timeout is DistStoreError from
// TCPStore but a plain c10::Error ("Wait timeout") from FileStore: so any failure of a wait
// whose deadline has passed (`timed_out`) is a Timeout too, which callers waiting in
// slices (the symmetric heap's rendezvous) retry until their own deadline.
[[noreturn]] void rethrowStoreError(const std::string& what, bool timed_out = false) {
  try {
    throw;
  } catch (const crossbar::Error&) {
    throw;
  } catch (const c10::DistStoreError& e) {
    throw Timeout(fmt::format("{}torch store: {} timed out: {}", errorContext(-1, "store"), what, e.what()));
  } catch (const c10::DistNetworkError& e) {
    throw PeerFailure(fmt::format("{}torch store: {} failed; is the store server still up? {}",
                                  errorContext(-1, "store"), what, e.what()));
  } catch (const std::exception& e) {
    if (timed_out)
      throw Timeout(fmt::format("{}torch store: {} timed out: {}", errorContext(-1, "store"), what, e.what()));
    throw SystemError(fmt::format("{}torch store: {} failed: {}", errorContext(-1, "store"), what, e.what()));
  }
}

// ---- tensors --------------------------------------------------------------------------

std::string scalarName(at::ScalarType s) {
  return c10::toString(s);
}

void checkTensor(const at::Tensor& t, int rank, const char* op) {
  if (!t.defined()) throw InvalidArgument(errorContext(rank, op) + "a tensor argument is undefined (None)");
#if !CROSSBAR_TORCH_CUDA
  if (t.is_cuda())
    throw Unsupported(errorContext(rank, op) +
                      "this crossbar build has no CUDA path (built without CUDA, or against a CPU-only torch); "
                      "use 'cpu:crossbar,cuda:nccl' (init_process_group(backend=\"cpu:crossbar,cuda:nccl\")) "
                      "to run CUDA tensors on NCCL");
#endif
  if (!t.device().is_cpu() && !t.is_cuda())
    throw Unsupported(
        fmt::format("{}tensors on device type '{}' are not supported; crossbar runs CPU tensors",
                    errorContext(rank, op), c10::DeviceTypeName(t.device().type(), true)));
  if (t.layout() != at::kStrided)
    throw Unsupported(fmt::format("{}{} tensors are not supported; crossbar runs dense (strided) tensors",
                                  errorContext(rank, op), c10::toString(t.layout())));
}

void checkTensors(const std::vector<at::Tensor>& ts, int rank, const char* op) {
  for (const auto& t : ts) checkTensor(t, rank, op);
}

void checkSingle(const std::vector<at::Tensor>& ts, int rank, const char* op) {
  if (ts.size() != 1)
    throw InvalidArgument(
        fmt::format("{}expected exactly one tensor per call, got {} (one CPU tensor per rank)",
                    errorContext(rank, op), ts.size()));
  checkTensor(ts[0], rank, op);
}

std::optional<DataType> mapType(at::ScalarType s) {
  switch (s) {
    case at::ScalarType::Double:
      return DataType::kFloat64;
    case at::ScalarType::Float:
      return DataType::kFloat32;
    case at::ScalarType::Half:
      return DataType::kFloat16;
    case at::ScalarType::BFloat16:
      return DataType::kBFloat16;
    case at::ScalarType::Float8_e4m3fn:
      return DataType::kFloat8E4M3;
    case at::ScalarType::Float8_e5m2:
      return DataType::kFloat8E5M2;
    case at::ScalarType::Char:
      return DataType::kInt8;
    case at::ScalarType::Byte:
      return DataType::kUInt8;
    case at::ScalarType::Int:
      return DataType::kInt32;
    case at::ScalarType::Long:
      return DataType::kInt64;
    case at::ScalarType::UInt32:
      return DataType::kUInt32;
    case at::ScalarType::UInt64:
      return DataType::kUInt64;
    default:
      return std::nullopt;
  }
}

// Data movement never looks at values: a type crossbar lacks travels as bytes.
struct Moved {
  DataType type;
  size_t scale;  // crossbar elements per torch element
};
Moved movedType(const at::Tensor& t) {
  if (auto m = mapType(t.scalar_type())) return {*m, 1};
  return {DataType::kUInt8, static_cast<size_t>(t.element_size())};
}

constexpr const char* kSupportedTypes =
    "float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8, uint8, int32, int64, uint32, "
    "uint64, bool (sum/max as logical or, product/min as logical and); complex with sum/avg";

struct Reduction {
  DataType type;
  ReduceOp op;
  double scalar = 1.0;
};

Reduction mapReduction(at::ScalarType s, const c10d::ReduceOp& rop, int rank, const char* opname) {
  auto unsupportedOp = [&](const char* name) {
    return Unsupported(fmt::format(
        "{}reduce op {} is not supported by crossbar for {} tensors; use SUM/PRODUCT/MIN/MAX/AVG/PREMUL_SUM "
        "(BAND/BOR/BXOR take integer and bool tensors), or run this op on a gloo group "
        "(new_group(backend=\"gloo\"))",
        errorContext(rank, opname), name, scalarName(s)));
  };
  Reduction r{};
  switch (rop.op_) {
    case c10d::ReduceOp::SUM:
      r.op = ReduceOp::kSum;
      break;
    case c10d::ReduceOp::AVG:
      r.op = ReduceOp::kAvg;
      break;
    case c10d::ReduceOp::PRODUCT:
      r.op = ReduceOp::kProd;
      break;
    case c10d::ReduceOp::MIN:
      r.op = ReduceOp::kMin;
      break;
    case c10d::ReduceOp::MAX:
      r.op = ReduceOp::kMax;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      r.op = ReduceOp::kPreMulSum;
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(rop.supplement_.get());
      if (!sup)
        throw InvalidArgument(errorContext(rank, opname) +
                              "PREMUL_SUM without its factor; create the op with "
                              "torch.distributed._make_nccl_premul_sum(factor)");
      r.scalar = sup->tensor_factor.defined() ? sup->tensor_factor.to(at::kDouble).item<double>()
                                              : sup->double_factor;
      break;
    }
    case c10d::ReduceOp::BAND:
      throw unsupportedOp("BAND");
    case c10d::ReduceOp::BOR:
      throw unsupportedOp("BOR");
    case c10d::ReduceOp::BXOR:
      throw unsupportedOp("BXOR");
    default:
      throw unsupportedOp("(unknown)");
  }
  if (s == at::ScalarType::Bool) {
    // bool as uint8 0/1: or = max, and = min; a sum could leave values above 1.
    if (r.op == ReduceOp::kSum || r.op == ReduceOp::kMax) return {DataType::kUInt8, ReduceOp::kMax};
    if (r.op == ReduceOp::kProd || r.op == ReduceOp::kMin) return {DataType::kUInt8, ReduceOp::kMin};
    throw Unsupported(
        fmt::format("{}reduce op {} is not defined for bool tensors; use SUM, MAX, MIN or PRODUCT",
                    errorContext(rank, opname), reduceOpName(r.op)));
  }
  auto t = mapType(s);
  if (!t)
    throw Unsupported(
        fmt::format("{}dtype {} is not supported for reductions by crossbar; supported: {}. "
                    "Convert the tensor (e.g. .to(torch.int32)) or use a gloo group",
                    errorContext(rank, opname), scalarName(s), kSupportedTypes));
  r.type = *t;
  if (r.op == ReduceOp::kPreMulSum && !isFloating(r.type))
    throw Unsupported(fmt::format("{}PREMUL_SUM needs a floating-point tensor, got {}; use SUM and scale",
                                  errorContext(rank, opname), scalarName(s)));
  return r;
}

// Bitwise reductions (BAND/BOR/BXOR, integer and bool tensors). crossbar's reduction
// kernels have no bitwise ops, so these move every rank's contribution (allgather, gather
// to the root, or all-to-all of the chunks) and fold them with torch: world-size times
// the traffic of a reduction, fine for the masks and flags these ops carry. Each call
// site below branches on isBitwise() before mapReduction().
bool isBitwise(const c10d::ReduceOp& rop) {
  return rop.op_ == c10d::ReduceOp::BAND || rop.op_ == c10d::ReduceOp::BOR || rop.op_ == c10d::ReduceOp::BXOR;
}

void checkBitwise(const at::Tensor& t, int rank, const char* opname) {
  if (!at::isIntegralType(t.scalar_type(), /*includeBool=*/true))
    throw Unsupported(fmt::format("{}bitwise reductions (BAND/BOR/BXOR) need an integer or bool tensor, got {}",
                                  errorContext(rank, opname), scalarName(t.scalar_type())));
}

// `rows` holds `ranks` contributions of `out.numel()` elements each, in rank order; their
// fold goes into `out`. Unsigned 16/32/64-bit tensors fold through a signed view (same
// bits: torch's bitwise kernels skip the barebones unsigned types).
void bitwiseFoldInto(at::Tensor out, const at::Tensor& rows, int ranks, c10d::ReduceOp::RedOpType op) {
  at::Tensor r = rows.view({ranks, out.numel()});
  if (r.scalar_type() == at::ScalarType::UInt16) r = r.view(at::kShort);
  if (r.scalar_type() == at::ScalarType::UInt32) r = r.view(at::kInt);
  if (r.scalar_type() == at::ScalarType::UInt64) r = r.view(at::kLong);
  at::Tensor acc = r[0].clone();
  for (int i = 1; i < ranks; ++i) {
    if (op == c10d::ReduceOp::BAND) acc.bitwise_and_(r[i]);
    else if (op == c10d::ReduceOp::BOR) acc.bitwise_or_(r[i]);
    else acc.bitwise_xor_(r[i]);
  }
  out.copy_(acc.view(rows.scalar_type()).view(out.sizes()));
}

// A contiguous tensor holding `t`'s data (t itself when already contiguous).
at::Tensor contiguousCopy(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

// Where an op writes `out`: out itself, or a contiguous stand-in copied back afterwards.
at::Tensor outputStage(const at::Tensor& out, bool keep_contents, std::vector<std::function<void()>>& post) {
  if (out.is_contiguous()) return out;
  at::Tensor stage = keep_contents ? out.contiguous() : at::empty(out.sizes(), out.options());
  post.push_back([out, stage]() mutable { out.copy_(stage); });
  return stage;
}

std::function<void()> sequence(std::vector<std::function<void()>> fs) {
  if (fs.empty()) return nullptr;
  return [fs = std::move(fs)] {
    for (const auto& f : fs) f();
  };
}

size_t elems(const at::Tensor& t) {
  return static_cast<size_t>(t.numel());
}

void checkSameType(const at::Tensor& a, const at::Tensor& b, int rank, const char* op) {
  if (a.scalar_type() != b.scalar_type())
    throw InvalidArgument(fmt::format("{}tensors must have the same dtype, got {} and {}",
                                      errorContext(rank, op), scalarName(a.scalar_type()),
                                      scalarName(b.scalar_type())));
  if (a.device() != b.device())
    throw InvalidArgument(fmt::format("{}tensors must be on the same device, got {} and {}",
                                      errorContext(rank, op), a.device().str(), b.device().str()));
}

// The root's list of one tensor per rank for gather (`role` "output") or scatter ("input"),
// each like `ref` (the rank's own tensor); the other ranks pass none (an empty list).
std::vector<at::Tensor> rootTensorList(const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& ref,
                                       int rank, int root, int size, const char* op, const char* role,
                                       const char* ref_role) {
  if (rank != root) {
    if (!lists.empty() && !lists[0].empty())
      throw InvalidArgument(fmt::format("{}only the root passes {} tensors", errorContext(rank, op), role));
    return {};
  }
  if (lists.size() != 1 || lists[0].size() != static_cast<size_t>(size))
    throw InvalidArgument(
        fmt::format("{}the root needs one {} list of {} tensors", errorContext(rank, op), role, size));
  for (const auto& t : lists[0]) {
    checkTensor(t, rank, op);
    checkSameType(t, ref, rank, op);
    if (t.numel() != ref.numel())
      throw InvalidArgument(
          fmt::format("{}{} tensors must match the {}'s size", errorContext(rank, op), role, ref_role));
  }
  return lists[0];
}

// The first tensor of a list (undefined when empty: the call then runs on the host).
at::Tensor firstOf(const std::vector<at::Tensor>& ts) {
  return ts.empty() ? at::Tensor() : ts[0];
}

#if CROSSBAR_TORCH_CUDA
void checkCuda(cudaError_t e, int rank, const char* what) {
  if (e != cudaSuccess)
    throw CudaError(fmt::format("{}{} failed: {} ({})", errorContext(rank, what), what, cudaGetErrorString(e),
                                cudaGetErrorName(e)));
}

cudaStream_t currentStream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

// An event recorded on `stream` now, destroyed with its last owner.
std::shared_ptr<void> recordEvent(cudaStream_t stream, int rank) {
  cudaEvent_t ev = nullptr;
  checkCuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), rank, "cudaEventCreateWithFlags");
  std::shared_ptr<void> owner(ev, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
  checkCuda(cudaEventRecord(ev, stream), rank, "cudaEventRecord");
  return owner;
}
#endif

// OpTypes of the coalesced tensor collectives, where this torch version has them (they
// only label the Work for logging and profiling).
template <typename T>
constexpr auto allgatherCoalescedType(int) -> decltype(T::ALLGATHER_INTO_TENSOR_COALESCED) {
  return T::ALLGATHER_INTO_TENSOR_COALESCED;
}
template <typename T>
constexpr T allgatherCoalescedType(...) {
  return T::COALESCED;
}
template <typename T>
constexpr auto reduceScatterCoalescedType(int) -> decltype(T::REDUCE_SCATTER_TENSOR_COALESCED) {
  return T::REDUCE_SCATTER_TENSOR_COALESCED;
}
template <typename T>
constexpr T reduceScatterCoalescedType(...) {
  return T::COALESCED;
}

// A flat contiguous tensor of n elements, of t's dtype.
at::Tensor flatLike(const at::Tensor& t, int64_t n) {
  return at::empty({n}, t.options());
}

}  // namespace

// ---- TorchStoreAdapter ------------------------------------------------------------------

void TorchStoreAdapter::set(const std::string& key, const Bytes& value) {
  try {
    store_->set(key, value);
  } catch (...) {
    rethrowStoreError("set(" + key + ")");
  }
}

// A clone for one parked request, given back when it ends.
struct TorchStoreAdapter::Waiter {
  TorchStoreAdapter& a;
  c10::intrusive_ptr<c10d::Store> store;
  explicit Waiter(TorchStoreAdapter& adapter) : a(adapter), store(adapter.leaseWaiter()) {}
  ~Waiter() { a.returnWaiter(std::move(store)); }
};

c10::intrusive_ptr<c10d::Store> TorchStoreAdapter::leaseWaiter() {
  {
    std::lock_guard<std::mutex> lk(pool_m_);
    if (!idle_.empty()) {
      auto s = std::move(idle_.back());
      idle_.pop_back();
      return s;
    }
    if (cannot_clone_ || clones_ >= kMaxWaiters) return store_;
    ++clones_;
  }
  try {
    auto s = store_->clone();
    if (s) return s;
  } catch (const std::exception& e) {
    CB_INFO("torch", "the torch store cannot be cloned ({}); parked waits share its connection", e.what());
  }
  std::lock_guard<std::mutex> lk(pool_m_);
  --clones_;
  cannot_clone_ = true;
  return store_;
}

void TorchStoreAdapter::returnWaiter(c10::intrusive_ptr<c10d::Store> s) {
  if (s.get() == store_.get()) return;
  std::lock_guard<std::mutex> lk(pool_m_);
  idle_.push_back(std::move(s));
}

Bytes TorchStoreAdapter::get(const std::string& key, Deadline deadline) {
  try {
    Waiter w(*this);
    w.store->wait({key}, storeTimeout(deadline));
    return w.store->get(key);
  } catch (...) {
    rethrowStoreError("get(" + key + ")", deadline.expired());
  }
}

int64_t TorchStoreAdapter::add(const std::string& key, int64_t delta) {
  try {
    return store_->add(key, delta);
  } catch (...) {
    rethrowStoreError("add(" + key + ")");
  }
}

Bytes TorchStoreAdapter::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  try {
    return store_->compareSet(key, expected, desired);
  } catch (...) {
    rethrowStoreError("compareSet(" + key + ")");
  }
}

bool TorchStoreAdapter::check(const std::vector<std::string>& keys) {
  try {
    return store_->check(keys);
  } catch (...) {
    rethrowStoreError("check");
  }
}

void TorchStoreAdapter::wait(const std::vector<std::string>& keys, Deadline deadline) {
  try {
    Waiter w(*this);
    w.store->wait(keys, storeTimeout(deadline));
  } catch (...) {
    std::string names;
    for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k;
    rethrowStoreError("wait([" + names + "])", deadline.expired());
  }
}

bool TorchStoreAdapter::deleteKey(const std::string& key) {
  try {
    return store_->deleteKey(key);
  } catch (...) {
    rethrowStoreError("deleteKey(" + key + ")");
  }
}

int64_t TorchStoreAdapter::numKeys() {
  try {
    return store_->getNumKeys();
  } catch (...) {
    rethrowStoreError("numKeys");
  }
}

// ---- CrossbarWork -------------------------------------------------------------------------

CrossbarWork::CrossbarWork(int rank, c10d::OpType type, const char* profiling_title,
                           std::vector<at::Tensor> outputs, Millis timeout, std::vector<c10::Device> devices)
    : c10d::Work(rank, type, profiling_title),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devices)),
      timeout_(timeout) {
  deadline = Deadline::after(timeout);
  if (!devices.empty() && devices[0].is_cuda()) cuda_device = devices[0].index();
}

CrossbarWork::~CrossbarWork() = default;

c10::intrusive_ptr<c10::ivalue::Future> CrossbarWork::getFuture() {
  if (bell && !future_wanted.exchange(true) && !completedFlag()) bell->ring();
  return future_;
}

bool CrossbarWork::underlyingDone(std::exception_ptr* err) {
  if (start) return false;  // a staged send not posted yet
  if (coll) {
    if (auto e = coll->error()) {
      *err = e;
      return true;
    }
    try {
      if (!coll->test()) return false;
    } catch (...) {
      *err = std::current_exception();
      return true;
    }
  }
  for (const auto& r : requests) {
    if (!r->done()) return false;
  }
  for (const auto& r : requests) {
    if (r->failed() && !*err) {
      try {
        r->rethrowIfFailed();
      } catch (...) {
        *err = std::current_exception();
      }
    }
  }
  return true;
}

bool CrossbarWork::waitUnderlying(Deadline d, std::exception_ptr* err) {
  if (coll) {
    try {
      coll->wait(d);
    } catch (...) {
      if (auto e = coll->error()) {
        *err = e;
        return true;
      }
      if (d.expired()) return false;  // our wait's deadline, not the operation's failure
      *err = std::current_exception();
      return true;
    }
  }
  for (const auto& r : requests) {
    try {
      r->wait(d);
    } catch (...) {
      // Its own failure, or the end of this wait (a slice of the completion thread). The
      // request may have finished since the wait threw (another thread progressed it):
      // then its outcome counts, not this wait's Timeout.
      if (!r->done()) return false;
      if (r->failed() && !*err) {
        try {
          r->rethrowIfFailed();
        } catch (...) {
          *err = std::current_exception();
        }
      }
    }
  }
  return true;
}

void CrossbarWork::complete(std::exception_ptr err) {
  {
    std::unique_lock<std::mutex> lk(mutex_);
    if (finalizing_) {
      cv_.wait(lk, [&] { return completed_; });
      return;
    }
    finalizing_ = true;
  }
  if (!err && post) {
    try {
      post();
    } catch (...) {
      err = std::current_exception();
    }
  }
  post = nullptr;
  finish(err);
  if (on_finish) std::exchange(on_finish, nullptr)();
  if (isCuda()) {
    // The future completed when the work was enqueued (stream semantics); a failure found
    // later shows in wait(), exception() and the backend's getError().
    if (err)
      CB_WARN("torch", "{}", [&] {
        try {
          std::rethrow_exception(err);
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      }());
    // (A staged work's pinned buffers stay: the transport or a copy may still use them.)
    if (!staged) keepalive.clear();
  } else if (err) {
    future_->setError(err);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  for (auto& c : children) c->complete(err);
}

bool CrossbarWork::isCompleted() {
  {
    // (A staged receive finishes on the host before its copy to the device ran: the
    // stream's event below decides.)
    std::lock_guard<std::mutex> lk(mutex_);
    if (completed_ && !staged) return true;
  }
#if CROSSBAR_TORCH_CUDA
  if (isCuda()) {  // done when the GPU passed the end event (NCCL's semantics)
    if (!cuda_end) return false;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(cuda_device));
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(cuda_end.get()));
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess) {
      std::exception_ptr err;
      try {
        checkCuda(e, rank_, "cudaEventQuery");
      } catch (...) {
        err = std::current_exception();
      }
      complete(err);
    }
    return true;
  }
#endif
  std::exception_ptr err;
  if (underlyingDone(&err)) {
    complete(err);
    return true;
  }
  return false;
}

bool CrossbarWork::startIfReady(std::exception_ptr* err) {
  if (!start) return true;
#if CROSSBAR_TORCH_CUDA
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(cuda_device));
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(start_after.get()));
  if (e == cudaErrorNotReady) return false;
  try {
    checkCuda(e, rank_, "cudaEventQuery (staged send's copy)");
    requests.push_back(start());
  } catch (...) {
    *err = std::current_exception();
  }
#else
  (void)err;  // staged sends exist only with the CUDA path
#endif
  start = nullptr;
  return true;
}

bool CrossbarWork::isSuccess() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr CrossbarWork::exception() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return exception_;
}

void CrossbarWork::synchronize() {
#if CROSSBAR_TORCH_CUDA
  if (isCuda() && cuda_end) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(cuda_device));
    checkCuda(cudaStreamWaitEvent(currentStream(cuda_device), static_cast<cudaEvent_t>(cuda_end.get()), 0), rank_,
              "cudaStreamWaitEvent");
  }
#endif
}

bool CrossbarWork::wait(std::chrono::milliseconds timeout) {
  if (isCuda()) {
    // Like ProcessGroupNCCL: the caller's current stream waits for the operation; the
    // host returns at once. A failure already known is raised here.
    {
      std::lock_guard<std::mutex> lk(mutex_);
      if (exception_) std::rethrow_exception(exception_);
    }
    synchronize();
    return true;
  }
  bool done;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    done = completed_;
  }
  if (!done) {
    // kNoTimeout (0): the operation's own timeout bounds the wait.
    // (Collectives queue in order: allow for the ones ahead of this one.)
    const Millis limit = timeout.count() > 0 ? Millis(timeout.count()) : timeout_ * 2 + Millis(5000);
    std::exception_ptr err;
    if (!waitUnderlying(Deadline::after(limit), &err)) {
      throw Timeout(fmt::format("{}{} did not finish within {} ms{}", errorContext(rank_, "wait"),
                                c10d::opTypeToString(opType_), limit.count(),
                                coll ? fmt::format(" ({})", coll->description()) : std::string()));
    }
    complete(err);
  }
  std::lock_guard<std::mutex> lk(mutex_);
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

void CrossbarWork::abort() {
  auto err = std::make_exception_ptr(
      Aborted(fmt::format("{}the {} was aborted", errorContext(rank_, "abort"), c10d::opTypeToString(opType_))));
  // (A staged send's request is posted later by the point-to-point thread: left alone.)
  if (!(staged && opType_ == c10d::OpType::SEND)) cancelReceives(err);
  complete(err);
}

void CrossbarWork::cancelReceives(const std::exception_ptr& err) {
  for (const auto& r : requests) r->cancel(err);  // a send or a matched receive: false, runs on
  for (auto& c : children) c->cancelReceives(err);
}

// ---- works whose buffers a transport may still use ---------------------------------------

namespace {

// A point-to-point work that failed without completing (timed out, aborted, its group
// aborted) has its receives withdrawn where no message matched them yet (then their
// buffers are free). What is left may still use its buffers: a send the peer has not
// taken yet, a receive whose message was arriving. Such works (their tensors) must
// outlive their group. The transport holds each request while it may touch the buffer,
// so a work is released once nothing but the work holds its requests.
bool transportStillHolds(const CrossbarWork& w) {
  for (const auto& r : w.requests)
    if (r.use_count() > 1) return true;
  for (const auto& c : w.children)
    if (transportStillHolds(*c)) return true;
  return false;
}

class LingeringWorks {
 public:
  static void keep(std::vector<c10::intrusive_ptr<CrossbarWork>> works) {
    LingeringWorks& self = instance();
    std::lock_guard<std::mutex> lk(self.mutex_);
    std::erase_if(self.works_, [](const auto& w) { return !transportStillHolds(*w); });
    for (auto& w : works)
      if (transportStillHolds(*w)) self.works_.push_back(std::move(w));
  }

 private:
  // Never destroyed: tensors are not freed during static destruction at exit.
  static LingeringWorks& instance() {
    static auto* self = new LingeringWorks();
    return *self;
  }
  std::mutex mutex_;
  std::vector<c10::intrusive_ptr<CrossbarWork>> works_;
};

}  // namespace

// ---- CrossbarBackend ------------------------------------------------------------------------

CrossbarBackend::CrossbarBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 c10::intrusive_ptr<Options> options)
    : c10d::Backend(rank, size), options_(std::move(options)), timeout_ms_(options_->timeout.count()) {
  CommOptions co;
  co.timeout = Millis(options_->timeout.count());
  co.name = options_->name.empty() ? "torch" : options_->name;
  co.ranks_per_node = options_->ranks_per_node;
  comm_ = Communicator::create(std::make_shared<TorchStoreAdapter>(store), rank, size, co);
  startThreads();
}

CrossbarBackend::CrossbarBackend(std::shared_ptr<Communicator> comm, c10::intrusive_ptr<Options> options)
    : c10d::Backend(comm->rank(), comm->size()),
      options_(std::move(options)),
      comm_(std::move(comm)),
      timeout_ms_(options_->timeout.count()) {
  startThreads();
}

void CrossbarBackend::startThreads() {
  coll_ = std::make_unique<Collectives>(comm_);
  // The completion thread waits for (so starts) every call no one waited for within
  // kCompletionPoll; a blocking torch call's own wait() runs it without a hand-off.
  coll_->setDeferredStart(true);
  coll_thread_ = std::thread([this] {
    nameThisThread("cb-torch-coll");
    completionLoop();
  });
  p2p_thread_ = std::thread([this] {
    nameThisThread("cb-torch-p2p");
    p2pLoop();
  });
}

c10::intrusive_ptr<c10d::Backend> CrossbarBackend::split(const c10::intrusive_ptr<c10d::Store>& /*store*/,
                                                         const std::vector<int>& ranks,
                                                         const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  ensureUsable("split_group");
  std::vector<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= size_ || std::find(seen.begin(), seen.end(), r) != seen.end())
      throw InvalidArgument(fmt::format("{}split ranks must be distinct ranks of this group (0..{}); got {}",
                                        errorContext(rank_, "split_group"), size_ - 1, r));
    seen.push_back(r);
  }
  // Groups are disjoint, so their smallest rank names them; the position in `ranks` is
  // the new rank (torch: "position in the list determines the group rank").
  auto me = std::find(ranks.begin(), ranks.end(), rank_);
  const bool member = me != ranks.end();
  const int color = member ? *std::min_element(ranks.begin(), ranks.end()) : -1;
  const int key = member ? static_cast<int>(me - ranks.begin()) : 0;
  std::shared_ptr<Communicator> child = comm_->split(color, key);
  if (!child) return nullptr;
  auto child_opts = c10::make_intrusive<Options>(opts ? opts->timeout : options_->timeout);
  child_opts->ranks_per_node = options_->ranks_per_node;
  if (auto* ours = dynamic_cast<const Options*>(opts.get())) child_opts->ranks_per_node = ours->ranks_per_node;
  child_opts->name = child->name();
  auto backend = c10::make_intrusive<CrossbarBackend>(std::move(child), child_opts);
  backend->shares_transports_ = true;
  return backend;
}

c10::intrusive_ptr<c10d::Backend> CrossbarBackend::splitMembers(const std::vector<int>& ranks,
                                                                std::chrono::milliseconds timeout,
                                                                const std::string& name) {
  ensureUsable("new_group");
  std::shared_ptr<Communicator> child = comm_->splitMembers(ranks, name);
  if (!child) return nullptr;
  auto child_opts = c10::make_intrusive<Options>(timeout);
  child_opts->ranks_per_node = options_->ranks_per_node;
  child_opts->name = child->name();
  auto backend = c10::make_intrusive<CrossbarBackend>(std::move(child), child_opts);
  backend->shares_transports_ = true;
  return backend;
}

CrossbarBackend::~CrossbarBackend() {
  // Not shutdown(): its goodbye barrier is collective, and ranks may release process
  // groups in different orders (garbage collection, interpreter exit) -- they would wait
  // on each other. destroy_process_group() calls shutdown() in the same order everywhere.
  if (shut_down_) return;
  shut_down_ = true;
  try {
    stopThreads();
    coll_.reset();
    cuda_.reset();
    announcer_.reset();
    LingeringWorks::keep(std::move(orphans_));
    comm_.reset();
  } catch (...) {
    // Destructors must not throw; the layers below logged what went wrong.
  }
}

void CrossbarBackend::stopThreads() {
  {
    std::lock_guard<std::mutex> lk(m_);
    if (stop_) return;
    stop_ = true;
    p2p_new_ = true;
  }
  coll_bell_->ring();
  p2p_bell_->ring();
  cuda_cv_.notify_all();
  if (coll_thread_.joinable()) coll_thread_.join();
  if (p2p_thread_.joinable()) p2p_thread_.join();
  if (cuda_thread_.joinable()) cuda_thread_.join();
}

void CrossbarBackend::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  // Pending work still finishes (each bounded by its deadline); then a collective goodbye.
  stopThreads();
  coll_.reset();
  cuda_.reset();  // waits (bounded) for its queued GPU work
  announcer_.reset();
  LingeringWorks::keep(std::move(orphans_));
  if (comm_ && !comm_->aborted()) comm_->destroy();
}

void CrossbarBackend::abort() {
  if (shut_down_ || !comm_) return;
  // The default group's communicator aborts the context: every group over it ends. A
  // split's (new_group, split_group) aborts only itself (and splits made from it): its
  // pending operations fail, the transports stay with the default group and the others.
  if (!shares_transports_) {
    comm_->abort("torch.distributed abort");
    shutdown();
    return;
  }
  // Works not started or still waiting fail now (crossbar.Aborted), not when the threads
  // get to them (then with whatever error the abort caused underneath).
  std::vector<c10::intrusive_ptr<CrossbarWork>> colls, p2ps;
  {
    std::lock_guard<std::mutex> lk(m_);
    colls.assign(coll_pending_.begin(), coll_pending_.end());
    coll_pending_.clear();  // the completion thread lets go of them
    p2ps.assign(p2p_incoming_.begin(), p2p_incoming_.end());
  }
  for (auto& w : p2ps) w->abort();  // (outside the lock: futures run their callbacks)
  bool busy = false;
  for (auto& w : colls) {
    std::exception_ptr ignored;
    busy = busy || !w->underlyingDone(&ignored);
    w->abort();
  }
  comm_->abort(fmt::format("torch.distributed abort of group {}", comm_->name()));
  stopThreads();
  if (busy) {
    // A collective of this group is still running: its waits see the abort within a
    // slice (the symmetric memory's check the heap's communicator every 100 ms) and it
    // fails then; meanwhile it may still use the works' buffers, so they and the
    // Collectives end together on a thread of their own, not here.
    CB_INFO("torch", "abort of {}: a collective still runs until its deadline; released in the background",
            comm_->name());
    std::thread([coll = std::move(coll_), colls = std::move(colls)]() mutable {
      nameThisThread("cb-torch-release");
      coll.reset();  // drains (bounded by the operation's deadline)
      colls.clear();
    }).detach();
  }
  shutdown();  // what is left: no goodbye barrier (aborted)
}

void CrossbarBackend::setShrinkHandler(ShrinkHandler handler) {
  std::lock_guard<std::mutex> lk(shrink_mu_);
  shrink_handler_ = std::move(handler);
}

bool CrossbarBackend::supportsShrinking() const {
  std::lock_guard<std::mutex> lk(shrink_mu_);
  return static_cast<bool>(shrink_handler_);
}

c10::intrusive_ptr<c10d::Backend> CrossbarBackend::shrink(const std::vector<int64_t>& ranks_to_exclude,
                                                          int /*shrink_flags: the agreement aborts the old epoch*/,
                                                          const c10::intrusive_ptr<c10d::Backend::Options>&) {
  ShrinkHandler handler;
  {
    std::lock_guard<std::mutex> lk(shrink_mu_);
    handler = shrink_handler_;
  }
  if (!handler)
    throw InvalidUsage(fmt::format(
        "{}this crossbar process group cannot shrink: the survivors of a failure must agree on who is left, "
        "which only a crossbar.ft.FaultTolerantGroup's group does (use its shrink(), or "
        "torch.distributed.shrink_group on its .group)",
        errorContext(rank_, "shrink_group")));
  return handler(ranks_to_exclude);
}

void CrossbarBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ms_ = timeout.count();
}

#if CROSSBAR_TORCH_AT_LEAST(2, 6)
c10d::ErrorType CrossbarBackend::getError() {
  std::lock_guard<std::mutex> lk(m_);
  if (!first_error_) return c10d::ErrorType::SUCCESS;
  try {
    std::rethrow_exception(first_error_);
  } catch (const Timeout&) {
    return c10d::ErrorType::TIMEOUT;
  } catch (const PeerFailure&) {
    return c10d::ErrorType::REMOTE_ERROR;
  } catch (...) {
    return c10d::ErrorType::COMM_ERROR;
  }
}
#endif

Millis CrossbarBackend::timeoutOf(std::chrono::milliseconds requested) const {
  return requested.count() > 0 ? Millis(requested.count()) : Millis(timeout_ms_.load());
}

void CrossbarBackend::ensureUsable(const char* op) const {
  if (shut_down_ || !coll_)
    throw InvalidUsage(errorContext(rank_, op) +
                       "the process group was shut down or aborted; create a new one");
}

// A call that finished inside its issue (a small collective whose peers were there, an
// eager send, a receive whose message had arrived) completes here and is never handed to
// the completion or point-to-point thread: that cost a futex wake-up and a context switch
// per call (a 64 B all_reduce through torch took 26 us, the call itself under 1 us; a 64 B
// send/recv ping-pong 20 us one way, now 11). Collectives complete in issue order
// underneath, so the ones before it have finished too (their futures may complete later).
bool CrossbarBackend::finishedAtIssue(CrossbarWork& work) {
  // hasFinished() / done(), not test(): a test() of a collective still running wakes the
  // collectives' worker for it, and the caller's wait() would run it anyway.
  const bool finished = work.coll ? work.coll->hasFinished()
                                  : !work.start && !work.requests.empty() &&
                                        std::all_of(work.requests.begin(), work.requests.end(),
                                                    [](const RequestPtr& r) { return r->done(); });
  std::exception_ptr err;
  if (!finished || !work.underlyingDone(&err)) return false;
  if (err) {
    std::lock_guard<std::mutex> lk(m_);
    if (!first_error_) first_error_ = err;
  }
  work.complete(err);
  return true;
}

namespace {
// The completion thread looks at its queue this often while collectives are being issued,
// and waits on a work only once it is this old (or its future is wanted): a blocking call's
// own wait() finishes it first, and a thread woken per call to wait beside it cost more
// than the call (64 KiB all_reduce through torch: 2 ranks 100-120 us vs 16 us in C++;
// futex, sched_yield and context switches 4-10 per call vs under 0.3).
constexpr auto kCompletionPoll = std::chrono::milliseconds(1);
// With nothing queued this long it sleeps until a submit or getFuture() rings its bell.
constexpr auto kCompletionIdle = std::chrono::milliseconds(50);
}  // namespace

// Waits for `bell`: at most kCompletionPoll while the thread was busy (`busy_at`) within
// kCompletionIdle, else until it rings. Asleep only when `nothing_queued` (called under
// m_), checked under the bell's lock: a submit queues first and then looks at `asleep`
// under it, so its work was either seen here or it rings.
void CrossbarBackend::awaitBell(CompletionBell& bell, Clock::time_point busy_at,
                                const std::function<bool()>& nothing_queued) {
  std::unique_lock<std::mutex> bl(bell.m);
  if (!bell.rung) {
    bool sleep = Clock::now() - busy_at >= kCompletionIdle;
    if (sleep) {
      std::lock_guard<std::mutex> lk(m_);
      sleep = nothing_queued() && !stop_;
    }
    bell.asleep = sleep;
    if (sleep)
      bell.cv.wait(bl, [&] { return bell.rung.load(); });
    else
      bell.cv.wait_for(bl, kCompletionPoll, [&] { return bell.rung.load(); });
    bell.asleep = false;
  }
  bell.rung = false;
}

// Whether a thread takes a queued host work over now (called under m_): when stopping,
// when its future is wanted, for the staged CUDA point to point (only that thread posts
// it), and once no wait() took care of it within kCompletionPoll.
bool CrossbarBackend::takeNow(const CrossbarWork& w, Clock::time_point now) const {
  return stop_ || w.future_wanted.load() || w.staged || w.start || now - w.queued_at >= kCompletionPoll;
}

void CrossbarBackend::completionLoop() {
  CompletionBell& bell = *coll_bell_;
  Clock::time_point busy_at = Clock::now();  // when the queue was last seen non-empty
  while (true) {
    awaitBell(bell, busy_at, [&] { return coll_pending_.empty(); });
    std::unique_lock<std::mutex> lk(m_);
    while (!coll_pending_.empty()) {
      busy_at = Clock::now();
      c10::intrusive_ptr<CrossbarWork> w = coll_pending_.front();
      if (w->completedFlag()) {  // finished by a wait() or isCompleted()
        coll_pending_.pop_front();
        if (auto e = w->exception(); e && !first_error_) first_error_ = e;
        continue;
      }
      if (!takeNow(*w, busy_at)) break;
      lk.unlock();
      std::exception_ptr err;
      bool done = w->waitUnderlying(Deadline::after(Millis(200)), &err);
      if (done) w->complete(err);
      lk.lock();
      if (done && !coll_pending_.empty() && coll_pending_.front() == w) {  // (abort() may have taken it)
        coll_pending_.pop_front();
        if (err && !first_error_) first_error_ = err;
      }
    }
    if (stop_ && coll_pending_.empty()) return;  // stopping and drained
  }
}

void CrossbarBackend::p2pLoop() {
  std::vector<c10::intrusive_ptr<CrossbarWork>> active;
  CompletionBell& bell = *p2p_bell_;
  Clock::time_point busy_at = Clock::now();  // when works were last seen
  while (true) {
    // Like the completion thread: a blocking send/recv is finished by its own wait(); this
    // thread takes a work over once that did not happen within kCompletionPoll (it then
    // enforces the timeout, withdrawing receives), or when its future is wanted.
    if (active.empty())
      awaitBell(bell, busy_at, [&] { return p2p_incoming_.empty(); });
    else
      bell.rung = false;
    {
      std::unique_lock<std::mutex> lk(m_);
      const Clock::time_point now = Clock::now();
      if (!active.empty() || !p2p_incoming_.empty()) busy_at = now;
      std::erase_if(p2p_incoming_, [&](c10::intrusive_ptr<CrossbarWork>& w) {
        if (w->completedFlag()) {  // finished by a wait(), isCompleted() or abort()
          if (auto e = w->exception()) {
            if (!first_error_) first_error_ = e;
            // Failed while the transport still holds it (a send the peer never took, a
            // receive whose message is arriving): keep its buffers (LingeringWorks).
            if (transportStillHolds(*w)) orphans_.push_back(w);
          }
          return true;
        }
        if (!takeNow(*w, now)) return false;
        active.push_back(std::move(w));
        return true;
      });
      p2p_active_ = active.size();
      p2p_new_ = false;
      if (active.empty() && p2p_incoming_.empty() && stop_) return;
    }
    std::erase_if(active, [&](const c10::intrusive_ptr<CrossbarWork>& w) {
      std::exception_ptr err;
      if (!w->startIfReady(&err) && !w->deadline.expired()) return false;
      if (err || w->underlyingDone(&err)) {
        w->complete(err);
        // A staged CUDA receive naming its sender: a size or order mismatch its
        // announcement showed (as cudaLoop reports them for NCCL receives).
        std::exception_ptr mismatch = w->staged && announcer_ ? announcer_->poll() : nullptr;
        if (mismatch) {
          try {
            std::rethrow_exception(mismatch);
          } catch (const std::exception& e) {
            CB_WARN("torch", "{}", e.what());
          }
        }
        if (err || mismatch) {  // for getError(), like the collectives' failures
          std::lock_guard<std::mutex> lk(m_);
          if (!first_error_) first_error_ = err ? err : mismatch;
          // Failed (e.g. its group was aborted) while the transport still holds it (a
          // send; the abort withdrew the receives no message had matched).
          if (err && transportStillHolds(*w)) orphans_.push_back(w);
        }
        return true;
      }
      if (w->deadline.expired()) {
        std::string what;
        for (const auto& r : w->requests)
          if (!r->done()) what += (what.empty() ? "" : ", ") + r->what();
        err = std::make_exception_ptr(Timeout(
            fmt::format("{}{} did not finish within {} ms (the peer never posted the matching operation?)",
                        errorContext(rank_, "p2p"), what, w->getTimeout().count())));
        // Its receives no message matched are withdrawn: a message sent later goes to the
        // next receive, not into this tensor. (This thread is the one that posts staged
        // sends, so their requests can be read here.)
        w->cancelReceives(err);  // (with the work's error: a wait() that sees it first reports the same)
        // Every request finished between the look above and the cancel (another thread's
        // progress): it succeeded, it did not time out.
        std::exception_ptr late;
        if (w->underlyingDone(&late) && !late) err = nullptr;
        w->complete(err);
        std::lock_guard<std::mutex> lk(m_);
        std::erase_if(orphans_, [](const auto& o) { return !transportStillHolds(*o); });
        // A send, or a receive whose message is arriving: keep the buffers (LingeringWorks).
        if (transportStillHolds(*w)) orphans_.push_back(w);
        if (!first_error_ && err) first_error_ = err;
        return true;
      }
      return false;
    });
    p2p_active_ = active.size();
    if (active.empty()) continue;
    // A staged send waits for its device-to-host copy: look again soon.
    const bool copying = std::any_of(active.begin(), active.end(), [](const auto& w) { return w->start != nullptr; });
    comm_->engine().waitUntil(
        [&] {
          if (p2p_new_.load() || bell.rung.load()) return true;
          for (const auto& w : active) {
            if (w->start) continue;
            bool all = true;
            for (const auto& r : w->requests) all = all && r->done();
            if (all) return true;
          }
          return false;
        },
        Deadline::after(Millis(copying ? 1 : 50)));
  }
}

// Where one call's operations go: the host Collectives, or (CUDA tensors) the
// CudaCollectives on the caller's current stream. Same calls, same arguments.
struct CrossbarBackend::Ops {
  Collectives* host = nullptr;
  CudaCollectives* cuda = nullptr;
  void* stream = nullptr;  // cudaStream_t
  bool* cuda_group_open = nullptr;  // the coalescing block's CUDA group (nested groups stay in it)
  bool staged = false;  // CUDA point to point through host memory (the group shares a GPU)

  bool onCuda() const { return cuda != nullptr; }
#if CROSSBAR_TORCH_CUDA
#define CROSSBAR_ROUTE(call, ...) \
  return cuda ? cuda->call(__VA_ARGS__, static_cast<cudaStream_t>(stream), o) : host->call(__VA_ARGS__, o)
#else
#define CROSSBAR_ROUTE(call, ...) return host->call(__VA_ARGS__, o)
#endif
  WorkPtr broadcast(void* buf, size_t n, DataType t, int root, const CollOptions& o) {
    CROSSBAR_ROUTE(broadcast, buf, n, t, root);
  }
  WorkPtr allreduce(const void* s, void* r, size_t n, DataType t, ReduceOp op, const CollOptions& o) {
    CROSSBAR_ROUTE(allreduce, s, r, n, t, op);
  }
  WorkPtr reduce(const void* s, void* r, size_t n, DataType t, ReduceOp op, int root, const CollOptions& o) {
    CROSSBAR_ROUTE(reduce, s, r, n, t, op, root);
  }
  WorkPtr allgather(const void* s, void* r, size_t n, DataType t, const CollOptions& o) {
    CROSSBAR_ROUTE(allgather, s, r, n, t);
  }
  WorkPtr reduceScatter(const void* s, void* r, size_t n, DataType t, ReduceOp op, const CollOptions& o) {
    CROSSBAR_ROUTE(reduceScatter, s, r, n, t, op);
  }
  WorkPtr gather(const void* s, void* r, size_t n, int root, DataType t, const CollOptions& o) {
    CROSSBAR_ROUTE(gather, s, r, n, root, t);
  }
  WorkPtr scatter(const void* s, void* r, size_t n, int root, DataType t, const CollOptions& o) {
    CROSSBAR_ROUTE(scatter, s, r, n, root, t);
  }
  WorkPtr alltoall(const void* s, void* r, size_t n, DataType t, const CollOptions& o) {
    CROSSBAR_ROUTE(alltoall, s, r, n, t);
  }
  WorkPtr alltoallv(const void* s, const std::vector<size_t>& sc, const std::vector<size_t>& sd, void* r,
                    const std::vector<size_t>& rc, const std::vector<size_t>& rd, DataType t, const CollOptions& o) {
    CROSSBAR_ROUTE(alltoallv, s, sc, sd, r, rc, rd, t);
  }
#undef CROSSBAR_ROUTE
  WorkPtr barrier(const CollOptions& o) { return host->barrier(o); }
#if CROSSBAR_TORCH_CUDA
  WorkPtr send(const void* d, size_t n, DataType t, int peer, uint32_t tag, const CollOptions& o) {
    return cuda->send(d, n, t, peer, tag, static_cast<cudaStream_t>(stream), o);
  }
  WorkPtr recv(void* d, size_t n, DataType t, int peer, uint32_t tag, const CollOptions& o) {
    return cuda->recv(d, n, t, peer, tag, static_cast<cudaStream_t>(stream), o);
  }
#else
  // Never called: CUDA tensors are refused before (checkTensor).
  WorkPtr send(const void*, size_t, DataType, int, uint32_t, const CollOptions&) { return nullptr; }
  WorkPtr recv(void*, size_t, DataType, int, uint32_t, const CollOptions&) { return nullptr; }
#endif
  // Coalesced collectives: one group. Inside a coalescing block the block's group is it.
  void groupStart() {
#if CROSSBAR_TORCH_CUDA
    if (cuda) {
      if (!*cuda_group_open) cuda->groupStart();
      return;
    }
#endif
    host->groupStart();
  }
  WorkPtr groupEnd() {
#if CROSSBAR_TORCH_CUDA
    if (cuda) return *cuda_group_open ? nullptr : cuda->groupEnd();
#endif
    return host->groupEnd();
  }
};

c10::intrusive_ptr<c10d::Work> CrossbarBackend::submit(c10d::OpType type, const char* title,
                                                       std::vector<at::Tensor> outputs, Millis timeout,
                                                       const at::Tensor& on,
                                                       const std::function<void(CrossbarWork&, Ops&)>& issue,
                                                       bool p2p) {
  ensureUsable(title);
  if (!p2p) ++coll_seq_;
  if (on.defined() && on.is_cuda()) return submitCuda(type, title, std::move(outputs), timeout, on, issue, p2p);
  if (coalescing_ && coalesced_kind_ == 2)
    throw InvalidUsage(errorContext(rank_, title) +
                       "a coalescing block (batch_isend_irecv, _coalescing_manager) mixes CPU and CUDA tensors; "
                       "use one device per block");
  auto work = c10::make_intrusive<CrossbarWork>(rank_, type, nullptr, std::move(outputs), timeout);
  Ops ops;
  ops.host = coll_.get();
  issue(*work, ops);  // validation errors surface here, synchronously
  if (coalescing_) {
    coalesced_kind_ = 1;
    coalesced_->children.push_back(work);
    return work;
  }
  if (finishedAtIssue(*work)) return work;
  work->queued_at = Clock::now();
  work->bell = p2p ? p2p_bell_ : coll_bell_;
  {
    std::lock_guard<std::mutex> lk(m_);
    (p2p ? p2p_incoming_ : coll_pending_).push_back(work);
  }
  work->bell->ringIfAsleep();
  return work;
}

#if CROSSBAR_TORCH_CUDA

CudaCollectives& CrossbarBackend::ensureCuda(int device, const char* op) {
  if (cuda_) {
    if (device != cuda_device_)
      throw InvalidArgument(fmt::format(
          "{}this process group runs CUDA tensors on cuda:{}, got a tensor on cuda:{}; use one device per rank "
          "and group (torch.cuda.set_device(local_rank))",
          errorContext(rank_, op), cuda_device_, device));
    return *cuda_;
  }
  // Collective: every rank's first CUDA call creates it (same call on every rank).
  CudaCollectivesOptions co;
  co.device = device;
  co.timeout = Millis(timeout_ms_.load());
  const bool shares_a_gpu = groupSharesAGpu(device);  // first: nothing is set up when it fails
  cuda_ = std::make_shared<CudaCollectives>(comm_, co);
  cuda_device_ = device;
  cuda_p2p_staged_ = shares_a_gpu;
  announcer_ = std::make_unique<P2pAnnouncer>(comm_);
  cuda_thread_ = std::thread([this] {
    nameThisThread("cb-torch-cuda");
    cudaLoop();
  });
  return *cuda_;
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::submitCuda(
    c10d::OpType type, const char* title, std::vector<at::Tensor> outputs, Millis timeout, const at::Tensor& on,
    const std::function<void(CrossbarWork&, Ops&)>& issue, bool p2p) {
  if (coalescing_ && coalesced_kind_ == 1)
    throw InvalidUsage(errorContext(rank_, title) +
                       "a coalescing block (batch_isend_irecv, _coalescing_manager) mixes CPU and CUDA tensors; "
                       "use one device per block");
  const int device = on.device().index();
  CudaCollectives& cc = ensureCuda(device, title);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaStream_t stream = currentStream(device);
  auto work = c10::make_intrusive<CrossbarWork>(rank_, type, nullptr, std::move(outputs), timeout,
                                                std::vector<c10::Device>{on.device()});
  const bool staged = p2p && cuda_p2p_staged_;
  if (coalescing_ && !cuda_group_open_ && !staged) {
    cc.groupStart();  // NCCL ops of the block launch together at endCoalescing
    cuda_group_open_ = true;
  }
  Ops ops;
  ops.host = coll_.get();
  ops.cuda = &cc;
  ops.stream = stream;
  ops.cuda_group_open = &cuda_group_open_;
  ops.staged = staged;
  issue(*work, ops);
  if (work->staged) {
    if (coalescing_) {  // receives go on the stream at endCoalescing, after every send's copy
      coalesced_kind_ = 2;
      coalesced_->children.push_back(work);
      return work;
    }
    launchStaged(work, stream);
    return work;
  }
  // Stream order: copies into non-contiguous or listed outputs go on the stream right
  // after the operation, not after the host saw it finish.
  if (work->post) std::exchange(work->post, nullptr)();
  if (coalescing_) {
    coalesced_kind_ = 2;
    coalesced_->children.push_back(work);  // finished at endCoalescing, after the group launched
    return work;
  }
  enqueuedOnCuda(work, stream);
  return work;
}

void CrossbarBackend::enqueuedOnCuda(const c10::intrusive_ptr<CrossbarWork>& work, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  work->cuda_end = recordEvent(s, rank_);
  // The future completes now; a CUDA-aware future makes its consumers' streams wait for
  // what was enqueued on the current stream (DDP comm hooks chain on it).
  work->getFuture()->markCompleted(c10::IValue(work->result()));
  {
    std::lock_guard<std::mutex> lk(m_);
    cuda_pending_.push_back(work);
  }
  cuda_cv_.notify_all();
}

void CrossbarBackend::cudaLoop() {
  std::unique_lock<std::mutex> lk(m_);
  while (true) {
    cuda_cv_.wait(lk, [&] { return stop_ || !cuda_pending_.empty(); });
    if (cuda_pending_.empty()) return;  // stopping and drained
    c10::intrusive_ptr<CrossbarWork> w = cuda_pending_.front();
    lk.unlock();
    std::exception_ptr err;
    bool done = w->waitUnderlying(Deadline::after(Millis(200)), &err);
    if (!done && w->deadline.expired()) {
      err = std::make_exception_ptr(Timeout(fmt::format(
          "{}{} did not finish on cuda:{} within {} ms ({}); a peer may be missing or hung. The stream stays "
          "blocked: abort the process group (and create a new one)",
          errorContext(rank_, "cuda work"), c10d::opTypeToString(w->retrieveOpType()), cuda_device_,
          w->getTimeout().count(), w->coll ? w->coll->description() : std::string("group"))));
      done = true;
    }
    if (done) w->complete(err);
    // Receives naming their sender: a size or order mismatch its announcement showed.
    std::exception_ptr mismatch = done && announcer_ ? announcer_->poll() : nullptr;
    if (mismatch) {
      try {
        std::rethrow_exception(mismatch);
      } catch (const std::exception& e) {
        CB_WARN("torch", "{}", e.what());
      }
    }
    lk.lock();
    if (done) {
      cuda_pending_.pop_front();
      if (err && !first_error_) first_error_ = err;
      if (mismatch && !first_error_) first_error_ = mismatch;
    }
  }
}

// ---- CUDA point to point through host memory ----------------------------------------------
// NCCL refuses a communicator in which two ranks share a GPU ("Duplicate GPU detected"),
// so such a group's CUDA send/recv go through pinned host memory and the host path,
// ordered on the current stream as NCCL's would be, the host never blocking:
//   send: D2H copy on the stream -> the point-to-point thread posts the host send once
//         that copy passed; the work's end on the stream is the copy (the tensor may be
//         reused after it, like after an NCCL send).
//   recv: the host receive is posted at once into pinned memory; on the stream: wait for
//         a release word in that memory (cuStreamWaitValue32), then the H2D copy. The
//         point-to-point thread releases the word when the receive finished -- also
//         when it failed or timed out (the error goes to the work and getError()), so
//         the stream never stays blocked.

namespace {
// The receive's release word sits ahead of its data, on its own cache line.
constexpr int64_t kReleaseBytes = 64;
// Which GPU each rank uses (its UUID), exchanged at the group's first CUDA call; above
// monitored_barrier's tag (kInternalTagBase + 0x200).
constexpr uint32_t kGpuIdTag = kInternalTagBase + 0x201;

// Pinned host memory from torch's caching host allocator: a block is reused only after
// the stream copies recorded on it (copy_ with non_blocking) passed.
at::Tensor pinnedBytes(int64_t n) {
  return at::empty({n}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
}

// A contiguous tensor's bytes (flat uint8 view).
at::Tensor bytesOf(const at::Tensor& t) {
  return t.reshape({-1}).view(at::kByte);
}

// cudaLaunchHostFunc callback (no CUDA calls allowed): until the release word is set.
void CUDART_CB waitForRelease(void* word) {
  auto* release = static_cast<uint32_t*>(word);
  while (__atomic_load_n(release, __ATOMIC_ACQUIRE) == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
}
}  // namespace

bool CrossbarBackend::groupSharesAGpu(int device) {
  cudaDeviceProp prop{};
  checkCuda(cudaGetDeviceProperties(&prop, device), rank_, "cudaGetDeviceProperties");
  constexpr size_t kId = sizeof(prop.uuid.bytes);
  std::vector<uint8_t> all(kId * static_cast<size_t>(size_));
  std::memcpy(&all[rank_ * kId], prop.uuid.bytes, kId);
  // Point to point, not the host Collectives: a coalescing block may hold its group open.
  std::vector<RequestPtr> reqs;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    reqs.push_back(comm_->irecv(&all[r * kId], kId, r, kGpuIdTag));
    reqs.push_back(comm_->isend(&all[rank_ * kId], kId, r, kGpuIdTag));
  }
  comm_->waitAll(reqs, Deadline::after(Millis(timeout_ms_.load())));
  for (int a = 0; a < size_; ++a)
    for (int b = a + 1; b < size_; ++b)
      if (std::memcmp(&all[a * kId], &all[b * kId], kId) == 0) {
        CB_INFO("torch", "{}: ranks {} and {} share a GPU, which NCCL refuses: CUDA point to point goes through "
                "host memory", comm_->name(), a, b);
        return true;
      }
  return false;
}

void CrossbarBackend::stagedSend(CrossbarWork& w, const at::Tensor& src, int dst, uint32_t tag, void* stream) {
  const int64_t n = static_cast<int64_t>(src.nbytes());
  at::Tensor host = pinnedBytes(n);
  if (n) host.copy_(bytesOf(src), /*non_blocking=*/true);  // on the current stream
  w.staged = true;
  w.keepalive = {src, host};
  w.start_after = recordEvent(static_cast<cudaStream_t>(stream), rank_);
  w.cuda_end = w.start_after;
  w.start = [comm = comm_, host, dst, tag] { return comm->isend(host.data_ptr(), host.nbytes(), dst, tag); };
}

void CrossbarBackend::stagedRecv(CrossbarWork& w, const at::Tensor& dst, int src, uint32_t tag,
                                 std::function<void()> stream_post) {
  const int64_t n = static_cast<int64_t>(dst.nbytes());
  at::Tensor block = pinnedBytes(kReleaseBytes + n);
  auto* release = static_cast<uint32_t*>(block.data_ptr());
  __atomic_store_n(release, 0u, __ATOMIC_RELAXED);
  // Pinned memory is mapped for the device; with unified addressing at the same address.
  void* release_on_device = nullptr;
  if (cudaHostGetDevicePointer(&release_on_device, release, 0) != cudaSuccess) {
    cudaGetLastError();
    release_on_device = release;
  }
  at::Tensor host = block.narrow(0, kReleaseBytes, n);
  auto req = comm_->irecv(n ? host.data_ptr() : nullptr, static_cast<size_t>(n), src, tag);
  w.staged = true;
  w.keepalive = {dst, block};
  w.requests.push_back(req);
  w.post = [req, n, src, rank = rank_] {
    if (req->status().bytes != static_cast<size_t>(n))
      throw InvalidUsage(fmt::format("{}rank {} sent {} bytes, expected {}; do the tensor sizes match?",
                                     errorContext(rank, "recv"), src, req->status().bytes, n),
                         {src});
  };
  w.on_finish = [release] { __atomic_store_n(release, 1u, __ATOMIC_RELEASE); };
  const int device = cuda_device_;
  const int rank = rank_;
  w.enqueue = [work = &w, release_on_device, release_on_host = release, block, host, dst,
               stream_post = std::move(stream_post), n, device, rank] {
    cudaStream_t s = currentStream(device);
    try {
      crossbar::cuda::streamWaitValue32(s, static_cast<const uint32_t*>(release_on_device), 1u,
                                        crossbar::cuda::WaitCond::kEq);
    } catch (const Error& e) {
      // No stream memory operations on this device or memory: a host function on the
      // stream waits for the release instead (it always comes: at the receive's end or
      // deadline).
      static std::once_flag logged;
      std::call_once(logged, [&] {
        CB_WARN("torch", "staged CUDA receive: the stream waits through a host function ({})", e.what());
      });
      checkCuda(cudaLaunchHostFunc(s, waitForRelease, release_on_host), rank, "cudaLaunchHostFunc");
    }
    if (n) {
      bytesOf(dst).copy_(host, /*non_blocking=*/true);
    } else {  // nothing to copy: a 4-byte one still ties the block's reuse to this stream
      at::empty({4}, dst.options().dtype(at::kByte)).copy_(block.narrow(0, 0, 4), /*non_blocking=*/true);
    }
    if (stream_post) stream_post();  // into a non-contiguous output, on the stream
    work->cuda_end = recordEvent(s, rank);
  };
}

void CrossbarBackend::launchStaged(const c10::intrusive_ptr<CrossbarWork>& work, void* /*stream*/) {
  if (work->enqueue) std::exchange(work->enqueue, nullptr)();
  // As for every CUDA work: the future completes now, consumers' streams wait for cuda_end.
  work->getFuture()->markCompleted(c10::IValue(work->result()));
  {
    std::lock_guard<std::mutex> lk(m_);
    p2p_incoming_.push_back(work);
    p2p_new_ = true;
  }
  p2p_bell_->ring();
}

std::string CrossbarBackend::cudaP2pPath() const {
  if (!cuda_) return "";
  return cuda_p2p_staged_ ? "host-staged" : "nccl";
}

#else

CudaCollectives& CrossbarBackend::ensureCuda(int /*device*/, const char* op) {
  throw Unsupported(errorContext(rank_, op) + "this crossbar build has no CUDA path");
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::submitCuda(c10d::OpType, const char* title, std::vector<at::Tensor>,
                                                           Millis, const at::Tensor&,
                                                           const std::function<void(CrossbarWork&, Ops&)>&, bool) {
  ensureCuda(-1, title);
  return nullptr;
}

void CrossbarBackend::enqueuedOnCuda(const c10::intrusive_ptr<CrossbarWork>&, void*) {}
void CrossbarBackend::cudaLoop() {}
std::string CrossbarBackend::cudaP2pPath() const { return ""; }
void CrossbarBackend::stagedSend(CrossbarWork&, const at::Tensor&, int, uint32_t, void*) {}
void CrossbarBackend::stagedRecv(CrossbarWork&, const at::Tensor&, int, uint32_t, std::function<void()>) {}
void CrossbarBackend::launchStaged(const c10::intrusive_ptr<CrossbarWork>&, void*) {}
bool CrossbarBackend::groupSharesAGpu(int) { return false; }

#endif

// ---- collectives ----------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> CrossbarBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  checkSingle(tensors, rank_, "broadcast");
  at::Tensor t = tensors[0];
  const int root = static_cast<int>(opts.rootRank);
  CollOptions o{timeoutOf(opts.timeout), "", 1.0};
  return submit(c10d::OpType::BROADCAST, "broadcast", tensors, o.timeout, t, [&](CrossbarWork& w, Ops& ops) {
    std::vector<std::function<void()>> post;
    at::Tensor buf = outputStage(t, rank_ == root, post);
    Moved m = movedType(buf);
    w.keepalive = {buf};
    w.post = sequence(std::move(post));
    w.coll = ops.broadcast(buf.data_ptr(), elems(buf) * m.scale, m.type, root, o);
  });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  checkSingle(tensors, rank_, "allreduce");
  at::Tensor t = tensors[0];
  if (isBitwise(opts.reduceOp)) {
    checkBitwise(t, rank_, "allreduce");
    CollOptions o{timeoutOf(opts.timeout), "", 1.0};
    return submit(c10d::OpType::ALLREDUCE, "allreduce", tensors, o.timeout, t, [&](CrossbarWork& w, Ops& ops) {
      at::Tensor src = contiguousCopy(t);
      at::Tensor rows = flatLike(t, t.numel() * size_);
      Moved m = movedType(src);
      w.keepalive = {src, rows};
      w.post = [t, rows, size = size_, op = opts.reduceOp.op_] { bitwiseFoldInto(t, rows, size, op); };
      w.coll = ops.allgather(src.data_ptr(), rows.data_ptr(), elems(src) * m.scale, m.type, o);
    });
  }
  Reduction r = mapReduction(t.scalar_type(), opts.reduceOp, rank_, "allreduce");
  CollOptions o{timeoutOf(opts.timeout), "", r.scalar};
  return submit(c10d::OpType::ALLREDUCE, "allreduce", tensors, o.timeout, t, [&](CrossbarWork& w, Ops& ops) {
    std::vector<std::function<void()>> post;
    at::Tensor buf = outputStage(t, true, post);
    w.keepalive = {buf};
    w.post = sequence(std::move(post));
    w.coll = ops.allreduce(buf.data_ptr(), buf.data_ptr(), elems(buf), r.type, r.op, o);
  });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  checkTensors(tensors, rank_, "allreduce_coalesced");
  if (isBitwise(opts.reduceOp)) {
    for (const auto& t : tensors) checkBitwise(t, rank_, "allreduce_coalesced");
    CollOptions o{timeoutOf(opts.timeout), "", 1.0};
    return submit(c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors, o.timeout, firstOf(tensors),
                  [&](CrossbarWork& w, Ops& ops) {
                    std::vector<std::function<void()>> post;
                    ops.groupStart();
                    try {
                      for (const auto& t : tensors) {
                        at::Tensor src = contiguousCopy(t);
                        at::Tensor rows = flatLike(t, t.numel() * size_);
                        Moved m = movedType(src);
                        w.keepalive.push_back(src);
                        w.keepalive.push_back(rows);
                        post.push_back([t, rows, size = size_, op = opts.reduceOp.op_] {
                          bitwiseFoldInto(t, rows, size, op);
                        });
                        ops.allgather(src.data_ptr(), rows.data_ptr(), elems(src) * m.scale, m.type, o);
                      }
                    } catch (...) {
                      ops.groupEnd();
                      throw;
                    }
                    w.coll = ops.groupEnd();
                    w.post = sequence(std::move(post));
                  });
  }
  std::vector<Reduction> rs;
  for (const auto& t : tensors)
    rs.push_back(mapReduction(t.scalar_type(), opts.reduceOp, rank_, "allreduce"));
  CollOptions o{timeoutOf(opts.timeout), "", rs.empty() ? 1.0 : rs[0].scalar};
  return submit(c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors, o.timeout,
                firstOf(tensors), [&](CrossbarWork& w, Ops& ops) {
                  std::vector<std::function<void()>> post;
                  ops.groupStart();
                  try {
                    for (size_t i = 0; i < tensors.size(); ++i) {
                      at::Tensor buf = outputStage(tensors[i], true, post);
                      w.keepalive.push_back(buf);
                      ops.allreduce(buf.data_ptr(), buf.data_ptr(), elems(buf), rs[i].type, rs[i].op, o);
                    }
                  } catch (...) {
                    ops.groupEnd();
                    throw;
                  }
                  w.coll = ops.groupEnd();
                  w.post = sequence(std::move(post));
                });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  checkSingle(tensors, rank_, "reduce");
  at::Tensor t = tensors[0];
  const int root = static_cast<int>(opts.rootRank);
  if (isBitwise(opts.reduceOp)) {
    checkBitwise(t, rank_, "reduce");
    CollOptions o{timeoutOf(opts.timeout), "", 1.0};
    return submit(c10d::OpType::REDUCE, "reduce", tensors, o.timeout, t, [&](CrossbarWork& w, Ops& ops) {
      at::Tensor src = contiguousCopy(t);
      Moved m = movedType(src);
      w.keepalive = {src};
      void* recv = nullptr;
      if (rank_ == root) {  // non-root inputs stay unchanged
        at::Tensor rows = flatLike(t, t.numel() * size_);
        w.keepalive.push_back(rows);
        recv = rows.data_ptr();
        w.post = [t, rows, size = size_, op = opts.reduceOp.op_] { bitwiseFoldInto(t, rows, size, op); };
      }
      w.coll = ops.gather(src.data_ptr(), recv, elems(src) * m.scale, root, m.type, o);
    });
  }
  Reduction r = mapReduction(t.scalar_type(), opts.reduceOp, rank_, "reduce");
  CollOptions o{timeoutOf(opts.timeout), "", r.scalar};
  return submit(c10d::OpType::REDUCE, "reduce", tensors, o.timeout, t, [&](CrossbarWork& w, Ops& ops) {
    std::vector<std::function<void()>> post;
    at::Tensor buf = rank_ == root ? outputStage(t, true, post) : contiguousCopy(t);
    w.keepalive = {buf};
    w.post = sequence(std::move(post));
    // Non-root inputs stay unchanged (no receive buffer there).
    w.coll = ops.reduce(buf.data_ptr(), rank_ == root ? buf.data_ptr() : nullptr, elems(buf), r.type, r.op,
                           root, o);
  });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  checkSingle(inputs, rank_, "allgather");
  if (outputs.size() != 1 || outputs[0].size() != static_cast<size_t>(size_))
    throw InvalidArgument(fmt::format("{}expected one output list of {} tensors (one per rank)",
                                      errorContext(rank_, "allgather"), size_));
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs = outputs[0];
  for (const auto& o : outs) {
    checkTensor(o, rank_, "allgather");
    checkSameType(o, in, rank_, "allgather");
    if (o.numel() != in.numel())
      throw InvalidArgument(fmt::format("{}every output tensor must have the input's {} elements, got {}",
                                        errorContext(rank_, "allgather"), in.numel(), o.numel()));
  }
  CollOptions o{timeoutOf(opts.timeout), "", 1.0};
  return submit(c10d::OpType::ALLGATHER, "allgather", outs, o.timeout, in, [&](CrossbarWork& w, Ops& ops) {
    at::Tensor src = contiguousCopy(in);
    at::Tensor flat = flatLike(in, in.numel() * size_);
    Moved m = movedType(src);
    w.keepalive = {src, flat};
    w.post = [outs, flat, n = in.numel()]() mutable {
      for (size_t i = 0; i < outs.size(); ++i)
        outs[i].copy_(flat.narrow(0, static_cast<int64_t>(i) * n, n).view(outs[i].sizes()));
    };
    w.coll = ops.allgather(src.data_ptr(), flat.data_ptr(), elems(src) * m.scale, m.type, o);
  });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  checkTensor(input, rank_, "all_gather_into_tensor");
  checkTensor(output, rank_, "all_gather_into_tensor");
  checkSameType(output, input, rank_, "all_gather_into_tensor");
  if (output.numel() != input.numel() * size_)
    throw InvalidArgument(fmt::format("{}output has {} elements, expected input ({}) x world size ({})",
                                      errorContext(rank_, "all_gather_into_tensor"), output.numel(),
                                      input.numel(), size_));
  CollOptions o{timeoutOf(opts.timeout), "", 1.0};
  return submit(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {output}, o.timeout,
                input, [&](CrossbarWork& w, Ops& ops) {
                  std::vector<std::function<void()>> post;
                  at::Tensor out = outputStage(output, false, post);
                  at::Tensor src = contiguousCopy(input);
                  Moved m = movedType(src);
                  w.keepalive = {out, src};
                  w.post = sequence(std::move(post));
                  w.coll = ops.allgather(src.data_ptr(), out.data_ptr(), elems(src) * m.scale, m.type, o);
                });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (outputs.size() != static_cast<size_t>(size_))
    throw InvalidArgument(fmt::format("{}expected {} output lists (one per rank), got {}",
                                      errorContext(rank_, "allgather_coalesced"), size_, outputs.size()));
  checkTensors(inputs, rank_, "allgather_coalesced");
  for (const auto& list : outputs) {
    if (list.size() != inputs.size())
      throw InvalidArgument(fmt::format("{}each output list must have {} tensors (one per input)",
                                        errorContext(rank_, "allgather_coalesced"), inputs.size()));
    for (size_t i = 0; i < list.size(); ++i) {
      checkTensor(list[i], rank_, "allgather_coalesced");
      checkSameType(list[i], inputs[i], rank_, "allgather_coalesced");
      if (list[i].numel() != inputs[i].numel())
        throw InvalidArgument(errorContext(rank_, "allgather_coalesced") +
                              "output tensors must match their inputs' sizes");
    }
  }
  std::vector<at::Tensor> flat_outs;
  for (const auto& list : outputs) flat_outs.insert(flat_outs.end(), list.begin(), list.end());
  CollOptions o{timeoutOf(opts.timeout), "", 1.0};
  return submit(c10d::OpType::ALLGATHER_COALESCED, "allgather_coalesced", flat_outs, o.timeout,
                firstOf(inputs), [&](CrossbarWork& w, Ops& ops) {
                  std::vector<at::Tensor> flats;
                  ops.groupStart();
                  try {
                    for (const auto& in : inputs) {
                      at::Tensor src = contiguousCopy(in);
                      at::Tensor flat = flatLike(in, in.numel() * size_);
                      Moved m = movedType(src);
                      w.keepalive.push_back(src);
                      flats.push_back(flat);
                      ops.allgather(src.data_ptr(), flat.data_ptr(), elems(src) * m.scale, m.type, o);
                    }
                  } catch (...) {
                    ops.groupEnd();
                    throw;
                  }
                  w.coll = ops.groupEnd();
                  w.keepalive.insert(w.keepalive.end(), flats.begin(), flats.end());
                  w.post = [outputs, flats]() mutable {
                    for (size_t r = 0; r < outputs.size(); ++r)
                      for (size_t i = 0; i < flats.size(); ++i) {
                        const int64_t n = outputs[r][i].numel();
                        outputs[r][i].copy_(
                            flats[i].narrow(0, static_cast<int64_t>(r) * n, n).view(outputs[r][i].sizes()));
                      }
                  };
                });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  if (outputs.size() != inputs.size())
    throw InvalidArgument(errorContext(rank_, "allgather_into_tensor_coalesced") +
                          "needs as many outputs as inputs");
  checkTensors(inputs, rank_, "allgather_into_tensor_coalesced");
  checkTensors(outputs, rank_, "allgather_into_tensor_coalesced");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSameType(outputs[i], inputs[i], rank_, "allgather_into_tensor_coalesced");
    if (outputs[i].numel() != inputs[i].numel() * size_)
      throw InvalidArgument(errorContext(rank_, "allgather_into_tensor_coalesced") +
                            "each output needs input size x world size elements");
  }
  CollOptions o{timeoutOf(opts.timeout), "", 1.0};
  return submit(allgatherCoalescedType<c10d::OpType>(0), "allgather_into_tensor_coalesced", outputs,
                o.timeout, firstOf(inputs), [&](CrossbarWork& w, Ops& ops) {
                  std::vector<std::function<void()>> post;
                  ops.groupStart();
                  try {
                    for (size_t i = 0; i < inputs.size(); ++i) {
                      at::Tensor out = outputStage(outputs[i], false, post);
                      at::Tensor src = contiguousCopy(inputs[i]);
                      Moved m = movedType(src);
                      w.keepalive.push_back(out);
                      w.keepalive.push_back(src);
                      ops.allgather(src.data_ptr(), out.data_ptr(), elems(src) * m.scale, m.type, o);
                    }
                  } catch (...) {
                    ops.groupEnd();
                    throw;
                  }
                  w.coll = ops.groupEnd();
                  w.post = sequence(std::move(post));
                });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::GatherOptions& opts) {
  checkSingle(inputs, rank_, "gather");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs = rootTensorList(outputs, in, rank_, root, size_, "gather", "output", "input");
  CollOptions o{timeoutOf(opts.timeout), "", 1.0};
  return submit(c10d::OpType::GATHER, "gather", outs, o.timeout, in, [&](CrossbarWork& w, Ops& ops) {
    at::Tensor src = contiguousCopy(in);
    Moved m = movedType(src);
    w.keepalive = {src};
    void* recv = nullptr;
    if (rank_ == root) {
      at::Tensor flat = flatLike(in, in.numel() * size_);
      w.keepalive.push_back(flat);
      recv = flat.data_ptr();
      w.post = [outs, flat, n = in.numel()]() mutable {
        for (size_t i = 0; i < outs.size(); ++i)
          outs[i].copy_(flat.narrow(0, static_cast<int64_t>(i) * n, n).view(outs[i].sizes()));
      };
    }
    w.coll = ops.gather(src.data_ptr(), recv, elems(src) * m.scale, root, m.type, o);
  });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  checkSingle(outputs, rank_, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor out = outputs[0];
  std::vector<at::Tensor> ins = rootTensorList(inputs, out, rank_, root, size_, "scatter", "input", "output");
  CollOptions o{timeoutOf(opts.timeout), "", 1.0};
  return submit(c10d::OpType::SCATTER, "scatter", outputs, o.timeout, out, [&](CrossbarWork& w, Ops& ops) {
    std::vector<std::function<void()>> post;
    at::Tensor dst = outputStage(out, false, post);
    Moved m = movedType(dst);
    w.keepalive = {dst};
    const void* send = nullptr;
    if (rank_ == root) {
      std::vector<at::Tensor> flat_ins;
      for (const auto& i : ins) flat_ins.push_back(i.reshape({-1}));
      at::Tensor flat = at::cat(flat_ins);
      w.keepalive.push_back(flat);
      send = flat.data_ptr();
    }
    w.post = sequence(std::move(post));
    w.coll = ops.scatter(send, dst.data_ptr(), elems(dst) * m.scale, root, m.type, o);
  });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  checkSingle(outputs, rank_, "reduce_scatter");
  if (inputs.size() != 1 || inputs[0].size() != static_cast<size_t>(size_))
    throw InvalidArgument(fmt::format("{}expected one input list of {} tensors (one per rank)",
                                      errorContext(rank_, "reduce_scatter"), size_));
  at::Tensor out = outputs[0];
  std::vector<at::Tensor> ins = inputs[0];
  for (const auto& i : ins) {
    checkTensor(i, rank_, "reduce_scatter");
    checkSameType(i, out, rank_, "reduce_scatter");
    if (i.numel() != out.numel())
      throw InvalidArgument(errorContext(rank_, "reduce_scatter") +
                            "input tensors must match the output's size");
  }
  if (isBitwise(opts.reduceOp)) {
    checkBitwise(out, rank_, "reduce_scatter");
    CollOptions o{timeoutOf(opts.timeout), "", 1.0};
    return submit(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", outputs, o.timeout, out,
                  [&](CrossbarWork& w, Ops& ops) {
                    std::vector<at::Tensor> flat_ins;
                    for (const auto& i : ins) flat_ins.push_back(i.reshape({-1}));
                    at::Tensor src = at::cat(flat_ins);
                    at::Tensor rows = flatLike(out, out.numel() * size_);  // my chunk from every rank
                    Moved m = movedType(src);
                    w.keepalive = {src, rows};
                    w.post = [out, rows, size = size_, op = opts.reduceOp.op_] { bitwiseFoldInto(out, rows, size, op); };
                    w.coll = ops.alltoall(src.data_ptr(), rows.data_ptr(), elems(out) * m.scale, m.type, o);
                  });
  }
  Reduction r = mapReduction(out.scalar_type(), opts.reduceOp, rank_, "reduce_scatter");
  CollOptions o{timeoutOf(opts.timeout), "", r.scalar};
  return submit(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", outputs, o.timeout, out, [&](CrossbarWork& w, Ops& ops) {
    std::vector<std::function<void()>> post;
    at::Tensor dst = outputStage(out, false, post);
    std::vector<at::Tensor> flat_ins;
    for (const auto& i : ins) flat_ins.push_back(i.reshape({-1}));
    at::Tensor flat = at::cat(flat_ins);
    w.keepalive = {dst, flat};
    w.post = sequence(std::move(post));
    w.coll = ops.reduceScatter(flat.data_ptr(), dst.data_ptr(), elems(dst), r.type, r.op, o);
  });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  checkTensor(input, rank_, "reduce_scatter_tensor");
  checkTensor(output, rank_, "reduce_scatter_tensor");
  checkSameType(output, input, rank_, "reduce_scatter_tensor");
  if (input.numel() != output.numel() * size_)
    throw InvalidArgument(fmt::format("{}input has {} elements, expected output ({}) x world size ({})",
                                      errorContext(rank_, "reduce_scatter_tensor"), input.numel(),
                                      output.numel(), size_));
  if (isBitwise(opts.reduceOp)) {
    checkBitwise(output, rank_, "reduce_scatter_tensor");
    CollOptions o{timeoutOf(opts.timeout), "", 1.0};
    return submit(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", {output}, o.timeout, input,
                  [&](CrossbarWork& w, Ops& ops) {
                    at::Tensor src = contiguousCopy(input);
                    at::Tensor rows = flatLike(output, output.numel() * size_);
                    Moved m = movedType(src);
                    w.keepalive = {src, rows};
                    w.post = [output, rows, size = size_, op = opts.reduceOp.op_] {
                      bitwiseFoldInto(output, rows, size, op);
                    };
                    w.coll = ops.alltoall(src.data_ptr(), rows.data_ptr(), elems(output) * m.scale, m.type, o);
                  });
  }
  Reduction r = mapReduction(output.scalar_type(), opts.reduceOp, rank_, "reduce_scatter_tensor");
  CollOptions o{timeoutOf(opts.timeout), "", r.scalar};
  return submit(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", {output}, o.timeout,
                input, [&](CrossbarWork& w, Ops& ops) {
                  std::vector<std::function<void()>> post;
                  at::Tensor dst = outputStage(output, false, post);
                  at::Tensor src = contiguousCopy(input);
                  w.keepalive = {dst, src};
                  w.post = sequence(std::move(post));
                  w.coll = ops.reduceScatter(src.data_ptr(), dst.data_ptr(), elems(dst), r.type, r.op, o);
                });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (outputs.size() != inputs.size())
    throw InvalidArgument(errorContext(rank_, "reduce_scatter_tensor_coalesced") +
                          "needs as many outputs as inputs");
  checkTensors(inputs, rank_, "reduce_scatter_tensor_coalesced");
  checkTensors(outputs, rank_, "reduce_scatter_tensor_coalesced");
  if (isBitwise(opts.reduceOp)) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkSameType(outputs[i], inputs[i], rank_, "reduce_scatter_tensor_coalesced");
      checkBitwise(outputs[i], rank_, "reduce_scatter_tensor_coalesced");
      if (inputs[i].numel() != outputs[i].numel() * size_)
        throw InvalidArgument(errorContext(rank_, "reduce_scatter_tensor_coalesced") +
                              "each input needs output size x world size elements");
    }
    CollOptions o{timeoutOf(opts.timeout), "", 1.0};
    return submit(reduceScatterCoalescedType<c10d::OpType>(0), "reduce_scatter_tensor_coalesced", outputs,
                  o.timeout, firstOf(inputs), [&](CrossbarWork& w, Ops& ops) {
                    std::vector<std::function<void()>> post;
                    ops.groupStart();
                    try {
                      for (size_t i = 0; i < inputs.size(); ++i) {
                        at::Tensor src = contiguousCopy(inputs[i]);
                        at::Tensor rows = flatLike(outputs[i], outputs[i].numel() * size_);
                        Moved m = movedType(src);
                        w.keepalive.push_back(src);
                        w.keepalive.push_back(rows);
                        post.push_back([out = outputs[i], rows, size = size_, op = opts.reduceOp.op_] {
                          bitwiseFoldInto(out, rows, size, op);
                        });
                        ops.alltoall(src.data_ptr(), rows.data_ptr(), elems(outputs[i]) * m.scale, m.type, o);
                      }
                    } catch (...) {
                      ops.groupEnd();
                      throw;
                    }
                    w.coll = ops.groupEnd();
                    w.post = sequence(std::move(post));
                  });
  }
  std::vector<Reduction> rs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSameType(outputs[i], inputs[i], rank_, "reduce_scatter_tensor_coalesced");
    if (inputs[i].numel() != outputs[i].numel() * size_)
      throw InvalidArgument(errorContext(rank_, "reduce_scatter_tensor_coalesced") +
                            "each input needs output size x world size elements");
    rs.push_back(
        mapReduction(outputs[i].scalar_type(), opts.reduceOp, rank_, "reduce_scatter_tensor_coalesced"));
  }
  CollOptions o{timeoutOf(opts.timeout), "", rs.empty() ? 1.0 : rs[0].scalar};
  return submit(reduceScatterCoalescedType<c10d::OpType>(0), "reduce_scatter_tensor_coalesced", outputs,
                o.timeout, firstOf(inputs), [&](CrossbarWork& w, Ops& ops) {
                  std::vector<std::function<void()>> post;
                  ops.groupStart();
                  try {
                    for (size_t i = 0; i < inputs.size(); ++i) {
                      at::Tensor dst = outputStage(outputs[i], false, post);
                      at::Tensor src = contiguousCopy(inputs[i]);
                      w.keepalive.push_back(dst);
                      w.keepalive.push_back(src);
                      ops.reduceScatter(src.data_ptr(), dst.data_ptr(), elems(dst), rs[i].type, rs[i].op,
                                           o);
                    }
                  } catch (...) {
                    ops.groupEnd();
                    throw;
                  }
                  w.coll = ops.groupEnd();
                  w.post = sequence(std::move(post));
                });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& output_splits,
                                                              std::vector<int64_t>& input_splits,
                                                              const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all_single";
  checkTensor(input, rank_, op);
  checkTensor(output, rank_, op);
  checkSameType(output, input, rank_, op);
  CollOptions o{timeoutOf(opts.timeout), "", 1.0};
  const bool even = output_splits.empty() && input_splits.empty();
  if (even) {
    if (input.numel() % size_ != 0 || output.numel() != input.numel())
      throw InvalidArgument(
          fmt::format("{}without split sizes, input and output need the same number of "
                      "elements, divisible by the world size ({}); got {} and {}",
                      errorContext(rank_, op), size_, input.numel(), output.numel()));
  }
  // Split sizes count dim-0 slices; crossbar counts elements.
  auto counts = [&](const std::vector<int64_t>& splits, const at::Tensor& t, const char* which) {
    std::vector<size_t> c(size_);
    const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
    const int64_t row = rows > 0 ? t.numel() / rows : 0;
    if (splits.empty()) {
      if (rows % size_ != 0)
        throw InvalidArgument(
            fmt::format("{}{} dim 0 ({}) is not divisible by the world size ({}); pass split "
                        "sizes",
                        errorContext(rank_, op), which, rows, size_));
      for (auto& x : c) x = static_cast<size_t>(rows / size_ * row);
      return c;
    }
    if (splits.size() != static_cast<size_t>(size_))
      throw InvalidArgument(fmt::format("{}{} split sizes have {} entries, expected {}",
                                        errorContext(rank_, op), which, splits.size(), size_));
    int64_t total = 0;
    for (int i = 0; i < size_; ++i) {
      if (splits[i] < 0) throw InvalidArgument(errorContext(rank_, op) + "split sizes must not be negative");
      total += splits[i];
      c[i] = static_cast<size_t>(splits[i] * row);
    }
    if (total != rows)
      throw InvalidArgument(fmt::format("{}{} split sizes add up to {} but dim 0 is {}",
                                        errorContext(rank_, op), which, total, rows));
    return c;
  };
  std::vector<size_t> scounts = counts(input_splits, input, "input");
  std::vector<size_t> rcounts = counts(output_splits, output, "output");
  return submit(c10d::OpType::ALLTOALL_BASE, op, {output}, o.timeout, input, [&](CrossbarWork& w, Ops& ops) {
    std::vector<std::function<void()>> post;
    at::Tensor dst = outputStage(output, false, post);
    at::Tensor src = contiguousCopy(input);
    Moved m = movedType(src);
    w.keepalive = {dst, src};
    w.post = sequence(std::move(post));
    if (even) {
      w.coll = ops.alltoall(src.data_ptr(), dst.data_ptr(), elems(src) / size_ * m.scale, m.type, o);
      return;
    }
    std::vector<size_t> sd(size_), rd(size_);
    for (auto* v : {&scounts, &rcounts})
      for (auto& x : *v) x *= m.scale;
    std::exclusive_scan(scounts.begin(), scounts.end(), sd.begin(), size_t{0});
    std::exclusive_scan(rcounts.begin(), rcounts.end(), rd.begin(), size_t{0});
    w.coll = ops.alltoallv(src.data_ptr(), scounts, sd, dst.data_ptr(), rcounts, rd, m.type, o);
  });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  if (outputs.size() != static_cast<size_t>(size_) || inputs.size() != static_cast<size_t>(size_))
    throw InvalidArgument(fmt::format("{}expected {} input and output tensors (one per rank), got {} and {}",
                                      errorContext(rank_, "all_to_all"), size_, inputs.size(),
                                      outputs.size()));
  checkTensors(inputs, rank_, "all_to_all");
  checkTensors(outputs, rank_, "all_to_all");
  for (int i = 0; i < size_; ++i) {
    checkSameType(outputs[i], inputs[0], rank_, "all_to_all");
    checkSameType(inputs[i], inputs[0], rank_, "all_to_all");
  }
  CollOptions o{timeoutOf(opts.timeout), "", 1.0};
  return submit(c10d::OpType::ALLTOALL, "all_to_all", outputs, o.timeout, inputs[0], [&](CrossbarWork& w, Ops& ops) {
    Moved m = movedType(inputs[0]);
    std::vector<at::Tensor> flat_ins;
    std::vector<size_t> sc(size_), rc(size_), sd(size_), rd(size_);
    int64_t rtotal = 0;
    for (int i = 0; i < size_; ++i) {
      flat_ins.push_back(inputs[i].reshape({-1}));
      sc[i] = elems(inputs[i]) * m.scale;
      rc[i] = elems(outputs[i]) * m.scale;
      rtotal += outputs[i].numel();
    }
    at::Tensor src = at::cat(flat_ins);
    at::Tensor flat = flatLike(inputs[0], rtotal);
    std::exclusive_scan(sc.begin(), sc.end(), sd.begin(), size_t{0});
    std::exclusive_scan(rc.begin(), rc.end(), rd.begin(), size_t{0});
    w.keepalive = {src, flat};
    w.post = [outs = outputs, flat]() mutable {
      int64_t off = 0;
      for (auto& t : outs) {
        t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
        off += t.numel();
      }
    };
    w.coll = ops.alltoallv(src.data_ptr(), sc, sd, flat.data_ptr(), rc, rd, m.type, o);
  });
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::barrier(const c10d::BarrierOptions& opts) {
  CollOptions o{timeoutOf(opts.timeout), "", 1.0};
  return submit(c10d::OpType::BARRIER, "barrier", {}, o.timeout,
                at::Tensor(), [&](CrossbarWork& w, Ops& ops) { w.coll = ops.barrier(o); });
}

// ---- point to point: straight on the Communicator, so a pending recv never holds up
// collectives or other sends (gloo's semantics) ----------------------------------------------

namespace {
void checkP2p(int peer, int size, int rank, int tag, const char* op) {
  if (peer < 0 || peer >= size)
    throw InvalidArgument(
        fmt::format("{}peer {} is out of range for a group of {} ranks", errorContext(rank, op), peer, size));
  if (peer == rank)
    throw InvalidArgument(
        fmt::format("{}peer {} is this rank; copy locally instead", errorContext(rank, op), peer));
  if (tag < 0 || static_cast<uint32_t>(tag) >= kInternalTagBase)
    throw InvalidArgument(fmt::format("{}tag {} is out of range (0 <= tag < {:#x})", errorContext(rank, op),
                                      tag, kInternalTagBase));
}
}  // namespace

c10::intrusive_ptr<c10d::Work> CrossbarBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  checkSingle(tensors, rank_, "send");
  checkP2p(dst, size_, rank_, tag, "send");
  at::Tensor t = tensors[0];
  return submit(
      c10d::OpType::SEND, "send", tensors, Millis(timeout_ms_.load()),
      t, [&](CrossbarWork& w, Ops& ops) {
        at::Tensor src = contiguousCopy(t);
        w.keepalive = {src};
        if (ops.onCuda()) {
          Moved m = movedType(src);
          if (P2pAnnouncer::announces(tag)) w.requests.push_back(announcer_->announceSend(dst, tag, src.nbytes()));
          if (ops.staged) {
            stagedSend(w, src, dst, static_cast<uint32_t>(tag), ops.stream);
            return;
          }
          w.coll = ops.send(src.data_ptr(), elems(src) * m.scale, m.type, dst, static_cast<uint32_t>(tag),
                            CollOptions{Millis(timeout_ms_.load()), "", 1.0});
          return;
        }
        w.requests.push_back(comm_->isend(src.data_ptr(), src.nbytes(), dst, static_cast<uint32_t>(tag)));
      },
      true);
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  checkSingle(tensors, rank_, "recv");
  checkP2p(src, size_, rank_, tag, "recv");
  return recvFrom(tensors, src, tag, false);
}

// `announced`: a CUDA receive whose sender's announcement was taken already (from any source).
c10::intrusive_ptr<c10d::Work> CrossbarBackend::recvFrom(std::vector<at::Tensor>& tensors, int src, int tag,
                                                         bool announced) {
  at::Tensor t = tensors[0];
  return submit(
      announced ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV, announced ? "recv_anysource" : "recv", tensors,
      Millis(timeout_ms_.load()), t, [&](CrossbarWork& w, Ops& ops) {
        std::vector<std::function<void()>> post;
        at::Tensor dst = outputStage(t, false, post);
        w.source_rank_ = src;
        if (ops.onCuda()) {  // NCCL matches in order; it cannot check the size (the announcement does)
          Moved m = movedType(dst);
          w.keepalive = {dst};
          if (!announced && P2pAnnouncer::announces(tag))
            w.requests.push_back(announcer_->expectFrom(src, tag, dst.nbytes()));
          if (ops.staged) {
            stagedRecv(w, dst, src, static_cast<uint32_t>(tag), sequence(std::move(post)));
            return;
          }
          w.coll = ops.recv(dst.data_ptr(), elems(dst) * m.scale, m.type, src, static_cast<uint32_t>(tag),
                            CollOptions{Millis(timeout_ms_.load()), "", 1.0});
          w.post = sequence(std::move(post));
          return;
        }
        const size_t bytes = dst.nbytes();
        auto req = comm_->irecv(dst.data_ptr(), bytes, src, static_cast<uint32_t>(tag));
        post.insert(post.begin(), [req, bytes, src, rank = rank_] {
          if (req->status().bytes != bytes)
            throw InvalidUsage(fmt::format("{}rank {} sent {} bytes, expected {}; do the tensor sizes match?",
                                           errorContext(rank, "recv"), src, req->status().bytes, bytes),
                               {src});
        });
        w.keepalive = {dst};
        w.requests.push_back(req);
        w.post = sequence(std::move(post));
      },
      true);
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  checkSingle(tensors, rank_, "recv");
  if (size_ < 2)
    throw InvalidUsage(errorContext(rank_, "recv") + "a group of one rank has nobody to receive from");
  checkP2p(rank_ == 0 ? 1 : 0, size_, rank_, tag, "recv");  // the tag's range
  at::Tensor t = tensors[0];
#if CROSSBAR_TORCH_CUDA
  if (t.is_cuda()) {
    // NCCL matches by peer: the host learns the sender from its announcement first
    // (blocking until some rank sent one, see p2p_announce.h), then the receive from that
    // rank goes on the current stream like any CUDA recv.
    if (!P2pAnnouncer::announces(tag))
      throw InvalidArgument(fmt::format("{}a CUDA tensor from any source needs a tag below {} (got {})",
                                        errorContext(rank_, "recv"), P2pAnnouncer::kTagLimit, tag));
    if (coalescing_)
      throw InvalidUsage(errorContext(rank_, "recv") +
                         "a CUDA receive from any source cannot be part of a coalescing block "
                         "(batch_isend_irecv): its sender must be known when the block launches; pass src=");
    ensureUsable("recv");
    ensureCuda(t.device().index(), "recv");
    const int src = announcer_->awaitAnySource(tag, t.nbytes(), Deadline::after(Millis(timeout_ms_.load())));
    return recvFrom(tensors, src, tag, true);
  }
#endif
  return submit(
      c10d::OpType::RECVANYSOURCE, "recv_anysource", tensors, Millis(timeout_ms_.load()),
      t, [&](CrossbarWork& w, Ops& /*host only*/) {
        std::vector<std::function<void()>> post;
        at::Tensor dst = outputStage(t, false, post);
        const size_t bytes = dst.nbytes();
        auto req = comm_->irecv(dst.data_ptr(), bytes, kAnySource, static_cast<uint32_t>(tag));
        // torch asks the Work who sent it (Work::sourceRank) once it completed.
        post.insert(post.begin(), [req, bytes, work = &w, rank = rank_] {
          const Status& st = req->status();
          if (st.bytes != bytes)
            throw InvalidUsage(fmt::format("{}rank {} sent {} bytes, expected {}; do the tensor sizes match?",
                                           errorContext(rank, "recv"), st.source, st.bytes, bytes),
                               {st.source});
          work->source_rank_ = st.source;
        });
        w.keepalive = {dst};
        w.requests.push_back(req);
        w.post = sequence(std::move(post));
      },
      true);
}

// ---- coalescing: collectives go into one crossbar group; point to point is already
// nonblocking, so the coalesced Work just waits for all of it --------------------------------

void CrossbarBackend::startCoalescing() {
  ensureUsable("start_coalescing");
  if (coalescing_)
    throw InvalidUsage(errorContext(rank_, "start_coalescing") +
                       "already coalescing; end the open batch first");
  coll_->groupStart();
  coalescing_ = true;
  coalesced_kind_ = 0;
  coalesced_ = c10::make_intrusive<CrossbarWork>(rank_, c10d::OpType::COALESCED, nullptr,
                                                 std::vector<at::Tensor>{}, Millis(timeout_ms_.load()));
}

c10::intrusive_ptr<c10d::Work> CrossbarBackend::endCoalescing() {
  if (!coalescing_)
    throw InvalidUsage(errorContext(rank_, "end_coalescing") + "end_coalescing without start_coalescing");
  coalescing_ = false;
  c10::intrusive_ptr<CrossbarWork> w = std::move(coalesced_);
  WorkPtr group = coll_->groupEnd();
  const int kind = std::exchange(coalesced_kind_, 0);
#if CROSSBAR_TORCH_CUDA
  if (kind == 2) {
    // CUDA tensors: launch the block's NCCL group, then mark every part's end on the
    // stream (after the launch) and the block's own.
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(cuda_device_));
    WorkPtr cuda_group = cuda_group_open_ ? cuda_->groupEnd() : nullptr;
    cuda_group_open_ = false;
    cudaStream_t stream = currentStream(cuda_device_);
    auto block = c10::make_intrusive<CrossbarWork>(
        rank_, c10d::OpType::COALESCED, nullptr, std::vector<at::Tensor>{}, Millis(timeout_ms_.load()),
        std::vector<c10::Device>{c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(cuda_device_))});
    block->coll = cuda_group;
    for (auto& c : w->children) {
      if (c->staged)
        launchStaged(c, stream);
      else
        enqueuedOnCuda(c, stream);
    }
    enqueuedOnCuda(block, stream);
    return block;
  }
#endif
  (void)kind;
  bool has_coll = false;
  std::vector<std::function<void()>> posts;
  for (auto& c : w->children) {
    if (c->coll) has_coll = true;
    w->requests.insert(w->requests.end(), c->requests.begin(), c->requests.end());
    if (c->post) posts.push_back(std::exchange(c->post, nullptr));
    w->keepalive.insert(w->keepalive.end(), c->keepalive.begin(), c->keepalive.end());
    c->coll = group;
  }
  w->coll = group;
  w->post = sequence(std::move(posts));
  {
    std::lock_guard<std::mutex> lk(m_);
    if (has_coll || w->requests.empty()) {
      w->queued_at = Clock::now();
      w->bell = coll_bell_;
      coll_pending_.push_back(w);
    } else {
      // Only point to point: the (empty) crossbar group needs no waiting.
      p2p_incoming_.push_back(w);
      p2p_new_ = true;
    }
  }
  coll_bell_->ring();
  p2p_bell_->ring();
  return w;
}

}  // namespace crossbar::torch_backend
