// Overhead of telemetry on real collectives: a tight loop of small allreduces on N
// self-launched ranks, alternating telemetry off and on (step() every --ops-per-step
// ops, lines written to a temporary directory), several rounds; rank 0 prints the median
// time per allreduce of each and the difference. Not a test: timings need a quiet machine.
//
//   bench_telemetry_coll [--nranks 2] [--iters 20000] [--count 16] [--ops-per-step 100] [--rounds 5]
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "comm/local_launch.h"
#include "telemetry/telemetry.h"

using namespace crossbar;
namespace tel = crossbar::telemetry;

namespace {

struct Args {
  int nranks = 2;
  long iters = 20000;
  size_t count = 16;  // floats per allreduce (64 bytes)
  long ops_per_step = 100;
  int rounds = 5;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto val = [&]() -> const char* {
      if (i + 1 >= argc) {
        fmt::print(stderr, "{} needs a value\n", k);
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--nranks")
      a.nranks = std::atoi(val());
    else if (k == "--iters")
      a.iters = std::atol(val());
    else if (k == "--count")
      a.count = std::strtoull(val(), nullptr, 10);
    else if (k == "--ops-per-step")
      a.ops_per_step = std::max(1L, std::atol(val()));
    else if (k == "--rounds")
      a.rounds = std::max(1, std::atoi(val()));
    else {
      fmt::print(stderr,
                 "usage: {} [--nranks N] [--iters N] [--count floats] [--ops-per-step N] [--rounds N]\n",
                 argv[0]);
      std::exit(2);
    }
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("crossbar-bench-tel-{}", getpid());
  auto exits = launchLocalRanks(a.nranks, [&](int rank, int size, std::shared_ptr<Store> store) {
    auto comm = Communicator::create(store, rank, size);
    Collectives coll(comm);
    std::vector<float> buf(a.count, 1.0f);
    auto loop = [&](bool on) {
      tel::Config c;
      c.enabled = on;
      c.rank = rank;
      c.world_size = size;
      c.dir = on ? dir.string() : "";
      tel::Recorder::instance().configure(c);
      coll.barrier()->wait();
      const int64_t t0 = tel::nowNs();
      for (long i = 0; i < a.iters; ++i) {
        coll.allreduce(buf.data(), buf.data(), a.count, DataType::kFloat32, ReduceOp::kMax)->wait();
        if (on && (i + 1) % a.ops_per_step == 0) tel::Recorder::instance().step();
      }
      coll.barrier()->wait();
      return double(tel::nowNs() - t0) / double(a.iters);
    };
    loop(false);  // warm-up: connections, staging buffers
    std::vector<double> off, on;
    for (int r = 0; r < a.rounds; ++r) {
      off.push_back(loop(false));
      on.push_back(loop(true));
    }
    tel::Recorder::instance().configure(tel::Config{});
    if (rank == 0) {
      double o = median(off), n = median(on);
      fmt::print("{} ranks, {} x allreduce of {} bytes per round, step() every {} ops, {} rounds (median)\n",
                 size, a.iters, a.count * sizeof(float), a.ops_per_step, a.rounds);
      fmt::print("telemetry off: {:9.0f} ns/allreduce\n", o);
      fmt::print("telemetry on:  {:9.0f} ns/allreduce  ({:+.0f} ns, {:+.2f}% of the op)\n", n, n - o,
                 100.0 * (n - o) / o);
    }
    comm->destroy();
    return 0;
  });
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return combinedExitCode(exits);
}
