// SymmetricPool: deterministic offsets (locally and across ranks), coalescing,
// exhaustion and misuse errors.
#include <gtest/gtest.h>

#include <random>

#include "harness/multiprocess.h"
#include "symmem/symmetric_pool.h"

namespace crossbar::symm {
namespace {

using testing::RankEnv;
using testing::runRanks;

// The same pseudo-random allocate/free sequence; returns the offsets it got.
std::vector<size_t> churn(SymmetricPool& pool, uint64_t seed, int steps) {
  std::mt19937_64 rng(seed);
  std::vector<PoolBlock> live;
  std::vector<size_t> offsets;
  for (int i = 0; i < steps; ++i) {
    if (!live.empty() && rng() % 3 == 0) {
      size_t k = rng() % live.size();
      pool.free(live[k]);
      live.erase(live.begin() + k);
    } else {
      size_t bytes = 1 + rng() % 5000;
      size_t align = size_t{1} << (rng() % 10);
      try {
        PoolBlock b = pool.allocate(bytes, align);
        EXPECT_EQ(b.offset % align, 0u);
        offsets.push_back(b.offset);
        live.push_back(b);
      } catch (const PoolExhausted&) {
        offsets.push_back(~size_t{0});
      }
    }
  }
  return offsets;
}

TEST(SymmetricPool, DeterministicAcrossRanksAndExhaustion) {
  runRanks(4, [](RankEnv& env) {
    auto comm = env.communicator();
    auto heap = SymmetricHeap::create(comm);
    auto pool = SymmetricPool::create(heap, 256 << 10);
    std::vector<size_t> offsets = churn(*pool, 7, 600);
    // Every rank made the same calls: compare fingerprints and offsets through rank 0's buffer.
    uint64_t fp = pool->fingerprint();
    pool->buffer().local<uint64_t>()[0] = fp;
    pool->buffer().local<uint64_t>()[1] = offsets.size();
    pool->buffer().barrier(0, comm->defaultDeadline());
    EXPECT_EQ(*pool->buffer().peer<uint64_t>(0), fp);
    EXPECT_EQ(pool->buffer().peer<uint64_t>(0)[1], offsets.size());
    pool->buffer().barrier(0, comm->defaultDeadline());
    pool->buffer().free();
  });
}

TEST(SymmetricPool, LocalBehaviour) {
  runRanks(1, [](RankEnv& env) {
    auto heap = SymmetricHeap::create(env.communicator());
    auto pool = SymmetricPool::create(heap, 64 << 10);
    SymmetricPool again(heap.allocate(64 << 10));
    EXPECT_EQ(churn(*pool, 11, 400), churn(again, 11, 400));  // same calls, same offsets
    EXPECT_EQ(pool->fingerprint(), again.fingerprint());

    SymmetricPool p(heap.allocate(4096));
    PoolBlock a = p.allocate(1000), b = p.allocate(1000), c = p.allocate(1000);
    EXPECT_EQ(a.offset, 0u);
    EXPECT_EQ(b.offset, 1024u);
    EXPECT_EQ(c.offset, 2048u);
    EXPECT_EQ(p.localPtr(b), static_cast<char*>(p.buffer().localPtr()) + 1024);
    try {
      p.allocate(2000);
      ADD_FAILURE() << "expected PoolExhausted";
    } catch (const PoolExhausted& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("2000 bytes"), std::string::npos) << m;
      EXPECT_NE(m.find("4096-byte pool"), std::string::npos) << m;
      EXPECT_NE(m.find("larger pool"), std::string::npos) << m;
      EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    }
    p.free(b);
    EXPECT_THROW(p.free(b), InvalidUsage);
    p.free(a);  // coalesces with b's run
    PoolBlock big = p.allocate(2000);
    EXPECT_EQ(big.offset, 0u);
    p.free(c);
    p.free(big);
    EXPECT_EQ(p.used(), 0u);
    EXPECT_EQ(p.largestFree(), 4096u);
    EXPECT_THROW(p.allocate(0), InvalidArgument);
    EXPECT_THROW(p.allocate(8, 3), InvalidArgument);
  });
}

}  // namespace
}  // namespace crossbar::symm
