// Copy-engine bandwidth on one GPU: device-to-device ceiling with one
// cudaMemcpyAsync vs CudaCopyEngine batches (N chunks in one cudaMemcpyBatchAsync),
// 64 MiB .. 1 GiB, timed with events, median of --iters. No kernels involved.
//   ce_bandwidth [--iters N] [--chunks C] [--max-mib M]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "comm/errors.h"
#include "symmem/cuda/copy_engine_cuda.h"
#include "symmem/cuda/driver_api.h"

using namespace crossbar;
using namespace crossbar::cuda;

namespace {

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "ce_bandwidth: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <typename Fn>
double medianMs(cudaStream_t s, int iters, Fn enqueue) {
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a), "event");
  ok(cudaEventCreate(&b), "event");
  enqueue();  // warm-up
  ok(cudaStreamSynchronize(s), "warm-up");
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    ok(cudaEventRecord(a, s), "record");
    enqueue();
    ok(cudaEventRecord(b, s), "record");
    ok(cudaEventSynchronize(b), "sync");
    float t = 0;
    ok(cudaEventElapsedTime(&t, a, b), "elapsed");
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 10, chunks = 8;
  size_t max_mib = 1024;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--iters"))
      iters = std::max(1, std::atoi(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--chunks"))
      chunks = std::max(1, std::atoi(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--max-mib"))
      max_mib = std::strtoull(argv[i + 1], nullptr, 10);
  }
  if (!driverAvailable()) {
    std::printf("ce_bandwidth: SKIP (%s)\n", driverUnavailableReason().c_str());
    return 0;
  }
  try {
    ensureContext(0, "ce_bandwidth");
    cudaDeviceProp prop{};
    ok(cudaGetDeviceProperties(&prop, 0), "properties");
    const size_t max_bytes = max_mib << 20;
    char *src = nullptr, *dst = nullptr;
    ok(cudaMalloc(&src, max_bytes), "cudaMalloc src");
    ok(cudaMalloc(&dst, max_bytes), "cudaMalloc dst");
    ok(cudaMemset(src, 1, max_bytes), "memset");
    ok(cudaDeviceSynchronize(), "sync");
    CudaCopyEngine ce(0);
    CudaCopyEngine::Options per_copy_opts;
    per_copy_opts.use_batch = false;
    CudaCopyEngine ce_each(0, per_copy_opts);
    std::printf("device: %s (%d SMs), iters %d, batch of %d chunks; GB/s = bytes copied / time (1e9)\n",
                prop.name, prop.multiProcessorCount, iters, chunks);
    std::printf("%10s %16s %16s %16s %8s %s\n", "MiB", "memcpyAsync", "CE batch", "CE per-copy", "ratio",
                "batch-used");
    for (size_t mib = 64; mib <= max_mib; mib *= 2) {
      const size_t bytes = mib << 20;
      const double t_ref = medianMs(ce.stream(), iters, [&] {
        ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ce.stream()), "cudaMemcpyAsync");
      });
      std::vector<CopyOp> ops;
      const size_t chunk = bytes / chunks;
      for (int c = 0; c < chunks; ++c) ops.push_back({src + c * chunk, dst + c * chunk, chunk});
      const double t_batch = medianMs(ce.stream(), iters, [&] { ce.enqueue(ops); });
      const double t_each = medianMs(ce_each.stream(), iters, [&] { ce_each.enqueue(ops); });
      auto gbs = [&](double ms) { return bytes / (ms * 1e-3) / 1e9; };
      std::printf("%10zu %16.1f %16.1f %16.1f %8.2f %s\n", mib, gbs(t_ref), gbs(t_batch), gbs(t_each),
                  t_ref / t_batch, ce.usingBatch() ? "yes" : "no (fallback)");
      std::fflush(stdout);
    }
    cudaFree(src);
    cudaFree(dst);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ce_bandwidth: %s\n", e.what());
    return 1;
  }
  return 0;
}
