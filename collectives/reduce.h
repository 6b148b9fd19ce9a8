// Reduction math shared by the CPU and CUDA paths.
//
// Every op is decomposed into three per-element stages so any algorithm (a kernel
// reducing N peers' buffers at once, or a ring doing it one step at a time) applies
// each exactly where it belongs:
//   pre(x)        once per input element: premul-sum multiplies by the scalar, others pass
//   combine(a, b) sum / prod / min / max; avg and premul-sum combine as sums
//   post(acc, n)  once on the final result: avg divides by the number of contributions
//                 (integers: integer division truncating toward zero, as NCCL does)
// Arithmetic happens in the accumulator type: f32 for half/bfloat16/fp8 (load with
// loadAcc, round once with storeAcc), the storage type otherwise. Integer sums and
// products wrap modulo 2^bits like NCCL on the GPU (done in unsigned, so no UB).
// Floating min/max propagate NaN (torch semantics; NCCL's fminf would drop it).
// Rounding back to half/bfloat16 is IEEE (overflow -> Inf); to fp8 it saturates to the
// largest finite value like cuda_fp8.h's conversions (NaN stays NaN).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "collectives/dtype.h"
#include "collectives/float_types.h"
#include "comm/errors.h"

namespace crossbar {

// ---- type mapping --------------------------------------------------------------------
template <DataType D>
struct DataTypeTraits;
template <>
struct DataTypeTraits<DataType::kFloat64> {
  using type = double;
};
template <>
struct DataTypeTraits<DataType::kFloat32> {
  using type = float;
};
template <>
struct DataTypeTraits<DataType::kFloat16> {
  using type = Float16;
};
template <>
struct DataTypeTraits<DataType::kBFloat16> {
  using type = BFloat16;
};
template <>
struct DataTypeTraits<DataType::kFloat8E4M3> {
  using type = Float8E4M3;
};
template <>
struct DataTypeTraits<DataType::kFloat8E5M2> {
  using type = Float8E5M2;
};
template <>
struct DataTypeTraits<DataType::kInt8> {
  using type = int8_t;
};
template <>
struct DataTypeTraits<DataType::kUInt8> {
  using type = uint8_t;
};
template <>
struct DataTypeTraits<DataType::kInt32> {
  using type = int32_t;
};
template <>
struct DataTypeTraits<DataType::kUInt32> {
  using type = uint32_t;
};
template <>
struct DataTypeTraits<DataType::kInt64> {
  using type = int64_t;
};
template <>
struct DataTypeTraits<DataType::kUInt64> {
  using type = uint64_t;
};
template <DataType D>
using StorageT = typename DataTypeTraits<D>::type;

template <class T>
struct IsNarrowFloat : std::false_type {};
template <>
struct IsNarrowFloat<Float16> : std::true_type {};
template <>
struct IsNarrowFloat<BFloat16> : std::true_type {};
template <>
struct IsNarrowFloat<Float8E4M3> : std::true_type {};
template <>
struct IsNarrowFloat<Float8E5M2> : std::true_type {};

// ---- accumulator ---------------------------------------------------------------------
template <class T>
struct AccumTraits {
  using type = std::conditional_t<IsNarrowFloat<T>::value, float, T>;
};
template <class T>
using AccumT = typename AccumTraits<T>::type;

template <class T>
CROSSBAR_HDI AccumT<T> loadAcc(T v) {
  if constexpr (IsNarrowFloat<T>::value) {
    return v.toFloat();
  } else {
    return v;
  }
}

template <class T>
CROSSBAR_HDI T storeAcc(AccumT<T> a) {
  if constexpr (std::is_same_v<T, Float8E4M3> || std::is_same_v<T, Float8E5M2>) {
    return T::fromFloat(a, Saturate::kFinite);
  } else if constexpr (IsNarrowFloat<T>::value) {
    return T::fromFloat(a, Saturate::kNo);
  } else {
    return a;
  }
}

// ---- element ops on accumulator values -----------------------------------------------
namespace reducedetail {

template <class A>
CROSSBAR_HDI A add(A a, A b) {
  if constexpr (std::is_integral_v<A> && std::is_signed_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return static_cast<A>(a + b);
  }
}

template <class A>
CROSSBAR_HDI A mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    // uint8 operands promote to int but their product fits; wider ones stay unsigned.
    using U = std::make_unsigned_t<A>;
    using P = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, U>;
    return static_cast<A>(
        static_cast<U>(static_cast<P>(static_cast<U>(a)) * static_cast<P>(static_cast<U>(b))));
  } else {
    return a * b;
  }
}

template <class A>
CROSSBAR_HDI A min(A a, A b) {
  if constexpr (!std::is_integral_v<A>) {
    if (a != a) return a;
    if (b != b) return b;
  }
  return b < a ? b : a;
}

template <class A>
CROSSBAR_HDI A max(A a, A b) {
  if constexpr (!std::is_integral_v<A>) {
    if (a != a) return a;
    if (b != b) return b;
  }
  return a < b ? b : a;
}

}  // namespace reducedetail

template <class T, ReduceOp Op>
struct Reducer {
  using Acc = AccumT<T>;

  CROSSBAR_HDI static Acc pre(Acc x, Acc scalar) {
    if constexpr (Op == ReduceOp::kPreMulSum) {
      return x * scalar;
    } else {
      (void)scalar;
      return x;
    }
  }

  CROSSBAR_HDI static Acc combine(Acc a, Acc b) {
    if constexpr (Op == ReduceOp::kProd) {
      return reducedetail::mul(a, b);
    } else if constexpr (Op == ReduceOp::kMin) {
      return reducedetail::min(a, b);
    } else if constexpr (Op == ReduceOp::kMax) {
      return reducedetail::max(a, b);
    } else {
      return reducedetail::add(a, b);
    }
  }

  CROSSBAR_HDI static Acc post(Acc a, uint64_t count) {
    if constexpr (Op == ReduceOp::kAvg) {
      if constexpr (std::is_integral_v<Acc>) {
        // Divide in 64 bits: the count may not fit the element type (int8, 200 ranks).
        if constexpr (std::is_signed_v<Acc>) {
          return static_cast<Acc>(static_cast<int64_t>(a) / static_cast<int64_t>(count));
        } else {
          return static_cast<Acc>(static_cast<uint64_t>(a) / count);
        }
      } else {
        return a / static_cast<Acc>(count);
      }
    } else {
      (void)count;
      return a;
    }
  }

  // Reduces element i of nsrc inputs completely (pre on each, post at the end), rounding
  // once; what a kernel thread does per element.
  CROSSBAR_HDI static T reduceElement(const T* const* srcs, int nsrc, size_t i, Acc scalar, uint64_t count) {
    Acc acc = pre(loadAcc(srcs[0][i]), scalar);
    for (int k = 1; k < nsrc; ++k) acc = combine(acc, pre(loadAcc(srcs[k][i]), scalar));
    return storeAcc<T>(post(acc, count));
  }
};

// ---- host dispatch -------------------------------------------------------------------
struct ReduceParams {
  double preMulScalar = 1.0;  // kPreMulSum: the factor every input is multiplied by
  uint64_t avgCount = 0;      // kAvg: the divisor; 0 means the number of inputs of reduce()
};

template <class T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with the storage type of t.
template <class F>
decltype(auto) visitDataType(DataType t, F&& f) {
  switch (t) {
    case DataType::kFloat64:
      return f(TypeTag<double>{});
    case DataType::kFloat32:
      return f(TypeTag<float>{});
    case DataType::kFloat16:
      return f(TypeTag<Float16>{});
    case DataType::kBFloat16:
      return f(TypeTag<BFloat16>{});
    case DataType::kFloat8E4M3:
      return f(TypeTag<Float8E4M3>{});
    case DataType::kFloat8E5M2:
      return f(TypeTag<Float8E5M2>{});
    case DataType::kInt8:
      return f(TypeTag<int8_t>{});
    case DataType::kUInt8:
      return f(TypeTag<uint8_t>{});
    case DataType::kInt32:
      return f(TypeTag<int32_t>{});
    case DataType::kUInt32:
      return f(TypeTag<uint32_t>{});
    case DataType::kInt64:
      return f(TypeTag<int64_t>{});
    case DataType::kUInt64:
      return f(TypeTag<uint64_t>{});
  }
  throw InvalidArgument("unknown DataType " + std::to_string(static_cast<int>(t)));
}

// Calls f(std::integral_constant<ReduceOp, op>{}).
template <class F>
decltype(auto) visitReduceOp(ReduceOp op, F&& f) {
  switch (op) {
    case ReduceOp::kSum:
      return f(std::integral_constant<ReduceOp, ReduceOp::kSum>{});
    case ReduceOp::kProd:
      return f(std::integral_constant<ReduceOp, ReduceOp::kProd>{});
    case ReduceOp::kMin:
      return f(std::integral_constant<ReduceOp, ReduceOp::kMin>{});
    case ReduceOp::kMax:
      return f(std::integral_constant<ReduceOp, ReduceOp::kMax>{});
    case ReduceOp::kAvg:
      return f(std::integral_constant<ReduceOp, ReduceOp::kAvg>{});
    case ReduceOp::kPreMulSum:
      return f(std::integral_constant<ReduceOp, ReduceOp::kPreMulSum>{});
  }
  throw InvalidArgument("unknown ReduceOp " + std::to_string(static_cast<int>(op)));
}

namespace reducedetail {

// Elements per chunk: the accumulator chunk stays in L1 and every loop below is a
// plain restrict-qualified loop that -O2/-O3 auto-vectorizes for f32/f64/integers.
inline constexpr size_t kChunk = 1024;
// Up to this many elements reduceChunked() goes element by element.
inline constexpr size_t kSmall = 16;

template <class T, ReduceOp Op>
void loadChunk(AccumT<T>* __restrict acc, const T* __restrict src, size_t m, AccumT<T> scalar, bool pre) {
  using R = Reducer<T, Op>;
  if (pre && Op == ReduceOp::kPreMulSum) {
    for (size_t j = 0; j < m; ++j) acc[j] = R::pre(loadAcc(src[j]), scalar);
  } else {
    for (size_t j = 0; j < m; ++j) acc[j] = loadAcc(src[j]);
  }
}

template <class T, ReduceOp Op>
void combineChunk(AccumT<T>* __restrict acc, const T* __restrict src, size_t m, AccumT<T> scalar) {
  using R = Reducer<T, Op>;
  for (size_t j = 0; j < m; ++j) acc[j] = R::combine(acc[j], R::pre(loadAcc(src[j]), scalar));
}

template <class T, ReduceOp Op>
void storeChunk(T* __restrict dst, const AccumT<T>* __restrict acc, size_t m, uint64_t count) {
  using R = Reducer<T, Op>;
  if (count != 0 && Op == ReduceOp::kAvg) {
    for (size_t j = 0; j < m; ++j) dst[j] = storeAcc<T>(R::post(acc[j], count));
  } else {
    for (size_t j = 0; j < m; ++j) dst[j] = storeAcc<T>(acc[j]);
  }
}

template <class T, ReduceOp Op>
inline void reduceOneChunk(T* dst, const T* const* srcs, size_t nsrc, size_t off, size_t m,
                           AccumT<T>* __restrict acc, AccumT<T> scalar, bool preFirst, uint64_t count) {
  loadChunk<T, Op>(acc, srcs[0] + off, m, scalar, preFirst);
  for (size_t k = 1; k < nsrc; ++k) combineChunk<T, Op>(acc, srcs[k] + off, m, scalar);
  storeChunk<T, Op>(dst + off, acc, m, count);
}

// reduceChunked() for n <= kSmall: element by element, the same operations in the same
// order as the chunk loops, without their setup or their stack frame (small collectives'
// latency).
template <class T, ReduceOp Op>
void reduceSmall(T* dst, const T* const* srcs, size_t nsrc, size_t n, AccumT<T> scalar, bool preFirst,
                 uint64_t count) {
  using R = Reducer<T, Op>;
  for (size_t i = 0; i < n; ++i) {
    AccumT<T> a = loadAcc(srcs[0][i]);
    if (preFirst) a = R::pre(a, scalar);
    for (size_t k = 1; k < nsrc; ++k) a = R::combine(a, R::pre(loadAcc(srcs[k][i]), scalar));
    dst[i] = storeAcc<T>(count != 0 ? R::post(a, count) : a);
  }
}

// reduceChunked() from kSmall elements up. Not inlined, so its 4-8 KiB accumulator frame
// stays out of the small path.
template <class T, ReduceOp Op>
__attribute__((noinline)) void reduceLarge(T* dst, const T* const* srcs, size_t nsrc, size_t n, AccumT<T> scalar,
                                           bool preFirst, uint64_t count) {
  alignas(64) AccumT<T> acc[kChunk];
  size_t full = n - n % kChunk;
  for (size_t off = 0; off < full; off += kChunk)
    reduceOneChunk<T, Op>(dst, srcs, nsrc, off, kChunk, acc, scalar, preFirst, count);
  if (full < n) reduceOneChunk<T, Op>(dst, srcs, nsrc, full, n - full, acc, scalar, preFirst, count);
}

// dst = post(combine_k pre(src_k)); pre on src 0 only if preFirst, post only if count.
// dst may alias any src: a chunk is fully read before it is written. Full chunks are
// processed with a compile-time trip count, which GCC's -O2 ("very cheap") vectorizer
// accepts; the tail goes through the same loops with a run-time count.
template <class T, ReduceOp Op>
void reduceChunked(T* dst, const T* const* srcs, size_t nsrc, size_t n, AccumT<T> scalar, bool preFirst,
                   uint64_t count) {
  if (n <= kSmall)
    reduceSmall<T, Op>(dst, srcs, nsrc, n, scalar, preFirst, count);
  else
    reduceLarge<T, Op>(dst, srcs, nsrc, n, scalar, preFirst, count);
}

inline void checkSupported(DataType t, ReduceOp op, const char* what) {
  if (!isSupported(t, op)) {
    throw Unsupported(std::string(what) + ": reduce op " + reduceOpName(op) + " is not defined for " +
                      dataTypeName(t) + " (premulsum needs a floating-point type); use sum and scale");
  }
}

// Runs body.template operator()<T, Op>() for a supported (t, op).
template <class Body>
void dispatch(DataType t, ReduceOp op, const char* what, Body&& body) {
  checkSupported(t, op, what);
  visitDataType(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    visitReduceOp(op, [&](auto opc) {
      constexpr ReduceOp kOp = decltype(opc)::value;
      if constexpr (kOp != ReduceOp::kPreMulSum || !std::is_integral_v<T>) body.template operator()<T, kOp>();
    });
  });
}

}  // namespace reducedetail

// reduce() with its (type, op) resolved: dst = post(combine_k pre(src_k)) with pre =
// the premul-sum factor and post = avg's division by `count`.
using ReduceFn = void (*)(void* dst, const void* const* srcs, size_t nsrc, size_t n, double premul, uint64_t count);

namespace reducedetail {
template <class T, ReduceOp Op>
void reduceResolved(void* dst, const void* const* srcs, size_t nsrc, size_t n, double premul, uint64_t count) {
  reduceChunked<T, Op>(static_cast<T*>(dst), reinterpret_cast<const T* const*>(srcs), nsrc, n,
                       static_cast<AccumT<T>>(premul), true, count);
}
}  // namespace reducedetail

// The function reduce() calls for (t, op). Flattened into jump tables: ~66 instructions
// (callgrind), where dispatching the call itself through the nested visitors cost ~250
// (a small collective's whole reduction of two floats is ~70).
__attribute__((flatten)) inline ReduceFn reduceFunction(DataType t, ReduceOp op) {
  ReduceFn f = nullptr;
  reducedetail::dispatch(t, op, "reduce", [&]<class T, ReduceOp Op>() { f = &reducedetail::reduceResolved<T, Op>; });
  return f;
}

// Complete reduction of nsrc inputs of n elements into dst, accumulating in AccumT and
// rounding once. dst may alias any input.
inline void reduce(void* dst, const void* const* srcs, size_t nsrc, size_t n, DataType t, ReduceOp op,
                   const ReduceParams& p = {}) {
  if (nsrc == 0) throw InvalidArgument("reduce: needs at least one input buffer");
  reduceFunction(t, op)(dst, srcs, nsrc, n, p.preMulScalar, p.avgCount ? p.avgCount : nsrc);
}

// One step of a multi-step algorithm: dst = combine(dst, pre(src)). dst holds a partial
// result (already pre-processed; see prepareReduceInput) and is not post-processed: avg
// is summed here and divided by finishReduce() at the end. dst may equal src.
inline void reduceInto(void* dst, const void* src, size_t n, DataType t, ReduceOp op,
                       const ReduceParams& p = {}) {
  reducedetail::dispatch(t, op, "reduceInto", [&]<class T, ReduceOp Op>() {
    const T* srcs[2] = {static_cast<const T*>(dst), static_cast<const T*>(src)};
    reducedetail::reduceChunked<T, Op>(static_cast<T*>(dst), srcs, 2, n,
                                       static_cast<AccumT<T>>(p.preMulScalar), false, 0);
  });
}

// dst = pre(src): a rank's own contribution entering a multi-step algorithm (a copy, or
// a scaled copy for premul-sum). dst may equal src.
inline void prepareReduceInput(void* dst, const void* src, size_t n, DataType t, ReduceOp op,
                               const ReduceParams& p = {}) {
  reducedetail::dispatch(t, op, "prepareReduceInput", [&]<class T, ReduceOp Op>() {
    const T* srcs[1] = {static_cast<const T*>(src)};
    reducedetail::reduceChunked<T, Op>(static_cast<T*>(dst), srcs, 1, n,
                                       static_cast<AccumT<T>>(p.preMulScalar), true, 0);
  });
}

// data = post(data, count): avg divides by count (the number of contributions); other
// ops are untouched.
inline void finishReduce(void* data, size_t n, DataType t, ReduceOp op, uint64_t count) {
  if (op != ReduceOp::kAvg) return;
  if (count == 0) throw InvalidArgument("finishReduce: avg needs a nonzero count of contributions");
  reducedetail::dispatch(t, op, "finishReduce", [&]<class T, ReduceOp Op>() {
    const T* srcs[1] = {static_cast<const T*>(data)};
    reducedetail::reduceChunked<T, Op>(static_cast<T*>(data), srcs, 1, n, AccumT<T>(1), false, count);
  });
}

}  // namespace crossbar
