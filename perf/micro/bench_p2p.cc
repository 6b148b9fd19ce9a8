// Point-to-point latency and bandwidth over each transport, beside a plain memcpy of
// the same size (the machine's copy limit). Forks 2 ranks: rank 0 runs the
// benchmarks, rank 1 echoes. Half a round trip is reported as the one-way time.
//
//   bench_p2p [--benchmark_filter=...]      (Google Benchmark flags)
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <stdlib.h>

#include <cstring>
#include <vector>

#include "comm/communicator.h"
#include "comm/local_launch.h"

using namespace crossbar;

namespace {

constexpr uint32_t kControlTag = 100, kPingTag = 101, kPongTag = 102;
struct Control {
  int64_t transport;  // index into g_comms; -1 ends the echo loop
  int64_t bytes;
  int64_t iters;
};

std::vector<std::shared_ptr<Communicator>> g_comms;  // [0] shm, [1] ucx
std::vector<char> g_buf;

void pingPong(Communicator& c, size_t bytes, int64_t iters) {
  for (int64_t i = 0; i < iters; ++i) {
    c.send(g_buf.data(), bytes, 1, kPingTag);
    c.recv(g_buf.data(), bytes, 1, kPongTag);
  }
}

void BM_p2p(benchmark::State& state, int transport) {
  Communicator& c = *g_comms[transport];
  const size_t bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    const int64_t iters = 4;
    Control ctl{transport, static_cast<int64_t>(bytes), iters};
    g_comms[0]->send(&ctl, sizeof(ctl), 1, kControlTag);
    auto t0 = Clock::now();
    pingPong(c, bytes, iters);
    double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(sec / (2.0 * iters));  // one-way time per message
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes);
}

void BM_memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes);
}

void echoLoop() {
  Communicator& c0 = *g_comms[0];
  while (true) {
    Control ctl{};
    c0.recv(&ctl, sizeof(ctl), 0, kControlTag);  // control always over the first comm
    if (ctl.transport < 0) return;
    Communicator& c = *g_comms[ctl.transport];
    for (int64_t i = 0; i < ctl.iters; ++i) {
      c.recv(g_buf.data(), ctl.bytes, 0, kPingTag);
      c.send(g_buf.data(), ctl.bytes, 0, kPongTag);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  const int64_t max_bytes = 64 << 20;
  auto exits = launchLocalRanks(2, [&](int rank, int size, std::shared_ptr<Store> store) {
    g_buf.assign(max_bytes, 1);
    for (const char* transport : {"shm", "ucx"}) {
      setenv("CROSSBAR_TRANSPORT", transport, 1);
      g_comms.push_back(Communicator::create(store, rank, size));
    }
    if (rank == 1) {
      // The control channel is g_comms[0]; benchmark messages use each transport's comm.
      echoLoop();
    } else {
      benchmark::RegisterBenchmark("memcpy", BM_memcpy)->RangeMultiplier(8)->Range(8, max_bytes);
      benchmark::RegisterBenchmark("p2p/shm", BM_p2p, 0)->RangeMultiplier(8)->Range(8, max_bytes)->UseManualTime();
      benchmark::RegisterBenchmark("p2p/ucx", BM_p2p, 1)->RangeMultiplier(8)->Range(8, max_bytes)->UseManualTime();
      benchmark::RunSpecifiedBenchmarks();
      Control stop{-1, 0, 0};
      g_comms[0]->send(&stop, sizeof(stop), 1, kControlTag);
    }
    for (auto& c : g_comms) c->destroy();
    return 0;
  });
  return combinedExitCode(exits);
}
