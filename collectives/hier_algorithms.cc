// Multi-node host algorithms, composed from intra-node sub-operations over symmetric
// memory (symm_staging.h) and inter-node point-to-point among the ranks with the same
// local index (one per node), pipelined in chunks: the buffer is cut into chunks and a
// helper thread runs chunk k's inter-node part (blocking p2p, progressed while it
// waits) while this thread runs the intra-node part of the neighbouring chunks:
//
//   this thread:   A(0)  A(1) C(0)  A(2) C(1)  ...        C(K-1)
//   helper:              B(0)       B(1)       B(2) ...
//
// allreduce:      A = intra reduce-scatter, B = inter allreduce of my block, C = intra allgather
// reduce_scatter: A = intra reduce-scatter of the blocks bound for each node, B = exchange
//                 and combine the partial blocks across nodes
// allgather:      B = inter exchange of my block, C = intra allgather of the node's blocks
// broadcast:      B = chain across nodes among the root's local index, C = intra broadcast
// alltoall:       A = intra alltoallv collecting the blocks bound for each node's rank with
//                 my local index, B = one aggregated message per node pair
//
// Only the helper touches the inter-node communicator and only this thread the
// symmetric staging, so the two never share state (scratch slots are split: the
// helper's p2p uses slots 0-1, this file's buffers slots kSlot*). Reductions are
// normalized as in the other algorithms: premul-sum scales each input once in the
// intra phase, avg sums and divides once at the end; each element is combined in a
// fixed order (intra rank order, then the inter algorithm's), and every rank gets the
// same bits because each block is reduced once and then copied.
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/reduce.h"
#include "collectives/symm_staging.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/thread_name.h"
#include "telemetry/telemetry.h"

namespace crossbar {
namespace {

constexpr size_t kAlign = 64;      // intra blocks start on cache lines
constexpr int kSlotPartials = 4;   // reduce_scatter / alltoall: blocks bound for other nodes
constexpr int kSlotInbound = 5;    // reduce_scatter / alltoall: blocks from other nodes
constexpr int kSlotInPlace = 6;    // alltoall in place: a copy of the input
constexpr uint32_t kSubInter = 8;  // inter-node sub-tags (another communicator; kept apart anyway)


// CROSSBAR_COLL_HIER_CHUNK, read once.
size_t hierChunkBytes() {
  static const size_t v = std::max<size_t>(env::getSize("CROSSBAR_COLL_HIER_CHUNK"), kAlign);
  return v;
}

// Ranks by (node, local index), nodes numbered densely in the order of the inter-node
// communicator (split by local index, keyed by node id).
struct NodeMap {
  int nodes = 0, local = 0;
  int my_node = 0, my_local = 0;
  std::vector<int> ranks;  // [node * local + l]
  int at(int node, int l) const { return ranks[static_cast<size_t>(node) * local + l]; }
};

NodeMap nodeMap(const Communicator& c, const HierComms& h) {
  std::vector<int> ids;
  for (int r = 0; r < c.size(); ++r) ids.push_back(c.nodeOf(r));
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  NodeMap m;
  m.nodes = static_cast<int>(ids.size());
  m.local = static_cast<int>(c.nodePeers(c.rank()).size());
  m.ranks.assign(static_cast<size_t>(m.nodes) * m.local, -1);
  for (int n = 0; n < m.nodes; ++n) {
    std::vector<int> peers;
    for (int r = 0; r < c.size(); ++r)
      if (c.nodeOf(r) == ids[n]) peers.push_back(r);
    for (int l = 0; l < m.local && l < static_cast<int>(peers.size()); ++l)
      m.ranks[static_cast<size_t>(n) * m.local + l] = peers[l];
  }
  m.my_node = static_cast<int>(std::lower_bound(ids.begin(), ids.end(), c.node()) - ids.begin());
  auto mine = c.nodePeers(c.rank());
  m.my_local = static_cast<int>(std::find(mine.begin(), mine.end(), c.rank()) - mine.begin());
  if (h.intra->rank() != m.my_local || h.intra->size() != m.local || h.inter->rank() != m.my_node ||
      h.inter->size() != m.nodes)
    throw InternalError(
        fmt::format("{}hierarchical sub-communicators disagree with the topology (intra {}/{}, "
                    "inter {}/{}; expected {}/{}, {}/{})",
                    errorContext(c.rank(), "hierarchical"), h.intra->rank(), h.intra->size(), h.inter->rank(),
                    h.inter->size(), m.my_local, m.local, m.my_node, m.nodes));
  return m;
}

// The inter-node helper: runs B(k) for k = 0, 1, ... as they are handed over, in order.
class InterWorker {
 public:
  InterWorker(std::function<void(size_t)> stage, Deadline deadline)
      : stage_(std::move(stage)), deadline_(deadline), thread_([this] {
          nameThisThread("cb-hier-stage");
          loop();
        }) {}
  ~InterWorker() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push() {
    {
      std::lock_guard<std::mutex> lk(m_);
      ++posted_;
    }
    cv_.notify_all();
  }
  // Waits until B(k) finished; rethrows the helper's failure.
  void waitDone(size_t k, int rank) {
    std::unique_lock<std::mutex> lk(m_);
    while (done_ <= k && !error_) {
      if (deadline_.expired())
        throw Timeout(fmt::format("{}inter-node phase of chunk {} did not finish before the deadline",
                                  errorContext(rank, "hierarchical"), k));
      cv_.wait_for(lk, std::min<Millis>(deadline_.remaining(), Millis(100)));
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lk(m_);
    while (true) {
      cv_.wait(lk, [&] { return stop_ || posted_ > done_; });
      if (stop_) return;  // the pipeline failed or finished: start nothing new
      const size_t k = done_;
      lk.unlock();
      std::exception_ptr err;
      try {
        stage_(k);
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      if (err) {
        error_ = err;
        cv_.notify_all();
        return;
      }
      ++done_;
      cv_.notify_all();
    }
  }

  std::function<void(size_t)> stage_;
  Deadline deadline_;
  std::mutex m_;
  std::condition_variable cv_;
  size_t posted_ = 0, done_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: starts after the members it uses
};

// Runs A(k) -> B(k) -> C(k) for k < K with B on the helper, A(k+1) and C(k-1) while
// B(k) runs. Empty stages may be null. One chunk runs inline (no thread).
void pipeline(size_t K, const RunContext& x, int rank, const std::function<void(size_t)>& A,
              const std::function<void(size_t)>& B, const std::function<void(size_t)>& C) {
  if (K == 0) return;
  if (K == 1 || !B) {
    for (size_t k = 0; k < K; ++k) {
      if (A) A(k);
      if (B) B(k);
      if (C) C(k);
    }
    return;
  }
  InterWorker helper(B, x.deadline);
  for (size_t k = 0; k < K; ++k) {
    if (A) A(k);
    helper.push();
    if (k > 0) {
      helper.waitDone(k - 1, rank);
      if (C) C(k - 1);
    }
  }
  helper.waitDone(K - 1, rank);
  if (C) C(K - 1);
}

ReduceParams paramsOf(const CollArgs& a) {
  ReduceParams p;
  p.preMulScalar = a.premul_scalar;
  return p;
}
// Intra phase: premul scales each input once; avg sums (divided at the very end).
ReduceOp intraOp(ReduceOp op) {
  return op == ReduceOp::kAvg ? ReduceOp::kSum : op;
}
// Inter phase combines partial results: plain sum for premul and avg.
ReduceOp interOp(ReduceOp op) {
  return op == ReduceOp::kAvg || op == ReduceOp::kPreMulSum ? ReduceOp::kSum : op;
}

// Elements per pipeline chunk of `bytes`: a whole number of cache lines, at least one element.
size_t chunkElems(size_t bytes, size_t es) {
  return std::max<size_t>(bytes / kAlign * kAlign / es, 1);
}

RunContext helperContext(const RunContext& x, Communicator& inter) {
  RunContext h = x;
  h.comm = &inter;
  h.symm = nullptr;  // the helper never touches symmetric staging
  return h;
}

// ---- allreduce -----------------------------------------------------------------------

// Chunk k ([k*C, ...) of the buffer) is split into one cache-aligned block per local rank.
void allreduceHierPipelined(const CollArgs& a, RunContext& x) {
  Communicator& inter = *x.hier->inter;
  const NodeMap nm = nodeMap(*x.comm, *x.hier);
  SymmStaging& s = x.symm->get(*x.hier->intra);
  const int L = nm.local, l = nm.my_local;
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = chunkElems(hierChunkBytes(), es);
  const size_t K = ceilDiv(n, C);
  const size_t align = std::max<size_t>(kAlign / es, 1);
  auto blocksOf = [&](size_t k) {
    const size_t lo = k * C, m = std::min(C, n - lo);
    const size_t blk = (ceilDiv(m, static_cast<size_t>(L)) + align - 1) / align * align;
    Blocks B;
    for (int b = 0; b < L; ++b) {
      size_t o = std::min(m, blk * b);
      B.off.push_back(o);
      B.len.push_back(std::min(m, blk * (b + 1)) - o);
    }
    return B;
  };
  const ReduceParams prm = paramsOf(a);
  const ReduceOp op1 = intraOp(a.op), opn = interOp(a.op);
  RunContext hx = helperContext(x, inter);
  const int total = x.comm->size();
  pipeline(
      K, x, x.comm->rank(),
      [&](size_t k) {
        const size_t lo = k * C;
        Blocks B = blocksOf(k);
        symmReduceScatter(s, x, ccp(a.send) + lo * es, cp(a.recv) + (lo + B.off[l]) * es, B, a.type, op1,
                          prm);
      },
      [&](size_t k) {
        const size_t lo = k * C;
        Blocks B = blocksOf(k);
        char* mine = cp(a.recv) + (lo + B.off[l]) * es;
        if (!B.len[l]) return;
        p2pAllreduceInPlace(inter, hx, mine, B.len[l], a.type, opn, kSubInter);
        if (a.op == ReduceOp::kAvg) finishReduce(mine, B.len[l], a.type, a.op, static_cast<uint64_t>(total));
      },
      [&](size_t k) {
        const size_t lo = k * C;
        Blocks B = blocksOf(k);
        symmAllgather(s, x, cp(a.recv) + (lo + B.off[l]) * es, cp(a.recv) + lo * es, B, a.type, false);
      });
}

// ---- reduce_scatter ------------------------------------------------------------------

// Chunk k of every rank's block (elements [k*C, ...) of count). A: for each node j, the
// local ranks reduce-scatter the blocks of node j's ranks, so local rank l holds node
// j's partial for its local index l (its own node's straight in the output). B: the
// partials go to the rank with local index l on node j, which adds the ones it gets.
void reduceScatterHierPipelined(const CollArgs& a, RunContext& x) {
  Communicator& inter = *x.hier->inter;
  const NodeMap nm = nodeMap(*x.comm, *x.hier);
  SymmStaging& s = x.symm->get(*x.hier->intra);
  const int L = nm.local, N = nm.nodes, me = nm.my_node;
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = chunkElems(hierChunkBytes() / static_cast<size_t>(L), es);
  const size_t K = ceilDiv(n, C);
  const size_t slot = C * es;
  // Two generations of outbound partials (A(k+1) runs while B(k) sends), one inbound set.
  char* outbound = x.scratch->get(kSlotPartials, 2 * static_cast<size_t>(N) * slot);
  char* inbound = x.scratch->get(kSlotInbound, static_cast<size_t>(N) * slot);
  auto partial = [&](size_t k, int j) { return outbound + ((k % 2) * N + j) * slot; };
  const ReduceParams prm = paramsOf(a);
  const ReduceOp op1 = intraOp(a.op), opn = interOp(a.op);
  RunContext hx = helperContext(x, inter);
  const int total = x.comm->size();
  pipeline(
      K, x, x.comm->rank(),
      [&](size_t k) {
        const size_t lo = k * C, m = std::min(C, n - lo);
        // Node order: the staging sequence must be identical on every rank.
        for (int j = 0; j < N; ++j) {
          Blocks B;
          for (int b = 0; b < L; ++b) {
            B.off.push_back(static_cast<size_t>(nm.at(j, b)) * n + lo);
            B.len.push_back(m);
          }
          char* out = j == me ? cp(a.recv) + lo * es : partial(k, j);
          symmReduceScatter(s, x, a.send, out, B, a.type, op1, prm);
        }
      },
      [&](size_t k) {
        const size_t lo = k * C, m = std::min(C, n - lo);
        std::vector<RequestPtr> reqs;
        for (int j = 0; j < N; ++j) {
          if (j == me) continue;
          reqs.push_back(inter.irecv(inbound + j * slot, m * es, j, hx.tag + kSubInter));
          reqs.push_back(inter.isend(partial(k, j), m * es, j, hx.tag + kSubInter));
        }
        {
          telemetry::PeerWait waiting(-1);
          inter.waitAll(reqs, hx.deadline);
        }
        char* out = cp(a.recv) + lo * es;
        for (int j = 0; j < N; ++j)
          if (j != me) reduceInto(out, inbound + j * slot, m, a.type, opn);
        if (a.op == ReduceOp::kAvg) finishReduce(out, m, a.type, a.op, static_cast<uint64_t>(total));
      },
      nullptr);
}

// ---- allgather -----------------------------------------------------------------------

// B: the ranks with my local index swap chunk k of their blocks (each lands in its
// final place in the output). C: for each node j, the local ranks allgather chunk k of
// node j's blocks (local rank l contributes the one of rank (j, l) it now holds).
void allgatherHierPipelined(const CollArgs& a, RunContext& x) {
  Communicator& inter = *x.hier->inter;
  const NodeMap nm = nodeMap(*x.comm, *x.hier);
  SymmStaging& s = x.symm->get(*x.hier->intra);
  const int L = nm.local, N = nm.nodes, l = nm.my_local, me = nm.my_node;
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = chunkElems(hierChunkBytes() / static_cast<size_t>(L), es);
  const size_t K = ceilDiv(n, C);
  const int r = x.comm->rank();
  char* out = cp(a.recv);
  if (ccp(a.send) != out + static_cast<size_t>(r) * n * es)
    std::memcpy(out + static_cast<size_t>(r) * n * es, a.send, n * es);
  RunContext hx = helperContext(x, inter);
  const bool nt = n * es * static_cast<size_t>(x.comm->size()) >= (8u << 20);
  pipeline(
      K, x, r, nullptr,
      [&](size_t k) {
        const size_t lo = k * C, m = std::min(C, n - lo);
        std::vector<RequestPtr> reqs;
        const char* mine = out + (static_cast<size_t>(r) * n + lo) * es;
        for (int i = 1; i < N; ++i) {  // nearest nodes first, so not everyone targets node 0
          const int from = (me - i + N) % N, to = (me + i) % N;
          reqs.push_back(inter.irecv(out + (static_cast<size_t>(nm.at(from, l)) * n + lo) * es, m * es, from,
                                     hx.tag + kSubInter));
          reqs.push_back(inter.isend(mine, m * es, to, hx.tag + kSubInter));
        }
        telemetry::PeerWait waiting(-1);
        inter.waitAll(reqs, hx.deadline);
      },
      [&](size_t k) {
        const size_t lo = k * C, m = std::min(C, n - lo);
        for (int j = 0; j < N; ++j) {
          Blocks B;
          for (int b = 0; b < L; ++b) {
            B.off.push_back(static_cast<size_t>(nm.at(j, b)) * n + lo);
            B.len.push_back(m);
          }
          symmAllgather(s, x, out + B.off[l] * es, out, B, a.type, nt);
        }
      });
}

// ---- broadcast -----------------------------------------------------------------------

// B: the ranks with the root's local index pass chunk k along a chain of nodes starting
// at the root's. C: each of them broadcasts chunk k inside its node.
void broadcastHierPipelined(const CollArgs& a, RunContext& x) {
  Communicator& inter = *x.hier->inter;
  Communicator& intra = *x.hier->intra;
  const NodeMap nm = nodeMap(*x.comm, *x.hier);
  const int N = nm.nodes, me = nm.my_node;
  int root_node = 0, root_local = 0;
  for (int j = 0; j < N; ++j)
    for (int b = 0; b < nm.local; ++b)
      if (nm.at(j, b) == a.root) root_node = j, root_local = b;
  const size_t es = elementSize(a.type), n = a.count;
  const size_t C = chunkElems(hierChunkBytes(), es);
  const size_t K = ceilDiv(n, C);
  const Algorithm* intra_bcast = findAlgorithm(CollType::kBroadcast, "symm");
  if (!intra_bcast) throw InternalError("hierarchical broadcast: the symm broadcast is not registered");
  RunContext hx = helperContext(x, inter);
  RunContext ix = x;
  ix.comm = &intra;
  const int pos = (me - root_node + N) % N;  // place in the chain
  const bool carrier = nm.my_local == root_local;
  std::function<void(size_t)> B;
  if (carrier && N > 1)
    B = [&](size_t k) {
      const size_t lo = k * C, m = std::min(C, n - lo);
      char* chunk = cp(a.recv) + lo * es;
      telemetry::PeerWait waiting(-1);
      if (pos > 0) inter.irecv(chunk, m * es, (me - 1 + N) % N, hx.tag + kSubInter)->wait(hx.deadline);
      if (pos + 1 < N) inter.isend(chunk, m * es, (me + 1) % N, hx.tag + kSubInter)->wait(hx.deadline);
    };
  pipeline(K, x, x.comm->rank(), nullptr, B, [&](size_t k) {
    const size_t lo = k * C, m = std::min(C, n - lo);
    CollArgs c = CollArgs::of(CollType::kBroadcast, cp(a.recv) + lo * es, cp(a.recv) + lo * es, m, a.type);
    c.root = root_local;
    intra_bcast->run(c, ix);
  });
}

// ---- alltoall -------------------------------------------------------------------------

// Aggregated per destination node, so each pair of nodes exchanges one message per
// local-index pair and chunk. A: for each node j, the local ranks run an intra-node
// alltoallv of chunk k of their blocks bound for node j's ranks: local rank l collects
// every local rank's block for rank (j, l) (its own node's straight into the output).
// B: those L blocks go to rank (j, l) in one message; what arrives is scattered into
// the output.
void alltoallHierPipelined(const CollArgs& a, RunContext& x) {
  Communicator& inter = *x.hier->inter;
  const NodeMap nm = nodeMap(*x.comm, *x.hier);
  const int L = nm.local, N = nm.nodes, me = nm.my_node;
  const size_t es = elementSize(a.type), n = a.count, p = static_cast<size_t>(x.comm->size());
  const size_t C = chunkElems(hierChunkBytes() / static_cast<size_t>(L), es);
  const size_t K = ceilDiv(n, C);
  const size_t agg = static_cast<size_t>(L) * C * es;  // one node's aggregate per chunk
  const char* in = ccp(a.send);
  if (a.send == a.recv) {  // in place: blocks are overwritten before every chunk of them is sent
    char* copy = x.scratch->get(kSlotInPlace, p * n * es);
    std::memcpy(copy, a.send, p * n * es);
    in = copy;
  }
  char* outbound = x.scratch->get(kSlotPartials, 2 * static_cast<size_t>(N) * agg);
  char* inbound = x.scratch->get(kSlotInbound, static_cast<size_t>(N) * agg);
  auto aggregate = [&](size_t k, int j) { return outbound + ((k % 2) * N + j) * agg; };
  const Algorithm* intra_v = findAlgorithm(CollType::kAlltoallv, "symm");
  if (!intra_v) throw InternalError("hierarchical alltoall: the symm alltoallv is not registered");
  RunContext ix = x;
  ix.comm = x.hier->intra.get();
  RunContext hx = helperContext(x, inter);
  pipeline(
      K, x, x.comm->rank(),
      [&](size_t k) {
        const size_t lo = k * C, m = std::min(C, n - lo);
        for (int j = 0; j < N; ++j) {
          char* dst = j == me ? cp(a.recv) : aggregate(k, j);
          CollArgs c = CollArgs::of(CollType::kAlltoallv, in, dst, 0, a.type);
          for (int b = 0; b < L; ++b) {
            c.send_counts.push_back(m);
            c.recv_counts.push_back(m);
            c.send_displs.push_back(static_cast<size_t>(nm.at(j, b)) * n + lo);
            c.recv_displs.push_back(j == me ? static_cast<size_t>(nm.at(me, b)) * n + lo : b * m);
          }
          intra_v->run(c, ix);
        }
      },
      [&](size_t k) {
        const size_t lo = k * C, m = std::min(C, n - lo);
        std::vector<RequestPtr> reqs;
        for (int i = 1; i < N; ++i) {
          const int from = (me - i + N) % N, to = (me + i) % N;
          reqs.push_back(inter.irecv(inbound + from * agg, L * m * es, from, hx.tag + kSubInter));
          reqs.push_back(inter.isend(aggregate(k, to), L * m * es, to, hx.tag + kSubInter));
        }
        {
          telemetry::PeerWait waiting(-1);
          inter.waitAll(reqs, hx.deadline);
        }
        for (int j = 0; j < N; ++j)
          if (j != me)
            for (int b = 0; b < L; ++b)
              std::memcpy(cp(a.recv) + (static_cast<size_t>(nm.at(j, b)) * n + lo) * es,
                          inbound + j * agg + b * m * es, m * es);
      },
      nullptr);
}

// ---- applicability -------------------------------------------------------------------

std::string hierApplies(const CollArgs&, const Communicator& c) {
  static const bool symm_off = env::getSize("CROSSBAR_COLL_SYMM_BYTES") == 0;
  if (symm_off) return "CROSSBAR_COLL_SYMM_BYTES=0 disables the symmetric-memory intra-node phases";
  if (c.numNodes() < 2) return "the communicator spans one node";
  if (!uniformNodes(c)) return "nodes have different numbers of ranks";
  return {};
}

}  // namespace

void registerHierAlgorithms(std::deque<Algorithm>& out) {
  auto add = [&](CollType coll, const char* summary, void (*run)(const CollArgs&, RunContext&)) {
    out.push_back(Algorithm{coll, "hier_pipelined", summary, hierApplies, run, true});
  };
  add(CollType::kAllreduce,
      "chunks: symm reduce-scatter in the node | p2p allreduce per local index (helper thread) | symm "
      "allgather",
      allreduceHierPipelined);
  add(CollType::kReduceScatter,
      "chunks: symm reduce-scatter of each node's blocks | exchange + combine partials across nodes",
      reduceScatterHierPipelined);
  add(CollType::kAllgather,
      "chunks: exchange blocks across nodes per local index | symm allgather in the node",
      allgatherHierPipelined);
  add(CollType::kAlltoall,
      "chunks: symm alltoallv gathers each node's blocks per local index | one message per node pair",
      alltoallHierPipelined);
  add(CollType::kBroadcast,
      "chunks: chain across nodes on the root's local index | symm broadcast in the node",
      broadcastHierPipelined);
}

}  // namespace crossbar
