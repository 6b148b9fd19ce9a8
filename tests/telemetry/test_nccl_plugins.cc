// The NCCL plugins, loaded the way NCCL loads them (dlopen + dlsym of the versioned
// symbol) and driven with synthetic events on the CPU.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "plugins/nccl/nccl_profiler_v5.h"
#include "plugins/nccl/nccl_tuner_v5.h"
#include "plugins/nccl/plugin_stats.h"
#include "telemetry/telemetry.h"

namespace crossbar::telemetry {
namespace {

template <typename T>
T* loadSymbol(const char* path, const char* symbol, void** handle) {
  *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  EXPECT_NE(*handle, nullptr) << dlerror();
  if (!*handle) return nullptr;
  auto* sym = static_cast<T*>(dlsym(*handle, symbol));
  EXPECT_NE(sym, nullptr) << symbol << ": " << dlerror();
  return sym;
}

// ---- tuner ------------------------------------------------------------------------------

class TunerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tuner_ = loadSymbol<ncclTuner_v5_t>(CROSSBAR_TUNER_PLUGIN, "ncclTunerPlugin_v5", &lib_);
    ASSERT_NE(tuner_, nullptr);
    path_ = std::filesystem::temp_directory_path() / ("crossbar-tuner-" + std::to_string(getpid()) + ".csv");
    std::ofstream(path_) << "collective,min_bytes,max_bytes,nranks,nnodes,algorithm,protocol,channels\n"
                            "# small allreduce on one node: ring/LL on 4 channels\n"
                            "allreduce, 0, 64K, *, 1, ring, ll, 4\n"
                            "allreduce, 64K, *, 8, *, tree, simple, 0\n"
                            "allgather, 0, *, *, *, pat, simple, 2\n"
                            "broadcast, 0, *, *, *, nvls, simple, 6\n"
                            "garbage row\n";
    setenv("CROSSBAR_TUNER_TABLE", path_.c_str(), 1);
  }
  void TearDown() override {
    unsetenv("CROSSBAR_TUNER_TABLE");
    std::filesystem::remove(path_);
    if (lib_) dlclose(lib_);
  }
  // A fresh cost table: every entry 1.0 except one NCCL marked unusable.
  void resetTable() {
    for (auto& row : table_)
      for (float& v : row) v = 1.0f;
    table_[NCCL_ALGO_NVLS][NCCL_PROTO_SIMPLE] = float(NCCL_ALGO_PROTO_IGNORE);
  }
  int call(void* ctx, ncclFunc_t coll, size_t bytes) {
    resetTable();
    int channels = -7;
    EXPECT_EQ(tuner_->getCollInfo(ctx, coll, bytes, 1, reinterpret_cast<float**>(table_),
                                  NCCL_NUM_ALGORITHMS_V5, NCCL_NUM_PROTOCOLS_V5, 0, &channels),
              ncclSuccess);
    return channels;
  }
  int zeros() {
    int n = 0;
    for (auto& row : table_)
      for (float v : row) n += v == 0.0f;
    return n;
  }

  void* lib_ = nullptr;
  ncclTuner_v5_t* tuner_ = nullptr;
  std::filesystem::path path_;
  float table_[NCCL_NUM_ALGORITHMS_V5][NCCL_NUM_PROTOCOLS_V5];
};

TEST_F(TunerTest, TableRowsSetCostAndChannels) {
  EXPECT_STREQ(tuner_->name, "crossbar");
  auto stats = reinterpret_cast<crossbar_tuner_stats_fn>(dlsym(lib_, CROSSBAR_TUNER_STATS_SYMBOL));
  ASSERT_NE(stats, nullptr);
  CrossbarTunerStats before{}, after{};
  stats(&before);
  void* ctx = nullptr;
  ASSERT_EQ(tuner_->init(&ctx, 1, 8, 1, nullptr, nullptr, nullptr), ncclSuccess);
  // Small allreduce: ring/LL chosen, 4 channels, nothing else touched.
  EXPECT_EQ(call(ctx, ncclFuncAllReduce, 4096), 4);
  EXPECT_EQ(table_[NCCL_ALGO_RING][NCCL_PROTO_LL], 0.0f);
  EXPECT_EQ(zeros(), 1);
  EXPECT_EQ(table_[NCCL_ALGO_TREE][NCCL_PROTO_SIMPLE], 1.0f);
  // Large allreduce on 8 ranks: tree/simple, channels left to NCCL.
  EXPECT_EQ(call(ctx, ncclFuncAllReduce, 1 << 20), -7);
  EXPECT_EQ(table_[NCCL_ALGO_TREE][NCCL_PROTO_SIMPLE], 0.0f);
  EXPECT_EQ(zeros(), 1);
  // The max bound is exclusive: exactly 64K falls in the second row.
  EXPECT_EQ(call(ctx, ncclFuncAllReduce, 64 << 10), -7);
  EXPECT_EQ(table_[NCCL_ALGO_TREE][NCCL_PROTO_SIMPLE], 0.0f);
  EXPECT_EQ(call(ctx, ncclFuncAllGather, 100), 2);
  EXPECT_EQ(table_[NCCL_ALGO_PAT][NCCL_PROTO_SIMPLE], 0.0f);
  // A row naming an entry NCCL marked unusable leaves the table (and channels) alone.
  EXPECT_EQ(call(ctx, ncclFuncBroadcast, 100), -7);
  EXPECT_EQ(zeros(), 0);
  EXPECT_EQ(table_[NCCL_ALGO_NVLS][NCCL_PROTO_SIMPLE], float(NCCL_ALGO_PROTO_IGNORE));
  // No matching row: untouched.
  EXPECT_EQ(call(ctx, ncclFuncReduceScatter, 100), -7);
  EXPECT_EQ(zeros(), 0);
  EXPECT_EQ(tuner_->finalize(ctx), ncclSuccess);
  // What the GPU check reads to tell that NCCL consulted the tuner.
  stats(&after);
  EXPECT_EQ(after.inits - before.inits, 1u);
  EXPECT_EQ(after.consulted - before.consulted, 6u);
  EXPECT_EQ(after.applied - before.applied, 4u);
  EXPECT_GE(after.rules - before.rules, 3u);
}

TEST_F(TunerTest, RowsMatchRanksAndNodes) {
  void* ctx = nullptr;
  // 4 ranks on 2 nodes: neither allreduce row applies.
  ASSERT_EQ(tuner_->init(&ctx, 2, 4, 2, nullptr, nullptr, nullptr), ncclSuccess);
  EXPECT_EQ(call(ctx, ncclFuncAllReduce, 4096), -7);
  EXPECT_EQ(call(ctx, ncclFuncAllReduce, 1 << 20), -7);
  EXPECT_EQ(zeros(), 0);
  EXPECT_EQ(tuner_->finalize(ctx), ncclSuccess);
}

TEST_F(TunerTest, MissingTableLeavesNcclInCharge) {
  setenv("CROSSBAR_TUNER_TABLE", "/nonexistent/crossbar-table.csv", 1);
  void* ctx = nullptr;
  ASSERT_EQ(tuner_->init(&ctx, 3, 8, 1, nullptr, nullptr, nullptr), ncclSuccess);
  EXPECT_EQ(call(ctx, ncclFuncAllReduce, 4096), -7);
  EXPECT_EQ(zeros(), 0);
  EXPECT_EQ(tuner_->finalize(ctx), ncclSuccess);
}

// ---- profiler ---------------------------------------------------------------------------

class ProfilerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prof_ = loadSymbol<ncclProfiler_v5_t>(CROSSBAR_PROFILER_PLUGIN, "ncclProfiler_v5", &lib_);
    ASSERT_NE(prof_, nullptr);
    Config c;
    c.enabled = true;
    Recorder::instance().configure(c);  // the plugin shares this process's recorder
  }
  void TearDown() override {
    Recorder::instance().configure(Config{});
    if (lib_) dlclose(lib_);
  }
  void* start(void* ctx, ncclProfilerEventDescr_v5_t d) {
    void* h = nullptr;
    EXPECT_EQ(prof_->startEvent(ctx, &h, &d), ncclSuccess);
    return h;
  }
  void state(void* h, ncclProfilerEventState_v5_t s) {
    ncclProfilerEventStateArgs_v5_t args{};
    EXPECT_EQ(prof_->recordEventState(h, s, &args), ncclSuccess);
  }

  void* lib_ = nullptr;
  ncclProfiler_v5_t* prof_ = nullptr;
};

TEST_F(ProfilerTest, CollectiveWithChannelsAndProxyStepsBecomesOneRecord) {
  EXPECT_STREQ(prof_->name, "crossbar");
  auto stats = reinterpret_cast<crossbar_profiler_stats_fn>(dlsym(lib_, CROSSBAR_PROFILER_STATS_SYMBOL));
  ASSERT_NE(stats, nullptr);
  CrossbarProfilerStats before{}, after{};
  stats(&before);
  void* ctx = nullptr;
  int mask = 0;
  ASSERT_EQ(prof_->init(&ctx, 42, &mask, "world", 1, 4, 2, nullptr), ncclSuccess);
  EXPECT_TRUE(mask & ncclProfileColl);
  EXPECT_TRUE(mask & ncclProfileProxyStep);
  EXPECT_EQ(Recorder::instance().rank(), 2);

  ncclProfilerEventDescr_v5_t d{};
  d.type = ncclProfileColl;
  d.rank = 2;
  d.coll.seqNumber = 7;
  d.coll.func = "AllReduce";
  d.coll.count = 1024;
  d.coll.datatype = "ncclFloat32";
  d.coll.nChannels = 2;
  d.coll.algo = "RING";
  d.coll.proto = "SIMPLE";
  void* coll = start(ctx, d);
  ASSERT_NE(coll, nullptr);
  // The host side finishes first; the record waits for the channels.
  EXPECT_EQ(prof_->stopEvent(coll), ncclSuccess);

  void* kernel[2];
  void* ops[2];
  for (int ch = 0; ch < 2; ++ch) {
    ncclProfilerEventDescr_v5_t k{};
    k.type = ncclProfileKernelCh;
    k.parentObj = coll;
    k.kernelCh.channelId = uint8_t(ch);
    kernel[ch] = start(ctx, k);
    ASSERT_NE(kernel[ch], nullptr);
  }
  for (int ch = 0; ch < 2; ++ch) {
    ncclProfilerEventDescr_v5_t p{};
    p.type = ncclProfileProxyOp;
    p.parentObj = coll;
    p.proxyOp.channelId = uint8_t(ch);
    p.proxyOp.peer = 3;
    p.proxyOp.nSteps = 2;
    p.proxyOp.isSend = 1;
    ops[ch] = start(ctx, p);
    ASSERT_NE(ops[ch], nullptr);
    for (int s = 0; s < 2; ++s) {
      ncclProfilerEventDescr_v5_t sd{};
      sd.type = ncclProfileProxyStep;
      sd.parentObj = ops[ch];
      sd.proxyStep.step = s;
      void* step = start(ctx, sd);
      ASSERT_NE(step, nullptr);
      state(step, ncclProfilerProxyStepSendGPUWait);
      state(step, ncclProfilerProxyStepSendPeerWait_v4);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      state(step, ncclProfilerProxyStepSendWait);
      EXPECT_EQ(prof_->stopEvent(step), ncclSuccess);
    }
  }
  EXPECT_EQ(prof_->stopEvent(ops[0]), ncclSuccess);
  EXPECT_EQ(prof_->stopEvent(kernel[0]), ncclSuccess);
  EXPECT_EQ(prof_->stopEvent(ops[1]), ncclSuccess);
  // Not yet: channel 1's kernel is still running.
  EXPECT_EQ(Recorder::instance().step().ops, 0u);
  state(kernel[1], ncclProfilerKernelChStop);
  EXPECT_EQ(prof_->stopEvent(kernel[1]), ncclSuccess);

  StepSummary s = Recorder::instance().step();
  EXPECT_EQ(s.ops, 1u);
  EXPECT_EQ(s.bytes, 4096u);
  auto records = Recorder::instance().lastStepRecords();
  ASSERT_EQ(records.size(), 1u);
  const Record& r = records[0];
  EXPECT_STREQ(r.name, "AllReduce");
  EXPECT_STREQ(r.algo, "RING/SIMPLE");
  EXPECT_LE(r.enqueue_ns, r.start_ns);
  EXPECT_LE(r.start_ns, r.end_ns);
  // Two 2 ms peer waits per channel: the longest channel's total.
  EXPECT_GE(r.wait_ns, 4'000'000);
  EXPECT_LE(r.wait_ns, r.end_ns - r.start_ns);
  EXPECT_EQ(prof_->finalize(ctx), ncclSuccess);
  // What the GPU check reads to tell that NCCL drove the profiler.
  stats(&after);
  EXPECT_EQ(after.inits - before.inits, 1u);
  EXPECT_EQ(after.colls - before.colls, 1u);
  EXPECT_EQ(after.colls_recorded - before.colls_recorded, 1u);
  EXPECT_EQ(after.kernel_channels - before.kernel_channels, 2u);
  EXPECT_EQ(after.proxy_ops - before.proxy_ops, 2u);
  EXPECT_EQ(after.proxy_steps - before.proxy_steps, 4u);
  EXPECT_EQ(after.last_bytes, 4096u);
  EXPECT_STREQ(after.last_func, "AllReduce");
}

TEST_F(ProfilerTest, CollectiveWithoutChildrenUsesHostSpanAndP2pIsIgnored) {
  void* ctx = nullptr;
  int mask = 0;
  ASSERT_EQ(prof_->init(&ctx, 43, &mask, "world", 1, 2, 0, nullptr), ncclSuccess);
  ncclProfilerEventDescr_v5_t d{};
  d.type = ncclProfileColl;
  d.coll.func = "Broadcast";
  d.coll.count = 10;
  d.coll.datatype = "ncclInt8";
  void* coll = start(ctx, d);
  EXPECT_EQ(prof_->stopEvent(coll), ncclSuccess);
  ncclProfilerEventDescr_v5_t p{};
  p.type = ncclProfileP2p;
  void* p2p = start(ctx, p);
  EXPECT_EQ(p2p, nullptr);
  EXPECT_EQ(prof_->stopEvent(p2p), ncclSuccess);  // NCCL may pass back a null handle
  StepSummary s = Recorder::instance().step();
  EXPECT_EQ(s.ops, 1u);
  EXPECT_EQ(s.bytes, 10u);
  EXPECT_EQ(prof_->finalize(ctx), ncclSuccess);
}

TEST_F(ProfilerTest, DisabledTelemetryAsksForNoEvents) {
  Recorder::instance().configure(Config{});
  void* ctx = nullptr;
  int mask = -1;
  ASSERT_EQ(prof_->init(&ctx, 44, &mask, "world", 1, 2, 0, nullptr), ncclSuccess);
  EXPECT_EQ(mask, 0);
  EXPECT_EQ(prof_->finalize(ctx), ncclSuccess);
}

}  // namespace
}  // namespace crossbar::telemetry
