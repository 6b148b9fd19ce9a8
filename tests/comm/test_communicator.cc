// Communicator over the real transports: creation, topology, p2p through both
// transports (virtual nodes), split/dup, barrier, deadlines and abort.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <numeric>
#include <thread>

#include "comm/communicator.h"
#include "comm/context.h"
#include "comm/errors.h"
#include "harness/multiprocess.h"

using namespace crossbar;
using crossbar::testing::RankEnv;
using crossbar::testing::RunOptions;
using crossbar::testing::runRanks;

namespace {

// Verifiable payload: word i of a message from `src` to `dst` with `tag`.
uint32_t word(int src, int dst, uint32_t tag, size_t i) {
  return static_cast<uint32_t>(src * 1000003u + dst * 7919u + tag * 104729u + i * 2654435761u);
}

void allPairs(Communicator& c, size_t words, uint32_t tag) {
  const int n = c.size(), me = c.rank();
  std::vector<std::vector<uint32_t>> out(n), in(n);
  std::vector<RequestPtr> reqs;
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    in[p].assign(words, 0);
    out[p].resize(words);
    for (size_t i = 0; i < words; ++i) out[p][i] = word(me, p, tag, i);
    reqs.push_back(c.irecv(in[p].data(), words * 4, p, tag));
  }
  for (int p = 0; p < n; ++p)
    if (p != me) reqs.push_back(c.isend(out[p].data(), words * 4, p, tag));
  c.waitAll(reqs, c.defaultDeadline());
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    for (size_t i = 0; i < words; ++i) {
      ASSERT_EQ(in[p][i], word(p, me, tag, i)) << "from rank " << p << " word " << i;
    }
  }
}

class CommSizes : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(CommSizes, CreateAndExchange) {
  auto [size, ranks_per_node] = GetParam();
  RunOptions opts;
  opts.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(ranks_per_node);
  runRanks(size, [&, rpn = ranks_per_node](RankEnv& env) {
    auto c = env.communicator();
    EXPECT_EQ(c->size(), env.size);
    EXPECT_EQ(c->rank(), env.rank);
    if (rpn > 0) {
      EXPECT_EQ(c->numNodes(), (env.size + rpn - 1) / rpn);
      EXPECT_EQ(c->node(), env.rank / rpn);
      EXPECT_EQ(c->localRank(), env.rank % rpn);
      const auto nodes = c->nodes();
      ASSERT_EQ(static_cast<int>(nodes.size()), c->numNodes());
      for (size_t m = 0; m < nodes.size(); ++m)
        for (size_t l = 0; l < nodes[m].size(); ++l)
          EXPECT_EQ(nodes[m][l], static_cast<int>(m) * rpn + static_cast<int>(l));
      EXPECT_EQ(nodes[c->node()], c->nodePeers(env.rank));
      for (int p = 0; p < env.size; ++p) {
        if (p == env.rank) continue;
        std::string expected = (p / rpn == env.rank / rpn) ? "shm" : "ucx";
        EXPECT_EQ(c->context().transportName(p), expected) << "peer " << p;
      }
    }
    for (size_t words : {size_t{0}, size_t{1}, size_t{1023}, size_t{300000}}) allPairs(*c, words, 5);
    c->barrier();
    c->destroy();
  }, opts);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommSizes,
                         ::testing::Values(std::make_tuple(2, 0), std::make_tuple(4, 0),
                                           std::make_tuple(8, 0), std::make_tuple(2, 1),
                                           std::make_tuple(4, 2), std::make_tuple(8, 4),
                                           std::make_tuple(5, 2)),  // nodes of 2, 2 and 1
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_rpn" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(Communicator, SplitAndDup) {
  runRanks(6, [](RankEnv& env) {
    auto world = env.communicator();
    // Evens and odds, ordered by descending old rank.
    auto half = world->split(env.rank % 2, -env.rank);
    ASSERT_TRUE(half);
    EXPECT_EQ(half->size(), 3);
    std::vector<int> expected_members;
    for (int r = 5; r >= 0; --r)
      if (r % 2 == env.rank % 2) expected_members.push_back(r);
    EXPECT_EQ(half->worldRank(half->rank()), env.rank);
    EXPECT_EQ(expected_members[half->rank()], env.rank);
    allPairs(*half, 1000, 9);
    // Traffic with the same user tag on world and on the split must not mix.
    allPairs(*world, 1000, 9);
    auto d = world->dup();
    EXPECT_EQ(d->rank(), world->rank());
    allPairs(*d, 100, 9);
    // Non-members get nullptr.
    auto some = world->split(env.rank < 2 ? 0 : -1, 0);
    EXPECT_EQ(some == nullptr, env.rank >= 2);
    if (some) allPairs(*some, 10, 1);
    world->barrier();
  });
}

// Threads splitting several communicators at once (torch's process groups, the
// hierarchical collectives of duplicated communicators): each split waits on the store
// for the others' entries, so one thread's parked get must not hold up the entries of
// another thread of the same process. With one store connection per process they waited
// on each other across processes (the soak's stalls; here: seconds per round, or the
// timeout below).
TEST(Communicator, ThreadsSplitSeveralCommunicatorsAtOnce) {
  runRanks(4, [](RankEnv& env) {
    CommOptions o;
    o.timeout = Millis(20'000);
    auto world = env.communicator(o);
    constexpr int kThreads = 3, kRounds = 15;
    std::vector<std::shared_ptr<Communicator>> dups;
    for (int t = 0; t < kThreads; ++t) dups.push_back(world->dup());
    std::vector<std::string> errors(kThreads);
    std::vector<std::thread> threads;
    const auto t0 = Clock::now();
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        try {
          for (int i = 0; i < kRounds; ++i) {
            // Ranks reach each round at different times: some park in get, some set.
            if ((env.rank + t + i) % 3 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
            auto half = dups[t]->split(env.rank % 2, env.rank);
            ASSERT_EQ(half->size(), 2);
            allPairs(*half, 1, 3);
            half->destroy();
          }
        } catch (const std::exception& e) {
          errors[t] = e.what();
        }
      });
    for (auto& th : threads) th.join();
    for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
    if (env.rank == 0)
      std::printf("%d threads x %d splits: %.0f ms\n", kThreads, kRounds,
                  std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    for (auto& d : dups) d->destroy();
    world->barrier();
  });
}

// Virtual nodes split one machine: localRank/localSize are per node, machineLocalRank/
// machineLocalSize count every rank of the communicator on the machine (what core binding
// and the spin-or-yield choice need); a split counts its own members only.
TEST(Communicator, MachineLocalRanksWithVirtualNodes) {
  crossbar::testing::RunOptions opts;
  opts.env["CROSSBAR_RANKS_PER_NODE"] = "2";
  runRanks(
      4,
      [](RankEnv& env) {
        auto world = env.communicator();
        EXPECT_EQ(world->numNodes(), 2);
        EXPECT_EQ(world->localRank(), env.rank % 2);
        EXPECT_EQ(world->localSize(), 2);
        EXPECT_EQ(world->machineLocalRank(), env.rank);
        EXPECT_EQ(world->machineLocalSize(), 4);
        auto odd_first = world->split(0, env.rank % 2 == 1 ? env.rank : 10 + env.rank);  // 1, 3, 0, 2
        const int expected[] = {2, 0, 3, 1};
        EXPECT_EQ(odd_first->machineLocalRank(), expected[env.rank]);
        EXPECT_EQ(odd_first->machineLocalSize(), 4);
        auto some = world->split(env.rank < 3 ? 0 : -1, 0);
        if (some) {
          EXPECT_EQ(some->machineLocalRank(), env.rank);
          EXPECT_EQ(some->machineLocalSize(), 3);
        }
        world->barrier();
      },
      opts);
}

TEST(Communicator, ManyBarriersMoreRanksThanCores) {
  runRanks(8, [](RankEnv& env) {
    auto c = env.communicator();
    auto t0 = Clock::now();
    for (int i = 0; i < 200; ++i) c->barrier();
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    // Not a pass/fail timing target; recorded for the log.
    if (env.rank == 0) std::printf("200 barriers, 8 ranks: %.1f ms\n", ms);
  });
}

TEST(Communicator, BarrierTimeoutNamesMissingPeer) {
  runRanks(3, [](RankEnv& env) {
    CommOptions o;
    o.timeout = Millis(1500);
    auto c = env.communicator(o);
    if (env.rank == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // never arrives in time
      return;
    }
    auto t0 = Clock::now();
    try {
      c->barrier();
      ADD_FAILURE() << "barrier without rank 2 succeeded";
    } catch (const Timeout& e) {
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      EXPECT_LT(s, 5.0);
      EXPECT_NE(std::string(e.what()).find("rank"), std::string::npos) << e.what();
    }
  });
}

TEST(Communicator, RecvTimeoutNamesPeer) {
  runRanks(2, [](RankEnv& env) {
    CommOptions o;
    o.timeout = Millis(800);
    auto c = env.communicator(o);
    if (env.rank == 0) {
      int x = 0;
      auto t0 = Clock::now();
      EXPECT_THROW(c->recv(&x, sizeof(x), 1, 3), Timeout);
      EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 4.0);
    } else {
      // Stay alive (silent): a live peer that never sends is a timeout, not a failure.
      std::this_thread::sleep_for(std::chrono::milliseconds(2000));
    }
  });
}

TEST(Communicator, KilledPeerIsAnErrorNotAHang) {
  RunOptions opts;
  opts.allow_rank_death = true;
  opts.env["CROSSBAR_RANKS_PER_NODE"] = "2";  // rank 0-1 shm, 0-2 UCX
  runRanks(4, [](RankEnv& env) {
    CommOptions o;
    o.timeout = Millis(10'000);
    auto c = env.communicator(o);
    c->barrier();
    if (env.rank == 1 || env.rank == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      kill(getpid(), SIGKILL);
    }
    if (env.rank == 0) {
      for (int peer : {1, 2}) {
        std::vector<char> buf(1 << 20);
        auto t0 = Clock::now();
        try {
          c->recv(buf.data(), buf.size(), peer, 4);
          ADD_FAILURE() << "recv from killed rank " << peer << " succeeded";
        } catch (const PeerFailure&) {
        } catch (const Timeout&) {
        }
        EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 12.0) << "peer " << peer;
      }
    }
  }, opts);
}

TEST(Communicator, AbortFailsPendingAndIsIdempotent) {
  runRanks(2, [](RankEnv& env) {
    auto c = env.communicator();
    if (env.rank == 0) {
      int x = 0;
      auto req = c->irecv(&x, sizeof(x), 1, 11);
      std::thread watchdog([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        c->abort("test watchdog");
        c->abort("second call");
      });
      EXPECT_THROW(req->wait(Deadline::after(Millis(5000))), Aborted);
      watchdog.join();
      EXPECT_TRUE(c->aborted());
      EXPECT_THROW(c->isend(&x, sizeof(x), 1, 1), Aborted);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    }
  });
}

TEST(Communicator, AbortEndsSplitWaitingForAPeer) {
  // split() waits on the store for every rank's color; a peer that died before calling
  // it used to hold the others until the full timeout (300 s) despite an abort.
  runRanks(2, [](RankEnv& env) {
    CommOptions o;
    o.timeout = Millis(60'000);
    auto c = env.communicator(o);
    if (env.rank == 0) {
      std::thread watchdog([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        c->abort("test watchdog");
      });
      auto t0 = Clock::now();
      try {
        c->split(0, 0);
        ADD_FAILURE() << "split without rank 1 succeeded";
      } catch (const Aborted& e) {
        EXPECT_NE(std::string(e.what()).find("rank 1's split()"), std::string::npos) << e.what();
      }
      EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0);
      watchdog.join();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // never calls split
    }
  });
}

TEST(Communicator, BadArguments) {
  runRanks(2, [](RankEnv& env) {
    auto c = env.communicator();
    int x = 0;
    EXPECT_THROW(c->isend(&x, 4, 2, 0), InvalidArgument);
    EXPECT_THROW(c->isend(&x, 4, -3, 0), InvalidArgument);
    EXPECT_THROW(c->isend(nullptr, 4, 1 - env.rank, 0), InvalidArgument);
    EXPECT_THROW(c->isend(&x, 4, env.rank, 0), InvalidUsage);
    c->barrier();
  });
}

}  // namespace
