// Mismatched-call detection: before a collective moves data, the ranks compare what
// each of them called (collective, count, type, op, root and its position in the call
// sequence), so a mismatch raises InvalidUsage on every rank, naming the ranks that
// differ and what differs, instead of hanging or corrupting memory.
//
// Modes (CROSSBAR_CHECK_CALLS):
//   off    no check.
//   cheap  (default) within one node: every rank writes its call (32 bytes; alltoallv:
//          plus its per-peer counts) into a slot of a small symmetric buffer, signals its
//          peers and reads theirs, so every rank sees the same table of calls (no
//          messages; the signal pads' futex waits). The ranks must all arrive before the
//          data moves, which the collective itself needs anyway, so the added cost is a
//          few cache lines per peer.
//          Across nodes: each rank hashes its call into 8 bytes; a dissemination exchange
//          (ceil(log2 ranks) rounds of one 16-byte message) gives every rank the global
//          minimum and maximum hash. Equal: every rank called the same. Different (seen
//          by every rank at once): the ranks exchange their full calls to build the report.
//          (alltoallv counts per pair are not compared across nodes in this mode.)
//   full   every rank sends its complete call, alltoallv counts per peer included, to
//          every other rank on each collective; also checks that rank i's send count to
//          j equals j's receive count from i. For debugging: O(ranks) messages per call.
// Point-to-point calls (send/recv) are not checked: they need not pair up per call.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "collectives/algorithms.h"
#include "comm/communicator.h"
#include "comm/deadline.h"
#include "symmem/symmetric_heap.h"

namespace crossbar {

enum class CallCheckMode { kOff, kCheap, kFull };
CallCheckMode callCheckModeFromEnv();  // CROSSBAR_CHECK_CALLS (InvalidArgument on bad values)
const char* callCheckModeName(CallCheckMode mode);

// What one rank called, normalized so that fields a collective ignores compare equal
// (op outside reductions, root outside rooted collectives, count of alltoallv).
struct CallSignature {
  int32_t coll = -1;
  int32_t type = -1;
  int32_t op = -1;
  int32_t root = -1;
  uint64_t count = 0;
  uint64_t seq = 0;  // position in this Collectives' sequence of collectives
  // alltoallv only, in full mode: elements sent to / received from each rank.
  std::vector<uint64_t> send_counts, recv_counts;

  // Inline: every small call computes its own (the eager header stores it).
  static CallSignature of(const CollArgs& a, uint64_t seq, bool with_counts) {
    CallSignature s;
    s.coll = static_cast<int32_t>(a.coll);
    s.type = a.coll == CollType::kBarrier ? -1 : static_cast<int32_t>(a.type);
    s.op = hasReduceOp(a.coll) ? static_cast<int32_t>(a.op) : -1;
    s.root = hasRoot(a.coll) ? a.root : -1;
    s.count = a.coll == CollType::kAlltoallv || a.coll == CollType::kBarrier ? 0 : a.count;
    s.seq = seq;
    if (with_counts && a.coll == CollType::kAlltoallv) {
      s.send_counts.assign(a.send_counts.begin(), a.send_counts.end());
      s.recv_counts.assign(a.recv_counts.begin(), a.recv_counts.end());
    }
    return s;
  }
  uint64_t hash() const;         // of every field but the per-peer counts
  std::string describe() const;  // "allreduce of 64 x float32 sum (collective #3)"
  std::vector<uint8_t> serialize() const;
  // Throws InvalidUsage when `bytes` is not a signature of `nranks` ranks.
  static CallSignature parse(const uint8_t* bytes, size_t n, int nranks);
};

struct Mismatch {
  std::string message;     // empty: the calls agree
  std::vector<int> ranks;  // the ranks that differ from the majority (or the pairs' ranks)
};

// Compares every rank's call (index = rank). The reference is the largest group of
// identical calls (ties: the one containing the lowest rank); every other group is
// reported against it, field by field. Pure function: every rank computes the same.
Mismatch findMismatch(const std::vector<CallSignature>& calls);

// The collective check of one call; every rank of `comm` runs it with its own view of
// collective number `seq`. Throws InvalidUsage (identical text on every rank) on a
// mismatch, Timeout when a peer does not reach the check before `deadline`. Owns the
// message buffers, so keep it alive as long as the communicator's traffic (a check cut
// short by a timeout may still receive into them).
class CallChecker {
 public:
  explicit CallChecker(CallCheckMode mode) : mode_(mode) {}
  CallCheckMode mode() const { return mode_; }
  void check(const std::shared_ptr<Communicator>& comm, const CollArgs& a, uint64_t seq, Deadline deadline);
  // check() in two halves, for algorithms that read peers' data only after a wait they
  // announce (RunContext::verify_calls): post() publishes this rank's call (cheap mode,
  // one node; false where the check cannot be split: call check() instead), and
  // verifyPosted() waits for every peer's and compares, as check() does, just before
  // the first read of peer data, so the wait overlaps this rank's own first steps.
  bool post(const std::shared_ptr<Communicator>& comm, const CollArgs& a, uint64_t seq, Deadline deadline);
  void verifyPosted(const std::shared_ptr<Communicator>& comm, Deadline deadline);
  // The same exchange, returning the mismatch (empty message: the calls agree) instead of
  // throwing it; still throws Timeout, or InvalidUsage for a malformed peer signature.
  Mismatch compare(const std::shared_ptr<Communicator>& comm, const CollArgs& a, uint64_t seq,
                   Deadline deadline);

  // Hooks of the eager path (eager.h), which publishes its call in its own slots:
  // ensureLocal creates the intra-node slots (collective; cheap mode) and then runs
  // `after_local_init`, so both paths create their buffers in the same order;
  // peekLocal reads `peer`'s slot of collective `seq` (false if not published there);
  // noteSkipped advances this rank's progress past a collective checked elsewhere; the
  // probe tells a waiting check that `peer` published `seq` on the eager path instead
  // (a mismatch, reported rather than waited out).
  using PeerProbe = std::function<bool(int peer, uint64_t seq, CallSignature* out)>;
  void setLocalHooks(std::function<void()> after_local_init, PeerProbe probe) {
    after_local_init_ = std::move(after_local_init);
    peer_probe_ = std::move(probe);
  }
  void ensureLocal(const std::shared_ptr<Communicator>& comm);
  bool peekLocal(int peer, uint64_t seq, CallSignature* out) const;
  void noteSkipped(uint64_t seq);

 private:
  // Cheap mode within one node; returns every rank's call.
  std::vector<CallSignature> exchangeLocal(const std::shared_ptr<Communicator>& comm,
                                           const CallSignature& mine, uint64_t seq, Deadline deadline);
  // exchangeLocal's halves: publish this rank's call; wait for and read the peers'.
  void postLocal(const std::shared_ptr<Communicator>& comm, const CallSignature& mine, uint64_t seq,
                 Deadline deadline);
  std::vector<CallSignature> collectLocal(const std::shared_ptr<Communicator>& comm, const CallSignature& mine,
                                          uint64_t seq, Deadline deadline);
  // Cheap mode across nodes: whether every rank's call hash is the same.
  bool sameHashEverywhere(Communicator& comm, const CallSignature& mine, uint64_t seq, Deadline deadline);
  std::vector<CallSignature> exchangeAll(Communicator& comm, const CallSignature& mine, uint64_t seq,
                                         Deadline deadline);
  [[noreturn]] void throwMismatch(int rank, const Mismatch& m) const;  // InvalidUsage with the report
  CallCheckMode mode_;
  uint64_t round_out_[2] = {0, 0}, round_in_[2] = {0, 0};
  std::vector<uint8_t> out_;
  std::vector<std::vector<uint8_t>> in_;
  symm::SymmetricHeap heap_;  // cheap mode, one node: created at the first check
  std::shared_ptr<symm::SymmetricBuffer> slots_;
  uint64_t local_checks_ = 0;  // signals consumed from each peer so far
  CallSignature posted_;       // post(): the call verifyPosted() compares
  std::function<void()> after_local_init_;
  PeerProbe peer_probe_;
};

// The check of stream-ordered calls (CudaCollectives), run on the calling thread at
// enqueue time, before anything of the call is enqueued on the GPU. The host knows the
// whole signature at the call, so it is exchanged there, through the same CallChecker
// (cheap: shared-memory slots within a node, a hash dissemination across nodes) on the
// caller's communicator: a mismatch raises InvalidUsage on every rank before any rank
// enqueues a kernel for that call, so no stream waits forever for a peer that called
// something else. The host waits only for the peers' hosts to reach the same call (never
// for a GPU): with every operation of a CudaCollectives running in issue order on one
// stream, a peer's host can only be blocked on GPU work issued before this call, which
// this rank has already enqueued, so the wait cannot deadlock.
//
// Sequence numbers count collectives only (point-to-point calls need not pair up per
// call), in every mode, so unbalanced send/recv keep the ranks in step.
class EnqueueCallCheck {
 public:
  explicit EnqueueCallCheck(CallCheckMode mode) : checker_(mode) {}
  CallCheckMode mode() const { return checker_.mode(); }

  // Call before enqueueing anything of `a` on `comm`'s rank. Returns the collective's
  // sequence number (point-to-point: -1, not checked). Throws
  //  * InvalidUsage on a mismatch: on every rank, at the same call, nothing of it enqueued
  //    anywhere; the sequence stays in step, so later (matching) calls still work;
  //  * Timeout when a peer does not reach the call before `deadline` (it called nothing,
  //    or is stuck): the peers' progress is then unknown, so every later call fails at
  //    once with InvalidUsage saying why (abort the communicator, start again).
  int64_t beforeEnqueue(const std::shared_ptr<Communicator>& comm, const CollArgs& a, Deadline deadline);
  uint64_t collectivesChecked() const { return next_seq_; }

 private:
  CallChecker checker_;
  uint64_t next_seq_ = 0;
  std::string broken_;  // a check failed without a verdict: the first error
};

}  // namespace crossbar
