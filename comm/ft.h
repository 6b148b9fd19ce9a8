// Fault-tolerant communicators: detect failed ranks, revoke, shrink to the
// survivors and grow back with replacement processes, without restarting the job.
//
// A FaultTolerantComm wraps a Communicator of one *epoch*. Every epoch has its own
// store namespace ("crossbar/ft/<name>/e<k>/..."), its own Context (transports) and
// its own FailureDetector thread that
//   * checks same-host peers' processes (/proc/<pid>/stat: gone or zombie = dead),
//   * exchanges heartbeats through the store (no progress for detect_timeout = hung,
//     reported as Timeout, never as dead),
//   * watches the epoch's revoke key: the first rank that detects a failure writes it
//     and every survivor aborts the epoch's pending work with PeerFailure/Timeout
//     naming the failed ranks and hosts,
//   * sends a zero-byte probe over the data path (UCX) to every peer on another node
//     each heartbeat: a peer whose probes stop while its store heartbeat continues is
//     alive but unreachable (a cut link), even when no operation waits on it,
//   * treats a store that stays unreachable for detect_timeout as a fatal error.
// shrink(): survivors post their views; the lowest live rank decides the member list
// of the next epoch (compare-and-set on the epoch's decision key, so there is one
// decision); a rank that is not in it (e.g. it was only stopped) gets Excluded.
// grow(n): replacement processes call join(); rank 0 admits them in arrival order.
//
// The store must outlive every rank (crossbar-store, or the launcher's). Use a
// separate store connection for the detector (FtOptions::detector_store) when the
// store is a TcpStore: its client serializes calls, and a long blocking get() on the
// main connection would delay heartbeats.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/store.h"

namespace crossbar::ft {

enum class FailureKind {
  kDead,         // process gone (pid check) or transport hang-up confirmed by a stopped heartbeat
  kHung,         // alive (or unknown) but no heartbeat for detect_timeout: Timeout
  kUnreachable,  // alive and heartbeating, but the transport to it failed (cut link)
  kStoreLost,    // the store did not answer for detect_timeout
};
const char* failureKindName(FailureKind kind);

struct PeerFault {
  int rank = -1;  // in the epoch's communicator
  FailureKind kind = FailureKind::kDead;
  std::string host;
  int pid = 0;
  int reporter = -1;             // rank that detected it
  std::string detail;            // how it was detected ("process gone", "stopped (state T)", ...)
  std::string describe() const;  // "rank 3 (host a, pid 12) died"
};

struct FailureEvent {
  uint64_t epoch = 0;
  std::vector<PeerFault> faults;
  bool local = false;   // detected by this rank (false: learnt from another rank's revoke)
  std::string message;  // what the aborted operations report
};
using FailureCallback = std::function<void(const FailureEvent&)>;
struct CallbackList;  // callbacks and attached resources, shared by the epochs' detectors

// Thrown by shrink()/grow() on a rank the agreed membership left out.
class Excluded : public Aborted {
 public:
  using Aborted::Aborted;
};

struct FtOptions {
  CommOptions comm;                       // for each epoch's Communicator (epoch is set by ft)
  std::string name = "ft";                // store namespace: several FT communicators can share a store
  Millis detect_timeout{0};               // 0: CROSSBAR_FT_DETECT_TIMEOUT
  Millis heartbeat_interval{0};           // 0: CROSSBAR_FT_HEARTBEAT
  std::shared_ptr<Store> detector_store;  // default: the main store (see above)
  bool data_path_probes = true;           // probe peers on other nodes (cut-link detection)
};

// Something built per epoch over the communicator (an NCCL communicator, a torch
// process group) that must fail with the epoch and be rebuilt for the next one.
// Attach it with FaultTolerantComm::attach().
struct EpochChange {
  uint64_t old_epoch = 0, new_epoch = 0;
  bool shrink = false;  // false: grow (or the first epoch of a joiner)
  int old_size = 0;
  std::vector<int> old_rank_of;        // per new rank: its rank in the old epoch, -1 for a joiner
  std::vector<int> excluded;           // old ranks that are not in the new epoch (ascending)
  std::shared_ptr<Communicator> comm;  // the new epoch's communicator
};
class EpochResource {
 public:
  virtual ~EpochResource() = default;
  // The epoch was revoked (detector thread, abort(), or a transition): fail pending
  // work now. Nonblocking, idempotent, thread-safe.
  virtual void abortEpoch(const std::string& reason, std::exception_ptr error) = 0;
  // Collective over the new epoch's members, called inside shrink()/grow() once the
  // new communicator exists (and by join() for the joiner's first epoch).
  virtual void advance(const EpochChange& change) = 0;
};

// One member of an epoch: enough to check liveness and to recognise itself.
struct Member {
  std::string host;
  int pid = 0;
  std::string id() const;  // "host:pid"
};

// Background failure detection for one epoch's communicator.
class FailureDetector {
 public:
  FailureDetector(std::shared_ptr<Store> epoch_store, std::shared_ptr<Communicator> comm,
                  std::vector<Member> members, Millis detect_timeout, Millis heartbeat_interval,
                  std::shared_ptr<CallbackList> callbacks, bool data_path_probes = true);
  ~FailureDetector();
  FailureDetector(const FailureDetector&) = delete;
  FailureDetector& operator=(const FailureDetector&) = delete;

  uint64_t epoch() const { return epoch_; }
  Millis detectTimeout() const { return detect_timeout_; }
  // Faults known here: detected locally or read from the revoke key.
  std::vector<PeerFault> faults() const;
  bool revoked() const { return revoked_.load(); }
  // Marks the epoch failed for everyone (first writer of the revoke key wins) and
  // aborts local pending work. Idempotent; an empty list revokes without blame.
  void revoke(std::vector<PeerFault> faults, const std::string& why);
  // Classifies ranks a transport error named (dead / hung / unreachable) and revokes.
  // Peers that turn out to be alive count as unreachable only if nobody revoked the
  // epoch meanwhile (a survivor's abort is not a cut link).
  std::vector<PeerFault> classify(const std::vector<int>& ranks);
  // For other errors that name peers (a failed system call on a peer's memory, ...):
  // those of `ranks` whose process is gone are dead; revokes (blaming nobody else).
  std::vector<PeerFault> blameDead(const std::vector<int>& ranks, const std::string& why);
  void stop();

 private:
  void run();
  void tick(bool heartbeat);
  void flushRevoke();  // writes a pending revoke to the store (detector thread / stop())
  void adopt(const std::string& revoke_text);  // a revoke written by someone else
  void fire(const FailureEvent& event);
  void abortEpoch(const std::string& why, std::exception_ptr error);  // communicator and resources
  std::exception_ptr errorFor(const std::vector<PeerFault>& faults, const std::string& message) const;
  bool processGone(int rank, char* state) const;
  bool leftCleanly(int rank);  // the rank closed its FaultTolerantComm (not a failure)
  bool peerReady(int rank);    // the rank's communicator of this epoch exists ("ready/<rank>")
  // Data-path probes to peers on other nodes; returns their faults (cut links).
  void probe(bool send, const std::set<int>& known, std::vector<PeerFault>& found);

  std::shared_ptr<Store> store_;  // this epoch's namespace, detector connection
  std::shared_ptr<Communicator> comm_;
  std::vector<Member> members_;
  uint64_t epoch_ = 0;
  int rank_ = 0;
  Millis detect_timeout_, heartbeat_interval_;
  std::shared_ptr<CallbackList> callbacks_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<PeerFault> faults_;
  std::atomic<bool> revoked_{false};
  std::vector<int64_t> last_hb_;
  std::vector<Clock::time_point> last_change_;
  Clock::time_point last_tick_, last_heartbeat_, store_ok_since_;
  bool store_failing_ = false;
  std::string pending_revoke_;  // revoke text not yet in the store
  std::set<int> left_;          // ranks that closed cleanly
  // Probes (detector thread only): zero-byte messages, so a request that outlives us
  // never writes into freed memory.
  struct Probe {
    int rank = -1;
    RequestPtr recv;
    std::vector<RequestPtr> sends;  // bounded: a cut link must not pile them up
    Clock::time_point last_seen;
    bool broken = false;  // the transport failed the probe: it stays silent from now
    // The peer's communicator exists (its "ready/<rank>" key, or a probe from it). Until
    // then it may still be building the epoch, blocked on another member: its silence
    // on the data path is not held against it (its heartbeat and setup watch cover it).
    bool ready = false;
  };
  std::vector<Probe> probes_;
  std::thread thread_;
};

// The shrink agreement's decision rule (the leader runs it; exposed for tests).
// Every fault in a view is an accusation "reporter cannot use rank": views carry the
// poster's own findings and those it adopted from revokes, each under its real reporter,
// so a relayed accusation counts once, for whoever made it. Accusations are applied
// the leader's first, then by reporter: an excluded reporter's accusations no longer
// count, and one against the leader excludes the reporter instead (of two sides of a
// cut link, the leader's stays). Ranks that left cleanly are out.
struct Agreement {
  std::vector<int> members;  // posted a view and not excluded (ascending)
  std::vector<int> waiting;  // not excluded but no view yet: the leader waits for them
  std::set<int> excluded;
};
Agreement agree(int size, int leader, const std::map<int, std::vector<PeerFault>>& views,
                const std::set<int>& left = {});

class SetupWatch;  // ft.cc: member liveness while an epoch's communicator is built

class FaultTolerantComm {
 public:
  // Collective over the `size` initial ranks (epoch 0).
  static std::unique_ptr<FaultTolerantComm> create(std::shared_ptr<Store> store, int rank, int size,
                                                   FtOptions options = {});
  // A new process (replacement) asks to join; returns once the members' grow()
  // admitted it, as a member of the new epoch. Timeout after options.comm.timeout.
  static std::unique_ptr<FaultTolerantComm> join(std::shared_ptr<Store> store, FtOptions options = {});
  ~FaultTolerantComm();

  const std::shared_ptr<Communicator>& comm() const { return comm_; }
  FailureDetector& detector() const { return *detector_; }
  uint64_t epoch() const { return epoch_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(members_.size()); }
  // Called on every failure event from the thread that saw it (usually the detector's):
  // keep them short, and never call shrink()/grow()/close() from one (they stop that thread).
  void onFailure(FailureCallback callback);

  // Turns an error from an operation on comm() into faults (dead / hung / unreachable)
  // and revokes the epoch. Safe to call with any exception.
  std::vector<PeerFault> handleError(const std::exception& error);

  // Collective over the survivors: agree on the members of epoch+1 (failed and slow
  // ranks left out, ranks renumbered in old order), rebuild transports, continue.
  // Throws Excluded on a rank that the agreement left out. If a member fails while
  // epoch+1 is being built, throws PeerFailure (dead) or Timeout (silent) naming it
  // within the detection bound; comm() is then null, and handleError() + shrink()
  // again continue without it (the attached resources see one combined change).
  std::shared_ptr<Communicator> shrink();
  // Collective over the members: admit target_size - size() joiners (in arrival order).
  std::shared_ptr<Communicator> grow(int target_size);

  // Nonblocking, thread-safe, idempotent: revokes the epoch for everyone and fails pending work.
  void abort(const std::string& reason);
  // Ties `resource` to this communicator's epochs: it is aborted on every revoke and
  // advanced on every transition (collective: every member attaches the same kinds of
  // resources in the same order). Call between operations, not during shrink()/grow().
  void attach(std::shared_ptr<EpochResource> resource);
  void detach(const EpochResource* resource);
  // Leaves cleanly: peers' detectors will not report this process's exit as a failure.
  // The destructor calls it; a process that exits without it looks dead, as it should.
  void close();

 private:
  FaultTolerantComm() = default;
  // Builds epoch `epoch` from the member list; `my_rank` indexes into it.
  void enter(uint64_t epoch, std::vector<Member> members, int my_rank);
  void requireOpen(const char* op) const;  // InvalidUsage after close() or Excluded
  bool setupFailed() const { return !comm_ && !setup_faults_.empty(); }
  // The detector's, or the failed setup's and what its watch found since.
  std::vector<PeerFault> currentFaults() const;
  Deadline operationDeadline() const;
  std::string epochPrefix(uint64_t epoch) const;
  std::shared_ptr<Store> epochStore(uint64_t epoch, bool detector) const;
  // Waits for the transition decision of the current epoch (leader writes it via `decide`).
  std::string awaitDecision(const std::function<std::string()>& leader_decide, bool shrinking);
  // Leaves the current epoch and enters the one `decision` describes (Excluded if not in it).
  std::shared_ptr<Communicator> applyDecision(const std::string& decision, bool first);

  std::shared_ptr<Store> store_;           // "crossbar/ft/<name>" namespace
  std::shared_ptr<Store> detector_store_;  // same namespace, detector connection
  FtOptions options_;
  Millis detect_timeout_{0}, heartbeat_interval_{0};
  uint64_t epoch_ = 0;
  std::vector<Member> members_;
  int rank_ = -1;  // in epoch_
  // The UCX worker and endpoints every epoch of this object reuses: survivors of a
  // shrink wire nothing up anew (docs/fault-tolerance.md, "Epochs"). Before comm_:
  // destroyed after it.
  std::shared_ptr<ucx::Fabric> ucx_fabric_;
  std::shared_ptr<Communicator> comm_;
  // Set when building epoch_'s communicator failed: who failed, and the change the
  // attached resources have not seen yet (composed with the next one).
  std::vector<PeerFault> setup_faults_;
  std::unique_ptr<EpochChange> unadvanced_;
  std::shared_ptr<SetupWatch> setup_watch_;  // from the decision until enter() takes it
  // After a failed setup, until the next decision: keeps this rank's heartbeat and finds
  // members that die meanwhile (a leader that dies in the agreement is replaced).
  std::shared_ptr<SetupWatch> failed_setup_watch_;
  std::unique_ptr<FailureDetector> detector_;
  std::shared_ptr<CallbackList> callbacks_;  // also holds the attached resources
};

}  // namespace crossbar::ft
