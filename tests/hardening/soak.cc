// crossbar-soak: random collectives, sizes, types, ops, algorithms and rank counts for a
// set time, checking every result. Run through scripts/soak.sh (not in CI).
//
// Each round forks 2..max ranks (sometimes split into virtual nodes, so UCX and the
// hierarchical algorithms run too), picks a call-check mode, and runs a sequence of
// operations that every rank derives from (seed, round, op): the same choices on
// every rank without talking. Data is a closed form of (seed, op, rank, index):
// small integers for reductions, chosen per op and type so every partial result is
// exact in any order; hashed bytes for data movement (compared bit for bit).
//
// Every rank also picks, on its own, how it completes what it issued: it issues 1-8
// operations before completing them, in issue order, reversed or shuffled, each by
// wait(), by polling test(), after a sleep, on another thread, or by polling
// hasFinished() alone (which never runs the call: the worker thread must, and a call
// still unfinished after --stall-seconds (20 s) is reported). Now and then calls are
// grouped (groupStart/groupEnd), some groups with a ring of sends and receives, and a
// quarter of the rounds run 2-3 threads at once, each on its own duplicate of the
// communicator with its own Collectives (--node-threads 0: one-node rounds only; 2: every
// round, each on several virtual nodes). The worker's start-poll period
// (CROSSBAR_COLL_START_POLL_US: 500, 50 or 0 = a wake-up per issue) is random per round.
// When no call completed for half the stall bound, every rank prints its queues' state.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/collectives.h"
#include "collectives/reduce.h"
#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/local_launch.h"

using namespace crossbar;

namespace {

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Deterministic choices shared by every rank.
struct Rng {
  uint64_t s;
  uint64_t next() { return s = mix(s); }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
};

void put(DataType t, void* b, size_t i, double v) {
  switch (t) {
    case DataType::kFloat64:
      static_cast<double*>(b)[i] = v;
      break;
    case DataType::kFloat32:
      static_cast<float*>(b)[i] = static_cast<float>(v);
      break;
    case DataType::kFloat16:
      static_cast<Float16*>(b)[i] = fromFloat<Float16>(static_cast<float>(v));
      break;
    case DataType::kBFloat16:
      static_cast<BFloat16*>(b)[i] = fromFloat<BFloat16>(static_cast<float>(v));
      break;
    case DataType::kFloat8E4M3:
      static_cast<Float8E4M3*>(b)[i] = fromFloat<Float8E4M3>(static_cast<float>(v));
      break;
    case DataType::kFloat8E5M2:
      static_cast<Float8E5M2*>(b)[i] = fromFloat<Float8E5M2>(static_cast<float>(v));
      break;
    case DataType::kInt8:
      static_cast<int8_t*>(b)[i] = static_cast<int8_t>(v);
      break;
    case DataType::kUInt8:
      static_cast<uint8_t*>(b)[i] = static_cast<uint8_t>(v);
      break;
    case DataType::kInt32:
      static_cast<int32_t*>(b)[i] = static_cast<int32_t>(v);
      break;
    case DataType::kUInt32:
      static_cast<uint32_t*>(b)[i] = static_cast<uint32_t>(v);
      break;
    case DataType::kInt64:
      static_cast<int64_t*>(b)[i] = static_cast<int64_t>(v);
      break;
    case DataType::kUInt64:
      static_cast<uint64_t*>(b)[i] = static_cast<uint64_t>(v);
      break;
  }
}

double get(DataType t, const void* b, size_t i) {
  switch (t) {
    case DataType::kFloat64:
      return static_cast<const double*>(b)[i];
    case DataType::kFloat32:
      return static_cast<const float*>(b)[i];
    case DataType::kFloat16:
      return toFloat(static_cast<const Float16*>(b)[i]);
    case DataType::kBFloat16:
      return toFloat(static_cast<const BFloat16*>(b)[i]);
    case DataType::kFloat8E4M3:
      return toFloat(static_cast<const Float8E4M3*>(b)[i]);
    case DataType::kFloat8E5M2:
      return toFloat(static_cast<const Float8E5M2*>(b)[i]);
    case DataType::kInt8:
      return static_cast<const int8_t*>(b)[i];
    case DataType::kUInt8:
      return static_cast<const uint8_t*>(b)[i];
    case DataType::kInt32:
      return static_cast<const int32_t*>(b)[i];
    case DataType::kUInt32:
      return static_cast<const uint32_t*>(b)[i];
    case DataType::kInt64:
      return static_cast<const int64_t*>(b)[i];
    case DataType::kUInt64:
      return static_cast<const uint64_t*>(b)[i];
  }
  return NAN;
}

bool isFloat(DataType t) {
  return t == DataType::kFloat64 || t == DataType::kFloat32 || t == DataType::kFloat16 ||
         t == DataType::kBFloat16 || t == DataType::kFloat8E4M3 || t == DataType::kFloat8E5M2;
}
bool isUnsigned(DataType t) {
  return t == DataType::kUInt8 || t == DataType::kUInt32 || t == DataType::kUInt64;
}
bool isFp8(DataType t) {
  return t == DataType::kFloat8E4M3 || t == DataType::kFloat8E5M2;
}

// Input of `rank` at element i for a reduction: small integers that keep every partial
// result exact for up to 8 ranks in every type (fp8 E5M2 has 2 mantissa bits).
double input(ReduceOp op, DataType t, uint64_t seed, int rank, size_t i) {
  const uint64_t h = mix(seed ^ mix(static_cast<uint64_t>(rank) * 7919 + i));
  const uint64_t hi = mix(seed ^ mix(i));  // rank-independent (avg)
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kPreMulSum:
      if (isUnsigned(t)) return static_cast<double>(h % 3);
      return isFp8(t) ? static_cast<double>(h % 3) - 1 : static_cast<double>(h % 5) - 2;
    case ReduceOp::kAvg:
      return isUnsigned(t) ? static_cast<double>(hi % 3) : static_cast<double>(hi % 5) - 2;
    case ReduceOp::kProd:
      if (isFloat(t)) return h % 2 ? 2.0 : 1.0;
      return isUnsigned(t) ? static_cast<double>(h % 2) : (h % 2 ? -1.0 : 1.0);
    case ReduceOp::kMin:
    case ReduceOp::kMax:
      return isUnsigned(t) ? static_cast<double>(h % 17) : static_cast<double>(h % 17) - 8;
  }
  return 0;
}

double expected(ReduceOp op, DataType t, uint64_t seed, int p, size_t i, double premul) {
  double acc = input(op, t, seed, 0, i);
  if (op == ReduceOp::kPreMulSum) acc *= premul;
  for (int r = 1; r < p; ++r) {
    const double v = input(op, t, seed, r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc += v;
        break;
      case ReduceOp::kPreMulSum:
        acc += premul * v;
        break;
      case ReduceOp::kProd:
        acc *= v;
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
    }
  }
  return op == ReduceOp::kAvg ? acc / p : acc;
}

uint8_t byteOf(uint64_t seed, int rank, size_t i) {
  return static_cast<uint8_t>(mix(seed ^ mix((static_cast<uint64_t>(rank) << 40) + i)));
}

struct Options {
  double seconds = 60;
  uint64_t seed = 1;
  int max_ranks = 6;
  size_t max_count = 1 << 17;
  int ops_per_round = 60;
  int stall_seconds = 20;    // a call polled with hasFinished() alone must finish within this
  std::string stall_stacks;  // a folder: the stall watch writes each rank's thread stacks there (gdb)
  // --replay "SEED RANKS PER_NODE CHECK POLL THREADS": every round is that round (as a
  // round's line prints it), to chase a failure that depends on timing.
  std::string replay;
  // Threads on duplicates in rounds with several virtual nodes: 0 never, 1 as in one-node
  // rounds, 2 every round (several nodes, 2-3 threads: to chase what only they do; it
  // found the store client's cross-thread stall, docs/reliability.md, Soak).
  int node_threads = 1;
};

// One issued operation: its buffers (kept until it completes), its Work, and the
// check of its result (run after it completed).
struct Pending {
  std::vector<uint8_t> send, recv;
  WorkPtr work;
  std::function<void()> check;
  std::vector<std::unique_ptr<Pending>> parts;  // a group's operations (their Work is the group's)
  std::string desc;
};

// How a rank completes its issued operations (its own choice: ranks must issue the
// same operations in the same order, but may complete them in any order and way).
enum class Completion { kWait, kPollTest, kSleepThenWait, kPollFinished, kOtherThread };
constexpr int kNumCompletions = 5;
const char* completionName(Completion c) {
  const char* names[] = {"wait", "poll test()", "sleep then wait", "poll hasFinished()",
                         "wait on another thread"};
  return names[static_cast<int>(c)];
}

// Completes `op` the way `how` says; false when hasFinished() never turned true within
// `stall` (then it waits, so the round still ends): nonblocking calls nobody waits for
// must still run (the worker thread looks for them).
bool complete(Pending& op, Completion how, Rng& rng, std::chrono::seconds stall) {
  switch (how) {
    case Completion::kWait:
      op.work->wait();
      return true;
    case Completion::kPollTest:
      while (!op.work->test()) std::this_thread::yield();
      return true;
    case Completion::kSleepThenWait:
      std::this_thread::sleep_for(std::chrono::microseconds(rng.below(3000)));
      op.work->wait();
      return true;
    case Completion::kPollFinished: {
      const auto until = std::chrono::steady_clock::now() + stall;
      bool finished = false;
      while (!(finished = op.work->hasFinished()) && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      op.work->wait();  // rethrows its error
      return finished;
    }
    case Completion::kOtherThread: {
      std::exception_ptr err;
      std::thread t([&] {
        try {
          op.work->wait();
        } catch (...) {
          err = std::current_exception();
        }
      });
      t.join();
      if (err) std::rethrow_exception(err);
      return true;
    }
  }
  return true;
}

// Stall watch (per rank process): when none of this rank's streams completed a call for
// half the stall bound, every rank prints its queues' state once (Collectives::state()),
// so a stall report shows the ranks holding the call up, not only the one polling it.
std::atomic<int64_t> g_last_completion_ns{0};
int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
void noteCompletion() {
  g_last_completion_ns.store(nowNs(), std::memory_order_relaxed);
}

class StallWatch {
 public:
  StallWatch(std::vector<const Collectives*> colls, int rank, std::chrono::seconds after,
             std::string stacks_dir)
      : colls_(std::move(colls)), rank_(rank), after_(after), stacks_dir_(std::move(stacks_dir)) {
    noteCompletion();
    thread_ = std::thread([this] { run(); });
  }
  ~StallWatch() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void run() {
    int64_t reported_for = -1;  // the last completion already reported as stalled
    std::unique_lock<std::mutex> lk(m_);
    while (!cv_.wait_for(lk, std::chrono::milliseconds(200), [&] { return stop_; })) {
      const int64_t last = g_last_completion_ns.load(std::memory_order_relaxed);
      if (last == reported_for || nowNs() - last < std::chrono::nanoseconds(after_).count()) continue;
      reported_for = last;
      std::string lines;
      for (const Collectives* c : colls_) lines += fmt::format("soak:   {}\n", c->state());
      fmt::print(stderr, "soak: rank {}: no call completed for {} s; queues:\n{}", rank_, after_.count(),
                 lines);
      if (!stacks_dir_.empty()) {
        // Every thread's stack, from gdb attached to this process (it stops us meanwhile).
        const std::string file = fmt::format("{}/rank{}-pid{}.txt", stacks_dir_, rank_, getpid());
        const std::string cmd = fmt::format(
            "gdb -p {} -batch -ex 'set pagination off' -ex 'thread apply all bt' > {} 2>&1", getpid(), file);
        const int rc = std::system(cmd.c_str());
        fmt::print(stderr, "soak: rank {}: thread stacks in {} (gdb exit {})\n", rank_, file, rc);
      }
    }
  }
  std::vector<const Collectives*> colls_;
  int rank_;
  std::chrono::seconds after_;
  std::string stacks_dir_;
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// One stream of `ops` operations on `coll`, drawn from `stream_seed` (the same on every
// rank), completed this rank's own way. Wrong results and errors go to `report`.
void runStream(Collectives& coll, uint64_t stream_seed, int ops, const Options& opt,
               const std::function<void(const std::string&)>& report) {
  const int rank = coll.comm().rank(), p = coll.comm().size();
  const CollType kinds[] = {CollType::kAllreduce, CollType::kAllgather, CollType::kReduceScatter,
                            CollType::kBroadcast, CollType::kReduce,    CollType::kAlltoall,
                            CollType::kAlltoallv, CollType::kGather,    CollType::kScatter,
                            CollType::kBarrier};
  Rng rng{stream_seed};                               // the same on every rank: what is issued
  Rng mine{mix(stream_seed ^ (0x5bd1e995u + rank))};  // this rank's own: how it completes
  // How many operations this rank issues before it completes them (1: each is waited for
  // before the next is issued).
  const int depth = 1 + mine.below(8);
  std::vector<std::unique_ptr<Pending>> pending;  // the buffers of calls in flight
  auto issue = [&](int n) {
    auto P = std::make_unique<Pending>();
    std::vector<uint8_t>& send = P->send;
    std::vector<uint8_t>& recv = P->recv;
    const uint64_t seed = rng.next();
    const CollType kind = kinds[rng.below(10)];
    const bool reduction =
        kind == CollType::kAllreduce || kind == CollType::kReduceScatter || kind == CollType::kReduce;
    DataType t = static_cast<DataType>(rng.below(kNumDataTypes));
    ReduceOp op = static_cast<ReduceOp>(rng.below(kNumReduceOps));
    if (reduction && !isSupported(t, op)) op = ReduceOp::kSum;
    const double premul = 2.0;
    // Log-uniform counts, a few zeros.
    const int bits = rng.below(static_cast<int>(std::log2(static_cast<double>(opt.max_count))) + 2);
    const size_t count = bits == 0 ? 0 : (size_t{1} << (bits - 1)) + rng.next() % (size_t{1} << (bits - 1));
    const int root = rng.below(p);
    const bool in_place = rng.below(3) == 0;
    CollOptions o;
    o.premul_scalar = premul;
    // Half the time a random algorithm of this collective (the table falls back when it
    // does not apply), else the table's choice.
    std::vector<std::string> names;
    for (const Algorithm& a : algorithms())
      if (a.coll == kind) names.push_back(a.name);
    if (!names.empty() && rng.below(2)) o.algorithm = names[rng.below(static_cast<int>(names.size()))];
    const size_t es = elementSize(t);
    P->desc =
        fmt::format("#{} {} {} x {} {} root {}{} algo '{}' ({} ranks)", n, collTypeName(kind), count,
                    dataTypeName(t), reduceOpName(op), root, in_place ? " in place" : "", o.algorithm, p);
    const std::string desc = P->desc;
    auto fillBytes = [seed](std::vector<uint8_t>& b, size_t from, size_t bytes, int who) {
      for (size_t i = 0; i < bytes; ++i) b[from + i] = byteOf(seed, who, i);
    };
    auto checkBytes = [seed, desc, report](const std::vector<uint8_t>& b, size_t from, size_t bytes, int who,
                                           const std::string& where) mutable {
      for (size_t i = 0; i < bytes; ++i)
        if (b[from + i] != byteOf(seed, who, i)) {
          report(fmt::format("{}: {} byte {} is {}, expected {}", desc, where, i, b[from + i],
                             byteOf(seed, who, i)));
          return;
        }
    };
    auto checkReduced = [=](const void* out, size_t n_elems, size_t first, const std::string& where) mutable {
      for (size_t i = 0; i < n_elems; ++i) {
        const double want = expected(op, t, seed, p, first + i, premul), got = get(t, out, i);
        if (got != want) {
          report(fmt::format("{}: {} element {} is {}, expected {}", desc, where, first + i, got, want));
          return;
        }
      }
    };
    Pending& Q = *P;
    switch (kind) {
      case CollType::kAllreduce: {
        send.resize(count * es);
        for (size_t i = 0; i < count; ++i) put(t, send.data(), i, input(op, t, seed, rank, i));
        recv.resize(count * es);
        void* out = in_place ? send.data() : recv.data();
        Q.work = coll.allreduce(send.data(), out, count, t, op, o);
        Q.check = [=]() mutable { checkReduced(out, count, 0, "allreduce"); };
        break;
      }
      case CollType::kReduceScatter: {
        send.resize(count * p * es);
        for (size_t i = 0; i < count * p; ++i) put(t, send.data(), i, input(op, t, seed, rank, i));
        recv.resize(count * es);
        void* out = in_place ? send.data() + rank * count * es : recv.data();
        Q.work = coll.reduceScatter(send.data(), out, count, t, op, o);
        Q.check = [=]() mutable { checkReduced(out, count, rank * count, "reduce_scatter"); };
        break;
      }
      case CollType::kReduce: {
        send.resize(count * es);
        for (size_t i = 0; i < count; ++i) put(t, send.data(), i, input(op, t, seed, rank, i));
        recv.resize(count * es);
        void* out = in_place ? send.data() : recv.data();
        Q.work = coll.reduce(send.data(), out, count, t, op, root, o);
        Q.check = [=]() mutable {
          if (rank == root) checkReduced(out, count, 0, "reduce (root)");
        };
        break;
      }
      case CollType::kAllgather: {
        recv.resize(count * p * es);
        send.resize(count * es);
        fillBytes(send, 0, count * es, rank);
        const void* in = send.data();
        if (in_place) {
          fillBytes(recv, rank * count * es, count * es, rank);
          in = recv.data() + rank * count * es;
        }
        Q.work = coll.allgather(in, recv.data(), count, t, o);
        Q.check = [=, &Q]() mutable {
          for (int r = 0; r < p; ++r)
            checkBytes(Q.recv, r * count * es, count * es, r, fmt::format("block {}", r));
        };
        break;
      }
      case CollType::kBroadcast: {
        send.resize(count * es);
        if (rank == root)
          fillBytes(send, 0, count * es, root);
        else
          std::fill(send.begin(), send.end(), uint8_t{0xA5});
        Q.work = coll.broadcast(send.data(), count, t, root, o);
        Q.check = [=, &Q]() mutable { checkBytes(Q.send, 0, count * es, root, "broadcast"); };
        break;
      }
      case CollType::kAlltoall: {
        // Block to rank r: byteOf(seed, rank * 64 + r, i).
        send.resize(count * p * es);
        recv.resize(count * p * es);
        for (int r = 0; r < p; ++r) fillBytes(send, r * count * es, count * es, rank * 64 + r);
        void* out = in_place ? send.data() : recv.data();
        Q.work = coll.alltoall(send.data(), out, count, t, o);
        Q.check = [=, &Q]() mutable {
          const auto& res = in_place ? Q.send : Q.recv;
          for (int r = 0; r < p; ++r)
            checkBytes(res, r * count * es, count * es, r * 64 + rank, fmt::format("block from {}", r));
        };
        break;
      }
      case CollType::kAlltoallv: {
        // Count from s to d: a closed form both sides can compute; blocks packed in order.
        auto cnt = [&](int s, int d) {
          return count == 0 ? 0 : static_cast<size_t>(mix(seed + s * 131 + d) % (count + 1));
        };
        std::vector<size_t> sc(p), sd(p), rc(p), rd(p);
        size_t so = 0, ro = 0;
        for (int r = 0; r < p; ++r) {
          sc[r] = cnt(rank, r);
          sd[r] = so;
          so += sc[r];
          rc[r] = cnt(r, rank);
          rd[r] = ro;
          ro += rc[r];
        }
        send.resize(so * es);
        recv.resize(ro * es);
        for (int r = 0; r < p; ++r) fillBytes(send, sd[r] * es, sc[r] * es, rank * 64 + r);
        Q.work = coll.alltoallv(send.data(), sc, sd, recv.data(), rc, rd, t, o);
        Q.check = [=, &Q]() mutable {
          for (int r = 0; r < p; ++r)
            checkBytes(Q.recv, rd[r] * es, rc[r] * es, r * 64 + rank, fmt::format("block from {}", r));
        };
        break;
      }
      case CollType::kGather: {
        send.resize(count * es);
        recv.resize(count * p * es);
        fillBytes(send, 0, count * es, rank);
        const void* in = send.data();
        if (in_place && rank == root) {
          fillBytes(recv, root * count * es, count * es, root);
          in = recv.data() + root * count * es;
        }
        Q.work = coll.gather(in, recv.data(), count, root, t, o);
        Q.check = [=, &Q]() mutable {
          if (rank == root)
            for (int r = 0; r < p; ++r)
              checkBytes(Q.recv, r * count * es, count * es, r, fmt::format("block {}", r));
        };
        break;
      }
      case CollType::kScatter: {
        send.resize(count * p * es);
        recv.resize(count * es);
        if (rank == root)
          for (int r = 0; r < p; ++r) fillBytes(send, r * count * es, count * es, 64 + r);
        void* out = in_place && rank == root ? send.data() + root * count * es : recv.data();
        Q.work = coll.scatter(send.data(), out, count, root, t, o);
        Q.check = [=]() mutable {
          std::vector<uint8_t> got(static_cast<uint8_t*>(out), static_cast<uint8_t*>(out) + count * es);
          checkBytes(got, 0, count * es, 64 + rank, "scatter");
        };
        break;
      }
      case CollType::kBarrier:
        Q.work = coll.barrier(o);
        Q.check = [] {};
        break;
      default:
        break;
    }
    return P;
  };
  // A ring exchange inside a group: send to the next rank, receive from the previous one.
  auto issueRing = [&](int n) {
    auto P = std::make_unique<Pending>();
    const uint64_t seed = rng.next();
    const int bits = rng.below(static_cast<int>(std::log2(static_cast<double>(opt.max_count))) + 2);
    const size_t bytes = bits == 0 ? 0 : (size_t{1} << (bits - 1)) + rng.next() % (size_t{1} << (bits - 1));
    const int next = (rank + 1) % p, prev = (rank + p - 1) % p;
    const auto tag = static_cast<uint32_t>(n);
    P->desc = fmt::format("#{} ring send/recv of {} bytes, tag {} ({} ranks)", n, bytes, tag, p);
    P->send.resize(bytes);
    P->recv.assign(bytes, 0xA5);
    for (size_t i = 0; i < bytes; ++i) P->send[i] = byteOf(seed, rank, i);
    P->work = coll.send(P->send.data(), bytes, DataType::kUInt8, next, tag);
    coll.recv(P->recv.data(), bytes, DataType::kUInt8, prev, tag);
    Pending& Q = *P;
    P->check = [&Q, seed, prev, bytes, report]() mutable {
      for (size_t i = 0; i < bytes; ++i)
        if (Q.recv[i] != byteOf(seed, prev, i)) {
          report(fmt::format("{}: byte {} from rank {} is {}, expected {}", Q.desc, i, prev, Q.recv[i],
                             byteOf(seed, prev, i)));
          return;
        }
    };
    return P;
  };
  // One operation, or now and then a group of 1-3 collectives, half of the groups with a
  // ring exchange (point to point needs a group: lone sends in a ring wait for each other).
  auto issueNext = [&](int n) {
    if (rng.below(6) != 0) return issue(n);
    auto G = std::make_unique<Pending>();
    coll.groupStart();
    const int members = 1 + rng.below(3);
    for (int i = 0; i < members; ++i) G->parts.push_back(issue(n));
    if (rng.below(2)) G->parts.push_back(issueRing(n));
    G->work = coll.groupEnd();
    G->desc = fmt::format("#{} group of {}", n, G->parts.size());
    for (const auto& part : G->parts) G->desc += ", " + part->desc;
    Pending& Q = *G;
    G->check = [&Q] {
      for (const auto& part : Q.parts) part->check();
    };
    return G;
  };
  // Completes the issued operations in an order and ways of this rank's own choosing.
  auto completeAll = [&] {
    std::vector<size_t> order(pending.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    switch (mine.below(3)) {
      case 0:
        break;  // in issue order
      case 1:
        std::reverse(order.begin(), order.end());
        break;
      default:
        for (size_t i = order.size(); i > 1; --i)
          std::swap(order[i - 1], order[mine.below(static_cast<int>(i))]);
    }
    for (size_t i : order) {
      Pending& op = *pending[i];
      const auto how = depth == 1 && mine.below(2) ? Completion::kWait
                                                   : static_cast<Completion>(mine.below(kNumCompletions));
      bool ran = false;
      try {
        ran = complete(op, how, mine, std::chrono::seconds(opt.stall_seconds));
      } catch (const std::exception& e) {
        throw std::runtime_error(
            fmt::format("{} (completed by {}): {}", op.desc, completionName(how), e.what()));
      }
      if (!ran)
        report(
            fmt::format("{}: not finished {} s after it was issued while this rank polled hasFinished() "
                        "(a call nobody waits for did not run)",
                        op.desc, opt.stall_seconds));
      op.check();
      noteCompletion();
    }
    pending.clear();
  };
  try {
    for (int n = 0; n < ops; ++n) {
      pending.push_back(issueNext(n));
      if (static_cast<int>(pending.size()) >= depth) completeAll();
    }
    completeAll();
  } catch (const std::exception& e) {
    report(fmt::format("error {} (this rank issues {} calls before completing them)", e.what(), depth));
    // The Collectives is sticky-failed now: finish what is in flight before its buffers go.
    for (auto& op : pending) try {
        op->work->wait();
      } catch (...) {
      }
  }
}

// The ranks of one round. Returns the number of wrong results (0: all good). `streams`
// > 1: that many duplicates of the communicator, each with its own Collectives driven by
// its own thread at the same time (as torch does with several process groups).
int runRank(int rank, int size, std::shared_ptr<Store> store, const Options& opt, uint64_t round_seed,
            int ranks_per_node, const char* check_mode, const char* start_poll_us, int streams) {
  setenv("CROSSBAR_CHECK_CALLS", check_mode, 1);
  setenv("CROSSBAR_COLL_START_POLL_US", start_poll_us, 1);
  CommOptions co;
  co.ranks_per_node = ranks_per_node;
  co.timeout = Millis(120'000);
  auto comm = Communicator::create(store, rank, size, co);
  std::atomic<int> errors{0};
  auto report = [&](const std::string& what) {
    if (++errors <= 5) fmt::print(stderr, "soak: rank {}: WRONG {}\n", rank, what);
  };
  const auto watch_after = std::chrono::seconds(std::max(opt.stall_seconds / 2, 1));
  if (streams <= 1) {
    Collectives coll(comm);
    StallWatch watch({&coll}, rank, watch_after, opt.stall_stacks);
    runStream(coll, round_seed, opt.ops_per_round, opt, report);
  } else {
    std::vector<std::shared_ptr<Communicator>> dups;
    std::vector<std::unique_ptr<Collectives>> colls;
    for (int i = 0; i < streams; ++i) {
      dups.push_back(comm->dup());
      colls.push_back(std::make_unique<Collectives>(dups.back()));
    }
    {
      std::vector<const Collectives*> watched;
      for (auto& c : colls) watched.push_back(c.get());
      StallWatch watch(watched, rank, watch_after, opt.stall_stacks);  // stops before the Collectives go
      std::vector<std::thread> threads;
      for (int i = 0; i < streams; ++i)
        threads.emplace_back([&, i] {
          runStream(*colls[i], mix(round_seed + static_cast<uint64_t>(i) + 1), opt.ops_per_round / streams,
                    opt, [&, i](const std::string& what) { report(fmt::format("stream {}: {}", i, what)); });
        });
      for (auto& t : threads) t.join();
    }
    colls.clear();
    for (auto& d : dups) d->destroy();
  }
  comm->destroy();
  return errors;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--seconds")
      opt.seconds = std::stod(v);
    else if (k == "--seed")
      opt.seed = std::stoull(v);
    else if (k == "--max-ranks")
      opt.max_ranks = std::stoi(v);
    else if (k == "--max-count")
      opt.max_count = std::stoull(v);
    else if (k == "--ops")
      opt.ops_per_round = std::stoi(v);
    else if (k == "--stall-seconds")
      opt.stall_seconds = std::stoi(v);
    else if (k == "--stall-stacks")
      opt.stall_stacks = v;
    else if (k == "--replay")
      opt.replay = v;
    else if (k == "--node-threads")
      opt.node_threads = std::stoi(v);
    else {
      fmt::print(stderr,
                 "usage: crossbar-soak [--seconds S] [--seed N] [--max-ranks R] [--max-count C] [--ops K] "
                 "[--stall-seconds T] [--stall-stacks DIR] [--replay 'SEED RANKS PER_NODE CHECK POLL "
                 "THREADS'] [--node-threads 0|1|2]\n");
      return 2;
    }
  }
  opt.max_ranks = std::max(opt.max_ranks, 2);
  opt.max_count = std::max<size_t>(opt.max_count, 2);
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  const char* modes[] = {"cheap", "full", "off"};
  const char* polls[] = {"500", "50", "0"};  // CROSSBAR_COLL_START_POLL_US
  Rng rng{opt.seed};
  int rounds = 0, failed = 0;
  long ops = 0;
  while (elapsed() < opt.seconds) {
    uint64_t round_seed = rng.next();
    int p = 2 + rng.below(opt.max_ranks - 1);
    // Virtual nodes a third of the time (UCX across them, hierarchical algorithms).
    std::vector<int> divisors;
    for (int d = 1; d < p; ++d)
      if (p % d == 0) divisors.push_back(d);
    int rpn = rng.below(3) == 0 || opt.node_threads == 2
                  ? divisors[rng.below(static_cast<int>(divisors.size()))]
                  : p;
    const char* mode = modes[rng.below(3)];
    const char* poll = polls[rng.below(3)];
    int streams = rng.below(4) == 0 || opt.node_threads == 2 ? 2 + rng.below(2) : 1;  // threads on duplicates
    if (rpn < p && opt.node_threads == 0) streams = 1;
    if (!opt.replay.empty()) {
      std::istringstream in(opt.replay);
      std::string seed_text, check, start_poll;
      in >> seed_text >> p >> rpn >> check >> start_poll >> streams;
      round_seed = std::stoull(seed_text, nullptr, 0);
      auto m = std::find_if(std::begin(modes), std::end(modes), [&](const char* c) { return check == c; });
      auto u =
          std::find_if(std::begin(polls), std::end(polls), [&](const char* c) { return start_poll == c; });
      if (!in || m == std::end(modes) || u == std::end(polls) || p < 1 || rpn < 1 || streams < 1) {
        fmt::print(stderr,
                   "soak: --replay '{}': expected SEED RANKS PER_NODE CHECK(cheap|full|off) "
                   "POLL(500|50|0) THREADS\n",
                   opt.replay);
        return 2;
      }
      mode = *m;
      poll = *u;
    }
    auto exits = launchLocalRanks(
        p,
        [&](int rank, int size, std::shared_ptr<Store> store) {
          return std::min(runRank(rank, size, std::move(store), opt, round_seed, rpn, mode, poll, streams),
                          100);
        },
        LocalLaunchOptions{Millis(600'000)});
    const int rc = combinedExitCode(exits);
    ++rounds;
    ops += opt.ops_per_round;
    if (rc != 0) ++failed;
    fmt::print(
        "soak: round {:4} seed {:#018x}: {} ranks, {} per node, check {:5}, start poll {:>3} us, {} "
        "thread(s): {} "
        "({:.0f} s, {} ops so far)\n",
        rounds, round_seed, p, rpn, mode, poll, streams, rc == 0 ? "ok" : fmt::format("FAILED (exit {})", rc),
        elapsed(), ops);
    std::fflush(stdout);
  }
  fmt::print(
      "soak: {} rounds, {} operations (each checked on every rank), {} rounds failed, {:.0f} s, seed {}\n",
      rounds, ops, failed, elapsed(), opt.seed);
  return failed ? 1 : 0;
}
