// NCCL communicators under fault tolerance (symmem/cuda/nccl_ft.h), CPU-visible logic:
// the rebuild plan, revoke on failure, ncclCommShrink with the dead rank excluded, the
// all-or-nothing fallback to ncclCommInitRankConfig, re-creation on grow, and the
// watchdog. NCCL itself is replaced by a fake NcclFtApi (no GPU here); the ranks, the
// FT communicator, the store and the failures are real.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>

#include "ft/ft_testing.h"
#include "symmem/cuda/nccl_ft.h"

namespace crossbar::testing {
namespace {

using cuda::NcclFtApi;
using cuda::NcclFtComm;
using cuda::NcclRebuildPlan;
using ft::FaultTolerantComm;

// ---- the plan (pure) ----------------------------------------------------------------

ft::EpochChange change(bool shrink, int old_size, std::vector<int> old_rank_of) {
  ft::EpochChange c;
  c.shrink = shrink;
  c.old_size = old_size;
  c.old_rank_of = old_rank_of;
  for (int r = 0; r < old_size; ++r)
    if (std::find(old_rank_of.begin(), old_rank_of.end(), r) == old_rank_of.end()) c.excluded.push_back(r);
  return c;
}

TEST(NcclFtPlan, ShrinkExcludesTheRanksThatLeft) {
  auto p = cuda::planNcclRebuild(change(true, 4, {0, 1, 3}), true, true);
  EXPECT_EQ(p.kind, NcclRebuildPlan::Kind::kShrink);
  EXPECT_EQ(p.exclude, (std::vector<int>{2}));
  p = cuda::planNcclRebuild(change(true, 8, {1, 2, 4, 5, 6}), true, true);
  EXPECT_EQ(p.exclude, (std::vector<int>{0, 3, 7}));
}

TEST(NcclFtPlan, EverythingElseReinitializes) {
  auto p = cuda::planNcclRebuild(change(false, 3, {0, 1, 2, -1}), true, true);
  EXPECT_EQ(p.kind, NcclRebuildPlan::Kind::kReinit);
  EXPECT_NE(p.reason.find("grew"), std::string::npos) << p.reason;
  p = cuda::planNcclRebuild(change(true, 4, {0, 1, 3}), false, true);
  EXPECT_EQ(p.kind, NcclRebuildPlan::Kind::kReinit);
  EXPECT_NE(p.reason.find("no parent"), std::string::npos) << p.reason;
  p = cuda::planNcclRebuild(change(true, 4, {0, 1, 3}), true, false);
  EXPECT_EQ(p.kind, NcclRebuildPlan::Kind::kReinit);
  EXPECT_NE(p.reason.find("unavailable"), std::string::npos) << p.reason;
  p = cuda::planNcclRebuild(change(true, 4, {1, 0}), true, true);
  EXPECT_EQ(p.kind, NcclRebuildPlan::Kind::kReinit);
}

// ---- a fake NCCL (one per process: ranks are forked) -------------------------------

struct FakeComm {
  int rank = 0, size = 0;
  uint64_t uid = 0;
  bool revoked = false, aborted = false;
  int polls_left = 2;  // getAsyncError says ncclInProgress this often first
};

struct FakeNccl {
  std::mutex mu;
  std::vector<std::unique_ptr<FakeComm>> comms;
  int inits = 0, shrinks = 0, revokes = 0, aborts = 0;
  std::vector<int> last_exclude;
  int last_flags = -1;
  bool fail_shrink = false;
  std::atomic<int> async_error{ncclSuccess};
  FakeComm* last = nullptr;

  static FakeComm* of(ncclComm_t c) { return reinterpret_cast<FakeComm*>(c); }
  ncclComm_t make(int rank, int size, uint64_t uid) {
    comms.push_back(std::make_unique<FakeComm>(FakeComm{rank, size, uid}));
    last = comms.back().get();
    return reinterpret_cast<ncclComm_t>(last);
  }

  NcclFtApi api() {
    NcclFtApi a;
    a.version = 22809;
    a.getUniqueId = [](ncclUniqueId* id) {
      std::memset(id, 0, sizeof(*id));
      uint64_t v = (uint64_t(::getpid()) << 20) ^ uint64_t(monoNs());
      std::memcpy(id->internal, &v, sizeof(v));
      return ncclSuccess;
    };
    a.initRankConfig = [this](ncclComm_t* c, int n, ncclUniqueId id, int r, ncclConfig_t* cfg) {
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_EQ(cfg->blocking, 0) << "fault tolerance needs nonblocking communicators";
      uint64_t v;
      std::memcpy(&v, id.internal, sizeof(v));
      ++inits;
      *c = make(r, n, v);
      return ncclInProgress;
    };
    a.shrink = [this](ncclComm_t parent, int* ex, int n, ncclComm_t* out, ncclConfig_t* cfg, int flags) {
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_EQ(cfg->blocking, 0);
      ++shrinks;
      last_exclude.assign(ex, ex + n);
      last_flags = flags;
      if (fail_shrink) return ncclInternalError;
      auto* p = of(parent);
      int below = static_cast<int>(std::count_if(ex, ex + n, [&](int e) { return e < p->rank; }));
      *out = make(p->rank - below, p->size - n, p->uid);
      return ncclSuccess;
    };
    a.revoke = [this](ncclComm_t c, int flags) {
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_EQ(flags, 0);
      ++revokes;
      of(c)->revoked = true;
      return ncclSuccess;
    };
    a.abort = [this](ncclComm_t c) {
      std::lock_guard<std::mutex> lock(mu);
      ++aborts;
      of(c)->aborted = true;
      return ncclSuccess;
    };
    a.getAsyncError = [this](ncclComm_t c, ncclResult_t* state) {
      std::lock_guard<std::mutex> lock(mu);
      auto* f = of(c);
      if (f->polls_left > 0) {
        --f->polls_left;
        *state = ncclInProgress;
      } else {
        *state = f == last ? static_cast<ncclResult_t>(async_error.load()) : ncclSuccess;
      }
      return ncclSuccess;
    };
    a.lastError = [](ncclComm_t) { return std::string("fake NCCL"); };
    return a;
  }
};

// allow_rank_death would also hide a hang (the harness kills it at the timeout):
// only `killed` may die, of SIGKILL; everyone else finishes cleanly.
void expectOutcome(const std::vector<RankResult>& results, int killed) {
  for (const auto& r : results) {
    if (r.rank == killed)
      EXPECT_EQ(r.exit_code, -SIGKILL) << "rank " << r.rank << ":\n" << r.failure;
    else
      EXPECT_TRUE(r.ok) << "rank " << r.rank << " (exit " << r.exit_code << "):\n" << r.failure;
  }
}

RunOptions ncclRun() {
  RunOptions o;
  o.allow_rank_death = true;
  o.timeout = Millis(60'000);
  o.env["CROSSBAR_FT_DETECT_TIMEOUT"] = "3000ms";
  return o;
}

cuda::NcclFtOptions fakeOptions() {
  cuda::NcclFtOptions o;
  o.timeout = Millis(30'000);
  return o;
}

// Runs collectives until the epoch fails; returns after handleError(). The first
// collective runs before anyone dies (see warmUp).
void untilFailure(FaultTolerantComm& ft, std::unique_ptr<Collectives> coll, uint32_t seed) {
  try {
    for (int it = 0; it < 100'000; ++it) step(*coll, it, seed);
    ADD_FAILURE() << "no failure reported";
  } catch (const Error& e) {
    ft.handleError(e);
  }
}

// One collective on every rank before a kill: a rank that dies before the first
// collective of a communicator leaves the others waiting in the call checker's
// symmetric-heap setup until CROSSBAR_TIMEOUT (not this test's subject).
std::unique_ptr<Collectives> warmUp(FaultTolerantComm& ft, uint32_t seed) {
  auto coll = std::make_unique<Collectives>(ft.comm());
  step(*coll, 0, seed);
  return coll;
}

// All members of an epoch must have made their NCCL communicator from the same id.
void expectSameId(RankEnv& env, FaultTolerantComm& ft, FakeNccl& fake, const std::string& what) {
  env.store->set(fmt::format("test/{}/uid/{}", what, ft.rank()), std::to_string(fake.last->uid));
  for (int r = 0; r < ft.size(); ++r)
    EXPECT_EQ(toString(env.store->get(fmt::format("test/{}/uid/{}", what, r))),
              std::to_string(fake.last->uid))
        << what << ": rank " << r << " used another unique id";
}

// 4 ranks: rank 2 dies; the survivors' NCCL communicator is revoked at detection and
// shrunk with rank 2 excluded (NCCL_SHRINK_ABORT); a replacement joins and everyone
// re-creates a 4-rank communicator from one unique id.
TEST(NcclFt, ShrinkExcludesDeadRankAndGrowRecreates) {
  const int n = 4, victim = 2;
  auto results = runRanks(
      n + 1,
      [&](RankEnv& env) {
        FakeNccl fake;
        if (env.rank == n) {  // the replacement
          auto ft = FaultTolerantComm::join(env.store, ftOptions(env));
          auto nccl = NcclFtComm::create(*ft, fakeOptions(), fake.api());
          EXPECT_EQ(nccl->size(), n);
          EXPECT_EQ(nccl->rank(), n - 1);
          expectSameId(env, *ft, fake, "grown");
          ft->comm()->barrier();
          return;
        }
        auto ft = FaultTolerantComm::create(env.store, env.rank, n, ftOptions(env));
        auto nccl = NcclFtComm::create(*ft, fakeOptions(), fake.api());
        EXPECT_EQ(nccl->lastRebuild(), "init");
        EXPECT_EQ(fake.inits, 1);
        expectSameId(env, *ft, fake, "initial");
        ncclComm_t parent = nccl->get();
        auto coll = warmUp(*ft, 21);
        if (env.rank == victim) ::kill(::getpid(), SIGKILL);

        untilFailure(*ft, std::move(coll), 21);
        EXPECT_TRUE(nccl->revoked());
        EXPECT_THROW(nccl->get(), InvalidUsage);
        EXPECT_EQ(fake.revokes, 1);
        EXPECT_TRUE(FakeNccl::of(parent)->revoked);
        EXPECT_EQ(fake.aborts, 0) << "revoked, not aborted: the shrink needs the parent";

        ft->shrink();
        EXPECT_EQ(nccl->lastRebuild(), "shrink");
        EXPECT_EQ(fake.shrinks, 1);
        EXPECT_EQ(fake.last_exclude, (std::vector<int>{victim}));
        EXPECT_EQ(fake.last_flags, NCCL_SHRINK_ABORT);
        EXPECT_TRUE(FakeNccl::of(parent)->aborted) << "the parent is released after the shrink";
        EXPECT_EQ(nccl->size(), n - 1);
        EXPECT_EQ(nccl->rank(), ft->rank());
        EXPECT_EQ(FakeNccl::of(nccl->get())->rank, ft->rank());
        EXPECT_EQ(nccl->epoch(), 1u);

        ft->grow(n);
        EXPECT_EQ(nccl->lastRebuild().rfind("reinit: the membership grew", 0), 0u) << nccl->lastRebuild();
        EXPECT_EQ(fake.inits, 2);
        EXPECT_EQ(nccl->size(), n);
        EXPECT_EQ(nccl->epoch(), 2u);
        expectSameId(env, *ft, fake, "grown");
        ft->comm()->barrier();
      },
      ncclRun(), /*expect_ok=*/false);
  expectOutcome(results, victim);
}

// ncclCommShrink fails on one survivor: every survivor falls back to re-creating the
// communicator (a mix of shrunk and re-created communicators would hang).
TEST(NcclFt, ShrinkFailureAnywhereFallsBackEverywhere) {
  const int n = 3, victim = 2;
  auto results = runRanks(
      n,
      [&](RankEnv& env) {
        FakeNccl fake;
        fake.fail_shrink = env.rank == 1;
        auto ft = FaultTolerantComm::create(env.store, env.rank, n, ftOptions(env));
        auto nccl = NcclFtComm::create(*ft, fakeOptions(), fake.api());
        auto coll = warmUp(*ft, 22);
        if (env.rank == victim) ::kill(::getpid(), SIGKILL);
        untilFailure(*ft, std::move(coll), 22);
        ft->shrink();
        EXPECT_EQ(nccl->lastRebuild().rfind("reinit: shrink failed", 0), 0u) << nccl->lastRebuild();
        EXPECT_EQ(fake.shrinks, 1);
        EXPECT_EQ(fake.inits, 2);
        EXPECT_EQ(nccl->size(), n - 1);
        expectSameId(env, *ft, fake, "fallback");
        ft->comm()->barrier();
      },
      ncclRun(), /*expect_ok=*/false);
  expectOutcome(results, victim);
}

// An NCCL without ncclCommRevoke / ncclCommShrink (the GPU machine's library reported 2.28
// and lacked ncclCommRevoke): detection aborts the NCCL communicator and the shrink
// re-creates it over the survivors.
TEST(NcclFt, WithoutRevokeAndShrinkAbortsAndRecreates) {
  const int n = 3, victim = 1;
  auto results = runRanks(
      n,
      [&](RankEnv& env) {
        FakeNccl fake;
        NcclFtApi api = fake.api();
        api.revoke = nullptr;
        api.shrink = nullptr;
        auto ft = FaultTolerantComm::create(env.store, env.rank, n, ftOptions(env));
        auto nccl = NcclFtComm::create(*ft, fakeOptions(), api);
        ncclComm_t parent = nccl->get();
        auto coll = warmUp(*ft, 23);
        if (env.rank == victim) ::kill(::getpid(), SIGKILL);
        untilFailure(*ft, std::move(coll), 23);
        EXPECT_TRUE(nccl->revoked());
        EXPECT_EQ(fake.revokes, 0);
        EXPECT_TRUE(FakeNccl::of(parent)->aborted) << "no revoke: the communicator is aborted at once";
        ft->shrink();
        EXPECT_EQ(nccl->lastRebuild().rfind("reinit:", 0), 0u) << nccl->lastRebuild();
        EXPECT_EQ(fake.shrinks, 0);
        EXPECT_EQ(fake.inits, 2);
        EXPECT_EQ(nccl->size(), n - 1);
        expectSameId(env, *ft, fake, "no-shrink");
        ft->comm()->barrier();
      },
      ncclRun(), /*expect_ok=*/false);
  expectOutcome(results, victim);
}

// An asynchronous NCCL error (polled by the watchdog) fails the epoch's crossbar
// operations with NcclError; handleError revokes for everyone and both ranks shrink
// (nobody is blamed: an NCCL error names no rank).
TEST(NcclFt, WatchdogTurnsAsyncErrorIntoNcclError) {
  auto results = runRanks(
      2,
      [&](RankEnv& env) {
        FakeNccl fake;
        auto ft = FaultTolerantComm::create(env.store, env.rank, 2, ftOptions(env));
        auto nccl = NcclFtComm::create(*ft, fakeOptions(), fake.api());
        ft->comm()->barrier();
        if (env.rank == 0) fake.async_error = ncclSystemError;
        std::vector<int32_t> buf(4);
        auto coll = std::make_unique<Collectives>(ft->comm());
        try {
          coll->recv(buf.data(), buf.size(), DataType::kInt32, 1 - env.rank, 9)->wait();  // nobody sends
          ADD_FAILURE() << "the NCCL error did not fail the wait";
        } catch (const Error& e) {
          if (env.rank == 0) {
            EXPECT_EQ(e.code(), ErrorCode::kNcclError) << e.what();
            EXPECT_NE(std::string(e.what()).find("fake NCCL"), std::string::npos) << e.what();
          }
          ft->handleError(e);
        }
        coll.reset();
        fake.async_error = ncclSuccess;
        ft->shrink();
        EXPECT_EQ(ft->size(), 2);
        EXPECT_EQ(nccl->lastRebuild(), "shrink");
        EXPECT_TRUE(fake.last_exclude.empty());
        ft->comm()->barrier();
      },
      ncclRun(), /*expect_ok=*/false);
  expectOutcome(results, -1);
}

}  // namespace
}  // namespace crossbar::testing
