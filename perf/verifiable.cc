// Verifiable data: inputs from (seed, rank, index) whose reductions are exact in any
// order, so one reference fold per element checks every algorithm bit for bit.
//
// Why exact: floating sums use integers whose every partial sum stays within the type's
// exactly-representable range (2^11 for half, 2^3 for e5m2, ...); products use +-1 and +-2
// with a bounded number of 2s (powers of two never round); min/max never round; integer
// sums and products wrap modulo 2^bits, which is associative.
#include <cstring>
#include <type_traits>

#include "collectives/reduce.h"
#include "perf/driver.h"

namespace crossbar::perf {
namespace {

inline uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint64_t hashOf(uint64_t seed, int64_t rank, uint64_t index) {
  return mix(mix(seed * 0x2545F4914F6CDD1Dull + static_cast<uint64_t>(rank + 1)) ^ index);
}

enum class Mode {
  kBits,     // arbitrary bit patterns (data movement; integer sum/min/max/avg)
  kOddBits,  // odd integers (integer products stay non-zero)
  kRange,    // floating integers in [-v, v]
  kSelect,   // floating 0/1: 1 on k(i) of the ranks, k(i) <= limit
  kPow2,     // floating +-1/+-2: 2 on k(i) of the ranks, k(i) <= limit
};

// Largest integer E such that every integer in [-E, E] is exact in the type.
int64_t exactLimit(DataType t) {
  switch (t) {
    case DataType::kFloat64:
      return int64_t{1} << 53;
    case DataType::kFloat32:
      return int64_t{1} << 24;
    case DataType::kFloat16:
      return 2048;
    case DataType::kBFloat16:
      return 256;
    case DataType::kFloat8E4M3:
      return 16;
    case DataType::kFloat8E5M2:
      return 8;
    default:
      return 0;
  }
}

// Most factors of 2 whose product is still finite (e4m3 stops at 448).
int pow2Limit(DataType t) {
  switch (t) {
    case DataType::kFloat8E4M3:
      return 8;
    case DataType::kFloat8E5M2:
    case DataType::kFloat16:
      return 15;
    default:
      return 60;
  }
}

struct Gen {
  Mode mode = Mode::kBits;
  int nranks = 1;
  uint64_t seed = 0;
  int64_t range = 0;  // kRange: values in [-range, range]
  int64_t limit = 0;  // kSelect/kPow2: most ranks selected for one element

  explicit Gen(const DataSpec& s) : nranks(s.nranks), seed(s.seed) {
    if (!s.op) return;
    const ReduceOp op = *s.op;
    if (!isFloating(s.type)) {
      if (op == ReduceOp::kProd) mode = Mode::kOddBits;
      return;
    }
    const int64_t e = exactLimit(s.type);
    if (op == ReduceOp::kMin || op == ReduceOp::kMax) {
      mode = Mode::kRange;
      range = e;
      return;
    }
    if (op == ReduceOp::kProd) {
      mode = Mode::kPow2;
      limit = std::min<int64_t>(nranks, pow2Limit(s.type));
      return;
    }
    // sum, avg, premulsum: the sum of |inputs| (times the scalar) must stay <= e.
    const int64_t budget = op == ReduceOp::kPreMulSum ? e / 2 : e;
    range = std::min<int64_t>(budget / nranks, int64_t{1} << 20);
    if (range >= 1) {
      mode = Mode::kRange;
    } else {
      mode = Mode::kSelect;
      limit = std::min<int64_t>(nranks, budget);
    }
  }

  // Whether `rank` is one of the k(i) ranks selected for element i (consecutive ranks
  // from a per-element start, so exactly k(i) are selected).
  bool selected(int rank, uint64_t i) const {
    const uint64_t h = hashOf(seed, -1, i);
    const uint64_t k = (h >> 32) % static_cast<uint64_t>(limit + 1);
    const uint64_t start = (h & 0xFFFFFFFFu) % static_cast<uint64_t>(nranks);
    const uint64_t pos = (static_cast<uint64_t>(rank) + nranks - start) % static_cast<uint64_t>(nranks);
    return pos < k;
  }

  template <class T>
  T value(int rank, uint64_t i) const {
    const uint64_t h = hashOf(seed, rank, i);
    switch (mode) {
      case Mode::kBits:
      case Mode::kOddBits: {
        uint64_t bits = mode == Mode::kOddBits ? (h | 1u) : h;
        T v;
        std::memcpy(&v, &bits, sizeof(T));  // little-endian: low bytes (odd stays odd)
        return v;
      }
      case Mode::kRange:
        return fromInt<T>(static_cast<int64_t>(h % static_cast<uint64_t>(2 * range + 1)) - range);
      case Mode::kSelect:
        return fromInt<T>(selected(rank, i) ? 1 : 0);
      case Mode::kPow2: {
        int64_t mag = selected(rank, i) ? 2 : 1;
        return fromInt<T>((h & 1u) ? -mag : mag);
      }
    }
    return T{};
  }

  template <class T>
  static T fromInt(int64_t v) {
    if constexpr (std::is_arithmetic_v<T>) {
      return static_cast<T>(v);
    } else {
      return T::fromFloat(static_cast<float>(v));
    }
  }
};

template <class T, ReduceOp Op>
size_t countWrongReduce(const Gen& g, double scalar, size_t first, size_t count, const T* got) {
  using R = Reducer<T, Op>;
  using Acc = AccumT<T>;
  const Acc s = static_cast<Acc>(scalar);
  size_t wrong = 0;
  for (size_t k = 0; k < count; ++k) {
    const uint64_t i = first + k;
    Acc acc = R::pre(loadAcc(g.value<T>(0, i)), s);
    for (int r = 1; r < g.nranks; ++r) acc = R::combine(acc, R::pre(loadAcc(g.value<T>(r, i)), s));
    const T want = storeAcc<T>(R::post(acc, static_cast<uint64_t>(g.nranks)));
    if (std::memcmp(&want, &got[k], sizeof(T)) != 0) ++wrong;
  }
  return wrong;
}

}  // namespace

double premulScalar() {
  return 2.0;
}

void fillInput(const DataSpec& s, int rank, size_t first, size_t count, void* dst) {
  Gen g(s);
  visitDataType(s.type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* out = static_cast<T*>(dst);
    for (size_t k = 0; k < count; ++k) out[k] = g.value<T>(rank, first + k);
  });
}

size_t countWrong(const DataSpec& s, int src_rank, size_t first, size_t count, const void* got) {
  Gen g(s);
  return visitDataType(s.type, [&](auto tag) -> size_t {
    using T = typename decltype(tag)::type;
    const T* in = static_cast<const T*>(got);
    if (!s.op) {
      size_t wrong = 0;
      for (size_t k = 0; k < count; ++k) {
        const T want = g.value<T>(src_rank, first + k);
        if (std::memcmp(&want, &in[k], sizeof(T)) != 0) ++wrong;
      }
      return wrong;
    }
    return visitReduceOp(*s.op, [&](auto op) -> size_t {
      return countWrongReduce<T, decltype(op)::value>(g, s.premul_scalar, first, count, in);
    });
  });
}

}  // namespace crossbar::perf
