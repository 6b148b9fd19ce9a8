// CudaCollectives: selection, the internal stream, the symmetric-heap algorithms and
// the NCCL path. See cuda_collectives.h for the model.
//
// Heap protocol. Every rank owns one staging buffer of the CUDA symmetric heap (signal
// channel 0 of it carries every barrier). A rank's contribution to an operation is a
// "region": its staging (the input copied in) or, when the user buffer already lies in
// a buffer from allocateSymmetric(), that buffer at the same offset on every rank.
// Each operation keeps this invariant: between operations no rank touches another
// rank's memory, and every remote access of an operation happens after a barrier that
// follows the owner's local writes. So an operation is: local copy-in, barrier, remote
// reads (kernel or copy engine) / remote writes, then either an exit barrier or, when
// only local work follows a barrier after the last remote access, nothing. Barriers
// are stream memory operations (write a peer's pad slot, wait on ours) between
// launches: the GPU never spins inside a kernel on another process's progress.
#include "collectives/cuda/cuda_collectives.h"

#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>

#include "collectives/algorithms.h"
#include "collectives/cuda/op_timing.h"
#include "collectives/cuda/reduce_kernels.h"
#include "collectives/float_types.h"
#include "collectives/reduce.h"
#include "collectives/selection.h"
#include "collectives/signature.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"
#include "symmem/cuda/copy_engine_cuda.h"
#include "symmem/cuda/cuda_segment_allocator.h"
#include "symmem/cuda/cuda_symmetric.h"
#include "symmem/cuda/device_handle.h"
#include "symmem/cuda/driver_api.h"
#include "symmem/cuda/nccl_window.h"
#include "telemetry/telemetry.h"

namespace crossbar {

namespace {

constexpr int kBarrierChannel = 0;
constexpr size_t kStageAlign = 256;
constexpr size_t kMinStageBytes = 1 << 20;
static_assert(cudacoll::kMaxReduceInputs == cuda::kMaxLocalRanks);

size_t alignUp(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}

// Keeps the caller's current device across a call that needs ours.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      cudaGetLastError();
      prev_ = -1;
    }
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (prev_ >= 0) {
      int cur = -1;
      if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

ncclDataType_t ncclType(DataType t) {
  switch (t) {
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kFloat8E4M3:
      return ncclFloat8e4m3;
    case DataType::kFloat8E5M2:
      return ncclFloat8e5m2;
    case DataType::kInt8:
      return ncclInt8;
    case DataType::kUInt8:
      return ncclUint8;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kUInt32:
      return ncclUint32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kUInt64:
      return ncclUint64;
  }
  throw InvalidArgument(fmt::format("unknown DataType {}", static_cast<int>(t)));
}

// Telemetry of the operations on the internal stream (op_timing.h). Each recorded
// operation takes a slot of four pooled events (start, wait begin/end, end; timing
// events, created once per slot on first use, so never while telemetry is off); the
// record is pushed once the end event has completed, by whoever calls resolve() next:
// the next operation, its Work's completion, Recorder::step(). Event times become host
// times through an anchor event recorded on the idle internal stream together with the
// host clock (renewed every second when the stream is idle: cudaEventElapsedTime is a
// float of ms). Its own mutex: Work completion and step() must not wait for Impl::m,
// which a call holds while it waits on peers on the host.
class OpTimer {
 public:
  static constexpr size_t kSlots = 256;
  static constexpr int64_t kReanchorNs = 1'000'000'000;

  OpTimer(int device, cudaStream_t stream) : device_(device), stream_(stream), slots_(kSlots) {}
  ~OpTimer() {
    for (Slot& s : slots_)
      for (cudaEvent_t e : s.ev)
        if (e) cudaEventDestroy(e);
    if (anchor_) cudaEventDestroy(anchor_);
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // Starts timing an operation whose work is enqueued next on the internal stream.
  // `stream_was_idle`: the internal stream had nothing pending before this call's
  // first enqueue (so an anchor recorded now runs now). -1: not recorded (counted).
  int begin(const cudacoll::PendingOp& op, bool stream_was_idle) {
    std::lock_guard<std::mutex> lk(m_);
    resolveLocked();
    const int64_t now = telemetry::nowNs();
    if (!anchor_ || (stream_was_idle && ring_.size() == 0 && now - anchor_host_ns_ > kReanchorNs)) {
      // Only with no operation pending: their times are relative to the current anchor.
      if (!anchor_ && !ok(cudaEventCreateWithFlags(&anchor_, cudaEventDefault))) return dropped();
      if (!ok(cudaEventRecord(anchor_, stream_))) return dropped();
      anchor_host_ns_ = telemetry::nowNs();
    }
    const int slot = ring_.push(op);
    if (slot < 0) return dropped();  // kSlots operations still running on the GPU
    Slot& s = slots_[slot];
    for (cudaEvent_t& e : s.ev)
      if (!e && !ok(cudaEventCreateWithFlags(&e, cudaEventDefault))) return cancel(slot);
    if (!ok(cudaEventRecord(s.ev[kStart], stream_))) return cancel(slot);
    return slot;
  }
  // Around the stream's waits for the peers' signals (the operation's first barrier).
  void waitBegin(int slot) { record(slot, kWaitBegin); }
  void waitEnd(int slot) {
    if (record(slot, kWaitEnd)) {
      std::lock_guard<std::mutex> lk(m_);
      ring_.at(slot).has_wait = true;
    }
  }
  // The operation is fully enqueued: its record becomes resolvable.
  void end(int slot, const cudacoll::PendingOp* final_op = nullptr) {
    std::lock_guard<std::mutex> lk(m_);
    if (final_op) {
      const bool has_wait = ring_.at(slot).has_wait;
      ring_.at(slot) = *final_op;
      ring_.at(slot).has_wait = has_wait;
    }
    if (!ok(cudaEventRecord(slots_[slot].ev[kEnd], stream_))) {
      cancel(slot);
      return;
    }
    ring_.close(slot);
  }
  // The operation failed while being enqueued (the newest slot).
  int cancel(int slot) {
    (void)slot;
    ring_.cancelNewest();
    return dropped();
  }
  cudacoll::PendingOp pending(int slot) {
    std::lock_guard<std::mutex> lk(m_);
    return ring_.at(slot);
  }
  // The same, from outside (the call that began it failed afterwards).
  void abandon(int slot) {
    std::lock_guard<std::mutex> lk(m_);
    cancel(slot);
  }

  // Pushes the records of the finished operations; never blocks on the GPU.
  void resolve() {
    std::lock_guard<std::mutex> lk(m_);
    resolveLocked();
  }

 private:
  enum { kStart = 0, kWaitBegin = 1, kWaitEnd = 2, kEnd = 3 };
  struct Slot {
    cudaEvent_t ev[4] = {};
  };

  bool record(int slot, int which) { return ok(cudaEventRecord(slots_[slot].ev[which], stream_)); }
  int dropped() {
    telemetry::Recorder::instance().countDropped(1);
    return -1;
  }
  // Telemetry never fails an operation: a failing event call (a broken context, which
  // the operation itself reports) only loses the record.
  static bool ok(cudaError_t e) { return e == cudaSuccess; }

  void resolveLocked() {
    if (ring_.size() == 0) return;
    DeviceGuard guard(device_);
    ring_.resolve(
        [&](int slot, cudacoll::OpTimes* t) {
          const Slot& s = slots_[slot];
          const cudaError_t q = cudaEventQuery(s.ev[kEnd]);
          if (q == cudaErrorNotReady) return cudacoll::Probe::kPending;
          float a2s = 0, s2e = 0, w = 0;
          if (q != cudaSuccess || cudaEventElapsedTime(&a2s, anchor_, s.ev[kStart]) != cudaSuccess ||
              cudaEventElapsedTime(&s2e, s.ev[kStart], s.ev[kEnd]) != cudaSuccess)
            return cudacoll::Probe::kFailed;
          if (ring_.at(slot).has_wait &&
              cudaEventElapsedTime(&w, s.ev[kWaitBegin], s.ev[kWaitEnd]) != cudaSuccess)
            w = 0;
          *t = cudacoll::eventTimesToHost(anchor_host_ns_, a2s, s2e, w, ring_.at(slot).enqueue_ns);
          return cudacoll::Probe::kDone;
        },
        [&](const cudacoll::PendingOp& op, const cudacoll::OpTimes& t) {
          // The peer that arrived last is not known on the GPU path (-1).
          telemetry::Recorder::instance().recordOp(op.name, op.bytes, op.algo, op.op_seq, op.enqueue_ns,
                                                   t.start_ns, t.end_ns, t.wait_ns, -1);
        });
  }

  std::mutex m_;
  const int device_;
  const cudaStream_t stream_;
  std::vector<Slot> slots_;
  cudacoll::PendingOpRing ring_{kSlots};
  cudaEvent_t anchor_ = nullptr;
  int64_t anchor_host_ns_ = 0;
};

// The work of one call (or group): an event recorded on the internal stream after it.
class CudaWork final : public Work {
 public:
  CudaWork(std::string desc, int rank, int device, std::shared_ptr<cuda::NcclCommHolder> nccl)
      : desc_(std::move(desc)), rank_(rank), device_(device), nccl_(std::move(nccl)) {}
  ~CudaWork() override {
    if (event_) cudaEventDestroy(event_);  // deferred by CUDA until the event completes
  }

  // Records completion of everything enqueued so far on `stream`.
  void arm(cudaStream_t stream) {
    std::lock_guard<std::mutex> lk(m_);
    cuda::checkCuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate", device_);
    cuda::checkCuda(cudaEventRecord(event_, stream), "cudaEventRecord", device_);
  }
  cudaEvent_t event() const { return event_; }
  void setNccl(std::shared_ptr<cuda::NcclCommHolder> n) {
    std::lock_guard<std::mutex> lk(m_);
    nccl_ = std::move(n);
  }
  void setDescription(std::string d) { desc_ = std::move(d); }
  // Telemetry: resolve the pending records when this work completes.
  void setTimer(std::weak_ptr<OpTimer> t) {
    std::lock_guard<std::mutex> lk(m_);
    timer_ = std::move(t);
  }

  bool test() override {
    std::weak_ptr<OpTimer> timer;
    {
      std::lock_guard<std::mutex> lk(m_);
      if (!pollLocked()) return false;
      timer.swap(timer_);  // once
    }
    if (auto t = timer.lock()) t->resolve();
    return true;
  }

  bool hasFinished() override {
    std::lock_guard<std::mutex> lk(m_);
    return pollLocked();
  }

  void wait(Deadline deadline) override {
    auto sleep = std::chrono::microseconds(0);
    for (int polls = 0;; ++polls) {
      {
        std::unique_lock<std::mutex> lk(m_);
        if (pollLocked()) {
          std::weak_ptr<OpTimer> timer;
          timer.swap(timer_);
          lk.unlock();
          if (auto t = timer.lock()) t->resolve();
          return;
        }
      }
      if (deadline.expired()) {
        auto e = std::make_exception_ptr(Timeout(fmt::format(
            "{}{} did not complete on GPU {} before the deadline. Its stream may wait for a peer that "
            "did not issue the same operation (or died), or the GPU is hung. The GPU work cannot be "
            "cancelled: abort the communicator and create a new one",
            errorContext(rank_, "wait"), desc_, device_)));
        std::rethrow_exception(e);
      }
      if (polls < 200) continue;
      sleep = std::min(std::chrono::microseconds(1000), sleep + std::chrono::microseconds(20));
      std::this_thread::sleep_for(sleep);
    }
  }

  std::exception_ptr error() const override {
    std::lock_guard<std::mutex> lk(m_);
    return err_;
  }
  const std::string& description() const override { return desc_; }

 private:
  bool pollLocked() {
    if (err_) std::rethrow_exception(err_);
    if (done_) return true;
    if (!event_)
      throw InvalidUsage(errorContext(rank_, desc_) +
                         "the operation is inside groupStart() and not launched yet; call groupEnd() first");
    try {
      if (nccl_) nccl_->checkAsync(desc_);
      cudaError_t e = cudaEventQuery(event_);
      if (e == cudaErrorNotReady) return false;
      cuda::checkCuda(e, fmt::format("{}: cudaEventQuery", desc_), device_,
                      "a kernel or copy of this operation faulted; the CUDA context is unusable");
    } catch (...) {
      err_ = std::current_exception();
      throw;
    }
    done_ = true;
    return true;
  }

  mutable std::mutex m_;
  std::string desc_;
  int rank_, device_;
  std::shared_ptr<cuda::NcclCommHolder> nccl_;
  cudaEvent_t event_ = nullptr;
  std::weak_ptr<OpTimer> timer_;
  bool done_ = false;
  std::exception_ptr err_;
};

// Where a rank's contribution lives: the same buffer and offset on every rank.
// Where a rank's contribution lives: the same buffer and offset on every rank, seen
// through the buffer's device handle (every peer's mapping in this process).
struct Region {
  Region() = default;
  Region(symm::SymmetricBuffer* b, size_t off) : buf(b), offset(off), handle(cuda::makeDeviceHandle(*b)) {}
  symm::SymmetricBuffer* buf = nullptr;
  size_t offset = 0;
  cuda::SymmDeviceHandle handle{};
  const char* at(int rank, size_t byte_offset = 0) const {
    return handle.peer<char>(rank, offset + byte_offset);
  }
};

}  // namespace

struct CudaCollectives::Impl {
  std::shared_ptr<Communicator> comm;  // the user's
  std::shared_ptr<Communicator> ctl;   // dup: heap, NCCL and host exchanges (own tag space)
  CudaCollectivesOptions opt;
  int device = -1;
  std::mutex m;
  AlgoOverride env_override;
  std::unique_ptr<cuda::CudaCopyEngine> ce;  // its stream is the internal stream
  cudaStream_t stream = nullptr;
  cudaEvent_t join = nullptr;  // caller's stream -> internal stream
  symm::SymmetricHeap heap;
  std::string heap_reason;  // "" when the heap algorithms are usable
  std::shared_ptr<symm::SymmetricBuffer> stage;
  std::vector<std::weak_ptr<symm::SymmetricBuffer>> user_bufs;
  std::shared_ptr<cuda::NcclCommHolder> nccl;
  std::string nccl_error;  // creation failed once: every later NCCL call fails the same way
  std::vector<std::pair<std::weak_ptr<symm::SymmetricBuffer>, cuda::NcclWindow>> windows;
  void* nccl_scratch = nullptr;  // barrier via NCCL
  // Mismatched calls (CROSSBAR_CHECK_CALLS): compared on the host before anything is
  // enqueued; also numbers the collectives (point-to-point calls take no number).
  EnqueueCallCheck calls{callCheckModeFromEnv()};
  uint64_t coll_seq = 0;  // the current collective's number (alltoallv exchange tags)
  std::string sticky;  // an enqueue failed half-way: the peers' state is unknown
  int group_depth = 0;
  std::shared_ptr<CudaWork> group_work;
  bool group_nccl_open = false;
  std::vector<std::string> group_ops;
  std::vector<cudaStream_t> group_streams;  // callers' streams, joined at groupEnd()
  // Telemetry (created on the first operation issued with telemetry on).
  std::shared_ptr<OpTimer> timer;
  int tel_slot = -1;        // the group's slot while a group is open
  int tel_wait_slot = -1;   // the slot whose wait the next barrier() times
  size_t group_timed_ops = 0;
  bool group_wait_timed = false;  // the group's first barrier has been timed
  uint64_t group_bytes = 0;

  int rank() const { return comm->rank(); }
  int size() const { return comm->size(); }
  Millis timeout(const CollOptions& o) const {
    if (o.timeout.count() > 0) return o.timeout;
    return opt.timeout.count() > 0 ? opt.timeout : comm->timeout();
  }
  std::string ctx(const std::string& op) const { return errorContext(rank(), op); }

  WorkPtr run(CollArgs a, cudaStream_t user, const CollOptions& o);
  void execute(const CollArgs& a, const Algorithm& algo, const std::string& desc);
  // heap helpers
  void ensureStage(size_t bytes, Deadline deadline);
  void barrier();
  Region contribution(const void* ptr, size_t bytes, bool force_stage);
  bool outputHitsInput(const void* out, size_t out_bytes, const Region& in, size_t in_bytes) const;
  symm::SymmetricBuffer* findUserBuffer(const void* ptr, size_t bytes, size_t* offset);
  void copies(const std::vector<cuda::CopyOp>& ops);
  void localCopy(void* dst, const void* src, size_t bytes);
  // algorithms
  void allreduceHeap(const CollArgs& a, bool twoshot);
  void reduceScatterHeap(const CollArgs& a);
  void reduceHeap(const CollArgs& a);
  void allgatherHeap(const CollArgs& a);
  void alltoallHeap(const CollArgs& a);
  size_t exchangeAlltoallv(const CollArgs& a, Deadline deadline);
  void alltoallvHeap(const CollArgs& a);
  std::vector<uint64_t> a2av_rows;  // exchangeAlltoallv() of the current call
  void broadcastHeap(const CollArgs& a);
  void gatherHeap(const CollArgs& a);
  void scatterHeap(const CollArgs& a);
  void runNccl(const CollArgs& a, const std::string& desc);
  void ensureNccl(const std::string& desc);
  void registerWindow(const std::shared_ptr<symm::SymmetricBuffer>& buf);
  size_t stageNeed(const CollArgs& a, bool twoshot) const;
};

// ---- construction ----------------------------------------------------------------------

CudaCollectives::CudaCollectives(std::shared_ptr<Communicator> comm, CudaCollectivesOptions options)
    : impl_(new Impl) {
  if (!comm) throw InvalidArgument("CudaCollectives: the communicator is null");
  Impl& x = *impl_;
  x.comm = comm;
  x.opt = options;
  const std::string op = "CudaCollectives";
  if (!cuda::driverAvailable())
    throw Unsupported(x.ctx(op) + "no usable CUDA driver/device: " + cuda::driverUnavailableReason() +
                      ". Use the host Collectives for host memory");
  x.device = options.device;
  if (x.device < 0) cuda::checkCuda(cudaGetDevice(&x.device), "CudaCollectives: cudaGetDevice", -1);
  cuda::ensureContext(x.device, op);
  DeviceGuard guard(x.device);
  x.env_override = parseAlgoOverride(env::getString("CROSSBAR_ALGO"));
  x.ctl = comm->dup();  // collective
  x.ce = std::make_unique<cuda::CudaCopyEngine>(x.device);
  x.stream = x.ce->stream();
  cuda::checkCuda(cudaEventCreateWithFlags(&x.join, cudaEventDisableTiming), "cudaEventCreate", x.device);

  // The heap: one node of at most kMaxLocalRanks ranks (the same answer on every rank).
  if (!options.symmetric_heap) {
    x.heap_reason = "disabled by CudaCollectivesOptions::symmetric_heap";
  } else if (comm->numNodes() != 1) {
    x.heap_reason =
        fmt::format("{} nodes (peers' GPU memory is only mapped within a node)", comm->numNodes());
  } else if (comm->size() > cuda::kMaxLocalRanks) {
    x.heap_reason = fmt::format("{} ranks (at most {} on the heap)", comm->size(), cuda::kMaxLocalRanks);
  }
  if (x.heap_reason.empty()) {
    // Collective; a rank that cannot create it fails the creation on every rank (the
    // heap's own exchange reports it), so all agree.
    symm::HeapOptions ho;
    ho.channels = 1;
    ho.allocator = cuda::makeCudaSegmentAllocator(x.device);
    ho.name = "cudacoll";
    ho.remote_access = false;
    x.heap = symm::SymmetricHeap::create(x.ctl, ho);
    x.stage = x.heap.allocate(std::max(kMinStageBytes, alignUp(options.initial_staging_bytes, kStageAlign)));
  }
  CB_INFO("coll", "{}: CudaCollectives on device {} ({}; heap {})", comm->name(), x.device, comm->describe(),
          x.heap_reason.empty() ? "on" : "off: " + x.heap_reason);
}

CudaCollectives::~CudaCollectives() {
  Impl& x = *impl_;
  DeviceGuard guard(x.device);
  // Finish this object's work (bounded) before its buffers and stream go away.
  if (x.stream) {
    const Deadline d = Deadline::after(std::min<Millis>(x.comm->timeout(), Millis(30'000)));
    while (cudaStreamQuery(x.stream) == cudaErrorNotReady && !d.expired())
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (cudaStreamQuery(x.stream) == cudaErrorNotReady)
      CB_WARN("coll", "{}CudaCollectives destroyed with GPU work still pending (a peer missing?)",
              x.ctx("~CudaCollectives"));
    cudaGetLastError();
  }
  if (x.timer) {
    telemetry::Recorder::instance().removeFlushHook(&x);
    x.timer->resolve();  // the stream is drained: every pending record is final
  }
  x.windows.clear();
  if (x.nccl_scratch) cudaFree(x.nccl_scratch);
  if (x.stage && !x.stage->freed()) {
    try {
      x.stage->free();
    } catch (const std::exception& e) {
      CB_WARN("coll", "{}freeing the staging buffer: {}", x.ctx("~CudaCollectives"), e.what());
    }
  }
  if (x.join) cudaEventDestroy(x.join);
  x.ce.reset();
}

Communicator& CudaCollectives::comm() const {
  return *impl_->comm;
}
int CudaCollectives::device() const {
  return impl_->device;
}
const std::string& CudaCollectives::heapUnavailableReason() const {
  return impl_->heap_reason;
}
bool CudaCollectives::ncclCreated() const {
  std::lock_guard<std::mutex> lk(impl_->m);
  return impl_->nccl != nullptr;
}

std::shared_ptr<symm::SymmetricBuffer> CudaCollectives::allocateSymmetric(size_t bytes) {
  Impl& x = *impl_;
  std::lock_guard<std::mutex> lk(x.m);
  if (!x.heap_reason.empty())
    throw Unsupported(x.ctx("allocateSymmetric") + "no CUDA symmetric heap here: " + x.heap_reason);
  DeviceGuard guard(x.device);
  auto buf = x.heap.allocate(bytes);
  x.user_bufs.push_back(buf);
  if (x.nccl) x.registerWindow(buf);
  return buf;
}

// ---- heap helpers -----------------------------------------------------------------------

void CudaCollectives::Impl::ensureStage(size_t bytes, Deadline deadline) {
  if (stage->size() >= bytes) return;
  // Every rank grows at the same call (the need depends on arguments equal everywhere).
  // Peers may still read our old staging in work already enqueued: drain our stream,
  // then agree that every rank did, before releasing it.
  const size_t grown = alignUp(std::max(bytes, 2 * stage->size()), 2 << 20);
  while (true) {
    cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) cuda::checkCuda(e, "growing the staging: cudaStreamQuery", device);
    if (deadline.expired())
      throw Timeout(ctx("staging") +
                    "earlier operations did not complete on the GPU before the deadline "
                    "(a peer missing?); cannot grow the staging buffer");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  ctl->barrier(deadline);
  stage->free(deadline);
  stage = heap.allocate(grown);
  CB_INFO("coll", "{}: CUDA staging grown to {} bytes per rank", comm->name(), grown);
}

void CudaCollectives::Impl::barrier() {
  for (int p = 0; p < size(); ++p)
    if (p != rank()) cuda::streamPutSignal(*stage, p, kBarrierChannel, stream);
  // Telemetry: the first barrier of an operation is where the stream waits for the
  // peers to arrive; events around its waits give the wait time (not who came last).
  const int timed = std::exchange(tel_wait_slot, -1);
  if (timed >= 0) timer->waitBegin(timed);
  for (int p = 0; p < size(); ++p)
    if (p != rank()) cuda::streamWaitSignal(*stage, p, kBarrierChannel, stream);
  if (timed >= 0) timer->waitEnd(timed);
}

symm::SymmetricBuffer* CudaCollectives::Impl::findUserBuffer(const void* ptr, size_t bytes, size_t* offset) {
  auto p = reinterpret_cast<uintptr_t>(ptr);
  for (auto it = user_bufs.begin(); it != user_bufs.end();) {
    auto buf = it->lock();
    if (!buf || buf->freed()) {
      it = user_bufs.erase(it);
      continue;
    }
    auto base = reinterpret_cast<uintptr_t>(buf->localPtr());
    if (p >= base && p - base <= buf->size() && bytes <= buf->size() - (p - base)) {
      *offset = p - base;
      return buf.get();  // kept alive by the caller's shared_ptr for the operation's duration
    }
    ++it;
  }
  return nullptr;
}

void CudaCollectives::Impl::localCopy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  cuda::CopyOp op{src, dst, bytes};
  ce->enqueue({&op, 1});
}

void CudaCollectives::Impl::copies(const std::vector<cuda::CopyOp>& ops) {
  if (!ops.empty()) ce->enqueue(ops);
}

// The rank's input as peers will read it: in place when it lies in a symmetric
// buffer (same buffer and offset on every rank, like NCCL symmetric windows), else
// copied into the staging at offset 0. Peers address our input the way they decided
// for theirs, so the decision may depend only on that contract, never on anything
// that can differ between ranks (in place or not, root or not).
// Whether this rank's output [out, out+bytes) overlaps its own input region that peers
// read in place (a symmetric buffer used in place): then results go through the staging.
bool CudaCollectives::Impl::outputHitsInput(const void* out, size_t out_bytes, const Region& in,
                                            size_t in_bytes) const {
  if (in.buf == stage.get() || !out) return false;
  auto o = reinterpret_cast<uintptr_t>(out), i = reinterpret_cast<uintptr_t>(in.at(rank()));
  return o < i + in_bytes && i < o + out_bytes;
}

Region CudaCollectives::Impl::contribution(const void* ptr, size_t bytes, bool force_stage) {
  size_t off = 0;
  if (!force_stage && ptr)
    if (symm::SymmetricBuffer* b = findUserBuffer(ptr, bytes, &off)) return Region(b, off);
  if (ptr) localCopy(stage->localPtr(), ptr, bytes);
  return Region(stage.get(), 0);
}

size_t CudaCollectives::Impl::stageNeed(const CollArgs& a, bool twoshot) const {
  const size_t es = elementSize(a.type), blk = a.count * es, all = blk * size();
  switch (a.coll) {
    case CollType::kAllreduce:
      return twoshot ? alignUp(blk, kStageAlign) + blk : blk;
    case CollType::kReduceScatter:
    case CollType::kAlltoall:
    case CollType::kScatter:
      return all;
    default:
      return blk;
  }
}

// ---- heap algorithms ---------------------------------------------------------------------

void CudaCollectives::Impl::allreduceHeap(const CollArgs& a, bool twoshot) {
  const int n = size(), me = rank();
  const size_t es = elementSize(a.type), blk = a.count * es;
  Region in = contribution(a.send, blk, false);
  barrier();
  cudacoll::ReduceLaunch l;
  l.type = a.type;
  l.op = a.op;
  l.premul_scalar = a.premul_scalar;
  l.num_inputs = n;
  if (!twoshot) {
    // In place on a symmetric buffer, peers still read what we would overwrite: reduce
    // into the staging and copy out after the exit barrier.
    const bool via_stage = outputHitsInput(a.recv, blk, in, blk);
    for (int r = 0; r < n; ++r) l.inputs[r] = in.at(r);
    l.outputs[0] = via_stage ? stage->localPtr() : a.recv;
    l.num_outputs = 1;
    l.count = a.count;
    cudacoll::launchReduce(l, stream, device);
    barrier();  // peers have read our input before anyone reuses it
    if (via_stage) localCopy(a.recv, stage->localPtr(), blk);
    return;
  }
  // Two-shot: rank r reduces elements [lo, hi) and writes them into every rank's
  // staging at `out`; after a barrier each rank copies the whole result out.
  const size_t out = alignUp(blk, kStageAlign);
  const cuda::SymmDeviceHandle stage_handle = cuda::makeDeviceHandle(*stage);
  const size_t per = (a.count + n - 1) / n;
  const size_t lo = std::min(a.count, per * me), hi = std::min(a.count, lo + per);
  for (int r = 0; r < n; ++r) {
    l.inputs[r] = in.at(r, lo * es);
    l.outputs[r] = stage_handle.peer<char>(r, out + lo * es);
  }
  l.num_outputs = n;
  l.count = hi - lo;
  cudacoll::launchReduce(l, stream, device);
  barrier();  // every block is written everywhere, every input read
  localCopy(a.recv, stage->local<char>(out), blk);
}

void CudaCollectives::Impl::reduceScatterHeap(const CollArgs& a) {
  const int n = size(), me = rank();
  const size_t blk = a.count * elementSize(a.type);
  Region in = contribution(a.send, blk * n, false);
  barrier();
  cudacoll::ReduceLaunch l;
  l.type = a.type;
  l.op = a.op;
  l.premul_scalar = a.premul_scalar;
  l.num_inputs = n;
  for (int r = 0; r < n; ++r) l.inputs[r] = in.at(r, me * blk);
  l.outputs[0] = a.recv;
  l.num_outputs = 1;
  l.count = a.count;
  cudacoll::launchReduce(l, stream, device);
  barrier();
}

void CudaCollectives::Impl::reduceHeap(const CollArgs& a) {
  const int n = size();
  const size_t blk = a.count * elementSize(a.type);
  // Only the root reads (its own input too, element by element): in place is safe.
  Region in = contribution(a.send, blk, false);
  barrier();
  if (rank() == a.root) {
    cudacoll::ReduceLaunch l;
    l.type = a.type;
    l.op = a.op;
    l.premul_scalar = a.premul_scalar;
    l.num_inputs = n;
    for (int r = 0; r < n; ++r) l.inputs[r] = in.at(r);
    l.outputs[0] = a.recv;
    l.num_outputs = 1;
    l.count = a.count;
    cudacoll::launchReduce(l, stream, device);
  }
  barrier();
}

void CudaCollectives::Impl::allgatherHeap(const CollArgs& a) {
  const int n = size(), me = rank();
  const size_t blk = a.count * elementSize(a.type);
  char* recv = static_cast<char*>(a.recv);
  Region in = contribution(a.send, blk, false);
  barrier();
  std::vector<cuda::CopyOp> ops;
  for (int r = 0; r < n; ++r)
    ops.push_back(
        {r == me ? a.send : in.at(r), recv + r * blk, r == me && a.send == recv + me * blk ? 0 : blk});
  copies(ops);
  barrier();
}

void CudaCollectives::Impl::alltoallHeap(const CollArgs& a) {
  const int n = size(), me = rank();
  const size_t blk = a.count * elementSize(a.type);
  char* recv = static_cast<char*>(a.recv);
  Region in = contribution(a.send, blk * n, false);
  // In place on a symmetric buffer, peers read what we overwrite: land in the staging
  // (unused by the input then) and copy out after the exit barrier.
  const bool via_stage = outputHitsInput(recv, blk * n, in, blk * n);
  char* dst = via_stage ? stage->local<char>() : recv;
  barrier();
  std::vector<cuda::CopyOp> ops;
  for (int r = 0; r < n; ++r) ops.push_back({in.at(r, me * blk), dst + r * blk, blk});
  copies(ops);
  barrier();
  if (via_stage) localCopy(recv, dst, blk * n);
}

// Rank r pulls its block from our region at our send_displs[r], so every rank needs
// every rank's (send_counts, send_displs) row and staging need: exchanged on the host
// before anything is enqueued. Row of rank r: counts[n], displs[n], staging bytes.
size_t CudaCollectives::Impl::exchangeAlltoallv(const CollArgs& a, Deadline deadline) {
  const int n = size(), me = rank();
  const size_t es = elementSize(a.type), width = 2 * static_cast<size_t>(n) + 1;
  std::vector<uint64_t> mine(width);
  a2av_rows.assign(width * n, 0);
  size_t extent = 0;  // staging: the input, or the output landing there (in place)
  for (int r = 0; r < n; ++r) {
    mine[r] = a.send_counts[r];
    mine[n + r] = a.send_displs[r];
    extent = std::max({extent, a.send_displs[r] + a.send_counts[r], a.recv_displs[r] + a.recv_counts[r]});
  }
  mine[2 * n] = extent * es;
  const uint32_t tag = static_cast<uint32_t>(coll_seq & 0xFFFFFF);
  const size_t row = width * sizeof(uint64_t);
  std::vector<RequestPtr> reqs;
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    reqs.push_back(ctl->irecv(a2av_rows.data() + r * width, row, r, tag));
    reqs.push_back(ctl->isend(mine.data(), row, r, tag));
  }
  std::copy(mine.begin(), mine.end(), a2av_rows.begin() + me * width);
  ctl->waitAll(reqs, deadline);
  size_t need = 0;
  for (int r = 0; r < n; ++r) {
    const uint64_t* rr = a2av_rows.data() + r * width;
    need = std::max<size_t>(need, rr[2 * n]);
    if (rr[me] != a.recv_counts[r])
      throw InvalidArgument(ctx("alltoallv") + fmt::format("rank {} sends {} elements to this rank but "
                                                           "recv_counts[{}] = {}; the counts must match",
                                                           r, rr[me], r, a.recv_counts[r]),
                            {r});
  }
  return need;
}

void CudaCollectives::Impl::alltoallvHeap(const CollArgs& a) {
  const int n = size(), me = rank();
  const size_t es = elementSize(a.type), width = 2 * static_cast<size_t>(n) + 1;
  size_t extent = 0;
  for (int r = 0; r < n; ++r) extent = std::max(extent, a.send_displs[r] + a.send_counts[r]);
  size_t recv_extent = 0;
  for (int r = 0; r < n; ++r) recv_extent = std::max(recv_extent, a.recv_displs[r] + a.recv_counts[r]);
  Region in = contribution(a.send, extent * es, false);
  char* recv = static_cast<char*>(a.recv);
  // As alltoall: in place on a symmetric buffer, land in the staging first.
  const bool via_stage = outputHitsInput(recv, recv_extent * es, in, extent * es);
  char* dst = via_stage ? stage->local<char>() : recv;
  barrier();
  std::vector<cuda::CopyOp> ops;
  for (int r = 0; r < n; ++r) {
    const uint64_t* rr = a2av_rows.data() + r * width;
    ops.push_back({in.at(r, rr[n + me] * es), dst + a.recv_displs[r] * es, a.recv_counts[r] * es});
  }
  copies(ops);
  barrier();
  if (via_stage) localCopy(recv, dst, recv_extent * es);
}

void CudaCollectives::Impl::broadcastHeap(const CollArgs& a) {
  const size_t blk = a.count * elementSize(a.type);
  Region in = contribution(rank() == a.root ? a.recv : nullptr, blk, false);
  // Non-roots must address the root's region the way the root chose it: in place when
  // the (same, symmetric) buffer lies in the heap.
  size_t off = 0;
  if (symm::SymmetricBuffer* b = findUserBuffer(a.recv, blk, &off)) in = Region(b, off);
  barrier();
  if (rank() != a.root) localCopy(a.recv, in.at(a.root), blk);
  barrier();
}

void CudaCollectives::Impl::gatherHeap(const CollArgs& a) {
  const int n = size(), me = rank();
  const size_t blk = a.count * elementSize(a.type);
  Region in = contribution(a.send, blk, false);
  barrier();
  if (me == a.root) {
    char* recv = static_cast<char*>(a.recv);
    std::vector<cuda::CopyOp> ops;
    for (int r = 0; r < n; ++r)
      ops.push_back(
          {r == me ? a.send : in.at(r), recv + r * blk, r == me && a.send == recv + me * blk ? 0 : blk});
    copies(ops);
  }
  barrier();
}

void CudaCollectives::Impl::scatterHeap(const CollArgs& a) {
  const int me = rank();
  const size_t blk = a.count * elementSize(a.type);
  // Non-roots pass no send buffer, so they cannot know a symmetric one: always stage.
  Region in = contribution(me == a.root ? a.send : nullptr, blk * size(), true);
  barrier();
  const char* mine = in.at(a.root, me * blk);
  if (!(me == a.root && a.recv == static_cast<const char*>(a.send) + me * blk)) localCopy(a.recv, mine, blk);
  barrier();
}

// ---- NCCL --------------------------------------------------------------------------------

void CudaCollectives::Impl::registerWindow(const std::shared_ptr<symm::SymmetricBuffer>& buf) {
  try {
    windows.emplace_back(buf, cuda::NcclWindow::registerBuffer(*nccl, *buf));
  } catch (const Error& e) {
    // Collective failure on every rank alike; collectives still work without a window.
    CB_WARN("coll", "{}NCCL window registration failed ({}); NCCL runs without symmetric kernels",
            ctx("allocateSymmetric"), e.what());
  }
}

void CudaCollectives::Impl::ensureNccl(const std::string& desc) {
  if (nccl) return;
  if (!nccl_error.empty()) throw NcclError(ctx(desc) + nccl_error);
  cuda::NcclCommOptions no;
  no.device = device;
  no.cta_policy_zero = opt.nccl_cta_policy_zero;
  no.name = comm->name() + "/cudacoll";
  try {
    nccl = std::make_shared<cuda::NcclCommHolder>(cuda::NcclCommHolder::create(ctl, no));
  } catch (const std::exception& e) {
    nccl_error = fmt::format(
        "could not create the NCCL communicator this call needs ({} ranks; this rank uses GPU {} on {}). "
        "NCCL allows one rank per GPU, so ranks sharing a GPU cannot use it: run one rank per GPU, or "
        "keep the call on the CUDA heap algorithms (one node, at most {} ranks; CROSSBAR_ALGO must not "
        "force nccl; send/recv always need NCCL). NCCL said: {}",
        size(), device, comm->host(rank()), cuda::kMaxLocalRanks, e.what());
    throw NcclError(ctx(desc) + nccl_error);
  }
  for (auto it = user_bufs.begin(); it != user_bufs.end(); ++it)
    if (auto b = it->lock(); b && !b->freed()) registerWindow(b);
  CB_INFO("coll", "{}: NCCL communicator created for CUDA collectives ({} ranks, cta_policy_zero={})",
          comm->name(), size(), opt.nccl_cta_policy_zero);
}

void CudaCollectives::Impl::runNccl(const CollArgs& a, const std::string& desc) {
  ensureNccl(desc);
  ncclComm_t nc = nccl->get();
  const ncclDataType_t t = ncclType(a.type);
  const size_t es = elementSize(a.type);
  const int n = size();
  auto check = [&](ncclResult_t r, const char* call) { nccl->check(r, fmt::format("{}: {}", desc, call)); };
  // Reduce op (premul-sum: a scalar of the element type, host immediate).
  ncclRedOp_t op = ncclSum;
  bool created = false;
  if (a.coll == CollType::kAllreduce || a.coll == CollType::kReduceScatter || a.coll == CollType::kReduce) {
    switch (a.op) {
      case ReduceOp::kSum:
        op = ncclSum;
        break;
      case ReduceOp::kProd:
        op = ncclProd;
        break;
      case ReduceOp::kMin:
        op = ncclMin;
        break;
      case ReduceOp::kMax:
        op = ncclMax;
        break;
      case ReduceOp::kAvg:
        op = ncclAvg;
        break;
      case ReduceOp::kPreMulSum: {
        alignas(8) unsigned char scalar[8] = {};
        visitDataType(a.type, [&](auto tag) {
          using T = typename decltype(tag)::type;
          if constexpr (std::is_floating_point_v<T>) {
            T v = static_cast<T>(a.premul_scalar);
            std::memcpy(scalar, &v, sizeof v);
          } else if constexpr (IsNarrowFloat<T>::value) {
            T v = T::fromFloat(static_cast<float>(a.premul_scalar));
            std::memcpy(scalar, &v, sizeof v);
          }
        });
        check(ncclRedOpCreatePreMulSum(&op, scalar, t, ncclScalarHostImmediate, nc),
              "ncclRedOpCreatePreMulSum");
        created = true;
        break;
      }
    }
  }
  switch (a.coll) {
    case CollType::kAllreduce:
      check(ncclAllReduce(a.send, a.recv, a.count, t, op, nc, stream), "ncclAllReduce");
      break;
    case CollType::kReduceScatter:
      check(ncclReduceScatter(a.send, a.recv, a.count, t, op, nc, stream), "ncclReduceScatter");
      break;
    case CollType::kReduce:
      check(ncclReduce(a.send, a.recv, a.count, t, op, a.root, nc, stream), "ncclReduce");
      break;
    case CollType::kAllgather:
      check(ncclAllGather(a.send, a.recv, a.count, t, nc, stream), "ncclAllGather");
      break;
    case CollType::kBroadcast:
      check(ncclBroadcast(a.recv, a.recv, a.count, t, a.root, nc, stream), "ncclBroadcast");
      break;
    case CollType::kAlltoall:
      check(ncclAlltoAll(a.send, a.recv, a.count, t, nc, stream), "ncclAlltoAll");
      break;
    case CollType::kGather:
      check(ncclGather(a.send, a.recv, a.count, t, a.root, nc, stream), "ncclGather");
      break;
    case CollType::kScatter:
      check(ncclScatter(a.send, a.recv, a.count, t, a.root, nc, stream), "ncclScatter");
      break;
    case CollType::kAlltoallv: {
      check(ncclGroupStart(), "ncclGroupStart");
      for (int r = 0; r < n; ++r) {
        const char* s = static_cast<const char*>(a.send) + a.send_displs[r] * es;
        char* d = static_cast<char*>(a.recv) + a.recv_displs[r] * es;
        if (a.send_counts[r]) check(ncclSend(s, a.send_counts[r], t, r, nc, stream), "ncclSend");
        if (a.recv_counts[r]) check(ncclRecv(d, a.recv_counts[r], t, r, nc, stream), "ncclRecv");
      }
      check(ncclGroupEnd(), "ncclGroupEnd");
      break;
    }
    case CollType::kBarrier:
      if (!nccl_scratch) cuda::checkCuda(cudaMalloc(&nccl_scratch, 256), "NCCL barrier: cudaMalloc", device);
      check(ncclAllReduce(nccl_scratch, nccl_scratch, 1, ncclFloat32, ncclSum, nc, stream), "ncclAllReduce");
      break;
    case CollType::kSend:
      check(ncclSend(a.send, a.count, t, a.peer, nc, stream), "ncclSend");
      break;
    case CollType::kRecv:
      check(ncclRecv(a.recv, a.count, t, a.peer, nc, stream), "ncclRecv");
      break;
  }
  if (created) ncclRedOpDestroy(op, nc);
}

// ---- issuing -----------------------------------------------------------------------------

void CudaCollectives::Impl::execute(const CollArgs& a, const Algorithm& algo, const std::string& desc) {
  if (algo.name == "nccl") {
    runNccl(a, desc);
    return;
  }
  switch (a.coll) {
    case CollType::kAllreduce:
      allreduceHeap(a, algo.name == "twoshot");
      return;
    case CollType::kReduceScatter:
      reduceScatterHeap(a);
      return;
    case CollType::kReduce:
      reduceHeap(a);
      return;
    case CollType::kAllgather:
      allgatherHeap(a);
      return;
    case CollType::kAlltoall:
      alltoallHeap(a);
      return;
    case CollType::kBroadcast:
      broadcastHeap(a);
      return;
    case CollType::kGather:
      gatherHeap(a);
      return;
    case CollType::kScatter:
      scatterHeap(a);
      return;
    case CollType::kAlltoallv:
      alltoallvHeap(a);
      return;
    case CollType::kBarrier:
      barrier();
      return;
    default:
      break;
  }
  throw InternalError(ctx(desc) + "no heap implementation for " + algo.name);
}

WorkPtr CudaCollectives::Impl::run(CollArgs a, cudaStream_t user, const CollOptions& o) {
  const bool timed = telemetry::Recorder::instance().enabled();
  const int64_t issued_ns = timed ? telemetry::nowNs() : 0;
  std::lock_guard<std::mutex> lk(m);
  const char* name = collTypeName(a.coll);
  validateCollArgs(a, *comm);
  if (!sticky.empty())
    throw InvalidUsage(ctx(name) +
                       "not run: an earlier operation failed while being enqueued, so the peers' "
                       "state is unknown; abort the communicator and create a new one. First "
                       "error: " +
                       sticky);
  const Deadline deadline = Deadline::after(timeout(o));
  // Every rank compares this call with its peers' before any rank enqueues a kernel of it
  // (a mismatch: InvalidUsage on every rank, nothing enqueued, still usable). A check
  // that ends without a verdict (a peer never came) leaves the peers' state unknown.
  int64_t my_seq = -1;
  try {
    my_seq = calls.beforeEnqueue(ctl, a, deadline);
  } catch (const Timeout& e) {
    sticky = fmt::format("{} (call check): {}", a.describe(), e.what());
    throw;
  }
  if (my_seq >= 0) coll_seq = static_cast<uint64_t>(my_seq);
  Selection s = selectAlgorithm(a, *comm, o.algorithm, env_override, MemoryKind::kCuda);
  const Algorithm* algo = s.algorithm;
  if (algo->name != "nccl" && !heap_reason.empty()) {
    s.reason += " -> nccl: no CUDA heap (" + heap_reason + ")";
    algo = findAlgorithm(a.coll, "nccl", MemoryKind::kCuda);
  }
  const std::string desc = fmt::format("{} ({}, cuda)", a.describe(), algo->name);
  CB_INFO("coll", "{}: cuda #{} {} [{}]", comm->name(), my_seq, desc, s.reason);
  const bool is_nccl = algo->name == "nccl";
  DeviceGuard guard(device);
  // Creating NCCL fails alike on every rank and enqueues nothing: not sticky.
  if (is_nccl) ensureNccl(desc);

  std::shared_ptr<CudaWork> w;
  try {
    // Host-side preparation (collective, may block) before anything is enqueued.
    if (!is_nccl && a.coll == CollType::kAlltoallv)
      ensureStage(exchangeAlltoallv(a, deadline), deadline);
    else if (!is_nccl && a.coll != CollType::kBarrier)
      ensureStage(stageNeed(a, algo->name == "twoshot"), deadline);
    if (group_depth > 0) {
      w = group_work;
      group_ops.push_back(desc);
      if (std::find(group_streams.begin(), group_streams.end(), user) == group_streams.end())
        group_streams.push_back(user);
      if (is_nccl && !group_nccl_open) {
        nccl->check(ncclGroupStart(), "ncclGroupStart");
        group_nccl_open = true;
      }
    } else {
      w = std::make_shared<CudaWork>(desc, rank(), device, nullptr);
    }
    const bool was_idle = timed && cudaStreamQuery(stream) == cudaSuccess;
    cuda::checkCuda(cudaEventRecord(join, user),
                    fmt::format("{}: cudaEventRecord on the caller's stream", desc), device,
                    "the stream must belong to this CudaCollectives' device");
    cuda::checkCuda(cudaStreamWaitEvent(stream, join, 0), "cudaStreamWaitEvent", device);
    const bool empty = a.coll != CollType::kBarrier && a.coll != CollType::kAlltoallv &&
                       a.coll != CollType::kSend && a.coll != CollType::kRecv && a.count == 0;
    // Telemetry: one record per call (a group: one for the group, started at its first
    // call), timed on the stream from after the caller's prior work to the op's end.
    int slot = -1;
    if (timed) {
      if (!timer) {
        timer = std::make_shared<OpTimer>(device, stream);
        telemetry::Recorder::instance().addFlushHook(this, [t = std::weak_ptr<OpTimer>(timer)] {
          if (auto p = t.lock()) p->resolve();
        });
      }
      if (group_depth == 0 || group_timed_ops == 0) {
        cudacoll::PendingOp op;
        op.setNames(name, algo->name);
        op.bytes = a.selectionBytes(size());
        op.op_seq = my_seq;  // as the host collectives: collectives only, p2p -1
        op.enqueue_ns = issued_ns;
        slot = timer->begin(op, was_idle);
        if (group_depth > 0) tel_slot = slot;
      }
      if (group_depth > 0) {
        slot = tel_slot;
        group_timed_ops++;
        group_bytes += a.selectionBytes(size());
      }
      // A group's wait is its first barrier's (later calls' barriers would re-record it).
      if (group_depth == 0 || !group_wait_timed) tel_wait_slot = slot;
    }
    try {
      if (!empty) execute(a, *algo, desc);
    } catch (...) {
      tel_wait_slot = -1;
      if (slot >= 0) timer->abandon(slot);
      tel_slot = -1;
      throw;
    }
    if (group_depth > 0 && slot >= 0 && tel_wait_slot < 0) group_wait_timed = true;  // barrier() took it
    tel_wait_slot = -1;
    if (is_nccl) w->setNccl(nccl);
    if (group_depth > 0) return w;
    if (slot >= 0) timer->end(slot);
    if (timer) w->setTimer(timer);
    w->arm(stream);
    cuda::checkCuda(cudaStreamWaitEvent(user, w->event(), 0), "cudaStreamWaitEvent on the caller's stream",
                    device);
  } catch (const Error& e) {
    // Some ranks may have enqueued (or grown) more than others: later calls must not run.
    if (sticky.empty()) sticky = fmt::format("{}: {}", desc, e.what());
    throw;
  }
  return w;
}

WorkPtr CudaCollectives::allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                                   cudaStream_t stream, const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kAllreduce, send, recv, count, type);
  a.op = op;
  a.premul_scalar = o.premul_scalar;
  return impl_->run(std::move(a), stream, o);
}

WorkPtr CudaCollectives::allgather(const void* send, void* recv, size_t count, DataType type,
                                   cudaStream_t stream, const CollOptions& o) {
  return impl_->run(CollArgs::of(CollType::kAllgather, send, recv, count, type), stream, o);
}

WorkPtr CudaCollectives::reduceScatter(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                                       cudaStream_t stream, const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kReduceScatter, send, recv, count, type);
  a.op = op;
  a.premul_scalar = o.premul_scalar;
  return impl_->run(std::move(a), stream, o);
}

WorkPtr CudaCollectives::broadcast(void* buffer, size_t count, DataType type, int root, cudaStream_t stream,
                                   const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kBroadcast, buffer, buffer, count, type);
  a.root = root;
  return impl_->run(std::move(a), stream, o);
}

WorkPtr CudaCollectives::reduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                                int root, cudaStream_t stream, const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kReduce, send, recv, count, type);
  a.op = op;
  a.root = root;
  a.premul_scalar = o.premul_scalar;
  return impl_->run(std::move(a), stream, o);
}

WorkPtr CudaCollectives::alltoall(const void* send, void* recv, size_t count, DataType type,
                                  cudaStream_t stream, const CollOptions& o) {
  return impl_->run(CollArgs::of(CollType::kAlltoall, send, recv, count, type), stream, o);
}

WorkPtr CudaCollectives::alltoallv(const void* send, const std::vector<size_t>& send_counts,
                                   const std::vector<size_t>& send_displs, void* recv,
                                   const std::vector<size_t>& recv_counts,
                                   const std::vector<size_t>& recv_displs, DataType type, cudaStream_t stream,
                                   const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kAlltoallv, send, recv, 0, type);
  a.send_counts = send_counts;
  a.send_displs = send_displs;
  a.recv_counts = recv_counts;
  a.recv_displs = recv_displs;
  return impl_->run(std::move(a), stream, o);
}

WorkPtr CudaCollectives::gather(const void* send, void* recv, size_t count, int root, DataType type,
                                cudaStream_t stream, const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kGather, send, recv, count, type);
  a.root = root;
  return impl_->run(std::move(a), stream, o);
}

WorkPtr CudaCollectives::scatter(const void* send, void* recv, size_t count, int root, DataType type,
                                 cudaStream_t stream, const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kScatter, send, recv, count, type);
  a.root = root;
  return impl_->run(std::move(a), stream, o);
}

WorkPtr CudaCollectives::barrier(cudaStream_t stream, const CollOptions& o) {
  return impl_->run(CollArgs::of(CollType::kBarrier, nullptr, nullptr, 0, DataType::kUInt8), stream, o);
}

WorkPtr CudaCollectives::send(const void* data, size_t count, DataType type, int peer, uint32_t tag,
                              cudaStream_t stream, const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kSend, data, nullptr, count, type);
  a.peer = peer;
  a.tag = tag;
  return impl_->run(std::move(a), stream, o);
}

WorkPtr CudaCollectives::recv(void* data, size_t count, DataType type, int peer, uint32_t tag,
                              cudaStream_t stream, const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kRecv, nullptr, data, count, type);
  a.peer = peer;
  a.tag = tag;
  return impl_->run(std::move(a), stream, o);
}

void CudaCollectives::groupStart() {
  Impl& x = *impl_;
  std::lock_guard<std::mutex> lk(x.m);
  if (x.group_depth++ == 0) {
    x.group_work = std::make_shared<CudaWork>("group", x.rank(), x.device, nullptr);
    x.group_ops.clear();
    x.group_streams.clear();
    x.group_nccl_open = false;
    x.tel_slot = -1;
    x.group_timed_ops = 0;
    x.group_bytes = 0;
    x.group_wait_timed = false;
  }
}

WorkPtr CudaCollectives::groupEnd() {
  Impl& x = *impl_;
  std::lock_guard<std::mutex> lk(x.m);
  if (x.group_depth == 0)
    throw InvalidUsage(x.ctx("groupEnd") + "groupEnd() without a matching groupStart()");
  std::shared_ptr<CudaWork> w = x.group_work;
  if (--x.group_depth > 0) return w;
  DeviceGuard guard(x.device);
  std::string desc = fmt::format("group of {} CUDA operations", x.group_ops.size());
  for (size_t i = 0; i < x.group_ops.size() && i < 4; ++i) desc += (i ? ", " : ": ") + x.group_ops[i];
  if (x.group_ops.size() > 4) desc += ", ...";
  w->setDescription(desc);
  if (x.group_nccl_open) x.nccl->check(ncclGroupEnd(), desc + ": ncclGroupEnd");
  x.group_nccl_open = false;
  if (x.tel_slot >= 0) {
    // One record for the group; a group of one call keeps that call's name and algorithm.
    cudacoll::PendingOp op = x.timer->pending(x.tel_slot);
    if (x.group_timed_ops > 1) {
      op.setNames("group", "group");
      op.op_seq = -1;
      op.bytes = x.group_bytes;
    }
    x.timer->end(x.tel_slot, &op);
    x.tel_slot = -1;
  }
  if (x.timer) w->setTimer(x.timer);
  // The callers' streams joined the internal stream at each call; they wait for the
  // group's end here.
  w->arm(x.stream);
  for (cudaStream_t user : x.group_streams)
    cuda::checkCuda(cudaStreamWaitEvent(user, w->event(), 0), "groupEnd: cudaStreamWaitEvent", x.device);
  x.group_work.reset();
  x.group_ops.clear();
  x.group_streams.clear();
  return w;
}

}  // namespace crossbar
