// The collectives' own telemetry: every operation of a real run (forked ranks over
// shm) leaves one record with the right name, size, algorithm, sequence number and
// times; a rank that arrives late is named last arrival by the ranks that waited for it
// (in the call check, in the one-shot algorithm, in the ring's receives).
// Timing: the late rank sleeps 300 ms; assertions allow a third of that.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "collectives/collectives.h"
#include "harness/multiprocess.h"
#include "telemetry/telemetry.h"

namespace crossbar::telemetry {
namespace {

using crossbar::testing::RankEnv;
using crossbar::testing::RunOptions;
using crossbar::testing::runRanks;

constexpr int64_t kLateMs = 300;

// check_calls: CROSSBAR_CHECK_CALLS. Its default (cheap) call check is where ranks first
// meet, so it absorbs the arrival skew (its waits on each peer's call slot are marked);
// "off" leaves the waiting to the algorithm itself.
RunOptions options(const char* check_calls = "cheap") {
  RunOptions o;
  o.env["CROSSBAR_TIMEOUT"] = "60s";
  o.env["CROSSBAR_CHECK_CALLS"] = check_calls;
  return o;
}

void enableTelemetry(const Communicator& comm) {
  Config c;
  c.enabled = true;  // in memory: lastStepRecords() is what we check
  c.rank = comm.rank();
  c.world_size = comm.size();
  Recorder::instance().configure(c);
}

std::vector<Record> opRecords() {
  std::vector<Record> ops;
  for (const Record& r : Recorder::instance().lastStepRecords())
    if (r.kind == Kind::kOp) ops.push_back(r);
  std::sort(ops.begin(), ops.end(), [](const Record& a, const Record& b) { return a.seq < b.seq; });
  return ops;
}

void recordsEveryOperation(int nranks) {
  runRanks(
      nranks,
      [](RankEnv& env) {
        auto comm = env.communicator();
        enableTelemetry(*comm);
        Collectives coll(comm);
        const int p = comm->size(), r = comm->rank();
        std::vector<float> a(1024, float(r + 1)), g(256 * p), rs(256);
        coll.allreduce(a.data(), a.data(), a.size(), DataType::kFloat32, ReduceOp::kSum)->wait();
        coll.allgather(a.data(), g.data(), 256, DataType::kFloat32)->wait();
        coll.broadcast(a.data(), 100, DataType::kFloat32, p - 1)->wait();
        coll.reduceScatter(g.data(), rs.data(), 256, DataType::kFloat32, ReduceOp::kSum)->wait();
        coll.barrier()->wait();
        const float want = float(p * (p + 1) / 2);
        EXPECT_EQ(a[0], want);  // the data moved, not only the records

        StepSummary s = Recorder::instance().step();
        std::vector<Record> ops = opRecords();
        ASSERT_EQ(ops.size(), 5u);
        EXPECT_EQ(s.ops, 5u);
        const char* names[] = {"allreduce", "allgather", "broadcast", "reduce_scatter", "barrier"};
        const uint64_t bytes[] = {4096, 1024u * p, 400, 1024u * p, 0};
        for (size_t i = 0; i < ops.size(); ++i) {
          SCOPED_TRACE(names[i]);
          EXPECT_STREQ(ops[i].name, names[i]);
          EXPECT_EQ(ops[i].bytes, bytes[i]);
          EXPECT_EQ(ops[i].op_seq, int64_t(i));  // the collectives' own numbering, same on every rank
          EXPECT_GT(std::strlen(ops[i].algo), 0u);
          EXPECT_LE(ops[i].enqueue_ns, ops[i].start_ns);
          EXPECT_LE(ops[i].start_ns, ops[i].end_ns);
          EXPECT_GE(ops[i].wait_ns, 0);
          EXPECT_LE(ops[i].wait_ns, ops[i].end_ns - ops[i].start_ns);
          EXPECT_GE(ops[i].last_peer, 0);
          EXPECT_LT(ops[i].last_peer, p);
          if (i) {
            EXPECT_GT(ops[i].seq, ops[i - 1].seq);
          }
        }
        EXPECT_EQ(s.rank, r);
        EXPECT_EQ(s.world_size, p);
        EXPECT_EQ(s.bytes, 4096 + 400 + 2048u * p);

        // Point to point: a lone send/recv is one record named after it.
        if (p >= 2 && r < 2) {
          std::vector<int32_t> buf(64, r);
          if (r == 0)
            coll.send(buf.data(), buf.size(), DataType::kInt32, 1, 7)->wait();
          else
            coll.recv(buf.data(), buf.size(), DataType::kInt32, 0, 7)->wait();
          Recorder::instance().step();
          std::vector<Record> p2p = opRecords();
          ASSERT_EQ(p2p.size(), 1u);
          EXPECT_STREQ(p2p[0].name, r == 0 ? "send" : "recv");
          EXPECT_EQ(p2p[0].bytes, 256u);
          EXPECT_EQ(p2p[0].op_seq, -1);
        }
        comm->destroy();
      },
      options());
}

TEST(TelemetryCollectives, RecordsEveryOperation2Ranks) {
  recordsEveryOperation(2);
}

TEST(TelemetryCollectives, RecordsEveryOperation4Ranks) {
  recordsEveryOperation(4);
}

// `late` sleeps before the allreduce; the others must name it and have waited for it.
void lateRankIsLastArrival(int nranks, int late, const char* algorithm, size_t count, const char* check_calls) {
  runRanks(
      nranks,
      [=](RankEnv& env) {
        auto comm = env.communicator();
        enableTelemetry(*comm);
        Collectives coll(comm);
        CollOptions o;
        o.algorithm = algorithm;
        std::vector<float> a(count, 1.0f);
        // Warm-up (creates staging buffers, connects peers), then a fresh step.
        coll.allreduce(a.data(), a.data(), count, DataType::kFloat32, ReduceOp::kSum, o)->wait();
        coll.barrier()->wait();
        Recorder::instance().step();

        if (comm->rank() == late) std::this_thread::sleep_for(std::chrono::milliseconds(kLateMs));
        coll.allreduce(a.data(), a.data(), count, DataType::kFloat32, ReduceOp::kSum, o)->wait();
        StepSummary s = Recorder::instance().step();
        std::vector<Record> ops = opRecords();
        ASSERT_EQ(ops.size(), 1u);
        EXPECT_STREQ(ops[0].algo, algorithm);
        const int64_t ms = 1'000'000;
        if (comm->rank() == late) {
          // Everyone was there before it: nobody kept it waiting long.
          EXPECT_LT(ops[0].wait_ns, kLateMs * ms / 3);
        } else {
          EXPECT_EQ(ops[0].last_peer, late) << "waited " << ops[0].wait_ns / ms << " ms";
          EXPECT_GE(ops[0].wait_ns, kLateMs * ms / 3);
          // The step line attributes the wait to the late rank.
          auto it = std::find_if(s.waited_on.begin(), s.waited_on.end(),
                                 [&](const auto& e) { return e.first == late; });
          ASSERT_NE(it, s.waited_on.end());
          EXPECT_GE(it->second, kLateMs * ms / 3);
        }
        comm->destroy();
      },
      options(check_calls));
}

// One node, small: the symmetric one-shot algorithm waits for every peer's READY signal
// (call check off), as does the default call check on one node.
TEST(TelemetryCollectives, LateRankIsLastArrivalOneshot4Ranks) {
  lateRankIsLastArrival(4, 3, "oneshot", 256, "off");
}

TEST(TelemetryCollectives, LateRankIsLastArrivalCallCheck4Ranks) {
  lateRankIsLastArrival(4, 2, "oneshot", 256, "cheap");
}

// Point-to-point ring: with 2 ranks the only peer is the late one.
TEST(TelemetryCollectives, LateRankIsLastArrivalRing2Ranks) {
  lateRankIsLastArrival(2, 1, "ring", 64 * 1024, "off");
}

}  // namespace
}  // namespace crossbar::telemetry
