// The torch backend's host-side matching for CUDA receives from any source
// (torch_backend/p2p_announce.h), on CPU: senders announce, an any-source receive learns
// the sender (tags kept apart, every announcement taken once), receives naming the
// sender consume theirs, and size / order mismatches and timeouts are reported.
#include <gtest/gtest.h>

#include <set>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "harness/multiprocess.h"
#include "torch_backend/p2p_announce.h"

using namespace crossbar;
using crossbar::testing::RankEnv;
using crossbar::testing::runRanks;
using crossbar::torch_backend::P2pAnnouncer;

TEST(P2pAnnounce, AnySourceLearnsEverySenderOnce) {
  runRanks(4, [](RankEnv& env) {
    auto world = env.communicator();
    P2pAnnouncer a(world);
    const int me = world->rank();
    if (me == 0) {
      // Tag 3 from ranks 1..3 (two each), then tag 4 from rank 2: the any-source
      // receives of tag 3 see each of ranks 1..3 exactly twice, never tag 4's.
      std::multiset<int> senders;
      for (int i = 0; i < 6; ++i) senders.insert(a.awaitAnySource(3, 64, world->defaultDeadline()));
      EXPECT_EQ(senders, (std::multiset<int>{1, 1, 2, 2, 3, 3}));
      EXPECT_EQ(a.awaitAnySource(4, 8, world->defaultDeadline()), 2);
      // A receive naming the sender consumes its announcement; the check passes.
      auto r = a.expectFrom(3, 5, 16);
      r->wait(world->defaultDeadline());
      EXPECT_EQ(a.poll(), nullptr);
    } else {
      std::vector<RequestPtr> sends;
      sends.push_back(a.announceSend(0, 3, 64));
      sends.push_back(a.announceSend(0, 3, 64));
      if (me == 2) sends.push_back(a.announceSend(0, 4, 8));  // may arrive before rank 0's last tag 3 receive
      if (me == 3) sends.push_back(a.announceSend(0, 5, 16));
      world->waitAll(sends, world->defaultDeadline());
      EXPECT_EQ(a.poll(), nullptr);
    }
    world->barrier();
  });
}

TEST(P2pAnnounce, MixedTargetedAndAnySourceKeepOrder) {
  runRanks(2, [](RankEnv& env) {
    auto world = env.communicator();
    P2pAnnouncer a(world);
    if (world->rank() == 1) {
      for (int i = 0; i < 4; ++i) a.announceSend(0, 7, 32)->wait(world->defaultDeadline());
    } else {
      // Sends #0 and #2 by name, #1 and #3 from any source: the sequence check passes.
      auto first = a.expectFrom(1, 7, 32);
      EXPECT_EQ(a.awaitAnySource(7, 32, world->defaultDeadline()), 1);
      auto third = a.expectFrom(1, 7, 32);
      EXPECT_EQ(a.awaitAnySource(7, 32, world->defaultDeadline()), 1);
      world->waitAll({first, third}, world->defaultDeadline());
      EXPECT_EQ(a.poll(), nullptr);
    }
    world->barrier();
  });
}

TEST(P2pAnnounce, SizeAndOrderMismatchesAreReported) {
  runRanks(2, [](RankEnv& env) {
    auto world = env.communicator();
    P2pAnnouncer a(world);
    if (world->rank() == 1) {
      a.announceSend(0, 1, 100)->wait(world->defaultDeadline());
      a.announceSend(0, 2, 8)->wait(world->defaultDeadline());   // send #1, tag 2
      a.announceSend(0, 3, 8)->wait(world->defaultDeadline());   // send #2, tag 3
    } else {
      try {
        a.awaitAnySource(1, 96, world->defaultDeadline());
        ADD_FAILURE() << "a size mismatch was not reported";
      } catch (const InvalidUsage& e) {
        EXPECT_NE(std::string(e.what()).find("rank 1 sends 100 bytes"), std::string::npos) << e.what();
        EXPECT_EQ(e.peers(), std::vector<int>{1});
      }
      // Tag 3 asked first, but NCCL would pair this receive with send #1 (tag 2).
      auto r = a.expectFrom(1, 3, 8);
      r->wait(world->defaultDeadline());
      std::exception_ptr e = a.poll();
      ASSERT_NE(e, nullptr) << "an out-of-order receive was not reported";
      try {
        std::rethrow_exception(e);
      } catch (const InvalidUsage& err) {
        EXPECT_NE(std::string(err.what()).find("in the order it sent them"), std::string::npos) << err.what();
      }
    }
    world->barrier();
  });
}

TEST(P2pAnnounce, AnySourceTimesOutAndTheNextOneTakesOver) {
  CommOptions opts;
  opts.timeout = Millis(10'000);
  runRanks(2, [opts](RankEnv& env) {
    auto world = env.communicator(opts);
    P2pAnnouncer a(world);
    if (world->rank() == 0) {
      EXPECT_THROW(a.awaitAnySource(9, 4, Deadline::after(Millis(200))), Timeout);
      env.store->set("timed_out", "1");
      // The timed-out receive stays posted; the next any-source receive of the tag is it.
      EXPECT_EQ(a.awaitAnySource(9, 4, world->defaultDeadline()), 1);
    } else {
      env.store->get("timed_out", world->defaultDeadline());
      a.announceSend(0, 9, 4)->wait(world->defaultDeadline());
    }
    world->barrier();
  });
  EXPECT_FALSE(P2pAnnouncer::announces(-1));
  EXPECT_FALSE(P2pAnnouncer::announces(1 << 26));
  EXPECT_TRUE(P2pAnnouncer::announces((1 << 26) - 1));
}
