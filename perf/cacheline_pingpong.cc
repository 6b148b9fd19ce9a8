// cacheline_pingpong: the price of handing one cache line between two cores, now.
// Two threads pinned to two CPUs take turns storing a counter and spinning until the
// other's store arrives; prints the mean round trip in ns. Every small collective pays
// such handoffs, and on a VM their price changes with where the host runs the vCPUs
// (46-70 ns and 520 ns on the same 2-vCPU VM on one day), so perf/compare prints it next
// to its latency table. Usage: cacheline_pingpong [rounds] [cpu_a] [cpu_b]
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace {

struct alignas(64) Line {
  std::atomic<long> value{0};
};
Line ping, pong;

bool pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const long rounds = argc > 1 ? std::atol(argv[1]) : 1000000;
  const int cpu_a = argc > 2 ? std::atoi(argv[2]) : 0;
  const int cpu_b = argc > 3 ? std::atoi(argv[3]) : 1;
  if (rounds <= 0) {
    std::fprintf(stderr, "usage: %s [rounds > 0] [cpu_a] [cpu_b]\n", argv[0]);
    return 2;
  }
  bool pinned_b = true;
  std::thread other([&] {
    pinned_b = pin(cpu_b);
    for (long i = 1; i <= rounds; ++i) {
      while (ping.value.load(std::memory_order_acquire) != i) {
      }
      pong.value.store(i, std::memory_order_release);
    }
  });
  const bool pinned_a = pin(cpu_a);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 1; i <= rounds; ++i) {
    ping.value.store(i, std::memory_order_release);
    while (pong.value.load(std::memory_order_acquire) != i) {
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  other.join();
  std::printf("%.1f ns per round trip (cpus %d and %d%s, %ld rounds)\n",
              std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(rounds), cpu_a,
              cpu_b, pinned_a && pinned_b ? "" : ", not pinned", rounds);
  return 0;
}
