// The random kill trial of the fault-tolerance tests, over any verified workload: a random
// rank is SIGKILLed a random time into a random iteration; survivors must blame exactly it
// within the bound, shrink, run the workload correctly on the new epoch, and have released
// the dead rank's memory. test_ft runs it over collectives, test_ft_moe over MoE
// dispatch/combine.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ft/ft_testing.h"

namespace crossbar::testing {

constexpr Millis kDetect{3000};  // CROSSBAR_FT_DETECT_TIMEOUT in these tests
// Slack on top of the detection bound for a loaded machine.
constexpr Millis kSlack{15'000};

inline RunOptions ftRun(int detect_ms = 3000, bool deaths = true) {
  RunOptions o;
  o.allow_rank_death = deaths;
  o.timeout = Millis(120'000);
  o.env["CROSSBAR_FT_DETECT_TIMEOUT"] = fmt::format("{}ms", detect_ms);
  return o;
}

inline bool contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// allow_rank_death would also hide a crash: check that exactly `killed` died of SIGKILL
// and every other rank finished cleanly.
inline void expectOutcome(const std::vector<RankResult>& results, const std::vector<int>& killed) {
  for (const auto& r : results) {
    if (contains(killed, r.rank)) {
      EXPECT_EQ(r.exit_code, -SIGKILL) << "rank " << r.rank << " should have been killed:\n" << r.failure;
    } else {
      EXPECT_TRUE(r.ok) << "rank " << r.rank << " (exit " << r.exit_code << "):\n" << r.failure;
    }
  }
}

// What a trial repeats until a rank dies: one verified, collective step (it records a test
// failure on a wrong result and throws what the operation threw). Made again on each
// epoch's communicator, and destroyed before the communicator changes.
class Workload {
 public:
  virtual ~Workload() = default;
  virtual void step(int iter, uint32_t seed) = 0;
};
using MakeWorkload = std::function<std::unique_ptr<Workload>(std::shared_ptr<Communicator>)>;

// ft_testing.h's step(): allreduce / alltoall, eager and staged.
inline MakeWorkload collectivesWorkload() {
  struct Run : Workload {
    explicit Run(std::shared_ptr<Communicator> comm) : coll(std::move(comm)) {}
    void step(int iter, uint32_t seed) override { testing::step(coll, iter, seed); }
    Collectives coll;
  };
  return [](std::shared_ptr<Communicator> comm) { return std::make_unique<Run>(std::move(comm)); };
}

// shrink() and four verified steps on the new epoch. `setup_victim` (a rank of the next
// epoch, -1: none) is meant to die (or hang: `kind`) while that epoch is built or in its
// first steps (CROSSBAR_FT_TEST_EXIT_AT): that attempt must fail with PeerFailure
// (Timeout) within the detection bound (not at CROSSBAR_CONNECT_TIMEOUT), handleError()
// must blame exactly that rank, and a second shrink must then compute correctly. Leaves
// `work` null after a fatal failure.
inline void shrinkAndCompute(ft::FaultTolerantComm& ft, std::unique_ptr<Workload>& work,
                             const MakeWorkload& make, uint32_t seed, int setup_victim = -1,
                             ft::FailureKind kind = ft::FailureKind::kDead) {
  const uint64_t epoch0 = ft.epoch();
  work.reset();
  for (int attempt = 0;; ++attempt) {
    const int64_t t0 = monoNs();
    try {
      ft.shrink();
      work = make(ft.comm());
      for (int it = 0; it < 4; ++it) work->step(it, seed);
      break;
    } catch (const Error& e) {
      work.reset();
      ASSERT_TRUE(setup_victim >= 0 && attempt == 0)
          << "unexpected failure (attempt " << attempt << "): " << e.what();
      EXPECT_EQ(ft.epoch(), epoch0 + 1) << e.what();
      const ErrorCode code = kind == ft::FailureKind::kDead ? ErrorCode::kPeerFailure : ErrorCode::kTimeout;
      EXPECT_TRUE(e.code() == code || e.code() == ErrorCode::kAborted) << e.what();
      EXPECT_LT(monoNs() - t0, (kDetect + kSlack).count() * 1'000'000LL)
          << "waited too long for the member that failed while epoch " << epoch0 + 1
          << " was built: " << e.what();
      auto faults = ft.handleError(e);
      ASSERT_EQ(faults.size(), 1u) << e.what();
      EXPECT_EQ(faults[0].rank, setup_victim) << faults[0].describe();
      EXPECT_EQ(faults[0].kind, kind) << faults[0].describe();
    }
  }
  EXPECT_EQ(ft.epoch(), epoch0 + (setup_victim >= 0 ? 2 : 1));
}

struct KillTrial {
  int ranks = 4;
  uint32_t seed = 1;
  int ranks_per_node = 0;  // > 0: virtual nodes, so peers on other nodes are reached (and lost) over UCX
  std::string algo = {};   // CROSSBAR_ALGO
  MakeWorkload workload = collectivesWorkload();
  // Steps that may not complete before the first failure (a long step, e.g. MoE, gives
  // the kill fewer chances to land in a step than in the gap between two).
  int max_iterations = 2000;
};

// In about a third of the trials a second rank dies in the middle of building the shrunk
// communicator, at a random named setup step (CROSSBAR_FT_TEST_EXIT_AT); the others then
// shrink again (shrinkAndCompute).
inline void killTrial(const KillTrial& trial) {
  const int n = trial.ranks, ranks_per_node = trial.ranks_per_node;
  const uint32_t seed = trial.seed;
  std::mt19937 rng(seed);
  const int victim = static_cast<int>(rng() % n);
  const int kill_iter = 2 + static_cast<int>(rng() % 6);
  const int delay_us = static_cast<int>(rng() % 3000);
  // The second death: a rank of epoch 1 (n - 1 ranks) at a step it reaches.
  int setup_victim = -1;
  std::string setup_step;
  if (rng() % 3 == 0) {
    const int m = n - 1, rpn = ranks_per_node > 0 ? ranks_per_node : m;
    setup_victim = static_cast<int>(rng() % m);
    std::vector<std::string> steps = {"rankinfo/"};
    const bool lower = setup_victim % rpn > 0, higher = setup_victim % rpn < rpn - 1 && setup_victim + 1 < m;
    if (lower || higher) steps.push_back("shm/nonce");
    if (lower) steps.push_back("unix connect");
    if (higher) steps.push_back("unix accept");
    if (rpn < m) {
      steps.push_back("ucx/addr");
      steps.push_back("ucx handshake");  // survivors' endpoints are kept: no wireup to interrupt
    }
    setup_step = steps[rng() % steps.size()];
  }
  const int setup_victim_old = setup_victim < 0        ? -1
                               : setup_victim < victim ? setup_victim
                                                       : setup_victim + 1;
  SCOPED_TRACE(fmt::format("{} ranks ({} per node), seed {}: rank {} dies in iteration {} after {} us{}", n,
                           ranks_per_node, seed, victim, kill_iter, delay_us,
                           setup_victim < 0
                               ? std::string()
                               : fmt::format(", then rank {} of epoch 1 (old {}) at setup step '{}'",
                                             setup_victim, setup_victim_old, setup_step)));
  auto options = ftRun();
  if (ranks_per_node > 0) options.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(ranks_per_node);
  if (!trial.algo.empty()) options.env["CROSSBAR_ALGO"] = trial.algo;
  if (setup_victim >= 0)
    options.env["CROSSBAR_FT_TEST_EXIT_AT"] = fmt::format("1:{}:{}", setup_victim, setup_step);
  auto results = runRanks(
      n,
      [&](RankEnv& env) {
        auto ft = ft::FaultTolerantComm::create(env.store, env.rank, n, ftOptions(env));
        auto work = trial.workload(ft->comm());
        // Baseline after every kind of step ran once (small collectives use the eager
        // slots, larger ones the staging heap, each created on first use).
        for (int it = 0; it < 4; ++it) work->step(it, seed);
        const int maps0 = countShmMaps(), fds0 = countFds();
        const int local0 = ft->comm()->localSize();
        std::thread killer;
        try {
          for (int it = 1; it < trial.max_iterations; ++it) {
            if (env.rank == victim && it == kill_iter) {
              killer = std::thread([&] {
                std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
                env.store->set("test/killed_at", std::to_string(monoNs()));
                ::kill(::getpid(), SIGKILL);
              });
            }
            work->step(it, seed);
          }
          ADD_FAILURE() << "rank " << env.rank << ": no failure after " << trial.max_iterations
                        << " iterations";
          if (killer.joinable()) killer.join();
          return;
        } catch (const Error& e) {
          // The operation's own error may name a survivor that tore down first (a
          // cascade); what the detector reports must name exactly the dead rank.
          EXPECT_TRUE(e.code() == ErrorCode::kPeerFailure || e.code() == ErrorCode::kAborted) << e.what();
          auto faults = ft->handleError(e);
          const int64_t seen = monoNs();
          auto killed = std::stoll(toString(env.store->get("test/killed_at", Deadline::after(kSlack))));
          EXPECT_LT(seen - killed, (kDetect + kSlack).count() * 1'000'000LL) << "detection took too long";
          ASSERT_EQ(faults.size(), 1u) << e.what();
          EXPECT_EQ(faults[0].rank, victim) << faults[0].describe();
          EXPECT_EQ(faults[0].kind, ft::FailureKind::kDead) << faults[0].describe();
          EXPECT_NE(faults[0].describe().find(fmt::format("rank {} (host", victim)), std::string::npos);
        }
        shrinkAndCompute(*ft, work, trial.workload, seed + 1, setup_victim);
        if (!work) return;
        const int rank1 = env.rank < victim ? env.rank : env.rank - 1;  // in epoch 1
        EXPECT_EQ(ft->size(), setup_victim < 0 ? n - 1 : n - 2);
        EXPECT_EQ(ft->rank(), setup_victim < 0 || rank1 < setup_victim ? rank1 : rank1 - 1);
        // The dead peers' segments and sockets are gone with the old epoch's context.
        // (Virtual nodes are consecutive ranks, so renumbering can move ranks between them.)
        if (ft->comm()->localSize() < local0) {
          EXPECT_LT(countShmMaps(), maps0);
          EXPECT_LT(countFds(), fds0);
        } else {
          EXPECT_LE(countShmMaps(), maps0);
          EXPECT_LE(countFds(), fds0);
        }
        work.reset();
        ft->comm()->barrier();
      },
      options, /*expect_ok=*/false);
  if (setup_victim < 0)
    expectOutcome(results, {victim});
  else
    expectOutcome(results, {victim, setup_victim_old});
}

}  // namespace crossbar::testing
