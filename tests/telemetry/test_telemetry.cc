// Telemetry core and cross-rank aggregation. No timing assertions: the synthetic job's
// planted delays (hundreds of ms) dwarf anything a loaded machine adds.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "harness/multiprocess.h"
#include "telemetry/aggregate.h"
#include "telemetry/telemetry.h"

namespace crossbar::telemetry {
namespace {

namespace fs = std::filesystem;

fs::path tempDir(const char* tag) {
  std::string tmpl = (fs::temp_directory_path() / fmt::format("crossbar-{}-XXXXXX", tag)).string();
  char* dir = mkdtemp(tmpl.data());
  EXPECT_NE(dir, nullptr);
  return fs::path(tmpl);
}

Config inMemory(size_t ring = 8192) {
  Config c;
  c.enabled = true;
  c.ring_capacity = ring;
  return c;
}

class TelemetryTest : public ::testing::Test {
 protected:
  void TearDown() override { Recorder::instance().configure(Config{}); }
};

TEST_F(TelemetryTest, DisabledRecordsNothing) {
  auto& rec = Recorder::instance();
  rec.configure(Config{});
  EXPECT_FALSE(rec.enabled());
  { OpScope op("allreduce", 64, "ring"); }
  { Phase p("forward"); }
  EXPECT_EQ(rec.step().ops, 0u);
  EXPECT_TRUE(rec.history().empty());
}

TEST_F(TelemetryTest, StepSummarizesOpsAndPhases) {
  auto& rec = Recorder::instance();
  rec.configure(inMemory());
  {
    Phase p("forward");
    OpScope op("allreduce", 1024, "ring");
    op.setWait(5, 3);
  }
  rec.recordOp("allgather", 2048, "bruck", 10, 20, 120, 30, 1);
  { Phase p("backward"); }
  StepSummary s = rec.step();
  EXPECT_EQ(s.step, 0u);
  EXPECT_EQ(s.ops, 2u);
  EXPECT_EQ(s.bytes, 3072u);
  EXPECT_GE(s.comm_ns, 100);
  EXPECT_EQ(s.wait_ns, 35);
  EXPECT_GT(s.rss_max, 0u);
  ASSERT_EQ(s.phases.size(), 2u);
  EXPECT_EQ(s.phases[0].first, "backward");
  EXPECT_EQ(s.phases[1].first, "forward");
  auto records = rec.lastStepRecords();
  ASSERT_EQ(records.size(), 4u);
  auto op = std::find_if(records.begin(), records.end(),
                         [](const Record& r) { return std::string(r.name) == "allgather"; });
  ASSERT_NE(op, records.end());
  EXPECT_EQ(std::string(op->algo), "bruck");
  EXPECT_EQ(op->last_peer, 1);
  EXPECT_EQ(op->end_ns - op->start_ns, 100);
  // Sequence numbers are per process and increasing.
  EXPECT_EQ(rec.step().step, 1u);
  uint64_t a = rec.recordOp("x", 0, "", 0, 0, 0);
  uint64_t b = rec.recordOp("x", 0, "", 0, 0, 0);
  EXPECT_EQ(b, a + 1);
}

TEST_F(TelemetryTest, JsonLineRoundTrips) {
  StepSummary s;
  s.rank = 3, s.world_size = 8, s.step = 42, s.start_ns = 1000, s.end_ns = 5000, s.comm_ns = 700;
  s.wait_ns = 300, s.ops = 5, s.bytes = 1 << 20, s.rss_max = 123456789, s.dropped = 2;
  s.phases = {{"data_loading", 10}, {"forward", 20}};
  s.waited_on = {{1, 250}, {3, 0}};
  s.device_mem_max = 7 << 20;
  auto back = parseStepLine(s.toJson());
  ASSERT_TRUE(back);
  EXPECT_EQ(back->rank, 3);
  EXPECT_EQ(back->world_size, 8);
  EXPECT_EQ(back->step, 42u);
  EXPECT_EQ(back->end_ns - back->start_ns, 4000);
  EXPECT_EQ(back->wait_ns, 300);
  EXPECT_EQ(back->rss_max, 123456789u);
  EXPECT_EQ(back->dropped, 2u);
  EXPECT_EQ(back->phases, s.phases);
  EXPECT_EQ(back->waited_on, s.waited_on);
  EXPECT_EQ(back->device_mem_max, 7u << 20);
  // Torn and foreign lines are rejected, not half-parsed.
  std::string line = s.toJson();
  EXPECT_FALSE(parseStepLine(line.substr(0, line.size() / 2)));
  EXPECT_FALSE(parseStepLine("not json"));
  EXPECT_FALSE(parseStepLine("{}"));
}

TEST_F(TelemetryTest, FullRingDropsAndCounts) {
  auto& rec = Recorder::instance();
  rec.configure(inMemory(16));
  for (int i = 0; i < 100; ++i) rec.recordOp("allreduce", 8, "ring", 0, 0, 1);
  StepSummary s = rec.step();
  EXPECT_EQ(s.ops, 16u);
  EXPECT_EQ(s.dropped, 84u);
  // The ring is empty again after the step.
  rec.recordOp("allreduce", 8, "ring", 0, 0, 1);
  EXPECT_EQ(rec.step().ops, 1u);
}

TEST_F(TelemetryTest, ThreadsRecordIntoTheirOwnRings) {
  auto& rec = Recorder::instance();
  rec.configure(inMemory(1 << 14));
  constexpr int kThreads = 4, kOps = 10000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < kOps; ++i) OpScope op("alltoall", 1, "pairwise");
    });
  for (auto& t : threads) t.join();
  StepSummary s = rec.step();
  EXPECT_EQ(s.ops, uint64_t(kThreads) * kOps);
  EXPECT_EQ(s.dropped, 0u);
}

TEST_F(TelemetryTest, WritesOneLinePerStep) {
  auto dir = tempDir("tel");
  Config c = inMemory();
  c.dir = dir.string();
  c.rank = 2;
  c.world_size = 4;
  auto& rec = Recorder::instance();
  rec.configure(c);
  for (int i = 0; i < 3; ++i) rec.step();
  auto loaded = loadDir(dir.string());
  ASSERT_EQ(loaded.size(), 3u);
  EXPECT_EQ(loaded[2].rank, 2);
  EXPECT_EQ(loaded[2].step, 2u);
  fs::remove_all(dir);
}

// Hand-made summaries: only steps every rank finished are reported.
TEST_F(TelemetryTest, AggregateSkipsIncompleteSteps) {
  std::vector<StepSummary> all;
  for (int step = 0; step < 4; ++step)
    for (int rank = 0; rank < 3; ++rank) {
      if (step == 3 && rank == 1) continue;
      StepSummary s;
      s.rank = rank, s.world_size = 3, s.step = uint64_t(step), s.start_ns = 0;
      s.end_ns = (rank == 2 && step == 1) ? 900 : 100;
      all.push_back(s);
    }
  Report r = aggregate(all);
  ASSERT_EQ(r.steps.size(), 3u);
  EXPECT_EQ(r.incomplete, std::vector<uint64_t>{3});
  EXPECT_EQ(r.steps[1].worst_rank, 2);
  EXPECT_EQ(r.steps[1].worst_ns, 900);
  EXPECT_EQ(r.steps[1].median_ns, 100);
  EXPECT_EQ(r.steps[1].straggler, 2);
  EXPECT_EQ(r.steps[1].straggler_margin_ns, 800);
}

// The straggler is who spent the most time outside communication, whether or not the
// collectives could attribute the others' wait; last arrival is whom the others waited on;
// device memory gets its own high-water and creep.
TEST_F(TelemetryTest, AggregateStragglerLastArrivalAndDeviceCreep) {
  std::vector<StepSummary> all;
  for (int step = 0; step < 8; ++step)
    for (int rank = 0; rank < 3; ++rank) {
      StepSummary s;
      s.rank = rank, s.world_size = 3, s.step = uint64_t(step), s.start_ns = 0, s.end_ns = 1000;
      // Rank 1 computes 600 ns longer in step 5; the others sit in the collective.
      s.comm_ns = (step == 5 && rank != 1) ? 700 : 100;
      if (step == 5 && rank != 1) s.waited_on = {{1, 600}};
      s.device_mem_max = rank == 2 ? uint64_t(step) * (8 << 20) : (1 << 30);
      all.push_back(s);
    }
  Report r = aggregate(all);
  ASSERT_EQ(r.steps.size(), 8u);
  EXPECT_EQ(r.steps[5].straggler, 1);
  EXPECT_EQ(r.steps[5].straggler_margin_ns, 600);
  EXPECT_EQ(r.steps[5].last_arrival, 1);
  EXPECT_EQ(r.steps[5].last_arrival_wait_ns, 1200);
  EXPECT_EQ(r.steps[4].last_arrival, -1);
  EXPECT_EQ(r.steps[7].device_mem_max, 1u << 30);
  ASSERT_EQ(r.creep.size(), 3u);
  EXPECT_TRUE(r.creep[2].device_flagged);
  EXPECT_NEAR(r.creep[2].device_slope_bytes_per_step, 8 << 20, 1);
  EXPECT_FALSE(r.creep[0].device_flagged);
  EXPECT_FALSE(r.creep[2].flagged);  // host RSS flat
}

constexpr int kRanks = 4;
constexpr int kSteps = 20;  // complete steps; a 21st is left unfinished by rank 0
constexpr int kSlowRank = 3, kSlowStep = 7;
constexpr int kStallRank = 1, kStallStep = 12;
constexpr int kLeakRank = 2;
constexpr size_t kLeakPerStep = 4 << 20;

void sleepMs(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

// Rank 3 computes 300 ms longer in step 7, rank 1's data loader stalls in step 12, rank 2
// leaks 4 MiB per step; every step ends in a barrier (the op whose wait shows who was late).
void syntheticJob(testing::RankEnv& env, const std::string& dir, bool live) {
  auto comm = env.communicator();
  auto& rec = Recorder::instance();
  Config c;
  c.enabled = true;
  c.rank = env.rank;
  c.world_size = env.size;
  c.dir = dir;
  rec.configure(c);
  if (live) rec.attachStore(env.store);
  std::vector<std::unique_ptr<char[]>> leak;
  for (int step = 0; step <= kSteps; ++step) {
    if (step == kSteps && env.rank == 0) {
      // Rank 0 "dies" mid-step: a torn line and no summary of the step.
      int fd = ::open((dir + "/rank0.jsonl").c_str(), O_WRONLY | O_APPEND);
      ASSERT_GE(fd, 0);
      const char torn[] = "{\"rank\":0,\"world\":4,\"step\":20,\"start_";
      ASSERT_EQ(::write(fd, torn, sizeof(torn) - 1), ssize_t(sizeof(torn) - 1));
      ::close(fd);
      break;
    }
    {
      Phase p("data_loading");
      sleepMs(1);
      if (env.rank == kStallRank && step == kStallStep) sleepMs(300);
    }
    {
      Phase p("forward");
      sleepMs(2);
      if (env.rank == kSlowRank && step == kSlowStep) sleepMs(300);
      if (env.rank == kLeakRank) {
        leak.emplace_back(new char[kLeakPerStep]);
        std::memset(leak.back().get(), 1, kLeakPerStep);  // touched: resident
      }
    }
    if (step < kSteps) {
      OpScope op("barrier", 0, "store");
      int64_t t0 = nowNs();
      comm->barrier();
      op.setWait(nowNs() - t0);
    }
    rec.step();
  }
  if (live && env.rank == 0) {
    // Live aggregation on rank 0 from what the ranks published.
    auto summaries = collectFromStore(*env.store, env.size, kSlowStep, 60'000);
    ASSERT_EQ(summaries.size(), size_t(kRanks));
    Report r = aggregate(summaries);
    ASSERT_EQ(r.steps.size(), 1u);
    EXPECT_EQ(r.steps[0].straggler, kSlowRank);
  }
  rec.configure(Config{});
}

void checkReport(const Report& r) {
  EXPECT_EQ(r.world_size, kRanks);
  ASSERT_EQ(r.steps.size(), size_t(kSteps)) << "the unfinished last step must not be reported";
  EXPECT_EQ(r.incomplete, std::vector<uint64_t>{kSteps});
  const StepReport& slow = r.steps[kSlowStep];
  EXPECT_EQ(slow.step, uint64_t(kSlowStep));
  EXPECT_EQ(slow.straggler, kSlowRank);
  EXPECT_GT(slow.straggler_margin_ns, 0);
  EXPECT_GT(slow.wait_max_ns, 0);
  EXPECT_TRUE(slow.stalls.empty());
  const StepReport& stall = r.steps[kStallStep];
  EXPECT_EQ(stall.stalls, std::vector<int>{kStallRank});
  EXPECT_EQ(stall.straggler, kStallRank);
  ASSERT_EQ(r.creep.size(), size_t(kRanks));
  for (const auto& c : r.creep)
    EXPECT_EQ(c.flagged, c.rank == kLeakRank) << "rank " << c.rank << " slope " << c.slope_bytes_per_step;
  EXPECT_GT(r.steps.back().rss_max, 0u);
  EXPECT_EQ(r.steps.back().rss_max_rank, kLeakRank);
}

TEST_F(TelemetryTest, SyntheticJobNamesStragglerStallAndCreep) {
  auto dir = tempDir("teljob");
  testing::runRanks(kRanks, [&](testing::RankEnv& env) { syntheticJob(env, dir.string(), /*live=*/true); });
  Report r = aggregate(loadDir(dir.string()));
  checkReport(r);
  // crossbar-report reads the same files and must reach the same findings.
  if (std::system("python3 -c 'import matplotlib' >/dev/null 2>&1") == 0) {
    std::string cmd =
        fmt::format("python3 {} {} --plots {}/plots 2>&1", CROSSBAR_REPORT, dir.string(), dir.string());
    FILE* pipe = popen(cmd.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string out;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), pipe)) out.append(buf, n);
    EXPECT_EQ(pclose(pipe), 0) << out;
    EXPECT_NE(out.find(fmt::format("step {}: straggler rank {}", kSlowStep, kSlowRank)), std::string::npos)
        << out;
    EXPECT_NE(out.find(fmt::format("step {}: data-loader stall on rank {}", kStallStep, kStallRank)),
              std::string::npos)
        << out;
    EXPECT_NE(out.find(fmt::format("memory creep on rank {}", kLeakRank)), std::string::npos) << out;
    EXPECT_EQ(out.find(fmt::format("memory creep on rank {}", 0)), std::string::npos) << out;
    EXPECT_TRUE(fs::exists(dir / "plots" / "step_times.png"));
    EXPECT_TRUE(fs::exists(dir / "plots" / "heatmap.png"));
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace crossbar::telemetry
