// Communicator::splitMembers: members-only splits (what torch's new_group with
// use_local_synchronization needs). Only members call; groups are created in different
// orders on different ranks; the children share the parent's transports; traffic of
// siblings, repeats of one list and the parent stays apart; size 1; nested; errors.
#include <gtest/gtest.h>

#include <numeric>

#include "comm/communicator.h"
#include "comm/context.h"
#include "comm/errors.h"
#include "harness/multiprocess.h"
#include "ring_check.h"

using namespace crossbar;
using crossbar::testing::RankEnv;
using crossbar::testing::RunOptions;
using crossbar::testing::ring;
using crossbar::testing::runRanks;

namespace {

void expectMembers(const Communicator& c, const std::vector<int>& world_ranks, int world_rank) {
  ASSERT_EQ(c.size(), static_cast<int>(world_ranks.size())) << c.describe();
  for (int r = 0; r < c.size(); ++r) EXPECT_EQ(c.worldRank(r), world_ranks[r]) << c.describe();
  EXPECT_EQ(c.worldRank(c.rank()), world_rank) << c.describe();
}

}  // namespace

TEST(SplitMembers, DisjointAndOverlappingGroupsInDifferentOrders) {
  runRanks(4, [](RankEnv& env) {
    auto world = env.communicator();
    const int me = world->rank();
    // A = [0, 2], B = [3, 1] (new rank = position), C = [3, 0]: rank 0 makes C before A,
    // rank 3 makes B before C; rank 2 and rank 1 make only their own group.
    std::shared_ptr<Communicator> a, b, c;
    if (me == 0) {
      c = world->splitMembers({3, 0});
      a = world->splitMembers({0, 2});
    } else if (me == 1) {
      b = world->splitMembers({3, 1});
    } else if (me == 2) {
      a = world->splitMembers({0, 2});
    } else {
      b = world->splitMembers({3, 1});
      c = world->splitMembers({3, 0});
    }
    if (a) {
      expectMembers(*a, {0, 2}, me);
      EXPECT_EQ(a->rank(), me == 0 ? 0 : 1);
      EXPECT_EQ(&a->context(), &world->context()) << "a split must share the parent's transports";
    }
    if (b) {
      expectMembers(*b, {3, 1}, me);
      EXPECT_EQ(b->rank(), me == 3 ? 0 : 1);
    }
    if (c) expectMembers(*c, {3, 0}, me);
    if (a) {
      EXPECT_EQ(a->name(), "world.[0,2]");
    }

    // Same user tag on every communicator at once: nothing mixes.
    if (a) ring(*a, 100);
    if (b) ring(*b, 200);
    if (c) ring(*c, 300);
    ring(*world, 400);
    for (auto* g : {a.get(), b.get(), c.get()})
      if (g) g->barrier();
    world->barrier();
  });
}

TEST(SplitMembers, RepeatsSizeOneNestedAndNonMembers) {
  runRanks(4, [](RankEnv& env) {
    auto world = env.communicator();
    const int me = world->rank();
    EXPECT_EQ(world->splitMembers({(me + 1) % 4}), nullptr) << "non-members get no communicator";

    // Size one: no peer, but a working communicator.
    auto self = world->splitMembers({me});
    ASSERT_NE(self, nullptr);
    EXPECT_EQ(self->size(), 1);
    EXPECT_EQ(self->rank(), 0);
    self->barrier();

    if (me == 1) return;  // not in any group below
    // The same list twice: two communicators whose traffic stays apart.
    std::vector<int> list = {2, 0, 3};
    auto first = world->splitMembers(list);
    auto second = world->splitMembers(list);
    ASSERT_NE(first, nullptr);
    ASSERT_NE(second, nullptr);
    expectMembers(*first, {2, 0, 3}, me);
    expectMembers(*second, {2, 0, 3}, me);
    EXPECT_NE(first->name(), second->name());
    ring(*second, 2);  // the second one first: a message of `first` would be taken here
    ring(*first, 1);

    // Nested: a members-only split of a split, reversed; and of that, size one.
    if (me == 3) return;
    auto nested = first->splitMembers({1, 0});  // first's ranks 1, 0 = world 0, 2
    ASSERT_NE(nested, nullptr);
    expectMembers(*nested, {0, 2}, me);
    ring(*nested, 3);
    auto lone = nested->splitMembers({nested->rank()});
    ASSERT_NE(lone, nullptr);
    EXPECT_EQ(lone->size(), 1);
    EXPECT_EQ(lone->worldRank(0), me);
    nested->barrier();
  });
}

TEST(SplitMembers, BadListsAreRejected) {
  runRanks(2, [](RankEnv& env) {
    auto world = env.communicator();
    EXPECT_THROW(world->splitMembers({}), InvalidArgument);
    EXPECT_THROW(world->splitMembers({0, 0}), InvalidArgument);
    EXPECT_THROW(world->splitMembers({0, 2}), InvalidArgument);
    EXPECT_THROW(world->splitMembers({-1, 1}), InvalidArgument);
    world->barrier();
  });
}

TEST(SplitMembers, MissingFirstMemberTimesOutNamingIt) {
  CommOptions opts;
  opts.timeout = Millis(300);
  runRanks(2, [opts](RankEnv& env) {
    auto world = env.communicator(opts);
    if (world->rank() == 1) {
      try {
        world->splitMembers({0, 1});  // rank 0 never makes this split
        ADD_FAILURE() << "members-only split without its first member succeeded";
      } catch (const Timeout& e) {
        EXPECT_EQ(e.peers(), std::vector<int>{0});
        EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
      }
    }
    // Both leave once rank 1 is done (the world barrier would time out at 300 ms while
    // rank 1 waits, so use a store key).
    if (world->rank() == 1) env.store->set("done", "1");
    else env.store->get("done", Deadline::after(Millis(60'000)));
  });
}
