// Why zero-SM collectives: a large bf16 matrix multiply (cuBLAS) timed alone, then
// running concurrently with an allgather-like copy of the same bytes done two ways:
//   * copy engines (CudaCopyEngine: cudaMemcpyBatchAsync, no kernels, zero SMs),
//   * an SM copy kernel (what an SM-based collective does), with NCCL-like and
//     one-per-SM CTA counts.
// Both streams start together behind one gate event; each side is timed with CUDA events
// on its own stream, median of --reps. The copy volume is sized so the copy alone takes
// about as long as the matmul alone (the collective hides behind the compute).
//   matmul_overlap [--m 8192] [--n 8192] [--k 8192] [--iters 20] [--reps 3]
//                  [--copy-mib 1024] [--chunks 8] [--sm-ctas 32,0 (0: one per SM)]
// Prints a table and one machine-readable line:
//   RESULT matmul_alone_tflops=.. ce_ratio=.. sm_ratio=.. (ratio = TFLOP/s concurrent / alone)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "symmem/cuda/copy_engine_cuda.h"

using crossbar::cuda::CopyOp;
using crossbar::cuda::CudaCopyEngine;

namespace {

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "matmul_overlap: %s: %s (%s)\n", what, cudaGetErrorString(e), cudaGetErrorName(e));
    std::exit(1);
  }
}
void ok(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "matmul_overlap: %s: cuBLAS status %d\n", what, static_cast<int>(s));
    std::exit(1);
  }
}

__global__ void fillBf16(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    p[i] = __float2bfloat16(static_cast<float>(h % 17) / 16.0f - 0.5f);
  }
}

// The SM path: a grid-stride 16-byte copy, as a kernel-based collective moves bytes.
__global__ void smCopy(int4* __restrict__ dst, const int4* __restrict__ src, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// Holds both streams until the host has enqueued everything (so they start together).
__global__ void gate(unsigned ns) {
  for (unsigned t = 0; t < ns; t += 1000) __nanosleep(1000);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Args {
  int m = 8192, n = 8192, k = 8192, iters = 20, reps = 3, chunks = 8;
  size_t copy_mib = 1024;
  std::vector<int> sm_ctas{32, 0};
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string opt = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "matmul_overlap: %s needs a value\n", opt.c_str());
      std::exit(2);
    }
    const char* v = argv[++i];
    if (opt == "--m")
      a.m = std::atoi(v);
    else if (opt == "--n")
      a.n = std::atoi(v);
    else if (opt == "--k")
      a.k = std::atoi(v);
    else if (opt == "--iters")
      a.iters = std::max(1, std::atoi(v));
    else if (opt == "--reps")
      a.reps = std::max(1, std::atoi(v));
    else if (opt == "--chunks")
      a.chunks = std::max(1, std::atoi(v));
    else if (opt == "--copy-mib")
      a.copy_mib = std::strtoull(v, nullptr, 10);
    else if (opt == "--sm-ctas") {
      a.sm_ctas.clear();
      for (const char* p = v; *p;) {
        a.sm_ctas.push_back(std::atoi(p));
        const char* c = std::strchr(p, ',');
        if (!c) break;
        p = c + 1;
      }
    } else {
      std::fprintf(stderr, "matmul_overlap: unknown option %s\n", opt.c_str());
      std::exit(2);
    }
  }
  if (a.m <= 0 || a.n <= 0 || a.k <= 0 || a.copy_mib == 0) {
    std::fprintf(stderr, "matmul_overlap: sizes must be positive\n");
    std::exit(2);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("matmul_overlap: SKIP (no CUDA device)\n");
    return 0;
  }
  ok(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const int sms = prop.multiProcessorCount;

  // Matmul operands (column-major C = A x B, bf16 in/out, fp32 accumulation).
  __nv_bfloat16 *A, *B, *C;
  ok(cudaMalloc(&A, sizeof(__nv_bfloat16) * size_t(a.m) * a.k), "cudaMalloc A");
  ok(cudaMalloc(&B, sizeof(__nv_bfloat16) * size_t(a.k) * a.n), "cudaMalloc B");
  ok(cudaMalloc(&C, sizeof(__nv_bfloat16) * size_t(a.m) * a.n), "cudaMalloc C");
  fillBf16<<<1024, 256>>>(A, size_t(a.m) * a.k, 1);
  fillBf16<<<1024, 256>>>(B, size_t(a.k) * a.n, 2);
  // Copy buffers: an allgather's receive side, chunk c from chunk c of the source.
  const size_t bytes = a.copy_mib << 20;
  char *src, *dst;
  ok(cudaMalloc(&src, bytes), "cudaMalloc src");
  ok(cudaMalloc(&dst, bytes), "cudaMalloc dst");
  ok(cudaMemset(src, 7, bytes), "cudaMemset");
  ok(cudaDeviceSynchronize(), "init");

  cudaStream_t compute, gate_stream;
  ok(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "stream");
  ok(cudaStreamCreateWithFlags(&gate_stream, cudaStreamNonBlocking), "stream");
  CudaCopyEngine ce(0);
  cublasHandle_t blas;
  ok(cublasCreate(&blas), "cublasCreate");
  ok(cublasSetStream(blas, compute), "cublasSetStream");
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&] {
    ok(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, a.m, a.n, a.k, &alpha, A, CUDA_R_16BF, a.m, B,
                    CUDA_R_16BF, a.k, &beta, C, CUDA_R_16BF, a.m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
       "cublasGemmEx");
  };
  std::vector<CopyOp> ops;
  const size_t chunk = bytes / a.chunks;
  for (int c = 0; c < a.chunks; ++c) ops.push_back({src + c * chunk, dst + c * chunk, chunk});
  const size_t copied_per_round = chunk * a.chunks;
  auto ceRound = [&] { ce.enqueue(ops); };
  auto smRound = [&](int ctas, cudaStream_t s) {
    smCopy<<<ctas, 512, 0, s>>>(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(src),
                                copied_per_round / sizeof(int4));
    ok(cudaGetLastError(), "smCopy launch");
  };

  cudaEvent_t ev_gate, ev_a, ev_b, ev_c;
  for (cudaEvent_t* e : {&ev_gate, &ev_a, &ev_b, &ev_c}) ok(cudaEventCreate(e), "cudaEventCreate");
  auto elapsed = [&](cudaEvent_t x, cudaEvent_t y) {
    float ms = 0;
    ok(cudaEventSynchronize(y), "cudaEventSynchronize");
    ok(cudaEventElapsedTime(&ms, x, y), "cudaEventElapsedTime");
    return static_cast<double>(ms);
  };
  // One timed window on one stream.
  auto timeOn = [&](cudaStream_t s, auto&& body) {
    ok(cudaEventRecord(ev_a, s), "record");
    body();
    ok(cudaEventRecord(ev_b, s), "record");
    return elapsed(ev_a, ev_b);
  };

  for (int i = 0; i < 3; ++i) gemm();  // cuBLAS heuristics and clocks warm up
  ceRound();
  smRound(sms, compute);
  ok(cudaDeviceSynchronize(), "warm-up");

  const double flop = 2.0 * a.m * a.n * double(a.k) * a.iters;
  auto tflops = [&](double ms) { return flop / (ms * 1e-3) / 1e12; };
  std::vector<double> reps;
  for (int r = 0; r < a.reps; ++r)
    reps.push_back(timeOn(compute, [&] {
      for (int i = 0; i < a.iters; ++i) gemm();
    }));
  const double mm_alone = median(reps);
  const double round_ms = [&] {
    std::vector<double> v;
    for (int r = 0; r < a.reps; ++r) v.push_back(timeOn(ce.stream(), ceRound));
    return median(v);
  }();
  // Enough rounds that the copy alone lasts about as long as the matmul alone.
  const int rounds = std::max(1, static_cast<int>(mm_alone / round_ms + 0.5));
  const double total_bytes = double(copied_per_round) * rounds;
  auto gbs = [&](double ms) { return total_bytes / (ms * 1e-3) / 1e9; };

  std::vector<double> v;
  for (int r = 0; r < a.reps; ++r)
    v.push_back(timeOn(ce.stream(), [&] {
      for (int i = 0; i < rounds; ++i) ceRound();
    }));
  const double ce_alone = median(v);

  // Both streams wait on the gate, so neither starts before everything is enqueued.
  auto concurrent = [&](cudaStream_t copy_stream, auto&& copy_round, double* mm_ms, double* copy_ms) {
    std::vector<double> m, c;
    for (int r = 0; r < a.reps; ++r) {
      gate<<<1, 1, 0, gate_stream>>>(10000000);  // 10 ms: longer than enqueueing takes
      ok(cudaEventRecord(ev_gate, gate_stream), "record gate");
      ok(cudaStreamWaitEvent(compute, ev_gate, 0), "wait gate");
      ok(cudaStreamWaitEvent(copy_stream, ev_gate, 0), "wait gate");
      ok(cudaEventRecord(ev_a, compute), "record");
      for (int i = 0; i < rounds; ++i) copy_round();
      ok(cudaEventRecord(ev_c, copy_stream), "record");
      for (int i = 0; i < a.iters; ++i) gemm();
      ok(cudaEventRecord(ev_b, compute), "record");
      m.push_back(elapsed(ev_a, ev_b));
      c.push_back(elapsed(ev_a, ev_c));
    }
    *mm_ms = median(m);
    *copy_ms = median(c);
  };

  std::printf(
      "device: %s, %d SMs; matmul %dx%dx%d bf16 (fp32 accumulate) x %d; copy %d rounds of %zu MiB "
      "(%d chunks); median of %d\n",
      prop.name, sms, a.m, a.n, a.k, a.iters, rounds, a.copy_mib, a.chunks, a.reps);
  std::printf("%-34s %10s %9s %9s %10s %9s\n", "mode", "matmul ms", "TFLOP/s", "vs alone", "copy GB/s",
              "copy ms");
  std::printf("%-34s %10.2f %9.1f %9.3f %10s %9s\n", "matmul alone", mm_alone, tflops(mm_alone), 1.0, "-",
              "-");
  std::printf("%-34s %10s %9s %9s %10.1f %9.2f\n", "copy alone: copy engines (0 SMs)", "-", "-", "-",
              gbs(ce_alone), ce_alone);
  double mm_ms = 0, copy_ms = 0;
  concurrent(ce.stream(), ceRound, &mm_ms, &copy_ms);
  const double ce_ratio = mm_alone / mm_ms;
  std::printf("%-34s %10.2f %9.1f %9.3f %10.1f %9.2f\n", "matmul + copy engines (0 SMs)", mm_ms,
              tflops(mm_ms), ce_ratio, gbs(copy_ms), copy_ms);
  cudaStream_t sm_stream;
  ok(cudaStreamCreateWithFlags(&sm_stream, cudaStreamNonBlocking), "stream");
  std::string sm_results;
  double first_sm_ratio = 0;
  for (int ctas : a.sm_ctas) {
    const int n = ctas > 0 ? ctas : sms;
    v.clear();
    for (int r = 0; r < a.reps; ++r)
      v.push_back(timeOn(sm_stream, [&] {
        for (int i = 0; i < rounds; ++i) smRound(n, sm_stream);
      }));
    const double sm_alone = median(v);
    char label[64];
    std::snprintf(label, sizeof label, "copy alone: SM kernel %d CTAs", n);
    std::printf("%-34s %10s %9s %9s %10.1f %9.2f\n", label, "-", "-", "-", gbs(sm_alone), sm_alone);
    concurrent(
        sm_stream, [&] { smRound(n, sm_stream); }, &mm_ms, &copy_ms);
    const double ratio = mm_alone / mm_ms;
    std::snprintf(label, sizeof label, "matmul + SM kernel %d CTAs", n);
    std::printf("%-34s %10.2f %9.1f %9.3f %10.1f %9.2f\n", label, mm_ms, tflops(mm_ms), ratio, gbs(copy_ms),
                copy_ms);
    if (first_sm_ratio == 0) first_sm_ratio = ratio;
    char kv[64];
    std::snprintf(kv, sizeof kv, " sm%d_ratio=%.3f", n, ratio);
    sm_results += kv;
  }
  std::printf("RESULT matmul_alone_tflops=%.1f ce_ratio=%.3f sm_ratio=%.3f%s\n", tflops(mm_alone), ce_ratio,
              first_sm_ratio, sm_results.c_str());
  ok(cudaDeviceSynchronize(), "final");
  cublasDestroy(blas);
  return 0;
}
