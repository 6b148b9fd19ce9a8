// Single-copy (CMA) host collectives: the probe's failure reports, the fallback decision
// (agreed by every rank, data still right on the staged path), the selection table, and
// that a buffer may be reused as soon as its collective completes (no reader is still
// copying from it). The full type x size x in-place matrix of the "cma" algorithms runs
// in test_collectives (every registered algorithm).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/cma.h"
#include "collectives/collectives.h"
#include "collectives/selection.h"
#include "collectives/symm_staging.h"
#include "harness/multiprocess.h"

using namespace crossbar;
using crossbar::testing::RankEnv;
using crossbar::testing::RunOptions;
using crossbar::testing::runRanks;

namespace {

uint8_t byteOf(int iter, int rank, size_t i) {
  return static_cast<uint8_t>(iter * 131 + rank * 29 + i * 7 + (i >> 9));
}

void fill(std::vector<uint8_t>& v, int iter, int rank, size_t first = 0) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = byteOf(iter, rank, first + i);
}

// First index where `got` differs from rank `rank`'s bytes of iteration `iter`, or -1.
long firstWrong(const uint8_t* got, size_t n, int iter, int rank, size_t first = 0) {
  for (size_t i = 0; i < n; ++i)
    if (got[i] != byteOf(iter, rank, first + i)) return static_cast<long>(i);
  return -1;
}

}  // namespace

TEST(Cma, ProbeReportsWhyItFails) {
  uint64_t token = 0x1234567890abcdefull;
  EXPECT_EQ(cma::probe(getpid(), &token, token, 0), "");
  std::string wrong = cma::probe(getpid(), &token, token + 1, 3);
  EXPECT_NE(wrong.find("rank 3"), std::string::npos) << wrong;
  EXPECT_NE(wrong.find("other data"), std::string::npos) << wrong;
  std::string bad_addr = cma::probe(getpid(), reinterpret_cast<const void*>(8), token, 1);
  EXPECT_NE(bad_addr.find("failed"), std::string::npos) << bad_addr;
  // A process that no longer exists.
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  std::string gone = cma::probe(child, &token, token, 2);
  EXPECT_NE(gone.find("failed"), std::string::npos) << gone;
  // read() names the operation and the peer; an exited peer is a PeerFailure.
  char dst[8];
  try {
    cma::read(child, dst, &token, sizeof dst, 0, 2, "allgather");
    ADD_FAILURE() << "read from an exited process succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
  }
  try {
    cma::read(getpid(), dst, reinterpret_cast<const void*>(8), sizeof dst, 0, 1, "alltoall");
    ADD_FAILURE() << "read from an unmapped address succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kSystemError) << e.what();
    EXPECT_NE(std::string(e.what()).find("alltoall"), std::string::npos) << e.what();
  }
}

// Runs one of each single-copy collective (forced "cma") and checks the data.
void runCmaCollectives(Collectives& coll, Communicator& comm, size_t n, int iter) {
  const int p = comm.size(), r = comm.rank();
  CollOptions o;
  o.algorithm = "cma";
  std::vector<uint8_t> send(n * p), recv(n * p);
  fill(send, iter, r);
  coll.allgather(send.data(), recv.data(), n, DataType::kUInt8, o)->wait();
  for (int q = 0; q < p; ++q)
    EXPECT_EQ(firstWrong(recv.data() + q * n, n, iter, q), -1) << "allgather block " << q;
  coll.alltoall(send.data(), recv.data(), n, DataType::kUInt8, o)->wait();
  for (int q = 0; q < p; ++q)
    EXPECT_EQ(firstWrong(recv.data() + q * n, n, iter, q, r * n), -1) << "alltoall block " << q;
  std::vector<size_t> dsp(p);
  for (int q = 0; q < p; ++q) dsp[q] = q * n;
  // Rank q sends n/(r+1) bytes to rank r (what r expects from everyone).
  std::vector<size_t> scnt(p);
  for (int q = 0; q < p; ++q) scnt[q] = n / (q + 1);
  std::vector<size_t> rcnt(p, n / (r + 1));
  coll.alltoallv(send.data(), scnt, dsp, recv.data(), rcnt, dsp, DataType::kUInt8, o)->wait();
  for (int q = 0; q < p; ++q)
    EXPECT_EQ(firstWrong(recv.data() + q * n, rcnt[q], iter, q, r * n), -1) << "alltoallv block " << q;
  const int root = iter % p;
  std::vector<uint8_t> b(n);
  if (r == root) fill(b, iter, root);
  coll.broadcast(b.data(), n, DataType::kUInt8, root, o)->wait();
  EXPECT_EQ(firstWrong(b.data(), n, iter, root), -1) << "broadcast";
  std::vector<uint8_t> mine(n);
  fill(mine, iter, r);
  coll.gather(mine.data(), recv.data(), n, root, DataType::kUInt8, o)->wait();
  if (r == root) {
    for (int q = 0; q < p; ++q) EXPECT_EQ(firstWrong(recv.data() + q * n, n, iter, q), -1) << "gather " << q;
  }
  coll.scatter(send.data(), mine.data(), n, root, DataType::kUInt8, o)->wait();
  EXPECT_EQ(firstWrong(mine.data(), n, iter, root, r * n), -1) << "scatter";
}

// One rank turns single copy off: every rank must agree on the staged path (a rank
// on the other protocol would hang), and the "cma" algorithms still deliver the data.
TEST(Cma, FallbackIsAgreedByEveryRank) {
  RunOptions opts;
  opts.env["CROSSBAR_COLL_SYMM_BYTES"] = "64K";
  opts.env["CROSSBAR_TIMEOUT"] = "60s";
  runRanks(
      3,
      [](RankEnv& env) {
        auto comm = env.communicator();
        if (comm->rank() == 1) setenv("CROSSBAR_COLL_CMA", "off", 1);
        SymmStaging s(comm, 64 * 1024, 16 * 1024);
        EXPECT_FALSE(s.cma(Deadline::after(Millis(60000))));
        const std::string want = comm->rank() == 1 ? "CROSSBAR_COLL_CMA=off" : "rank 1";
        EXPECT_NE(s.cmaReason().find(want), std::string::npos) << s.cmaReason();
        Collectives coll(comm);
        for (size_t n : {size_t{1}, size_t{4099}, size_t{70001}})
          runCmaCollectives(coll, *comm, n, static_cast<int>(n));
        comm->destroy();
      },
      opts);
}

// Every rank on auto: all agree (single copy on wherever the kernel allows it),
// CROSSBAR_ALGO selects "cma" (the table keeps "symm"), and the data is right.
TEST(Cma, AutoIsAgreedAndSelected) {
  RunOptions opts;
  opts.env["CROSSBAR_COLL_CMA"] = "auto";
  opts.env["CROSSBAR_TIMEOUT"] = "60s";
  runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        SymmStaging s(comm, 64 * 1024, 16 * 1024);
        std::vector<uint8_t> mine{static_cast<uint8_t>(s.cma(Deadline::after(Millis(60000))))}, all(2);
        Collectives coll(comm);
        CollOptions o;
        o.algorithm = "direct";  // point-to-point: independent of what is being tested
        coll.gather(mine.data(), all.data(), 1, 0, DataType::kUInt8, o)->wait();
        if (comm->rank() == 0) {
          EXPECT_EQ(all[0], all[1]) << "ranks disagree on single copy: " << s.cmaReason();
        }
        EXPECT_EQ(s.cma(Deadline::after(Millis(60000))), s.cmaReason().empty()) << s.cmaReason();
        // The table keeps the staged path (measured faster here); CROSSBAR_ALGO selects cma.
        auto pick = [&](CollType c, size_t count, const char* env) {
          return selectAlgorithm(CollArgs::of(c, nullptr, nullptr, count, DataType::kUInt8), *comm, "",
                                 parseAlgoOverride(env))
              .algorithm->name;
        };
        EXPECT_EQ(pick(CollType::kAllgather, 1 << 20, ""), "symm");
        EXPECT_EQ(pick(CollType::kAllgather, 1 << 20, "cma"), "cma");
        EXPECT_EQ(pick(CollType::kAlltoallv, 64, "alltoallv=cma"), "cma");
        EXPECT_EQ(pick(CollType::kAlltoall, 1 << 20, "alltoallv=cma"), "symm");  // above the eager sizes
        runCmaCollectives(coll, *comm, 100003, 1);
        comm->destroy();
      },
      opts);
}

// The caller overwrites its buffers the moment each collective completes; a reader
// still copying from them would see the next iteration's (or garbage) bytes. Rank 0
// lags behind by turns, so readers and owners are out of step.
TEST(Cma, BuffersReusableRightAfterCompletion) {
  RunOptions opts;
  opts.env["CROSSBAR_TIMEOUT"] = "60s";
  runRanks(
      3,
      [](RankEnv& env) {
        auto comm = env.communicator();
        const int p = comm->size(), r = comm->rank();
        Collectives coll(comm);
        CollOptions o;
        o.algorithm = "cma";
        const size_t n = 1 << 20;
        std::vector<uint8_t> send(n * p), recv(n * p);
        for (int iter = 0; iter < 12; ++iter) {
          if (r == iter % p) usleep(2000);
          fill(send, iter, r);
          if (iter % 2 == 0)
            coll.allgather(send.data(), recv.data(), n, DataType::kUInt8, o)->wait();
          else
            coll.alltoall(send.data(), recv.data(), n, DataType::kUInt8, o)->wait();
          std::memset(send.data(), 0xA5, send.size());  // reuse at once
          for (int q = 0; q < p; ++q) {
            long bad = firstWrong(recv.data() + q * n, n, iter, q, iter % 2 ? r * n : 0);
            ASSERT_EQ(bad, -1) << "iteration " << iter << ": block of rank " << q << " wrong at byte " << bad;
          }
          // Broadcast: the root overwrites its buffer at once, then broadcasts again.
          std::vector<uint8_t>& b = recv;
          const int root = iter % p;
          if (r == root) fill(b, iter, root);
          coll.broadcast(b.data(), n, DataType::kUInt8, root, o)->wait();
          if (r == root) {
            std::memset(b.data(), 0x5A, n);
          } else {
            ASSERT_EQ(firstWrong(b.data(), n, iter, root), -1) << "broadcast, iteration " << iter;
          }
        }
        comm->destroy();
      },
      opts);
}

// The staging copy-in picks plain or streaming stores by timing (retrying the other
// kind every 64 large copies): both kinds must copy every byte exactly, at any size and
// alignment, and the copy must be complete when the peer sees the READY signal.
TEST(StageCopy, BothStoreKindsCopyExactlyAndBeforeTheSignal) {
  RunOptions opts;
  opts.env["CROSSBAR_TIMEOUT"] = "60s";
  runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        SymmStaging s(comm, 1 << 20, 256 * 1024);
        const int r = s.rank(), peer = 1 - r;
        const size_t sizes[] = {1, 63, 16 * 1024 - 1, 16 * 1024, 16 * 1024 + 5, 100003, 256 * 1024 - 7};
        std::vector<uint8_t> src(300 * 1024), got(300 * 1024);
        for (int i = 0; i < 300; ++i) {  // > 2 x 64 large copies: each store kind runs
          const size_t bytes = sizes[i % 7], dst_off = (i * 13) % 64, src_off = (i * 7) % 61;
          for (int h = 0; h < 2; ++h) {
            if (i > 0) s.wait(peer, SymmStaging::kFree, Deadline::after(Millis(60000)));
            for (size_t j = 0; j < bytes; ++j) src[src_off + j] = static_cast<uint8_t>(j * 31 + i * 7 + r * 3 + h);
            s.stageCopy(s.mine(h) + dst_off, src.data() + src_off, bytes);
            s.notify(peer, SymmStaging::kReady);
            s.wait(peer, SymmStaging::kReady, Deadline::after(Millis(60000)));
            std::memcpy(got.data(), s.slot(peer, h) + dst_off, bytes);
            s.release(peer);
            for (size_t j = 0; j < bytes; ++j)
              ASSERT_EQ(got[j], static_cast<uint8_t>(j * 31 + i * 7 + peer * 3 + h))
                  << "copy " << i << " half " << h << ", " << bytes << " bytes, byte " << j;
          }
        }
        comm->destroy();
      },
      opts);
}

// Staged alltoall(v) copies its output out with streaming stores once a rank receives
// 8 MiB or more: odd sizes, an unaligned receive buffer, in and out of place, many
// chunks (small staging), 2 and 3 ranks; ranks below the threshold (alltoallv) keep
// plain stores in the same call.
TEST(SymmExchange, LargeOutputsStreamExactly) {
  for (int p : {2, 3}) {
    RunOptions opts;
    opts.env["CROSSBAR_COLL_SYMM_BYTES"] = "1M";
    opts.env["CROSSBAR_TIMEOUT"] = "60s";
    runRanks(
        p,
        [](RankEnv& env) {
          auto comm = env.communicator();
          const int p = comm->size(), r = comm->rank();
          Collectives coll(comm);
          CollOptions o;
          o.algorithm = "symm";
          const size_t n = (size_t{9} << 20) / p + 7;  // per peer: >= 8 MiB received in all
          std::vector<uint8_t> send(n * p), store(n * p + 64);
          uint8_t* recv = store.data() + 3;  // not aligned for vector stores
          for (int iter = 0; iter < 2; ++iter) {
            const bool inplace = iter == 1;
            fill(send, iter, r);
            if (inplace) std::memcpy(recv, send.data(), n * p);
            coll.alltoall(inplace ? recv : send.data(), recv, n, DataType::kUInt8, o)->wait();
            for (int q = 0; q < p; ++q) {
              long bad = firstWrong(recv + q * n, n, iter, q, r * n);
              ASSERT_EQ(bad, -1) << (inplace ? "in place" : "out of place") << ", block of rank " << q
                                 << " wrong at byte " << bad;
            }
          }
          // alltoallv: every rank sends (q + 1) * m + q bytes to rank q, so rank 0 receives
          // less than 8 MiB in all (plain stores) and the others more (streaming).
          const size_t m = (size_t{7} << 20) / p;
          auto cnt = [&](int q) { return (q + 1) * m + q; };
          auto off = [&](int q) {  // where the block for rank q starts in every sender's buffer
            size_t o = 0;
            for (int j = 0; j < q; ++j) o += cnt(j);
            return o;
          };
          std::vector<size_t> scnt(p), sdsp(p), rcnt(p), rdsp(p);
          for (int q = 0; q < p; ++q) {
            scnt[q] = cnt(q);
            sdsp[q] = off(q);
            rcnt[q] = cnt(r);
            rdsp[q] = q * cnt(r);
          }
          std::vector<uint8_t> vsend(off(p)), vstore(p * cnt(r) + 64);
          uint8_t* vrecv = vstore.data() + 5;
          fill(vsend, 7, r);
          coll.alltoallv(vsend.data(), scnt, sdsp, vrecv, rcnt, rdsp, DataType::kUInt8, o)->wait();
          for (int q = 0; q < p; ++q) {
            long bad = firstWrong(vrecv + rdsp[q], rcnt[q], 7, q, off(r));
            ASSERT_EQ(bad, -1) << "alltoallv, block of rank " << q << " wrong at byte " << bad;
          }
          comm->destroy();
        },
        opts);
  }
}
