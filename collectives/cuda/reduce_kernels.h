// Reduction kernels of the CUDA collectives: dst_j[i] = post(combine_k pre(src_k[i]))
// for every output j, with the per-element math of collectives/reduce.h (Reducer:
// f16/bf16/fp8 accumulate in f32 and round once). Pointers are device addresses
// valid in this process (own memory or peers' mapped symmetric buffers); the host
// decides what each rank reads and writes, the kernel only indexes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "collectives/dtype.h"

namespace crossbar::cudacoll {

inline constexpr int kMaxReduceInputs = 8;   // one per local rank
inline constexpr int kMaxReduceOutputs = 8;  // two-shot writes its block to every rank

struct ReduceLaunch {
  const void* inputs[kMaxReduceInputs] = {};
  int num_inputs = 0;
  void* outputs[kMaxReduceOutputs] = {};
  int num_outputs = 0;
  size_t count = 0;  // elements
  DataType type = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  double premul_scalar = 1.0;  // kPreMulSum
  uint64_t avg_count = 0;      // kAvg divisor; 0: num_inputs
};

// Enqueues the reduction on `stream`. InvalidArgument for bad counts of inputs/outputs
// or an unsupported (type, op); CudaError if the launch fails.
void launchReduce(const ReduceLaunch& launch, cudaStream_t stream, int device);

}  // namespace crossbar::cudacoll
