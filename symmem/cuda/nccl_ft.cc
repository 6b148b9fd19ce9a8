#include "symmem/cuda/nccl_ft.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "comm/errors.h"
#include "comm/log.h"
#include "comm/thread_name.h"
#include "symmem/cuda/nccl_window.h"

namespace crossbar::cuda {
namespace {
constexpr int kShrinkVersion = 22700;  // ncclCommShrink
constexpr int kRevokeVersion = 22800;  // ncclCommRevoke
constexpr int kShrinkAbort = 0x01;     // NCCL_SHRINK_ABORT: stop the parent's work, then shrink

// `name` from the NCCL library this process loaded (the one ncclGetVersion lives in), or
// null when that library lacks it.
template <class Fn>
Fn loadedNcclSymbol(const char* name) {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) == 0 || info.dli_fname == nullptr)
    return nullptr;
  void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (lib == nullptr) return nullptr;
  void* sym = dlsym(lib, name);
  dlclose(lib);  // RTLD_NOLOAD took a reference on the already-loaded library: give it back
  return reinterpret_cast<Fn>(sym);
}
}  // namespace

NcclFtApi NcclFtApi::real() {
  NcclFtApi api;
  api.getUniqueId = [](ncclUniqueId* id) { return ncclGetUniqueId(id); };
  api.initRankConfig = [](ncclComm_t* c, int n, ncclUniqueId id, int r, ncclConfig_t* cfg) {
    return ncclCommInitRankConfig(c, n, id, r, cfg);
  };
  api.abort = [](ncclComm_t c) { return ncclCommAbort(c); };
  api.getAsyncError = [](ncclComm_t c, ncclResult_t* r) { return ncclCommGetAsyncError(c, r); };
  api.lastError = [](ncclComm_t c) {
    const char* s = ncclGetLastError(c);
    return std::string(s ? s : "");
  };
  int version = 0;
  if (ncclGetVersion(&version) == ncclSuccess) api.version = version;
  // Looked up in the NCCL library actually loaded, not linked: the headers here may be newer
  // than that library, and a release can report 2.28 without ncclCommRevoke (seen on the
  // GPU machine: "undefined symbol: ncclCommRevoke" at the first revoke).
  using ShrinkFn = ncclResult_t (*)(ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int);
  using RevokeFn = ncclResult_t (*)(ncclComm_t, int);
  if (auto* shrink = loadedNcclSymbol<ShrinkFn>("ncclCommShrink"); shrink && api.version >= kShrinkVersion)
    api.shrink = [shrink](ncclComm_t c, int* ex, int n, ncclComm_t* out, ncclConfig_t* cfg, int flags) {
      return shrink(c, ex, n, out, cfg, flags);
    };
  if (auto* revoke = loadedNcclSymbol<RevokeFn>("ncclCommRevoke"); revoke && api.version >= kRevokeVersion)
    api.revoke = [revoke](ncclComm_t c, int flags) { return revoke(c, flags); };
  return api;
}

NcclRebuildPlan planNcclRebuild(const ft::EpochChange& change, bool have_parent, bool can_shrink) {
  NcclRebuildPlan plan;
  if (!change.shrink) {
    plan.reason = "the membership grew (NCCL communicators cannot add ranks)";
    return plan;
  }
  if (!have_parent) {
    plan.reason = "no parent communicator to shrink";
    return plan;
  }
  if (!can_shrink) {
    plan.reason = "ncclCommShrink is unavailable (NCCL < 2.27) or disabled";
    return plan;
  }
  // ncclCommShrink keeps the remaining ranks in old order: so must the new epoch.
  int last = -1;
  for (int old : change.old_rank_of) {
    if (old <= last) {
      plan.reason = "the new membership is not the old one in old order";
      return plan;
    }
    last = old;
  }
  plan.kind = NcclRebuildPlan::Kind::kShrink;
  plan.exclude = change.excluded;
  return plan;
}

// ------------------------------------------------------------------------------------

std::shared_ptr<NcclFtComm> NcclFtComm::create(ft::FaultTolerantComm& ft, NcclFtOptions options,
                                               NcclFtApi api) {
  std::shared_ptr<NcclFtComm> self(new NcclFtComm(std::move(options), std::move(api)));
  const auto& comm = ft.comm();
  if (!comm) throw InvalidUsage(errorContext(-1, "NcclFtComm create") + "the FT communicator is closed");
  self->timeout_ = self->options_.timeout.count() > 0 ? self->options_.timeout : comm->timeout();
  ncclComm_t c = self->initFromStore(comm, self->key("init"));
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    self->comm_ = c;
    self->epoch_comm_ = comm;
    self->epoch_ = ft.epoch();
    self->rank_ = comm->rank();
    self->size_ = comm->size();
    self->last_rebuild_ = "init";
  }
  if (self->options_.watchdog_period.count() > 0)
    self->watchdog_ = std::thread([s = self.get()] {
      nameThisThread("cb-nccl-wdog");
      s->watchdog();
    });
  ft.attach(self);
  return self;
}

NcclFtComm::~NcclFtComm() {
  close();
}

void NcclFtComm::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  ncclComm_t c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    c = std::exchange(comm_, nullptr);
    epoch_comm_.reset();
  }
  if (c) {
    setDevice();
    api_.abort(c);  // bounded, unlike a finalize with peers that may be gone
  }
}

ncclComm_t NcclFtComm::get() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (revoked_.load() || !comm_)
    throw InvalidUsage(
        fmt::format("{}the NCCL communicator of epoch {} was revoked; call shrink()/grow() on the "
                    "fault-tolerant communicator first",
                    errorContext(rank_, "NcclFtComm"), epoch_));
  return comm_;
}

int NcclFtComm::rank() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rank_;
}
int NcclFtComm::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return size_;
}
uint64_t NcclFtComm::epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}
std::string NcclFtComm::lastRebuild() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_rebuild_;
}

std::string NcclFtComm::key(const char* what) const {
  return fmt::format("nccl-ft/{}/{}", options_.name.empty() ? "default" : options_.name, what);
}

void NcclFtComm::setDevice() const {
  if (options_.device >= 0) cudaSetDevice(options_.device);
}

ncclConfig_t NcclFtComm::config() const {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;  // every call returns at once; waits poll under our deadlines
  if (!options_.name.empty()) c.commName = options_.name.c_str();
  return c;
}

void NcclFtComm::fail(ncclResult_t r, ncclComm_t comm, const std::string& op) const {
  std::string last = comm && api_.lastError ? api_.lastError(comm) : "";
  throw NcclError(fmt::format("{}{} failed: {}{}{}. Run with NCCL_DEBUG=WARN for NCCL's view",
                              errorContext(rank_, "NcclFtComm"), op, ncclResultText(r),
                              last.empty() ? "" : ": ", last));
}

ncclResult_t NcclFtComm::waitReady(ncclComm_t comm, const std::string& op, Deadline deadline) const {
  while (true) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t r = api_.getAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (deadline.expired())
      throw Timeout(fmt::format("{}{} did not complete within {} ms", errorContext(rank_, "NcclFtComm"), op,
                                timeout_.count()));
    std::this_thread::sleep_for(Millis(1));
  }
}

ncclComm_t NcclFtComm::initFromStore(const std::shared_ptr<Communicator>& comm, const std::string& key) {
  const Deadline deadline = Deadline::after(timeout_);
  Store& store = comm->store();  // the new epoch's namespace: a fresh id per epoch
  ncclUniqueId uid{};
  if (comm->rank() == 0) {
    ncclResult_t r = api_.getUniqueId(&uid);
    if (r != ncclSuccess) fail(r, nullptr, "ncclGetUniqueId");
    store.set(key, Bytes(reinterpret_cast<uint8_t*>(&uid), reinterpret_cast<uint8_t*>(&uid) + sizeof(uid)));
  } else {
    Bytes b;
    try {
      b = store.get(key, deadline);
    } catch (const Timeout&) {
      throw Timeout(fmt::format("{}rank 0 did not publish the NCCL unique id ({}) within {} ms",
                                errorContext(comm->rank(), "NcclFtComm init"), key, timeout_.count()),
                    {0});
    }
    if (b.size() != sizeof(uid))
      throw InternalError(fmt::format("{}NCCL unique id under {} has {} bytes, expected {}",
                                      errorContext(comm->rank(), "NcclFtComm init"), key, b.size(),
                                      sizeof(uid)));
    std::memcpy(&uid, b.data(), sizeof(uid));
  }
  setDevice();
  ncclConfig_t cfg = config();
  ncclComm_t c = nullptr;
  const std::string op = fmt::format("ncclCommInitRankConfig (rank {} of {})", comm->rank(), comm->size());
  ncclResult_t r = api_.initRankConfig(&c, comm->size(), uid, comm->rank(), &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (c) api_.abort(c);
    fail(r, nullptr, op);
  }
  try {
    r = waitReady(c, op, deadline);
  } catch (...) {
    api_.abort(c);
    throw;
  }
  if (r != ncclSuccess) {
    std::string last = api_.lastError ? api_.lastError(c) : "";
    api_.abort(c);
    throw NcclError(fmt::format("{}{} failed: {}{}{}", errorContext(comm->rank(), "NcclFtComm"), op,
                                ncclResultText(r), last.empty() ? "" : ": ", last));
  }
  return c;
}

void NcclFtComm::abortEpoch(const std::string& reason, std::exception_ptr) {
  if (revoked_.exchange(true)) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return;
  setDevice();
  CB_INFO("ft", "revoking the NCCL communicator of epoch {}: {}", epoch_, reason);
  // Revoke keeps the communicator for ncclCommShrink; abort is the fallback.
  if (api_.revoke) {
    ncclResult_t r = api_.revoke(comm_, 0);  // NCCL_REVOKE_DEFAULT
    if (r == ncclSuccess || r == ncclInProgress) return;
    CB_WARN("ft", "ncclCommRevoke failed ({}); aborting the NCCL communicator instead", ncclResultText(r));
  }
  api_.abort(comm_);
  comm_ = nullptr;
}

bool NcclFtComm::tryShrink(ncclComm_t parent, const std::vector<int>& exclude, ncclComm_t* out,
                           std::string* why) {
  setDevice();
  // A revoked parent settles (leaves ncclInProgress) once quiescent; then shrink.
  const Deadline deadline = Deadline::after(timeout_);
  try {
    ncclResult_t st = waitReady(parent, "ncclCommRevoke", deadline);
    (void)st;  // an error state is what NCCL_SHRINK_ABORT is for
    std::vector<int> ex = exclude;
    ncclConfig_t cfg = config();
    *out = nullptr;
    ncclResult_t r = api_.shrink(parent, ex.data(), static_cast<int>(ex.size()), out, &cfg, kShrinkAbort);
    if (r != ncclSuccess && r != ncclInProgress) {
      *why = fmt::format("ncclCommShrink returned {}", ncclResultText(r));
      return false;
    }
    if (!*out) {
      *why = "ncclCommShrink gave no communicator";
      return false;
    }
    r = waitReady(*out, "ncclCommShrink", deadline);
    if (r != ncclSuccess) {
      *why = fmt::format("ncclCommShrink failed asynchronously: {}", ncclResultText(r));
      return false;
    }
    return true;
  } catch (const std::exception& e) {
    *why = e.what();
    return false;
  }
}

bool NcclFtComm::everyoneAgrees(const std::shared_ptr<Communicator>& comm, const std::string& key, bool mine,
                                std::string* why) {
  Store& store = comm->store();
  store.set(fmt::format("{}/{}", key, comm->rank()), mine ? std::string("ok") : "failed: " + *why);
  const Deadline deadline = Deadline::after(timeout_);
  bool all = true;
  for (int r = 0; r < comm->size(); ++r) {
    std::string v = toString(store.get(fmt::format("{}/{}", key, r), deadline));
    if (v != "ok") {
      if (all && r != comm->rank()) *why = fmt::format("rank {}: {}", r, v);
      all = false;
    }
  }
  return all;
}

void NcclFtComm::releaseParent(ncclComm_t parent) {
  if (!parent) return;
  setDevice();
  api_.abort(parent);  // revoked and replaced: nothing of it is needed
}

void NcclFtComm::advance(const ft::EpochChange& change) {
  ncclComm_t parent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    parent = std::exchange(comm_, nullptr);
  }
  auto plan =
      planNcclRebuild(change, parent != nullptr, options_.allow_shrink && static_cast<bool>(api_.shrink));
  ncclComm_t fresh = nullptr;
  std::string how;
  if (plan.kind == NcclRebuildPlan::Kind::kShrink) {
    std::string why;
    bool ok = tryShrink(parent, plan.exclude, &fresh, &why);
    // All members take the same path, or the re-created communicator would hang.
    if (everyoneAgrees(change.comm, key("shrink"), ok, &why)) {
      how = "shrink";
    } else {
      CB_WARN("ft", "epoch {}: NCCL shrink not usable everywhere ({}); re-creating the communicator",
              change.new_epoch, why);
      if (fresh) api_.abort(fresh);
      fresh = nullptr;
      plan.reason = "shrink failed: " + why;
    }
  }
  releaseParent(parent);
  if (!fresh) {
    fresh = initFromStore(change.comm, key("init"));
    how = "reinit: " + plan.reason;
  }
  std::lock_guard<std::mutex> lock(mu_);
  comm_ = fresh;
  epoch_comm_ = change.comm;
  epoch_ = change.new_epoch;
  rank_ = change.comm->rank();
  size_ = change.comm->size();
  last_rebuild_ = how;
  revoked_ = false;
  CB_INFO("ft", "epoch {}: NCCL communicator {} ({} ranks)", epoch_, how, size_);
}

void NcclFtComm::watchdog() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, options_.watchdog_period, [&] { return stopping_; })) {
    if (!comm_ || revoked_.load()) continue;
    ncclResult_t state = ncclSuccess;
    if (api_.getAsyncError(comm_, &state) != ncclSuccess || state == ncclSuccess || state == ncclInProgress)
      continue;
    std::string last = api_.lastError ? api_.lastError(comm_) : "";
    auto comm = epoch_comm_.lock();
    const uint64_t epoch = epoch_;
    lock.unlock();
    std::string message = fmt::format(
        "{}the NCCL communicator of epoch {} failed asynchronously: {}{}{}. Call handleError() and shrink() "
        "on "
        "the fault-tolerant communicator",
        errorContext(comm ? comm->rank() : -1, "NcclFtComm watchdog"), epoch, ncclResultText(state),
        last.empty() ? "" : ": ", last);
    CB_WARN("ft", "{}", message);
    // The epoch's crossbar operations fail with the NCCL error; NCCL's stop too.
    if (comm) comm->abort("NCCL asynchronous error", std::make_exception_ptr(NcclError(message)));
    abortEpoch(message, nullptr);
    lock.lock();
  }
}

}  // namespace crossbar::cuda
