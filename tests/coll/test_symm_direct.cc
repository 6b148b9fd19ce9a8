// Zero-copy symmetric collectives: allgather and alltoall ("symm") read an owner's input
// in place when it lies in a symmetric buffer allocated over the same communicator, and
// stage it otherwise, decided per owner. Checks: the data (bytes from (iter, rank, index)),
// that exactly the symmetric owners' blocks were read in place (symmDirectReads), mixed
// symmetric / plain ranks in one call, in place and out of place, several chunks and odd
// sizes, and that an owner may overwrite its input as soon as the call returns.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/symm_staging.h"
#include "harness/multiprocess.h"
#include "symmem/symmetric_heap.h"

using namespace crossbar;
using crossbar::testing::RankEnv;
using crossbar::testing::RunOptions;
using crossbar::testing::runRanks;

namespace {

uint8_t byteOf(int iter, int rank, size_t i) {
  return static_cast<uint8_t>(iter * 131 + rank * 29 + i * 7 + (i >> 9));
}

void fill(uint8_t* v, size_t n, int iter, int rank, size_t first = 0) {
  for (size_t i = 0; i < n; ++i) v[i] = byteOf(iter, rank, first + i);
}

// First index where `got` differs from rank `rank`'s bytes of iteration `iter`, or -1.
long firstWrong(const uint8_t* got, size_t n, int iter, int rank, size_t first = 0) {
  for (size_t i = 0; i < n; ++i)
    if (got[i] != byteOf(iter, rank, first + i)) return static_cast<long>(i);
  return -1;
}

RunOptions smallStaging() {
  RunOptions opts;
  // Halves of 32 KiB, chunks of 8 KiB: the larger sizes take many chunks / rounds.
  opts.env["CROSSBAR_COLL_SYMM_BYTES"] = "64K";
  opts.env["CROSSBAR_COLL_SYMM_CHUNK"] = "8K";
  opts.env["CROSSBAR_TIMEOUT"] = "60s";
  return opts;
}

// Whether rank r's input is symmetric in iteration `iter`: every pattern of 2-3 ranks.
bool symmetricIn(int iter, int r) {
  return (iter >> r) & 1;
}

// Every pattern of symmetric / plain owners, sizes 1 .. several chunks, in place and out
// of place; the symmetric inputs are overwritten right after each call returns.
void runPatterns(int ranks) {
  runRanks(
      ranks,
      [](RankEnv& env) {
        auto comm = env.communicator();
        const int p = comm->size(), r = comm->rank();
        Collectives coll(comm);
        CollOptions o;
        o.algorithm = "symm";
        auto heap = symm::SymmetricHeap::create(comm);
        const size_t max_n = 70001;
        auto sym_send = heap.allocate(max_n * p + 3);
        auto sym_recv = heap.allocate(max_n * p);
        std::vector<uint8_t> plain_send(max_n * p), plain_recv(max_n * p);
        int iter = 0;
        for (size_t n : {size_t{1}, size_t{4099}, size_t{70001}}) {
          for (int pattern = 0; pattern < (1 << p); ++pattern) {
            for (bool inplace : {false, true}) {
              ++iter;
              const bool sym = symmetricIn(pattern, r);
              int peers_sym = 0;
              for (int q = 0; q < p; ++q) peers_sym += q != r && symmetricIn(pattern, q);
              SCOPED_TRACE(fmt::format("n {} pattern {} {}", n, pattern, inplace ? "in place" : "out of place"));
              // Allgather. Out of place from an unaligned offset (3) of the symmetric buffer.
              uint8_t* recv = sym ? sym_recv->local<uint8_t>() : plain_recv.data();
              uint8_t* send = inplace ? recv + r * n : sym ? sym_send->local<uint8_t>(3) : plain_send.data();
              fill(send, n, iter, r);
              uint64_t before = symmDirectReads();
              coll.allgather(send, recv, n, DataType::kUInt8, o)->wait();
              EXPECT_EQ(symmDirectReads() - before, static_cast<uint64_t>(peers_sym)) << "allgather direct reads";
              if (sym) std::memset(send, 0xA5, n);  // reuse at once: no reader may still be copying
              for (int q = 0; q < p; ++q) {
                if (q == r && sym) continue;  // just overwritten (in place)
                EXPECT_EQ(firstWrong(recv + q * n, n, iter, q), -1) << "allgather block " << q;
              }
              // Alltoall: in place never reads the input in place (the owner overwrites it).
              send = inplace ? recv : sym ? sym_send->local<uint8_t>() : plain_send.data();
              fill(send, n * p, iter, r);
              before = symmDirectReads();
              coll.alltoall(send, recv, n, DataType::kUInt8, o)->wait();
              EXPECT_EQ(symmDirectReads() - before, inplace ? 0u : static_cast<uint64_t>(peers_sym))
                  << "alltoall direct reads";
              if (sym && !inplace) std::memset(send, 0xA5, n * p);
              for (int q = 0; q < p; ++q)
                EXPECT_EQ(firstWrong(recv + q * n, n, iter, q, r * n), -1) << "alltoall block " << q;
            }
          }
        }
        sym_send->free();
        sym_recv->free();
        comm->destroy();
      },
      smallStaging());
}

}  // namespace

TEST(SymmDirect, TwoRanksEveryPattern) {
  runPatterns(2);
}

TEST(SymmDirect, ThreeRanksEveryPattern) {
  runPatterns(3);
}

// Large blocks, a lagging rank by turns, every rank symmetric: an owner returning before
// its readers finished would see its 0xA5 overwrite (or the next iteration's bytes) in
// their output.
TEST(SymmDirect, InputReusableRightAfterCompletion) {
  runRanks(
      3,
      [](RankEnv& env) {
        auto comm = env.communicator();
        const int p = comm->size(), r = comm->rank();
        Collectives coll(comm);
        CollOptions o;
        o.algorithm = "symm";
        auto heap = symm::SymmetricHeap::create(comm);
        const size_t n = 1 << 20;
        auto send_buf = heap.allocate(n * p);
        uint8_t* send = send_buf->local<uint8_t>();
        std::vector<uint8_t> recv(n * p);
        const uint64_t start = symmDirectReads();
        for (int iter = 0; iter < 8; ++iter) {
          if (r == iter % p) usleep(2000);
          fill(send, n * p, iter, r);
          if (iter % 2 == 0)
            coll.allgather(send, recv.data(), n, DataType::kUInt8, o)->wait();
          else
            coll.alltoall(send, recv.data(), n, DataType::kUInt8, o)->wait();
          std::memset(send, 0xA5, n * p);  // reuse at once
          for (int q = 0; q < p; ++q) {
            const size_t first = iter % 2 == 0 ? 0 : r * n;
            EXPECT_EQ(firstWrong(recv.data() + q * n, n, iter, q, first), -1) << "iter " << iter << " block " << q;
          }
        }
        EXPECT_EQ(symmDirectReads() - start, 8u * (p - 1));
        send_buf->free();
        comm->destroy();
      },
      smallStaging());
}

// A heap over another communicator (a dup: same ranks, other object) is not used in place:
// that heap's peers need not be the collective's. The data is staged and still right.
TEST(SymmDirect, OtherCommunicatorsHeapIsStaged) {
  runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        auto other = comm->dup();
        const int p = comm->size(), r = comm->rank();
        Collectives coll(comm);
        CollOptions o;
        o.algorithm = "symm";
        auto heap = symm::SymmetricHeap::create(other);
        const size_t n = 4099;
        auto buf = heap.allocate(n * p);
        fill(buf->local<uint8_t>(), n, 1, r);
        std::vector<uint8_t> recv(n * p);
        const uint64_t before = symmDirectReads();
        coll.allgather(buf->local<uint8_t>(), recv.data(), n, DataType::kUInt8, o)->wait();
        EXPECT_EQ(symmDirectReads(), before);
        for (int q = 0; q < p; ++q) EXPECT_EQ(firstWrong(recv.data() + q * n, n, 1, q), -1) << "block " << q;
        buf->free();
        other->destroy();
        comm->destroy();
      },
      smallStaging());
}

// A freed buffer leaves the lookup: its (reused) address range is staged again.
TEST(SymmDirect, RegistryForgetsFreedBuffers) {
  runRanks(
      1,
      [](RankEnv& env) {
        auto comm = env.communicator();
        auto heap = symm::SymmetricHeap::create(comm);
        auto buf = heap.allocate(1000);
        auto found = symm::findBuffer(buf->local<char>(10), 990);
        EXPECT_EQ(found.buffer, buf);
        EXPECT_EQ(found.offset, 10u);
        EXPECT_EQ(symm::findBuffer(buf->local<char>(10), 991).buffer, nullptr);  // past the end
        EXPECT_EQ(symm::findBuffer(heap.id(), buf->id()), buf);
        EXPECT_TRUE(buf->createdOver(*comm));
        const void* p = buf->localPtr();
        buf->free();
        EXPECT_EQ(symm::findBuffer(p, 1).buffer, nullptr);
        comm->destroy();
      },
      smallStaging());
}
