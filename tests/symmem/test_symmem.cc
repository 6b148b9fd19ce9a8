// Symmetric heap and buffers over forked ranks: mapping, signals and their
// ordering, barriers with more ranks than cores, put/get to on-node peers (shared
// memory) and off-node peers (UCX RMA on virtual nodes), deadlines, lifetime and
// crash cleanup.
#include <dirent.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "comm/errors.h"
#include "harness/multiprocess.h"
#include "symmem/symmetric_heap.h"

namespace crossbar::symm {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;

uint8_t patternByte(uint64_t seed, size_t i) {
  return static_cast<uint8_t>(i * 31 + (i >> 11) + seed * 101);
}
void fill(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = patternByte(seed, i);
}
int64_t firstMismatch(const uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != patternByte(seed, i)) return static_cast<int64_t>(i);
  return -1;
}
Deadline soon(int ms = 60'000) {
  return Deadline::after(Millis(ms));
}

// Lines of /proc/self/maps naming our segments, and our open fds.
int symmMappings() {
  std::ifstream f("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(f, line)) n += line.find("crossbar-symm") != std::string::npos;
  return n;
}
int openFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n - 1;  // the DIR's own fd
}
std::set<std::string> devShm() {
  std::set<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) names.insert(e->d_name);
    closedir(d);
  }
  return names;
}

// ------------------------------------------------------------------ single node

class OnNode : public ::testing::TestWithParam<int> {};

TEST_P(OnNode, PeersSeeEachOthersWrites) {
  const int n = GetParam();
  runRanks(n, [n](RankEnv& env) {
    auto comm = env.communicator();
    auto heap = SymmetricHeap::create(comm);
    std::vector<std::shared_ptr<SymmetricBuffer>> bufs;
    for (size_t bytes : {size_t{1}, size_t{4096}, size_t{100'000}, size_t{3} << 20})
      bufs.push_back(heap.allocate(bytes));
    for (auto& b : bufs) {
      ASSERT_NE(b->localPtr(), nullptr);
      EXPECT_EQ(b->peerPtr(comm->rank()), b->localPtr());
      EXPECT_EQ(reinterpret_cast<uintptr_t>(b->localPtr()) % 4096, 0u);
      for (int r = 0; r < n; ++r) EXPECT_NE(b->peerPtr(r), nullptr);
      EXPECT_EQ(b->peerPtr(n), nullptr);
      EXPECT_EQ(*b->local<uint8_t>(), 0) << "fresh buffers are zeroed";
      fill(b->local<uint8_t>(), b->size(), comm->rank() * 10 + b->id());
    }
    bufs[0]->barrier(0, soon());
    for (auto& b : bufs)
      for (int r = 0; r < n; ++r)
        EXPECT_EQ(firstMismatch(b->peer<uint8_t>(r), b->size(), r * 10 + b->id()), -1) << "rank " << r;
    EXPECT_EQ(bufs[2]->offsetOf(bufs[2]->local<char>(777)), 777u);
    EXPECT_THROW(bufs[2]->offsetOf(bufs[1]->localPtr()), InvalidArgument);
    bufs[0]->barrier(0, soon());
    for (auto& b : bufs) b->free();
    EXPECT_TRUE(bufs[0]->freed());
    EXPECT_THROW(bufs[0]->putSignal(0, 0), InvalidUsage);
  });
}
INSTANTIATE_TEST_SUITE_P(Ranks, OnNode, ::testing::Values(2, 4, 8),
                         [](const auto& info) { return "ranks" + std::to_string(info.param); });

// Each rank streams random-size messages around a ring; the receiver checks every
// message right after its wait, and acknowledges so the slot can be reused.
void signalStress(RankEnv& env, int iters) {
  auto comm = env.communicator();
  const int me = comm->rank(), n = comm->size();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  auto heap = SymmetricHeap::create(comm);
  const size_t cap = 256 << 10;
  auto buf = heap.allocate(2 * cap);
  std::vector<uint8_t> src(cap);
  std::mt19937_64 rng(me);
  std::mt19937_64 prev_rng(prev);
  for (int i = 0; i < iters; ++i) {
    const size_t slot = (i % 2) * cap;
    // Sizes drawn per sender: the receiver replays the sender's generator.
    size_t bytes = 1 + rng() % (i % 7 == 0 ? cap : 2048);
    if (i >= 2) buf->waitSignal(next, 1, soon());  // next consumed the message that used this slot
    fill(src.data(), bytes, me * 100000 + i);
    if (i % 3 == 0)
      buf->putWithSignal(next, slot, src.data(), bytes, 0);
    else {  // direct stores through the mapping, then a signal
      std::memcpy(buf->peer<uint8_t>(next, slot), src.data(), bytes);
      buf->putSignal(next, 0);
    }
    size_t in = 1 + prev_rng() % (i % 7 == 0 ? cap : 2048);
    buf->waitSignal(prev, 0, soon());
    ASSERT_EQ(firstMismatch(buf->local<uint8_t>(slot), in, prev * 100000 + i), -1) << "iteration " << i;
    buf->putSignal(prev, 1);
  }
  EXPECT_EQ(buf->signalValue(prev, 0), static_cast<uint64_t>(iters));
  buf->barrier(2, soon());
  buf->free();
}

TEST(Signals, OrderingStress2Ranks) {
  runRanks(2, [](RankEnv& env) { signalStress(env, 3000); });
}
TEST(Signals, OrderingStress4Ranks) {
  runRanks(4, [](RankEnv& env) { signalStress(env, 800); });
}

TEST(Signals, BarriersWithMoreRanksThanCores) {
  runRanks(8, [](RankEnv& env) {
    auto comm = env.communicator();
    auto heap = SymmetricHeap::create(comm);
    auto buf = heap.allocate(8 * sizeof(uint64_t));
    const int me = comm->rank();
    auto t0 = Clock::now();
    const int rounds = 300;
    for (int i = 1; i <= rounds; ++i) {
      // Every rank writes its slot in every peer, then the barrier publishes it.
      for (int r = 0; r < 8; ++r) buf->peer<uint64_t>(r)[me] = i;
      buf->barrier(3, soon());
      for (int r = 0; r < 8; ++r)
        ASSERT_EQ(buf->local<uint64_t>()[r], static_cast<uint64_t>(i)) << "round " << i;
      buf->barrier(4, soon());  // nobody writes round i+1 before everyone checked round i
    }
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (me == 0) fmt::print("{} barrier pairs over 8 ranks: {:.1f} us each\n", rounds, 1000 * ms / rounds);
    EXPECT_LT(ms, 30'000);
    buf->free();
  });
}

TEST(Signals, DeadlineNamesPeerAndChannel) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    auto heap = SymmetricHeap::create(comm);
    auto buf = heap.allocate(64);
    if (comm->rank() == 0) {
      auto t0 = Clock::now();
      try {
        buf->waitSignal(1, 3, Deadline::after(Millis(300)));
        ADD_FAILURE() << "expected Timeout";
      } catch (const Timeout& e) {
        std::string m = e.what();
        EXPECT_NE(m.find("rank 1"), std::string::npos) << m;
        EXPECT_NE(m.find("channel 3"), std::string::npos) << m;
        EXPECT_EQ(e.peers(), std::vector<int>{1});
      }
      EXPECT_LT(Clock::now() - t0, Millis(3000));
      EXPECT_THROW(buf->waitSignal(1, 99, soon()), InvalidArgument);
      EXPECT_THROW(buf->put(1, 60, "12345678", 8), InvalidArgument);
    }
    buf->barrier(0, soon());
    buf->free();
  });
}

TEST(Heap, MismatchedSizesAreInvalidUsage) {
  auto results = runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        auto heap = SymmetricHeap::create(comm);
        try {
          heap.allocate(comm->rank() == 0 ? 4096 : 8192);
          ADD_FAILURE() << "expected InvalidUsage";
        } catch (const InvalidUsage& e) {
          EXPECT_NE(std::string(e.what()).find(fmt::format("rank {}", 1 - comm->rank())), std::string::npos);
        }
      },
      {}, true);
}

// ----------------------------------------------------------------- lifetime

TEST(Lifetime, FreeWhilePeerStillMaps) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    auto heap = SymmetricHeap::create(comm);
    auto buf = heap.allocate(1 << 20);
    auto keep = heap.allocate(64);  // a second buffer to coordinate after the first is freed
    const int me = comm->rank();
    fill(buf->local<uint8_t>(), 1 << 20, me);
    keep->barrier(0, soon());
    if (me == 0) {
      buf->free();  // rank 1 still maps our segment
      keep->putSignal(1, 1);
      keep->waitSignal(1, 1, soon());
    } else {
      keep->waitSignal(0, 1, soon());
      uint8_t* theirs = buf->peer<uint8_t>(0);
      EXPECT_EQ(firstMismatch(theirs, 1 << 20, 0), -1);  // still readable and intact
      std::memset(theirs, 0x5A, 1 << 20);                // and writable: no SIGBUS
      buf->free();
      keep->putSignal(0, 1);
    }
    keep->free();
    EXPECT_EQ(symmMappings(), 0);
  });
}

TEST(Lifetime, HeapAndCommunicatorDestroyedFirst) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    std::shared_ptr<SymmetricBuffer> buf;
    {
      auto heap = SymmetricHeap::create(comm);
      buf = heap.allocate(4096);
    }  // heap handle gone: the buffer keeps the heap's state
    comm->destroy();
    env.comm.reset();
    comm.reset();  // communicator gone too
    const int me = buf->rank(), peer = 1 - me;
    uint64_t v = 1000 + me;
    buf->putWithSignal(peer, 8 * me, &v, 8, 0);
    buf->waitSignal(peer, 0, soon());
    EXPECT_EQ(buf->local<uint64_t>()[peer], 1000u + peer);
    buf->barrier(1, soon());
    buf->free();
    EXPECT_EQ(symmMappings(), 0);
  });
}

RunOptions deathOptions() {
  RunOptions o;
  o.timeout = Millis(60'000);
  o.allow_rank_death = true;
  return o;
}

TEST(Lifetime, KilledProcessLeavesNothingBehind) {
  const auto shm_before = devShm();
  auto results = runRanks(
      3,
      [](RankEnv& env) {
        auto comm = env.communicator();
        auto heap = SymmetricHeap::create(comm);
        const int fds_before = openFds();
        auto buf = heap.allocate(1 << 20);
        EXPECT_EQ(symmMappings(), 3);  // ours + two peers'
        EXPECT_EQ(openFds(), fds_before) << "mapped buffers hold no descriptors";
        buf->barrier(0, soon());
        if (comm->rank() == 2) ::kill(::getpid(), SIGKILL);
        // Rank 2 never signals: the wait ends with PeerFailure (its socket hung up), not a Timeout.
        auto t0 = Clock::now();
        try {
          buf->waitSignal(2, 1, soon(20'000));
          ADD_FAILURE() << "expected PeerFailure";
        } catch (const PeerFailure& e) {
          EXPECT_EQ(e.peers(), std::vector<int>{2});
          EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
        }
        EXPECT_LT(Clock::now() - t0, Millis(5000));
        buf->free();
        EXPECT_EQ(symmMappings(), 0);
        EXPECT_EQ(openFds(), fds_before);
      },
      deathOptions(), false);
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].ok) << results[0].failure;
  EXPECT_TRUE(results[1].ok) << results[1].failure;
  EXPECT_EQ(devShm(), shm_before) << "memfd segments never appear in /dev/shm";
}

// --------------------------------------------------- virtual nodes (UCX RMA)

class OffNode : public ::testing::TestWithParam<std::string> {
 protected:
  RunOptions options() const {
    RunOptions o;
    o.timeout = Millis(90'000);
    o.env["CROSSBAR_RANKS_PER_NODE"] = "2";
    if (GetParam() == "tcp") o.env["CROSSBAR_UCX_TLS"] = "tcp";
    return o;
  }
};

TEST_P(OffNode, PutGetSignalToOnAndOffNodePeers) {
  runRanks(
      4,
      [](RankEnv& env) {
        auto comm = env.communicator();
        const int me = comm->rank(), n = comm->size();
        auto heap = SymmetricHeap::create(comm);
        const size_t region = 300'000;
        auto buf = heap.allocate(region * n);
        for (int r = 0; r < n; ++r) {
          EXPECT_EQ(buf->isLocalPeer(r), comm->nodeOf(r) == comm->node());
          EXPECT_EQ(buf->peerPtr(r) == nullptr, comm->nodeOf(r) != comm->node()) << r;
        }
        // Everyone puts a pattern into its own region of every peer, with a signal.
        std::vector<uint8_t> src(region);
        for (int round = 0; round < 4; ++round) {
          const size_t bytes = round == 0 ? region : 1 + (round * 7919) % region;
          for (int r = 0; r < n; ++r) {
            if (r == me) continue;
            fill(src.data(), bytes, me * 1000 + r * 10 + round);
            buf->putWithSignal(r, me * region, src.data(), bytes, 0);
          }
          for (int r = 0; r < n; ++r) {
            if (r == me) continue;
            buf->waitSignal(r, 0, soon());
            ASSERT_EQ(firstMismatch(buf->local<uint8_t>(r * region), bytes, r * 1000 + me * 10 + round), -1)
                << "from rank " << r << " round " << round;
          }
          buf->barrier(1, soon());
        }
        // get: read what rank r received from us, out of r's buffer.
        std::vector<uint8_t> back(region);
        for (int r = 0; r < n; ++r) {
          if (r == me) continue;
          const size_t bytes = 1 + (3 * 7919) % region;
          buf->get(r, me * region, back.data(), bytes);
          EXPECT_EQ(firstMismatch(back.data(), bytes, me * 1000 + r * 10 + 3), -1) << "get from " << r;
        }
        buf->barrier(1, soon());  // every get done before the puts below overwrite regions
        // Plain puts then quiet + barrier: visible everywhere.
        uint64_t word = 0xABC000 + me;
        for (int r = 0; r < n; ++r)
          if (r != me) buf->put(r, 8 * me, &word, 8);
        buf->quiet(soon());
        buf->barrier(2, soon());
        for (int r = 0; r < n; ++r)
          if (r != me) {
            EXPECT_EQ(buf->local<uint64_t>()[r], 0xABC000u + r);
          }
        buf->barrier(2, soon());
        buf->free();
      },
      options());
}

TEST_P(OffNode, RemoteSignalStressAndDeadline) {
  runRanks(
      2,
      [](RankEnv& env) {
        CommOptions co;
        co.ranks_per_node = 1;
        auto comm = env.communicator(co);
        const int me = comm->rank(), peer = 1 - me;
        auto heap = SymmetricHeap::create(comm);
        auto buf = heap.allocate(2 * 65536);
        ASSERT_EQ(buf->peerPtr(peer), nullptr);
        std::vector<uint8_t> src(65536);
        std::mt19937_64 mine(me), theirs(peer);
        for (int i = 0; i < 300; ++i) {
          const size_t slot = (i % 2) * 65536;
          size_t out = 1 + mine() % 65536, in = 1 + theirs() % 65536;
          if (i >= 2) buf->waitSignal(peer, 1, soon());
          fill(src.data(), out, me * 100000 + i);
          buf->putWithSignal(peer, slot, src.data(), out, 0);
          buf->waitSignal(peer, 0, soon());
          ASSERT_EQ(firstMismatch(buf->local<uint8_t>(slot), in, peer * 100000 + i), -1) << "iteration " << i;
          buf->putSignal(peer, 1);
        }
        buf->barrier(2, soon());
        if (me == 0) {
          try {
            buf->waitSignal(1, 5, Deadline::after(Millis(300)));
            ADD_FAILURE() << "expected Timeout";
          } catch (const Timeout& e) {
            EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("channel 5"), std::string::npos) << e.what();
          }
        }
        buf->barrier(2, soon());
        buf->free();
      },
      options());
}

INSTANTIATE_TEST_SUITE_P(Ucx, OffNode, ::testing::Values("default", "tcp"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace crossbar::symm
