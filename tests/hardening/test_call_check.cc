// Mismatched-call detection (collectives/signature.h): every kind of mismatch (count,
// type, op, root, collective order, alltoallv pair counts) raises InvalidUsage on every
// rank, with the same text everywhere, naming the ranks that differ and what differs;
// with 2, 3 (dissemination over a non-power of two) and 4 ranks, cheap and full modes.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

#include "collectives/collectives.h"
#include "collectives/signature.h"
#include "comm/errors.h"
#include "comm/store.h"
#include "harness/multiprocess.h"

using namespace crossbar;
using crossbar::testing::RankEnv;
using crossbar::testing::RunOptions;
using crossbar::testing::runRanks;

namespace {

const auto i32 = DataType::kInt32;
const auto f32 = DataType::kFloat32;

CallSignature sig(CollType c, size_t count, DataType t, ReduceOp op, int root, uint64_t seq) {
  CollArgs a;
  a.coll = c;
  a.count = count;
  a.type = t;
  a.op = op;
  a.root = root;
  return CallSignature::of(a, seq, false);
}

// ---- the report (pure) -----------------------------------------------------------------

TEST(CallCheck, ReportNamesMinorityRanksAndFields) {
  std::vector<CallSignature> calls(4, sig(CollType::kAllreduce, 64, f32, ReduceOp::kSum, 0, 7));
  EXPECT_TRUE(findMismatch(calls).message.empty());
  calls[2] = sig(CollType::kAllreduce, 100, i32, ReduceOp::kMax, 0, 7);
  Mismatch m = findMismatch(calls);
  EXPECT_EQ(m.ranks, std::vector<int>{2});
  EXPECT_NE(m.message.find("ranks 0-1,3 called allreduce of 64 x float sum (collective #7)"),
            std::string::npos)
      << m.message;
  EXPECT_NE(m.message.find("rank 2 called allreduce of 100 x int32 max"), std::string::npos) << m.message;
  EXPECT_NE(m.message.find("count 100 vs 64, type int32 vs float, op max vs sum"), std::string::npos)
      << m.message;
  // Ignored fields compare equal: op of a broadcast, root of an allreduce.
  EXPECT_TRUE(findMismatch({sig(CollType::kBroadcast, 8, f32, ReduceOp::kSum, 1, 0),
                            sig(CollType::kBroadcast, 8, f32, ReduceOp::kMax, 1, 0)})
                  .message.empty());
  EXPECT_TRUE(findMismatch({sig(CollType::kAllreduce, 8, f32, ReduceOp::kSum, 0, 0),
                            sig(CollType::kAllreduce, 8, f32, ReduceOp::kSum, 3, 0)})
                  .message.empty());
  // A tie: the group holding the lowest rank is the reference.
  m = findMismatch({sig(CollType::kBroadcast, 8, f32, ReduceOp::kSum, 0, 0),
                    sig(CollType::kBroadcast, 8, f32, ReduceOp::kSum, 1, 0)});
  EXPECT_EQ(m.ranks, std::vector<int>{1});
  EXPECT_NE(m.message.find("root 1 vs 0"), std::string::npos) << m.message;
  m = findMismatch({sig(CollType::kBarrier, 0, f32, ReduceOp::kSum, 0, 3),
                    sig(CollType::kAllgather, 8, f32, ReduceOp::kSum, 0, 3),
                    sig(CollType::kBarrier, 0, i32, ReduceOp::kSum, 0, 3)});
  EXPECT_EQ(m.ranks, std::vector<int>{1});
  EXPECT_NE(m.message.find("collective allgather vs barrier (called in a different order"), std::string::npos)
      << m.message;
}

TEST(CallCheck, AlltoallvPairCounts) {
  CollArgs a;
  a.coll = CollType::kAlltoallv;
  a.type = f32;
  std::vector<CallSignature> calls;
  // Rank r sends r + j + 1 elements to j; rank 1 expects one element too few from rank 2.
  for (int r = 0; r < 3; ++r) {
    a.send_counts = {size_t(r + 1), size_t(r + 2), size_t(r + 3)};
    a.recv_counts = {size_t(r + 1), size_t(r + 2), size_t(r + 3)};
    calls.push_back(CallSignature::of(a, 5, true));
  }
  EXPECT_TRUE(findMismatch(calls).message.empty());
  calls[1].recv_counts[2] = 3;
  Mismatch m = findMismatch(calls);
  EXPECT_EQ(m.ranks, (std::vector<int>{1, 2}));
  EXPECT_NE(m.message.find("rank 2 sends 4 elements to rank 1, which expects 3"), std::string::npos)
      << m.message;
  // The cheap mode's signature has no per-peer counts: nothing to compare.
  EXPECT_TRUE(CallSignature::of(a, 5, false).send_counts.empty());
}

TEST(CallCheck, SignatureWireFormat) {
  CollArgs a;
  a.coll = CollType::kAlltoallv;
  a.type = DataType::kBFloat16;
  a.send_counts = {1, 2, 3};
  a.recv_counts = {4, 5, 6};
  CallSignature s = CallSignature::of(a, 1234567, true);
  std::vector<uint8_t> b = s.serialize();
  CallSignature t = CallSignature::parse(b.data(), b.size(), 3);
  EXPECT_EQ(t.hash(), s.hash());
  EXPECT_EQ(t.send_counts, s.send_counts);
  EXPECT_EQ(t.recv_counts, s.recv_counts);
  EXPECT_EQ(t.describe(), "alltoallv of bfloat16 (collective #1234567)");
  // Truncated, wrong rank count, bad magic, trailing bytes: InvalidUsage, never a crash.
  for (size_t n = 0; n < b.size(); ++n) EXPECT_THROW(CallSignature::parse(b.data(), n, 3), InvalidUsage);
  EXPECT_THROW(CallSignature::parse(b.data(), b.size(), 4), InvalidUsage);
  b.push_back(0);
  EXPECT_THROW(CallSignature::parse(b.data(), b.size(), 3), InvalidUsage);
  b.pop_back();
  b[0] ^= 1;
  EXPECT_THROW(CallSignature::parse(b.data(), b.size(), 3), InvalidUsage);
  // Every field changes the hash.
  const uint64_t h = sig(CollType::kReduce, 8, f32, ReduceOp::kSum, 1, 9).hash();
  EXPECT_NE(h, sig(CollType::kAllreduce, 8, f32, ReduceOp::kSum, 1, 9).hash());
  EXPECT_NE(h, sig(CollType::kReduce, 9, f32, ReduceOp::kSum, 1, 9).hash());
  EXPECT_NE(h, sig(CollType::kReduce, 8, i32, ReduceOp::kSum, 1, 9).hash());
  EXPECT_NE(h, sig(CollType::kReduce, 8, f32, ReduceOp::kMin, 1, 9).hash());
  EXPECT_NE(h, sig(CollType::kReduce, 8, f32, ReduceOp::kSum, 0, 9).hash());
  EXPECT_NE(h, sig(CollType::kReduce, 8, f32, ReduceOp::kSum, 1, 10).hash());
}

TEST(CallCheck, ModeFromEnvironment) {
  const char* old = std::getenv("CROSSBAR_CHECK_CALLS");
  std::string saved = old ? old : "";
  unsetenv("CROSSBAR_CHECK_CALLS");
  EXPECT_EQ(callCheckModeFromEnv(), CallCheckMode::kCheap);  // on by default
  setenv("CROSSBAR_CHECK_CALLS", "FULL", 1);
  EXPECT_EQ(callCheckModeFromEnv(), CallCheckMode::kFull);
  setenv("CROSSBAR_CHECK_CALLS", "off", 1);
  EXPECT_EQ(callCheckModeFromEnv(), CallCheckMode::kOff);
  setenv("CROSSBAR_CHECK_CALLS", "sometimes", 1);
  try {
    callCheckModeFromEnv();
    ADD_FAILURE() << "a bad value was accepted";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    for (const char* want : {"CROSSBAR_CHECK_CALLS", "sometimes", "off", "cheap", "full"})
      EXPECT_NE(msg.find(want), std::string::npos) << msg;
  }
  if (old)
    setenv("CROSSBAR_CHECK_CALLS", saved.c_str(), 1);
  else
    unsetenv("CROSSBAR_CHECK_CALLS");
}

// ---- over real ranks -------------------------------------------------------------------

// Runs `issue` on a fresh Collectives, expects InvalidUsage containing every `needle`
// on this rank and checks that every rank got the same text (through the store).
void expectMismatch(RankEnv& env, const std::string& name, const std::function<WorkPtr(Collectives&)>& issue,
                    std::vector<std::string> needles, std::vector<int> peers) {
  auto comm = env.communicator();
  std::string text;
  {
    Collectives coll(comm);
    try {
      issue(coll)->wait(Deadline::after(Millis(60'000)));
      ADD_FAILURE() << name << ": no error on rank " << comm->rank();
    } catch (const InvalidUsage& e) {
      text = e.what();
      EXPECT_EQ(e.peers(), peers) << name << ": " << text;
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << ": wrong error on rank " << comm->rank() << ": " << e.what();
    }
  }
  for (const auto& n : needles) EXPECT_NE(text.find(n), std::string::npos) << name << ": " << text;
  // The report after "call check: " is the same on every rank.
  const size_t at = std::min(text.find("ranks called"), text.find("alltoallv counts"));
  const std::string report = at == std::string::npos ? text : text.substr(at);
  env.store->set(fmt::format("{}/{}", name, comm->rank()), report);
  for (int r = 0; r < comm->size(); ++r) {
    Bytes b = env.store->get(fmt::format("{}/{}", name, r), Deadline::after(Millis(60'000)));
    EXPECT_EQ(std::string(b.begin(), b.end()), report) << name << ": rank " << r << " reported otherwise";
  }
  comm->barrier();
}

void mismatchMatrix(RankEnv& env, bool full) {
  auto comm = env.communicator();
  const int me = comm->rank(), p = comm->size(), odd = p - 1;  // the rank that differs
  std::vector<int32_t> a(256, 1), b(256 * 8);
  expectMismatch(
      env, "count",
      [&](Collectives& c) {
        return c.allreduce(a.data(), b.data(), me == odd ? 100 : 64, i32, ReduceOp::kSum);
      },
      {fmt::format("rank {} called allreduce of 100 x int32 sum (collective #0) (count 100 vs 64)", odd),
       "call check"},
      {odd});
  expectMismatch(env, "type",
                 [&](Collectives& c) { return c.broadcast(a.data(), 16, me == odd ? f32 : i32, 0); },
                 {"type float vs int32"}, {odd});
  expectMismatch(env, "op",
                 [&](Collectives& c) {
                   return c.reduceScatter(a.data(), b.data(), 8, i32,
                                          me == odd ? ReduceOp::kMax : ReduceOp::kSum);
                 },
                 {"op max vs sum"}, {odd});
  expectMismatch(
      env, "root",
      [&](Collectives& c) { return c.reduce(a.data(), b.data(), 8, i32, ReduceOp::kSum, me == odd); },
      {"root 1 vs 0"}, {odd});
  // Order: the upper half calls broadcast first, the lower half allreduce; the second
  // call fails too (sticky), never runs against the wrong peer call.
  std::vector<int> upper;
  for (int r = (p + 1) / 2; r < p; ++r) upper.push_back(r);
  expectMismatch(
      env, "order",
      [&](Collectives& c) {
        const bool up = me >= (p + 1) / 2;
        WorkPtr w1 =
            up ? c.broadcast(a.data(), 4, i32, 0) : c.allreduce(a.data(), b.data(), 4, i32, ReduceOp::kSum);
        WorkPtr w2 =
            up ? c.allreduce(a.data(), b.data(), 4, i32, ReduceOp::kSum) : c.broadcast(a.data(), 4, i32, 0);
        try {
          w1->wait(Deadline::after(Millis(60'000)));
        } catch (const InvalidUsage&) {
          EXPECT_THROW(w2->wait(Deadline::after(Millis(60'000))), InvalidUsage);
          throw;
        }
        return w2;
      },
      {"collective broadcast vs allreduce (called in a different order"}, upper);
  // Inside a group, after a matching collective.
  expectMismatch(env, "group",
                 [&](Collectives& c) {
                   c.allreduce(a.data(), b.data(), 4, i32, ReduceOp::kSum)->wait();
                   c.groupStart();
                   c.allgather(a.data(), b.data(), me == odd ? 3 : 4, i32);
                   return c.groupEnd();
                 },
                 {"allgather of 3 x int32 (collective #1) (count 3 vs 4)"}, {odd});
  // Zero-count calls move nothing but still agree (or not): one rank's empty call must
  // not let the others hang.
  expectMismatch(env, "empty",
                 [&](Collectives& c) { return c.allgather(a.data(), b.data(), me == odd ? 0 : 2, i32); },
                 {"count 0 vs 2"}, {odd});
  if (full) {
    // Rank 0 sends one element more to the last rank than that rank expects.
    std::vector<size_t> cnt(p, 2), displ(p);
    for (int r = 0; r < p; ++r) displ[r] = 4 * r;
    std::vector<size_t> sc = cnt, rc = cnt;
    if (me == 0) sc[odd] = 3;
    expectMismatch(env, "alltoallv",
                   [&](Collectives& c) { return c.alltoallv(a.data(), sc, displ, b.data(), rc, displ, i32); },
                   {fmt::format("rank 0 sends 3 elements to rank {}, which expects 2", odd)}, {0, odd});
  }
  // After all that (every check completed its exchange), the communicator still works.
  Collectives coll(comm);
  for (int i = 0; i < 8; ++i) a[i] = me + i;
  coll.allreduce(a.data(), b.data(), 8, i32, ReduceOp::kSum)->wait();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(b[i], p * (p - 1) / 2 + p * i);
  comm->destroy();
}

TEST(CallCheck, MismatchesRaiseOnEveryRankCheap) {
  for (int n : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    runRanks(n, [](RankEnv& env) { mismatchMatrix(env, false); });
  }
}

// Without the eager path every call takes a staged symmetric algorithm, whose check
// is split: posted up front, verified before the first read of peer data (or before
// the staging is created), so the wait overlaps the rank's own copy-in. The verdict and
// the report must be the same as the up-front check's.
TEST(CallCheck, MismatchesRaiseOnEveryRankStaged) {
  RunOptions o;
  o.env["CROSSBAR_EAGER_BYTES"] = "0";
  o.env["CROSSBAR_COLL_SYMM_CHUNK"] = "64K";
  for (int n : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    runRanks(
        n,
        [](RankEnv& env) {
          // A broadcast of many chunks: the root reuses its staging halves and waits
          // for the readers' releases before it ever waits for peer data; a reader that
          // called something else never releases, so the root must get the verdict
          // first, not wait for the release until the deadline. (After a matching call:
          // the first staged call of a Collectives gets the verdict before it creates
          // the staging.)
          auto comm = env.communicator();
          const int me = comm->rank(), odd = comm->size() - 1;
          std::vector<int32_t> big(1 << 18, 7);
          expectMismatch(
              env, "chunks",
              [&](Collectives& c) {
                c.broadcast(big.data(), 1 << 14, i32, 0)->wait();
                return c.broadcast(big.data(), me == odd ? (1 << 17) : (1 << 18), i32, 0);
              },
              {"count 131072 vs 262144"}, {odd});
          mismatchMatrix(env, false);
        },
        o);
  }
}

TEST(CallCheck, MismatchesRaiseOnEveryRankFull) {
  RunOptions o;
  o.env["CROSSBAR_CHECK_CALLS"] = "full";
  runRanks(
      4, [](RankEnv& env) { mismatchMatrix(env, true); }, o);
}

// Across nodes (virtual: one rank per node) the cheap mode exchanges call hashes over
// the transports in log2(ranks) rounds; 3 ranks is not a power of two.
TEST(CallCheck, MismatchesRaiseOnEveryRankAcrossNodes) {
  RunOptions o;
  o.env["CROSSBAR_RANKS_PER_NODE"] = "1";
  runRanks(
      3,
      [](RankEnv& env) {
        ASSERT_EQ(env.communicator()->numNodes(), 3);
        mismatchMatrix(env, false);
      },
      o);
}

// Point-to-point calls do not advance the collectives' sequence: ranks that sent or
// received different numbers of messages still agree on the next collective.
TEST(CallCheck, UnbalancedPointToPointKeepsCollectivesInStep) {
  runRanks(3, [](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    const int me = comm->rank();
    std::vector<int32_t> v(4, me), out(4);
    CollOptions o;
    o.timeout = Millis(30'000);
    if (me == 0) coll.send(v.data(), 4, i32, 1, 5, o)->wait();
    if (me == 1) coll.recv(out.data(), 4, i32, 0, 5, o)->wait();
    coll.allreduce(v.data(), out.data(), 4, i32, ReduceOp::kSum, o)->wait();
    for (int x : out) EXPECT_EQ(x, 3);
    comm->destroy();
  });
}

// Cost of the check: a tiny allreduce loop per mode, modes interleaved over several
// rounds, best round reported (a loaded machine only ever adds time). Not a test
// (timing); run on a quiet machine with
//   build/bin/test_call_check --gtest_also_run_disabled_tests --gtest_filter='*CheckCost*'
// (CROSSBAR_RANKS_PER_NODE=1 measures the across-nodes path.)
TEST(CallCheck, DISABLED_CheckCost) {
  for (int n : {2, 4}) {
    runRanks(n, [](RankEnv& env) {
      auto comm = env.communicator();
      int32_t x = 1, y = 0;
      const char* modes[] = {"off", "cheap", "full"};
      double best[3] = {1e9, 1e9, 1e9};
      for (int round = 0; round < 5; ++round) {
        for (int m = 0; m < 3; ++m) {
          setenv("CROSSBAR_CHECK_CALLS", modes[m], 1);
          Collectives coll(comm);
          for (int i = 0; i < 100; ++i) coll.allreduce(&x, &y, 1, i32, ReduceOp::kSum)->wait();
          comm->barrier();
          const int iters = 2000;
          auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < iters; ++i) coll.allreduce(&x, &y, 1, i32, ReduceOp::kSum)->wait();
          const double us =
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
              iters;
          best[m] = std::min(best[m], us);
          comm->barrier();
        }
      }
      if (comm->rank() == 0)
        for (int m = 0; m < 3; ++m)
          fmt::print("ranks {} nodes {} check {:5}: 4-byte allreduce {:7.2f} us (best of 5 rounds)\n",
                     comm->size(), comm->numNodes(), modes[m], best[m]);
      comm->destroy();
    });
  }
}

}  // namespace
