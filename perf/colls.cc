// The per-collective table: byte counts from a size, bus-bandwidth factor, run, check.
// Byte counts and bandwidth formulas follow nccl-tests so the numbers compare directly.
#include <cstring>
#include <vector>

#include "perf/driver.h"

namespace crossbar::perf {
namespace {

// Per-rank blocks are multiples of 4 elements, as nccl-tests aligns them.
constexpr size_t kAlign = 4;
size_t alignedBase(size_t count, int n) {
  return (count / (kAlign * n)) * kAlign;
}

ByteCounts sameCounts(size_t count, int) {
  return {count, count, count, 0, 0};
}
ByteCounts gatherCounts(size_t count, int n) {
  size_t b = alignedBase(count, n);
  return {b, b * n, b, b, 0};
}
ByteCounts scatterCounts(size_t count, int n) {
  size_t b = alignedBase(count, n);
  return {b * n, b, b, 0, b};
}
ByteCounts alltoallCounts(size_t count, int n) {
  size_t b = count / n;
  return {b * n, b * n, b, 0, 0};
}

double one(int) {
  return 1.0;
}
double ranks(int n) {
  return n;
}
double ranksMinusOne(int n) {
  return n - 1;
}
double ringFactor(int n) {
  return static_cast<double>(n - 1) / n;
}
double allreduceFactor(int n) {
  return 2.0 * (n - 1) / n;
}
std::string anyRanks(int) {
  return {};
}
std::string powerOfTwo(int n) {
  if (n > 0 && (n & (n - 1)) == 0) return {};
  return "nRanks " + std::to_string(n) + " is not a power of 2, skipping";
}

int rankOf(const RunArgs& a) {
  return a.coll->comm().rank();
}
int sizeOf(const RunArgs& a) {
  return a.coll->comm().size();
}

WorkPtr runAllreduce(const RunArgs& a) {
  return a.coll->allreduce(a.send, a.recv, a.count, a.type, a.op, a.options);
}
WorkPtr runAllgather(const RunArgs& a) {
  return a.coll->allgather(a.send, a.recv, a.count, a.type, a.options);
}
WorkPtr runReduceScatter(const RunArgs& a) {
  return a.coll->reduceScatter(a.send, a.recv, a.count, a.type, a.op, a.options);
}
WorkPtr runAlltoall(const RunArgs& a) {
  return a.coll->alltoall(a.send, a.recv, a.count, a.type, a.options);
}
WorkPtr runBroadcast(const RunArgs& a) {
  // crossbar's broadcast has one buffer: out of place, the root's data starts in send.
  if (a.send != a.recv && rankOf(a) == a.root) std::memcpy(a.recv, a.send, a.count * elementSize(a.type));
  return a.coll->broadcast(a.recv, a.count, a.type, a.root, a.options);
}
WorkPtr runReduce(const RunArgs& a) {
  return a.coll->reduce(a.send, a.recv, a.count, a.type, a.op, a.root, a.options);
}
WorkPtr runGather(const RunArgs& a) {
  return a.coll->gather(a.send, a.recv, a.count, a.root, a.type, a.options);
}
WorkPtr runScatter(const RunArgs& a) {
  return a.coll->scatter(a.send, a.recv, a.count, a.root, a.type, a.options);
}
constexpr uint32_t kPerfTag = 0x7E57;
WorkPtr runSendrecv(const RunArgs& a) {
  const int r = rankOf(a), n = sizeOf(a);
  if (n == 1) {  // a rank pairs with itself
    if (a.send != a.recv) std::memcpy(a.recv, a.send, a.count * elementSize(a.type));
    return a.coll->barrier(a.options);
  }
  const size_t bytes = a.count * elementSize(a.type);
  // In place (send == recv), the incoming message would overwrite data still being sent:
  // receive into a staging buffer and copy once both are done (counted in the time).
  static thread_local std::vector<char> staging;
  const bool in_place = a.send == a.recv && bytes > 0;
  if (in_place && staging.size() < bytes) staging.resize(bytes);
  a.coll->groupStart();
  a.coll->send(a.send, a.count, a.type, (r + 1) % n, kPerfTag, a.options);
  a.coll->recv(in_place ? staging.data() : a.recv, a.count, a.type, (r + n - 1) % n, kPerfTag, a.options);
  WorkPtr w = a.coll->groupEnd();
  if (in_place) {
    w->wait();
    std::memcpy(a.recv, staging.data(), bytes);
  }
  return w;
}
// Allgather by recursive doubling over send/recv: step k swaps 2^k blocks with rank ^ 2^k.
WorkPtr runHypercube(const RunArgs& a) {
  const int r = rankOf(a), n = sizeOf(a);
  const size_t block = a.count * elementSize(a.type);
  char* recv = static_cast<char*>(a.recv);
  if (recv + r * block != a.send) std::memcpy(recv + r * block, a.send, block);
  WorkPtr last;
  for (int mask = 1; mask < n; mask <<= 1) {
    const int mine = r & ~(mask - 1), theirs = mine ^ mask;
    a.coll->groupStart();
    a.coll->send(recv + mine * block, a.count * mask, a.type, r ^ mask, kPerfTag + 1, a.options);
    a.coll->recv(recv + theirs * block, a.count * mask, a.type, r ^ mask, kPerfTag + 1, a.options);
    last = a.coll->groupEnd();
  }
  return last ? last : a.coll->barrier(a.options);
}

// Checks: count the wrong elements of this rank's result (b = elements per block).
size_t checkAllreduce(const DataSpec& s, int, int, size_t b, const char* recv) {
  return countWrong(s, 0, 0, b, recv);
}
size_t checkReduce(const DataSpec& s, int rank, int root, size_t b, const char* recv) {
  return rank == root ? countWrong(s, 0, 0, b, recv) : 0;
}
size_t checkBroadcast(const DataSpec& s, int, int root, size_t b, const char* recv) {
  return countWrong(s, root, 0, b, recv);
}
size_t checkReduceScatter(const DataSpec& s, int rank, int, size_t b, const char* recv) {
  return countWrong(s, 0, static_cast<size_t>(rank) * b, b, recv);
}
size_t checkScatter(const DataSpec& s, int rank, int root, size_t b, const char* recv) {
  return countWrong(s, root, static_cast<size_t>(rank) * b, b, recv);
}
size_t checkSendrecv(const DataSpec& s, int rank, int, size_t b, const char* recv) {
  return countWrong(s, (rank + s.nranks - 1) % s.nranks, 0, b, recv);
}
size_t checkAllgather(const DataSpec& s, int, int, size_t b, const char* recv) {
  size_t wrong = 0;
  for (int q = 0; q < s.nranks; ++q) wrong += countWrong(s, q, 0, b, recv + q * b * elementSize(s.type));
  return wrong;
}
size_t checkGather(const DataSpec& s, int rank, int root, size_t b, const char* recv) {
  return rank == root ? checkAllgather(s, rank, root, b, recv) : 0;
}
size_t checkAlltoall(const DataSpec& s, int rank, int, size_t b, const char* recv) {
  size_t wrong = 0;
  for (int q = 0; q < s.nranks; ++q)
    wrong += countWrong(s, q, static_cast<size_t>(rank) * b, b, recv + q * b * elementSize(s.type));
  return wrong;
}

const CollTest kTests[] = {
    {"all_reduce", true, false, false, sameCounts, allreduceFactor, one, runAllreduce, checkAllreduce,
     anyRanks},
    {"all_gather", false, false, false, gatherCounts, ringFactor, ranks, runAllgather, checkAllgather,
     anyRanks},
    {"reduce_scatter", true, false, false, scatterCounts, ringFactor, ranks, runReduceScatter,
     checkReduceScatter, anyRanks},
    {"alltoall", false, false, false, alltoallCounts, ringFactor, ranks, runAlltoall, checkAlltoall,
     anyRanks},
    {"broadcast", false, true, false, sameCounts, one, one, runBroadcast, checkBroadcast, anyRanks},
    {"reduce", true, true, true, sameCounts, one, one, runReduce, checkReduce, anyRanks},
    {"gather", false, true, true, gatherCounts, ringFactor, ranks, runGather, checkGather, anyRanks},
    {"scatter", false, true, false, scatterCounts, ringFactor, ranks, runScatter, checkScatter, anyRanks},
    {"sendrecv", false, false, false, sameCounts, one, one, runSendrecv, checkSendrecv, anyRanks},
    {"hypercube", false, false, false, gatherCounts, one, ranksMinusOne, runHypercube, checkAllgather,
     powerOfTwo},
};

}  // namespace

const std::vector<const CollTest*>& allCollTests() {
  static const std::vector<const CollTest*> all = [] {
    std::vector<const CollTest*> v;
    for (const CollTest& t : kTests) v.push_back(&t);
    return v;
  }();
  return all;
}

const CollTest* findCollTest(const std::string& name) {
  for (const CollTest* t : allCollTests())
    if (name == t->name) return t;
  return nullptr;
}

void computeBandwidth(const CollTest& t, size_t param_count, size_t elem_size, double seconds, int nranks,
                      double* algbw, double* busbw) {
  const double bytes =
      static_cast<double>(param_count) * static_cast<double>(elem_size) * t.algBytesFactor(nranks);
  *algbw = seconds > 0 ? bytes / 1.0e9 / seconds : 0.0;
  *busbw = *algbw * t.busFactor(nranks);
}

}  // namespace crossbar::perf
