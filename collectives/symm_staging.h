// Symmetric staging for the host symmetric-memory collectives (symm_algorithms.cc).
//
// Every rank of one (intra-node) communicator owns a symmetric buffer of two halves.
// A chunk is staged by its owner into one half and read by peers straight from the
// owner's mapping (one copy in, one copy or reduction out), so the protocol is:
//   owner:  acquire(h) -> write half h -> publish(h, reader) (READY signal)
//   reader: wait(owner, kReady) -> read owner's half h -> release(owner) (FREE signal)
// Signal counters only grow, and each (channel, peer) pair is consumed in order, so
// the owner remembers, per reader, which halves it still owes a FREE for (a FIFO) and
// acquire() consumes FREE signals only when it reuses a half: a small collective
// pays no trailing synchronization, the next use of the same half does.
// Chunk k of an operation uses half (base + k) % 2 where `base` advances by the same
// amount on every rank (operations run in the same order everywhere).
//
// Single copy (CMA, cma.h): when every rank can read its peers' memory (probed once, at
// creation, and agreed by all), an owner posts the address of its *user* buffer in its
// metadata slot (post: ADDR signal) and readers copy straight from it with
// process_vm_readv (readPosted: DONE signal back). The owner waits for every reader's
// DONE before its operation completes (waitReaders), so the caller may reuse the
// buffer as soon as the Work completes; the slot is then free for the next operation.
//
// Zero copy (every staged algorithm; ZeroCopy below): an owner whose input already lies
// in a symmetric buffer allocated over this same communicator (every rank maps it) does
// not stage it. With its first chunk's READY (half h, after acquire(h)) every owner
// announces per reader whether its input is staged or "direct at (buffer, offset)"; a
// reader of a direct owner reads the owner's input from its mapping of that buffer: the
// data movers copy the whole block at once, the reductions read chunk k in place where
// they would read the staged chunk k (after the same READY). The owner does not return
// before every reader is done with its input: finish() waits for the FREEs it is owed
// (two-shot needs no wait: a peer's REDUCED for a chunk comes after its reads of it).
// The announcement sits in the owner's metadata per half, so a reader still reading the
// previous announcement of the other half is never overtaken.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/reduce.h"
#include "comm/communicator.h"
#include "comm/deadline.h"
#include "symmem/symmetric_heap.h"

namespace crossbar {

class SymmStaging {
 public:
  static constexpr int kReady = 0;    // owner -> reader: the chunk is in the owner's half
  static constexpr int kReduced = 1;  // owner -> reader: second-phase data (two-shot) is ready
  static constexpr int kFree = 2;     // reader -> owner: done reading the owner's half
  static constexpr int kAddr = 3;     // owner -> reader: user-buffer address posted (CMA)
  static constexpr int kDone = 4;     // reader -> owner: done reading the owner's user buffer
  static constexpr int kChannels = 5;

  // Collective over `comm` (every rank at the same point of its operation sequence).
  SymmStaging(std::shared_ptr<Communicator> comm, size_t bytes, size_t chunk);

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t halfBytes() const { return half_; }
  size_t chunkBytes() const { return chunk_; }  // largest chunk per rank (<= halfBytes)
  // Outputs of at least this many bytes per rank are written with streaming stores by the
  // data movers (CROSSBAR_COLL_STREAM_BYTES).
  size_t streamBytes() const { return stream_bytes_; }
  void setStreamBytes(size_t b) { stream_bytes_ = b; }
  char* mine(int h) const { return slot(rank_, h); }
  char* slot(int rank, int h) const { return static_cast<char*>(buf_->peerPtr(rank)) + h * half_; }
  int halfOf(uint64_t k) const { return static_cast<int>((base_ + k) & 1); }
  void advance(uint64_t chunks) { base_ += chunks; }

  // Waits until every reader of this rank's half h has released it.
  void acquire(int h, Deadline deadline);
  // Waits until every reader has released everything this rank published to it. A zero
  // copy owner may wait here without ever waiting for peer data (broadcast's root, a
  // reduce's non-root): the call check's verdict first, so a peer that called something
  // else is reported as a mismatch, not waited for until the deadline.
  void acquireAll(Deadline deadline) {
    runPendingCheck();
    acquire(0, deadline);
    acquire(1, deadline);
  }
  // READY to `reader`, who now owes a FREE for half h.
  void publish(int h, int reader);
  void notify(int peer, int channel) { buf_->putSignal(peer, channel); }
  // Next signal from `peer` on `channel`: a spin (CROSSBAR_SPIN_US when this node's
  // ranks have a core each, else a few hundred pauses), then yielding the core (with
  // more ranks than cores the peer may be waiting for this very core), then the
  // symmetric buffer's blocking wait (futex, deadline, peer-failure checks).
  void wait(int peer, int channel, Deadline deadline);
  // This operation's pending call check (RunContext::verify_calls, may be null): run by
  // the first wait for peer data (READY, REDUCED, ADDR), before it returns.
  void setPendingCheck(std::function<void()>* check) { pending_check_ = check; }
  void runPendingCheck();
  void release(int owner) { buf_->putSignal(owner, kFree); }

  // Copies into this rank's half(s) for peers to read: plain or streaming stores,
  // whichever has copied faster on this rank lately (symm_algorithms.cc says why).
  void stageCopy(void* dst, const void* src, size_t bytes);

  // Helpers over every peer but this rank.
  void publishAll(int h);
  void notifyAll(int channel);
  void waitAll(int channel, Deadline deadline);
  void releaseAll();

  // Single copy: whether every rank of the communicator can read every peer (agreed).
  // Collective on the first call (every rank at the same operation): the probe runs
  // only when a single-copy algorithm is first used, so a process that never uses one
  // never relaxes its ptrace policy (Yama).
  bool cma(Deadline deadline);
  const std::string& cmaReason() const { return cma_reason_; }  // why not ("" if cma())
  // Owner: `reader` may read [addr, addr + bytes) of this process (ADDR signal).
  void post(int reader, const void* addr, size_t bytes);
  // Reader: waits for `owner`'s post, copies it to `dst` (its size must be `bytes`),
  // then signals DONE. `op` names the operation in errors.
  void readPosted(int owner, void* dst, size_t bytes, Deadline deadline, const char* op);
  // Owner: waits for DONE from `reader` (one per post to it).
  void waitReader(int reader, Deadline deadline) { wait(reader, kDone, deadline); }

  // Zero copy (see the top; algorithms use ZeroCopy). The symmetric buffer holding all of
  // [p, p + bytes) at an offset that is a multiple of `align`, if it is host memory
  // allocated over this communicator; null buffer: stage as usual.
  struct Direct {
    std::shared_ptr<symm::SymmetricBuffer> buffer;
    size_t offset = 0;
  };
  Direct directSource(const void* p, size_t bytes, size_t align = 1) const;
  // Owner, after acquire(h) and before publish(h, reader): `reader`'s block of this
  // operation is `bytes` at d.offset of d.buffer (or staged when d.buffer is null).
  // `which`: the buffer of the operation (0: its input; 1: two-shot's output).
  void announce(int h, int reader, const Direct& d, size_t bytes, int which = 0);
  // Reader, after the owner's READY for half h: where to copy the owner's block from in
  // place (`bytes` long), or nullptr when it is staged. `op` names the operation in errors.
  const char* announced(int owner, int h, size_t bytes, const char* op, int which = 0);

 private:
  struct MetaHeader {
    uint64_t pid, token_addr, token, probe_ok;
  };
  struct MetaEntry {
    uint64_t addr, bytes;
  };
  struct DirectEntry {  // zero copy: [which][half][reader] after the MetaEntry array
    uint64_t direct, heap_id, buffer_id, offset, bytes;
  };
  MetaHeader* meta(int rank) const;
  MetaEntry* entry(int owner, int reader) const {
    return reinterpret_cast<MetaEntry*>(meta(owner) + 1) + reader;
  }
  DirectEntry* directEntry(int owner, int h, int reader, int which) const {
    return reinterpret_cast<DirectEntry*>(entry(owner, size_)) + (which * 2 + h) * size_ + reader;
  }
  void probeCma(Deadline deadline);

  std::shared_ptr<Communicator> comm_;
  symm::SymmetricHeap heap_;
  std::shared_ptr<symm::SymmetricBuffer> buf_;
  int rank_ = 0, size_ = 0;
  size_t half_ = 0, chunk_ = 0, stream_bytes_ = size_t{2} << 20;
  uint64_t base_ = 0;
  Clock::duration spin_{};                 // pure spin before yielding: CROSSBAR_SPIN_US when ranks <= cores
  std::vector<std::deque<uint8_t>> owed_;  // by reader: halves it still has to release, oldest first
  std::vector<uint64_t> seen_;             // [channel * size + peer]: signals consumed so far
  bool cma_ = false, cma_probed_ = false;
  std::string cma_reason_;
  std::vector<int64_t> pids_;  // by rank (CMA)
  double stage_plain_ns_ = 0, stage_stream_ns_ = 0;  // recent ns per KiB of stageCopy (0: not yet)
  uint64_t stage_copies_ = 0;
  uint64_t token_ = 0;         // read by peers in the probe
  std::function<void()>* pending_check_ = nullptr;
};

// Zero copy of one operation's input, on every rank (symm_staging.h top): this rank as an
// owner (its input [in, in + bytes)) and as a reader (what each owner announced).
class ZeroCopy {
 public:
  // `allowed`: false where the operation writes into its input while peers may read it
  // (then it is staged). `align`: the element size (reductions read typed elements).
  // `which`: 0 for the input; 1 for a second buffer read in place (two-shot's output).
  ZeroCopy(SymmStaging& s, const void* in, size_t bytes, size_t align, bool allowed, int which = 0);
  bool direct() const { return d_.buffer != nullptr; }  // this rank's input is read in place
  // Owner, at its first chunk (after acquire(h), before publish(h, reader)): `reader`
  // reads [in + offset, + bytes) in place, or from the staging when not direct().
  void announce(int h, int reader, size_t offset, size_t bytes);
  void announceAll(int h, size_t offset, size_t bytes);
  // Reader, after `owner`'s first READY (half h): the owner's announced range in this
  // rank's mapping, or nullptr when staged; kept as from(owner). `op` names the
  // operation in errors.
  const char* learn(int owner, int h, size_t bytes, const char* op);
  const char* from(int owner) const { return from_[owner]; }
  // Owner, last (when direct()): every reader is done with the input once this returns,
  // so the caller may overwrite it as soon as the operation completes.
  void finish(Deadline deadline) {
    if (direct()) s_.acquireAll(deadline);
  }

 private:
  SymmStaging& s_;
  SymmStaging::Direct d_;
  int which_ = 0;
  std::vector<const char*> from_;  // by owner
};

// Blocks this process read in place from peers' symmetric input (zero copy), all staging
// areas together: tests and telemetry check that the direct path was taken.
uint64_t symmDirectReads();

// The staging areas of one Collectives, by communicator (the whole one, or the
// intra-node one of the hierarchical algorithms), created at first use.
class SymmCache {
 public:
  SymmCache();
  size_t bytes() const { return bytes_; }  // CROSSBAR_COLL_SYMM_BYTES (0: disabled)
  SymmStaging& get(Communicator& comm);
  bool has(Communicator& comm);  // get() would not create it (creating is collective)

 private:
  size_t bytes_ = 0, chunk_ = 0, stream_bytes_ = 0;
  std::mutex mutex_;
  std::map<const Communicator*, std::unique_ptr<SymmStaging>> states_;
};

// Blocks of a buffer: block b at element off[b], len[b] elements.
struct Blocks {
  std::vector<size_t> off, len;
  size_t maxLen() const { return len.empty() ? 0 : *std::max_element(len.begin(), len.end()); }
};

// Building blocks of the symmetric-memory algorithms, also used by the hierarchical
// ones (hier_algorithms.cc), over the staging of one intra-node communicator (B has
// one block per rank of it). symmReduceScatter: rank r's `out` (len[r] elements) =
// reduce over ranks of their input block r (full op: premul scaling, avg division).
// symmAllgather: every rank's `mine` (len[r] elements) lands at out + off[r] on every
// rank (`nt`: streaming stores). `zero_copy`: peers read `in` / `mine` in place when it
// lies in a symmetric buffer of this communicator.
void symmReduceScatter(SymmStaging& s, const RunContext& x, const void* in, void* out, const Blocks& B,
                       DataType t, ReduceOp op, const ReduceParams& prm, bool zero_copy = false);
void symmAllgather(SymmStaging& s, const RunContext& x, const void* mine, void* out, const Blocks& B,
                   DataType t, bool nt, bool zero_copy = false);

}  // namespace crossbar
