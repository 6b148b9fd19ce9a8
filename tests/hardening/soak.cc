// crossbar-soak: random collectives, sizes, types, ops, algorithms and rank counts for a
// set time, checking every result. Run through scripts/soak.sh (not in CI).
//
// Each round forks 2..max ranks (sometimes split into virtual nodes, so UCX and the
// hierarchical algorithms run too), picks a call-check mode, and runs a sequence of
// operations that every rank derives from (seed, round, op): the same choices on
// every rank without talking. Data is a closed form of (seed, op, rank, index):
// small integers for reductions, chosen per op and type so every partial result is
// exact in any order; hashed bytes for data movement (compared bit for bit).
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
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
};

// The ranks of one round. Returns the number of wrong results (0: all good).
int runRank(int rank, int size, std::shared_ptr<Store> store, const Options& opt, uint64_t round_seed,
            int ranks_per_node, const char* check_mode) {
  setenv("CROSSBAR_CHECK_CALLS", check_mode, 1);
  CommOptions co;
  co.ranks_per_node = ranks_per_node;
  co.timeout = Millis(120'000);
  auto comm = Communicator::create(store, rank, size, co);
  Collectives coll(comm);
  const int p = size;
  int errors = 0;
  auto report = [&](const std::string& what) {
    if (++errors <= 5) fmt::print(stderr, "soak: rank {}: WRONG {}\n", rank, what);
  };
  const CollType kinds[] = {CollType::kAllreduce, CollType::kAllgather, CollType::kReduceScatter,
                            CollType::kBroadcast, CollType::kReduce,    CollType::kAlltoall,
                            CollType::kAlltoallv, CollType::kGather,    CollType::kScatter,
                            CollType::kBarrier};
  Rng rng{round_seed};
  for (int n = 0; n < opt.ops_per_round; ++n) {
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
    const std::string desc =
        fmt::format("#{} {} {} x {} {} root {}{} algo '{}' ({} ranks)", n, collTypeName(kind), count,
                    dataTypeName(t), reduceOpName(op), root, in_place ? " in place" : "", o.algorithm, p);
    std::vector<uint8_t> send, recv;
    auto fillBytes = [&](std::vector<uint8_t>& b, size_t from, size_t bytes, int who) {
      for (size_t i = 0; i < bytes; ++i) b[from + i] = byteOf(seed, who, i);
    };
    auto checkBytes = [&](const std::vector<uint8_t>& b, size_t from, size_t bytes, int who,
                          const std::string& where) {
      for (size_t i = 0; i < bytes; ++i)
        if (b[from + i] != byteOf(seed, who, i)) {
          report(fmt::format("{}: {} byte {} is {}, expected {}", desc, where, i, b[from + i],
                             byteOf(seed, who, i)));
          return;
        }
    };
    auto checkReduced = [&](const void* out, size_t n_elems, size_t first, const std::string& where) {
      for (size_t i = 0; i < n_elems; ++i) {
        const double want = expected(op, t, seed, p, first + i, premul), got = get(t, out, i);
        if (got != want) {
          report(fmt::format("{}: {} element {} is {}, expected {}", desc, where, first + i, got, want));
          return;
        }
      }
    };
    try {
      switch (kind) {
        case CollType::kAllreduce: {
          send.resize(count * es);
          for (size_t i = 0; i < count; ++i) put(t, send.data(), i, input(op, t, seed, rank, i));
          recv.resize(count * es);
          void* out = in_place ? send.data() : recv.data();
          coll.allreduce(send.data(), out, count, t, op, o)->wait();
          checkReduced(out, count, 0, "allreduce");
          break;
        }
        case CollType::kReduceScatter: {
          send.resize(count * p * es);
          for (size_t i = 0; i < count * p; ++i) put(t, send.data(), i, input(op, t, seed, rank, i));
          recv.resize(count * es);
          void* out = in_place ? send.data() + rank * count * es : recv.data();
          coll.reduceScatter(send.data(), out, count, t, op, o)->wait();
          checkReduced(out, count, rank * count, "reduce_scatter");
          break;
        }
        case CollType::kReduce: {
          send.resize(count * es);
          for (size_t i = 0; i < count; ++i) put(t, send.data(), i, input(op, t, seed, rank, i));
          recv.resize(count * es);
          void* out = in_place ? send.data() : recv.data();
          coll.reduce(send.data(), out, count, t, op, root, o)->wait();
          if (rank == root) checkReduced(out, count, 0, "reduce (root)");
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
          coll.allgather(in, recv.data(), count, t, o)->wait();
          for (int r = 0; r < p; ++r)
            checkBytes(recv, r * count * es, count * es, r, fmt::format("block {}", r));
          break;
        }
        case CollType::kBroadcast: {
          send.resize(count * es);
          if (rank == root)
            fillBytes(send, 0, count * es, root);
          else
            std::memset(send.data(), 0xA5, send.size());
          coll.broadcast(send.data(), count, t, root, o)->wait();
          checkBytes(send, 0, count * es, root, "broadcast");
          break;
        }
        case CollType::kAlltoall: {
          // Block to rank r: byteOf(seed, rank * 64 + r, i).
          send.resize(count * p * es);
          recv.resize(count * p * es);
          for (int r = 0; r < p; ++r) fillBytes(send, r * count * es, count * es, rank * 64 + r);
          void* out = in_place ? send.data() : recv.data();
          coll.alltoall(send.data(), out, count, t, o)->wait();
          const auto& res = in_place ? send : recv;
          for (int r = 0; r < p; ++r)
            checkBytes(res, r * count * es, count * es, r * 64 + rank, fmt::format("block from {}", r));
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
          coll.alltoallv(send.data(), sc, sd, recv.data(), rc, rd, t, o)->wait();
          for (int r = 0; r < p; ++r)
            checkBytes(recv, rd[r] * es, rc[r] * es, r * 64 + rank, fmt::format("block from {}", r));
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
          coll.gather(in, recv.data(), count, root, t, o)->wait();
          if (rank == root)
            for (int r = 0; r < p; ++r)
              checkBytes(recv, r * count * es, count * es, r, fmt::format("block {}", r));
          break;
        }
        case CollType::kScatter: {
          send.resize(count * p * es);
          recv.resize(count * es);
          if (rank == root)
            for (int r = 0; r < p; ++r) fillBytes(send, r * count * es, count * es, 64 + r);
          void* out = in_place && rank == root ? send.data() + root * count * es : recv.data();
          coll.scatter(send.data(), out, count, root, t, o)->wait();
          std::vector<uint8_t> got(static_cast<uint8_t*>(out), static_cast<uint8_t*>(out) + count * es);
          checkBytes(got, 0, count * es, 64 + rank, "scatter");
          break;
        }
        case CollType::kBarrier:
          coll.barrier(o)->wait();
          break;
        default:
          break;
      }
    } catch (const std::exception& e) {
      report(fmt::format("{}: error {}", desc, e.what()));
      break;  // the Collectives is sticky-failed now
    }
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
    else {
      fmt::print(stderr,
                 "usage: crossbar-soak [--seconds S] [--seed N] [--max-ranks R] [--max-count C] [--ops K]\n");
      return 2;
    }
  }
  opt.max_ranks = std::max(opt.max_ranks, 2);
  opt.max_count = std::max<size_t>(opt.max_count, 2);
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  const char* modes[] = {"cheap", "full", "off"};
  Rng rng{opt.seed};
  int rounds = 0, failed = 0;
  long ops = 0;
  while (elapsed() < opt.seconds) {
    const uint64_t round_seed = rng.next();
    const int p = 2 + rng.below(opt.max_ranks - 1);
    // Virtual nodes a third of the time (UCX across them, hierarchical algorithms).
    std::vector<int> divisors;
    for (int d = 1; d < p; ++d)
      if (p % d == 0) divisors.push_back(d);
    const int rpn = rng.below(3) == 0 ? divisors[rng.below(static_cast<int>(divisors.size()))] : p;
    const char* mode = modes[rng.below(3)];
    auto exits = launchLocalRanks(
        p,
        [&](int rank, int size, std::shared_ptr<Store> store) {
          return std::min(runRank(rank, size, std::move(store), opt, round_seed, rpn, mode), 100);
        },
        LocalLaunchOptions{Millis(600'000)});
    const int rc = combinedExitCode(exits);
    ++rounds;
    ops += opt.ops_per_round;
    if (rc != 0) ++failed;
    fmt::print(
        "soak: round {:4} seed {:#018x}: {} ranks, {} per node, check {:5}: {} ({:.0f} s, {} ops so far)\n",
        rounds, round_seed, p, rpn, mode, rc == 0 ? "ok" : fmt::format("FAILED (exit {})", rc), elapsed(),
        ops);
    std::fflush(stdout);
  }
  fmt::print(
      "soak: {} rounds, {} operations (each checked on every rank), {} rounds failed, {:.0f} s, seed {}\n",
      rounds, ops, failed, elapsed(), opt.seed);
  return failed ? 1 : 0;
}
