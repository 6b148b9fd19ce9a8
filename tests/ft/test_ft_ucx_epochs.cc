// Survivors of a shrink keep their UCX worker and endpoints (comm/ucx_context.h, "Kept
// workers"): no new wireup between them, so a member dying in the next epoch's setup
// cannot catch UCX in the middle of one (docs/fault-tolerance.md, "UCX versions and
// the wireup abort"). Messages of an old epoch that were never received stay in the kept worker's
// unexpected queue; each epoch's messages carry wire ids no earlier epoch used, so such a
// message can never be taken by a receive of a newer epoch. These tests check both.
#include <fmt/format.h>
#include <signal.h>
#include <ucp/api/ucp.h>

#include <cstring>
#include <string>
#include <thread>

#include "comm/context.h"
#include "comm/transport.h"
#include "comm/ucx_context.h"
#include "ft_testing.h"

namespace crossbar::testing {
namespace {

using ft::FaultTolerantComm;

constexpr uint32_t kTag = 4242;     // a user tag no collective uses
constexpr uint32_t kAnyTag = 4243;  // received with an any-source receive
constexpr size_t kCapacity = 64;

RunOptions options(int victims) {
  RunOptions o;
  o.allow_rank_death = victims > 0;
  o.timeout = Millis(120'000);
  o.env["CROSSBAR_FT_DETECT_TIMEOUT"] = "2000ms";
  o.env["CROSSBAR_RANKS_PER_NODE"] = "1";  // every pair over UCX
  return o;
}

std::shared_ptr<ucx::UcxContext> ucxTo(Communicator& comm, int peer) {
  auto u = ucx::ucxContextOf(comm.context().transportTo(comm.worldRank(peer)));
  EXPECT_NE(u, nullptr) << "rank " << peer << " is not reached over UCX";
  return u;
}

// True once a message from `source` with `tag` (world communicator: comm id 0) of the
// context `u` sits in the worker's unexpected queue; leaves it there.
bool queued(ucx::UcxContext& u, int source, uint32_t tag) {
  std::lock_guard<std::recursive_mutex> lock(u.mutex());
  u.progress();
  ucp_tag_recv_info_t info{};
  return ucp_tag_probe_nb(u.worker(), u.wireTag(source) | tag, ~uint64_t{0}, 0, &info) != nullptr;
}

bool waitQueued(ucx::UcxContext& u, int source, uint32_t tag) {
  auto deadline = Deadline::after(Millis(30'000));
  while (!queued(u, source, tag)) {
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// 3 ranks, one per virtual node. In epoch 0 rank 0 sends rank 1 two messages nobody
// receives (tags kTag and kAnyTag, "epoch 0"); rank 1 waits until both sit in its worker.
// Rank 2 dies; ranks 0 and 1 shrink to epoch 1 (same rank numbers) on the kept
// endpoints. There rank 1 posts a receive from rank 0 with kTag and an any-source
// receive with kAnyTag before rank 0 sends anything; after a barrier both must still be
// pending (had the old messages matched, they would have completed at once), and they
// must then get rank 0's "epoch 1" messages. The old messages are still queued at the
// end: ignored, never delivered.
TEST(FtUcxEpochs, OldEpochMessagesNeverMatchNewEpochReceives) {
  const int n = 3, victim = 2;
  auto results = runRanks(
      n,
      [&](RankEnv& env) {
        auto ft = FaultTolerantComm::create(env.store, env.rank, n, ftOptions(env));
        auto comm = ft->comm();
        char old_message[kCapacity] = "epoch 0";
        std::shared_ptr<ucx::UcxContext> epoch0;
        if (env.rank == 0) {
          comm->waitAll({comm->isend(old_message, sizeof old_message, 1, kTag),
                         comm->isend(old_message, sizeof old_message, 1, kAnyTag)},
                        Deadline::after(Millis(30'000)));
        } else if (env.rank == 1) {
          epoch0 = ucxTo(*comm, 0);
          ASSERT_TRUE(epoch0);
          ASSERT_TRUE(waitQueued(*epoch0, 0, kTag)) << "rank 0's epoch-0 message never arrived";
          ASSERT_TRUE(waitQueued(*epoch0, 0, kAnyTag)) << "rank 0's epoch-0 message never arrived";
        }
        comm.reset();
        auto coll = std::make_unique<Collectives>(ft->comm());
        if (!loseRankInCollectives(*ft, coll, env.rank, victim, 7)) return;
        ft->shrink();
        ASSERT_EQ(ft->epoch(), 1u);
        ASSERT_EQ(ft->size(), 2);
        comm = ft->comm();
        const int peer = 1 - env.rank;
        auto u = ucxTo(*comm, peer);
        ASSERT_TRUE(u);
        EXPECT_TRUE(u->kept());
        // The survivors wired nothing up anew: the endpoint of epoch 0 carries epoch 1.
        EXPECT_EQ(u->reusedPeers(), std::vector<int>{peer});
        EXPECT_NE(u->wireBase(), 0u) << "epoch 1 must use wire ids epoch 0 did not";

        char message[kCapacity] = "epoch 1";
        if (env.rank == 1) {
          char got[kCapacity] = {}, got_any[kCapacity] = {};
          auto r = comm->irecv(got, sizeof got, 0, kTag);
          auto r_any = comm->irecv(got_any, sizeof got_any, kAnySource, kAnyTag);
          comm->barrier();  // progresses the worker; rank 0 has sent nothing yet
          EXPECT_FALSE(r->done()) << "a receive of epoch 1 took a message: '" << got << "'";
          EXPECT_FALSE(r_any->done())
              << "an any-source receive of epoch 1 took a message: '" << got_any << "'";
          comm->barrier();  // rank 0 sends now
          comm->waitAll({r, r_any}, Deadline::after(Millis(30'000)));
          EXPECT_STREQ(got, "epoch 1");
          EXPECT_STREQ(got_any, "epoch 1");
          EXPECT_EQ(r_any->status().source, 0);
          // Epoch 0's messages were neither delivered nor dropped by UCX: still queued.
          EXPECT_TRUE(queued(*u, 0, kTag) == false) << "epoch 1's own tag must have no message left";
          std::lock_guard<std::recursive_mutex> lock(u->mutex());
          ucp_tag_recv_info_t info{};
          EXPECT_NE(ucp_tag_probe_nb(u->worker(), epoch0->wireTag(0) | kTag, ~uint64_t{0}, 0, &info),
                    nullptr);
          EXPECT_EQ(info.length, kCapacity);
        } else {
          comm->barrier();
          comm->barrier();
          comm->waitAll({comm->isend(message, sizeof message, 1, kTag),
                         comm->isend(message, sizeof message, 1, kAnyTag)},
                        Deadline::after(Millis(30'000)));
        }
        epoch0.reset();
        comm->barrier();
      },
      options(1), /*expect_ok=*/false);
  for (const auto& r : results) {
    if (r.rank == victim)
      EXPECT_EQ(r.exit_code, -SIGKILL) << r.failure;
    else
      EXPECT_TRUE(r.ok) << "rank " << r.rank << " (exit " << r.exit_code << "):\n" << r.failure;
  }
}

// After two shrinks (4 -> 3 -> 2 ranks, over virtual nodes) the survivors still run on
// the endpoints of epoch 0, and a grow admits a replacement: only the pairs with the
// newcomer are wired up, and every pair computes correctly.
TEST(FtUcxEpochs, ShrinkTwiceThenGrowWiresUpOnlyTheNewcomer) {
  const int n = 4;
  auto results = runRanks(
      n + 1,
      [&](RankEnv& env) {
        if (env.rank == n) {  // the replacement: joins once the others are down to 2
          auto ft = FaultTolerantComm::join(env.store, ftOptions(env));
          EXPECT_EQ(ft->size(), 3);
          EXPECT_EQ(ft->rank(), 2);
          for (int p = 0; p < 2; ++p) {
            auto u = ucxTo(*ft->comm(), p);
            ASSERT_TRUE(u);
            EXPECT_TRUE(u->reusedPeers().empty());
          }
          auto coll = std::make_unique<Collectives>(ft->comm());
          for (int it = 0; it < 4; ++it) step(*coll, it, 11);
          coll.reset();
          ft->comm()->barrier();
          return;
        }
        auto ft = FaultTolerantComm::create(env.store, env.rank, n, ftOptions(env));
        auto coll = std::make_unique<Collectives>(ft->comm());
        if (!loseRankInCollectives(*ft, coll, env.rank, 3, 9)) return;
        ft->shrink();
        coll = std::make_unique<Collectives>(ft->comm());
        if (!loseRankInCollectives(*ft, coll, env.rank, 2, 10)) return;
        ft->shrink();
        ASSERT_EQ(ft->epoch(), 2u);
        ASSERT_EQ(ft->size(), 2);
        {
          auto u = ucxTo(*ft->comm(), 1 - ft->rank());
          ASSERT_TRUE(u);
          EXPECT_EQ(u->reusedPeers(), std::vector<int>{1 - ft->rank()});
        }
        ft->grow(3);
        ASSERT_EQ(ft->size(), 3);
        auto u = ucxTo(*ft->comm(), 1 - ft->rank());
        ASSERT_TRUE(u);
        EXPECT_EQ(u->reusedPeers(), std::vector<int>{1 - ft->rank()});  // not the joiner (rank 2)
        coll = std::make_unique<Collectives>(ft->comm());
        for (int it = 0; it < 4; ++it) step(*coll, it, 11);
        coll.reset();
        ft->comm()->barrier();
      },
      options(2), /*expect_ok=*/false);
  for (const auto& r : results) {
    if (r.rank == 2 || r.rank == 3)
      EXPECT_EQ(r.exit_code, -SIGKILL) << r.failure;
    else
      EXPECT_TRUE(r.ok) << "rank " << r.rank << " (exit " << r.exit_code << "):\n" << r.failure;
  }
}

}  // namespace
}  // namespace crossbar::testing
