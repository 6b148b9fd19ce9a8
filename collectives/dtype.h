// Element types and reduction operators of the collectives layer, with the names
// nccl-tests prints (so perf output and CROSSBAR_* settings read the same as NCCL's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "collectives/hd.h"

namespace crossbar {

enum class DataType {
  kFloat64,
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat8E4M3,  // OCP E4M3 "FN": no infinities, NaN = S.1111.111, max 448
  kFloat8E5M2,  // OCP E5M2: IEEE-like, with infinities, max 57344
  kInt8,
  kUInt8,
  kInt32,
  kUInt32,
  kInt64,
  kUInt64,
};
inline constexpr int kNumDataTypes = 12;

enum class ReduceOp { kSum, kProd, kMin, kMax, kAvg, kPreMulSum };
inline constexpr int kNumReduceOps = 6;

CROSSBAR_HDI constexpr size_t elementSize(DataType t) {
  switch (t) {
    case DataType::kFloat64:
    case DataType::kInt64:
    case DataType::kUInt64:
      return 8;
    case DataType::kFloat32:
    case DataType::kInt32:
    case DataType::kUInt32:
      return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kFloat8E4M3:
    case DataType::kFloat8E5M2:
    case DataType::kInt8:
    case DataType::kUInt8:
      return 1;
  }
  return 0;
}

CROSSBAR_HDI constexpr bool isFloating(DataType t) {
  switch (t) {
    case DataType::kFloat64:
    case DataType::kFloat32:
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kFloat8E4M3:
    case DataType::kFloat8E5M2:
      return true;
    default:
      return false;
  }
}

CROSSBAR_HDI constexpr bool isSignedInteger(DataType t) {
  return t == DataType::kInt8 || t == DataType::kInt32 || t == DataType::kInt64;
}

// Pre-multiplied sum is a floating-point operation (the scalar is a real factor); every
// other op works on every type. There are no bitwise ops.
CROSSBAR_HDI constexpr bool isSupported(DataType t, ReduceOp op) {
  return op != ReduceOp::kPreMulSum || isFloating(t);
}

// nccl-tests spelling: int8 uint8 int32 uint32 int64 uint64 half float double bfloat16
// f8e4m3 f8e5m2.
constexpr const char* dataTypeName(DataType t) {
  switch (t) {
    case DataType::kFloat64:
      return "double";
    case DataType::kFloat32:
      return "float";
    case DataType::kFloat16:
      return "half";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kFloat8E4M3:
      return "f8e4m3";
    case DataType::kFloat8E5M2:
      return "f8e5m2";
    case DataType::kInt8:
      return "int8";
    case DataType::kUInt8:
      return "uint8";
    case DataType::kInt32:
      return "int32";
    case DataType::kUInt32:
      return "uint32";
    case DataType::kInt64:
      return "int64";
    case DataType::kUInt64:
      return "uint64";
  }
  return "unknown";
}

// nccl-tests spelling: sum prod max min avg premulsum.
constexpr const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kProd:
      return "prod";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kPreMulSum:
      return "premulsum";
  }
  return "unknown";
}

// Accepts the nccl-tests names plus the torch spellings users type (float32, float16,
// bf16, float8_e4m3fn, ...). Case-sensitive, like both tools.
constexpr std::optional<DataType> parseDataType(std::string_view name) {
  struct Alias {
    std::string_view name;
    DataType type;
  };
  constexpr Alias kAliases[] = {
      {"double", DataType::kFloat64},
      {"float64", DataType::kFloat64},
      {"fp64", DataType::kFloat64},
      {"float", DataType::kFloat32},
      {"float32", DataType::kFloat32},
      {"fp32", DataType::kFloat32},
      {"half", DataType::kFloat16},
      {"float16", DataType::kFloat16},
      {"fp16", DataType::kFloat16},
      {"bfloat16", DataType::kBFloat16},
      {"bf16", DataType::kBFloat16},
      {"f8e4m3", DataType::kFloat8E4M3},
      {"float8_e4m3fn", DataType::kFloat8E4M3},
      {"fp8_e4m3", DataType::kFloat8E4M3},
      {"e4m3", DataType::kFloat8E4M3},
      {"f8e5m2", DataType::kFloat8E5M2},
      {"float8_e5m2", DataType::kFloat8E5M2},
      {"fp8_e5m2", DataType::kFloat8E5M2},
      {"e5m2", DataType::kFloat8E5M2},
      {"int8", DataType::kInt8},
      {"char", DataType::kInt8},
      {"uint8", DataType::kUInt8},
      {"int32", DataType::kInt32},
      {"int", DataType::kInt32},
      {"uint32", DataType::kUInt32},
      {"int64", DataType::kInt64},
      {"uint64", DataType::kUInt64},
  };
  for (const Alias& a : kAliases) {
    if (a.name == name) return a.type;
  }
  return std::nullopt;
}

constexpr std::optional<ReduceOp> parseReduceOp(std::string_view name) {
  for (int i = 0; i < kNumReduceOps; ++i) {
    auto op = static_cast<ReduceOp>(i);
    if (name == reduceOpName(op)) return op;
  }
  if (name == "premul_sum") return ReduceOp::kPreMulSum;  // torch's spelling
  return std::nullopt;
}

}  // namespace crossbar
