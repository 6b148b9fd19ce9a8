// Overhead of telemetry on the hot path: a tight loop of small recordOp/OpScope calls
// with telemetry off, then on (writing to a temporary directory). Not a test: timings
// depend on the machine. Usage: bench_telemetry [iterations] [ops-per-step]
#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>

#include "telemetry/telemetry.h"

using namespace crossbar::telemetry;

static double run(long iters, long per_step) {
  auto& rec = Recorder::instance();
  volatile uint64_t sink = 0;
  int64_t t0 = nowNs();
  for (long i = 0; i < iters; ++i) {
    {
      OpScope op("allreduce", 4096, "ring");
      sink = sink + uint64_t(i);  // stands in for a tiny collective
    }
    if ((i + 1) % per_step == 0) rec.step();
  }
  return double(nowNs() - t0) / double(iters);
}

int main(int argc, char** argv) {
  long iters = argc > 1 ? std::atol(argv[1]) : 2'000'000;
  long per_step = argc > 2 ? std::atol(argv[2]) : 1000;
  auto dir = std::filesystem::temp_directory_path() / fmt::format("crossbar-bench-telemetry-{}", getpid());
  Config off;
  Recorder::instance().configure(off);
  double ns_off = run(iters, per_step);
  Config on;
  on.enabled = true;
  on.dir = dir.string();
  Recorder::instance().configure(on);
  double ns_on = run(iters, per_step);
  Recorder::instance().configure(off);
  std::filesystem::remove_all(dir);
  fmt::print("ops {}  ops/step {}\n", iters, per_step);
  fmt::print("telemetry off: {:8.1f} ns/op\n", ns_off);
  fmt::print("telemetry on:  {:8.1f} ns/op  (+{:.1f} ns/op, including step() every {} ops)\n", ns_on,
             ns_on - ns_off, per_step);
  return 0;
}
