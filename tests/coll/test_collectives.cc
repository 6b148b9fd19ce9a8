// Collectives over the real transports (shm within a node, UCX across virtual nodes).
//
// Data is a closed form of (seed, rank, index): small integers for reductions, chosen
// per type and op so every partial result is exactly representable and the expected
// value is exact in any order (computed with reduce.h over every rank's input);
// arbitrary bytes for data movement. Forking is the slow part, so each runRanks() call
// runs a whole matrix of cases (every collective x algorithm x size x in/out of place
// x offset), issued in nonblocking batches and then waited for.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "collectives/algorithms.h"
#include "collectives/collectives.h"
#include "collectives/reduce.h"
#include "collectives/selection.h"
#include "comm/errors.h"
#include "comm/tcp_store.h"
#include "harness/multiprocess.h"

using namespace crossbar;
using crossbar::testing::RankEnv;
using crossbar::testing::RunOptions;
using crossbar::testing::runRanks;

namespace {

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t hashOf(uint64_t seed, int rank, size_t i) {
  return mix(seed * 1000003u + mix(rank * 7919u + mix(i)));
}

struct Range {
  int lo, hi;
};

// Value ranges that keep every partial sum/product exact for up to 8 ranks (sums also
// after premul-sum by 2: all values stay even where the format's spacing is 2).
Range rangeFor(DataType t, ReduceOp op) {
  if (op == ReduceOp::kProd)
    return isFloating(t) ? Range{1, 2} : isSignedInteger(t) ? Range{-3, 3} : Range{0, 3};
  if (op == ReduceOp::kMin || op == ReduceOp::kMax) {
    switch (t) {
      case DataType::kFloat8E4M3:
      case DataType::kFloat8E5M2:
        return {-8, 8};
      case DataType::kUInt8:
      case DataType::kUInt32:
      case DataType::kUInt64:
        return {0, 200};
      default:
        return {-100, 100};
    }
  }
  switch (t) {
    case DataType::kInt8:
      return {-15, 15};
    case DataType::kUInt8:
      return {0, 31};
    case DataType::kUInt32:
    case DataType::kUInt64:
      return {0, 1000};
    case DataType::kFloat16:
      return {-200, 200};
    case DataType::kBFloat16:
      return {-31, 31};
    case DataType::kFloat8E4M3:
      return {-2, 2};
    case DataType::kFloat8E5M2:
      return {-1, 1};
    default:
      return {-1000, 1000};
  }
}

// Reduction input: element i of rank `rank`.
void fillValues(DataType t, void* buf, size_t n, uint64_t seed, int rank, Range r) {
  visitDataType(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(buf);
    for (size_t i = 0; i < n; ++i) {
      int v = r.lo + static_cast<int>(hashOf(seed, rank, i) % static_cast<uint64_t>(r.hi - r.lo + 1));
      p[i] = storeAcc<T>(static_cast<AccumT<T>>(v));
    }
  });
}

// Data-movement input: arbitrary bytes.
void fillBytes(void* buf, size_t bytes, uint64_t seed, int rank, size_t first_byte = 0) {
  auto* p = static_cast<uint8_t*>(buf);
  for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(hashOf(seed, rank, first_byte + i) >> 17);
}

bool isReduction(CollType c) {
  return c == CollType::kAllreduce || c == CollType::kReduceScatter || c == CollType::kReduce;
}

struct Case {
  CollType coll;
  std::string algo;
  size_t n = 0;
  bool inplace = false;
  size_t off = 0;  // elements the user buffers start past an allocation
  DataType type = DataType::kInt32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  double premul = 2.0;
  std::string name() const {
    return fmt::format("{}/{} n={} {} off={} {} {} root={}", collTypeName(coll), algo, n,
                       inplace ? "inplace" : "outofplace", off, dataTypeName(type),
                       isReduction(coll) ? reduceOpName(op) : "-", root);
  }
};

// One case in flight: buffers, its Work, and the check.
class Instance {
 public:
  Instance(const Case& c, Communicator& comm, uint64_t seed) : c_(c), comm_(comm), seed_(seed) {}

  void issue(Collectives& coll) {
    const int p = comm_.size(), r = comm_.rank();
    const size_t es = elementSize(c_.type), n = c_.n;
    CollOptions o;
    o.algorithm = c_.algo;
    o.premul_scalar = c_.premul;
    const Range rng = rangeFor(c_.type, c_.op);
    switch (c_.coll) {
      case CollType::kAllreduce: {
        send_ = alloc(n);
        fillValues(c_.type, send_, n, seed_, r, rng);
        recv_ = c_.inplace ? send_ : alloc(n);
        w_ = coll.allreduce(send_, recv_, n, c_.type, c_.op, o);
        break;
      }
      case CollType::kReduceScatter: {
        send_ = alloc(n * p);
        fillValues(c_.type, send_, n * p, seed_, r, rng);
        recv_ = c_.inplace ? send_ + r * n * es : alloc(n);
        w_ = coll.reduceScatter(send_, recv_, n, c_.type, c_.op, o);
        break;
      }
      case CollType::kReduce: {
        send_ = alloc(n);
        fillValues(c_.type, send_, n, seed_, r, rng);
        recv_ = r == c_.root ? (c_.inplace ? send_ : alloc(n)) : nullptr;
        w_ = coll.reduce(send_, recv_, n, c_.type, c_.op, c_.root, o);
        break;
      }
      case CollType::kAllgather: {
        recv_ = alloc(n * p);
        fillBytes(recv_, n * p * es, seed_ + 1, r);  // garbage
        if (c_.inplace) {
          send_ = recv_ + r * n * es;
        } else {
          send_ = alloc(n);
        }
        fillBytes(send_, n * es, seed_, r);
        w_ = coll.allgather(send_, recv_, n, c_.type, o);
        break;
      }
      case CollType::kBroadcast: {
        recv_ = alloc(n);
        fillBytes(recv_, n * es, seed_, r == c_.root ? c_.root : 1000 + r);
        w_ = coll.broadcast(recv_, n, c_.type, c_.root, o);
        break;
      }
      case CollType::kAlltoall: {
        send_ = alloc(n * p);
        fillBytes(send_, n * p * es, seed_, r);
        recv_ = c_.inplace ? send_ : alloc(n * p);
        w_ = coll.alltoall(send_, recv_, n, c_.type, o);
        break;
      }
      case CollType::kAlltoallv: {
        sc_.resize(p), sd_.resize(p), rc_.resize(p), rd_.resize(p);
        size_t so = 0, ro = 0;
        for (int j = 0; j < p; ++j) {
          sc_[j] = vcount(r, j);
          sd_[j] = so;
          so += sc_[j] + 1;  // gaps between blocks
          rc_[j] = vcount(j, r);
        }
        for (int j = p - 1; j >= 0; --j) {  // receive blocks in reverse rank order
          rd_[j] = ro;
          ro += rc_[j] + 2;
        }
        send_ = alloc(so);
        fillBytes(send_, so * es, seed_, r);
        recv_ = alloc(ro);
        std::memset(recv_, 0xEE, ro * es);
        recv_elems_ = ro;
        w_ = coll.alltoallv(send_, sc_, sd_, recv_, rc_, rd_, c_.type, o);
        break;
      }
      case CollType::kGather: {
        if (r == c_.root) {
          recv_ = alloc(n * p);
          send_ = c_.inplace ? recv_ + r * n * es : alloc(n);
        } else {
          send_ = alloc(n);
        }
        fillBytes(send_, n * es, seed_, r);
        w_ = coll.gather(send_, recv_, n, c_.root, c_.type, o);
        break;
      }
      case CollType::kScatter: {
        if (r == c_.root) {
          send_ = alloc(n * p);
          fillBytes(send_, n * p * es, seed_, r);
          recv_ = c_.inplace ? send_ + r * n * es : alloc(n);
        } else {
          recv_ = alloc(n);
        }
        w_ = coll.scatter(send_, recv_, n, c_.root, c_.type, o);
        break;
      }
      case CollType::kBarrier:
        w_ = coll.barrier(o);
        break;
      default:
        FAIL() << "no test for " << collTypeName(c_.coll);
    }
  }

  WorkPtr work() const { return w_; }

  // Returns "" or what is wrong.
  std::string verify() {
    const int p = comm_.size(), r = comm_.rank();
    const size_t es = elementSize(c_.type), n = c_.n;
    std::vector<char> expect;
    const Range rng = rangeFor(c_.type, c_.op);
    auto reduced = [&](size_t elems, size_t from, size_t len) {
      // reduce.h over every rank's input elements [from, from + len) of `elems`.
      std::vector<std::vector<char>> in(p, std::vector<char>(elems * es + 1));
      std::vector<const void*> srcs(p);
      for (int q = 0; q < p; ++q) {
        fillValues(c_.type, in[q].data(), elems, seed_, q, rng);
        srcs[q] = in[q].data() + from * es;
      }
      std::vector<char> out(len * es + 1);
      ReduceParams prm;
      prm.preMulScalar = c_.premul;
      if (len) reduce(out.data(), srcs.data(), p, len, c_.type, c_.op, prm);
      out.resize(len * es);
      return out;
    };
    const char* got = recv_;
    size_t got_bytes = 0;
    switch (c_.coll) {
      case CollType::kAllreduce:
        expect = reduced(n, 0, n);
        break;
      case CollType::kReduceScatter:
        expect = reduced(n * p, r * n, n);
        break;
      case CollType::kReduce:
        if (r != c_.root) return "";
        expect = reduced(n, 0, n);
        break;
      case CollType::kAllgather:
        expect.resize(n * p * es);
        for (int q = 0; q < p; ++q) fillBytes(expect.data() + q * n * es, n * es, seed_, q);
        break;
      case CollType::kBroadcast:
        expect.resize(n * es);
        fillBytes(expect.data(), n * es, seed_, c_.root);
        break;
      case CollType::kAlltoall:
        expect.resize(n * p * es);
        for (int q = 0; q < p; ++q) fillBytes(expect.data() + q * n * es, n * es, seed_, q, r * n * es);
        break;
      case CollType::kAlltoallv: {
        expect.assign(recv_elems_ * es, static_cast<char>(0xEE));
        for (int q = 0; q < p; ++q) {
          // Rank q's send displacement of its block to me.
          size_t sd = 0;
          for (int j = 0; j < r; ++j) sd += vcount(q, j) + 1;
          fillBytes(expect.data() + rd_[q] * es, rc_[q] * es, seed_, q, sd * es);
        }
        break;
      }
      case CollType::kGather:
        if (r != c_.root) return "";
        expect.resize(n * p * es);
        for (int q = 0; q < p; ++q) fillBytes(expect.data() + q * n * es, n * es, seed_, q);
        break;
      case CollType::kScatter:
        expect.resize(n * es);
        fillBytes(expect.data(), n * es, seed_, c_.root, r * n * es);
        break;
      case CollType::kBarrier:
        return "";
      default:
        return "unknown collective";
    }
    got_bytes = expect.size();
    for (size_t b = 0; b < got_bytes; ++b) {
      if (got[b] != expect[b]) {
        return fmt::format("rank {}: {}: first mismatch at byte {} (element {}): got {:#04x} want {:#04x}", r,
                           c_.name(), b, b / es, static_cast<uint8_t>(got[b]),
                           static_cast<uint8_t>(expect[b]));
      }
    }
    return "";
  }

 private:
  size_t vcount(int from, int to) const { return (c_.n + 3 * from + 5 * to) % (c_.n + 4); }

  char* alloc(size_t elems) {
    const size_t es = elementSize(c_.type);
    bufs_.emplace_back((elems + c_.off + 1) * es + 64);
    return bufs_.back().data() + c_.off * es;
  }

  Case c_;
  Communicator& comm_;
  uint64_t seed_;
  std::deque<std::vector<char>> bufs_;
  char* send_ = nullptr;
  char* recv_ = nullptr;
  std::vector<size_t> sc_, sd_, rc_, rd_;
  size_t recv_elems_ = 0;
  WorkPtr w_;
};

bool hasInPlace(CollType c) {
  return c != CollType::kBroadcast && c != CollType::kBarrier && c != CollType::kAlltoallv;
}

// The whole matrix for one communicator, identical on every rank. `multi`: the
// communicator spans several nodes (adds the multi-node algorithms' type x op sweep).
std::vector<Case> matrix(int p, bool multi = false) {
  std::vector<Case> cases;
  const size_t sizes[] = {0, 1, 7, 1031, 65539};
  const std::pair<DataType, ReduceOp> red[] = {
      {DataType::kInt32, ReduceOp::kSum},
      {DataType::kFloat32, ReduceOp::kAvg},
      {DataType::kFloat16, ReduceOp::kSum},
      {DataType::kBFloat16, ReduceOp::kMax},
      {DataType::kInt64, ReduceOp::kProd},
      {DataType::kUInt8, ReduceOp::kMin},
      {DataType::kFloat8E4M3, ReduceOp::kPreMulSum},
      {DataType::kFloat64, ReduceOp::kSum},
  };
  const DataType mov[] = {DataType::kInt32, DataType::kUInt8, DataType::kFloat16, DataType::kFloat64};
  int k = 0;
  for (const Algorithm& a : algorithms()) {
    if (a.coll == CollType::kSend || a.coll == CollType::kRecv) continue;
    if (a.coll == CollType::kBarrier) {
      cases.push_back(Case{a.coll, a.name});
      continue;
    }
    for (size_t si = 0; si < std::size(sizes); ++si) {
      for (int inplace = 0; inplace < (hasInPlace(a.coll) ? 2 : 1); ++inplace) {
        Case c;
        c.coll = a.coll;
        c.algo = a.name;
        c.n = sizes[si];
        c.inplace = inplace;
        c.off = (si + inplace) % 2;
        if (isReduction(a.coll)) {
          auto [t, op] = red[k % std::size(red)];
          c.type = t;
          c.op = op;
        } else {
          c.type = mov[k % std::size(mov)];
        }
        c.root = k % p;
        ++k;
        cases.push_back(c);
      }
    }
  }
  // Every type x op: allreduce with each algorithm, reduce and reduce_scatter.
  for (int ti = 0; ti < kNumDataTypes; ++ti) {
    for (int oi = 0; oi < kNumReduceOps; ++oi) {
      auto t = static_cast<DataType>(ti);
      auto op = static_cast<ReduceOp>(oi);
      if (!isSupported(t, op)) continue;
      for (const char* algo : {"rd", "ring", "hierarchical"})
        for (size_t n : {size_t{7}, size_t{1031}})
          cases.push_back(Case{CollType::kAllreduce, algo, n, (ti + oi) % 2 == 0, size_t(oi % 2), t, op});
      // Symmetric-memory algorithms: also a size past the (test-sized) staging buffer,
      // so every type x op goes through the chunked path.
      for (const char* algo : {"oneshot", "twoshot", "twoshot_nt", "hierarchical_symm"})
        for (size_t n : {size_t{7}, size_t{1031}, size_t{9001}})
          cases.push_back(
              Case{CollType::kAllreduce, algo, n, (ti + oi + n) % 2 == 0, size_t((oi + n) % 2), t, op});
      if (multi) {
        cases.push_back(Case{CollType::kAllreduce, "hier_pipelined", 1031, (ti + oi) % 2 == 1, 1, t, op});
        cases.push_back(
            Case{CollType::kReduceScatter, "hier_pipelined", 7, oi % 2 == 0, size_t(ti % 2), t, op});
      }
      cases.push_back(Case{CollType::kReduce, "binomial", 7, false, 0, t, op, (ti + oi) % p});
      cases.push_back(Case{CollType::kReduce, "symm", 9001, oi % 2 == 0, 1, t, op, (ti + oi + 1) % p});
      cases.push_back(Case{CollType::kReduceScatter, oi % 2 ? "ring" : "pairwise", 7, false, 1, t, op});
      cases.push_back(Case{CollType::kReduceScatter, "symm", 1031, oi % 2 == 1, 0, t, op});
    }
  }
  // Symmetric-memory data movement past the staging size (chunked, unaligned offsets).
  for (const Algorithm& a : algorithms()) {
    if (a.name != "symm" || isReduction(a.coll)) continue;
    for (int inplace = 0; inplace < (hasInPlace(a.coll) ? 2 : 1); ++inplace)
      cases.push_back(Case{a.coll, a.name, 40009, inplace == 1, size_t(1 - inplace), DataType::kUInt8,
                           ReduceOp::kSum, (inplace + 1) % p});
  }
  return cases;
}

// Runs `cases` in nonblocking batches of `batch`; reports failures with the case name.
void runCases(Collectives& coll, Communicator& comm, const std::vector<Case>& cases, size_t batch,
              uint64_t seed) {
  for (size_t i = 0; i < cases.size(); i += batch) {
    std::deque<Instance> inst;
    for (size_t j = i; j < std::min(cases.size(), i + batch); ++j) {
      inst.emplace_back(cases[j], comm, seed + j);
      inst.back().issue(coll);
    }
    for (auto& x : inst) {
      try {
        x.work()->wait();
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        return;
      }
      std::string err = x.verify();
      if (!err.empty()) {
        ADD_FAILURE() << err;
        return;
      }
    }
  }
}

struct Config {
  int ranks;
  int ranks_per_node;  // 0: one node
  const char* chunk;   // CROSSBAR_COLL_CHUNK_SIZE, "" = default
};

void PrintTo(const Config& c, std::ostream* os) {
  *os << c.ranks << " ranks, " << c.ranks_per_node << " per node, chunk '" << c.chunk << "'";
}

class CollMatrix : public ::testing::TestWithParam<Config> {};

TEST_P(CollMatrix, AllAlgorithms) {
  const Config cfg = GetParam();
  RunOptions opts;
  opts.timeout = Millis(600'000);
  opts.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(cfg.ranks_per_node);
  opts.env["CROSSBAR_TIMEOUT"] = "120s";
  if (*cfg.chunk) opts.env["CROSSBAR_COLL_CHUNK_SIZE"] = cfg.chunk;
  // Small symmetric staging (2 x 16 KiB), so the matrix's larger sizes are chunked.
  opts.env["CROSSBAR_COLL_SYMM_BYTES"] = "32K";
  runRanks(
      cfg.ranks,
      [&](RankEnv& env) {
        auto comm = env.communicator();
        Collectives coll(comm);
        auto cases = matrix(comm->size(), comm->numNodes() > 1);
        runCases(coll, *comm, cases, 8, 100);
        // The one large case: 4M floats.
        if (cfg.ranks == 4 && cfg.ranks_per_node == 0)
          runCases(coll, *comm,
                   {Case{CollType::kAllreduce, "ring", size_t{4} << 20, false, 0, DataType::kFloat32}}, 1, 7);
        // Table selection (no forced algorithm), back to back, 48 ops then wait all.
        std::vector<Case> auto_cases;
        for (int i = 0; i < 48; ++i) {
          CollType cs[] = {CollType::kAllreduce, CollType::kAllgather, CollType::kReduceScatter,
                           CollType::kBroadcast, CollType::kAlltoall};
          auto_cases.push_back(Case{cs[i % 5], "", size_t{1} << (i % 17), i % 2 == 0, 0, DataType::kFloat32,
                                    ReduceOp::kSum, i % comm->size()});
        }
        runCases(coll, *comm, auto_cases, 48, 5000);
        comm->destroy();
      },
      opts);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CollMatrix,
                         ::testing::Values(Config{1, 0, ""}, Config{2, 0, ""}, Config{3, 0, "4K"},
                                           Config{4, 0, "16K"}, Config{3, 2, "4K"}, Config{4, 2, "4K"},
                                           Config{8, 0, "8K"}, Config{8, 4, "8K"}),
                         [](const auto& info) {
                           return fmt::format("n{}_rpn{}", info.param.ranks, info.param.ranks_per_node);
                         });

// ---- multi-node (hierarchical, pipelined) ---------------------------------------------

// Every hierarchical algorithm x size (0, 1, odd, prime, many chunks) x in/out of place
// x offset, every type x op of the reducing ones, every root of broadcast.
std::vector<Case> hierMatrix(int p) {
  std::vector<Case> cases;
  const size_t sizes[] = {0, 1, 7, 1031, 9001};
  const DataType mov[] = {DataType::kUInt8, DataType::kInt32, DataType::kFloat16, DataType::kFloat64};
  int k = 0;
  for (CollType coll :
       {CollType::kAllreduce, CollType::kReduceScatter, CollType::kAllgather, CollType::kAlltoall}) {
    for (size_t si = 0; si < std::size(sizes); ++si)
      for (int inplace = 0; inplace < 2; ++inplace, ++k) {
        Case c{coll, "hier_pipelined", sizes[si], inplace == 1, (si + inplace) % 2};
        if (isReduction(coll)) {
          c.type = k % 2 ? DataType::kFloat32 : DataType::kInt64;
          c.op = k % 3 ? ReduceOp::kSum : ReduceOp::kAvg;
        } else {
          c.type = mov[k % std::size(mov)];
        }
        cases.push_back(c);
      }
  }
  for (int root = 0; root < p; ++root)
    for (size_t n : {size_t{1}, size_t{1031}, size_t{9001}})
      cases.push_back(Case{CollType::kBroadcast, "hier_pipelined", n, false, size_t(root % 2),
                           mov[(root + n) % std::size(mov)], ReduceOp::kSum, root});
  for (int ti = 0; ti < kNumDataTypes; ++ti)
    for (int oi = 0; oi < kNumReduceOps; ++oi) {
      auto t = static_cast<DataType>(ti);
      auto op = static_cast<ReduceOp>(oi);
      if (!isSupported(t, op)) continue;
      cases.push_back(Case{CollType::kAllreduce, "hier_pipelined", (ti + oi) % 2 ? size_t{1031} : size_t{7},
                           (ti + oi) % 2 == 0, size_t(oi % 2), t, op});
      cases.push_back(Case{CollType::kReduceScatter, "hier_pipelined",
                           (ti + oi) % 2 ? size_t{7} : size_t{1031}, oi % 2 == 1, size_t(ti % 2), t, op});
    }
  return cases;
}

struct HierConfig {
  int nodes, per_node;
};

void PrintTo(const HierConfig& c, std::ostream* os) {
  *os << c.nodes << " nodes x " << c.per_node << " ranks";
}

class HierMatrix : public ::testing::TestWithParam<HierConfig> {};

TEST_P(HierMatrix, PipelinedAlgorithms) {
  const HierConfig cfg = GetParam();
  RunOptions opts;
  opts.timeout = Millis(600'000);
  opts.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(cfg.per_node);
  opts.env["CROSSBAR_TIMEOUT"] = "120s";
  // Small pipeline chunks and staging: the larger sizes run through many chunks.
  opts.env["CROSSBAR_COLL_HIER_CHUNK"] = "1K";
  opts.env["CROSSBAR_COLL_SYMM_BYTES"] = "32K";
  runRanks(
      cfg.nodes * cfg.per_node,
      [&](RankEnv& env) {
        auto comm = env.communicator();
        ASSERT_EQ(comm->numNodes(), cfg.nodes);
        // The algorithms must apply here (a forced one that does not falls back silently).
        for (CollType c : {CollType::kAllreduce, CollType::kReduceScatter, CollType::kAllgather,
                           CollType::kBroadcast, CollType::kAlltoall}) {
          const Algorithm* a = findAlgorithm(c, "hier_pipelined");
          ASSERT_NE(a, nullptr) << collTypeName(c);
          EXPECT_EQ(a->applies(CollArgs::of(c, nullptr, nullptr, 1, DataType::kFloat32), *comm), "");
        }
        Collectives coll(comm);
        // Back to back: 24 nonblocking operations in flight, then waited for.
        runCases(coll, *comm, hierMatrix(comm->size()), 24, 300);
        // Table selection: allreduce and allgather pick hier_pipelined for large buffers (>= 4 ranks).
        if (comm->size() >= 4) {
          CollArgs big =
              CollArgs::of(CollType::kAllreduce, nullptr, nullptr, size_t{4} << 20, DataType::kFloat32);
          EXPECT_EQ(selectAlgorithm(big, *comm, "", AlgoOverride{}).algorithm->name, "hier_pipelined");
          big.coll = CollType::kAllgather;
          EXPECT_EQ(selectAlgorithm(big, *comm, "", AlgoOverride{}).algorithm->name, "hier_pipelined");
        }
        comm->destroy();
      },
      opts);
}

INSTANTIATE_TEST_SUITE_P(Nodes, HierMatrix,
                         ::testing::Values(HierConfig{2, 2}, HierConfig{2, 3}, HierConfig{3, 2},
                                           HierConfig{4, 2}, HierConfig{4, 1}),
                         [](const auto& info) {
                           return fmt::format("{}x{}", info.param.nodes, info.param.per_node);
                         });

// ---- point to point, groups, errors ---------------------------------------------------

template <class F>
void expectThrows(F&& f, ErrorCode code, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected " << errorCodeName(code) << " mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Collectives, SendRecvAndGroups) {
  runRanks(4, [](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    const int p = comm->size(), r = comm->rank();
    // Blocking-style pairs: even ranks send first.
    std::vector<int32_t> out(1031), in(1031);
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int32_t>(r * 100000 + i);
    int peer = r ^ 1;
    if (r % 2 == 0) {
      coll.send(out.data(), out.size(), DataType::kInt32, peer, 5)->wait();
      coll.recv(in.data(), in.size(), DataType::kInt32, peer, 6)->wait();
    } else {
      coll.recv(in.data(), in.size(), DataType::kInt32, peer, 5)->wait();
      coll.send(out.data(), out.size(), DataType::kInt32, peer, 6)->wait();
    }
    for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(in[i], static_cast<int32_t>(peer * 100000 + i));

    // A group: recv from both neighbours and send to both (would deadlock if run one by
    // one with rendezvous sends), plus an allreduce in the same group.
    std::vector<int32_t> l(65539), rr(65539), mine(65539);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<int32_t>(r * 7 + i);
    int32_t one = 1, sum = 0;
    coll.groupStart();
    auto w1 = coll.recv(l.data(), l.size(), DataType::kInt32, (r + p - 1) % p, 9);
    auto w2 = coll.recv(rr.data(), rr.size(), DataType::kInt32, (r + 1) % p, 10);
    coll.send(mine.data(), mine.size(), DataType::kInt32, (r + 1) % p, 9);
    coll.send(mine.data(), mine.size(), DataType::kInt32, (r + p - 1) % p, 10);
    coll.allreduce(&one, &sum, 1, DataType::kInt32, ReduceOp::kSum);
    auto g = coll.groupEnd();
    EXPECT_EQ(g, w1);
    EXPECT_EQ(g, w2);
    g->wait();
    EXPECT_EQ(sum, p);
    for (size_t i = 0; i < l.size(); ++i) {
      ASSERT_EQ(l[i], static_cast<int32_t>(((r + p - 1) % p) * 7 + i));
      ASSERT_EQ(rr[i], static_cast<int32_t>(((r + 1) % p) * 7 + i));
    }
    // Empty and nested groups.
    coll.groupStart();
    coll.groupStart();
    coll.barrier();
    EXPECT_FALSE(coll.groupEnd() == nullptr);
    coll.groupEnd()->wait();
    coll.groupStart();
    coll.groupEnd()->wait();
    expectThrows([&] { coll.groupEnd(); }, ErrorCode::kInvalidUsage, "without a matching groupStart");
    comm->destroy();
  });
}

// Runs `body` on 2 ranks with the worker's default start poll (500 us) and with a wake
// per issue (CROSSBAR_COLL_START_POLL_US=0).
void runWithEachStartPoll(void (*body)(RankEnv&)) {
  for (const char* poll : {"500", "0"}) {
    RunOptions opts;
    opts.env = {{"CROSSBAR_COLL_START_POLL_US", poll}};
    runRanks(2, body, opts);
  }
}

// A nonblocking call that this rank never waits for still runs (the worker thread starts
// it): after a pause (the worker asleep, woken by the issue), right after other calls (the
// worker looking every CROSSBAR_COLL_START_POLL_US), and polled with test() (which wakes
// the worker), with the default and with a wake per issue (0). Rank 1 waits; rank 0 only
// watches the store or polls test(), so rank 1 finishes only if rank 0's worker ran it.
TEST(Collectives, CallNobodyWaitsForStillRuns) {
  runWithEachStartPoll([](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    const int r = comm->rank();
    // Its own store client: the communicator's may be busy (heap set-up).
    TcpStoreOptions so;
    so.host = "127.0.0.1";
    so.port = static_cast<uint16_t>(std::stoi(env.store_addr.substr(env.store_addr.rfind(':') + 1)));
    TcpStore store(so);
    std::vector<float> in(65536 / sizeof(float), static_cast<float>(r + 1)), out(in.size());
    for (int round = 0; round < 6; ++round) {
      // Rounds 0 and 3: after 100 ms without calls; the others right after a blocking one.
      if (round % 3 == 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      else
        coll.allreduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kSum)->wait();
      std::fill(out.begin(), out.end(), 0.0f);
      auto w = coll.allreduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kSum);
      const std::string done = fmt::format("done/{}", round);
      if (r == 1) {
        w->wait();
        store.set(done, Bytes{1});
      } else if (round % 3 == 2) {
        const Deadline limit = Deadline::after(Millis(20000));
        while (!w->test()) ASSERT_FALSE(limit.expired()) << "round " << round;
      } else {
        store.wait({done}, Deadline::after(Millis(20000)));  // no wait() or test() here
      }
      w->wait();
      for (float v : out) ASSERT_EQ(v, 3.0f);
    }
    comm->destroy();
  });
}

// A small (eager) call whose peer is late is left queued, published, by its issue; a
// rank that then only polls hasFinished() (which never runs a call) still sees it finish:
// the worker finishes it, also when it slept for good (after a pause, or with a wake per
// issue). Found by the soak (tests/hardening/soak.cc): such a call waited for this rank's
// next call, test() or wait(), and a rank polling hasFinished() alone never finished.
TEST(Collectives, EagerCallPolledWithHasFinishedFinishes) {
  runWithEachStartPoll([](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    const int r = comm->rank();
    std::vector<int32_t> in(16, r + 1), out(in.size());
    for (int round = 0; round < 4; ++round) {
      // Even rounds: after 100 ms without calls (the worker asleep for good); odd ones
      // right after a blocking call.
      if (round % 2 == 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      else
        coll.allreduce(in.data(), out.data(), in.size(), DataType::kInt32, ReduceOp::kSum)->wait();
      std::fill(out.begin(), out.end(), 0);
      if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));  // rank 0 publishes alone
      auto w = coll.allreduce(in.data(), out.data(), in.size(), DataType::kInt32, ReduceOp::kSum);
      if (r == 0) {
        const Deadline limit = Deadline::after(Millis(20000));
        while (!w->hasFinished()) {
          ASSERT_FALSE(limit.expired()) << "round " << round << ": the call never finished";
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      }
      w->wait();
      for (int32_t v : out) ASSERT_EQ(v, 3);
    }
    comm->destroy();
  });
}

// state() (for hang reports) names what executes and on which thread, and what waits.
TEST(Collectives, StateNamesExecutingAndQueuedCalls) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    const int r = comm->rank();
    std::vector<float> in(1 << 18, 1.0f), out(in.size());  // 1 MiB: not eager
    auto contains = [](const std::string& s, const char* what) { return s.find(what) != std::string::npos; };
    // A call nobody waits for, its peer late (rank 1 issues once rank 0 looked): the
    // worker executes it.
    if (r == 1) env.store->wait({"looked"}, Deadline::after(Millis(60000)));
    auto w = coll.allreduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kSum);
    if (r == 0) {
      std::string s = coll.state();
      for (const Deadline limit = Deadline::after(Millis(20000));
           !contains(s, "on the worker") && !limit.expired(); s = coll.state())
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_TRUE(contains(s, "rank 0 ")) << s;
      EXPECT_TRUE(contains(s, "1 unfinished; executing allreduce")) << s;
      EXPECT_TRUE(contains(s, "on the worker since")) << s;
      EXPECT_TRUE(contains(s, "worker executing")) << s;
      // A wait that times out says the same.
      expectThrows([&] { w->wait(Deadline::after(Millis(10))); }, ErrorCode::kTimeout,
                   "Queue: rank 0 world: 1 unfinished; executing allreduce");
      env.store->add("looked", 1);
    }
    w->wait();
    EXPECT_TRUE(contains(coll.state(), "0 unfinished; nothing executing; 0 queued")) << coll.state();
    // Deferred start: once the worker sleeps (it was looking for calls until now), a call
    // stays queued until this rank waits for it.
    coll.setDeferredStart(true);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto q = coll.allreduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kSum);
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      const std::string s = coll.state();
      EXPECT_TRUE(contains(s, "nothing executing; 1 queued: allreduce")) << s;
      EXPECT_TRUE(contains(s, "(deferred start)")) << s;
    }
    q->wait();
    for (float v : out) ASSERT_EQ(v, 2.0f);
    comm->destroy();
  });
}

TEST(Collectives, InvalidArguments) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    std::vector<int32_t> a(64), b(64);
    const auto i32 = DataType::kInt32;
    expectThrows([&] { coll.allreduce(nullptr, b.data(), 4, i32, ReduceOp::kSum); },
                 ErrorCode::kInvalidArgument, "send buffer is null");
    expectThrows([&] { coll.allreduce(a.data(), nullptr, 4, i32, ReduceOp::kSum); },
                 ErrorCode::kInvalidArgument, "allreduce");
    expectThrows([&] { coll.allreduce(a.data(), a.data() + 1, 4, i32, ReduceOp::kSum); },
                 ErrorCode::kInvalidArgument, "overlap");
    expectThrows([&] { coll.allreduce(a.data(), b.data(), 4, i32, ReduceOp::kPreMulSum); },
                 ErrorCode::kInvalidArgument, "premulsum");
    expectThrows([&] { coll.broadcast(a.data(), 4, i32, 2); }, ErrorCode::kInvalidArgument, "root 2");
    expectThrows([&] { coll.reduce(a.data(), b.data(), 4, i32, ReduceOp::kSum, -1); },
                 ErrorCode::kInvalidArgument, "root -1");
    expectThrows([&] { coll.allgather(a.data(), a.data() + 1, 4, i32); }, ErrorCode::kInvalidArgument,
                 "overlap");
    expectThrows(
        [&] {
          coll.alltoallv(a.data(), {1}, {0}, b.data(), {1, 1}, {0, 1}, i32);
        },
        ErrorCode::kInvalidArgument, "send_counts has 1 entries");
    int me = comm->rank();
    std::vector<size_t> cnt(2, 2), sd = {0, 2}, overlapping = {0, 1};
    expectThrows([&] { coll.alltoallv(a.data(), cnt, sd, b.data(), cnt, overlapping, i32); },
                 ErrorCode::kInvalidArgument, "overlap");
    std::vector<size_t> bad = cnt;
    bad[me] = 3;
    expectThrows(
        [&] {
          coll.alltoallv(a.data(), bad, {0, 4}, b.data(), cnt, sd, i32);
        },
        ErrorCode::kInvalidArgument, "must match");
    expectThrows([&] { coll.send(a.data(), 4, i32, me, 1); }, ErrorCode::kInvalidArgument, "this rank");
    expectThrows([&] { coll.send(a.data(), 4, i32, 5, 1); }, ErrorCode::kInvalidArgument, "peer 5");
    expectThrows([&] { coll.send(a.data(), 4, i32, 1 - me, kInternalTagBase); }, ErrorCode::kInvalidArgument,
                 "reserved");
    CollOptions o;
    o.algorithm = "nope";
    expectThrows([&] { coll.allreduce(a.data(), b.data(), 4, i32, ReduceOp::kSum, o); },
                 ErrorCode::kInvalidArgument, "not an algorithm of allreduce");
    expectThrows([&] { parseAlgoOverride("allreduce=bruck"); }, ErrorCode::kInvalidArgument, "choices");
    expectThrows([&] { parseAlgoOverride("frobnicate"); }, ErrorCode::kInvalidArgument, "frobnicate");
    expectThrows([&] { parseAlgoOverride("allsum=ring"); }, ErrorCode::kInvalidArgument,
                 "unknown collective");
    AlgoOverride ov = parseAlgoOverride("allreduce=rd, ring");
    EXPECT_EQ(ov.per_coll[static_cast<int>(CollType::kAllreduce)], "ring");  // later entries win
    EXPECT_EQ(ov.per_coll[static_cast<int>(CollType::kAllgather)], "ring");
    EXPECT_EQ(ov.per_coll[static_cast<int>(CollType::kBroadcast)], "");
    // Nothing was issued by the failed calls: the next collective still matches up.
    for (int i = 0; i < 64; ++i) a[i] = i + me;
    // An algorithm that does not apply (hierarchical on one node) falls back.
    o.algorithm = "hierarchical";
    coll.allreduce(a.data(), b.data(), 64, i32, ReduceOp::kSum, o)->wait();
    for (int i = 0; i < 64; ++i) ASSERT_EQ(b[i], 2 * i + 1);
    EXPECT_NE(describeAlgorithmTable().find("allreduce"), std::string::npos);
    comm->destroy();
  });
}

TEST(Collectives, TimeoutsMismatchesAndStickyErrors) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    const int me = comm->rank();
    {
      // A wait with a short deadline times out naming the op; the op still completes.
      Collectives coll(comm);
      if (me == 1) std::this_thread::sleep_for(Millis(300));
      auto w = coll.barrier();
      if (me == 0) {
        expectThrows([&] { w->wait(Deadline::after(Millis(30))); }, ErrorCode::kTimeout, "barrier");
      }
      w->wait();
      EXPECT_TRUE(w->test());
      EXPECT_FALSE(w->error());
    }
    {
      // The operation's own deadline (CollOptions.timeout): rank 1 never sends.
      Collectives coll(comm);
      std::vector<int32_t> buf(4);
      CollOptions o;
      o.timeout = Millis(200);
      if (me == 0) {
        auto w = coll.recv(buf.data(), 4, DataType::kInt32, 1, 77, o);
        expectThrows([&] { w->wait(); }, ErrorCode::kTimeout, "recv 4 x int32 from rank 1 tag 77");
        EXPECT_TRUE(w->error());
        // Sticky: the next operation fails at once naming the first failure.
        auto t0 = Clock::now();
        expectThrows([&] { coll.barrier()->wait(); }, ErrorCode::kTimeout, "earlier operation");
        EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
      }
    }
    comm->barrier();
    {
      // Ranks disagree on a count: the receiver gets InvalidUsage through its Work.
      Collectives coll(comm);
      std::vector<int32_t> buf(20);
      if (me == 0) {
        auto w = coll.recv(buf.data(), 10, DataType::kInt32, 1, 88);
        expectThrows([&] { w->wait(); }, ErrorCode::kInvalidUsage, "rank 1 sent 20 bytes, expected 40");
      } else {
        coll.send(buf.data(), 5, DataType::kInt32, 0, 88)->wait();
      }
    }
    comm->barrier();
    comm->destroy();
  });
}

// A rank of node 1 never joins: the pipelined algorithms (helper thread mid-pipeline on
// node 0, intra-node wait on node 1) end with Timeout at the operation's deadline, and
// the helper thread is joined (no hang, no crash at exit).
TEST(Collectives, HierPipelinedMissingRankTimesOut) {
  RunOptions opts;
  opts.env["CROSSBAR_RANKS_PER_NODE"] = "2";
  opts.env["CROSSBAR_COLL_HIER_CHUNK"] = "1K";
  opts.env["CROSSBAR_CHECK_CALLS"] = "off";  // else the call check is what times out
  runRanks(
      4,
      [](RankEnv& env) {
        auto comm = env.communicator();
        const int me = comm->rank();
        Collectives coll(comm);
        CollOptions o;
        o.algorithm = "hier_pipelined";
        {
          // Together once: creates the sub-communicators and the staging (collective
          // set-up, which waits with the communicator's own, long timeout).
          std::vector<float> in(4096, 1.0f), out(4096);
          coll.allreduce(in.data(), out.data(), 4096, DataType::kFloat32, ReduceOp::kSum, o)->wait();
          ASSERT_EQ(out[4095], 4.0f);
        }
        if (me == 3) {
          std::this_thread::sleep_for(Millis(4000));  // stay alive: the others see a timeout, not a death
          return;
        }
        o.timeout = Millis(500);
        for (CollType c : {CollType::kAllreduce, CollType::kAllgather}) {
          if (me == 2 && c == CollType::kAllgather) break;  // its staging now waits on rank 3's next op
          std::vector<float> in(4096 * 4, 1.0f), out(4096 * 4);
          auto t0 = Clock::now();
          WorkPtr w = c == CollType::kAllreduce
                          ? coll.allreduce(in.data(), out.data(), 4096, DataType::kFloat32, ReduceOp::kSum, o)
                          : coll.allgather(in.data(), out.data(), 4096, DataType::kFloat32, o);
          try {
            w->wait();
            ADD_FAILURE() << collTypeName(c) << " finished without rank 3";
          } catch (const Error& e) {
            // The first op times out; the second fails at once on the sticky error.
            EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
          }
          EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3)) << collTypeName(c);
        }
      },
      opts);
}

// Bus bandwidth (nccl-tests definitions) of the table's choices; not a test, run with
// --gtest_also_run_disabled_tests --gtest_filter='*Busbw*'.
TEST(Collectives, DISABLED_Busbw) {
  for (int n : {2, 4}) {
    runRanks(n, [](RankEnv& env) {
      auto comm = env.communicator();
      Collectives coll(comm);
      const int p = comm->size();
      for (size_t bytes : {size_t{8} << 10, size_t{256} << 10, size_t{4} << 20, size_t{64} << 20}) {
        size_t count = bytes / 4;
        std::vector<float> a(count, 1.0f), b(count);
        std::vector<float> g(count * p);
        auto time = [&](auto&& op) {
          op()->wait();
          comm->barrier();
          int iters = bytes >= (size_t{16} << 20) ? 5 : 20;
          auto t0 = Clock::now();
          for (int i = 0; i < iters; ++i) op()->wait();
          comm->barrier();
          return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
        };
        double ar = time(
            [&] { return coll.allreduce(a.data(), b.data(), count, DataType::kFloat32, ReduceOp::kSum); });
        double ag = time([&] { return coll.allgather(a.data(), g.data(), count / p, DataType::kFloat32); });
        double bc = time([&] { return coll.broadcast(b.data(), count, DataType::kFloat32, 0); });
        // Baseline: one message of `bytes` between ranks 0 and 1 (half a ping-pong).
        comm->barrier();
        double pp = 0;
        if (comm->rank() < 2) {
          auto t0 = Clock::now();
          for (int i = 0; i < 5; ++i) {
            if (comm->rank() == 0) {
              comm->send(a.data(), bytes, 1, 1);
              comm->recv(b.data(), bytes, 1, 2);
            } else {
              comm->recv(b.data(), bytes, 0, 1);
              comm->send(a.data(), bytes, 0, 2);
            }
          }
          pp = std::chrono::duration<double>(Clock::now() - t0).count() / 10;
        }
        comm->barrier();
        if (comm->rank() == 0)
          fmt::print(
              "ranks {} bytes {:>9}: allreduce {:8.1f} us busbw {:6.2f} GB/s | allgather {:8.1f} us busbw "
              "{:6.2f} "
              "GB/s | broadcast {:8.1f} us busbw {:6.2f} GB/s | p2p {:8.1f} us {:6.2f} GB/s\n",
              p, bytes, ar * 1e6, bytes * 2.0 * (p - 1) / p / ar / 1e9, ag * 1e6,
              bytes * double(p - 1) / p / ag / 1e9, bc * 1e6, bytes / bc / 1e9, pp * 1e6, bytes / pp / 1e9);
      }
      comm->destroy();
    });
  }
}

}  // namespace
