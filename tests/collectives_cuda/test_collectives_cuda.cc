// CPU tests of the CUDA collectives path (no GPU needed): the cuda rows of the
// selection table and their fallbacks, CROSSBAR_ALGO with CUDA names, the table
// printout, clean failures of device-memory calls where CUDA cannot run (no
// driver, or a build without CUDA), the telemetry's pending-event ring, and the host
// side of the mismatched-call check the CUDA path runs before it enqueues anything.
// Ranks are forked processes, so the gtest process never initializes CUDA.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/cuda/op_timing.h"
#include "collectives/cuda/route.h"
#include "collectives/selection.h"
#include "collectives/signature.h"
#include "comm/errors.h"
#include "harness/multiprocess.h"
#include "telemetry/telemetry.h"

#if defined(CROSSBAR_HAVE_CUDA_COLLECTIVES)
#include "collectives/cuda/cuda_collectives.h"
#include "symmem/cuda/driver_api.h"
#endif

namespace crossbar {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;

CollArgs args(CollType c, size_t count, DataType t = DataType::kFloat32) {
  CollArgs a;
  a.coll = c;
  a.count = count;
  a.type = t;
  a.send = reinterpret_cast<const void*>(0x1000);
  a.recv = reinterpret_cast<void*>(0x40000000);
  return a;
}

std::string pick(const CollArgs& a, const Communicator& c, const std::string& forced = "",
                 const AlgoOverride& ov = {}) {
  return selectAlgorithm(a, c, forced, ov, MemoryKind::kCuda).algorithm->name;
}

TEST(CudaSelection, OneNodeUsesTheHeapAlgorithms) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    EXPECT_EQ(pick(args(CollType::kAllreduce, 1024), *comm), "oneshot");     // 4 KiB
    EXPECT_EQ(pick(args(CollType::kAllreduce, 1 << 20), *comm), "twoshot");  // 4 MiB
    EXPECT_EQ(pick(args(CollType::kReduceScatter, 1 << 20), *comm), "direct");
    EXPECT_EQ(pick(args(CollType::kReduce, 7), *comm), "direct");
    for (CollType c : {CollType::kAllgather, CollType::kAlltoall, CollType::kAlltoallv, CollType::kBroadcast,
                       CollType::kGather, CollType::kScatter})
      EXPECT_EQ(pick(args(c, 1000), *comm), "ce") << collTypeName(c);
    EXPECT_EQ(pick(args(CollType::kBarrier, 0), *comm), "signal");
    CollArgs s = args(CollType::kSend, 10);
    s.peer = 1 - comm->rank();
    EXPECT_EQ(pick(s, *comm), "nccl");  // point to point always goes to NCCL
    // The host table is unchanged by the cuda rows (above the host's eager sizes).
    EXPECT_EQ(selectAlgorithm(args(CollType::kAllgather, 1 << 16), *comm, "", {}).algorithm->name, "symm");
  });
}

TEST(CudaSelection, SeveralNodesFallBackToNccl) {
  RunOptions opt;
  opt.env["CROSSBAR_RANKS_PER_NODE"] = "1";  // 2 virtual nodes
  runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        ASSERT_EQ(comm->numNodes(), 2);
        for (int i = 0; i < kNumCollTypes; ++i) {
          CollArgs a = args(static_cast<CollType>(i), 64);
          a.peer = 1 - comm->rank();
          EXPECT_EQ(pick(a, *comm), "nccl") << collTypeName(a.coll);
        }
        // Forcing a heap algorithm that does not apply falls back, saying why.
        Selection s =
            selectAlgorithm(args(CollType::kAllreduce, 64), *comm, "oneshot", {}, MemoryKind::kCuda);
        EXPECT_EQ(s.algorithm->name, "nccl");
        EXPECT_NE(s.reason.find("does not apply"), std::string::npos) << s.reason;
        EXPECT_NE(s.reason.find("2 nodes"), std::string::npos) << s.reason;
      },
      opt);
}

TEST(CudaSelection, OverridesAndUnknownNames) {
  runRanks(1, [](RankEnv& env) {
    auto comm = env.communicator();
    AlgoOverride ov = parseAlgoOverride("nccl");  // a bare CUDA-only name: every collective
    for (int i = 0; i < kNumCollTypes; ++i) EXPECT_EQ(ov.per_coll[i], "nccl");
    EXPECT_EQ(pick(args(CollType::kAllreduce, 8), *comm, "", ov), "nccl");
    // The host path ignores a name it does not have.
    EXPECT_NE(selectAlgorithm(args(CollType::kAllreduce, 8), *comm, "", ov).algorithm->name, "nccl");
    AlgoOverride two = parseAlgoOverride("allreduce=twoshot");
    EXPECT_EQ(pick(args(CollType::kAllreduce, 8), *comm, "", two), "twoshot");
    EXPECT_EQ(selectAlgorithm(args(CollType::kAllreduce, 8), *comm, "", two).algorithm->name, "twoshot");
    EXPECT_EQ(pick(args(CollType::kAllgather, 8), *comm, "", parseAlgoOverride("allgather=nccl")), "nccl");
    EXPECT_THROW(parseAlgoOverride("allgather=oneshot"), InvalidArgument);
    EXPECT_THROW(parseAlgoOverride("allreduce=cee"), InvalidArgument);
    try {
      pick(args(CollType::kAllreduce, 8), *comm, "ring");  // a host-only name forced on cuda memory
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("cuda memory"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("oneshot"), std::string::npos) << e.what();
    }
    EXPECT_EQ(pick(args(CollType::kAllreduce, 8), *comm, "twoshot"), "twoshot");
  });
}

TEST(CudaSelection, TablePrintsTheCudaRows) {
  const std::string t = describeAlgorithmTable();
  EXPECT_NE(t.find("cuda allreduce"), std::string::npos) << t;
  EXPECT_NE(t.find("-> oneshot"), std::string::npos) << t;
  EXPECT_NE(t.find("host allreduce"), std::string::npos) << t;
  size_t nccl_rows = 0;
  for (const SelectionRule& r : selectionTable())
    if (r.memory == MemoryKind::kCuda && r.algorithm == "nccl") ++nccl_rows;
  EXPECT_EQ(nccl_rows, static_cast<size_t>(kNumCollTypes));  // every collective has an NCCL row
  for (const SelectionRule& r : selectionTable())
    EXPECT_NE(findAlgorithm(r.coll, r.algorithm, r.memory), nullptr) << r.algorithm;
}

// Host pointers keep the host path; device-memory requests fail clearly where CUDA
// cannot run (this machine: no driver; or a build without CUDA).
TEST(CudaFrontEnd, HostPointersStayOnTheHostAndCudaStreamFailsCleanly) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    std::vector<float> in(100, 1.0f), out(100, 0.0f);
    EXPECT_EQ(pointerMemoryKind(in.data()), MemoryKind::kHost);
    coll.allreduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kSum)->wait();
    EXPECT_EQ(out[99], 2.0f);
#if defined(CROSSBAR_HAVE_CUDA_COLLECTIVES)
    if (cuda::driverAvailable()) GTEST_SKIP() << "a CUDA driver is present: the GPU test covers this";
#endif
    CollOptions o;
    o.cuda_stream = reinterpret_cast<void*>(0x1);  // never dereferenced: refused first
    try {
      coll.allreduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kSum, o);
      ADD_FAILURE() << "no error";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find("cuda_stream"), std::string::npos) << e.what();
    }
    // The host path still works afterwards (nothing was enqueued or made sticky).
    coll.allreduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kMax)->wait();
    EXPECT_EQ(out[0], 1.0f);
  });
}

#if defined(CROSSBAR_HAVE_CUDA_COLLECTIVES)
// The library loads and CudaCollectives refuses cleanly without a driver.
TEST(CudaCollectivesNoDriver, ConstructorSaysWhy) {
  runRanks(1, [](RankEnv& env) {
    if (cuda::driverAvailable()) GTEST_SKIP() << "a CUDA driver is present";
    try {
      CudaCollectives cc(env.communicator());
      ADD_FAILURE() << "no error";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find("no usable CUDA driver"), std::string::npos) << e.what();
    }
  });
}
#endif

// Argument checks shared with the CUDA front end run before anything else.
TEST(CudaFrontEnd, ValidateCollArgs) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    CollArgs a = args(CollType::kAllreduce, 16);
    EXPECT_NO_THROW(validateCollArgs(a, *comm));
    a.recv = nullptr;
    EXPECT_THROW(validateCollArgs(a, *comm), InvalidArgument);
    CollArgs b = args(CollType::kBroadcast, 16);
    b.root = 2;
    EXPECT_THROW(validateCollArgs(b, *comm), InvalidArgument);
    CollArgs o = args(CollType::kAllgather, 16);
    o.recv = const_cast<void*>(o.send);  // overlapping, not the in-place layout (rank 1)
    if (comm->rank() == 1) {
      EXPECT_THROW(validateCollArgs(o, *comm), InvalidArgument);
    }
    CollArgs p = args(CollType::kAllreduce, 16, DataType::kInt32);
    p.op = ReduceOp::kPreMulSum;
    EXPECT_THROW(validateCollArgs(p, *comm), InvalidArgument);
  });
}

// ---- telemetry: pending-event ring and event-time conversion (op_timing.h) ----------------

cudacoll::PendingOp pendingOp(int64_t seq) {
  cudacoll::PendingOp op;
  op.setNames("allreduce", "oneshot");
  op.op_seq = seq;
  op.bytes = 1000 + static_cast<uint64_t>(seq);
  op.enqueue_ns = 100 * seq;
  return op;
}

TEST(CudaOpTiming, RingResolvesFinishedOpsInOrderWithoutBlocking) {
  cudacoll::PendingOpRing ring(4);
  std::vector<cudacoll::Probe> state(4, cudacoll::Probe::kPending);  // per slot, the fake "event"
  std::vector<int64_t> emitted;
  int probes = 0;
  auto probe = [&](int slot, cudacoll::OpTimes* t) {
    probes++;
    t->start_ns = slot * 10;
    t->end_ns = slot * 10 + 5;
    return state[static_cast<size_t>(slot)];
  };
  auto emit = [&](const cudacoll::PendingOp& op, const cudacoll::OpTimes& t) {
    EXPECT_EQ(op.bytes, 1000 + static_cast<uint64_t>(op.op_seq));
    EXPECT_EQ(t.end_ns - t.start_ns, 5);
    emitted.push_back(op.op_seq);
  };
  int s0 = ring.push(pendingOp(0)), s1 = ring.push(pendingOp(1)), s2 = ring.push(pendingOp(2));
  ASSERT_GE(s0, 0);
  ASSERT_GE(s1, 0);
  ASSERT_GE(s2, 0);
  EXPECT_NE(s0, s1);
  // Not closed (end event not recorded yet): never probed, even if "done".
  state[s0] = cudacoll::Probe::kDone;
  EXPECT_EQ(ring.resolve(probe, emit), 0u);
  EXPECT_EQ(probes, 0);
  ring.close(s0);
  ring.close(s1);
  ring.close(s2);
  // s1 still running: s2 (done) waits behind it; the stream finishes in order.
  state[s2] = cudacoll::Probe::kDone;
  EXPECT_EQ(ring.resolve(probe, emit), 1u);
  EXPECT_EQ(emitted, (std::vector<int64_t>{0}));
  EXPECT_EQ(ring.size(), 2u);
  state[s1] = cudacoll::Probe::kFailed;  // a failed read loses only that record
  EXPECT_EQ(ring.resolve(probe, emit), 1u);
  EXPECT_EQ(emitted, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(ring.size(), 0u);
}

TEST(CudaOpTiming, RingFullDropsAndReusesSlots) {
  cudacoll::PendingOpRing ring(2);
  std::vector<int> slots;
  for (int i = 0; i < 2; ++i) slots.push_back(ring.push(pendingOp(i)));
  EXPECT_EQ(ring.push(pendingOp(2)), -1);  // every slot pending: the caller counts a drop
  for (int s : slots) ring.close(s);
  std::vector<int64_t> emitted;
  auto done = [](int, cudacoll::OpTimes*) { return cudacoll::Probe::kDone; };
  auto emit = [&](const cudacoll::PendingOp& op, const cudacoll::OpTimes&) { emitted.push_back(op.op_seq); };
  EXPECT_EQ(ring.resolve(done, emit), 2u);
  // Slots (and the caller's events in them) are reused, oldest first.
  const int again = ring.push(pendingOp(3));
  EXPECT_EQ(again, slots[0]);
  // A failed enqueue forgets its slot: nothing is emitted for it.
  ring.cancelNewest();
  EXPECT_EQ(ring.size(), 0u);
  const int next = ring.push(pendingOp(4));
  ring.close(next);
  EXPECT_EQ(ring.resolve(done, emit), 1u);
  EXPECT_EQ(emitted, (std::vector<int64_t>{0, 1, 4}));
}

TEST(CudaOpTiming, EventTimesToHostClock) {
  // Anchor at host 1'000'000 ns; start 2.5 ms later, 0.75 ms long, 0.25 ms waiting.
  cudacoll::OpTimes t = cudacoll::eventTimesToHost(1'000'000, 2.5f, 0.75f, 0.25f, 900'000);
  EXPECT_NEAR(t.start_ns, 3'500'000, 1000);
  EXPECT_NEAR(t.end_ns - t.start_ns, 750'000, 1000);
  EXPECT_NEAR(t.wait_ns, 250'000, 1000);
  // The anchor's host time is a little late: a start before the enqueue is clamped to it.
  t = cudacoll::eventTimesToHost(1'000'000, 0.001f, 0.5f, 0.0f, 1'200'000);
  EXPECT_EQ(t.start_ns, 1'200'000);
  EXPECT_NEAR(t.end_ns, 1'700'000, 1000);
  // A wait can not exceed the operation; negative event differences become 0.
  t = cudacoll::eventTimesToHost(0, 1.0f, 0.1f, 0.5f, 0);
  EXPECT_EQ(t.wait_ns, t.end_ns - t.start_ns);
  t = cudacoll::eventTimesToHost(0, 1.0f, -0.1f, -1.0f, 0);
  EXPECT_EQ(t.end_ns, t.start_ns);
  EXPECT_EQ(t.wait_ns, 0);
}

// What the CUDA collectives rely on in the recorder: step() runs the flush hooks first
// (records they push land in that step), counts the drops they report, and a removed
// hook is not called again.
TEST(CudaOpTiming, RecorderFlushHooksFeedTheStep) {
  auto& rec = telemetry::Recorder::instance();
  telemetry::Config c;
  c.enabled = true;
  rec.configure(c);
  int calls = 0;
  int owner = 0;
  rec.addFlushHook(&owner, [&] {
    calls++;
    rec.recordOp("allreduce", 64, "oneshot", 7, 10, 20, 30, 5, -1);
    rec.countDropped(2);
  });
  telemetry::StepSummary s = rec.step();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(s.ops, 1u);
  EXPECT_EQ(s.dropped, 2u);
  EXPECT_EQ(s.comm_ns, 10);
  ASSERT_EQ(rec.lastStepRecords().size(), 1u);
  EXPECT_EQ(rec.lastStepRecords()[0].op_seq, 7);
  rec.removeFlushHook(&owner);
  s = rec.step();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(s.ops, 0u);
  EXPECT_EQ(s.dropped, 0u);
  rec.configure(telemetry::Config{});
}

// ---- mismatched-call check of the CUDA path (signature.h EnqueueCallCheck) ----------------
// CudaCollectives::run() calls EnqueueCallCheck::beforeEnqueue() before any CUDA call
// of an operation (tests/collectives_cuda/*_gpu checks it end to end). Here a stand-in
// stream takes the CUDA part's place: a call is "enqueued" only once the check passed,
// exactly as run() does, so the decisions are tested without a GPU.
struct StandInStream {
  EnqueueCallCheck check{callCheckModeFromEnv()};
  std::vector<std::string> enqueued;
  int64_t issue(const std::shared_ptr<Communicator>& comm, const CollArgs& a, Millis timeout = Millis(30'000)) {
    const int64_t seq = check.beforeEnqueue(comm, a, Deadline::after(timeout));
    enqueued.push_back(a.describe());
    return seq;
  }
};

CollArgs call(CollType c, size_t count, DataType t = DataType::kFloat32, ReduceOp op = ReduceOp::kSum,
              int root = 0) {
  CollArgs a = args(c, count, t);
  a.op = op;
  a.root = root;
  return a;
}

// Expects InvalidUsage naming `peers` with every `needle`, nothing enqueued, and the same
// report on every rank (through the store).
void expectRefused(RankEnv& env, StandInStream& st, const std::string& name, const std::function<void()>& issue,
                   const std::vector<std::string>& needles, const std::vector<int>& peers) {
  auto comm = env.communicator();
  const size_t before = st.enqueued.size();
  std::string text;
  try {
    issue();
    ADD_FAILURE() << name << ": no error on rank " << comm->rank();
  } catch (const InvalidUsage& e) {
    text = e.what();
    EXPECT_EQ(e.peers(), peers) << name << ": " << text;
  }
  EXPECT_EQ(st.enqueued.size(), before) << name << ": enqueued despite the mismatch";
  for (const auto& n : needles) EXPECT_NE(text.find(n), std::string::npos) << name << ": " << text;
  EXPECT_NE(text.find("Nothing of this call was enqueued on any rank"), std::string::npos) << text;
  const size_t at = std::min(text.find("ranks called"), text.find("alltoallv counts"));
  const std::string report = at == std::string::npos ? text : text.substr(at);
  env.store->set(fmt::format("{}/{}", name, comm->rank()), report);
  for (int r = 0; r < comm->size(); ++r) {
    Bytes b = env.store->get(fmt::format("{}/{}", name, r), Deadline::after(Millis(60'000)));
    EXPECT_EQ(std::string(b.begin(), b.end()), report) << name << ": rank " << r << " reported otherwise";
  }
}

// Every kind of mismatch, then a matching call: the same sequence number everywhere.
void cudaCheckMatrix(RankEnv& env, bool pair_counts) {
  auto comm = env.communicator();
  const int me = comm->rank(), p = comm->size(), odd = p - 1;
  StandInStream st;
  EXPECT_EQ(st.issue(comm, call(CollType::kAllreduce, 64)), 0);
  expectRefused(
      env, st, "count", [&] { st.issue(comm, call(CollType::kAllreduce, me == odd ? 100 : 64)); },
      {fmt::format("rank {} called allreduce of 100 x float sum (collective #1) (count 100 vs 64)", odd)},
      {odd});
  expectRefused(
      env, st, "type",
      [&] { st.issue(comm, call(CollType::kBroadcast, 16, me == odd ? DataType::kBFloat16 : DataType::kFloat32)); },
      {"type bfloat16 vs float"}, {odd});
  expectRefused(
      env, st, "op",
      [&] {
        st.issue(comm, call(CollType::kReduceScatter, 8, DataType::kFloat32,
                            me == odd ? ReduceOp::kMax : ReduceOp::kSum));
      },
      {"op max vs sum"}, {odd});
  expectRefused(
      env, st, "root",
      [&] { st.issue(comm, call(CollType::kReduce, 8, DataType::kFloat32, ReduceOp::kSum, me == odd ? 1 : 0)); },
      {"root 1 vs 0"}, {odd});
  // Order: one rank issues a barrier where the others allgather (on a GPU: a stream
  // waiting on signals the peers never send).
  expectRefused(
      env, st, "order",
      [&] { st.issue(comm, me == odd ? call(CollType::kBarrier, 0) : call(CollType::kAllgather, 4)); },
      {"collective barrier vs allgather (called in a different order"}, {odd});
  if (pair_counts) {
    // Rank 0 sends one element more to the last rank than it expects (within a node the
    // cheap mode compares every pair; full mode everywhere).
    CollArgs a = call(CollType::kAlltoallv, 0);
    a.send_counts.assign(p, 2);
    a.recv_counts.assign(p, 2);
    a.send_displs.assign(p, 0);
    a.recv_displs.assign(p, 0);
    if (me == 0) a.send_counts[odd] = 3;
    expectRefused(
        env, st, "alltoallv", [&] { st.issue(comm, a); },
        {fmt::format("rank 0 sends 3 elements to rank {}, which expects 2", odd)}, {0, odd});
  }
  // Unbalanced point-to-point takes no number; the next collective matches everywhere.
  if (me == 0) {
    for (int i = 0; i < 3; ++i) EXPECT_EQ(st.issue(comm, call(CollType::kSend, 4)), -1);
  }
  const int64_t next = pair_counts ? 7 : 6;
  EXPECT_EQ(st.issue(comm, call(CollType::kAllreduce, 64)), next);
  EXPECT_EQ(st.check.collectivesChecked(), static_cast<uint64_t>(next + 1));
  comm->barrier();
}

TEST(CudaCallCheck, MismatchesRaiseOnEveryRankBeforeEnqueue) {
  for (int n : {2, 4}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    runRanks(n, [](RankEnv& env) { cudaCheckMatrix(env, true); });
  }
}

// Across (virtual) nodes: cheap mode compares hashes in log2(ranks) rounds (3 ranks: not
// a power of two), full mode exchanges every call with its per-pair counts.
TEST(CudaCallCheck, MismatchesRaiseAcrossNodesAndInFullMode) {
  RunOptions o;
  o.env["CROSSBAR_RANKS_PER_NODE"] = "1";
  runRanks(
      3,
      [](RankEnv& env) {
        ASSERT_EQ(env.communicator()->numNodes(), 3);
        cudaCheckMatrix(env, false);
      },
      o);
  o.env["CROSSBAR_CHECK_CALLS"] = "full";
  runRanks(
      3, [](RankEnv& env) { cudaCheckMatrix(env, true); }, o);
}

// Off: no exchange (NCCL's behaviour), but collectives are still numbered.
TEST(CudaCallCheck, OffChecksNothingButStillNumbersCollectives) {
  RunOptions o;
  o.env["CROSSBAR_CHECK_CALLS"] = "off";
  runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        StandInStream st;
        EXPECT_EQ(st.check.mode(), CallCheckMode::kOff);
        EXPECT_EQ(st.issue(comm, call(CollType::kAllreduce, comm->rank() == 1 ? 100 : 64)), 0);
        EXPECT_EQ(st.issue(comm, call(CollType::kRecv, 4)), -1);
        EXPECT_EQ(st.issue(comm, call(CollType::kBarrier, 0)), 1);
        EXPECT_EQ(st.enqueued.size(), 3u);
      },
      o);
}

// A peer that never issues the call: Timeout naming it (bounded, nothing enqueued), and
// since the peers' progress is then unknown, every later call fails at once.
TEST(CudaCallCheck, MissingPeerTimesOutThenEveryCallFailsAtOnce) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    StandInStream st;
    EXPECT_EQ(st.issue(comm, call(CollType::kAllreduce, 8)), 0);  // creates the slots
    if (comm->rank() == 0) {
      try {
        st.issue(comm, call(CollType::kAllreduce, 8), Millis(500));
        ADD_FAILURE() << "no error";
      } catch (const Timeout& e) {
        EXPECT_EQ(e.peers(), std::vector<int>{1}) << e.what();
      }
      EXPECT_EQ(st.enqueued.size(), 1u);
      const auto t0 = std::chrono::steady_clock::now();
      try {
        st.issue(comm, call(CollType::kBroadcast, 8));
        ADD_FAILURE() << "no error";
      } catch (const InvalidUsage& e) {
        EXPECT_NE(std::string(e.what()).find("ended without a verdict"), std::string::npos) << e.what();
      }
      EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10)) << "must not wait again";
      EXPECT_EQ(st.issue(comm, call(CollType::kSend, 8)), -1);  // point-to-point is not checked
    }
    env.store->set(fmt::format("done/{}", comm->rank()), "1");
    env.store->get(fmt::format("done/{}", 1 - comm->rank()), Deadline::after(Millis(60'000)));
  });
}

// Cost per call of the check alone (what the CUDA path adds to each enqueue): a loop
// of allreduce signatures per mode, modes interleaved over rounds, best round. Timing,
// not a test: run on a quiet machine with
//   build/bin/test_collectives_cuda --gtest_also_run_disabled_tests --gtest_filter='*CheckCost*'
// (CROSSBAR_RANKS_PER_NODE=1 measures the across-nodes path.)
TEST(CudaCallCheck, DISABLED_CheckCost) {
  for (int n : {2, 4}) {
    runRanks(n, [](RankEnv& env) {
      auto comm = env.communicator();
      const char* modes[] = {"off", "cheap", "full"};
      double best[3] = {1e9, 1e9, 1e9};
      for (int round = 0; round < 5; ++round) {
        for (int m = 0; m < 3; ++m) {
          setenv("CROSSBAR_CHECK_CALLS", modes[m], 1);
          StandInStream st;
          const CollArgs a = call(CollType::kAllreduce, 1 << 20, DataType::kBFloat16);
          for (int i = 0; i < 100; ++i) st.check.beforeEnqueue(comm, a, Deadline::after(Millis(30'000)));
          comm->barrier();
          const int iters = 2000;
          auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < iters; ++i) st.check.beforeEnqueue(comm, a, Deadline::after(Millis(30'000)));
          const double us =
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
          best[m] = std::min(best[m], us);
          comm->barrier();
        }
      }
      if (comm->rank() == 0)
        for (int m = 0; m < 3; ++m)
          fmt::print("ranks {} nodes {} check {:5}: {:7.2f} us per call (best of 5 rounds of 2000)\n",
                     comm->size(), comm->numNodes(), modes[m], best[m]);
      comm->destroy();
    });
  }
}

}  // namespace
}  // namespace crossbar
