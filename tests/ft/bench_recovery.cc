// Recovery benchmark: time from a rank's death (SIGKILL) to the first correct step on the
// shrunk communicator, 8 ranks: a collective on shared memory (one node), and a MoE
// dispatch + combine over 4 virtual nodes of 2 (new MoE buffers on the shrunk
// communicator included).
//   bench_recovery [--gtest_repeat=5] [--gtest_filter=*Moe*]   (CROSSBAR_FT_* env vars apply)
// Prints, per trial, the slowest survivor's detect / shrink / first-step times.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <thread>

#include "ft/kill_trial.h"
#ifdef CROSSBAR_BENCH_MOE
#include "ft/moe_workload.h"
#endif

namespace crossbar::testing {
namespace {

// Rank 5 of 8 dies while every rank runs `make`'s steps; rank 0 prints the slowest
// survivor's times after the kill.
void benchRecovery(const MakeWorkload& make, const char* what, int ranks_per_node) {
  constexpr int n = 8, victim = 5;
  RunOptions o;
  o.allow_rank_death = true;
  o.timeout = Millis(120'000);
  if (ranks_per_node > 0) o.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(ranks_per_node);
  runRanks(
      n,
      [&](RankEnv& env) {
        auto ft = ft::FaultTolerantComm::create(env.store, env.rank, n, ftOptions(env));
        auto work = make(ft->comm());
        for (int it = 0; it < 4; ++it) work->step(it, 1);
        ft->comm()->barrier();
        if (env.rank == victim) {
          env.store->set("bench/killed_at", std::to_string(monoNs()));
          ::kill(::getpid(), SIGKILL);
        }
        int64_t detected = 0;
        try {
          for (int it = 0; it < 1'000'000; ++it) work->step(it % 2 ? 1 : 0, 2);  // small steps
        } catch (const Error& e) {
          detected = monoNs();
          ft->handleError(e);
        }
        work.reset();
        ft->shrink();
        const int64_t shrunk = monoNs();
        work = make(ft->comm());
        work->step(0, 3);
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
              "first correct %s %.1f ms after the kill\n",
              d / 1e6, s / 1e6, what, f / 1e6);
          std::fflush(stdout);
        }
        work.reset();
        ft->comm()->barrier();
      },
      o);
}

TEST(BenchRecovery, KillToFirstCollective8) {
  benchRecovery(collectivesWorkload(), "allreduce", 0);
}

#ifdef CROSSBAR_BENCH_MOE
TEST(BenchRecovery, KillToFirstMoeStep8) {
  benchRecovery(moeWorkload(), "MoE dispatch+combine (4 nodes x 2)", 2);
}
#endif

}  // namespace
}  // namespace crossbar::testing
