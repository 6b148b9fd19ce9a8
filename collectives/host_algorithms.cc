// Host algorithms: every collective written once over the Communicator's tagged
// point-to-point, so they run over shm and UCX alike (and, later, under the CUDA path
// for what crosses nodes). Reductions call the shared per-element math in reduce.h.
//
// Reduce ops are normalized before an algorithm runs: premul-sum scales the rank's own
// input once (prepareReduceInput) and then combines as a sum; avg combines as a sum and
// divides once at the end (finishReduce). So every intermediate combine is a plain,
// commutative sum/prod/min/max, and partial results can be combined in any order.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "collectives/algorithms.h"
#include "collectives/reduce.h"
#include "comm/errors.h"
#include "telemetry/telemetry.h"

namespace crossbar {
namespace {

constexpr size_t kMaxChunks = 256;  // bounds the request count of one pipelined pass

inline int mod(long v, int p) {
  return static_cast<int>(((v % p) + p) % p);
}

void copyBytes(void* dst, const void* src, size_t bytes) {
  if (bytes && dst != src) std::memmove(dst, src, bytes);
}

// Copies (premul-sum: scales) the rank's input into `out` (may equal `in`); returns the
// op the algorithm combines with.
ReduceOp prepare(void* out, const void* in, size_t n, DataType t, ReduceOp op, double scalar) {
  if (op == ReduceOp::kPreMulSum) {
    ReduceParams p;
    p.preMulScalar = scalar;
    if (n) prepareReduceInput(out, in, n, t, op, p);
    return ReduceOp::kSum;
  }
  copyBytes(out, in, n * elementSize(t));
  return op == ReduceOp::kAvg ? ReduceOp::kSum : op;
}

void finish(void* out, size_t n, DataType t, ReduceOp op, int contributions) {
  if (op == ReduceOp::kAvg && n) finishReduce(out, n, t, op, static_cast<uint64_t>(contributions));
}

// Block i of a buffer split into p parts (elements).
struct Layout {
  std::vector<size_t> off, len;
  size_t maxLen() const { return len.empty() ? 0 : *std::max_element(len.begin(), len.end()); }
};

Layout evenLayout(size_t n, int p) {
  Layout l;
  for (int i = 0; i < p; ++i) {
    size_t lo = n * i / p, hi = n * (i + 1) / p;
    l.off.push_back(lo);
    l.len.push_back(hi - lo);
  }
  return l;
}

Layout uniformLayout(size_t count, int p) {
  Layout l;
  for (int i = 0; i < p; ++i) {
    l.off.push_back(count * i);
    l.len.push_back(count);
  }
  return l;
}

void waitOne(const RequestPtr& r, const RunContext& x) {
  telemetry::PeerWait waiting(-1, !r->done());  // the op's wait for its peers (telemetry)
  r->wait(x.deadline);
  waiting.setPeer(r->status().source);
}

void expectBytes(const RequestPtr& r, size_t bytes, const Communicator& c, int peer, const char* what) {
  if (r->status().bytes != bytes)
    throw InvalidUsage(fmt::format("{}rank {} sent {} bytes, expected {}; do all ranks pass matching counts?",
                                   errorContext(c.rank(), what), peer, r->status().bytes, bytes),
                       {peer});
}

// One ring pass over the p blocks of `buf` (p = c.size()), pipelined in chunks.
// reduce: reduce-scatter, rank r ends with block r fully combined (others: partials).
// else:   allgather, rank r starts with block r and ends with every block.
// Step s sends block sendBlock(s) to the right and receives recvBlock(s) from the left;
// chunk c of step s+1 is forwarded as soon as chunk c of step s has arrived (and been
// reduced), so reduction overlaps communication. Receives of a reduce pass land in a
// window of 2C temporary slots.
void ringPass(Communicator& c, const RunContext& x, void* vbuf, const Layout& L, DataType t, ReduceOp op,
              bool reduce, uint32_t sub) {
  const int p = c.size(), r = c.rank();
  const size_t maxLen = L.maxLen();
  if (p == 1 || maxLen == 0) return;
  char* buf = cp(vbuf);
  const size_t es = elementSize(t);
  const int right = mod(r + 1, p), left = mod(r - 1, p);
  const size_t S = static_cast<size_t>(p - 1);
  const size_t C = std::clamp<size_t>((maxLen * es + x.chunk_bytes - 1) / x.chunk_bytes, 1, kMaxChunks);
  auto sendBlock = [&](size_t s) { return mod(reduce ? r - long(s) - 1 : r - long(s), p); };
  auto recvBlock = [&](size_t s) { return mod(reduce ? r - long(s) - 2 : r - long(s) - 1, p); };
  auto lo = [&](int b, size_t ch) { return L.len[b] * ch / C; };
  auto hi = [&](int b, size_t ch) { return L.len[b] * (ch + 1) / C; };
  const size_t U = S * C;
  const size_t W = reduce ? std::min(U, std::clamp<size_t>(2 * C, 4, 16)) : U;
  const size_t slot_elems = (maxLen + C - 1) / C;
  char* tmp = reduce ? x.scratch->get(0, W * slot_elems * es) : nullptr;
  const uint32_t tag = x.tag + sub;

  std::vector<RequestPtr> recvs(U), sends;
  sends.reserve(U);
  auto postSend = [&](size_t s, size_t ch) {
    int b = sendBlock(s);
    sends.push_back(c.isend(buf + (L.off[b] + lo(b, ch)) * es, (hi(b, ch) - lo(b, ch)) * es, right, tag));
  };
  auto postRecv = [&](size_t u) {
    size_t s = u / C, ch = u % C;
    int b = recvBlock(s);
    char* dst = reduce ? tmp + (u % W) * slot_elems * es : buf + (L.off[b] + lo(b, ch)) * es;
    recvs[u] = c.irecv(dst, (hi(b, ch) - lo(b, ch)) * es, left, tag);
  };
  for (size_t u = 0; u < W; ++u) postRecv(u);
  for (size_t ch = 0; ch < C; ++ch) postSend(0, ch);
  for (size_t u = 0; u < U; ++u) {
    const size_t s = u / C, ch = u % C;
    waitOne(recvs[u], x);
    if (reduce) {
      int b = recvBlock(s);
      size_t a = lo(b, ch), m = hi(b, ch) - a;
      if (m) reduceInto(buf + (L.off[b] + a) * es, tmp + (u % W) * slot_elems * es, m, t, op);
      recvs[u].reset();
      if (u + W < U) postRecv(u + W);
    }
    if (s + 1 < S) postSend(s + 1, ch);
  }
  c.waitAll(sends, x.deadline);
}

// ---- allreduce -----------------------------------------------------------------------

void ringAllreduceInPlace(Communicator& c, const RunContext& x, void* buf, size_t n, DataType t, ReduceOp op,
                          uint32_t sub) {
  Layout L = evenLayout(n, c.size());
  ringPass(c, x, buf, L, t, op, true, sub);
  ringPass(c, x, buf, L, t, op, false, sub + 1);
}

// Recursive doubling; a non-power-of-2 size first folds ranks 2i into 2i+1 for the
// first `rem` pairs, and unfolds at the end.
void rdAllreduceInPlace(Communicator& c, const RunContext& x, void* buf, size_t n, DataType t, ReduceOp op,
                        uint32_t sub) {
  const int p = c.size(), r = c.rank();
  if (p == 1 || n == 0) return;
  const size_t bytes = n * elementSize(t);
  const uint32_t tag = x.tag + sub;
  int p2 = 1;
  while (p2 * 2 <= p) p2 *= 2;
  const int rem = p - p2;
  char* tmp = x.scratch->get(1, bytes);
  int vr;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      waitOne(c.isend(buf, bytes, r + 1, tag), x);
      vr = -1;
    } else {
      waitOne(c.irecv(tmp, bytes, r - 1, tag), x);
      reduceInto(buf, tmp, n, t, op);
      vr = r / 2;
    }
  } else {
    vr = r - rem;
  }
  if (vr >= 0) {
    for (int mask = 1; mask < p2; mask <<= 1) {
      int pv = vr ^ mask;
      int peer = pv < rem ? pv * 2 + 1 : pv + rem;
      auto rq = c.irecv(tmp, bytes, peer, tag);
      auto sq = c.isend(buf, bytes, peer, tag);
      c.waitAll({rq, sq}, x.deadline);
      reduceInto(buf, tmp, n, t, op);
    }
  }
  if (r < 2 * rem) {
    if (r % 2 == 1)
      waitOne(c.isend(buf, bytes, r - 1, tag), x);
    else
      waitOne(c.irecv(buf, bytes, r + 1, tag), x);
  }
}

void allreduceRing(const CollArgs& a, RunContext& x) {
  ReduceOp op = prepare(a.recv, a.send, a.count, a.type, a.op, a.premul_scalar);
  ringAllreduceInPlace(*x.comm, x, a.recv, a.count, a.type, op, 0);
  finish(a.recv, a.count, a.type, a.op, x.comm->size());
}

void allreduceRd(const CollArgs& a, RunContext& x) {
  ReduceOp op = prepare(a.recv, a.send, a.count, a.type, a.op, a.premul_scalar);
  rdAllreduceInPlace(*x.comm, x, a.recv, a.count, a.type, op, 0);
  finish(a.recv, a.count, a.type, a.op, x.comm->size());
}

// Intra-node reduce-scatter -> allreduce of my block among the ranks with my local
// index (one per node) -> intra-node allgather. Every byte crosses the node boundary
// once per node pair direction instead of once per rank.
void allreduceHier(const CollArgs& a, RunContext& x) {
  Communicator& intra = *x.hier->intra;
  Communicator& inter = *x.hier->inter;
  const size_t es = elementSize(a.type);
  ReduceOp op = prepare(a.recv, a.send, a.count, a.type, a.op, a.premul_scalar);
  Layout L = evenLayout(a.count, intra.size());
  ringPass(intra, x, a.recv, L, a.type, op, true, 0);
  char* mine = cp(a.recv) + L.off[intra.rank()] * es;
  const size_t m = L.len[intra.rank()];
  if (m * es < 64 * 1024)
    rdAllreduceInPlace(inter, x, mine, m, a.type, op, 2);
  else
    ringAllreduceInPlace(inter, x, mine, m, a.type, op, 3);
  ringPass(intra, x, a.recv, L, a.type, op, false, 1);
  finish(a.recv, a.count, a.type, a.op, x.comm->size());
}

// ---- allgather -----------------------------------------------------------------------

void allgatherRing(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const size_t blk = a.count * elementSize(a.type);
  copyBytes(cp(a.recv) + c.rank() * blk, a.send, blk);
  ringPass(c, x, a.recv, uniformLayout(a.count, c.size()), a.type, ReduceOp::kSum, false, 0);
}

// Recursive doubling (power-of-2 sizes): step k swaps the 2^k blocks gathered so far.
void allgatherRd(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size(), r = c.rank();
  const size_t blk = a.count * elementSize(a.type);
  char* out = cp(a.recv);
  copyBytes(out + r * blk, a.send, blk);
  for (int dist = 1; dist < p; dist <<= 1) {
    int partner = r ^ dist;
    int mine = r & ~(dist - 1), theirs = partner & ~(dist - 1);
    auto rq = c.irecv(out + theirs * blk, dist * blk, partner, x.tag);
    auto sq = c.isend(out + mine * blk, dist * blk, partner, x.tag);
    c.waitAll({rq, sq}, x.deadline);
  }
}

// Bruck: ceil(log2 p) rounds for any p, gathering rotated (own block first) in a
// temporary, then unrotating.
void allgatherBruck(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size(), r = c.rank();
  const size_t blk = a.count * elementSize(a.type);
  char* tmp = x.scratch->get(0, blk * p);
  copyBytes(tmp, a.send, blk);
  for (int dist = 1; dist < p; dist <<= 1) {
    int cnt = std::min(dist, p - dist);
    auto rq = c.irecv(tmp + dist * blk, cnt * blk, mod(r + dist, p), x.tag);
    auto sq = c.isend(tmp, cnt * blk, mod(r - dist, p), x.tag);
    c.waitAll({rq, sq}, x.deadline);
  }
  for (int i = 0; i < p; ++i) copyBytes(cp(a.recv) + mod(r + i, p) * blk, tmp + i * blk, blk);
}

// ---- reduce_scatter ------------------------------------------------------------------

void reduceScatterRing(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size();
  const size_t blk = a.count * elementSize(a.type);
  char* work = x.scratch->get(2, blk * p);
  ReduceOp op = prepare(work, a.send, a.count * p, a.type, a.op, a.premul_scalar);
  ringPass(c, x, work, uniformLayout(a.count, p), a.type, op, true, 0);
  copyBytes(a.recv, work + c.rank() * blk, blk);
  finish(a.recv, a.count, a.type, a.op, p);
}

// Pairwise: step i sends block r+i to rank r+i and combines block r from rank r-i;
// at most kWindow steps in flight.
void reduceScatterPairwise(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size(), r = c.rank();
  const size_t es = elementSize(a.type), blk = a.count * es;
  const char* in = ccp(a.send);
  ReduceOp op = a.op == ReduceOp::kAvg ? ReduceOp::kSum : a.op;
  if (a.op == ReduceOp::kPreMulSum) {
    char* scaled = x.scratch->get(2, blk * p);
    op = prepare(scaled, a.send, a.count * p, a.type, a.op, a.premul_scalar);
    in = scaled;
  }
  copyBytes(a.recv, in + r * blk, blk);
  const int K = std::min(p - 1, 4);
  char* slots = x.scratch->get(0, blk * std::max(K, 1));
  std::vector<RequestPtr> rq(p), sq(p);
  auto post = [&](int i) {
    int to = mod(r + i, p), from = mod(r - i, p);
    rq[i] = c.irecv(slots + ((i - 1) % K) * blk, blk, from, x.tag);
    sq[i] = c.isend(in + to * blk, blk, to, x.tag);
  };
  for (int i = 1; i <= K; ++i) post(i);
  for (int i = 1; i < p; ++i) {
    waitOne(rq[i], x);
    if (a.count) reduceInto(a.recv, slots + ((i - 1) % K) * blk, a.count, a.type, op);
    waitOne(sq[i], x);
    rq[i].reset();
    sq[i].reset();
    if (i + K < p) post(i + K);
  }
  finish(a.recv, a.count, a.type, a.op, p);
}

// ---- broadcast -----------------------------------------------------------------------

void broadcastBinomial(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size();
  const int vr = mod(c.rank() - a.root, p);
  const size_t bytes = a.count * elementSize(a.type);
  auto real = [&](int v) { return mod(v + a.root, p); };
  int mask = 1;
  while (mask < p) {
    if (vr & mask) {
      waitOne(c.irecv(a.recv, bytes, real(vr - mask), x.tag), x);
      break;
    }
    mask <<= 1;
  }
  std::vector<RequestPtr> sends;
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (vr + mask < p) sends.push_back(c.isend(a.recv, bytes, real(vr + mask), x.tag));
  c.waitAll(sends, x.deadline);
}

// Pipelined chain root -> root+1 -> ...: chunk c is forwarded as soon as it arrived.
void broadcastChain(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size();
  const int vr = mod(c.rank() - a.root, p);
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = std::clamp<size_t>((n * es + x.chunk_bytes - 1) / x.chunk_bytes, 1, kMaxChunks);
  char* buf = cp(a.recv);
  const int prev = mod(c.rank() - 1, p), next = mod(c.rank() + 1, p);
  std::vector<RequestPtr> recvs, sends;
  if (vr > 0)
    for (size_t ch = 0; ch < C; ++ch)
      recvs.push_back(c.irecv(buf + n * ch / C * es, (n * (ch + 1) / C - n * ch / C) * es, prev, x.tag));
  for (size_t ch = 0; ch < C; ++ch) {
    if (vr > 0) waitOne(recvs[ch], x);
    if (vr + 1 < p)
      sends.push_back(c.isend(buf + n * ch / C * es, (n * (ch + 1) / C - n * ch / C) * es, next, x.tag));
  }
  c.waitAll(sends, x.deadline);
}

// Root sends block i to rank i, then a ring allgather: ~2x the bytes of one send per
// rank regardless of p, for large buffers on many ranks.
void broadcastScatterAllgather(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size(), r = c.rank();
  const size_t es = elementSize(a.type);
  char* buf = cp(a.recv);
  Layout L = evenLayout(a.count, p);
  if (r == a.root) {
    std::vector<RequestPtr> sends;
    for (int i = 0; i < p; ++i)
      if (i != r) sends.push_back(c.isend(buf + L.off[i] * es, L.len[i] * es, i, x.tag));
    c.waitAll(sends, x.deadline);
  } else {
    waitOne(c.irecv(buf + L.off[r] * es, L.len[r] * es, a.root, x.tag), x);
  }
  ringPass(c, x, buf, L, a.type, ReduceOp::kSum, false, 1);
}

// ---- reduce --------------------------------------------------------------------------

void reduceBinomial(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size();
  const int vr = mod(c.rank() - a.root, p);
  const size_t bytes = a.count * elementSize(a.type);
  auto real = [&](int v) { return mod(v + a.root, p); };
  void* acc = a.recv;
  if (c.rank() != a.root || !acc) acc = x.scratch->get(1, bytes);
  ReduceOp op = prepare(acc, a.send, a.count, a.type, a.op, a.premul_scalar);
  for (int mask = 1; mask < p; mask <<= 1) {
    if (vr & mask) {
      waitOne(c.isend(acc, bytes, real(vr - mask), x.tag), x);
      break;
    }
    if (vr + mask < p) {
      char* tmp = x.scratch->get(0, bytes);
      waitOne(c.irecv(tmp, bytes, real(vr + mask), x.tag), x);
      reduceInto(acc, tmp, a.count, a.type, op);
    }
  }
  if (c.rank() == a.root) finish(acc, a.count, a.type, a.op, p);
}

// ---- alltoall(v) ---------------------------------------------------------------------

// Step i sends to r+i and receives from r-i; at most kWindow steps in flight, so a
// large job does not post p^2 requests at once.
void pairwiseExchange(const CollArgs& a, RunContext& x, const size_t* scnt, const size_t* sdsp,
                      const size_t* rcnt, const size_t* rdsp) {
  Communicator& c = *x.comm;
  const int p = c.size(), r = c.rank();
  const size_t es = elementSize(a.type);
  const char* in = ccp(a.send);
  if (a.send == a.recv) {  // in place: keep the input while blocks are overwritten
    size_t extent = 0;
    for (int i = 0; i < p; ++i) extent = std::max(extent, (sdsp[i] + scnt[i]) * es);
    char* copy = x.scratch->get(0, extent);
    copyBytes(copy, in, extent);
    in = copy;
  }
  char* out = cp(a.recv);
  copyBytes(out + rdsp[r] * es, in + sdsp[r] * es, scnt[r] * es);
  constexpr int kWindow = 8;
  const int K = std::min(p - 1, kWindow);
  std::vector<RequestPtr> rq(p), sq(p);
  auto post = [&](int i) {
    int to = mod(r + i, p), from = mod(r - i, p);
    rq[i] = c.irecv(out + rdsp[from] * es, rcnt[from] * es, from, x.tag);
    sq[i] = c.isend(in + sdsp[to] * es, scnt[to] * es, to, x.tag);
  };
  for (int i = 1; i <= K; ++i) post(i);
  for (int i = 1; i < p; ++i) {
    int from = mod(r - i, p);
    waitOne(rq[i], x);
    expectBytes(rq[i], rcnt[from] * es, c, from, collTypeName(a.coll));
    waitOne(sq[i], x);
    rq[i].reset();
    sq[i].reset();
    if (i + K < p) post(i + K);
  }
}

void alltoallPairwise(const CollArgs& a, RunContext& x) {
  const int p = x.comm->size();
  std::vector<size_t> cnt(p, a.count), dsp(p);
  for (int i = 0; i < p; ++i) dsp[i] = a.count * i;
  pairwiseExchange(a, x, cnt.data(), dsp.data(), cnt.data(), dsp.data());
}

void alltoallvPairwise(const CollArgs& a, RunContext& x) {
  pairwiseExchange(a, x, a.send_counts.data(), a.send_displs.data(), a.recv_counts.data(),
                   a.recv_displs.data());
}

// ---- gather / scatter / barrier / p2p --------------------------------------------------

void gatherDirect(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size(), r = c.rank();
  const size_t blk = a.count * elementSize(a.type);
  if (r != a.root) {
    waitOne(c.isend(a.send, blk, a.root, x.tag), x);
    return;
  }
  copyBytes(cp(a.recv) + r * blk, a.send, blk);
  std::vector<RequestPtr> recvs;
  for (int i = 0; i < p; ++i)
    if (i != r) recvs.push_back(c.irecv(cp(a.recv) + i * blk, blk, i, x.tag));
  c.waitAll(recvs, x.deadline);
}

void scatterDirect(const CollArgs& a, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size(), r = c.rank();
  const size_t blk = a.count * elementSize(a.type);
  if (r != a.root) {
    waitOne(c.irecv(a.recv, blk, a.root, x.tag), x);
    return;
  }
  std::vector<RequestPtr> sends;
  for (int i = 0; i < p; ++i)
    if (i != r) sends.push_back(c.isend(ccp(a.send) + i * blk, blk, i, x.tag));
  copyBytes(a.recv, ccp(a.send) + r * blk, blk);
  c.waitAll(sends, x.deadline);
}

void barrierDissemination(const CollArgs&, RunContext& x) {
  Communicator& c = *x.comm;
  const int p = c.size(), r = c.rank();
  for (int k = 1; k < p; k <<= 1) {
    auto rq = c.irecv(nullptr, 0, mod(r - k, p), x.tag);
    auto sq = c.isend(nullptr, 0, mod(r + k, p), x.tag);
    c.waitAll({rq, sq}, x.deadline);
  }
}

void sendP2p(const CollArgs& a, RunContext& x) {
  waitOne(x.comm->isend(a.send, a.count * elementSize(a.type), a.peer, a.tag), x);
}

void recvP2p(const CollArgs& a, RunContext& x) {
  const size_t bytes = a.count * elementSize(a.type);
  auto r = x.comm->irecv(a.recv, bytes, a.peer, a.tag);
  waitOne(r, x);
  expectBytes(r, bytes, *x.comm, a.peer, "recv");
}

std::string always(const CollArgs&, const Communicator&) {
  return {};
}

}  // namespace

void p2pAllreduceInPlace(Communicator& c, const RunContext& x, void* buf, size_t n, DataType t, ReduceOp op,
                         uint32_t sub) {
  if (n * elementSize(t) < 64 * 1024)
    rdAllreduceInPlace(c, x, buf, n, t, op, sub);
  else
    ringAllreduceInPlace(c, x, buf, n, t, op, sub);
}

void registerHostAlgorithms(std::deque<Algorithm>& out) {
  auto add = [&](CollType coll, const char* name, const char* summary, auto run,
                 std::function<std::string(const CollArgs&, const Communicator&)> applies = always,
                 bool needs_hier = false) {
    out.push_back(Algorithm{coll, name, summary, std::move(applies), run, needs_hier});
  };
  auto pow2 = [](const CollArgs&, const Communicator& c) -> std::string {
    int p = c.size();
    return (p & (p - 1)) == 0 ? std::string() : fmt::format("{} ranks is not a power of 2", p);
  };
  auto hier = [](const CollArgs&, const Communicator& c) -> std::string {
    if (c.numNodes() < 2) return "the communicator spans one node";
    if (!uniformNodes(c)) return "nodes have different numbers of ranks";
    return {};
  };
  add(CollType::kAllreduce, "rd", "recursive doubling (non-power-of-2: fold extra ranks); log2(p) rounds",
      allreduceRd);
  add(CollType::kAllreduce, "ring", "ring reduce-scatter + allgather, chunk-pipelined; 2(p-1)/p of the data",
      allreduceRing);
  add(CollType::kAllreduce, "hierarchical",
      "intra-node ring reduce-scatter, inter-node allreduce per local index, intra-node allgather",
      allreduceHier, hier, true);
  add(CollType::kAllgather, "ring", "ring, chunk-pipelined", allgatherRing);
  add(CollType::kAllgather, "rd", "recursive doubling (power-of-2 ranks)", allgatherRd, pow2);
  add(CollType::kAllgather, "bruck", "Bruck, ceil(log2 p) rounds, any p", allgatherBruck);
  add(CollType::kReduceScatter, "ring", "ring on a working copy, chunk-pipelined", reduceScatterRing);
  add(CollType::kReduceScatter, "pairwise", "pairwise exchange of blocks, windowed", reduceScatterPairwise);
  add(CollType::kBroadcast, "binomial", "binomial tree", broadcastBinomial);
  add(CollType::kBroadcast, "chain", "pipelined chain from the root", broadcastChain);
  add(CollType::kBroadcast, "scatter_allgather", "root scatters blocks, then ring allgather",
      broadcastScatterAllgather);
  add(CollType::kReduce, "binomial", "binomial tree", reduceBinomial);
  add(CollType::kAlltoall, "pairwise", "pairwise exchange, at most 8 steps in flight", alltoallPairwise);
  add(CollType::kAlltoallv, "pairwise", "pairwise exchange, at most 8 steps in flight", alltoallvPairwise);
  add(CollType::kGather, "direct", "root posts every receive", gatherDirect);
  add(CollType::kScatter, "direct", "root posts every send", scatterDirect);
  add(CollType::kBarrier, "dissemination", "log2(p) rounds of empty messages", barrierDissemination);
  add(CollType::kSend, "p2p", "tagged send", sendP2p);
  add(CollType::kRecv, "p2p", "tagged receive", recvP2p);
}

}  // namespace crossbar
