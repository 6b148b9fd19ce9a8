#include <algorithm>
#include <string>

#include "collectives/cuda/reduce_kernels.h"
#include "collectives/reduce.h"
#include "comm/errors.h"
#include "symmem/cuda/driver_api.h"

// No fmt here: nvcc cannot evaluate fmt's consteval format-string checks.
namespace crossbar::cudacoll {
namespace {

struct Pointers {
  const void* in[kMaxReduceInputs];
  void* out[kMaxReduceOutputs];
};

// Grid-stride loop; each thread reduces whole elements (reads every input, rounds once,
// writes every output), so an output may alias an input at the same index.
template <class T, ReduceOp Op>
__global__ void reduceKernel(Pointers p, int nin, int nout, size_t n, AccumT<T> scalar, uint64_t count) {
  const T* in[kMaxReduceInputs];
#pragma unroll
  for (int k = 0; k < kMaxReduceInputs; ++k) in[k] = static_cast<const T*>(p.in[k]);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const T v = Reducer<T, Op>::reduceElement(in, nin, i, scalar, count);
    for (int j = 0; j < nout; ++j) static_cast<T*>(p.out[j])[i] = v;
  }
}

}  // namespace

void launchReduce(const ReduceLaunch& l, cudaStream_t stream, int device) {
  if (l.num_inputs < 1 || l.num_inputs > kMaxReduceInputs || l.num_outputs < 1 ||
      l.num_outputs > kMaxReduceOutputs)
    throw InvalidArgument(errorContext(-1, "launchReduce") + std::to_string(l.num_inputs) + " inputs and " +
                          std::to_string(l.num_outputs) + " outputs (1.." + std::to_string(kMaxReduceInputs) +
                          " each)");
  if (l.count == 0) return;
  Pointers p{};
  for (int k = 0; k < l.num_inputs; ++k) p.in[k] = l.inputs[k];
  for (int j = 0; j < l.num_outputs; ++j) p.out[j] = l.outputs[j];
  const uint64_t count = l.avg_count ? l.avg_count : static_cast<uint64_t>(l.num_inputs);
  constexpr int kThreads = 256;
  // Enough blocks to fill an H100/H200 several times over; the loop covers the rest.
  const size_t blocks = std::min<size_t>((l.count + kThreads - 1) / kThreads, 132 * 8);
  reducedetail::dispatch(l.type, l.op, "launchReduce", [&]<class T, ReduceOp Op>() {
    reduceKernel<T, Op><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        p, l.num_inputs, l.num_outputs, l.count, static_cast<AccumT<T>>(l.premul_scalar), count);
  });
  cuda::checkCuda(cudaGetLastError(),
                  "launchReduce: reduce kernel (" + std::to_string(l.count) + " x " + dataTypeName(l.type) +
                      " " + reduceOpName(l.op) + ", " + std::to_string(l.num_inputs) + " inputs, " +
                      std::to_string(blocks) + " blocks)",
                  device, "the stream must belong to the current device");
}

}  // namespace crossbar::cudacoll
