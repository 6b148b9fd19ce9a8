// The eager small-message path (collectives/eager.h): every type x op of allreduce and
// reduce_scatter, the data-movement collectives and barrier, sizes 0 / 1 / odd / the
// largest below CROSSBAR_EAGER_BYTES, in place and out of place, 1-8 ranks, many
// back-to-back nonblocking calls (slot reuse, interleaved with checked algorithms),
// selection (threshold, CROSSBAR_ALGO, two virtual nodes) and mismatch reports through
// the eager path, eager against eager and eager against a checked algorithm.
//
// Expected reductions: inputs are small integers (exact in every type for up to 8
// ranks), reduced with reduce.h over every rank's input in rank order, so the result
// must match byte for byte on every rank.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <functional>
#include <thread>

#include "collectives/algorithms.h"
#include "collectives/collectives.h"
#include "collectives/eager.h"
#include "collectives/reduce.h"
#include "collectives/selection.h"
#include "comm/errors.h"
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

// Small integers whose sums / products / min / max are exact in every type for up to
// 8 ranks (premul-sum multiplies by 2).
void fillValues(DataType t, ReduceOp op, void* buf, size_t n, uint64_t seed, int rank) {
  int lo = -2, hi = 2;
  if (op == ReduceOp::kProd) lo = isFloating(t) ? 1 : isSignedInteger(t) ? -1 : 0, hi = 2;
  if (!isFloating(t) && !isSignedInteger(t)) lo = 0;
  if (t == DataType::kFloat8E5M2 && op != ReduceOp::kProd) lo = -1, hi = 1;
  visitDataType(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(buf);
    for (size_t i = 0; i < n; ++i) {
      int v = lo + static_cast<int>(hashOf(seed, rank, i) % static_cast<uint64_t>(hi - lo + 1));
      p[i] = storeAcc<T>(static_cast<AccumT<T>>(v));
    }
  });
}

void fillBytes(void* buf, size_t bytes, uint64_t seed, int rank) {
  auto* p = static_cast<uint8_t*>(buf);
  for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(hashOf(seed, rank, i) >> 17);
}

std::string firstDiff(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return fmt::format("size {} vs {}", got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) return fmt::format("byte {}: {} vs {}", i, got[i], want[i]);
  return "";
}

// One call: issued nonblocking, verified after its wait.
struct Call {
  CollType coll = CollType::kAllreduce;
  DataType type = DataType::kInt32;
  ReduceOp op = ReduceOp::kSum;
  size_t n = 0;  // per-rank count (as the API takes it)
  bool inplace = false;
  int root = 0;
  uint64_t seed = 0;
  std::vector<uint8_t> send, recv, want;
  WorkPtr work;

  std::string name() const {
    return fmt::format("{} n={} {} {} {} root={} seed={}", collTypeName(coll), n, dataTypeName(type),
                       reduceOpName(op), inplace ? "inplace" : "outofplace", root, seed);
  }

  void issue(Collectives& c, const CollOptions& o) {
    const int p = c.comm().size(), r = c.comm().rank();
    const size_t es = elementSize(type), blk = n * es;
    auto input = [&](int rank, std::vector<uint8_t>& out, size_t bytes) {
      out.assign(bytes, 0);
      if (coll == CollType::kAllreduce || coll == CollType::kReduceScatter)
        fillValues(type, op, out.data(), bytes / es, seed, rank);
      else
        fillBytes(out.data(), bytes, seed, rank);
    };
    ReduceParams prm;
    prm.preMulScalar = o.premul_scalar;
    switch (coll) {
      case CollType::kAllreduce: {
        std::vector<std::vector<uint8_t>> all(p);
        std::vector<const void*> srcs(p);
        for (int q = 0; q < p; ++q) input(q, all[q], blk), srcs[q] = all[q].data();
        want.assign(blk, 0);
        if (n) reduce(want.data(), srcs.data(), p, n, type, op, prm);
        send = all[r];
        recv.assign(blk, 0xEE);
        if (inplace) recv = send;
        work = c.allreduce(inplace ? recv.data() : send.data(), recv.data(), n, type, op, o);
        break;
      }
      case CollType::kReduceScatter: {
        std::vector<std::vector<uint8_t>> all(p);
        std::vector<const void*> srcs(p);
        for (int q = 0; q < p; ++q) input(q, all[q], blk * p), srcs[q] = all[q].data() + r * blk;
        want.assign(blk, 0);
        if (n) reduce(want.data(), srcs.data(), p, n, type, op, prm);
        send = all[r];
        if (inplace) {
          work = c.reduceScatter(send.data(), send.data() + r * blk, n, type, op, o);
        } else {
          recv.assign(blk, 0xEE);
          work = c.reduceScatter(send.data(), recv.data(), n, type, op, o);
        }
        break;
      }
      case CollType::kAllgather: {
        want.clear();
        for (int q = 0; q < p; ++q) {
          std::vector<uint8_t> b;
          input(q, b, blk);
          want.insert(want.end(), b.begin(), b.end());
        }
        input(r, send, blk);
        recv.assign(blk * p, 0xEE);
        if (inplace && blk) std::memcpy(recv.data() + r * blk, send.data(), blk);  // size 0: data() may be null
        work = c.allgather(inplace ? recv.data() + r * blk : send.data(), recv.data(), n, type, o);
        break;
      }
      case CollType::kAlltoall: {
        want.assign(blk * p, 0);
        for (int q = 0; q < p; ++q) {
          std::vector<uint8_t> b;
          input(q, b, blk * p);
          if (blk) std::memcpy(want.data() + q * blk, b.data() + r * blk, blk);
        }
        input(r, send, blk * p);
        if (inplace) {
          recv = send;
          work = c.alltoall(recv.data(), recv.data(), n, type, o);
        } else {
          recv.assign(blk * p, 0xEE);
          work = c.alltoall(send.data(), recv.data(), n, type, o);
        }
        break;
      }
      case CollType::kBroadcast:
        input(root, want, blk);
        if (r == root)
          recv = want;
        else
          recv.assign(blk, 0xEE);
        work = c.broadcast(recv.data(), n, type, root, o);
        break;
      case CollType::kBarrier:
        work = c.barrier(o);
        break;
      default:
        FAIL() << "not an eager collective";
    }
  }

  // "" when correct.
  std::string verify(const Collectives& c) const {
    if (coll == CollType::kBarrier) return "";
    const int r = c.comm().rank();
    const size_t blk = n * elementSize(type);
    std::vector<uint8_t> got = recv;
    if (coll == CollType::kReduceScatter && inplace)
      got.assign(send.begin() + r * blk, send.begin() + (r + 1) * blk);
    std::string d = firstDiff(got, want);
    return d.empty() ? "" : name() + ": " + d;
  }
};

// Issues every call nonblocking (in order), then waits for and verifies each.
void runCalls(Collectives& c, std::deque<Call>& calls, const CollOptions& o, const std::string& algo) {
  for (Call& x : calls) x.issue(c, o);
  for (Call& x : calls) {
    try {
      x.work->wait(Deadline::after(Millis(120'000)));
    } catch (const std::exception& e) {
      FAIL() << x.name() << ": " << e.what();
    }
    if (!algo.empty()) {
      EXPECT_NE(x.work->description().find("(" + algo + ")"), std::string::npos)
          << x.work->description() << " (expected algorithm " << algo << ")";
    }
    std::string err = x.verify(c);
    EXPECT_EQ(err, "");
    if (!err.empty()) return;
  }
}

// The matrix on one communicator: every type x op for the reductions, every type's
// size for data movement, sizes 0 / 1 / odd / largest below the threshold.
void eagerMatrix(RankEnv& env) {
  auto comm = env.communicator();
  Collectives coll(comm);
  const int p = comm->size();
  const size_t limit = eagerMaxBytes();
  ASSERT_GT(limit, 0u);
  CollOptions o;
  o.algorithm = "eager";
  o.premul_scalar = 2.0;
  std::deque<Call> calls;
  uint64_t seed = 1;
  auto add = [&](CollType ct, DataType t, ReduceOp op, bool inplace, int root) {
    const size_t es = elementSize(t);
    const size_t per = (ct == CollType::kAllreduce || ct == CollType::kBroadcast) ? 1 : static_cast<size_t>(p);
    const size_t largest = (limit - 1) / (es * per);  // selection size below the threshold
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, largest}) {
      Call x;
      x.coll = ct;
      x.type = t;
      x.op = op;
      x.n = n;
      x.inplace = inplace;
      x.root = root;
      x.seed = seed++;
      calls.push_back(std::move(x));
    }
  };
  for (int ti = 0; ti < kNumDataTypes; ++ti) {
    const auto t = static_cast<DataType>(ti);
    for (int oi = 0; oi < kNumReduceOps; ++oi) {
      const auto op = static_cast<ReduceOp>(oi);
      if (!isSupported(t, op)) continue;
      for (CollType ct : {CollType::kAllreduce, CollType::kReduceScatter}) add(ct, t, op, (ti + oi) % 2 == 0, 0);
    }
    for (CollType ct : {CollType::kAllgather, CollType::kAlltoall, CollType::kBroadcast})
      for (int inplace = 0; inplace < (ct == CollType::kBroadcast ? 1 : 2); ++inplace)
        add(ct, t, ReduceOp::kSum, inplace == 1, ti % p);
  }
  Call b;
  b.coll = CollType::kBarrier;
  calls.push_back(b);
  runCalls(coll, calls, o, "eager");
  comm->destroy();
}

}  // namespace

TEST(Eager, EveryTypeOpAndSize1To8Ranks) {
  for (int n : {1, 2, 3, 4, 8}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    runRanks(n, eagerMatrix);
  }
}

// A smaller threshold (slot capacity) still bounds every call: the largest size below
// it is eager, the threshold itself is not.
TEST(Eager, ThresholdFromEnvironmentAndSelection) {
  RunOptions o;
  o.env["CROSSBAR_EAGER_BYTES"] = "1K";
  runRanks(
      3,
      [](RankEnv& env) {
        auto comm = env.communicator();
        ASSERT_EQ(eagerMaxBytes(), 1024u);
        auto pick = [&](CollType ct, size_t count) {
          CollArgs a = CollArgs::of(ct, nullptr, nullptr, count, DataType::kUInt8);
          return selectAlgorithm(a, *comm, "", AlgoOverride{}).algorithm->name;
        };
        EXPECT_EQ(pick(CollType::kAllreduce, 1023), "eager");
        EXPECT_NE(pick(CollType::kAllreduce, 1024), "eager");
        EXPECT_EQ(pick(CollType::kAllgather, 341), "eager");  // 3 x 341 = 1023 bytes
        EXPECT_NE(pick(CollType::kAllgather, 342), "eager");
        EXPECT_EQ(pick(CollType::kBarrier, 0), "eager");
        EXPECT_NE(pick(CollType::kReduce, 8), "eager");  // no eager reduce
        // CROSSBAR_ALGO naming another algorithm excludes eager for that collective.
        CollArgs a = CollArgs::of(CollType::kAllreduce, nullptr, nullptr, 8, DataType::kUInt8);
        EXPECT_EQ(selectAlgorithm(a, *comm, "", parseAlgoOverride("allreduce=oneshot")).algorithm->name,
                  "oneshot");
        EXPECT_EQ(selectAlgorithm(a, *comm, "", parseAlgoOverride("eager")).algorithm->name, "eager");
        EXPECT_NE(describeAlgorithmTable().find("eager"), std::string::npos);
        // Forced above the threshold: falls back, and the result is still right.
        Collectives coll(comm);
        CollOptions co;
        co.algorithm = "eager";
        std::deque<Call> calls;
        for (size_t n : {size_t{200}, size_t{300}, size_t{1000}}) {
          Call x;
          x.coll = CollType::kAllreduce;
          x.type = DataType::kInt32;
          x.n = n;
          x.seed = n;
          calls.push_back(x);
        }
        runCalls(coll, calls, co, "");
        EXPECT_NE(calls[0].work->description().find("(eager)"), std::string::npos);  // 800 bytes
        EXPECT_EQ(calls[1].work->description().find("(eager)"), std::string::npos);  // 1200 bytes
        comm->destroy();
      },
      o);
}

TEST(Eager, DisabledByZeroThreshold) {
  RunOptions o;
  o.env["CROSSBAR_EAGER_BYTES"] = "0";
  runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        CollArgs a = CollArgs::of(CollType::kAllreduce, nullptr, nullptr, 2, DataType::kFloat32);
        EXPECT_NE(selectAlgorithm(a, *comm, "", AlgoOverride{}).algorithm->name, "eager");
        CollArgs b = CollArgs::of(CollType::kBarrier, nullptr, nullptr, 0, DataType::kUInt8);
        EXPECT_NE(selectAlgorithm(b, *comm, "", AlgoOverride{}).algorithm->name, "eager");
        comm->destroy();
      },
      o);
}

// Two virtual nodes: the eager slots are intra-node, so the table picks other
// algorithms (forcing eager falls back) and the results are right.
TEST(Eager, TwoVirtualNodesFallBack) {
  RunOptions o;
  o.env["CROSSBAR_RANKS_PER_NODE"] = "2";
  runRanks(
      4,
      [](RankEnv& env) {
        auto comm = env.communicator();
        ASSERT_EQ(comm->numNodes(), 2);
        Collectives coll(comm);
        CollOptions co;
        co.algorithm = "eager";
        std::deque<Call> calls;
        for (CollType ct : {CollType::kAllreduce, CollType::kReduceScatter, CollType::kAllgather,
                            CollType::kAlltoall, CollType::kBroadcast, CollType::kBarrier}) {
          Call x;
          x.coll = ct;
          x.type = DataType::kFloat32;
          x.n = 5;
          x.root = 1;
          x.seed = static_cast<uint64_t>(ct) + 1;
          calls.push_back(x);
        }
        runCalls(coll, calls, co, "");
        for (const Call& x : calls)
          EXPECT_EQ(x.work->description().find("(eager)"), std::string::npos) << x.work->description();
        comm->destroy();
      },
      o);
}

// Far more calls than slots (and than the call check's 64 slots), issued back to back
// without waiting, eager and checked algorithms interleaved: slot reuse, flow control
// and the call check's progress across eager calls.
TEST(Eager, ManyBackToBackNonblocking) {
  for (int n : {2, 4}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    runRanks(n, [](RankEnv& env) {
      auto comm = env.communicator();
      Collectives coll(comm);
      const int p = comm->size();
      std::deque<Call> calls;
      const CollType kinds[] = {CollType::kAllreduce, CollType::kAllgather, CollType::kReduceScatter,
                                CollType::kBroadcast, CollType::kAlltoall, CollType::kBarrier};
      for (int i = 0; i < 300; ++i) {
        Call x;
        x.coll = kinds[i % 6];
        x.type = i % 2 ? DataType::kFloat32 : DataType::kInt64;
        x.n = 1 + static_cast<size_t>(i % 13);
        // Every 70th call above the threshold: a checked algorithm between eager ones.
        if (i % 70 == 69) {
          x.coll = CollType::kAllreduce;
          x.n = 20000;
        }
        x.inplace = i % 3 == 0 && x.coll != CollType::kBroadcast;
        x.root = i % p;
        x.seed = 1000 + i;
        calls.push_back(x);
      }
      runCalls(coll, calls, CollOptions{}, "");
      EXPECT_NE(calls[0].work->description().find("(eager)"), std::string::npos);
      EXPECT_EQ(calls[69].work->description().find("(eager)"), std::string::npos);
      // Blocking ones after: each waits right away.
      for (int i = 0; i < 100; ++i) {
        std::vector<float> v(3, static_cast<float>(comm->rank() + i)), out(3);
        coll.allreduce(v.data(), out.data(), 3, DataType::kFloat32, ReduceOp::kSum)->wait();
        for (float f : out) ASSERT_EQ(f, static_cast<float>(p * (p - 1) / 2 + p * i));
      }
      comm->destroy();
    });
  }
}

// A lone rank's eager call finishes inside the call that issues it (the issuing thread
// runs it when nothing is queued: no hand-off to the worker thread).
TEST(Eager, OneRankFinishesInsideTheCall) {
  runRanks(1, [](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    std::vector<float> in(5), out(5);
    for (int i = 0; i < 200; ++i) {
      for (int k = 0; k < 5; ++k) in[k] = static_cast<float>(i + k);
      WorkPtr w = coll.allreduce(in.data(), out.data(), 5, DataType::kFloat32, ReduceOp::kSum);
      ASSERT_TRUE(w->test()) << "call " << i << " was left to the worker";
      ASSERT_EQ(out, in);
      w = coll.barrier();
      ASSERT_TRUE(w->test());
    }
    comm->destroy();
  });
}

// Issuing an eager call never waits for the peers: rank 0 issues several (the first
// one published, the rest queued behind it) and only then lets rank 1 call them, by a
// message outside the Collectives queue. An issue that waited for the peer would
// deadlock here until the timeout.
TEST(Eager, IssueDoesNotWaitForLatePeers) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    const int me = comm->rank();
    CollOptions o;
    o.timeout = Millis(20'000);
    std::vector<int32_t> warm(1, 1), warm_out(1);
    coll.allreduce(warm.data(), warm_out.data(), 1, DataType::kInt32, ReduceOp::kSum, o)->wait();
    constexpr uint32_t kGoTag = 11;
    uint8_t go = 1;
    if (me == 1)
      comm->waitAll({comm->irecv(&go, 1, 0, kGoTag)}, Deadline::after(Millis(20'000)));
    std::vector<std::vector<int32_t>> in(6, std::vector<int32_t>(7)), out(6, std::vector<int32_t>(14));
    std::vector<WorkPtr> works;
    for (int i = 0; i < 6; ++i) {
      for (int k = 0; k < 7; ++k) in[i][k] = me * 100 + i * 10 + k;
      if (i % 2 == 0)
        works.push_back(coll.allreduce(in[i].data(), out[i].data(), 7, DataType::kInt32, ReduceOp::kSum, o));
      else
        works.push_back(coll.allgather(in[i].data(), out[i].data(), 7, DataType::kInt32, o));
    }
    EXPECT_NE(works[0]->description().find("(eager)"), std::string::npos);
    if (me == 0) {
      for (const WorkPtr& w : works) EXPECT_FALSE(w->test()) << "finished before the peer called it";
      comm->waitAll({comm->isend(&go, 1, 1, kGoTag)}, Deadline::after(Millis(20'000)));
    }
    for (const WorkPtr& w : works) w->wait();
    for (int i = 0; i < 6; ++i)
      for (int k = 0; k < 7; ++k) {
        if (i % 2 == 0) {
          ASSERT_EQ(out[i][k], 100 + 2 * (i * 10 + k)) << i << "," << k;
        } else {
          ASSERT_EQ(out[i][k], i * 10 + k);
          ASSERT_EQ(out[i][7 + k], 100 + i * 10 + k);
        }
      }
    comm->destroy();
  });
}

// Two Collectives (two communicators) called in opposite orders on the two ranks: each
// queue makes progress on its own, so neither rank's first call may wait for its peer.
TEST(Eager, TwoCommunicatorsInOppositeOrders) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    auto other = comm->split(0, comm->rank());
    const int me = comm->rank();
    {
      Collectives a(comm), b(other);
      CollOptions o;
      o.timeout = Millis(20'000);
      for (int round = 0; round < 20; ++round) {
        int32_t x = me + round, y = 10 * me + round, rx = 0, ry = 0;
        WorkPtr wx, wy;
        if (me == 0) {
          wx = a.allreduce(&x, &rx, 1, DataType::kInt32, ReduceOp::kSum, o);
          wy = b.allreduce(&y, &ry, 1, DataType::kInt32, ReduceOp::kSum, o);
        } else {
          wy = b.allreduce(&y, &ry, 1, DataType::kInt32, ReduceOp::kSum, o);
          wx = a.allreduce(&x, &rx, 1, DataType::kInt32, ReduceOp::kSum, o);
        }
        wx->wait();
        wy->wait();
        ASSERT_EQ(rx, 1 + 2 * round);
        ASSERT_EQ(ry, 10 + 2 * round);
      }
    }
    other->destroy();
    comm->destroy();
  });
}

namespace {

// Every rank must get InvalidUsage with `needle` (not a timeout) within `within`, and
// the same report text as rank 0 after "call check: ". Each rank keeps its Collectives
// until every rank has its answer: a rank that has left (its slots released, its sockets
// closed) is reported to a slower rank as having exited, which is right then but not
// what this test is about (seen under TSan: ranks 0-1 on the eager path left before
// rank 2's check looked at their slots).
void expectMismatch(RankEnv& env, const std::string& name, const std::function<WorkPtr(Collectives&)>& issue,
                    const std::string& needle, bool same_text = true) {
  auto comm = env.communicator();
  std::string text;
  {
    Collectives coll(comm);
    try {
      issue(coll)->wait(Deadline::after(Millis(60'000)));
      ADD_FAILURE() << name << ": no error on rank " << comm->rank();
    } catch (const InvalidUsage& e) {
      text = e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << ": wrong error on rank " << comm->rank() << ": " << e.what();
    }
    env.store->set(fmt::format("{}/answered/{}", name, comm->rank()), std::string("1"));
    for (int q = 0; q < comm->size(); ++q)
      env.store->get(fmt::format("{}/answered/{}", name, q), Deadline::after(Millis(120'000)));
  }
  EXPECT_NE(text.find(needle), std::string::npos) << name << ": " << text;
  if (same_text) {
    const size_t at = text.find("ranks called");
    const std::string report = at == std::string::npos ? text : text.substr(at);
    env.store->set(fmt::format("{}/{}", name, comm->rank()), report);
    Bytes b = env.store->get(fmt::format("{}/0", name), Deadline::after(Millis(60'000)));
    EXPECT_EQ(std::string(b.begin(), b.end()), report) << name;
  }
  comm->barrier();
}

void eagerMismatches(RankEnv& env) {
  auto comm = env.communicator();
  const int me = comm->rank(), p = comm->size(), odd = p - 1;
  std::vector<int32_t> a(20000, 1), b(20000 * 8);
  const auto i32 = DataType::kInt32;
  // Eager on every rank, the first collective of the communicator.
  expectMismatch(
      env, "count",
      [&](Collectives& c) { return c.allreduce(a.data(), b.data(), me == odd ? 5 : 4, i32, ReduceOp::kSum); },
      fmt::format("rank {} called allreduce of 5 x int32 sum (collective #0) (count 5 vs 4)", odd));
  expectMismatch(env, "coll",
                 [&](Collectives& c) {
                   return me == odd ? c.broadcast(a.data(), 4, i32, 0) : c.alltoall(a.data(), b.data(), 4, i32);
                 },
                 "collective broadcast vs alltoall");
  expectMismatch(env, "barrier",
                 [&](Collectives& c) { return me == odd ? c.barrier() : c.allgather(a.data(), b.data(), 1, i32); },
                 "collective barrier vs allgather");
  // Eager against a checked algorithm (the odd rank's count is past the threshold),
  // as the first collective, and after matching ones.
  expectMismatch(
      env, "paths",
      [&](Collectives& c) { return c.allreduce(a.data(), b.data(), me == odd ? 20000 : 4, i32, ReduceOp::kSum); },
      "count 20000 vs 4");
  expectMismatch(env, "paths_later",
                 [&](Collectives& c) {
                   for (int i = 0; i < 3; ++i) c.allreduce(a.data(), b.data(), 4, i32, ReduceOp::kSum);
                   return c.allgather(a.data(), b.data(), me == odd ? 5000 : 3, i32);
                 },
                 "count 5000 vs 3");
  // Same call, different algorithms on different ranks: reported, not waited out.
  expectMismatch(
      env, "algorithms",
      [&](Collectives& c) {
        CollOptions o;
        if (me == odd) o.algorithm = "oneshot";
        return c.allreduce(a.data(), b.data(), 4, i32, ReduceOp::kSum, o);
      },
      "ranks chose different algorithms", false);
  // Still works afterwards.
  Collectives coll(comm);
  for (int i = 0; i < 4; ++i) a[i] = me + i;
  coll.allreduce(a.data(), b.data(), 4, i32, ReduceOp::kSum)->wait();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(b[i], p * (p - 1) / 2 + p * i);
  comm->destroy();
}

}  // namespace

TEST(Eager, MismatchesReportedThroughEagerPath) {
  for (int n : {2, 3}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    runRanks(n, eagerMismatches);
  }
}

TEST(Eager, MismatchesReportedWithoutCallCheck) {
  // CROSSBAR_CHECK_CALLS=off: the eager headers still carry the signature, so eager
  // against eager is still reported (the checked path then has no check at all).
  RunOptions o;
  o.env["CROSSBAR_CHECK_CALLS"] = "off";
  runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        const int me = comm->rank();
        std::vector<int32_t> a(16, 1), b(16 * 4);
        expectMismatch(
            env, "off",
            [&](Collectives& c) {
              return c.allreduce(a.data(), b.data(), me == 1 ? 3 : 2, DataType::kInt32, ReduceOp::kSum);
            },
            "count 3 vs 2");
        comm->destroy();
      },
      o);
}

// A peer that dies, or an abort, ends an eager wait with that error (not a wait until
// the operation's deadline): the sleep slices reach the symmetric buffer's checks.
TEST(Eager, PeerDeathAndAbortEndTheWait) {
  RunOptions o;
  o.allow_rank_death = true;
  auto results = runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        Collectives coll(comm);
        int32_t v = 1, out = 0;
        coll.allreduce(&v, &out, 1, DataType::kInt32, ReduceOp::kSum)->wait();  // slots exist
        ASSERT_EQ(out, 2);
        if (comm->rank() == 1) {
          std::this_thread::sleep_for(Millis(50));
          ::_exit(3);
        }
        CollOptions co;
        co.timeout = Millis(60'000);
        const auto t0 = Clock::now();
        try {
          coll.allreduce(&v, &out, 1, DataType::kInt32, ReduceOp::kSum, co)->wait();
          ADD_FAILURE() << "no error with the peer gone";
        } catch (const Error& e) {
          EXPECT_TRUE(e.code() == ErrorCode::kPeerFailure || e.code() == ErrorCode::kAborted) << e.what();
        }
        EXPECT_LT(Clock::now() - t0, Millis(30'000));
      },
      o, /*expect_ok=*/false);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].ok) << results[0].failure;
  EXPECT_EQ(results[1].exit_code, 3);

  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    int32_t v = 1, out = 0;
    coll.allreduce(&v, &out, 1, DataType::kInt32, ReduceOp::kSum)->wait();
    if (comm->rank() == 1) {
      // Rank 0 waits in its eager allreduce until rank 1 aborts the communicator
      // (abort is per process: rank 0 aborts its own after a while, as a watchdog would).
      env.store->get("test/aborted", Deadline::after(Millis(60'000)));
      return;
    }
    std::thread watchdog([&] {
      std::this_thread::sleep_for(Millis(300));
      comm->abort("test watchdog");
    });
    CollOptions co;
    co.timeout = Millis(60'000);
    const auto t0 = Clock::now();
    try {
      coll.allreduce(&v, &out, 1, DataType::kInt32, ReduceOp::kSum, co)->wait();
      ADD_FAILURE() << "no error after the abort";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    }
    EXPECT_LT(Clock::now() - t0, Millis(30'000));
    watchdog.join();
    env.store->set("test/aborted", "1");
  });
}

// Calls queued behind a late one are published ahead of it (their inputs are final at
// issue), except a call that reads what a call ahead of it writes: stream order. Rank
// 0 issues chains of dependent calls while rank 1 is late, so rank 0's calls queue up
// behind an unfinished head; a call published too early would read the stale input.
TEST(Eager, PublishAheadKeepsStreamOrder) {
  for (int n : {2, 4}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    runRanks(n, [](RankEnv& env) {
      auto comm = env.communicator();
      Collectives coll(comm);
      const int p = comm->size();
      constexpr int kChain = 20;
      for (int round = 0; round < 3; ++round) {
        if (comm->rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
        // In place: x = sum(x) kChain times -> p^kChain.
        std::vector<int64_t> x(3, 1);
        // Out of place, alternating: a -> b -> a ...; plus independent calls between.
        std::vector<int64_t> a(2, comm->rank() + 1), b(2, 0), c(4, 0), other(5, 0);
        std::vector<WorkPtr> works;
        for (int i = 0; i < kChain; ++i) {
          works.push_back(coll.allreduce(x.data(), x.data(), 3, DataType::kInt64, ReduceOp::kSum));
          works.push_back(i % 2 ? coll.allreduce(b.data(), a.data(), 2, DataType::kInt64, ReduceOp::kSum)
                                : coll.allreduce(a.data(), b.data(), 2, DataType::kInt64, ReduceOp::kSum));
          works.push_back(coll.allreduce(c.data(), other.data(), 4, DataType::kInt64, ReduceOp::kMax));
        }
        // An allgather reading the in-place result.
        std::vector<int64_t> gathered(3 * p, 0);
        works.push_back(coll.allgather(x.data(), gathered.data(), 3, DataType::kInt64));
        for (auto& w : works) w->wait();
        int64_t expect_x = 1, expect_ab = 0;
        for (int i = 0; i < kChain; ++i) expect_x *= p;
        for (int r = 0; r < p; ++r) expect_ab += r + 1;  // first sum, then times p per step
        for (int i = 1; i < kChain; ++i) expect_ab *= p;
        for (int64_t v : x) ASSERT_EQ(v, expect_x) << "round " << round;
        for (int64_t v : gathered) ASSERT_EQ(v, expect_x) << "round " << round;
        const std::vector<int64_t>& last = (kChain - 1) % 2 ? a : b;
        for (int64_t v : last) ASSERT_EQ(v, expect_ab) << "round " << round;
        EXPECT_NE(works[0]->description().find("(eager)"), std::string::npos);
      }
      comm->destroy();
    });
  }
}
