// Eager small-message path (host memory, one node): allreduce, allgather,
// reduce_scatter, broadcast, alltoall and barrier below CROSSBAR_EAGER_BYTES (the
// selection table's "eager" algorithm).
//
// Every rank owns a ring of kEagerSlots slots in a small symmetric buffer; collective
// number `seq` uses slot seq % kEagerSlots. A slot is a cache-line header (the call's
// signature and seq + 1, stored last with release) followed by the rank's payload (its
// whole input, at most CROSSBAR_EAGER_BYTES). One store of the header publishes the
// data, the completion and the call's signature together: a reader that sees seq + 1
// in a peer's header compares the signature with its own call (the mismatch check of
// signature.h, without its separate signal round) and then reduces or copies straight
// out of the peer's slot. Every rank waits for every peer's header (broadcast and
// barrier included), so a mismatch is seen by every rank, with the same report.
//
// Flow control: a rank stores `done` (the last eager collective it finished, + 1) in
// its control line; a writer reuses a slot only when every peer's done has passed the
// collective that last used it (read rarely: the last value seen is kept).
//
// Waits follow the staging policy (CROSSBAR_SPIN_US spin when ranks <= cores, then
// yielding the core ~2 ms, then the symmetric buffer's futex wait with deadline, abort
// and peer-failure checks): a reader about to sleep flags itself in the writer's
// header, and a writer that sees the flag signals its peers.
//
// Mismatch with the other path: a peer that took a checked (non-eager) algorithm for
// the same collective writes its call-check slot instead (signature.h); an eager rank
// that waits finds it there (CallChecker::peekLocal) and a checked rank finds the eager
// rank's header through the probe the queue installs (CallChecker::setPeerProbe), so
// both report the mismatch instead of waiting out the deadline. The slots are created
// right after the call-check slots (CallChecker::setAfterLocalInit), so both paths
// create the two buffers in the same order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "collectives/algorithms.h"
#include "comm/communicator.h"
#include "comm/deadline.h"
#include "symmem/symmetric_heap.h"

namespace crossbar {

class CallChecker;
struct CallSignature;

inline constexpr uint64_t kEagerSlots = 16;

// CROSSBAR_EAGER_BYTES, read once: calls whose selection size (nccl-tests size) is
// below it may take the eager path; 0 disables it.
size_t eagerMaxBytes();
// The "eager" entries of the host algorithm registry (their `run` is not called: the
// queue runs eager calls through EagerChannel, which needs the sequence number).
void registerEagerAlgorithms(std::deque<Algorithm>& out);
// Whether the eager algorithm applies to this call (its `applies`, without the reason).
bool eagerFits(const CollArgs& a, const Communicator& comm);
bool isEagerAlgorithm(const Algorithm* a);

// The bytes an eager call reads from the caller (this rank's input, when it publishes;
// an alltoall's or reduce_scatter's own block when it completes; a broadcast's non-root
// publishes nothing, its range is still the buffer) and the bytes
// it writes for the caller when it completes.
struct ByteRange {
  const char* begin = nullptr;
  size_t bytes = 0;
  bool overlaps(const ByteRange& o) const {
    return bytes && o.bytes && begin < o.begin + o.bytes && o.begin < begin + bytes;
  }
};
ByteRange eagerInput(const CollArgs& a, int ranks);
ByteRange eagerOutput(const CollArgs& a, int ranks);

class EagerChannel {
  static constexpr size_t kLine = 64;         // a slot's header starts a cache line
  static constexpr size_t kHeaderBytes = 40;  // sizeof(Header); the payload follows in its line

 public:
  // `checker` (may be null) is the queue's call check: its local slots are created
  // first, its progress word advanced, and its slots probed while waiting.
  EagerChannel(std::shared_ptr<Communicator> comm, std::shared_ptr<CallChecker> checker);
  ~EagerChannel();

  // Runs collective number `seq` (every rank calls it at the same point). Throws
  // InvalidUsage on a mismatched call, Timeout / PeerFailure / Aborted from the waits.
  // `published`: an earlier tryRun() already published this rank's slot of `seq`.
  void run(const CollArgs& a, uint64_t seq, Deadline deadline, bool published = false);

  // The nonblocking form of run(), for the thread that issues the call: publishes this
  // rank's slot (once; sets *published) and completes the collective when every peer's
  // header is there within a few hundred pause instructions, or with `spin` within the
  // wait policy's spin (CROSSBAR_SPIN_US when ranks <= cores). Never sleeps, never
  // waits for a deadline. false: not finished yet (slots not created,
  // CROSSBAR_CHECK_CALLS=full, the slot still read by a peer, or a peer not there yet);
  // finish it with run(..., *published) or another tryRun. Once published, the peers
  // can finish the collective without this rank. Throws InvalidUsage on a mismatched
  // call, like run().
  bool tryRun(const CollArgs& a, uint64_t seq, bool* published, bool spin);

  // Publishes this rank's slot of `seq` now, if that needs no wait (slots created, the
  // slot free, no full call check): the issuing thread calls it before anything else
  // of a small call, so the line travels to the peers while the rest is set up. true:
  // published (finish with tryRun / run with published = true).
  bool tryPublish(const CollArgs& a, uint64_t seq);

  // Collective: creates the slots (idempotent). Called by the call check right after
  // its own slots, or by run() when there is no such check.
  void create();
  // Whether `peer` published collective `seq` in its eager slot; fills its signature.
  bool peek(int peer, uint64_t seq, CallSignature* out) const;

 private:
  struct Header;
  // Rank `rank`'s control line (its done word), then its slots: inline, from pointers
  // cached at create() (every small call reaches them several times).
  Header* header(int rank, uint64_t seq) const {
    return reinterpret_cast<Header*>(bases_[rank] + kLine + (seq % kEagerSlots) * slot_bytes_);
  }
  char* payload(int rank, uint64_t seq) const { return reinterpret_cast<char*>(header(rank, seq)) + kHeaderBytes; }
  uint64_t* doneWord(int rank) const { return reinterpret_cast<uint64_t*>(bases_[rank]); }
  void waitSlotFree(uint64_t seq, Deadline deadline);
  bool slotFree(uint64_t seq);  // waitSlotFree() without waiting
  // Payload, signature, then seq + 1 (release) in the own header; wakes sleeping readers.
  void publish(const CollArgs& a, uint64_t seq);
  // Every peer's header of `seq` within `spin` (no sleep).
  bool peersPublished(uint64_t seq, Clock::duration spin) const;
  // After publish(): waits for every peer's header, compares the calls, moves the data
  // and marks `seq` done.
  void complete(const CollArgs& a, uint64_t seq, Deadline deadline);
  // Waits for `peer`'s header of `seq`; false (with `theirs` filled) when the peer took
  // the checked path for it instead.
  bool awaitPeer(int peer, uint64_t seq, Deadline deadline, CallSignature* theirs);
  void runLocal(const CollArgs& a);

  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<CallChecker> checker_;
  int rank_ = 0, size_ = 1;
  size_t cap_ = 0, slot_bytes_ = 0;
  symm::SymmetricHeap heap_;
  std::shared_ptr<symm::SymmetricBuffer> buf_;
  std::vector<uint64_t> known_done_;  // by peer: the last done value read
  Clock::duration spin_{};
  std::vector<const void*> srcs_;
  std::vector<char*> bases_;  // by rank: the eager buffer's mapping (set by create())
};

}  // namespace crossbar
