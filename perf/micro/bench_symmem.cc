// Symmetric-memory put / get / putWithSignal latency and bandwidth by size, to an
// on-node peer (shared-memory mapping) and an off-node peer (UCX RMA between
// virtual nodes), beside a plain memcpy and the streaming-store copy. Forks 2
// ranks: rank 0 runs the benchmarks, rank 1 answers ping-pongs and otherwise sits
// in a wait (which progresses UCX, as software-emulated RMA needs the target).
//
//   bench_symmem [--benchmark_filter=...]      (Google Benchmark flags)
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/local_launch.h"
#include "symmem/copy_engine.h"
#include "symmem/symmetric_heap.h"

using namespace crossbar;
using namespace crossbar::symm;

namespace {

constexpr size_t kMaxBytes = 16 << 20;
constexpr size_t kData = 4096;  // data offset; [0, 64) holds the control word
constexpr int kCtrl = 0, kPing = 1;
struct Control {
  int64_t op;  // 1: ping-pong, -1: stop
  int64_t bytes;
  int64_t iters;
};

std::vector<std::shared_ptr<Communicator>> g_comms;  // [0] one node, [1] every rank its own node
std::vector<std::shared_ptr<SymmetricBuffer>> g_bufs;
std::vector<char> g_src;
const Deadline kForever = Deadline::after(Millis(3'600'000));

void BM_memcpy(benchmark::State& state, bool nt) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    if (nt)
      copyBytesNonTemporal(dst.data(), src.data(), bytes);
    else
      std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes);
}

void BM_put(benchmark::State& state, int which) {
  SymmetricBuffer& b = *g_bufs[which];
  const size_t bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    b.put(1, kData, g_src.data(), bytes);
    b.quiet(kForever);  // complete at the target: the full cost of one put
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes);
}

void BM_get(benchmark::State& state, int which) {
  SymmetricBuffer& b = *g_bufs[which];
  const size_t bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) b.get(1, kData, g_src.data(), bytes);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes);
}

// putWithSignal there, the peer waits and answers the same way: half a round trip.
void BM_putWithSignal(benchmark::State& state, int which) {
  SymmetricBuffer& b = *g_bufs[which];
  const size_t bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    const int64_t iters = 8;
    Control ctl{1, static_cast<int64_t>(bytes), iters};
    b.putWithSignal(1, 0, &ctl, sizeof(ctl), kCtrl);
    auto t0 = Clock::now();
    for (int64_t i = 0; i < iters; ++i) {
      b.putWithSignal(1, kData, g_src.data(), bytes, kPing);
      b.waitSignal(1, kPing, kForever);
    }
    double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(sec / (2.0 * iters));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes);
}

// Rank 1: serve ping-pongs on either buffer until told to stop on both.
void serve() {
  int stopped = 0;
  std::vector<uint64_t> seen(g_bufs.size(), 0);
  while (stopped < static_cast<int>(g_bufs.size())) {
    for (size_t w = 0; w < g_bufs.size(); ++w) {
      SymmetricBuffer& b = *g_bufs[w];
      if (b.signalValue(0, kCtrl) == seen[w]) continue;
      b.waitSignal(0, kCtrl, kForever);
      ++seen[w];
      Control ctl = *b.local<Control>();
      if (ctl.op < 0) {
        ++stopped;
        continue;
      }
      for (int64_t i = 0; i < ctl.iters; ++i) {
        b.waitSignal(0, kPing, kForever);
        b.putWithSignal(0, kData, b.local<char>(kData), ctl.bytes, kPing);
      }
    }
    // Idle: nap in a short wait on the remote buffer (progresses UCX for rank 0's RMA).
    try {
      g_bufs.back()->waitSignalValue(0, kCtrl, seen.back() + 1, Deadline::after(Millis(1)));
    } catch (const Timeout&) {
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  auto exits = launchLocalRanks(2, [&](int rank, int size, std::shared_ptr<Store> store) {
    g_src.assign(kMaxBytes, 1);
    for (int rpn : {-1, 1}) {
      CommOptions o;
      o.ranks_per_node = rpn;
      o.name = rpn == 1 ? "remote" : "local";
      g_comms.push_back(Communicator::create(store, rank, size, o));
      auto heap = SymmetricHeap::create(g_comms.back());
      g_bufs.push_back(heap.allocate(kData + kMaxBytes));
    }
    if (rank == 1) {
      serve();
    } else {
      auto range = [](benchmark::internal::Benchmark* b) { b->RangeMultiplier(8)->Range(8, kMaxBytes); };
      range(benchmark::RegisterBenchmark("memcpy", BM_memcpy, false));
      range(benchmark::RegisterBenchmark("memcpy_nt", BM_memcpy, true));
      const char* where[] = {"local", "remote"};
      for (int w = 0; w < 2; ++w) {
        range(benchmark::RegisterBenchmark(fmt::format("put/{}", where[w]).c_str(), BM_put, w));
        range(benchmark::RegisterBenchmark(fmt::format("get/{}", where[w]).c_str(), BM_get, w));
        range(benchmark::RegisterBenchmark(fmt::format("putWithSignal/{}", where[w]).c_str(),
                                           BM_putWithSignal, w)
                  ->UseManualTime());
      }
      benchmark::RunSpecifiedBenchmarks();
      for (auto& b : g_bufs) {
        Control stop{-1, 0, 0};
        b->putWithSignal(1, 0, &stop, sizeof(stop), kCtrl);
      }
    }
    for (auto& b : g_bufs) b->free();
    for (auto& c : g_comms) c->destroy();
    return 0;
  });
  return combinedExitCode(exits);
}
