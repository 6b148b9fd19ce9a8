// Host collectives over symmetric memory (one node, or the intra-node phases of the
// hierarchical allreduce). Each chunk is copied once into the owner's staging half
// (symm_staging.h) and read by every peer straight from the owner's mapping: data
// moves with one copy in and one copy (or reduction) out, no transport rings, and
// synchronization is one signal per chunk and peer (spin, then futex).
//
// Reductions read every rank's contribution and combine them in rank order with the
// full pre/post of reduce.h (premul-sum scaling, avg division), so every rank gets
// bit-identical results, and nothing needs normalizing afterwards.
#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "collectives/algorithms.h"
#include "collectives/cma.h"
#include "collectives/reduce.h"
#include "collectives/symm_staging.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"
#include "comm/topology.h"
#include "symmem/copy_engine.h"
#include "telemetry/telemetry.h"

namespace crossbar {

// ---- staging ---------------------------------------------------------------------------

namespace {
constexpr size_t kAlign = 64;  // sub-blocks start on cache lines (no false sharing, aligned vectors)
// How long a wait yields its core before blocking: long enough to cover a peer's
// time slice when ranks outnumber cores, short enough not to burn an idle machine.
constexpr Millis kYieldPhase{2};
size_t roundDown(size_t v, size_t a) {
  return v / a * a;
}
size_t roundUp(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}
bool overlaps(const void* a, size_t alen, const void* b, size_t blen) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return alen && blen && x < y + blen && y < x + alen;
}
}  // namespace

SymmStaging::SymmStaging(std::shared_ptr<Communicator> comm, size_t bytes, size_t chunk)
    : comm_(std::move(comm)), rank_(comm_->rank()), size_(comm_->size()) {
  half_ = std::max<size_t>(roundDown(bytes / 2, 4096), 4096);
  chunk_ = std::clamp<size_t>(roundDown(chunk, kAlign), kAlign, half_);
  symm::HeapOptions o;
  o.channels = kChannels;
  o.name = "coll";
  o.remote_access = false;  // intra-node only: what crosses nodes goes over point-to-point
  heap_ = symm::SymmetricHeap::create(comm_, o);
  const size_t meta_bytes =
      roundUp(sizeof(MetaHeader) + sizeof(MetaEntry) * size_ + sizeof(DirectEntry) * 4 * size_, 4096);
  buf_ = heap_.allocate(2 * half_ + meta_bytes);
  owed_.resize(size_);
  seen_.assign(static_cast<size_t>(kChannels) * size_, 0);
  if (everyRankHasACore(comm_->machineLocalSize()))
    spin_ = std::chrono::microseconds(std::max<int64_t>(env::getInt("CROSSBAR_SPIN_US"), 0));
  CB_INFO("coll", "{}: symmetric staging of 2 x {} bytes per rank, chunks of up to {} bytes", comm_->name(),
          half_, chunk_);
}

bool SymmStaging::cma(Deadline deadline) {
  if (!cma_probed_) {
    probeCma(deadline);
    cma_probed_ = true;
    CB_INFO("coll", "{}: single copy (CMA) {}", comm_->name(), cma_ ? "on" : "off: " + cma_reason_);
  }
  return cma_;
}

SymmStaging::MetaHeader* SymmStaging::meta(int rank) const {
  return reinterpret_cast<MetaHeader*>(static_cast<char*>(buf_->peerPtr(rank)) + 2 * half_);
}

// Every rank probes every peer (one read of a token it published), then all agree: a
// single failure anywhere turns single copy off everywhere, so ranks never disagree
// on an operation's protocol.
void SymmStaging::probeCma(Deadline deadline) {
  std::string why;
  if (env::getEnum("CROSSBAR_COLL_CMA") == "off") why = "CROSSBAR_COLL_CMA=off";
  if (why.empty()) why = cma::allowPeerReads();
  token_ =
      0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(getpid()) << 20) ^ reinterpret_cast<uintptr_t>(this);
  MetaHeader* me = meta(rank_);
  me->pid = static_cast<uint64_t>(getpid());
  me->token_addr = reinterpret_cast<uintptr_t>(&token_);
  me->token = token_;
  me->probe_ok = 0;
  notifyAll(kAddr);
  waitAll(kAddr, deadline);
  pids_.assign(size_, 0);
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    const MetaHeader* m = meta(q);
    pids_[q] = static_cast<int64_t>(m->pid);
    if (why.empty())
      why = cma::probe(static_cast<pid_t>(m->pid), reinterpret_cast<const void*>(m->token_addr), m->token, q);
  }
  me->probe_ok = why.empty() ? 1 : 2;
  notifyAll(kDone);
  waitAll(kDone, deadline);
  for (int q = 0; q < size_ && why.empty(); ++q)
    if (meta(q)->probe_ok != 1)
      why = fmt::format("rank {} cannot read its peers' memory (its INFO log says why)", q);
  cma_ = why.empty();
  cma_reason_ = why;
}

void SymmStaging::post(int reader, const void* addr, size_t bytes) {
  MetaEntry* e = entry(rank_, reader);
  e->addr = reinterpret_cast<uintptr_t>(addr);
  e->bytes = bytes;
  buf_->putSignal(reader, kAddr);
}

void SymmStaging::readPosted(int owner, void* dst, size_t bytes, Deadline deadline, const char* op) {
  wait(owner, kAddr, deadline);
  const MetaEntry* e = entry(owner, rank_);
  const uint64_t addr = e->addr, offered = e->bytes;
  // DONE even when the read fails, so the owner is not left waiting out its deadline.
  struct Done {
    SymmStaging* s;
    int owner;
    ~Done() { s->buf_->putSignal(owner, kDone); }
  } done{this, owner};
  if (offered != bytes)
    throw InvalidUsage(
        fmt::format("{}rank {} sends {} bytes to this rank, which expects {}; do the counts match "
                    "on every rank?",
                    errorContext(rank_, op), owner, offered, bytes),
        {owner});
  if (bytes)
    cma::read(static_cast<pid_t>(pids_[owner]), dst, reinterpret_cast<const void*>(addr), bytes, rank_, owner,
              op);
}

namespace {
std::atomic<uint64_t> direct_reads{0};
}  // namespace

uint64_t symmDirectReads() {
  return direct_reads.load(std::memory_order_relaxed);
}

SymmStaging::Direct SymmStaging::directSource(const void* p, size_t bytes, size_t align) const {
  if (!bytes) return {};
  symm::BufferRange found = symm::findBuffer(p, bytes);
  // Another communicator's heap may lack some of our peers (or map them elsewhere).
  // Mappings start on a page, so a peer's address has the offset's alignment.
  if (!found.buffer || found.buffer->memoryKind() != symm::MemoryKind::kHost ||
      !found.buffer->createdOver(*comm_) || found.offset % std::max<size_t>(align, 1) != 0)
    return {};
  return {std::move(found.buffer), found.offset};
}

ZeroCopy::ZeroCopy(SymmStaging& s, const void* in, size_t bytes, size_t align, bool allowed, int which)
    : s_(s),
      d_(allowed ? s.directSource(in, bytes, align) : SymmStaging::Direct{}),
      which_(which),
      from_(s.size(), nullptr) {}

void ZeroCopy::announce(int h, int reader, size_t offset, size_t bytes) {
  s_.announce(h, reader, direct() ? SymmStaging::Direct{d_.buffer, d_.offset + offset} : SymmStaging::Direct{},
              bytes, which_);
}

void ZeroCopy::announceAll(int h, size_t offset, size_t bytes) {
  for (int q = 0; q < s_.size(); ++q)
    if (q != s_.rank()) announce(h, q, offset, bytes);
}

const char* ZeroCopy::learn(int owner, int h, size_t bytes, const char* op) {
  return from_[owner] = s_.announced(owner, h, bytes, op, which_);
}

void SymmStaging::announce(int h, int reader, const Direct& d, size_t bytes, int which) {
  DirectEntry* e = directEntry(rank_, h, reader, which);
  if (!d.buffer) {
    e->direct = 0;
    return;
  }
  *e = DirectEntry{1, d.buffer->heapId(), d.buffer->id(), d.offset, bytes};
}

const char* SymmStaging::announced(int owner, int h, size_t bytes, const char* op, int which) {
  const DirectEntry e = *directEntry(owner, h, rank_, which);
  if (!e.direct) return nullptr;
  auto b = symm::findBuffer(e.heap_id, e.buffer_id);
  if (!b || !b->createdOver(*comm_))
    throw InvalidUsage(
        fmt::format("{}rank {} sends from its symmetric buffer #{} of heap #{}, which this rank has already "
                    "freed (or did not allocate over this communicator); free symmetric buffers only after "
                    "every collective that uses them, in the same order on every rank",
                    errorContext(rank_, op), owner, e.buffer_id, e.heap_id),
        {owner});
  if (e.bytes != bytes || e.offset + bytes > b->size())
    throw InvalidUsage(fmt::format("{}rank {} sends {} bytes to this rank, which expects {}; do the counts match "
                                   "on every rank?",
                                   errorContext(rank_, op), owner, e.bytes, bytes),
                       {owner});
  direct_reads.fetch_add(1, std::memory_order_relaxed);
  return b->peer<const char>(owner, e.offset);
}

void SymmStaging::runPendingCheck() {
  runPendingCallCheck(pending_check_);
}

void SymmStaging::wait(int peer, int channel, Deadline deadline) {
  const uint64_t want = ++seen_[static_cast<size_t>(channel) * size_ + peer];
  auto reached = [&] { return buf_->signalValue(peer, channel) >= want; };
  // Peer data next, or a release that is not there yet (a peer that called something
  // else never sends it): the call check's verdict first (every peer's call compared).
  if ((channel != kFree && channel != kDone) || !reached()) runPendingCheck();
  telemetry::PeerWait waiting(peer, !reached());  // the op's wait for its peers (telemetry)
  if (!reached()) {
    // A pause costs ~33 ns on this EPYC VM: with more ranks than cores, 256 of them
    // (8 us) only delay giving the core to the peer this rank waits for.
    const int pauses = spin_ > Clock::duration::zero() ? 256 : 16;
    for (int i = 0; i < pauses && !reached(); ++i) __builtin_ia32_pause();
    if (spin_ > Clock::duration::zero()) {
      // Every rank has a core: keep spinning without syscalls (the peer is running).
      const auto spin_until = Clock::now() + spin_;
      while (!reached() && Clock::now() < spin_until)
        for (int i = 0; i < 32; ++i) __builtin_ia32_pause();
    }
    const auto yield_until = Clock::now() + kYieldPhase;
    while (!reached() && Clock::now() < yield_until) sched_yield();
  }
  buf_->waitSignal(peer, channel, deadline);  // returns at once if reached
}

void SymmStaging::acquire(int h, Deadline deadline) {
  for (int q = 0; q < size_; ++q) {
    auto& f = owed_[q];
    // FREE signals from q arrive in publish order: consume through q's last use of h.
    auto last = std::find(f.rbegin(), f.rend(), static_cast<uint8_t>(h));
    if (last == f.rend()) continue;
    size_t n = static_cast<size_t>(f.rend() - last);
    for (size_t i = 0; i < n; ++i) {
      wait(q, kFree, deadline);
      f.pop_front();
    }
  }
}

void SymmStaging::publish(int h, int reader) {
  buf_->putSignal(reader, kReady);
  owed_[reader].push_back(static_cast<uint8_t>(h));
}

void SymmStaging::publishAll(int h) {
  for (int q = 0; q < size_; ++q)
    if (q != rank_) publish(h, q);
}

void SymmStaging::notifyAll(int channel) {
  for (int q = 0; q < size_; ++q)
    if (q != rank_) buf_->putSignal(q, channel);
}

void SymmStaging::waitAll(int channel, Deadline deadline) {
  for (int q = 0; q < size_; ++q)
    if (q != rank_) wait(q, channel, deadline);
}

void SymmStaging::releaseAll() {
  for (int q = 0; q < size_; ++q)
    if (q != rank_) release(q);
}

// Copy-in to the staging. Its lines were read by the peers on their cores last time,
// and what a plain store then costs depends on where the host runs this VM's vCPUs:
// measured on this EPYC VM (phase timers, 1 MiB, docs/performance.md session 4), a
// plain copy-in took 22 us in some runs and 370-420 us in others (the store's
// read-for-ownership of lines cached on the other core), while streaming stores
// (whole lines, no fetch) took 37-72 us in both. So each rank times its large
// copy-ins and keeps the faster kind, retrying the other every kStageExplore copies
// (the placement changes while a job runs). Only this rank's stores change: the
// bytes and the protocol are the same either way (the streaming path ends with a
// fence, before the READY signal).
namespace {
constexpr size_t kStageTimedBytes = 16 * 1024;  // smaller copies: plain, untimed
constexpr uint64_t kStageExplore = 64;
}  // namespace

void SymmStaging::stageCopy(void* dst, const void* src, size_t bytes) {
  if (bytes < kStageTimedBytes) {
    std::memcpy(dst, src, bytes);
    return;
  }
  bool stream = stage_plain_ns_ == 0 ? false : stage_stream_ns_ == 0 || stage_stream_ns_ < stage_plain_ns_;
  if (++stage_copies_ % kStageExplore == 0) stream = !stream;
  const auto t0 = Clock::now();
  if (stream)
    symm::copyBytesNonTemporal(dst, src, bytes);
  else
    std::memcpy(dst, src, bytes);
  const double ns_per_kib =
      static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count()) *
      1024.0 / static_cast<double>(bytes);
  // Drops at once to a faster sample, rises an eighth of the way to a slower one (a
  // preempted copy is one slow sample, a placement change a run of them).
  double& est = stream ? stage_stream_ns_ : stage_plain_ns_;
  est = est == 0 ? ns_per_kib : std::min(ns_per_kib, est + (ns_per_kib - est) / 8);
}

SymmCache::SymmCache() {
  bytes_ = env::getSize("CROSSBAR_COLL_SYMM_BYTES");
  chunk_ = env::getSize("CROSSBAR_COLL_SYMM_CHUNK");
  stream_bytes_ = env::getSize("CROSSBAR_COLL_STREAM_BYTES");
}

bool SymmCache::has(Communicator& comm) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = states_.find(&comm);
  return it != states_.end() && it->second;
}

SymmStaging& SymmCache::get(Communicator& comm) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& s = states_[&comm];
  if (!s) {
    s = std::make_unique<SymmStaging>(comm.shared_from_this(), bytes_, chunk_);
    s->setStreamBytes(stream_bytes_);
  }
  return *s;
}

namespace {


// Copy of `bytes`; streaming stores for large pieces when `nt` (output that is not
// read again soon: no read-for-ownership, no cache pollution).
void copyOut(void* dst, const void* src, size_t bytes, bool nt) {
  if (!bytes || dst == src) return;
  if (nt && bytes >= 16 * 1024)
    symm::copyBytesNonTemporal(dst, src, bytes);
  else
    std::memcpy(dst, src, bytes);
}

SymmStaging& staging(Communicator& c, const RunContext& x) {
  // Creating the staging is collective: the call check's verdict comes first (a peer
  // that called something else would never join the creation).
  if (x.verify_calls && *x.verify_calls && !x.symm->has(c)) runPendingCallCheck(x.verify_calls);
  SymmStaging& s = x.symm->get(c);
  s.setPendingCheck(x.verify_calls);
  return s;
}

ReduceParams paramsOf(const CollArgs& a) {
  ReduceParams p;
  p.preMulScalar = a.premul_scalar;
  return p;
}

// Elements per chunk and per rank: the chunk size in whole, cache-line multiple elements.
size_t chunkElems(size_t bytes, size_t es) {
  return std::max<size_t>(roundDown(bytes, kAlign) / es, 1);
}

// Elements per block when `parts` blocks share one half (stride = elems * es, aligned).
size_t subChunkElems(const SymmStaging& s, int parts, size_t es) {
  size_t per = std::min(s.chunkBytes(), s.halfBytes() / static_cast<size_t>(parts));
  return std::max<size_t>(roundDown(per, kAlign) / es, 1);
}

// Block b of `n` elements split into p parts of a cache-line multiple each.
struct Split {
  size_t blk;
  size_t n;
  size_t off(int b) const { return std::min(n, blk * b); }
  size_t len(int b) const { return std::min(n, blk * (b + 1)) - off(b); }
};
Split splitOf(size_t n, int p, size_t es) {
  const size_t a = std::max<size_t>(kAlign / es, 1);
  return Split{roundUp(ceilDiv(n, static_cast<size_t>(p)), a), n};
}

// ---- allreduce -----------------------------------------------------------------------

// One-shot: every rank stages its chunk, then reduces all p chunks (its own from the
// user buffer) into its output. p-1 reads per element; for small messages.
// Zero copy: peers read a symmetric input in place, chunk k after its READY, and the
// owner waits for their FREEs before it returns. Not in place: the owner writes its
// output chunk while peers may still read that chunk of its input (waiting for them
// first would cost a round, and an in-place output would need a private copy anyway).
void allreduceOneShot(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  const int p = s.size(), r = s.rank();
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = chunkElems(s.chunkBytes(), es);
  const size_t K = ceilDiv(n, C);
  const ReduceParams prm = paramsOf(a);
  ZeroCopy z(s, a.send, n * es, es, a.send != a.recv);
  std::vector<const void*> srcs(p);
  for (size_t k = 0; k < K; ++k) {
    const int h = s.halfOf(k);
    const size_t lo = k * C, m = std::min(C, n - lo);
    s.acquire(h, x.deadline);
    if (k == 0) z.announceAll(h, 0, n * es);
    if (!z.direct()) s.stageCopy(s.mine(h), ccp(a.send) + lo * es, m * es);
    s.publishAll(h);
    s.waitAll(SymmStaging::kReady, x.deadline);
    for (int q = 0; q < p; ++q) {
      if (k == 0 && q != r) z.learn(q, h, n * es, "allreduce");
      srcs[q] = q == r ? ccp(a.send) + lo * es : z.from(q) ? z.from(q) + lo * es : s.slot(q, h);
    }
    reduce(cp(a.recv) + lo * es, srcs.data(), p, m, a.type, a.op, prm);
    s.releaseAll();
  }
  z.finish(x.deadline);
  s.advance(K);
}

// Two-shot: stage the chunk; rank r reduces block r of it from every rank's half into
// its output and stages the result, then every rank copies the peers' reduced blocks
// out. Each element is read about twice per rank instead of p times.
// Zero copy of the input: peers read block q of a symmetric input in place (chunk k
// after its READY), in place too: rank r writes its output block q only after q's
// REDUCED for that chunk, which q sends after reading r's block q; its own block r no
// peer reads. For the same reason the input needs no FREE before r returns.
// Zero copy of the output: a symmetric output's reduced block r is not staged either;
// peers copy it from r's output after REDUCED (r writes no other byte of block r), and r
// waits for their FREEs before it returns (the caller may then overwrite the output).
// That wait costs more than the copy it saves below blocks of 256 KiB per chunk
// (docs/performance.md, session 7: 2 ranks 256K 59 -> 88 us, 4 ranks 64K 72 -> 132 us).
constexpr size_t kOutputInPlaceMinBlock = 256 * 1024;

void twoShot(const CollArgs& a, RunContext& x, bool nt) {
  SymmStaging& s = staging(*x.comm, x);
  const int p = s.size(), r = s.rank();
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = chunkElems(s.chunkBytes(), es);
  const size_t K = ceilDiv(n, C);
  const ReduceParams prm = paramsOf(a);
  ZeroCopy z(s, a.send, n * es, es, true);
  ZeroCopy zout(s, a.recv, n * es, es, std::min(n, C) * es / p >= kOutputInPlaceMinBlock, 1);
  std::vector<const void*> srcs(p);
  for (size_t k = 0; k < K; ++k) {
    const int h = s.halfOf(k);
    const size_t lo = k * C, m = std::min(C, n - lo);
    const Split sp = splitOf(m, p, es);
    s.acquire(h, x.deadline);
    if (k == 0) {
      z.announceAll(h, 0, n * es);
      zout.announceAll(h, 0, n * es);
    }
    // Stage the blocks the peers reduce; this rank's own block is reduced from the user
    // buffer, and its slot receives the reduced result below.
    const char* in = ccp(a.send) + lo * es;
    if (!z.direct()) {
      s.stageCopy(s.mine(h), in, sp.off(r) * es);
      const size_t after = sp.off(r) + sp.len(r);
      s.stageCopy(s.mine(h) + after * es, in + after * es, (m - after) * es);
    }
    s.publishAll(h);
    s.waitAll(SymmStaging::kReady, x.deadline);
    // Own block: reduce into the (private) output, then stage the result for the
    // peers with stageCopy (reducing straight into the staging, whose lines the peers
    // read last time, stalls on ownership like a plain copy-in; see stageCopy).
    const size_t bo = sp.off(r) * es;
    char* own = cp(a.recv) + lo * es + bo;
    for (int q = 0; q < p; ++q) {
      if (k == 0 && q != r) {
        z.learn(q, h, n * es, "allreduce");
        zout.learn(q, h, n * es, "allreduce");
      }
      srcs[q] = q == r ? in + bo : z.from(q) ? z.from(q) + lo * es + bo : s.slot(q, h) + bo;
    }
    if (sp.len(r)) {
      reduce(own, srcs.data(), p, sp.len(r), a.type, a.op, prm);
      if (!zout.direct()) s.stageCopy(s.mine(h) + bo, own, sp.len(r) * es);
    }
    s.notifyAll(SymmStaging::kReduced);
    for (int i = 1; i < p; ++i) {
      const int q = (r + i) % p;
      s.wait(q, SymmStaging::kReduced, x.deadline);
      const size_t qo = sp.off(q) * es;
      copyOut(cp(a.recv) + lo * es + qo, zout.from(q) ? zout.from(q) + lo * es + qo : s.slot(q, h) + qo,
              sp.len(q) * es, nt);
      s.release(q);
    }
  }
  zout.finish(x.deadline);
  s.advance(K);
}

void allreduceTwoShot(const CollArgs& a, RunContext& x) {
  twoShot(a, x, false);
}
void allreduceTwoShotNt(const CollArgs& a, RunContext& x) {
  twoShot(a, x, true);
}

// ---- reduce-scatter / allgather over blocks (also the hierarchical phases) -------------

Blocks uniformBlocks(size_t count, int p) {
  Blocks b;
  for (int i = 0; i < p; ++i) {
    b.off.push_back(count * i);
    b.len.push_back(count);
  }
  return b;
}

}  // namespace

// rank r's output `out` (len[r] elements) = reduce over ranks of their input block r.
// Every rank stages its blocks b != r chunk by chunk (its own block r it reads in place).
// Zero copy: rank b reads its block of a symmetric input in place (chunk k after its
// READY); in place too when `out` is the rank's own block, which no peer reads.
void symmReduceScatter(SymmStaging& s, const RunContext& x, const void* in, void* out, const Blocks& B,
                       DataType t, ReduceOp op, const ReduceParams& prm, bool zero_copy) {
  const int p = s.size(), r = s.rank();
  const size_t es = elementSize(t);
  const size_t C = subChunkElems(s, p, es), stride = C * es;
  const size_t K = ceilDiv(B.maxLen(), C);
  size_t extent = 0;
  for (int b = 0; b < p; ++b) extent = std::max(extent, (B.off[b] + B.len[b]) * es);
  const bool own_block = cp(out) == ccp(in) + B.off[r] * es;
  ZeroCopy z(s, in, extent, es, zero_copy && (own_block || !overlaps(in, extent, out, B.len[r] * es)));
  std::vector<const void*> srcs(p);
  for (size_t k = 0; k < K; ++k) {
    const int h = s.halfOf(k);
    const size_t lo = k * C;
    s.acquire(h, x.deadline);
    if (k == 0 && zero_copy) z.announceAll(h, 0, extent);
    for (int b = 0; b < p && !z.direct(); ++b) {
      if (b == r || B.len[b] <= lo) continue;
      s.stageCopy(s.mine(h) + b * stride, ccp(in) + (B.off[b] + lo) * es, std::min(C, B.len[b] - lo) * es);
    }
    s.publishAll(h);
    s.waitAll(SymmStaging::kReady, x.deadline);
    if (k == 0 && zero_copy)
      for (int q = 0; q < p; ++q)
        if (q != r) z.learn(q, h, extent, "reduce_scatter");
    if (B.len[r] > lo) {
      for (int q = 0; q < p; ++q)
        srcs[q] = q == r        ? ccp(in) + (B.off[r] + lo) * es
                  : z.from(q) ? z.from(q) + (B.off[r] + lo) * es
                              : s.slot(q, h) + r * stride;
      reduce(cp(out) + lo * es, srcs.data(), p, std::min(C, B.len[r] - lo), t, op, prm);
    }
    s.releaseAll();
  }
  z.finish(x.deadline);
  s.advance(K);
}

// Every rank's `mine` (len[r] elements) lands at out + off[r] on every rank.
void symmAllgather(SymmStaging& s, const RunContext& x, const void* mine, void* out, const Blocks& B,
                   DataType t, bool nt, bool zero_copy) {
  const int p = s.size(), r = s.rank();
  const size_t es = elementSize(t);
  const size_t C = chunkElems(s.chunkBytes(), es);
  const size_t K = ceilDiv(B.maxLen(), C);
  // Zero copy: `mine` is read in place by every peer (symm_staging.h), nothing is
  // staged; in place too (this rank writes only the other blocks of `out`).
  ZeroCopy z(s, mine, B.len[r] * es, 1, zero_copy);
  // The own block: read in place by the peers, copied first; staged, each chunk right
  // after staging it, while the peers read it and its source is still in cache (one read
  // of the input from memory instead of two when it exceeds the caches).
  const bool own_apart = ccp(mine) != cp(out) + B.off[r] * es;
  if (own_apart && z.direct()) copyOut(cp(out) + B.off[r] * es, mine, B.len[r] * es, nt);
  for (size_t k = 0; k < K; ++k) {
    const int h = s.halfOf(k);
    const size_t lo = k * C;
    if (k == 0 || !z.direct()) {
      s.acquire(h, x.deadline);
      if (k == 0) z.announceAll(h, 0, B.len[r] * es);
      const size_t m = B.len[r] > lo ? std::min(C, B.len[r] - lo) : 0;
      if (!z.direct() && m) s.stageCopy(s.mine(h), ccp(mine) + lo * es, m * es);
      s.publishAll(h);
      if (own_apart && !z.direct() && m) copyOut(cp(out) + (B.off[r] + lo) * es, ccp(mine) + lo * es, m * es, nt);
    }
    for (int i = 1; i < p; ++i) {
      const int q = (r + i) % p;
      if (k > 0 && z.from(q)) continue;  // read whole at the first chunk
      s.wait(q, SymmStaging::kReady, x.deadline);
      if (k == 0 && z.learn(q, h, B.len[q] * es, "allgather")) {
        copyOut(cp(out) + B.off[q] * es, z.from(q), B.len[q] * es, nt);
      } else if (B.len[q] > lo) {
        copyOut(cp(out) + (B.off[q] + lo) * es, s.slot(q, h), std::min(C, B.len[q] - lo) * es, nt);
      }
      s.release(q);
    }
  }
  z.finish(x.deadline);
  s.advance(K);
}

namespace {

void reduceScatterSymm(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  symmReduceScatter(s, x, a.send, a.recv, uniformBlocks(a.count, s.size()), a.type, a.op, paramsOf(a), true);
}

void allgatherSymm(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  symmAllgather(s, x, a.send, a.recv, uniformBlocks(a.count, s.size()), a.type,
                a.count * elementSize(a.type) * s.size() >= s.streamBytes(), true);
}

// Hierarchical: intra-node reduce-scatter over symmetric memory -> allreduce of my
// block among the ranks with my local index (point-to-point, over UCX between nodes)
// -> intra-node allgather over symmetric memory.
void allreduceHierSymm(const CollArgs& a, RunContext& x) {
  Communicator& intra = *x.hier->intra;
  Communicator& inter = *x.hier->inter;
  SymmStaging& s = staging(intra, x);
  const size_t es = elementSize(a.type);
  const int p = s.size(), r = s.rank();
  const Split sp = splitOf(a.count, p, es);
  Blocks B;
  for (int b = 0; b < p; ++b) {
    B.off.push_back(sp.off(b));
    B.len.push_back(sp.len(b));
  }
  // Intra phase: premul scales each input once; avg sums (divided at the very end).
  const ReduceOp op1 = a.op == ReduceOp::kAvg ? ReduceOp::kSum : a.op;
  const ReduceOp opn = a.op == ReduceOp::kAvg || a.op == ReduceOp::kPreMulSum ? ReduceOp::kSum : a.op;
  char* mine = cp(a.recv) + B.off[r] * es;
  symmReduceScatter(s, x, a.send, mine, B, a.type, op1, paramsOf(a));
  if (B.len[r]) {
    p2pAllreduceInPlace(inter, x, mine, B.len[r], a.type, opn, 2);
    if (a.op == ReduceOp::kAvg) finishReduce(mine, B.len[r], a.type, a.op, x.comm->size());
  }
  symmAllgather(s, x, mine, a.recv, B, a.type, false);
}

// ---- data movement -------------------------------------------------------------------

// Zero copy (ZeroCopy) in the data movers: a reader copies a direct owner's whole block
// at the first chunk, and the owner publishes only that chunk to it.

void broadcastSymm(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  const int r = s.rank();
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = chunkElems(s.chunkBytes(), es);
  const size_t K = ceilDiv(n, C);
  const bool nt = n * es >= s.streamBytes();
  ZeroCopy z(s, a.recv, n * es, 1, r == a.root);  // the root never writes its buffer
  for (size_t k = 0; k < K; ++k) {
    const int h = s.halfOf(k);
    const size_t lo = k * C, m = std::min(C, n - lo);
    if (r == a.root) {
      if (k > 0 && z.direct()) break;
      s.acquire(h, x.deadline);
      if (k == 0) z.announceAll(h, 0, n * es);
      if (!z.direct()) s.stageCopy(s.mine(h), ccp(a.recv) + lo * es, m * es);
      s.publishAll(h);
    } else {
      if (k > 0 && z.from(a.root)) break;
      s.wait(a.root, SymmStaging::kReady, x.deadline);
      if (k == 0 && z.learn(a.root, h, n * es, "broadcast"))
        copyOut(a.recv, z.from(a.root), n * es, nt);
      else
        copyOut(cp(a.recv) + lo * es, s.slot(a.root, h), m * es, nt);
      s.release(a.root);
    }
  }
  z.finish(x.deadline);
  s.advance(K);
}

// Zero copy: the root reads a symmetric input chunk k in place after its READY (in
// place too: the root's own input is read by the root alone).
void reduceSymm(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  const int p = s.size(), r = s.rank();
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = chunkElems(s.chunkBytes(), es);
  const size_t K = ceilDiv(n, C);
  const ReduceParams prm = paramsOf(a);
  ZeroCopy z(s, a.send, n * es, es, r != a.root);
  std::vector<const void*> srcs(p);
  for (size_t k = 0; k < K; ++k) {
    const int h = s.halfOf(k);
    const size_t lo = k * C, m = std::min(C, n - lo);
    if (r != a.root) {
      s.acquire(h, x.deadline);
      if (k == 0) z.announce(h, a.root, 0, n * es);
      if (!z.direct()) s.stageCopy(s.mine(h), ccp(a.send) + lo * es, m * es);
      s.publish(h, a.root);
      continue;
    }
    s.waitAll(SymmStaging::kReady, x.deadline);
    for (int q = 0; q < p; ++q) {
      if (k == 0 && q != r) z.learn(q, h, n * es, "reduce");
      srcs[q] = q == r ? ccp(a.send) + lo * es : z.from(q) ? z.from(q) + lo * es : s.slot(q, h);
    }
    reduce(cp(a.recv) + lo * es, srcs.data(), p, m, a.type, a.op, prm);
    s.releaseAll();
  }
  z.finish(x.deadline);
  s.advance(K);
}

void gatherSymm(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  const int p = s.size(), r = s.rank();
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = chunkElems(s.chunkBytes(), es);
  const size_t K = ceilDiv(n, C);
  ZeroCopy z(s, a.send, n * es, 1, r != a.root);
  if (r == a.root) copyOut(cp(a.recv) + r * n * es, a.send, n * es, false);
  for (size_t k = 0; k < K; ++k) {
    const int h = s.halfOf(k);
    const size_t lo = k * C, m = std::min(C, n - lo);
    if (r != a.root) {
      if (k > 0 && z.direct()) break;
      s.acquire(h, x.deadline);
      if (k == 0) z.announce(h, a.root, 0, n * es);
      if (!z.direct()) s.stageCopy(s.mine(h), ccp(a.send) + lo * es, m * es);
      s.publish(h, a.root);
      continue;
    }
    for (int i = 1; i < p; ++i) {
      const int q = (r + i) % p;
      if (k > 0 && z.from(q)) continue;  // read whole at the first chunk
      s.wait(q, SymmStaging::kReady, x.deadline);
      if (k == 0 && z.learn(q, h, n * es, "gather"))
        std::memcpy(cp(a.recv) + q * n * es, z.from(q), n * es);
      else
        std::memcpy(cp(a.recv) + (q * n + lo) * es, s.slot(q, h), m * es);
      s.release(q);
    }
  }
  z.finish(x.deadline);
  s.advance(K);
}

void scatterSymm(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  const int p = s.size(), r = s.rank();
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = subChunkElems(s, p, es), stride = C * es;
  const size_t K = ceilDiv(n, C);
  // The root writes only its own block (or nothing, in place), which no peer reads.
  ZeroCopy z(s, a.send, r == a.root ? p * n * es : 0, 1, r == a.root);
  if (r == a.root) copyOut(a.recv, ccp(a.send) + r * n * es, n * es, false);
  for (size_t k = 0; k < K; ++k) {
    const int h = s.halfOf(k);
    const size_t lo = k * C, m = std::min(C, n - lo);
    if (r == a.root) {
      if (k > 0 && z.direct()) break;
      s.acquire(h, x.deadline);
      for (int b = 0; b < p; ++b) {
        if (b == r) continue;
        if (k == 0) z.announce(h, b, b * n * es, n * es);
        if (!z.direct()) s.stageCopy(s.mine(h) + b * stride, ccp(a.send) + (b * n + lo) * es, m * es);
      }
      s.publishAll(h);
    } else {
      if (k > 0 && z.from(a.root)) break;
      s.wait(a.root, SymmStaging::kReady, x.deadline);
      if (k == 0 && z.learn(a.root, h, n * es, "scatter"))
        std::memcpy(a.recv, z.from(a.root), n * es);
      else
        std::memcpy(cp(a.recv) + lo * es, s.slot(a.root, h) + r * stride, m * es);
      s.release(a.root);
    }
  }
  z.finish(x.deadline);
  s.advance(K);
}

// Alltoall(v): each rank stages its blocks for every peer in per-destination slices of
// its half; a pair (s -> d) runs ceil(bytes / slice) rounds, known to both from the
// counts, so ranks with less to move finish early. Round k uses half base + k; the
// base is not advanced (the round count is not agreed globally): acquire() tracks
// which half each reader still holds, which is all the next operation needs.
// Zero copy: an owner whose whole input lies in a symmetric buffer lets each reader
// copy its block in place at the first round; not in place (the owner overwrites its
// input blocks with what it receives while peers may still read them).
void exchangeSymm(const CollArgs& a, RunContext& x, const size_t* scnt, const size_t* sdsp,
                  const size_t* rcnt, const size_t* rdsp, const char* op) {
  SymmStaging& s = staging(*x.comm, x);
  const int p = s.size(), r = s.rank();
  const size_t es = elementSize(a.type);
  const size_t C = subChunkElems(s, p, es), stride = C * es;
  const char* in = ccp(a.send);
  char* out = cp(a.recv);
  const bool inplace = a.send == a.recv;
  size_t rounds = 0, extent = 0;
  for (int q = 0; q < p; ++q) {
    if (q != r) rounds = std::max({rounds, ceilDiv(scnt[q], C), ceilDiv(rcnt[q], C)});
    extent = std::max(extent, (sdsp[q] + scnt[q]) * es);
  }
  ZeroCopy z(s, in, extent, 1, !inplace);
  // The own block is copied once the first round is published, so a late peer's wait
  // overlaps it (and an early peer is not kept waiting for it).
  auto copyOwn = [&] {
    if (!inplace && scnt[r])
      std::memcpy(out + rdsp[r] * es, in + sdsp[r] * es, scnt[r] * es);  // may be null when empty
  };
  if (rounds == 0) copyOwn();
  // Large outputs are not read again soon: streaming stores skip the read-for-ownership
  // of every receive line (as allgather and broadcast do; CROSSBAR_COLL_STREAM_BYTES).
  size_t received = 0;
  for (int q = 0; q < p; ++q) received += rcnt[q] * es;
  const bool nt = received >= s.streamBytes();
  for (size_t k = 0; k < rounds; ++k) {
    const int h = s.halfOf(k);
    const size_t lo = k * C;
    bool any = false;
    for (int q = 0; q < p; ++q) any |= q != r && scnt[q] > lo;
    if (any && (k == 0 || !z.direct())) {
      s.acquire(h, x.deadline);
      for (int q = 0; q < p; ++q) {
        if (q == r || scnt[q] <= lo) continue;
        if (k == 0) z.announce(h, q, sdsp[q] * es, scnt[q] * es);
        if (!z.direct())
          s.stageCopy(s.mine(h) + q * stride, in + (sdsp[q] + lo) * es, std::min(C, scnt[q] - lo) * es);
        s.publish(h, q);
      }
    }
    if (k == 0) copyOwn();
    for (int i = 1; i < p; ++i) {
      const int q = (r + i) % p;
      if (rcnt[q] <= lo || (k > 0 && z.from(q))) continue;
      s.wait(q, SymmStaging::kReady, x.deadline);
      if (k == 0 && z.learn(q, h, rcnt[q] * es, op))
        copyOut(out + rdsp[q] * es, z.from(q), rcnt[q] * es, nt);
      else
        copyOut(out + (rdsp[q] + lo) * es, s.slot(q, h) + r * stride, std::min(C, rcnt[q] - lo) * es, nt);
      s.release(q);
    }
  }
  z.finish(x.deadline);
}

void alltoallSymm(const CollArgs& a, RunContext& x) {
  const int p = x.comm->size();
  std::vector<size_t> cnt(p, a.count), dsp(p);
  for (int i = 0; i < p; ++i) dsp[i] = a.count * i;
  exchangeSymm(a, x, cnt.data(), dsp.data(), cnt.data(), dsp.data(), "alltoall");
}

void alltoallvSymm(const CollArgs& a, RunContext& x) {
  // In place with variable counts: a block may be overwritten before it is staged, so
  // the input is copied first (then staged from the copy).
  if (a.send == a.recv) {
    size_t extent = 0;
    for (int i = 0; i < x.comm->size(); ++i)
      extent = std::max(extent, (a.send_displs[i] + a.send_counts[i]) * elementSize(a.type));
    char* copy = x.scratch->get(0, extent);
    if (extent) std::memcpy(copy, a.send, extent);
    CollArgs b = a;
    b.send = copy;
    exchangeSymm(b, x, a.send_counts.data(), a.send_displs.data(), a.recv_counts.data(),
                 a.recv_displs.data(), "alltoallv");
    return;
  }
  exchangeSymm(a, x, a.send_counts.data(), a.send_displs.data(), a.recv_counts.data(), a.recv_displs.data(),
               "alltoallv");
}

// ---- single copy (CMA) -----------------------------------------------------------------

// Readers copy straight from the owner's user buffer (SymmStaging::post/readPosted):
// one copy per byte instead of two, and no chunking. Each falls back to its staged
// algorithm when single copy is off; that is agreed by every rank when the staging is
// created, so all ranks always take the same path. Every rank posts before it reads,
// and waits for its readers last (the caller may then reuse its buffers).

void allgatherCma(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  if (!s.cma(x.deadline)) return allgatherSymm(a, x);
  const int p = s.size(), r = s.rank();
  const size_t blk = a.count * elementSize(a.type);
  for (int q = 0; q < p; ++q)
    if (q != r) s.post(q, a.send, blk);
  if (ccp(a.send) != cp(a.recv) + r * blk) std::memcpy(cp(a.recv) + r * blk, a.send, blk);
  for (int i = 1; i < p; ++i) {
    const int q = (r + i) % p;
    s.readPosted(q, cp(a.recv) + q * blk, blk, x.deadline, "allgather");
  }
  for (int q = 0; q < p; ++q)
    if (q != r) s.waitReader(q, x.deadline);
}

void exchangeCma(const CollArgs& a, RunContext& x, const size_t* scnt, const size_t* sdsp, const size_t* rcnt,
                 const size_t* rdsp, const char* op) {
  SymmStaging& s = staging(*x.comm, x);
  const int p = s.size(), r = s.rank();
  const size_t es = elementSize(a.type);
  const char* in = ccp(a.send);
  char* out = cp(a.recv);
  if (a.send == a.recv) {
    // In place (identical counts and displacements): peers must not read blocks this
    // rank overwrites meanwhile, so they read a copy; the own block is already in place.
    size_t extent = 0;
    for (int q = 0; q < p; ++q) extent = std::max(extent, (sdsp[q] + scnt[q]) * es);
    char* copy = x.scratch->get(0, extent);
    if (extent) std::memcpy(copy, in, extent);
    in = copy;
  }
  for (int q = 0; q < p; ++q)
    if (q != r) s.post(q, in + sdsp[q] * es, scnt[q] * es);
  if (a.send != a.recv && scnt[r]) std::memcpy(out + rdsp[r] * es, in + sdsp[r] * es, scnt[r] * es);
  for (int i = 1; i < p; ++i) {
    const int q = (r + i) % p;
    s.readPosted(q, out + rdsp[q] * es, rcnt[q] * es, x.deadline, op);
  }
  for (int q = 0; q < p; ++q)
    if (q != r) s.waitReader(q, x.deadline);
}

void alltoallCma(const CollArgs& a, RunContext& x) {
  if (!staging(*x.comm, x).cma(x.deadline)) return alltoallSymm(a, x);
  const int p = x.comm->size();
  std::vector<size_t> cnt(p, a.count), dsp(p);
  for (int i = 0; i < p; ++i) dsp[i] = a.count * i;
  exchangeCma(a, x, cnt.data(), dsp.data(), cnt.data(), dsp.data(), "alltoall");
}

void alltoallvCma(const CollArgs& a, RunContext& x) {
  if (!staging(*x.comm, x).cma(x.deadline)) return alltoallvSymm(a, x);
  exchangeCma(a, x, a.send_counts.data(), a.send_displs.data(), a.recv_counts.data(), a.recv_displs.data(),
              "alltoallv");
}

void broadcastCma(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  if (!s.cma(x.deadline)) return broadcastSymm(a, x);
  const int p = s.size(), r = s.rank();
  const size_t bytes = a.count * elementSize(a.type);
  if (r != a.root) return s.readPosted(a.root, a.recv, bytes, x.deadline, "broadcast");
  for (int q = 0; q < p; ++q)
    if (q != r) s.post(q, a.recv, bytes);
  for (int q = 0; q < p; ++q)
    if (q != r) s.waitReader(q, x.deadline);
}

void gatherCma(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  if (!s.cma(x.deadline)) return gatherSymm(a, x);
  const int p = s.size(), r = s.rank();
  const size_t blk = a.count * elementSize(a.type);
  if (r != a.root) {
    s.post(a.root, a.send, blk);
    return s.waitReader(a.root, x.deadline);
  }
  copyOut(cp(a.recv) + r * blk, a.send, blk, false);
  for (int i = 1; i < p; ++i) {
    const int q = (r + i) % p;
    s.readPosted(q, cp(a.recv) + q * blk, blk, x.deadline, "gather");
  }
}

void scatterCma(const CollArgs& a, RunContext& x) {
  SymmStaging& s = staging(*x.comm, x);
  if (!s.cma(x.deadline)) return scatterSymm(a, x);
  const int p = s.size(), r = s.rank();
  const size_t blk = a.count * elementSize(a.type);
  if (r != a.root) return s.readPosted(a.root, a.recv, blk, x.deadline, "scatter");
  for (int q = 0; q < p; ++q)
    if (q != r) s.post(q, ccp(a.send) + q * blk, blk);
  copyOut(a.recv, ccp(a.send) + r * blk, blk, false);
  for (int q = 0; q < p; ++q)
    if (q != r) s.waitReader(q, x.deadline);
}

// ---- applicability -------------------------------------------------------------------

std::string symmDisabled() {
  static const bool off = env::getSize("CROSSBAR_COLL_SYMM_BYTES") == 0;
  return off ? "CROSSBAR_COLL_SYMM_BYTES=0 disables the symmetric-memory algorithms" : "";
}

std::string singleNode(const CollArgs&, const Communicator& c) {
  std::string off = symmDisabled();
  if (!off.empty()) return off;
  if (c.numNodes() > 1)
    return fmt::format("the communicator spans {} nodes (symmetric memory is intra-node)", c.numNodes());
  return {};
}

std::string multiNode(const CollArgs&, const Communicator& c) {
  std::string off = symmDisabled();
  if (!off.empty()) return off;
  if (c.numNodes() < 2) return "the communicator spans one node";
  if (!uniformNodes(c)) return "nodes have different numbers of ranks";
  return {};
}

}  // namespace

void registerSymmAlgorithms(std::deque<Algorithm>& out) {
  auto add = [&](CollType coll, const char* name, std::string summary, auto run,
                 std::function<std::string(const CollArgs&, const Communicator&)> applies = singleNode,
                 bool needs_hier = false) {
    out.push_back(Algorithm{coll, name, std::move(summary), std::move(applies), run, needs_hier});
    // One node, staged: every read of peer data follows a SymmStaging::wait.
    out.back().verifies_calls = !needs_hier;
  };
  add(CollType::kAllreduce, "oneshot",
      "symmetric memory: stage, every rank reduces all peers' chunks (small)", allreduceOneShot);
  add(CollType::kAllreduce, "twoshot",
      "symmetric memory: direct reduce-scatter of each chunk, then direct allgather; double-buffered",
      allreduceTwoShot);
  add(CollType::kAllreduce, "twoshot_nt", "twoshot with streaming stores for the output (very large)",
      allreduceTwoShotNt);
  add(CollType::kAllreduce, "hierarchical_symm",
      "symmetric-memory reduce-scatter in the node, p2p allreduce per local index, symmetric allgather",
      allreduceHierSymm, multiNode, true);
  add(CollType::kReduceScatter, "symm",
      "symmetric memory: each rank reduces its block from all peers' stages", reduceScatterSymm);
  add(CollType::kAllgather, "symm", "symmetric memory: stage once, every peer copies out", allgatherSymm);
  add(CollType::kBroadcast, "symm", "symmetric memory: root stages chunks, peers copy out", broadcastSymm);
  add(CollType::kReduce, "symm", "symmetric memory: root reduces every rank's staged chunk", reduceSymm);
  add(CollType::kAlltoall, "symm", "symmetric memory: per-destination slices, peers copy out", alltoallSymm);
  add(CollType::kAlltoallv, "symm", "symmetric memory: per-destination slices, pairwise round counts",
      alltoallvSymm);
  add(CollType::kGather, "symm", "symmetric memory: ranks stage, root copies out", gatherSymm);
  const char* staged = "; staged symm if CMA is unavailable";
  // The single-copy ones probe CMA collectively at first use, before any data wait:
  // they keep the check in front.
  auto cmaSummary = [&](const char* what) {
    return std::string("single copy (process_vm_readv): ") + what + staged;
  };
  add(CollType::kAllgather, "cma", cmaSummary("every rank reads each peer's user buffer"), allgatherCma);
  out.back().verifies_calls = false;
  add(CollType::kAlltoall, "cma", cmaSummary("every rank reads its block from each peer"), alltoallCma);
  out.back().verifies_calls = false;
  add(CollType::kAlltoallv, "cma", cmaSummary("every rank reads its block from each peer"), alltoallvCma);
  out.back().verifies_calls = false;
  add(CollType::kBroadcast, "cma", cmaSummary("every rank reads the root's buffer"), broadcastCma);
  out.back().verifies_calls = false;
  add(CollType::kGather, "cma", cmaSummary("the root reads every rank's buffer"), gatherCma);
  out.back().verifies_calls = false;
  add(CollType::kScatter, "cma", cmaSummary("every rank reads its block from the root"), scatterCma);
  out.back().verifies_calls = false;

  add(CollType::kScatter, "symm", "symmetric memory: root stages per-rank slices, ranks copy out",
      scatterSymm);
}

}  // namespace crossbar
