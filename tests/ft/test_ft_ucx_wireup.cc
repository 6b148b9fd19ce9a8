// A member of a shrunk epoch is SIGKILLed in the middle of its UCX endpoint wireup.
// UCX 1.13 (Debian 12) can then abort a survivor inside UCX:
//   wireup_ep.c:241 Assertion 'wireup_ep->pending_count == 0' failed
// (docs/fault-tolerance.md, Known limits). The promise is that survivors always
// detect, shrink and continue, so this counts survivor crashes over many trials.
//
// One trial: 4 ranks, one per virtual node (CROSSBAR_RANKS_PER_NODE=1: every pair talks
// over UCX). Rank 3 is SIGKILLed in a collective loop; the others shrink to epoch 1
// (3 ranks), in whose setup old rank 1 (rank 1 of epoch 1) dies:
//   hook:  at the first `ucx handshake` interruption point (CROSSBAR_FT_TEST_EXIT_AT):
//          endpoints made (before: new ones, handshake messages posted, nothing
//          progressed yet; now: the kept ones, no handshake needed);
//   delay: `delay_us` after every member of epoch 1 published its UCX address (a thread
//          of the victim watches the store), i.e. (before) somewhere in the endpoints'
//          wireup, now anywhere from there to the end of the setup.
// Ranks 0 and 2 must fail within the detection bound, blame exactly that rank, shrink to
// 2 ranks in epoch 2 and compute correctly; only ranks 3 and 1 may die, of SIGKILL.
//
// Survivors now keep their UCX endpoints across a shrink, so no wireup runs between
// them (comm/ucx_context.h, "Kept workers"): 0 survivor aborts in 480 trials with UCX
// 1.13, against 24 before (docs/fault-tolerance.md). CI runs 10 trials (KillInWireup);
// the 20-trial stress stays disabled. Run it with
//   test_ft_ucx_wireup --gtest_also_run_disabled_tests --gtest_filter='*Stress*' [--gtest_repeat=N]
// 20 trials per repeat; one line per trial and the counts. A trial's survivors must
// finish within 30 s (a trial takes about 1 s); one still running then counts as hung.
//
// Joiner trials (JoinerKillInWireup, 10 in CI; DISABLED_JoinerStress, 20 per repeat):
// the victim is a replacement process admitted by grow(), killed in the middle of the
// members' connection to it. That connection cannot be skipped; with worker-address
// wireup UCX 1.13 aborted a member in about 1 trial in 10. Members now connect to the
// joiner client-server (comm/ucx_context.h, "Connecting"): no abort since. Compare with
// CROSSBAR_UCX_CONNECT=address (the old path) / listener.
#include <fmt/format.h>
#include <signal.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "ft_testing.h"

namespace crossbar::testing {
namespace {

using ft::FailureKind;
using ft::FaultTolerantComm;

constexpr Millis kDetect{3000};
constexpr Millis kSlack{2000};

enum class KillAt { kHook, kDelay };

struct TrialResult {
  int survivor_crashes = 0;   // survivors that died of a signal (the UCX assertion: SIGABRT)
  int survivor_hangs = 0;     // survivors still running at the run's timeout (killed by the harness)
  int survivor_failures = 0;  // survivors that finished with a failed check
  std::string summary;
};

// Store key of a rank's UCX address in an epoch (FT name "ft", the epoch's first context,
// its "ucx" transport: comm/ft.cc, comm/communicator.cc, comm/ucx_transport.cc).
std::string addressKey(uint64_t epoch, int rank) {
  return fmt::format("crossbar/ft/ft/e{}/ctx/crossbar/ctx1/ucx/ucx/addr/{}", epoch, rank);
}

// The victim's thread for the delay mode: once every member of `epoch` published its UCX
// address, waits `delay_us` and SIGKILLs this process (unless `done` came first).
std::thread killAfterAddresses(const RankEnv& env, uint64_t epoch, int members, int delay_us,
                               const std::atomic<bool>& done) {
  return std::thread([&env, &done, epoch, members, delay_us] {
    auto store = detectorStore(env);  // its own connection: the TCP client serializes calls
    std::vector<std::string> keys;
    for (int r = 0; r < members; ++r) keys.push_back(addressKey(epoch, r));
    while (!done.load() && !store->check(keys)) std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (done.load()) return;
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    ::kill(::getpid(), SIGKILL);
  });
}

// Sorts the ranks' results: the victims must have died of SIGKILL; a survivor that
// crashed (the UCX assertion: SIGABRT), hung or failed a check is counted and fails the test.
TrialResult judge(const std::vector<RankResult>& results, const std::vector<int>& victims, std::string what) {
  TrialResult out;
  std::string detail;
  for (const auto& r : results) {
    if (std::find(victims.begin(), victims.end(), r.rank) != victims.end()) {
      EXPECT_EQ(r.exit_code, -SIGKILL) << "rank " << r.rank << " should have been killed:\n" << r.failure;
      continue;
    }
    if (r.ok) continue;
    if (r.failure.find("did not finish") != std::string::npos) {
      ++out.survivor_hangs;
      detail += fmt::format(" rank {} hung;", r.rank);
    } else if (r.exit_code < 0) {
      ++out.survivor_crashes;
      detail +=
          fmt::format(" rank {} died of signal {} ({});", r.rank, -r.exit_code, strsignal(-r.exit_code));
    } else {
      ++out.survivor_failures;
    }
    ADD_FAILURE() << "survivor rank " << r.rank << " (exit " << r.exit_code << "):\n" << r.failure;
  }
  out.summary = fmt::format("{}: {}", what,
                            detail.empty() && out.survivor_failures == 0 ? std::string("survivors ok")
                            : detail.empty() ? std::string(" a survivor's check failed")
                                             : detail);
  return out;
}

std::string modeName(KillAt mode, int delay_us) {
  return mode == KillAt::kHook ? std::string("hook 'ucx handshake'") : fmt::format("delay {} us", delay_us);
}

TrialResult wireupTrial(KillAt mode, int delay_us, uint32_t seed) {
  const int n = 4, first = 3, second = 1;  // `second`: rank 1 in epochs 0 and 1
  RunOptions options;
  options.allow_rank_death = true;
  options.timeout = Millis(30'000);  // a trial takes about 1 s; longer is a hang
  options.env["CROSSBAR_FT_DETECT_TIMEOUT"] = fmt::format("{}ms", kDetect.count());
  options.env["CROSSBAR_CONNECT_TIMEOUT"] = "60s";
  options.env["CROSSBAR_RANKS_PER_NODE"] = "1";
  if (mode == KillAt::kHook)
    options.env["CROSSBAR_FT_TEST_EXIT_AT"] = fmt::format("1:{}:ucx handshake", second);
  auto results = runRanks(
      n,
      [&](RankEnv& env) {
        auto ft = FaultTolerantComm::create(env.store, env.rank, n, ftOptions(env));
        std::atomic<bool> done{false};
        std::thread killer;
        if (mode == KillAt::kDelay && env.rank == second)
          killer = killAfterAddresses(env, /*epoch=*/1, /*members=*/3, delay_us, done);
        auto coll = std::make_unique<Collectives>(ft->comm());
        for (int it = 0; it < 4; ++it) step(*coll, it, seed);
        if (!loseRankInCollectives(*ft, coll, env.rank, first, seed + 1)) return;
        // Epoch 1: rank 1 dies in its setup (or, late in the delay mode, in the first
        // collectives). The second attempt shrinks to ranks 0 and 2 in epoch 2.
        for (int attempt = 0;; ++attempt) {
          const int64_t t0 = monoNs();
          try {
            ft->shrink();
            // The kill must land in epoch 1: with the survivors' endpoints kept, its setup
            // and collectives can finish before the killer thread sees the addresses.
            if (mode == KillAt::kDelay && env.rank == second && killer.joinable()) killer.join();
            coll = std::make_unique<Collectives>(ft->comm());
            for (int it = 0; it < 4; ++it) step(*coll, it, seed + 2);
            break;
          } catch (const Error& e) {
            coll.reset();
            ASSERT_EQ(attempt, 0) << "unexpected second failure: " << e.what();
            expectDeathBlamed(*ft, e, second, t0, kDetect + kSlack);
          }
        }
        done = true;
        if (killer.joinable()) killer.join();
        // Ranks 0 and 2 only: the victim never gets here.
        EXPECT_EQ(ft->epoch(), 2u);
        EXPECT_EQ(ft->size(), 2);
        EXPECT_EQ(ft->rank(), env.rank == 0 ? 0 : 1);
        coll.reset();
        ft->comm()->barrier();
      },
      options, /*expect_ok=*/false);

  return judge(results, {first, second}, modeName(mode, delay_us));
}

// A replacement process is SIGKILLed in the middle of the UCX wireup of the epoch that
// admits it: the members make new endpoints to it (they keep theirs among themselves).
// 4 ranks, one per virtual node; rank 3 dies in a collective loop, ranks 0-2 shrink to
// epoch 1, then grow(4) admits the joiner (launcher rank 4) as rank 3 of epoch 2, which
// dies at its `ucx handshake` step (hook) or `delay_us` after every member of epoch 2
// published its UCX address (delay: in the wireup, or in epoch 2's first collectives).
// Ranks 0-2 must fail within the bound, blame the joiner, shrink to epoch 3 (3 ranks)
// and compute correctly.
TrialResult joinerTrial(KillAt mode, int delay_us, uint32_t seed) {
  const int n = 4, first = 3, joiner = 4;
  RunOptions options;
  options.allow_rank_death = true;
  options.timeout = Millis(30'000);
  options.env["CROSSBAR_FT_DETECT_TIMEOUT"] = fmt::format("{}ms", kDetect.count());
  options.env["CROSSBAR_CONNECT_TIMEOUT"] = "60s";
  options.env["CROSSBAR_RANKS_PER_NODE"] = "1";
  if (mode == KillAt::kHook) options.env["CROSSBAR_FT_TEST_EXIT_AT"] = "2:3:ucx handshake";
  auto results = runRanks(
      n + 1,
      [&](RankEnv& env) {
        if (env.rank == joiner) {
          std::atomic<bool> done{false};
          std::thread killer;
          if (mode == KillAt::kDelay)
            killer = killAfterAddresses(env, /*epoch=*/2, /*members=*/n, delay_us, done);
          try {
            auto ft = FaultTolerantComm::join(env.store, ftOptions(env));
            EXPECT_EQ(ft->epoch(), 2u);
            if (killer.joinable()) killer.join();  // the kill lands in epoch 2
          } catch (const Error& e) {
            ADD_FAILURE() << "join failed: " << e.what();
          }
          done = true;
          if (killer.joinable()) killer.join();
          ADD_FAILURE() << "the joiner should have been killed in epoch 2";
          return;
        }
        auto ft = FaultTolerantComm::create(env.store, env.rank, n, ftOptions(env));
        auto coll = std::make_unique<Collectives>(ft->comm());
        for (int it = 0; it < 4; ++it) step(*coll, it, seed);
        if (!loseRankInCollectives(*ft, coll, env.rank, first, seed + 1)) return;
        ft->shrink();
        coll = std::make_unique<Collectives>(ft->comm());
        for (int it = 0; it < 2; ++it) step(*coll, it, seed + 2);
        coll.reset();
        // Epoch 2 admits the joiner, which dies in its setup (grow() fails) or, late in the
        // delay mode, in the first collectives (they fail).
        const int64_t t0 = monoNs();
        try {
          ft->grow(n);
          coll = std::make_unique<Collectives>(ft->comm());
          for (int it = 0; it < 2000; ++it) step(*coll, it, seed + 3);
          ADD_FAILURE() << "no failure in epoch 2 after 2000 iterations";
          return;
        } catch (const Error& e) {
          coll.reset();
          expectDeathBlamed(*ft, e, /*victim=*/3, t0, kDetect + kSlack);
        }
        ft->shrink();
        EXPECT_EQ(ft->epoch(), 3u);
        EXPECT_EQ(ft->size(), 3);
        EXPECT_EQ(ft->rank(), env.rank);
        coll = std::make_unique<Collectives>(ft->comm());
        for (int it = 0; it < 4; ++it) step(*coll, it, seed + 4);
        coll.reset();
        ft->comm()->barrier();
      },
      options, /*expect_ok=*/false);
  return judge(results, {first, joiner}, "joiner, " + modeName(mode, delay_us));
}

using Trial = TrialResult (*)(KillAt mode, int delay_us, uint32_t seed);

// Runs `trials` trials, alternating the two modes (delays drawn from `seed`), and prints
// one line per trial and the counts.
void runTrials(Trial trial, int trials, uint32_t seed) {
  std::mt19937 rng(seed);
  int crashes = 0, crashed_trials = 0, hung_trials = 0, failed_trials = 0;
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  const char* connect = std::getenv("CROSSBAR_UCX_CONNECT");  // comm/ucx_context.h, "Connecting"
  const std::string ucx =
      fmt::format("UCX {}.{}.{}, connect {}", major, minor, release, connect && *connect ? connect : "auto");
  for (int t = 0; t < trials; ++t) {
    const KillAt mode = t % 2 == 0 ? KillAt::kHook : KillAt::kDelay;
    const int delay_us = static_cast<int>(rng() % 3000);
    SCOPED_TRACE(fmt::format("trial {}", t));
    TrialResult r = trial(mode, delay_us, seed + 10 * t);
    crashes += r.survivor_crashes;
    crashed_trials += r.survivor_crashes > 0;
    hung_trials += r.survivor_hangs > 0;
    failed_trials += r.survivor_failures > 0;
    fmt::print("wireup kill trial {} ({}): {}\n", t, ucx, r.summary);
  }
  fmt::print(
      "wireup kill trials ({}): {} trials, {} with a survivor crash ({} survivors), {} with a "
      "hung survivor, {} with a survivor's failed check\n",
      ucx, trials, crashed_trials, crashes, hung_trials, failed_trials);
  std::fflush(stdout);
}

// 10 trials (about 5 s): a survivor abort or failed check fails the test. Before the
// survivors kept their endpoints, about 1 trial in 20 aborted a survivor (UCX 1.13).
TEST(FtUcxWireup, KillInWireup) {
  runTrials(wireupTrial, 10, 500);
}

// test_ft_ucx_wireup --gtest_also_run_disabled_tests --gtest_filter='*Stress*' [--gtest_repeat=N]
TEST(FtUcxWireup, DISABLED_Stress) {
  static uint32_t repeat = 0;  // a new set of delays per --gtest_repeat
  runTrials(wireupTrial, 20, 1000 + 100 * repeat++);
}

// 10 joiner trials (about 3 s). With CROSSBAR_UCX_CONNECT=address (worker-address
// wireup with the joiner) UCX 1.13 aborts a member in about 1 trial in 10, so this fails
// in most runs; client-server (the default on fault-tolerant communicators) passes.
TEST(FtUcxWireup, JoinerKillInWireup) {
  runTrials(joinerTrial, 10, 700);
}

// The same, 20 trials per repeat (docs/fault-tolerance.md, "Joiners killed in their wireup"):
//   test_ft_ucx_wireup --gtest_also_run_disabled_tests --gtest_filter='*JoinerStress*'
TEST(FtUcxWireup, DISABLED_JoinerStress) {
  static uint32_t repeat = 0;
  runTrials(joinerTrial, 20, 5000 + 100 * repeat++);
}

}  // namespace
}  // namespace crossbar::testing
