// Reductions over every type x op with inputs whose results are exact in every format,
// plus the rounding, wrapping, NaN and multi-step (ring-style) contracts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "collectives/reduce.h"

namespace crossbar {
namespace {

constexpr size_t kInputs = 4;
constexpr size_t kCount = 3000;  // spans several 1024-element chunks plus a tail

// Input k, element i: small integers in [-2, 2] (unsigned: [0, 3]), varying with both k and
// i so products are often nonzero. Sums of four lie in [-8, 12], products are +-2^j with
// j <= 4 (unsigned: <= 81, fits uint8) and averages are multiples of 1/4 -- all exact even
// in E5M2 (2 mantissa bits), checked by hand: e.g. 7 = 1.75 * 4, 3.5 = 1.75 * 2, 1.75,
// 0.75 = 1.5 * 0.5.
double inputValue(size_t k, size_t i, bool isUnsigned) {
  size_t r = (i % 11) * (k + 1) + i / 13;
  return isUnsigned ? static_cast<double>(r % 4) : static_cast<double>(r % 5) - 2;
}

template <class T>
T fromDouble(double v) {
  if constexpr (std::is_same_v<AccumT<T>, T>) {
    return static_cast<T>(v);
  } else {
    return T::fromFloat(static_cast<float>(v));
  }
}

template <class T>
double toDouble(T v) {
  return static_cast<double>(loadAcc(v));
}

double expectedValue(ReduceOp op, size_t i, bool isUnsigned, bool isInt, double scalar) {
  double acc = inputValue(0, i, isUnsigned) * (op == ReduceOp::kPreMulSum ? scalar : 1.0);
  for (size_t k = 1; k < kInputs; ++k) {
    double v = inputValue(k, i, isUnsigned);
    switch (op) {
      case ReduceOp::kProd:
        acc *= v;
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
      case ReduceOp::kPreMulSum:
        acc += v * scalar;
        break;
      default:
        acc += v;
        break;
    }
  }
  if (op == ReduceOp::kAvg)
    acc = isInt ? std::trunc(acc / kInputs) : acc / kInputs;  // C++ division truncates
  return acc;
}

template <class T>
void checkAllOps(DataType dt) {
  const bool isUnsigned = std::is_integral_v<T> && std::is_unsigned_v<T>;
  const bool isInt = std::is_integral_v<T>;
  std::vector<std::vector<T>> in(kInputs, std::vector<T>(kCount));
  for (size_t k = 0; k < kInputs; ++k)
    for (size_t i = 0; i < kCount; ++i) in[k][i] = fromDouble<T>(inputValue(k, i, isUnsigned));
  for (int o = 0; o < kNumReduceOps; ++o) {
    auto op = static_cast<ReduceOp>(o);
    SCOPED_TRACE(std::string(dataTypeName(dt)) + " " + reduceOpName(op));
    ReduceParams params;
    params.preMulScalar = 0.5;
    std::vector<T> out(kCount);
    const void* srcs[kInputs];
    for (size_t k = 0; k < kInputs; ++k) srcs[k] = in[k].data();
    if (!isSupported(dt, op)) {
      EXPECT_THROW(reduce(out.data(), srcs, kInputs, kCount, dt, op, params), Unsupported);
      continue;
    }
    // One-shot reduction of all inputs.
    reduce(out.data(), srcs, kInputs, kCount, dt, op, params);
    for (size_t i = 0; i < kCount; ++i) {
      double want = expectedValue(op, i, isUnsigned, isInt, 0.5);
      ASSERT_EQ(toDouble(out[i]), want) << "element " << i;
    }
    // The same result by the multi-step contract: prepare own input, reduceInto each
    // peer's, finish once.
    std::vector<T> acc(kCount);
    prepareReduceInput(acc.data(), in[0].data(), kCount, dt, op, params);
    for (size_t k = 1; k < kInputs; ++k) reduceInto(acc.data(), in[k].data(), kCount, dt, op, params);
    finishReduce(acc.data(), kCount, dt, op, kInputs);
    ASSERT_EQ(0, std::memcmp(acc.data(), out.data(), kCount * sizeof(T)));
    // In place: dst aliases the first input.
    std::vector<T> inplace = in[0];
    const void* srcs2[kInputs] = {inplace.data(), in[1].data(), in[2].data(), in[3].data()};
    reduce(inplace.data(), srcs2, kInputs, kCount, dt, op, params);
    ASSERT_EQ(0, std::memcmp(inplace.data(), out.data(), kCount * sizeof(T)));
  }
}

TEST(Reduce, EveryTypeEveryOpExact) {
  checkAllOps<double>(DataType::kFloat64);
  checkAllOps<float>(DataType::kFloat32);
  checkAllOps<Float16>(DataType::kFloat16);
  checkAllOps<BFloat16>(DataType::kBFloat16);
  checkAllOps<Float8E4M3>(DataType::kFloat8E4M3);
  checkAllOps<Float8E5M2>(DataType::kFloat8E5M2);
  checkAllOps<int8_t>(DataType::kInt8);
  checkAllOps<uint8_t>(DataType::kUInt8);
  checkAllOps<int32_t>(DataType::kInt32);
  checkAllOps<uint32_t>(DataType::kUInt32);
  checkAllOps<int64_t>(DataType::kInt64);
  checkAllOps<uint64_t>(DataType::kUInt64);
}

TEST(Reduce, StorageTypesMatchDataTypes) {
  static_assert(std::is_same_v<StorageT<DataType::kBFloat16>, BFloat16>);
  static_assert(std::is_same_v<AccumT<Float8E5M2>, float>);
  static_assert(std::is_same_v<AccumT<double>, double>);
  static_assert(std::is_same_v<AccumT<int8_t>, int8_t>);
  for (int i = 0; i < kNumDataTypes; ++i) {
    auto t = static_cast<DataType>(i);
    visitDataType(t, [&](auto tag) { EXPECT_EQ(sizeof(typename decltype(tag)::type), elementSize(t)); });
  }
}

// Half accumulates in f32 and rounds once: 1 + 2^-11 + 2^-11 is 1 + 2^-10 (0x3C01), while
// rounding after each step would tie back to 1.0 twice.
TEST(Reduce, NarrowFloatsRoundOnce) {
  Float16 a{floatToHalfBits(1.0f)}, b{floatToHalfBits(0x1p-11f)}, c = b;
  const void* srcs[3] = {&a, &b, &c};
  Float16 out;
  reduce(&out, srcs, 3, 1, DataType::kFloat16, ReduceOp::kSum);
  EXPECT_EQ(out.bits, 0x3C01);
  Float16 step = a;
  reduceInto(&step, &b, 1, DataType::kFloat16, ReduceOp::kSum);
  reduceInto(&step, &c, 1, DataType::kFloat16, ReduceOp::kSum);
  EXPECT_EQ(step.bits, 0x3C00);
  // Same for bfloat16 with 2^-8.
  BFloat16 x{0x3F80}, y{floatToBFloat16Bits(0x1p-8f)};
  const void* s2[3] = {&x, &y, &y};
  BFloat16 o2;
  reduce(&o2, s2, 3, 1, DataType::kBFloat16, ReduceOp::kSum);
  EXPECT_EQ(o2.bits, 0x3F81);
  // Avg of halves divides in f32 before the single rounding: (1 + 2 + 2) / 3.
  Float16 h1{0x3C00}, h2{0x4000};
  const void* s3[3] = {&h1, &h2, &h2};
  reduce(&out, s3, 3, 1, DataType::kFloat16, ReduceOp::kAvg);
  EXPECT_EQ(out.bits, floatToHalfBits(5.0f / 3.0f));
}

TEST(Reduce, IntegersWrapAndAvgTruncates) {
  int8_t a8[2] = {100, -100}, b8[2] = {100, -100};
  reduceInto(a8, b8, 2, DataType::kInt8, ReduceOp::kSum);
  EXPECT_EQ(a8[0], -56);  // 200 - 256
  EXPECT_EQ(a8[1], 56);
  uint8_t u[1] = {200}, v[1] = {100};
  reduceInto(u, v, 1, DataType::kUInt8, ReduceOp::kSum);
  EXPECT_EQ(u[0], 44);
  uint8_t p[1] = {16}, q[1] = {17};
  reduceInto(p, q, 1, DataType::kUInt8, ReduceOp::kProd);
  EXPECT_EQ(p[0], (16 * 17) % 256);
  int32_t i32[1] = {std::numeric_limits<int32_t>::max()}, one[1] = {1};
  reduceInto(i32, one, 1, DataType::kInt32, ReduceOp::kSum);
  EXPECT_EQ(i32[0], std::numeric_limits<int32_t>::min());
  int64_t big[1] = {int64_t{1} << 62}, four[1] = {4};
  reduceInto(big, four, 1, DataType::kInt64, ReduceOp::kProd);
  EXPECT_EQ(big[0], 0);
  // avg: -7 / 2 truncates toward zero like NCCL's integer division.
  int32_t m7[1] = {-7}, zero[1] = {0};
  const void* s[2] = {m7, zero};
  int32_t out[1];
  reduce(out, s, 2, 1, DataType::kInt32, ReduceOp::kAvg);
  EXPECT_EQ(out[0], -3);
  // A count larger than the type (int8 average over 200 contributions).
  int8_t acc[1] = {-100};
  finishReduce(acc, 1, DataType::kInt8, ReduceOp::kAvg, 200);
  EXPECT_EQ(acc[0], 0);
  int8_t acc2[1] = {100};
  finishReduce(acc2, 1, DataType::kInt8, ReduceOp::kAvg, 50);
  EXPECT_EQ(acc2[0], 2);
  // avgCount overrides the number of inputs (e.g. a sub-group's partial result).
  ReduceParams params;
  params.avgCount = 7;
  reduce(out, s, 2, 1, DataType::kInt32, ReduceOp::kAvg, params);
  EXPECT_EQ(out[0], -1);
}

TEST(Reduce, NanPropagatesThroughEveryFloatOp) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg,
                      ReduceOp::kPreMulSum}) {
    for (int pos = 0; pos < 3; ++pos) {
      float v[3] = {1.0f, -2.0f, 3.0f};
      v[pos] = nan;
      const void* s[3] = {&v[0], &v[1], &v[2]};
      float out;
      reduce(&out, s, 3, 1, DataType::kFloat32, op);
      EXPECT_TRUE(std::isnan(out)) << reduceOpName(op) << " pos " << pos;
      double d[3] = {1, -2, 3};
      d[pos] = std::numeric_limits<double>::quiet_NaN();
      const void* sd[3] = {&d[0], &d[1], &d[2]};
      double outd;
      reduce(&outd, sd, 3, 1, DataType::kFloat64, op);
      EXPECT_TRUE(std::isnan(outd)) << reduceOpName(op) << " pos " << pos;
      Float8E4M3 e[3] = {{0x38}, {0xC0}, {0x44}};
      e[pos].bits = 0x7F;
      const void* se[3] = {&e[0], &e[1], &e[2]};
      Float8E4M3 oute;
      reduce(&oute, se, 3, 1, DataType::kFloat8E4M3, op);
      EXPECT_EQ(oute.bits & 0x7F, 0x7F) << reduceOpName(op) << " pos " << pos;
      BFloat16 b[3] = {{0x3F80}, {0xC000}, {0x4040}};
      b[pos].bits = 0x7FC0;
      const void* sb[3] = {&b[0], &b[1], &b[2]};
      BFloat16 outb;
      reduce(&outb, sb, 3, 1, DataType::kBFloat16, op);
      EXPECT_TRUE(std::isnan(outb.toFloat())) << reduceOpName(op) << " pos " << pos;
    }
  }
}

TEST(Reduce, OverflowRules) {
  // fp8 results saturate (cuda_fp8.h conversions are satfinite): 448 + 448 -> 448.
  Float8E4M3 a{0x7E}, b{0x7E};
  reduceInto(&a, &b, 1, DataType::kFloat8E4M3, ReduceOp::kSum);
  EXPECT_EQ(a.bits, 0x7E);
  Float8E5M2 c{0x7B}, d{0x7B};
  reduceInto(&c, &d, 1, DataType::kFloat8E5M2, ReduceOp::kSum);
  EXPECT_EQ(c.bits, 0x7B);
  // half / bfloat16 overflow to Inf like IEEE: 65504 + 65504.
  Float16 h{0x7BFF}, g{0x7BFF};
  reduceInto(&h, &g, 1, DataType::kFloat16, ReduceOp::kSum);
  EXPECT_EQ(h.bits, 0x7C00);
  // min/max of signed zeros and infinities stay ordered.
  float x[2] = {-std::numeric_limits<float>::infinity(), 5.0f},
        y[2] = {3.0f, std::numeric_limits<float>::infinity()};
  float mn[2];
  const void* s[2] = {x, y};
  reduce(mn, s, 2, 2, DataType::kFloat32, ReduceOp::kMin);
  EXPECT_EQ(mn[0], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(mn[1], 5.0f);
}

TEST(Reduce, PreMulSumScalesEachInputOnce) {
  // 3 inputs, scalar 1/3: (3 + 6 + 9) / 3 exactly 6 in double.
  double v[3] = {3, 6, 9};
  const void* s[3] = {&v[0], &v[1], &v[2]};
  ReduceParams p;
  p.preMulScalar = 0.25;
  double out;
  reduce(&out, s, 3, 1, DataType::kFloat64, ReduceOp::kPreMulSum, p);
  EXPECT_EQ(out, 4.5);
  // Multi-step: the partial already holds scaled data; only the incoming input is scaled.
  double acc;
  prepareReduceInput(&acc, &v[0], 1, DataType::kFloat64, ReduceOp::kPreMulSum, p);
  EXPECT_EQ(acc, 0.75);
  reduceInto(&acc, &v[1], 1, DataType::kFloat64, ReduceOp::kPreMulSum, p);
  reduceInto(&acc, &v[2], 1, DataType::kFloat64, ReduceOp::kPreMulSum, p);
  finishReduce(&acc, 1, DataType::kFloat64, ReduceOp::kPreMulSum, 3);  // no-op for premulsum
  EXPECT_EQ(acc, 4.5);
}

TEST(Reduce, ArgumentErrors) {
  float x = 1;
  EXPECT_THROW(reduce(&x, nullptr, 0, 1, DataType::kFloat32, ReduceOp::kSum), InvalidArgument);
  EXPECT_THROW(finishReduce(&x, 1, DataType::kFloat32, ReduceOp::kAvg, 0), InvalidArgument);
  int32_t i = 1;
  EXPECT_THROW(reduceInto(&i, &i, 1, DataType::kInt32, ReduceOp::kPreMulSum), Unsupported);
  // Zero elements is a no-op.
  const void* s[1] = {&x};
  reduce(&x, s, 1, 0, DataType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(x, 1.0f);
}

// Reducer is what kernels call per element; check it agrees with the host loops.
TEST(Reduce, ReducerElementMatchesHostLoop) {
  BFloat16 a[2] = {{0x3F80}, {0x4000}}, b[2] = {{0x4040}, {0xBF80}};
  const BFloat16* srcs[2] = {a, b};
  for (size_t i = 0; i < 2; ++i) {
    BFloat16 viaKernelPath = Reducer<BFloat16, ReduceOp::kAvg>::reduceElement(srcs, 2, i, 1.0f, 2);
    BFloat16 host;
    const void* s[2] = {&a[i], &b[i]};
    reduce(&host, s, 2, 1, DataType::kBFloat16, ReduceOp::kAvg);
    EXPECT_EQ(viaKernelPath.bits, host.bits);
  }
}

}  // namespace
}  // namespace crossbar
