// abort() of a split (split, dup, splitMembers) fails that communicator's pending and
// later operations, and the splits made from it, but not the transports it shares: the
// parent and the other splits keep working. abort() of the communicator that made the
// context still ends everything. Over shm (one node) and UCX (one rank per node).
#include <gtest/gtest.h>

#include <thread>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "harness/multiprocess.h"
#include "ring_check.h"

using namespace crossbar;
using crossbar::testing::RankEnv;
using crossbar::testing::RunOptions;
using crossbar::testing::ring;
using crossbar::testing::runRanks;

namespace {

constexpr uint32_t kTag = 7;

// A rendezvous-sized ring (above the eager limits), checking every element.
void bigRing(Communicator& c, int salt) {
  const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
  std::vector<int> out(1 << 18), in(out.size(), -1);
  for (size_t i = 0; i < out.size(); ++i) out[i] = salt + c.rank() * 7 + static_cast<int>(i);
  auto r = c.irecv(in.data(), in.size() * sizeof(int), prev, kTag + 1);
  auto s = c.isend(out.data(), out.size() * sizeof(int), next, kTag + 1);
  c.waitAll({r, s}, c.defaultDeadline());
  for (size_t i = 0; i < in.size(); i += 4099) ASSERT_EQ(in[i], salt + prev * 7 + static_cast<int>(i)) << i;
  ASSERT_EQ(in.back(), salt + prev * 7 + static_cast<int>(in.size() - 1));
}

class SplitAbort : public ::testing::TestWithParam<int> {};

}  // namespace

TEST_P(SplitAbort, AbortOfOneSplitLeavesParentAndSiblingsWorking) {
  RunOptions opts;
  opts.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(GetParam());
  runRanks(4, [](RankEnv& env) {
    CommOptions o;
    o.timeout = Millis(60'000);  // a wait that does not end at the abort fails the test by timing out
    auto world = env.communicator(o);
    const int me = world->rank();
    // A = [0, 1] and B = [2, 3] members only; C = every rank (collective split);
    // A2 = a split of A (aborted with A).
    auto a = world->splitMembers({0, 1});
    auto b = world->splitMembers({2, 3});
    auto c = world->split(0, 3 - me);
    std::shared_ptr<Communicator> a2 = a ? a->dup() : nullptr;
    ring(*world, 1);

    if (a) {
      // Pending on A: a small receive, a rendezvous-sized receive, a receive from any
      // rank, and one on A2; nobody sends them. Rank 0 aborts from another thread while
      // waiting; rank 1 aborts first and then waits.
      int small = -1;
      std::vector<int> big(1 << 18, -1);
      int any = -1, nested = -1;
      const int peer = 1 - a->rank();
      auto r_small = a->irecv(&small, sizeof small, peer, kTag);
      auto r_big = a->irecv(big.data(), big.size() * sizeof(int), peer, kTag + 1);
      auto r_any = a->irecv(&any, sizeof any, kAnySource, kTag + 2);
      auto r_nested = a2->irecv(&nested, sizeof nested, peer, kTag);
      std::thread aborter;
      if (me == 0) {
        aborter = std::thread([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          a->abort("test: abort split A");
        });
      } else {
        a->abort("test: abort split A");
        a->abort("a second abort is a no-op");
      }
      for (auto* r : {&r_small, &r_big, &r_any, &r_nested}) {
        try {
          (*r)->wait(Deadline::after(Millis(30'000)));
          ADD_FAILURE() << (*r)->what() << " completed on an aborted split";
        } catch (const Aborted& e) {
          EXPECT_NE(std::string(e.what()).find("test: abort split A"), std::string::npos) << e.what();
        }
      }
      if (aborter.joinable()) aborter.join();
      EXPECT_TRUE(a->aborted());
      EXPECT_TRUE(a2->aborted()) << "a split of an aborted split is aborted too";
      EXPECT_THROW(a->isend(&small, sizeof small, peer, kTag), Aborted);
      EXPECT_THROW(a2->irecv(&small, sizeof small, peer, kTag), Aborted);
      // A split of an aborted split: its first member makes it at once (born aborted), the
      // other one's wait for the id ends at the abort; both refuse.
      EXPECT_THROW(a->splitMembers({0, 1})->isend(&small, sizeof small, peer, kTag), Aborted);
      EXPECT_EQ(small, -1);
      EXPECT_EQ(big[0], -1);
      a->destroy();  // local: no goodbye barrier on an aborted split
    }
    // The parent, the sibling and the collective split all still work, with the same
    // tags the aborted split had pending.
    EXPECT_FALSE(world->aborted());
    EXPECT_FALSE(c->aborted());
    if (b) {
      EXPECT_FALSE(b->aborted());
      ring(*b, 2);
      bigRing(*b, 20);
    }
    ring(*world, 3);
    bigRing(*world, 30);
    ring(*c, 4);
    bigRing(*c, 40);
    int got = -1;
    if (me == 3) world->send(&me, sizeof me, 0, kTag + 2);
    if (me == 0) {
      Status st = world->recv(&got, sizeof got, kAnySource, kTag + 2);
      EXPECT_EQ(st.source, 3);
      EXPECT_EQ(got, 3);
    }
    world->barrier();
    c->barrier();
  }, opts);
}

TEST_P(SplitAbort, AbortOfTheContextsCommunicatorEndsEverySplit) {
  RunOptions opts;
  opts.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(GetParam());
  runRanks(2, [](RankEnv& env) {
    CommOptions o;
    o.timeout = Millis(60'000);
    auto world = env.communicator(o);
    auto s = world->splitMembers({0, 1});
    ring(*s, 1);
    int x = -1;
    auto r = s->irecv(&x, sizeof x, 1 - s->rank(), kTag);
    world->abort("test: abort the world");
    EXPECT_THROW(r->wait(Deadline::after(Millis(30'000))), Aborted);
    EXPECT_TRUE(s->aborted());
    EXPECT_TRUE(world->aborted());
    EXPECT_THROW(world->isend(&x, sizeof x, 1 - world->rank(), kTag), Aborted);
    // Stay until both ranks checked (a peer that exits early turns the failure into PeerFailure).
    env.store->add("checked", 1);
    const Deadline until = Deadline::after(Millis(30'000));
    while (env.store->add("checked", 0) < 2 && !until.expired())
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }, opts);
}

INSTANTIATE_TEST_SUITE_P(Transports, SplitAbort, ::testing::Values(4, 1),
                         [](const ::testing::TestParamInfo<int>& p) { return p.param == 4 ? "shm" : "ucx"; });
