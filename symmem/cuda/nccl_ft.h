// Fault tolerance for NCCL communicators: an NCCL communicator that follows a
// ft::FaultTolerantComm (comm/ft.h) through its epochs.
//
//   auto ft = ft::FaultTolerantComm::create(store, rank, size, o);
//   auto nccl = cuda::NcclFtComm::create(*ft, {.device = local_rank});  // attaches itself
//   ncclAllReduce(..., nccl->get(), stream);
//   ... a rank dies: ft->handleError(e); ft->shrink();  // nccl->get() is the shrunk one
//
// * Revoke (the epoch failed: detector, abort(), or a transition): ncclCommRevoke
//   (NCCL >= 2.28) stops in-flight NCCL work and keeps the communicator for a shrink;
//   without it, ncclCommAbort. Nonblocking communicators only (config.blocking = 0),
//   so no call blocks the detector thread.
// * Shrink: ncclCommShrink(parent, excluded old ranks, NCCL_SHRINK_ABORT) (NCCL >= 2.27),
//   new ranks in old order like the FT communicator's. Every member reports through the
//   store whether its shrink succeeded; if any failed (or shrink is unavailable, or the
//   parent is gone), all of them abort what they have and re-create the communicator
//   with ncclCommInitRankConfig from a unique id published in the new epoch's store.
// * Grow (and a joiner's first epoch): re-created the same way (NCCL cannot add ranks).
// * Watchdog: a thread polls ncclCommGetAsyncError; an asynchronous NCCL error aborts
//   the epoch's Communicator with NcclError (so crossbar operations fail with it; the
//   caller then handleError()s and shrinks as usual) and revokes the NCCL communicator.
//
// The NCCL entry points go through NcclFtApi so the CPU-visible logic (planning,
// agreement, fallback, watchdog) is tested without a GPU by substituting fakes.
#pragma once

#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/ft.h"

namespace crossbar::cuda {

struct NcclFtApi {
  std::function<ncclResult_t(ncclUniqueId*)> getUniqueId;
  std::function<ncclResult_t(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*)> initRankConfig;
  // Unset when the NCCL in use lacks them (version below 2.27 / 2.28).
  std::function<ncclResult_t(ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int)> shrink;
  std::function<ncclResult_t(ncclComm_t, int)> revoke;
  std::function<ncclResult_t(ncclComm_t)> abort;
  std::function<ncclResult_t(ncclComm_t, ncclResult_t*)> getAsyncError;
  std::function<std::string(ncclComm_t)> lastError;
  int version = 0;  // NCCL_VERSION_CODE style (22809 for 2.28.9)

  // The linked NCCL (ncclGetVersion decides which optional entry points are set).
  static NcclFtApi real();
};

// What to do with the NCCL communicator when the FT communicator changes epoch.
struct NcclRebuildPlan {
  enum class Kind { kShrink, kReinit };
  Kind kind = Kind::kReinit;
  std::vector<int> exclude;  // kShrink: old ranks to leave out, ascending
  std::string reason;        // kReinit: why not a shrink
};
// Pure: a shrink whose members are all old members, in old order, with a live parent
// and an NCCL that can shrink, shrinks; everything else re-creates.
NcclRebuildPlan planNcclRebuild(const ft::EpochChange& change, bool have_parent, bool can_shrink);

struct NcclFtOptions {
  int device = -1;             // CUDA device (cudaSetDevice before NCCL calls); -1: leave as is
  bool allow_shrink = true;    // false: always re-create
  Millis timeout{0};           // each NCCL wait (init, shrink); 0: the FT communicator's timeout
  Millis watchdog_period{50};  // ncclCommGetAsyncError polling; 0: no watchdog
  std::string name;            // config.commName
};

class NcclFtComm : public ft::EpochResource, public std::enable_shared_from_this<NcclFtComm> {
 public:
  // Collective over ft's current members: creates the current epoch's NCCL
  // communicator (unique id through the epoch's store) and attaches to ft.
  static std::shared_ptr<NcclFtComm> create(ft::FaultTolerantComm& ft, NcclFtOptions options = {},
                                            NcclFtApi api = NcclFtApi::real());
  ~NcclFtComm() override;
  NcclFtComm(const NcclFtComm&) = delete;
  NcclFtComm& operator=(const NcclFtComm&) = delete;

  // The current NCCL communicator; InvalidUsage once revoked (until the next epoch).
  ncclComm_t get() const;
  int rank() const;
  int size() const;
  uint64_t epoch() const;
  bool revoked() const { return revoked_.load(); }
  // How the last epoch's communicator was made: "init", "shrink", "reinit: <why>".
  std::string lastRebuild() const;
  // Stops the watchdog and aborts the communicator (the destructor does this).
  void close();

  void abortEpoch(const std::string& reason, std::exception_ptr error) override;
  void advance(const ft::EpochChange& change) override;

 private:
  NcclFtComm(NcclFtOptions options, NcclFtApi api) : options_(std::move(options)), api_(std::move(api)) {}
  std::string key(const char* what) const;  // store key of this instance in the epoch
  void setDevice() const;
  ncclConfig_t config() const;
  // Polls the communicator's async state until it leaves ncclInProgress.
  ncclResult_t waitReady(ncclComm_t comm, const std::string& op, Deadline deadline) const;
  [[noreturn]] void fail(ncclResult_t r, ncclComm_t comm, const std::string& op) const;
  ncclComm_t initFromStore(const std::shared_ptr<Communicator>& comm, const std::string& key);
  bool tryShrink(ncclComm_t parent, const std::vector<int>& exclude, ncclComm_t* out, std::string* why);
  bool everyoneAgrees(const std::shared_ptr<Communicator>& comm, const std::string& key, bool mine,
                      std::string* why);
  void releaseParent(ncclComm_t parent);
  void watchdog();

  NcclFtOptions options_;
  NcclFtApi api_;
  Millis timeout_{0};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  ncclComm_t comm_ = nullptr;
  std::weak_ptr<Communicator> epoch_comm_;  // the FT epoch this NCCL communicator belongs to
  uint64_t epoch_ = 0;
  int rank_ = 0, size_ = 0;
  std::string last_rebuild_;
  std::atomic<bool> revoked_{false};
  bool stopping_ = false;
  std::thread watchdog_;
};

}  // namespace crossbar::cuda
