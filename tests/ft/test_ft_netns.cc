// A real cut link: ranks 0,1 live in network namespace A, ranks 2,3 in B, and the
// only path between the nodes is a veth pair carrying UCX over TCP. Mid-collective,
// rank 0 takes the link down. The failure detectors must report the ranks across the
// cut as unreachable (alive, heartbeating through the store, silent on the data path),
// the survivors revoke and shrink to one side without hanging, and once the link is
// back up the other side joins again and the communicator grows back to four.
//
// The store connections are opened before each rank enters its namespace, so they
// stay in the root namespace: the store is on a management network the cut does not
// touch, as in a cluster whose data fabric fails. Skips unless run as root.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <sstream>
#include <thread>

#include "comm/context.h"
#include "ft/ft_testing.h"
#include "ft/netns.h"

namespace crossbar::testing {
namespace {

using ft::FailureKind;
using ft::FaultTolerantComm;

constexpr int kDetectMs = 2000;

int64_t msSince(int64_t t0_ns) {
  return (monoNs() - t0_ns) / 1'000'000;
}

TEST(FtNetns, CutLinkShrinkRestoreGrow) {
  std::string why_not;
  auto net = NetnsPair::create(&why_not);
  if (!net) GTEST_SKIP() << why_not;

  const int n = 4;
  RunOptions o;
  o.timeout = Millis(120'000);
  o.env["CROSSBAR_FT_DETECT_TIMEOUT"] = fmt::format("{}ms", kDetectMs);
  o.env["CROSSBAR_UCX_TLS"] = "tcp";  // UCX's shared-memory transports would bypass the link
  const uint32_t seed = static_cast<uint32_t>(std::random_device{}());
  SCOPED_TRACE(fmt::format("seed {}", seed));
  runRanks(
      n,
      [&](RankEnv& env) {
        const int node = env.rank / 2;
        auto detector_store = detectorStore(env);  // root namespace: outside the cut
        std::string err;
        ASSERT_TRUE(NetnsPair::enter(net->ns[node], &err)) << err;
        setenv("CROSSBAR_NODE_ID", std::to_string(node).c_str(), 1);
        setenv("UCX_NET_DEVICES", net->dev[node].c_str(), 1);
        ft::FtOptions fo;
        fo.detector_store = detector_store;

        auto ft = FaultTolerantComm::create(env.store, env.rank, n, fo);
        const int remote = env.rank < 2 ? 2 : 0;
        ASSERT_STREQ(ft->comm()->context().transportName(remote), "ucx");
        auto coll = std::make_unique<Collectives>(ft->comm());
        for (int it = 0; it < 3; ++it) step(*coll, it, seed);

        // Phase 1: cut the link a random moment into a random iteration.
        std::mt19937 rng(seed);
        const int cut_iter = 3 + static_cast<int>(rng() % 4);
        const int delay_us = static_cast<int>(rng() % 3000);
        std::thread cutter;
        std::vector<int> blamed;
        try {
          for (int it = 3; it < 1'000'000; ++it) {
            if (env.rank == 0 && it == cut_iter)
              cutter = std::thread([&] {
                std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
                env.store->set("test/cut_at", std::to_string(monoNs()));
                std::string out;
                if (!net->setLink(false, &out)) ADD_FAILURE() << "link down failed: " << out;
              });
            step(*coll, it, seed);
          }
          ADD_FAILURE() << "no failure after the link was cut";
        } catch (const Error& e) {
          EXPECT_TRUE(e.code() == ErrorCode::kPeerFailure || e.code() == ErrorCode::kTimeout) << e.what();
          auto faults = ft->handleError(e);
          const int64_t cut_at =
              std::stoll(toString(env.store->get("test/cut_at", Deadline::after(Millis(30'000)))));
          env.store->set(fmt::format("test/detected/{}", env.rank),
                         std::to_string((monoNs() - cut_at) / 1'000'000));
          ASSERT_FALSE(faults.empty()) << e.what();
          for (const auto& f : faults) {
            // Alive and heartbeating, only unreachable -- and always across the cut.
            EXPECT_EQ(f.kind, FailureKind::kUnreachable) << f.describe();
            EXPECT_NE(f.rank / 2, f.reporter / 2) << f.describe();
            EXPECT_NE(f.describe().find(fmt::format("rank {} (host", f.rank)), std::string::npos);
            if (f.reporter == env.rank) blamed.push_back(f.rank);  // own findings (others' are relayed)
          }
        }
        if (cutter.joinable()) cutter.join();
        coll.reset();

        // Phase 2: one side continues; the other is told it was left out.
        bool excluded = false;
        try {
          ft->shrink();
        } catch (const ft::Excluded&) {
          excluded = true;
        }
        const int64_t cut_at = std::stoll(toString(env.store->get("test/cut_at")));
        if (!excluded) {
          // One side (or part of it, if a same-side rank missed the agreement window).
          EXPECT_GE(ft->size(), 1);
          EXPECT_LE(ft->size(), 2);
          EXPECT_EQ(ft->epoch(), 1u);
          env.store->set(fmt::format("test/shrunk/{}", env.rank), std::to_string(msSince(cut_at)));
          coll = std::make_unique<Collectives>(ft->comm());
          for (int it = 0; it < 4; ++it) step(*coll, it, seed + 1);
          env.store->set(fmt::format("test/first_ok/{}", env.rank), std::to_string(msSince(cut_at)));
          coll.reset();
          ft->comm()->barrier();
          // This survivor blamed nobody on its side. (Its faults may also hold the other
          // side's accusations against this side, adopted from their revoke: those do not count.)
          EXPECT_EQ(std::count_if(blamed.begin(), blamed.end(), [&](int r) { return r / 2 == node; }), 0);
        }
        // "in <new rank> <size>" or "out": checked by the survivors' rank 0 below.
        env.store->set(fmt::format("test/side/{}", env.rank),
                       excluded ? std::string("out") : fmt::format("in {} {}", ft->rank(), ft->size()));

        // Phase 3: restore the link; the excluded side joins as replacements.
        if (!excluded && ft->rank() == 0) {
          // The survivors: all on one side of the cut (no split brain), this rank's side
          // non-empty, one membership (same size everywhere, new ranks 0..size-1 in old
          // order), and every other rank told it is out.
          std::vector<int> survivors;
          for (int r = 0; r < n; ++r) {
            std::istringstream side(toString(env.store->get(fmt::format("test/side/{}", r))));
            std::string word;
            int new_rank = -1, size = -1;
            side >> word >> new_rank >> size;
            if (word != "in") continue;
            EXPECT_EQ(size, ft->size()) << "rank " << r << " is in a different membership";
            EXPECT_EQ(new_rank, static_cast<int>(survivors.size())) << "rank " << r;
            survivors.push_back(r);
          }
          EXPECT_EQ(static_cast<int>(survivors.size()), ft->size());
          ASSERT_FALSE(survivors.empty());
          for (int r : survivors) EXPECT_EQ(r / 2, node) << "survivors on both sides of the cut";
          env.store->set("test/survivors", std::to_string(survivors.size()));
          std::string out;
          EXPECT_TRUE(net->setLink(true, &out)) << out;
          env.store->set("test/restored_at", std::to_string(monoNs()));
        }
        const int64_t restored_at = std::stoll(toString(env.store->get("test/restored_at")));
        if (excluded) {
          ft.reset();
          ft = FaultTolerantComm::join(env.store, fo);
        } else {
          ft->grow(n);
        }
        EXPECT_EQ(ft->size(), n);
        EXPECT_EQ(ft->epoch(), 2u);
        // Back across the link: the other node is reached over UCX again.
        int other = 0;
        while (other < n && ft->comm()->nodeOf(other) == ft->comm()->node()) ++other;
        ASSERT_LT(other, n);
        EXPECT_STREQ(ft->comm()->context().transportName(other), "ucx");
        coll = std::make_unique<Collectives>(ft->comm());
        for (int it = 0; it < 4; ++it) step(*coll, it, seed + 2);
        env.store->set(fmt::format("test/grown/{}", env.rank), std::to_string(msSince(restored_at)));
        coll.reset();
        ft->comm()->barrier();

        // One line from one process (never parsed): what the run measured.
        if (ft->rank() == 0) {
          std::string line = fmt::format(
              "cut link (seed {}, detect timeout {} ms), {} of {} ranks stayed, ms after the cut:", seed,
              kDetectMs, toString(env.store->get("test/survivors")), n);
          for (int r = 0; r < n; ++r) {
            line += fmt::format(" rank {}: detected {}", r,
                                toString(env.store->get(fmt::format("test/detected/{}", r))));
            if (env.store->check({fmt::format("test/first_ok/{}", r)}))
              line += fmt::format(", shrunk {}, first correct collective {}",
                                  toString(env.store->get(fmt::format("test/shrunk/{}", r))),
                                  toString(env.store->get(fmt::format("test/first_ok/{}", r))));
            line += ";";
          }
          line += " grown back and verified ";
          line += toString(env.store->get(fmt::format("test/grown/{}", env.rank))) + " ms after the restore";
          std::printf("%s\n", line.c_str());
        }
      },
      o);
}

}  // namespace
}  // namespace crossbar::testing
