// Mismatched-call detection (signature.h): signatures, the report, and the exchange.
#include "collectives/signature.h"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/topology.h"
#include "telemetry/telemetry.h"

namespace crossbar {

namespace {

// Tags of the check's messages: a block of the internal tag space next to the
// collectives' own (kInternalTagBase | 0x08000000), 20 bits of sequence number and
// 6 bits of sub-step (dissemination rounds 0..31, full exchange 32).
constexpr uint32_t kCheckTagBase = kInternalTagBase | 0x04000000u;
constexpr uint32_t kFullExchangeSub = 32;
uint32_t checkTag(uint64_t seq, uint32_t sub) {
  return kCheckTagBase | (static_cast<uint32_t>(seq & 0xFFFFF) << 6) | sub;
}

constexpr uint32_t kMagic = 0x67734243;  // "CBsg"
constexpr size_t kHeaderBytes = 4 + 4 * 4 + 8 + 8 + 4;


template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof v);
  std::memcpy(out.data() + at, &v, sizeof v);
}
template <typename T>
T take(const uint8_t*& p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  p += sizeof v;
  return v;
}

// "0-2,5,7-8"
std::string rankList(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += j == i ? fmt::format("{}", ranks[i]) : fmt::format("{}-{}", ranks[i], ranks[j]);
    i = j + 1;
  }
  return s;
}
std::string ranksNamed(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rankList(ranks);
}

const char* collName(int32_t c) {
  return c >= 0 && c < kNumCollTypes ? collTypeName(static_cast<CollType>(c)) : "?";
}
const char* typeName(int32_t t) {
  return t >= 0 && t < kNumDataTypes ? dataTypeName(static_cast<DataType>(t)) : "?";
}
const char* opName(int32_t o) {
  return o >= 0 && o < kNumReduceOps ? reduceOpName(static_cast<ReduceOp>(o)) : "?";
}

// What differs between two calls, e.g. "count 100 vs 64, type float32 vs int32".
std::string differences(const CallSignature& a, const CallSignature& b) {
  std::vector<std::string> d;
  if (a.seq != b.seq) d.push_back(fmt::format("position in the call sequence #{} vs #{}", a.seq, b.seq));
  if (a.coll != b.coll) {
    d.push_back(fmt::format("collective {} vs {} (called in a different order, or one rank skipped a call)",
                            collName(a.coll), collName(b.coll)));
    return fmt::format("{}", fmt::join(d, ", "));
  }
  if (a.count != b.count) d.push_back(fmt::format("count {} vs {}", a.count, b.count));
  if (a.type != b.type) d.push_back(fmt::format("type {} vs {}", typeName(a.type), typeName(b.type)));
  if (a.op != b.op) d.push_back(fmt::format("op {} vs {}", opName(a.op), opName(b.op)));
  if (a.root != b.root) d.push_back(fmt::format("root {} vs {}", a.root, b.root));
  return fmt::format("{}", fmt::join(d, ", "));
}

bool sameCall(const CallSignature& a, const CallSignature& b) {
  return a.coll == b.coll && a.type == b.type && a.op == b.op && a.root == b.root && a.count == b.count &&
         a.seq == b.seq;
}

}  // namespace

CallCheckMode callCheckModeFromEnv() {
  const std::string m = env::getEnum("CROSSBAR_CHECK_CALLS");
  if (m == "off") return CallCheckMode::kOff;
  if (m == "full") return CallCheckMode::kFull;
  return CallCheckMode::kCheap;
}

const char* callCheckModeName(CallCheckMode mode) {
  switch (mode) {
    case CallCheckMode::kOff:
      return "off";
    case CallCheckMode::kCheap:
      return "cheap";
    case CallCheckMode::kFull:
      return "full";
  }
  return "?";
}

uint64_t CallSignature::hash() const {
  // FNV-1a over the fixed fields, then a final avalanche (splitmix64).
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(static_cast<uint32_t>(coll));
  mix(static_cast<uint32_t>(type));
  mix(static_cast<uint32_t>(op));
  mix(static_cast<uint32_t>(root));
  mix(count);
  mix(seq);
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

std::string CallSignature::describe() const {
  if (coll < 0 || coll >= kNumCollTypes) return fmt::format("an unknown collective ({})", coll);
  const CollType c = static_cast<CollType>(coll);
  std::string s = collName(coll);
  if (c == CollType::kAlltoallv)
    s += fmt::format(" of {}", typeName(type));
  else if (c != CollType::kBarrier)
    s += fmt::format(" of {} x {}", count, typeName(type));
  if (op >= 0) s += fmt::format(" {}", opName(op));
  if (root >= 0) s += fmt::format(" root {}", root);
  return s + fmt::format(" (collective #{})", seq);
}

std::vector<uint8_t> CallSignature::serialize() const {
  std::vector<uint8_t> out;
  out.reserve(kHeaderBytes + 16 * send_counts.size());
  put(out, kMagic);
  put(out, coll);
  put(out, type);
  put(out, op);
  put(out, root);
  put(out, count);
  put(out, seq);
  put(out, static_cast<uint32_t>(send_counts.size()));
  for (uint64_t v : send_counts) put(out, v);
  for (uint64_t v : recv_counts) put(out, v);
  return out;
}

CallSignature CallSignature::parse(const uint8_t* bytes, size_t n, int nranks) {
  auto bad = [&](const std::string& why) {
    throw InvalidUsage(
        fmt::format("a peer's call signature is malformed ({}); do all ranks run the same "
                    "crossbar version?",
                    why));
  };
  if (n < kHeaderBytes) bad(fmt::format("{} bytes, at least {} expected", n, kHeaderBytes));
  const uint8_t* p = bytes;
  if (take<uint32_t>(p) != kMagic) bad("bad magic");
  CallSignature s;
  s.coll = take<int32_t>(p);
  s.type = take<int32_t>(p);
  s.op = take<int32_t>(p);
  s.root = take<int32_t>(p);
  s.count = take<uint64_t>(p);
  s.seq = take<uint64_t>(p);
  const uint32_t k = take<uint32_t>(p);
  if (k != 0 && k != static_cast<uint32_t>(nranks))
    bad(fmt::format("{} per-rank counts for {} ranks", k, nranks));
  if (n != kHeaderBytes + 16 * static_cast<size_t>(k))
    bad(fmt::format("{} bytes for {} per-rank counts", n, k));
  s.send_counts.resize(k);
  s.recv_counts.resize(k);
  for (auto& v : s.send_counts) v = take<uint64_t>(p);
  for (auto& v : s.recv_counts) v = take<uint64_t>(p);
  return s;
}

Mismatch findMismatch(const std::vector<CallSignature>& calls) {
  Mismatch m;
  const int p = static_cast<int>(calls.size());
  // Groups of identical calls, in order of their lowest rank.
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < p; ++r) {
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const std::vector<int>& x) { return sameCall(calls[x[0]], calls[r]); });
    if (g == groups.end())
      groups.push_back({r});
    else
      g->push_back(r);
  }
  if (groups.size() > 1) {
    size_t ref = 0;
    for (size_t i = 1; i < groups.size(); ++i)
      if (groups[i].size() > groups[ref].size()) ref = i;
    const CallSignature& want = calls[groups[ref][0]];
    std::vector<std::string> parts;
    for (size_t i = 0; i < groups.size(); ++i) {
      if (i == ref) continue;
      const CallSignature& got = calls[groups[i][0]];
      parts.push_back(
          fmt::format("{} called {} ({})", ranksNamed(groups[i]), got.describe(), differences(got, want)));
      m.ranks.insert(m.ranks.end(), groups[i].begin(), groups[i].end());
    }
    std::sort(m.ranks.begin(), m.ranks.end());
    m.message = fmt::format(
        "ranks called different collectives: {} called {}; {}. Every rank must issue the same collectives "
        "in the same order, with the same count, type, op and root",
        ranksNamed(groups[ref]), want.describe(), fmt::join(parts, "; "));
    return m;
  }
  // Same call everywhere; alltoallv (full mode): rank i's send count to j must be j's
  // receive count from i.
  if (p == 0 || calls[0].send_counts.empty()) return m;
  std::vector<std::string> pairs;
  size_t npairs = 0;
  for (int i = 0; i < p; ++i) {
    if (calls[i].send_counts.size() != static_cast<size_t>(p)) continue;
    for (int j = 0; j < p; ++j) {
      if (calls[j].recv_counts.size() != static_cast<size_t>(p)) continue;
      if (calls[i].send_counts[j] == calls[j].recv_counts[i]) continue;
      ++npairs;
      if (pairs.size() < 8)
        pairs.push_back(fmt::format("rank {} sends {} elements to rank {}, which expects {}", i,
                                    calls[i].send_counts[j], j, calls[j].recv_counts[i]));
      for (int r : {i, j})
        if (std::find(m.ranks.begin(), m.ranks.end(), r) == m.ranks.end()) m.ranks.push_back(r);
    }
  }
  if (npairs == 0) return m;
  std::sort(m.ranks.begin(), m.ranks.end());
  m.message = fmt::format(
      "alltoallv counts disagree between ranks in {}: {}{}. send_counts[j] on rank i must "
      "equal recv_counts[i] on rank j",
      calls[0].describe(), fmt::join(pairs, "; "),
      npairs > pairs.size() ? fmt::format(" (and {} more pairs)", npairs - pairs.size()) : "");
  return m;
}

std::vector<CallSignature> CallChecker::exchangeAll(Communicator& comm, const CallSignature& mine,
                                                    uint64_t seq, Deadline deadline) {
  const int p = comm.size(), r = comm.rank();
  const uint32_t tag = checkTag(seq, kFullExchangeSub);
  out_ = mine.serialize();
  in_.resize(p);
  std::vector<RequestPtr> reqs;
  std::vector<int> from;
  for (int q = 0; q < p; ++q) {
    if (q == r) continue;
    in_[q].resize(kHeaderBytes + 16 * static_cast<size_t>(p));
    reqs.push_back(comm.irecv(in_[q].data(), in_[q].size(), q, tag));
    from.push_back(q);
  }
  for (int q = 0; q < p; ++q)
    if (q != r) reqs.push_back(comm.isend(out_.data(), out_.size(), q, tag));
  comm.waitAll(reqs, deadline);
  std::vector<CallSignature> calls(p);
  calls[r] = mine;
  for (size_t i = 0; i < from.size(); ++i) {
    try {
      calls[from[i]] = CallSignature::parse(in_[from[i]].data(), reqs[i]->status().bytes, p);
    } catch (const Error& e) {
      throw InvalidUsage(fmt::format("{}rank {}: {}", errorContext(r, "call check"), from[i], e.what()),
                         {from[i]});
    }
  }
  return calls;
}

// Intra-node slots: each rank's buffer holds its progress (checks completed) and its
// last kSlots calls, slot seq % kSlots, 64 bytes each; peers read them through their
// mapping. A rank overwrites a slot only after every peer has finished that check.
namespace {
constexpr uint64_t kSlots = 64;
constexpr size_t kSlotBytes = 64;
// Per slot, after the slots: alltoallv send and receive counts, one uint64 per rank each.
size_t countsBytes(int nranks) {
  return 16 * static_cast<size_t>(nranks);
}
struct SlotFields {
  uint64_t seq1;  // seq + 1, stored last (release)
  int32_t coll, type, op, root;
  uint64_t count;
};
uint64_t loadAcquire(const char* p) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(p), __ATOMIC_ACQUIRE);
}
void storeRelease(char* p, uint64_t v) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(p), v, __ATOMIC_RELEASE);
}
}  // namespace

void CallChecker::ensureLocal(const std::shared_ptr<Communicator>& comm) {
  if (slots_) return;
  symm::HeapOptions o;
  o.channels = 1;
  o.name = "callcheck";
  o.remote_access = false;
  heap_ = symm::SymmetricHeap::create(comm, o);
  slots_ = heap_.allocate(kSlotBytes * (kSlots + 1) + kSlots * countsBytes(comm->size()));
  if (after_local_init_) after_local_init_();
}

bool CallChecker::peekLocal(int peer, uint64_t seq, CallSignature* out) const {
  if (!slots_ || peer < 0 || peer >= slots_->worldSize() || peer == slots_->rank()) return false;
  const char* theirs = slots_->peer<char>(peer) + kSlotBytes * (1 + seq % kSlots);
  if (loadAcquire(theirs) != seq + 1) return false;
  SlotFields g;
  std::memcpy(&g, theirs, sizeof g);
  *out = CallSignature{};
  out->coll = g.coll;
  out->type = g.type;
  out->op = g.op;
  out->root = g.root;
  out->count = g.count;
  out->seq = seq;
  return true;
}

void CallChecker::noteSkipped(uint64_t seq) {
  if (slots_) storeRelease(slots_->local<char>(), seq + 1);
}

void CallChecker::throwMismatch(int rank, const Mismatch& m) const {
  throw InvalidUsage(fmt::format("{}{} (CROSSBAR_CHECK_CALLS={})", errorContext(rank, "call check"), m.message,
                                 callCheckModeName(mode_)),
                     m.ranks);
}

std::vector<CallSignature> CallChecker::exchangeLocal(const std::shared_ptr<Communicator>& comm,
                                                      const CallSignature& mine, uint64_t seq,
                                                      Deadline deadline) {
  postLocal(comm, mine, seq, deadline);
  return collectLocal(comm, mine, seq, deadline);
}

void CallChecker::postLocal(const std::shared_ptr<Communicator>& comm, const CallSignature& mine, uint64_t seq,
                            Deadline deadline) {
  const int p = comm->size(), r = comm->rank();
  ensureLocal(comm);
  char* own = slots_->local<char>();
  if (seq >= kSlots) {
    // Flow control: every peer must be done with the call this slot held (rarely waits:
    // only a rank kSlots collectives ahead of a peer, e.g. a root of many broadcasts).
    for (int q = 0; q < p; ++q) {
      if (q == r) continue;
      const char* progress = slots_->peer<char>(q);
      for (int spins = 0; loadAcquire(progress) < seq - kSlots + 1; ++spins) {
        if (deadline.expired())
          throw Timeout(
              fmt::format("{}rank {} is still {} collectives behind (at #{}, this rank at #{}); is it "
                          "stuck or did it stop calling collectives?",
                          errorContext(r, "call check"), q, seq - loadAcquire(progress),
                          loadAcquire(progress), seq),
              {q});
        if (spins < 1000)
          sched_yield();
        else
          std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
  }
  char* slot = own + kSlotBytes * (1 + seq % kSlots);
  SlotFields f{0, mine.coll, mine.type, mine.op, mine.root, mine.count};
  const bool with_counts = !mine.send_counts.empty();  // alltoallv: every pair's counts
  const size_t counts_at = kSlotBytes * (kSlots + 1) + (seq % kSlots) * countsBytes(p);
  if (with_counts) {
    std::memcpy(own + counts_at, mine.send_counts.data(), 8 * static_cast<size_t>(p));
    std::memcpy(own + counts_at + 8 * static_cast<size_t>(p), mine.recv_counts.data(),
                8 * static_cast<size_t>(p));
  }
  std::memcpy(slot + sizeof f.seq1, reinterpret_cast<const char*>(&f) + sizeof f.seq1,
              sizeof f - sizeof f.seq1);
  storeRelease(slot, seq + 1);
  for (int q = 0; q < p; ++q)
    if (q != r) slots_->putSignal(q, 0);
}

std::vector<CallSignature> CallChecker::collectLocal(const std::shared_ptr<Communicator>& comm,
                                                     const CallSignature& mine, uint64_t seq,
                                                     Deadline deadline) {
  const int p = comm->size(), r = comm->rank();
  char* own = slots_->local<char>();
  const bool with_counts = !mine.send_counts.empty();
  const size_t counts_at = kSlotBytes * (kSlots + 1) + (seq % kSlots) * countsBytes(p);
  std::vector<CallSignature> calls(p);
  calls[r] = mine;
  std::vector<int> eager_ranks;  // peers that published this collective on the eager path
  for (int q = 0; q < p; ++q) {
    if (q == r) continue;
    // Spin, then yield the core (with more ranks than cores the peer may need this very
    // core to arrive), then the buffer's blocking wait (futex, deadline, peer failure),
    // in slices that look for the peer's call on the eager path (eager.h) when it has one.
    auto arrived = [&] { return slots_->signalValue(q, 0) >= local_checks_ + 1; };
    auto eager = [&] { return peer_probe_ && peer_probe_(q, seq, &calls[q]); };
    telemetry::PeerWait waiting(q, !arrived());  // the op's wait for its peers (telemetry)
    bool on_eager = false;
    if (!arrived()) {
      // A pause costs ~33 ns on this EPYC VM: with more ranks than cores, 256 of them
      // (8 us) only delay the yield the late peer needs (as in SymmStaging::wait).
      const int pauses = everyRankHasACore(comm->machineLocalSize()) ? 256 : 16;
      for (int i = 0; i < pauses && !arrived(); ++i) __builtin_ia32_pause();
      const auto yield_until = Clock::now() + Millis(2);
      for (int i = 0; !arrived() && Clock::now() < yield_until; ++i) {
        if (i % 32 == 31 && (on_eager = eager())) break;
        sched_yield();
      }
    }
    while (!on_eager) {
      if (!peer_probe_ || arrived()) {
        slots_->waitSignal(q, 0, deadline);  // consumes the signal; returns at once if it arrived
        break;
      }
      if ((on_eager = eager())) break;
      try {
        // Longer than the buffer's 100 ms sleep slice, which ends in its abort and
        // peer-failure checks.
        slots_->waitSignal(q, 0, deadline.min(Deadline::after(Millis(250))));
        break;
      } catch (const Timeout&) {
        if (deadline.expired() || comm->aborted()) throw;  // an abort's error may be a Timeout too
      }
    }
    if (on_eager) {
      eager_ranks.push_back(q);
      continue;
    }
    const char* theirs = slots_->peer<char>(q) + kSlotBytes * (1 + seq % kSlots);
    const uint64_t seq1 = loadAcquire(theirs);
    SlotFields g;
    std::memcpy(&g, theirs, sizeof g);
    if (seq1 != seq + 1)
      throw InternalError(fmt::format("{}rank {}'s call slot holds collective #{}, expected #{}",
                                      errorContext(r, "call check"), q, seq1 - 1, seq));
    CallSignature& c = calls[q];
    c.coll = g.coll;
    c.type = g.type;
    c.op = g.op;
    c.root = g.root;
    c.count = g.count;
    c.seq = seq;
    if (with_counts && g.coll == mine.coll) {
      const char* counts = slots_->peer<char>(q) + counts_at;
      c.send_counts.resize(p);
      c.recv_counts.resize(p);
      std::memcpy(c.send_counts.data(), counts, 8 * static_cast<size_t>(p));
      std::memcpy(c.recv_counts.data(), counts + 8 * static_cast<size_t>(p), 8 * static_cast<size_t>(p));
    }
  }
  if (!eager_ranks.empty()) {
    // Not every rank is here: the state of the signal counts is unknown, so report now.
    Mismatch m = findMismatch(calls);
    if (m.message.empty()) {
      m.ranks = eager_ranks;
      m.message = fmt::format(
          "ranks chose different algorithms for {}: rank(s) {} took the eager path, this rank did not "
          "(do CROSSBAR_EAGER_BYTES, CROSSBAR_ALGO and CollOptions.algorithm agree on every rank?)",
          mine.describe(), fmt::join(eager_ranks, ","));
    }
    throwMismatch(r, m);
  }
  storeRelease(own, seq + 1);  // progress: peers may reuse this check's slots
  ++local_checks_;
  return calls;
}

bool CallChecker::sameHashEverywhere(Communicator& comm, const CallSignature& mine, uint64_t seq,
                                     Deadline deadline) {
  // Dissemination: after round k every rank has folded in 2^(k+1) ranks' hashes.
  const int p = comm.size(), r = comm.rank();
  const uint64_t h = mine.hash();
  uint64_t lo = h, hi = h;
  uint32_t round = 0;
  for (int dist = 1; dist < p; dist <<= 1, ++round) {
    round_out_[0] = lo;
    round_out_[1] = hi;
    const uint32_t tag = checkTag(seq, round);
    const int from = (r - dist + p) % p;
    std::vector<RequestPtr> reqs{comm.irecv(round_in_, sizeof round_in_, from, tag),
                                 comm.isend(round_out_, sizeof round_out_, (r + dist) % p, tag)};
    comm.waitAll(reqs, deadline);
    if (reqs[0]->status().bytes != sizeof round_in_)
      throw InvalidUsage(fmt::format("{}rank {} sent a {}-byte call hash, 16 expected; do all ranks run the "
                                     "same crossbar version?",
                                     errorContext(r, "call check"), from, reqs[0]->status().bytes),
                         {from});
    lo = std::min(lo, round_in_[0]);
    hi = std::max(hi, round_in_[1]);
  }
  return lo == hi;  // every rank saw the same minimum and maximum
}

Mismatch CallChecker::compare(const std::shared_ptr<Communicator>& comm, const CollArgs& a, uint64_t seq,
                              Deadline deadline) {
  const int p = comm->size();
  if (mode_ == CallCheckMode::kOff || p == 1 || a.coll == CollType::kSend || a.coll == CollType::kRecv)
    return {};
  const bool local = mode_ == CallCheckMode::kCheap && comm->numNodes() == 1;
  // Per-pair alltoallv counts: in full mode, and within a node (shared memory: free).
  const CallSignature mine = CallSignature::of(a, seq, mode_ == CallCheckMode::kFull || local);
  if (local) return findMismatch(exchangeLocal(comm, mine, seq, deadline));
  if (mode_ == CallCheckMode::kCheap && sameHashEverywhere(*comm, mine, seq, deadline)) return {};
  // Full mode, or cheap mode after a hash mismatch (every rank knows, so every rank is here).
  return findMismatch(exchangeAll(*comm, mine, seq, deadline));
}

bool CallChecker::post(const std::shared_ptr<Communicator>& comm, const CollArgs& a, uint64_t seq,
                       Deadline deadline) {
  if (mode_ != CallCheckMode::kCheap || comm->size() == 1 || comm->numNodes() != 1 ||
      a.coll == CollType::kSend || a.coll == CollType::kRecv)
    return false;
  posted_ = CallSignature::of(a, seq, true);
  postLocal(comm, posted_, seq, deadline);
  return true;
}

void CallChecker::verifyPosted(const std::shared_ptr<Communicator>& comm, Deadline deadline) {
  Mismatch m = findMismatch(collectLocal(comm, posted_, posted_.seq, deadline));
  if (!m.message.empty())
    throwMismatch(comm->rank(), m);
}

void CallChecker::check(const std::shared_ptr<Communicator>& comm, const CollArgs& a, uint64_t seq,
                        Deadline deadline) {
  Mismatch m = compare(comm, a, seq, deadline);
  if (!m.message.empty())
    throwMismatch(comm->rank(), m);
}

int64_t EnqueueCallCheck::beforeEnqueue(const std::shared_ptr<Communicator>& comm, const CollArgs& a,
                                        Deadline deadline) {
  if (a.coll == CollType::kSend || a.coll == CollType::kRecv) return -1;
  const char* name = collTypeName(a.coll);
  if (!broken_.empty())
    throw InvalidUsage(fmt::format("{}not run: an earlier call check ended without a verdict, so the peers "
                                   "may be at another collective; abort the communicator and create a new "
                                   "one. First error: {}",
                                   errorContext(comm->rank(), name), broken_));
  const uint64_t seq = next_seq_++;
  Mismatch m;
  try {
    m = checker_.compare(comm, a, seq, deadline);
  } catch (const std::exception& e) {
    broken_ = e.what();
    throw;
  }
  if (!m.message.empty())
    throw InvalidUsage(fmt::format("{}call check: {} (CROSSBAR_CHECK_CALLS={}). Nothing of this call was "
                                   "enqueued on any rank; later calls that match still work",
                                   errorContext(comm->rank(), name), m.message,
                                   callCheckModeName(checker_.mode())),
                       m.ranks);
  return static_cast<int64_t>(seq);
}

}  // namespace crossbar
