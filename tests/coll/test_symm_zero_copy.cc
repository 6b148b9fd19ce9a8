// Zero copy-in for every host symmetric-memory algorithm: allreduce oneshot / twoshot /
// twoshot_nt, reduce_scatter, reduce, broadcast, gather, scatter, allgather, alltoall and
// alltoallv read an owner's input in place when it lies in a symmetric buffer allocated
// over the same communicator (ZeroCopy, symm_staging.h), and stage it otherwise, decided
// per owner. Checks, with data from (iter, rank, index) and exact (wrapping integer) sums:
// every pattern of symmetric / plain ranks, in place and out of place, odd sizes and
// several chunks, offsets that are not cache-line multiples, u8 and u32; that exactly the
// symmetric owners' inputs were read in place (symmDirectReads); inputs overwritten as
// soon as the call returns (also with a lagging rank); many queued nonblocking calls on
// the same symmetric buffers (a peer still reading an input the next call overwrites shows
// up in the data); the fallbacks (another communicator's heap, partly inside a buffer,
// misaligned, disallowed); and that freed buffers leave the lookup.
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

uint32_t valueOf(int iter, int rank, size_t i) {
  return static_cast<uint32_t>(iter * 2654435761u + rank * 40503u + i * 2246822519u + (i >> 7));
}

template <class T>
DataType typeOf() {
  return sizeof(T) == 1 ? DataType::kUInt8 : DataType::kUInt32;
}

template <class T>
void fill(T* v, size_t n, int iter, int rank, size_t first = 0) {
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<T>(valueOf(iter, rank, first + i));
}

// Sum over p ranks of element i, wrapping as the type does.
template <class T>
T sumOf(int p, int iter, size_t i) {
  T s = 0;
  for (int q = 0; q < p; ++q) s = static_cast<T>(s + static_cast<T>(valueOf(iter, q, i)));
  return s;
}

// First index where got[i] != want(i), or -1.
template <class T, class F>
long firstWrong(const T* got, size_t n, F want) {
  for (size_t i = 0; i < n; ++i)
    if (got[i] != want(i)) return static_cast<long>(i);
  return -1;
}

RunOptions smallStaging() {
  RunOptions opts;
  // Halves of 32 KiB, chunks of 8 KiB: the larger sizes take many chunks.
  opts.env["CROSSBAR_COLL_SYMM_BYTES"] = "64K";
  opts.env["CROSSBAR_COLL_SYMM_CHUNK"] = "8K";
  opts.env["CROSSBAR_TIMEOUT"] = "60s";
  return opts;
}

bool symmetricIn(int pattern, int r) {
  return (pattern >> r) & 1;
}

// alltoallv: elements rank s sends to rank d (symmetric in s, d so in place works; 0 at times).
size_t vcount(size_t n, int s, int d) {
  return (n + 3 * static_cast<size_t>(s + d)) % (n + 1);
}

// Every pattern of symmetric / plain ranks for every changed collective; element offset
// `off` into the symmetric buffers (a byte offset that is not a multiple of 64).
template <class T>
void runPatterns(int ranks, size_t off) {
  runRanks(
      ranks,
      [off](RankEnv& env) {
        auto comm = env.communicator();
        const int p = comm->size(), r = comm->rank();
        const DataType t = typeOf<T>();
        Collectives coll(comm);
        auto heap = symm::SymmetricHeap::create(comm);
        const size_t max_n = 70001, cap = (max_n + 1) * p + off;
        auto sym_a = heap.allocate(cap * sizeof(T));
        auto sym_b = heap.allocate(cap * sizeof(T));
        std::vector<T> plain_a(cap), plain_b(cap), copy(cap);
        int iter = 0;
        for (size_t n : {size_t{1}, size_t{4099}, size_t{70001}}) {
          for (int pattern = 0; pattern < (1 << p); ++pattern) {
            for (bool inplace : {false, true}) {
              ++iter;
              const bool sym = symmetricIn(pattern, r);
              int peers_sym = 0;
              for (int q = 0; q < p; ++q) peers_sym += q != r && symmetricIn(pattern, q);
              const int root = iter % p;
              SCOPED_TRACE(fmt::format("{} n {} pattern {} {} root {}", dataTypeName(t), n, pattern,
                                       inplace ? "in place" : "out of place", root));
              T* A = sym ? sym_a->local<T>(off * sizeof(T)) : plain_a.data() + off;  // local(): bytes
              T* B = sym ? sym_b->local<T>(off * sizeof(T)) : plain_b.data() + off;
              // Overwrites the input and the output at once (no peer may still read either)
              // and returns a copy of the output taken first, to check.
              auto reuse = [&](T* input, size_t in_n, T* got, size_t got_n) -> const T* {
                std::memcpy(copy.data(), got, got_n * sizeof(T));
                std::memset(input, 0xA5, in_n * sizeof(T));
                std::memset(got, 0x5A, got_n * sizeof(T));
                return copy.data();
              };
              auto directReads = [&](auto&& call) {
                const uint64_t before = symmDirectReads();
                call();
                return static_cast<int>(symmDirectReads() - before);
              };

              // Allreduce, every algorithm. One-shot in place stages (it writes its output
              // while peers read that chunk of its input). (Two-shot's reduced blocks from a
              // symmetric output: TwoShotOutputInPlace; these chunks are below its threshold.)
              for (const char* algo : {"oneshot", "twoshot", "twoshot_nt"}) {
                CollOptions o;
                o.algorithm = algo;
                fill(A, n, iter, r);
                T* out = inplace ? A : B;
                const int reads =
                    directReads([&] { coll.allreduce(A, out, n, t, ReduceOp::kSum, o)->wait(); });
                const bool oneshot = std::string(algo) == "oneshot";
                EXPECT_EQ(reads, oneshot && inplace ? 0 : peers_sym) << algo;
                const T* got = reuse(A, n, out, n);
                EXPECT_EQ(firstWrong(got, n, [&](size_t i) { return sumOf<T>(p, iter, i); }), -1) << algo;
              }
              CollOptions o;
              o.algorithm = "symm";
              // Reduce-scatter: in place is the rank's own block of the input.
              {
                fill(A, n * p, iter, r);
                T* out = inplace ? A + r * n : B;
                const int reads =
                    directReads([&] { coll.reduceScatter(A, out, n, t, ReduceOp::kSum, o)->wait(); });
                EXPECT_EQ(reads, peers_sym) << "reduce_scatter";
                const T* got = reuse(A, n * p, out, n);
                EXPECT_EQ(firstWrong(got, n, [&](size_t i) { return sumOf<T>(p, iter, r * n + i); }), -1)
                    << "reduce_scatter";
              }
              // Reduce: the root reads the others' inputs (in place: the root's recv == send).
              {
                fill(A, n, iter, r);
                T* out = inplace ? A : B;
                const int reads =
                    directReads([&] { coll.reduce(A, out, n, t, ReduceOp::kSum, root, o)->wait(); });
                EXPECT_EQ(reads, r == root ? peers_sym : 0) << "reduce";
                const T* got = reuse(A, n, out, n);
                if (r == root) {
                  EXPECT_EQ(firstWrong(got, n, [&](size_t i) { return sumOf<T>(p, iter, i); }), -1) << "reduce";
                }
              }
              // Broadcast (always in place): the others read the root's buffer.
              if (!inplace) {
                if (r == root) fill(A, n, iter, r);
                const int reads = directReads([&] { coll.broadcast(A, n, t, root, o)->wait(); });
                EXPECT_EQ(reads, r != root && symmetricIn(pattern, root) ? 1 : 0) << "broadcast";
                const T* got = reuse(A, n, A, n);
                EXPECT_EQ(firstWrong(got, n, [&](size_t i) { return static_cast<T>(valueOf(iter, root, i)); }),
                          -1)
                    << "broadcast";
              }
              // Gather: in place at the root is its own block of the output.
              {
                T* in = inplace && r == root ? B + r * n : A;
                fill(in, n, iter, r);
                const int reads = directReads([&] { coll.gather(in, B, n, root, t, o)->wait(); });
                EXPECT_EQ(reads, r == root ? peers_sym : 0) << "gather";
                if (r == root) {
                  const T* got = reuse(in, n, B, n * p);
                  for (int q = 0; q < p; ++q)
                    EXPECT_EQ(firstWrong(got + q * n, n,
                                         [&](size_t i) { return static_cast<T>(valueOf(iter, q, i)); }),
                              -1)
                        << "gather block " << q;
                }
              }
              // Scatter: in place at the root is its own block of the input.
              {
                if (r == root) fill(A, n * p, iter, r);
                T* out = inplace && r == root ? A + r * n : B;
                const int reads = directReads([&] { coll.scatter(A, out, n, root, t, o)->wait(); });
                EXPECT_EQ(reads, r != root && symmetricIn(pattern, root) ? 1 : 0) << "scatter";
                const T* got = r == root ? reuse(A, n * p, out, n) : out;
                EXPECT_EQ(firstWrong(got, n, [&](size_t i) { return static_cast<T>(valueOf(iter, root, r * n + i)); }),
                          -1)
                    << "scatter";
              }
              // Allgather: in place is the rank's own block of the output.
              {
                T* in = inplace ? B + r * n : A;
                fill(in, n, iter, r);
                const int reads = directReads([&] { coll.allgather(in, B, n, t, o)->wait(); });
                EXPECT_EQ(reads, peers_sym) << "allgather";
                const T* got = reuse(in, n, B, n * p);
                for (int q = 0; q < p; ++q)
                  EXPECT_EQ(firstWrong(got + q * n, n, [&](size_t i) { return static_cast<T>(valueOf(iter, q, i)); }),
                            -1)
                      << "allgather block " << q;
              }
              // Alltoall: in place never reads the input in place (the owner overwrites it).
              {
                fill(A, n * p, iter, r);
                T* out = inplace ? A : B;
                const int reads = directReads([&] { coll.alltoall(A, out, n, t, o)->wait(); });
                EXPECT_EQ(reads, inplace ? 0 : peers_sym) << "alltoall";
                const T* got = reuse(A, n * p, out, n * p);
                for (int q = 0; q < p; ++q)
                  EXPECT_EQ(firstWrong(got + q * n, n,
                                       [&](size_t i) { return static_cast<T>(valueOf(iter, q, r * n + i)); }),
                            -1)
                      << "alltoall block " << q;
              }
              // Alltoallv, variable counts with gaps; in place stages (from a copy).
              {
                std::vector<size_t> cnt(p), dsp(p), rcnt(p), rdsp(p);
                size_t at = 0, rat = 0;
                for (int q = 0; q < p; ++q) {
                  cnt[q] = vcount(n, r, q);
                  dsp[q] = at;
                  at += cnt[q] + 1;
                  rcnt[q] = vcount(n, q, r);
                  rdsp[q] = rat;
                  rat += rcnt[q] + 1;
                }
                for (int q = 0; q < p; ++q) fill(A + dsp[q], cnt[q], iter, r, q * 1000003);
                T* out = inplace ? A : B;
                int expect = 0;
                for (int q = 0; q < p; ++q) expect += q != r && symmetricIn(pattern, q) && rcnt[q] > 0;
                const int reads = directReads([&] { coll.alltoallv(A, cnt, dsp, out, rcnt, rdsp, t, o)->wait(); });
                EXPECT_EQ(reads, inplace ? 0 : expect) << "alltoallv";
                const T* got = reuse(A, at, out, rat);
                for (int q = 0; q < p; ++q)
                  EXPECT_EQ(firstWrong(got + rdsp[q], rcnt[q],
                                       [&](size_t i) { return static_cast<T>(valueOf(iter, q, r * 1000003 + i)); }),
                            -1)
                      << "alltoallv from " << q;
              }
            }
          }
        }
        sym_a->free();
        sym_b->free();
        comm->destroy();
      },
      smallStaging());
}

}  // namespace

TEST(SymmZeroCopy, TwoRanksEveryPatternU32) {
  runPatterns<uint32_t>(2, 1);
}

TEST(SymmZeroCopy, ThreeRanksEveryPatternU8) {
  runPatterns<uint8_t>(3, 3);
}

TEST(SymmZeroCopy, FourRanksEveryPatternU32) {
  runPatterns<uint32_t>(4, 3);
}

// Two-shot with blocks of at least 256 KiB per chunk also reads a symmetric output's
// reduced blocks in place: every pattern, in place and out of place, several chunks, the
// outputs and inputs overwritten at once after each call.
namespace {
void runTwoShotOutput(int ranks) {
  RunOptions opts = smallStaging();
  opts.env["CROSSBAR_COLL_SYMM_BYTES"] = "4M";
  opts.env["CROSSBAR_COLL_SYMM_CHUNK"] = "1M";
  runRanks(
      ranks,
      [](RankEnv& env) {
        auto comm = env.communicator();
        const int p = comm->size(), r = comm->rank();
        Collectives coll(comm);
        auto heap = symm::SymmetricHeap::create(comm);
        const size_t n = (2 << 20) / 4 + 4099;  // u32: two full 1 MiB chunks and an odd tail
        const size_t off = 5;                   // elements
        auto sym_a = heap.allocate((n + off) * 4), sym_b = heap.allocate((n + off) * 4);
        std::vector<uint32_t> plain_a(n), plain_b(n), copy(n);
        int iter = 100;
        for (int pattern = 0; pattern < (1 << p); ++pattern) {
          for (bool inplace : {false, true}) {
            for (const char* algo : {"twoshot", "twoshot_nt"}) {
              ++iter;
              const bool sym = symmetricIn(pattern, r);
              int peers_sym = 0;
              for (int q = 0; q < p; ++q) peers_sym += q != r && symmetricIn(pattern, q);
              SCOPED_TRACE(fmt::format("{} pattern {} {}", algo, pattern, inplace ? "in place" : "out of place"));
              uint32_t* A = sym ? sym_a->local<uint32_t>(off * 4) : plain_a.data();
              uint32_t* out = inplace ? A : sym ? sym_b->local<uint32_t>(off * 4) : plain_b.data();
              fill(A, n, iter, r);
              CollOptions o;
              o.algorithm = algo;
              const uint64_t before = symmDirectReads();
              coll.allreduce(A, out, n, DataType::kUInt32, ReduceOp::kSum, o)->wait();
              EXPECT_EQ(symmDirectReads() - before, 2u * peers_sym);  // input and output of each
              std::memcpy(copy.data(), out, n * 4);
              std::memset(A, 0xA5, n * 4);
              std::memset(out, 0x5A, n * 4);
              EXPECT_EQ(firstWrong(copy.data(), n, [&](size_t i) { return sumOf<uint32_t>(p, iter, i); }), -1);
            }
          }
        }
        sym_a->free();
        sym_b->free();
        comm->destroy();
      },
      opts);
}

}  // namespace

TEST(SymmZeroCopy, TwoShotOutputInPlaceTwoRanks) {
  runTwoShotOutput(2);
}

TEST(SymmZeroCopy, TwoShotOutputInPlaceThreeRanks) {
  runTwoShotOutput(3);
}

// Queued nonblocking calls on the same symmetric buffers, each reading what the previous
// one wrote (in place and across the two buffers), with every algorithm: the expected
// state of every rank is simulated here. A rank that overwrote an input a peer was still
// reading (in this call or the next) would change the sums.
TEST(SymmZeroCopy, BackToBackNonblockingOnSameBuffers) {
  runRanks(
      3,
      [](RankEnv& env) {
        auto comm = env.communicator();
        const int p = comm->size(), r = comm->rank();
        Collectives coll(comm);
        auto heap = symm::SymmetricHeap::create(comm);
        const size_t n = 30011;  // per block; the buffers hold p blocks
        auto a_buf = heap.allocate(n * p * 4), b_buf = heap.allocate(n * p * 4);
        uint32_t* A = a_buf->local<uint32_t>();
        uint32_t* B = b_buf->local<uint32_t>();
        // Simulated state of every rank.
        std::vector<std::vector<uint32_t>> sa(p, std::vector<uint32_t>(n * p)), sb = sa;
        for (int q = 0; q < p; ++q) {
          fill(sa[q].data(), n * p, 1, q);
          fill(sb[q].data(), n * p, 2, q);
        }
        fill(A, n * p, 1, r);
        fill(B, n * p, 2, r);
        auto allreduceSim = [&](auto& in, auto& out, size_t len) {
          std::vector<uint32_t> s(len, 0);
          for (int q = 0; q < p; ++q)
            for (size_t i = 0; i < len; ++i) s[i] += in[q][i];
          for (int q = 0; q < p; ++q) std::copy(s.begin(), s.end(), out[q].begin());
        };
        const uint64_t start = symmDirectReads();
        std::vector<WorkPtr> works;
        auto opt = [](const char* algo) {
          CollOptions o;
          o.algorithm = algo;
          return o;
        };
        const size_t all = n * p;
        for (int j = 0; j < 4; ++j) {
          const int root = j % p;
          works.push_back(coll.allreduce(A, A, all, DataType::kUInt32, ReduceOp::kSum, opt("twoshot")));
          allreduceSim(sa, sa, all);
          works.push_back(coll.allreduce(A, B, n, DataType::kUInt32, ReduceOp::kSum, opt("oneshot")));
          allreduceSim(sa, sb, n);
          // B's block r = sum over ranks of block r of A, in place.
          works.push_back(coll.reduceScatter(A, A + r * n, n, DataType::kUInt32, ReduceOp::kSum, opt("symm")));
          {
            std::vector<uint32_t> s(all, 0);
            for (int q = 0; q < p; ++q)
              for (size_t i = 0; i < all; ++i) s[i] += sa[q][i];
            for (int q = 0; q < p; ++q) std::copy(s.begin() + q * n, s.begin() + (q + 1) * n, sa[q].begin() + q * n);
          }
          works.push_back(coll.broadcast(B, all, DataType::kUInt32, root, opt("symm")));
          for (int q = 0; q < p; ++q) sb[q] = sb[root];
          works.push_back(coll.allreduce(B, A, all, DataType::kUInt32, ReduceOp::kSum, opt("twoshot_nt")));
          allreduceSim(sb, sa, all);
          works.push_back(coll.reduce(A, B, n, DataType::kUInt32, ReduceOp::kSum, root, opt("symm")));
          {
            std::vector<uint32_t> s(n, 0);
            for (int q = 0; q < p; ++q)
              for (size_t i = 0; i < n; ++i) s[i] += sa[q][i];
            std::copy(s.begin(), s.end(), sb[root].begin());
          }
          // A's block q goes to rank q (B), then B feeds the next round's in-place allreduce of A.
          works.push_back(coll.alltoall(B, A, n, DataType::kUInt32, opt("symm")));
          for (int d = 0; d < p; ++d)
            for (int q = 0; q < p; ++q)
              std::copy(sb[q].begin() + d * n, sb[q].begin() + (d + 1) * n, sa[d].begin() + q * n);
        }
        for (auto& w : works) w->wait();
        EXPECT_EQ(firstWrong(A, all, [&](size_t i) { return sa[r][i]; }), -1) << "A";
        EXPECT_EQ(firstWrong(B, all, [&](size_t i) { return sb[r][i]; }), -1) << "B";
        EXPECT_GT(symmDirectReads() - start, 0u);
        a_buf->free();
        b_buf->free();
        comm->destroy();
      },
      smallStaging());
}

// Large blocks, a lagging rank by turns, every rank symmetric: an owner returning before
// its readers finished would see its 0xA5 overwrite (or the next iteration's bytes) in
// their output.
TEST(SymmZeroCopy, InputReusableRightAfterCompletion) {
  runRanks(
      3,
      [](RankEnv& env) {
        auto comm = env.communicator();
        const int p = comm->size(), r = comm->rank();
        Collectives coll(comm);
        CollOptions o;
        o.algorithm = "symm";
        auto heap = symm::SymmetricHeap::create(comm);
        const size_t n = 1 << 18;  // u32 elements per block: 1 MiB
        auto send_buf = heap.allocate(n * p * 4);
        uint32_t* send = send_buf->local<uint32_t>();
        std::vector<uint32_t> recv(n * p);
        const uint64_t start = symmDirectReads();
        for (int iter = 0; iter < 8; ++iter) {
          if (r == iter % p) usleep(2000);
          fill(send, n * p, iter, r);
          const bool gather = iter % 2 == 0;
          if (gather)
            coll.allgather(send, recv.data(), n, DataType::kUInt32, o)->wait();
          else
            coll.alltoall(send, recv.data(), n, DataType::kUInt32, o)->wait();
          std::memset(send, 0xA5, n * p * 4);  // reuse at once
          const size_t first = gather ? 0 : r * n;
          for (int q = 0; q < p; ++q)
            EXPECT_EQ(firstWrong(recv.data() + q * n, n, [&](size_t i) { return valueOf(iter, q, first + i); }), -1)
                << "iter " << iter << " block " << q;
        }
        EXPECT_EQ(symmDirectReads() - start, 8u * (p - 1));
        send_buf->free();
        comm->destroy();
      },
      smallStaging());
}

// A heap over another communicator (a dup) is not read in place: staged, still right.
TEST(SymmZeroCopy, OtherCommunicatorsHeapIsStaged) {
  runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        auto other = comm->dup();
        const int p = comm->size(), r = comm->rank();
        Collectives coll(comm);
        auto heap = symm::SymmetricHeap::create(other);
        const size_t n = 4099;
        auto a = heap.allocate(n * p * 4), b = heap.allocate(n * p * 4);
        uint32_t* A = a->local<uint32_t>();
        uint32_t* B = b->local<uint32_t>();
        const uint64_t before = symmDirectReads();
        for (const char* algo : {"oneshot", "twoshot"}) {
          CollOptions o;
          o.algorithm = algo;
          fill(A, n, 3, r);
          coll.allreduce(A, B, n, DataType::kUInt32, ReduceOp::kSum, o)->wait();
          EXPECT_EQ(firstWrong(B, n, [&](size_t i) { return sumOf<uint32_t>(p, 3, i); }), -1) << algo;
        }
        CollOptions o;
        o.algorithm = "symm";
        fill(A, n * p, 4, r);
        coll.reduceScatter(A, B, n, DataType::kUInt32, ReduceOp::kSum, o)->wait();
        EXPECT_EQ(firstWrong(B, n, [&](size_t i) { return sumOf<uint32_t>(p, 4, r * n + i); }), -1);
        if (r == 0) fill(A, n, 5, 0);
        coll.broadcast(A, n, DataType::kUInt32, 0, o)->wait();
        EXPECT_EQ(firstWrong(A, n, [&](size_t i) { return valueOf(5, 0, i); }), -1);
        fill(A, n, 6, r);
        coll.allgather(A, B, n, DataType::kUInt32, o)->wait();
        for (int q = 0; q < p; ++q)
          EXPECT_EQ(firstWrong(B + q * n, n, [&](size_t i) { return valueOf(6, q, i); }), -1) << "allgather " << q;
        EXPECT_EQ(symmDirectReads(), before);
        a->free();
        b->free();
        other->destroy();
        comm->destroy();
      },
      smallStaging());
}

// ZeroCopy's own checks: only a range wholly inside one buffer of this communicator's
// heaps, at an offset of the element alignment, and only where the algorithm allows it.
TEST(SymmZeroCopy, DirectOnlyWhollyInsideAlignedAndAllowed) {
  runRanks(
      1,
      [](RankEnv& env) {
        auto comm = env.communicator();
        SymmStaging s(comm, 64 * 1024, 8 * 1024);
        auto heap = symm::SymmetricHeap::create(comm);
        auto buf = heap.allocate(8192);
        char* base = buf->local<char>();
        EXPECT_TRUE(ZeroCopy(s, base, 8192, 4, true).direct());
        EXPECT_TRUE(ZeroCopy(s, base + 4, 64, 4, true).direct());        // aligned to the element
        EXPECT_FALSE(ZeroCopy(s, base + 2, 64, 4, true).direct());       // misaligned for 4-byte elements
        EXPECT_TRUE(ZeroCopy(s, base + 3, 64, 1, true).direct());        // bytes: any offset
        EXPECT_FALSE(ZeroCopy(s, base + 8192 - 8, 16, 1, true).direct());  // partly inside
        EXPECT_FALSE(ZeroCopy(s, base, 8192, 4, false).direct());        // not allowed
        std::vector<char> plain(64);
        EXPECT_FALSE(ZeroCopy(s, plain.data(), 64, 1, true).direct());
        buf->free();
        comm->destroy();
      },
      smallStaging());
}

// A freed buffer leaves the lookup: its (reused) address range is staged again.
TEST(SymmZeroCopy, RegistryForgetsFreedBuffers) {
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
