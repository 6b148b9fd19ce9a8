// Eager small-message path (eager.h): slots, the waits and the six collectives.
#include "collectives/eager.h"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "collectives/reduce.h"
#include "collectives/signature.h"
#include "comm/context.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/fence.h"
#include "comm/log.h"
#include "comm/topology.h"
#include "telemetry/telemetry.h"

namespace crossbar {

namespace {
constexpr size_t kMaxEagerBytes = size_t{1} << 20;  // slots are kEagerSlots x this per rank at most
constexpr Millis kYieldPhase{2};
// How long tryRun() spins for peers that have not published yet. Peers running in step
// arrive within a few microseconds; one that is later is descheduled or busy, and a
// longer spin then only delays the issuing thread (measured: 50 us was 2-3x slower per
// 2-rank small allreduce than 10 us on the loaded 2-core VM; docs/performance.md).
constexpr auto kIssueSpin = std::chrono::microseconds(10);
// Sleeps are cut into slices so a waiting rank also notices a peer that took the
// checked path (its call-check slot) instead of waiting out the whole deadline. Longer
// than the symmetric buffer's own 100 ms sleep slice, after which it checks for an
// abort and for a dead peer (a shorter slice would never reach those checks).
constexpr Millis kSleepSlice{250};
constexpr int kWakeChannel = 0;

size_t roundUp(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}

bool reduces(CollType c) {
  return c == CollType::kAllreduce || c == CollType::kReduceScatter;
}

std::string eagerApplies(const CollArgs& a, const Communicator& comm) {
  const size_t limit = eagerMaxBytes();
  if (limit == 0) return "CROSSBAR_EAGER_BYTES=0 disables the eager path";
  if (comm.localSize() != comm.size())  // not one node (cheaper than numNodes())
    return fmt::format("{} nodes: eager slots are shared memory within one node", comm.numNodes());
  const size_t bytes = a.selectionBytes(comm.size());
  if (bytes >= limit) return fmt::format("{} bytes: not below CROSSBAR_EAGER_BYTES={}", bytes, limit);
  return "";
}

}  // namespace

bool eagerFits(const CollArgs& a, const Communicator& comm) {
  const size_t limit = eagerMaxBytes();
  return limit != 0 && comm.localSize() == comm.size() && a.selectionBytes(comm.size()) < limit;
}

// The header of one slot, `seq1` stored last (release). The payload starts right
// after it, in the rest of the header's cache line: a payload of up to 24 bytes
// reaches a reader with the header, one line transfer instead of two.
struct EagerChannel::Header {
  std::atomic<uint64_t> seq1;      // collective number + 1 (0: never used)
  std::atomic<uint32_t> sleepers;  // readers about to block on this slot (writer signals them)
  int32_t coll, type, op, root;
  uint32_t unused;
  uint64_t count;
};
static_assert(sizeof(std::atomic<uint64_t>) == 8 && sizeof(std::atomic<uint32_t>) == 4);

size_t eagerMaxBytes() {
  static const size_t limit = std::min(env::getSize("CROSSBAR_EAGER_BYTES"), kMaxEagerBytes);
  return limit;
}

ByteRange eagerInput(const CollArgs& a, int ranks) {
  const size_t blk = a.count * elementSize(a.type);
  switch (a.coll) {
    case CollType::kAllreduce:
    case CollType::kAllgather:
      return {static_cast<const char*>(a.send), blk};
    case CollType::kReduceScatter:
    case CollType::kAlltoall:
      return {static_cast<const char*>(a.send), blk * ranks};
    case CollType::kBroadcast:
      return {static_cast<const char*>(a.recv), blk};
    default:
      return {};
  }
}

ByteRange eagerOutput(const CollArgs& a, int ranks) {
  const size_t blk = a.count * elementSize(a.type);
  switch (a.coll) {
    case CollType::kAllreduce:
    case CollType::kReduceScatter:
    case CollType::kBroadcast:
      return {static_cast<const char*>(a.recv), blk};
    case CollType::kAllgather:
    case CollType::kAlltoall:
      return {static_cast<const char*>(a.recv), blk * ranks};
    default:
      return {};
  }
}

bool isEagerAlgorithm(const Algorithm* a) {
  return a && a->name == "eager";
}

void registerEagerAlgorithms(std::deque<Algorithm>& out) {
  auto add = [&](CollType c, const char* summary) {
    Algorithm a;
    a.coll = c;
    a.name = "eager";
    a.summary = summary;
    a.applies = eagerApplies;
    a.run = [](const CollArgs& args, RunContext&) {
      throw InternalError(fmt::format(
          "eager {} reached the generic algorithm runner; the Work queue runs eager calls (report this)",
          collTypeName(args.coll)));
    };
    out.push_back(std::move(a));
  };
  add(CollType::kAllreduce, "every rank reduces all peers' eager slots (data + signature in one store)");
  add(CollType::kAllgather, "every rank copies each peer's block out of its eager slot");
  add(CollType::kReduceScatter, "every rank reduces its block out of all peers' eager slots");
  add(CollType::kBroadcast, "peers copy the root's eager slot (every rank publishes its signature)");
  add(CollType::kAlltoall, "every rank copies its block out of each peer's eager slot");
  add(CollType::kBarrier, "every rank publishes its eager header and waits for every peer's");
}

EagerChannel::EagerChannel(std::shared_ptr<Communicator> comm, std::shared_ptr<CallChecker> checker)
    : comm_(std::move(comm)), checker_(std::move(checker)), rank_(comm_->rank()), size_(comm_->size()) {
  cap_ = roundUp(std::max<size_t>(eagerMaxBytes(), 1), kLine);
  static_assert(sizeof(Header) == kHeaderBytes, "the payload starts 8-byte aligned inside the header's line");
  slot_bytes_ = roundUp(kHeaderBytes + cap_, kLine);  // every header starts a line
  known_done_.assign(size_, 0);
  if (everyRankHasACore(comm_->machineLocalSize()))
    spin_ = std::chrono::microseconds(std::max<int64_t>(env::getInt("CROSSBAR_SPIN_US"), 0));
  srcs_.resize(size_);
  bases_.assign(size_, nullptr);
}

EagerChannel::~EagerChannel() = default;

void EagerChannel::create() {
  if (buf_) return;
  symm::HeapOptions o;
  o.channels = 1;
  o.name = "eager";
  o.remote_access = false;
  heap_ = symm::SymmetricHeap::create(comm_, o);
  auto buf = heap_.allocate(kLine + kEagerSlots * slot_bytes_);
  for (int q = 0; q < size_; ++q) bases_[q] = static_cast<char*>(buf->peerPtr(q));
  buf_ = std::move(buf);
  CB_INFO("coll", "{}: eager slots of {} bytes x {} per rank (CROSSBAR_EAGER_BYTES={})", comm_->name(), cap_,
          kEagerSlots, eagerMaxBytes());
}


bool EagerChannel::peek(int peer, uint64_t seq, CallSignature* out) const {
  if (!buf_ || peer < 0 || peer >= size_ || peer == rank_) return false;
  const Header* h = header(peer, seq);
  if (h->seq1.load(std::memory_order_acquire) != seq + 1) return false;
  out->coll = h->coll;
  out->type = h->type;
  out->op = h->op;
  out->root = h->root;
  out->count = h->count;
  out->seq = seq;
  out->send_counts.clear();
  out->recv_counts.clear();
  return true;
}

// Before reusing the slot of `seq`: every peer must be done with the collective that
// last used it. Almost never waits (every eager collective already waits for all
// peers' headers), so a plain poll with yields and short sleeps.
void EagerChannel::waitSlotFree(uint64_t seq, Deadline deadline) {
  const uint64_t prev = header(rank_, seq)->seq1.load(std::memory_order_relaxed);
  if (prev == 0) return;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_ || known_done_[q] >= prev) continue;
    for (int i = 0;; ++i) {
      known_done_[q] = __atomic_load_n(doneWord(q), __ATOMIC_ACQUIRE);
      if (known_done_[q] >= prev) break;
      if (deadline.expired())
        throw Timeout(fmt::format("{}rank {} has not finished collective #{} (it last finished #{}), so this "
                                  "rank cannot reuse its eager slot for #{}; is it stuck or did it stop "
                                  "calling collectives?",
                                  errorContext(rank_, "eager"), q, prev - 1,
                                  static_cast<int64_t>(known_done_[q]) - 1, seq),
                      {q});
      if (comm_->aborted())
        throw Aborted(fmt::format("{}the communicator was aborted while waiting for rank {}",
                                  errorContext(rank_, "eager"), q));
      if (i < 1000)
        sched_yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

bool EagerChannel::slotFree(uint64_t seq) {
  const uint64_t prev = header(rank_, seq)->seq1.load(std::memory_order_relaxed);
  if (prev == 0) return true;
  // This rank too: a call published ahead of the ones before it (the queue's
  // publishAhead) must not overwrite a slot this rank has not read back yet.
  for (int q = 0; q < size_; ++q) {
    if (known_done_[q] >= prev) continue;
    known_done_[q] = __atomic_load_n(doneWord(q), __ATOMIC_ACQUIRE);
    if (known_done_[q] < prev) return false;
  }
  return true;
}

bool EagerChannel::peersPublished(uint64_t seq, Clock::duration spin) const {
  const uint64_t want = seq + 1;
  Clock::time_point until{};  // read the clock only when a peer is late
  for (int i = 1; i < size_; ++i) {
    const Header* h = header((rank_ + i) % size_, seq);
    auto ready = [&] { return h->seq1.load(std::memory_order_acquire) == want; };
    if (ready()) continue;
    if (spin <= Clock::duration::zero()) return false;  // a quick look (a pause is ~30 ns here)
    while (!ready()) {
      for (int k = 0; k < 32 && !ready(); ++k) __builtin_ia32_pause();
      if (ready()) break;
      // The clock only once a peer is late by a round of pauses (~1 us): reading it
      // costs about as much as the line transfer the common case waits for.
      const Clock::time_point now = Clock::now();
      if (until == Clock::time_point{}) until = now + spin;
      if (now >= until) return false;
    }
  }
  return true;
}

bool EagerChannel::awaitPeer(int peer, uint64_t seq, Deadline deadline, CallSignature* theirs) {
  Header* h = header(peer, seq);
  const uint64_t want = seq + 1;
  auto ready = [&] { return h->seq1.load(std::memory_order_acquire) == want; };
  if (ready()) return true;
  telemetry::PeerWait waiting(peer, true);
  // A peer on the checked path publishes its call in the call-check slot instead.
  auto checked = [&] { return checker_ && checker_->peekLocal(peer, seq, theirs); };
  // A pause costs ~33 ns on this EPYC VM: with more ranks than cores (no spin phase),
  // 256 of them (8 us) only delay the yield the late peer needs.
  const int pauses = spin_ > Clock::duration::zero() ? 256 : 16;
  for (int i = 0; i < pauses; ++i) {
    if (ready()) return true;
    __builtin_ia32_pause();
  }
  if (spin_ > Clock::duration::zero()) {
    const auto spin_until = Clock::now() + spin_;
    while (Clock::now() < spin_until) {
      for (int i = 0; i < 32; ++i) {
        if (ready()) return true;
        __builtin_ia32_pause();
      }
    }
  }
  const auto yield_until = Clock::now() + kYieldPhase;
  for (int i = 0; Clock::now() < yield_until; ++i) {
    if (ready()) return true;
    if (i % 32 == 31 && checked()) return false;
    sched_yield();
  }
  while (true) {
    if (ready()) return true;
    if (checked()) return false;
    if (deadline.expired())
      throw Timeout(fmt::format("{}rank {} did not reach collective #{} within the deadline (its eager slot "
                                "holds #{}); is it stuck, or did it skip or reorder a collective?",
                                errorContext(rank_, "eager"), peer, seq,
                                static_cast<int64_t>(h->seq1.load()) - 1),
                    {peer});
    // Flag, re-check, sleep until the writer signals (Dekker with run()'s store-then-load).
    const uint64_t before = buf_->signalValue(peer, kWakeChannel);
    h->sleepers.fetch_add(1, std::memory_order_seq_cst);
    struct Unflag {
      Header* h;
      ~Unflag() { h->sleepers.fetch_sub(1, std::memory_order_seq_cst); }
    } unflag{h};
    fence::heavy();  // the writer's publish() only has fence::light()
    if (ready()) return true;
    try {
      buf_->waitSignalValue(peer, kWakeChannel, before + 1, deadline.min(Deadline::after(kSleepSlice)));
    } catch (const Timeout&) {
      // Only the slice's own end is ours to absorb: an abort (e.g. the failure
      // detector's "not responding") arrives as its error, possibly a Timeout too.
      // When the abort lands as the slice ends, report the abort's error, not the slice's.
      if (comm_->aborted()) {
        if (auto e = comm_->context().abortError()) std::rethrow_exception(e);
        throw;
      }
      if (deadline.expired() && !ready()) throw;
    }
  }
}

void EagerChannel::runLocal(const CollArgs& a) {
  const size_t es = elementSize(a.type), n = a.count;
  if (a.coll == CollType::kBarrier || n == 0) return;
  if (reduces(a.coll)) {
    // One input: still pre/post (premul scaling, avg), like every algorithm.
    ReduceParams prm;
    prm.preMulScalar = a.premul_scalar;
    const void* src = a.send;
    reduce(a.recv, &src, 1, n, a.type, a.op, prm);
    return;
  }
  if (a.coll != CollType::kBroadcast && a.send != a.recv) std::memmove(a.recv, a.send, n * es);
}

void EagerChannel::run(const CollArgs& a, uint64_t seq, Deadline deadline, bool published) {
  if (size_ == 1) return runLocal(a);
  if (!published) {
    const CallCheckMode mode = checker_ ? checker_->mode() : CallCheckMode::kOff;
    // Full mode keeps its message exchange (debugging; also compares what this path would).
    if (mode == CallCheckMode::kFull) checker_->check(comm_, a, seq, deadline);
    if (!buf_) {
      // Cheap mode: the call-check slots first (their creation creates ours), the order
      // in which a rank on the checked path creates them too.
      if (mode == CallCheckMode::kCheap) checker_->ensureLocal(comm_);
      create();
    }
    waitSlotFree(seq, deadline);
    publish(a, seq);
  }
  complete(a, seq, deadline);
}

bool EagerChannel::tryRun(const CollArgs& a, uint64_t seq, bool* published, bool spin) {
  if (size_ == 1) {
    runLocal(a);
    return true;
  }
  if (!*published) {
    // Creating the slots is collective and the full check exchanges messages: both wait.
    if (!buf_ || (checker_ && checker_->mode() == CallCheckMode::kFull) || !slotFree(seq)) return false;
    publish(a, seq);
    *published = true;
  }
  if (!peersPublished(seq, spin ? std::min<Clock::duration>(spin_, kIssueSpin) : Clock::duration::zero()))
    return false;
  complete(a, seq, Deadline::never());  // every header is there: nothing waits
  return true;
}

bool EagerChannel::tryPublish(const CollArgs& a, uint64_t seq) {
  if (size_ == 1 || !buf_ || (checker_ && checker_->mode() == CallCheckMode::kFull) || !slotFree(seq))
    return false;
  publish(a, seq);
  return true;
}

void EagerChannel::publish(const CollArgs& a, uint64_t seq) {
  const int p = size_, r = rank_;
  const CallSignature mine = CallSignature::of(a, seq, false);
  Header* own = header(r, seq);
  const ByteRange in = eagerInput(a, p);
  if (in.bytes && (a.coll != CollType::kBroadcast || r == a.root)) {
    // An alltoall's or reduce_scatter's own block is read by this rank only, straight
    // from its input when it completes: not published.
    size_t own_from = in.bytes, own_to = in.bytes;
    if (a.coll == CollType::kAlltoall || a.coll == CollType::kReduceScatter) {
      own_from = r * (in.bytes / p);
      own_to = own_from + in.bytes / p;
    }
    char* dst = payload(r, seq);
    if (own_from) std::memcpy(dst, in.begin, own_from);
    if (own_to < in.bytes) std::memcpy(dst + own_to, in.begin + own_to, in.bytes - own_to);
  }
  own->coll = mine.coll;
  own->type = mine.type;
  own->op = mine.op;
  own->root = mine.root;
  own->count = mine.count;
  own->seq1.store(seq + 1, std::memory_order_release);
  fence::light();  // pairs with awaitPeer's heavy() before it sleeps
  if (own->sleepers.load(std::memory_order_relaxed) != 0)
    for (int q = 0; q < p; ++q)
      if (q != r) buf_->putSignal(q, kWakeChannel);
}

void EagerChannel::complete(const CollArgs& a, uint64_t seq, Deadline deadline) {
  const CallCheckMode mode = checker_ ? checker_->mode() : CallCheckMode::kOff;
  const int p = size_, r = rank_;
  const size_t n = a.count, blk = n * elementSize(a.type);
  const Header* own = header(r, seq);  // this call's signature, as publish() stored it

  // Every peer's header: the data is there and the calls compare (the mismatch check).
  bool agree = true;
  std::vector<int> checked_path;
  std::vector<CallSignature> calls;
  CallSignature theirs;
  for (int i = 1; i < p; ++i) {
    const int q = (r + i) % p;
    if (!awaitPeer(q, seq, deadline, &theirs)) {
      if (calls.empty()) calls.resize(p);
      calls[q] = theirs;
      checked_path.push_back(q);
      agree = false;
      continue;
    }
    const Header* h = header(q, seq);
    if (h->coll != own->coll || h->type != own->type || h->op != own->op || h->root != own->root ||
        h->count != own->count)
      agree = false;
  }
  if (!agree) {
    const CallSignature mine = CallSignature::of(a, seq, false);
    if (calls.empty()) calls.resize(p);
    calls[r] = mine;
    for (int q = 0; q < p; ++q)
      if (q != r && std::find(checked_path.begin(), checked_path.end(), q) == checked_path.end())
        peek(q, seq, &calls[q]);
    Mismatch m = findMismatch(calls);
    if (m.message.empty()) {
      std::sort(checked_path.begin(), checked_path.end());
      m.ranks = checked_path;
      m.message = fmt::format(
          "ranks chose different algorithms for {}: rank(s) {} did not take the eager path this rank took "
          "(do CROSSBAR_EAGER_BYTES, CROSSBAR_ALGO and CollOptions.algorithm agree on every rank?)",
          mine.describe(), fmt::join(checked_path, ","));
    }
    throw InvalidUsage(fmt::format("{}{} (CROSSBAR_CHECK_CALLS={})", errorContext(r, "call check"),
                                   m.message, callCheckModeName(mode)),
                       m.ranks);
  }

  // Data: straight out of the peers' slots (own contribution from the own slot, or for
  // alltoall / reduce_scatter from the input, so in-place calls read nothing they have
  // overwritten; reductions combine in rank order, so every rank's result is
  // bit-identical).
  ReduceParams prm;
  prm.preMulScalar = a.premul_scalar;
  switch (a.coll) {
    case CollType::kAllreduce:
      if (n) {
        for (int q = 0; q < p; ++q) srcs_[q] = payload(q, seq);
        reduce(a.recv, srcs_.data(), p, n, a.type, a.op, prm);
      }
      break;
    case CollType::kReduceScatter:
      if (n) {
        for (int q = 0; q < p; ++q) srcs_[q] = payload(q, seq) + r * blk;
        srcs_[r] = static_cast<const char*>(a.send) + r * blk;  // not published; may be recv
        reduce(a.recv, srcs_.data(), p, n, a.type, a.op, prm);
      }
      break;
    case CollType::kAllgather:
      for (int q = 0; q < p && blk; ++q) std::memcpy(cp(a.recv) + q * blk, payload(q, seq), blk);
      break;
    case CollType::kAlltoall:
      for (int q = 0; q < p && blk; ++q) {
        char* out = cp(a.recv) + q * blk;
        if (q != r)
          std::memcpy(out, payload(q, seq) + r * blk, blk);
        else if (out != static_cast<const char*>(a.send) + r * blk)  // in place: already there
          std::memcpy(out, static_cast<const char*>(a.send) + r * blk, blk);
      }
      break;
    case CollType::kBroadcast:
      if (r != a.root && blk) std::memcpy(a.recv, payload(a.root, seq), blk);
      break;
    default:
      break;
  }
  // Done with the peers' slots of `seq` (they may reuse them); also the call check's
  // progress, which counts every collective.
  __atomic_store_n(doneWord(r), seq + 1, __ATOMIC_RELEASE);
  if (checker_) checker_->noteSkipped(seq);
}

}  // namespace crossbar
