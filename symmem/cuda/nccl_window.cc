#include "symmem/cuda/nccl_window.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "comm/errors.h"
#include "comm/log.h"
#include "comm/store.h"
#include "symmem/cuda/driver_api.h"

namespace crossbar::cuda {

std::string ncclResultText(ncclResult_t result) {
  const char* name = "ncclUnknownResult";
  switch (result) {
    case ncclSuccess:
      name = "ncclSuccess";
      break;
    case ncclUnhandledCudaError:
      name = "ncclUnhandledCudaError";
      break;
    case ncclSystemError:
      name = "ncclSystemError";
      break;
    case ncclInternalError:
      name = "ncclInternalError";
      break;
    case ncclInvalidArgument:
      name = "ncclInvalidArgument";
      break;
    case ncclInvalidUsage:
      name = "ncclInvalidUsage";
      break;
    case ncclRemoteError:
      name = "ncclRemoteError";
      break;
    case ncclInProgress:
      name = "ncclInProgress";
      break;
    default:
      break;
  }
  return fmt::format("{} ({})", name, ncclGetErrorString(result));
}

namespace detail {

struct NcclState {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 0, device = -1;
  uint64_t id = 0;
  Millis timeout{0};
  std::string name;  // config.commName points here
  bool aborted = false;

  std::string ctx(std::string_view op) const {
    return errorContext(
        rank, fmt::format("NCCL communicator #{}{} {}", id, name.empty() ? "" : " '" + name + "'", op));
  }

  [[noreturn]] void fail(ncclResult_t r, std::string_view op) const {
    const char* last = comm ? ncclGetLastError(comm) : nullptr;
    throw NcclError(ctx(op) + fmt::format("{}{}{}. Run with NCCL_DEBUG=WARN (or INFO) for NCCL's view; a "
                                          "remote or system error usually means a peer rank failed",
                                          ncclResultText(r), last && *last ? ": " : "", last ? last : ""));
  }

  // Polls the communicator's state until it leaves ncclInProgress. Short sleeps that
  // grow to 1 ms: NCCL progresses on its own threads, so nothing needs to spin here.
  void waitReady(std::string_view op, Deadline deadline) const {
    if (aborted) throw Aborted(ctx(op) + "the NCCL communicator was aborted; create a new one");
    auto nap = std::chrono::microseconds(5);
    while (true) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) fail(r, fmt::format("{}: ncclCommGetAsyncError", op));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail(state, op);
      if (deadline.expired())
        throw Timeout(ctx(op) + fmt::format("still in progress after the deadline ({} ms timeout); every "
                                            "rank must make the same NCCL call (same order, sizes); "
                                            "NCCL_DEBUG=INFO shows where it waits",
                                            timeout.count()));
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }

  void check(ncclResult_t r, std::string_view call, Deadline deadline) const {
    if (r == ncclSuccess) return;
    if (r == ncclInProgress) return waitReady(call, deadline);
    fail(r, call);
  }

  ~NcclState() {
    if (!comm) return;
    if (!aborted) {
      // Finalize flushes outstanding work; bounded, then destroy. Abort if it fails.
      try {
        if (device >= 0) cudaSetDevice(device);
        check(ncclCommFinalize(comm), "ncclCommFinalize", Deadline::after(std::min(timeout, Millis(30'000))));
        ncclCommDestroy(comm);
        return;
      } catch (const std::exception& e) {
        CB_WARN("symmem", "{}; aborting the NCCL communicator instead", e.what());
      }
    }
    ncclCommAbort(comm);
  }
};

}  // namespace detail

using detail::NcclState;

NcclCommHolder NcclCommHolder::create(const std::shared_ptr<Communicator>& comm, NcclCommOptions options) {
  constexpr std::string_view kOp = "NcclCommHolder::create";
  if (!comm) throw InvalidArgument(errorContext(-1, kOp) + "null communicator");
  auto s = std::make_shared<NcclState>();
  s->rank = comm->rank();
  s->size = comm->size();
  s->name = options.name;
  s->timeout = options.timeout.count() > 0 ? options.timeout : comm->timeout();
  const Deadline deadline = Deadline::after(s->timeout);

  // Without a driver NCCL cannot work: say so before anything reaches the store.
  if (!driverAvailable())
    throw Unsupported(errorContext(s->rank, kOp) + driverUnavailableReason() +
                      "; NCCL needs a CUDA device (use crossbar's host collectives on CPU-only machines)");
  if (options.device >= 0) {
    ensureContext(options.device, kOp);
    s->device = options.device;
  } else {
    checkCuda(cudaGetDevice(&s->device), "cudaGetDevice", -1);
    ensureContext(s->device, kOp);
  }

  // Communicator number: every rank's arrival lands in the same window of `size`
  // because no rank finishes NCCL init k (collective) before all arrived at k.
  Store& store = comm->store();
  s->id = static_cast<uint64_t>(store.add("crossbar/nccl/creations", 1) - 1) / static_cast<uint64_t>(s->size);
  const std::string key = fmt::format("crossbar/nccl/{}/unique_id", s->id);
  ncclUniqueId uid{};
  if (s->rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess) s->fail(r, "ncclGetUniqueId");
    store.set(key, Bytes(reinterpret_cast<uint8_t*>(&uid), reinterpret_cast<uint8_t*>(&uid) + sizeof(uid)));
  } else {
    Bytes b;
    try {
      b = store.get(key, deadline);
    } catch (const Timeout&) {
      throw Timeout(s->ctx("create") +
                        "rank 0 never published the NCCL unique id; every rank must call "
                        "NcclCommHolder::create() on this communicator",
                    {0});
    }
    if (b.size() != sizeof(uid))
      throw InternalError(s->ctx("create") + fmt::format("the unique id in the store has {} bytes, not {}",
                                                         b.size(), sizeof(uid)));
    std::memcpy(&uid, b.data(), sizeof(uid));
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every wait below is ours, with a deadline
  if (options.cta_policy_zero) config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
  if (!s->name.empty()) config.commName = s->name.c_str();
  ncclResult_t r = ncclCommInitRankConfig(&s->comm, s->size, uid, s->rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (s->comm) {
      ncclCommAbort(s->comm);
      s->aborted = true;
    }
    s->fail(r, fmt::format("ncclCommInitRankConfig (rank {} of {}, device {})", s->rank, s->size, s->device));
  }
  try {
    s->waitReady(
        fmt::format("ncclCommInitRankConfig (rank {} of {}, device {})", s->rank, s->size, s->device),
        deadline);
  } catch (...) {
    ncclCommAbort(s->comm);  // a half-initialized communicator cannot be finalized
    s->aborted = true;
    throw;
  }
  // The id is only needed until every rank has initialized; rank 0 removes it best effort.
  if (s->rank == 0) {
    try {
      store.deleteKey(key);
    } catch (...) {
    }
  }
  CB_INFO("symmem", "NCCL communicator #{}: rank {} of {} on device {}{}", s->id, s->rank, s->size, s->device,
          options.cta_policy_zero ? ", CTA policy zero" : "");
  NcclCommHolder h;
  h.state_ = std::move(s);
  return h;
}

namespace {
const NcclState& need(const std::shared_ptr<NcclState>& s, std::string_view op) {
  if (!s)
    throw InvalidUsage(errorContext(-1, op) +
                       "the NCCL communicator was not created (NcclCommHolder::create)");
  return *s;
}
}  // namespace

ncclComm_t NcclCommHolder::get() const {
  return need(state_, "NcclCommHolder::get").comm;
}
int NcclCommHolder::rank() const {
  return need(state_, "NcclCommHolder::rank").rank;
}
int NcclCommHolder::size() const {
  return need(state_, "NcclCommHolder::size").size;
}
int NcclCommHolder::device() const {
  return need(state_, "NcclCommHolder::device").device;
}
Millis NcclCommHolder::timeout() const {
  return need(state_, "NcclCommHolder::timeout").timeout;
}

void NcclCommHolder::check(ncclResult_t result, std::string_view call) const {
  const NcclState& s = need(state_, call);
  s.check(result, call, Deadline::after(s.timeout));
}

void NcclCommHolder::check(ncclResult_t result, std::string_view call, Deadline deadline) const {
  need(state_, call).check(result, call, deadline);
}

void NcclCommHolder::waitReady(std::string_view op, Deadline deadline) const {
  need(state_, op).waitReady(op, deadline);
}

void NcclCommHolder::checkAsync(std::string_view op) const {
  const NcclState& s = need(state_, op);
  if (s.aborted) throw Aborted(s.ctx(op) + "the NCCL communicator was aborted; create a new one");
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(s.comm, &state);
  if (r != ncclSuccess) s.fail(r, fmt::format("{}: ncclCommGetAsyncError", op));
  if (state != ncclSuccess && state != ncclInProgress) s.fail(state, op);
}

void NcclCommHolder::abort() noexcept {
  if (!state_ || state_->aborted || !state_->comm) return;
  ncclCommAbort(state_->comm);
  state_->aborted = true;
}

// ------------------------------------------------------------------------------- windows

NcclWindow NcclWindow::registerBuffer(const NcclCommHolder& comm, void* ptr, size_t bytes, int flags) {
  constexpr std::string_view kOp = "NcclWindow::registerBuffer";
  const NcclState& s = need(comm.state_, kOp);
  if (ptr == nullptr || bytes == 0 || reinterpret_cast<uintptr_t>(ptr) % NCCL_WIN_REQUIRED_ALIGNMENT != 0)
    throw InvalidArgument(s.ctx(kOp) + fmt::format("[{}, +{}) must be non-empty and start {}-byte aligned "
                                                   "(NCCL_WIN_REQUIRED_ALIGNMENT)",
                                                   ptr, bytes, NCCL_WIN_REQUIRED_ALIGNMENT));
  NcclWindow w;
  w.state_ = comm.state_;
  w.ptr_ = ptr;
  w.bytes_ = bytes;
  ncclWindow_t win = nullptr;
  const std::string call =
      fmt::format("ncclCommWindowRegister({}, {} bytes, flags {:#x})", ptr, bytes, flags);
  s.check(ncclCommWindowRegister(s.comm, ptr, bytes, &win, flags), call, Deadline::after(s.timeout));
  if (!win)
    CB_INFO("symmem", "{}{} returned no window: NCCL does not use symmetric kernels for this buffer here",
            s.ctx(kOp), call);
  w.window_ = win;
  w.registered_ = true;
  return w;
}

NcclWindow NcclWindow::registerBuffer(const NcclCommHolder& comm, const symm::SymmetricBuffer& buffer,
                                      int flags) {
  if (buffer.freed() || buffer.memoryKind() != symm::MemoryKind::kCuda)
    throw InvalidArgument(errorContext(buffer.rank(), "NcclWindow::registerBuffer") +
                          fmt::format("buffer #{} is {}; NCCL windows need a live buffer from a heap with "
                                      "makeCudaSegmentAllocator()",
                                      buffer.id(), buffer.freed() ? "freed" : "host memory"));
  return registerBuffer(comm, buffer.localPtr(), buffer.size(), flags);
}

NcclWindow::NcclWindow(NcclWindow&& other) noexcept {
  *this = std::move(other);
}

NcclWindow& NcclWindow::operator=(NcclWindow&& other) noexcept {
  if (this != &other) {
    if (valid()) {
      try {
        deregister();
      } catch (const std::exception& e) {
        CB_WARN("symmem", "{}", e.what());
      }
    }
    state_ = std::move(other.state_);
    registered_ = std::exchange(other.registered_, false);
    window_ = std::exchange(other.window_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

NcclWindow::~NcclWindow() {
  if (!valid()) return;
  try {
    deregister();
  } catch (const std::exception& e) {
    CB_WARN("symmem", "deregistering an NCCL window in its destructor: {}", e.what());
  }
}

void NcclWindow::deregister() {
  registered_ = false;
  if (!window_) return;  // never registered, or NCCL declined: nothing to release
  ncclWindow_t win = std::exchange(window_, nullptr);
  const NcclState& s = *state_;
  if (s.aborted) return;  // the abort released it with the communicator
  s.check(ncclCommWindowDeregister(s.comm, win), fmt::format("ncclCommWindowDeregister({})", ptr_),
          Deadline::after(s.timeout));
}

}  // namespace crossbar::cuda
