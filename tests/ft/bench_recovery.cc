// Recovery benchmark: time from a rank's death (SIGKILL) to the first correct
// collective on the shrunk communicator, with 8 ranks on shared memory.
//   bench_recovery [--gtest_repeat=5]     (CROSSBAR_FT_* env vars apply)
// Prints, per trial, the slowest survivor's detect / shrink / first-allreduce times.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <thread>

#include "ft/ft_testing.h"

namespace crossbar::testing {
namespace {

TEST(BenchRecovery, KillToFirstCollective8) {
  constexpr int n = 8, victim = 5;
  RunOptions o;
  o.allow_rank_death = true;
  o.timeout = Millis(120'000);
  runRanks(
      n,
      [&](RankEnv& env) {
        auto ft = ft::FaultTolerantComm::create(env.store, env.rank, n, ftOptions(env));
        auto coll = std::make_unique<Collectives>(ft->comm());
        for (int it = 0; it < 4; ++it) step(*coll, it, 1);
        ft->comm()->barrier();
        if (env.rank == victim) {
          env.store->set("bench/killed_at", std::to_string(monoNs()));
          ::kill(::getpid(), SIGKILL);
        }
        int64_t detected = 0;
        try {
          for (int it = 0; it < 1'000'000; ++it) step(*coll, it % 2 ? 1 : 0, 2);  // small allreduce/alltoall
        } catch (const Error& e) {
          detected = monoNs();
          ft->handleError(e);
        }
        coll.reset();
        ft->shrink();
        const int64_t shrunk = monoNs();
        coll = std::make_unique<Collectives>(ft->comm());
        step(*coll, 0, 3);
        const int64_t done = monoNs();
        const int64_t killed = std::stoll(toString(env.store->get("bench/killed_at")));
        env.store->set(fmt::format("bench/t/{}", ft->rank()),
                       fmt::format("{} {} {}", detected - killed, shrunk - killed, done - killed));
        if (ft->rank() == 0) {
          int64_t d = 0, s = 0, f = 0;
          for (int r = 0; r < n - 1; ++r) {
            int64_t a, b, c;
            std::sscanf(toString(env.store->get(fmt::format("bench/t/{}", r))).c_str(), "%ld %ld %ld", &a, &b,
                        &c);
            d = std::max(d, a), s = std::max(s, b), f = std::max(f, c);
          }
          std::printf(
              "recovery (8 ranks, slowest survivor): detected %.1f ms, shrunk %.1f ms, "
              "first correct allreduce %.1f ms after the kill\n",
              d / 1e6, s / 1e6, f / 1e6);
          std::fflush(stdout);
        }
        coll.reset();
        ft->comm()->barrier();
      },
      o);
}

}  // namespace
}  // namespace crossbar::testing
