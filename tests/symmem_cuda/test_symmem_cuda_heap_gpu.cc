// GPU tests of the CUDA symmetric heap and NCCL interop (skip without a device).
// Ranks are forked processes sharing GPU 0 (harness/multiprocess.h), each creating
// its CUDA context after the fork; the gtest process never initializes CUDA.
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "comm/errors.h"
#include "gpu_checks.h"
#include "gpu_kernels.h"
#include "harness/multiprocess.h"
#include "symmem/cuda/cuda_segment_allocator.h"
#include "symmem/cuda/cuda_symmetric.h"
#include "symmem/cuda/driver_api.h"
#include "symmem/cuda/nccl_window.h"
#include "symmem/symmetric_heap.h"

namespace crossbar::cuda {
namespace {

using crossbar::testing::RankEnv;
using crossbar::testing::runRanks;

#define CUDA_OK(call)                                                                                     \
  do {                                                                                                    \
    cudaError_t e_ = (call);                                                                              \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorName(e_) << " " << cudaGetErrorString(e_); \
  } while (0)

// The GPU never times out a stream wait: poll the stream on the host, with a deadline.
void syncStream(cudaStream_t s, const char* what, Millis limit = Millis(30'000)) {
  const auto until = Clock::now() + limit;
  while (true) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    ASSERT_EQ(e, cudaErrorNotReady) << what << ": " << cudaGetErrorString(e);
    ASSERT_LT(Clock::now(), until) << what << ": stream not done after " << limit.count()
                                   << " ms (a signal never arrived?)";
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

uint32_t word(int rank, size_t i, int round) {
  return static_cast<uint32_t>(rank * 0x01000193u + i * 2654435761u + round * 0x9E3779B1u);
}

class CudaHeapGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpucheck::gpuUnavailableReason().empty()) GTEST_SKIP() << gpucheck::gpuUnavailableReason();
  }
};

// 2 processes on one GPU: heap with the CUDA allocator, zero fill, copy-engine puts to
// peerPtr() ordered by stream signals, several rounds (counters only grow).
TEST_F(CudaHeapGpu, TwoProcessPutAndStreamSignals) {
  runRanks(2, [](RankEnv& env) {
    ASSERT_TRUE(driverAvailable()) << driverUnavailableReason();
    CUDA_OK(cudaSetDevice(0));
    auto heap = symm::SymmetricHeap::create(env.communicator(), {.allocator = makeCudaSegmentAllocator(0)});
    const size_t words = 1 << 18, bytes = 2 * words * 4;  // first half: the peer's puts; second: untouched
    auto buf = heap.allocate(bytes);
    const int peer = 1 - env.rank;
    ASSERT_NE(buf->peerPtr(peer), nullptr);
    ASSERT_NE(buf->peerPtr(peer), buf->localPtr());
    EXPECT_THROW(buf->putSignal(peer, 0), Unsupported);  // the host path refuses device pads
    EXPECT_THROW(buf->signalValue(peer, 0), Unsupported);

    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<uint32_t> src(words), got(words);
    for (int round = 0; round < 3; ++round) {
      for (size_t i = 0; i < words; ++i) src[i] = word(env.rank, i, round);
      // Data then signal in one stream; the peer's stream waits for it before reading.
      streamPutWithSignal(*buf, peer, 0, src.data(), words * 4, /*channel=*/0, s);
      streamWaitSignal(*buf, peer, 0, s);
      CUDA_OK(cudaMemcpyAsync(got.data(), buf->localPtr(), words * 4, cudaMemcpyDeviceToHost, s));
      // Barrier on channel 1 so nobody overwrites a region the peer still reads.
      streamPutSignal(*buf, peer, 1, s);
      streamWaitSignal(*buf, peer, 1, s);
      syncStream(s, "round");
      for (size_t i = 0; i < words; i += 997)
        ASSERT_EQ(got[i], word(peer, i, round)) << "round " << round << " word " << i;
    }
    // A pure device-to-peer copy (cudaMemcpy to peerPtr) is visible after a barrier too.
    uint32_t* dev = nullptr;
    CUDA_OK(cudaMalloc(&dev, 4096));
    CUDA_OK(cudaMemset(dev, 0x5A, 4096));
    CUDA_OK(cudaMemcpy(buf->peer<char>(peer, 4096), dev, 4096, cudaMemcpyDeviceToDevice));
    // A device-to-device cudaMemcpy may return before the copy is done, and `s` does not
    // order after the legacy stream: finish it before signalling.
    CUDA_OK(cudaDeviceSynchronize());
    streamPutSignal(*buf, peer, 1, s);
    streamWaitSignal(*buf, peer, 1, s);
    syncStream(s, "copy barrier");
    std::vector<uint8_t> bytes_back(4096);
    CUDA_OK(cudaMemcpy(bytes_back.data(), buf->local<char>(4096), 4096, cudaMemcpyDeviceToHost));
    for (uint8_t b : bytes_back) ASSERT_EQ(b, 0x5A);
    // The second half was never written: the allocator zero-filled it.
    CUDA_OK(cudaMemcpy(got.data(), buf->local<char>(words * 4), words * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < words; ++i) ASSERT_EQ(got[i], 0u) << "word " << i << " not zero-filled";
    cudaFree(dev);
    streamPutSignal(*buf, peer, 1, s);  // both done reading before either frees
    streamWaitSignal(*buf, peer, 1, s);
    syncStream(s, "final barrier");
    cudaStreamDestroy(s);
    buf->free();
  });
}

// The device handle of a heap buffer drives the SymmDeviceHandle kernel (16-byte pad slots).
TEST_F(CudaHeapGpu, TwoProcessKernelWithDeviceHandle) {
  runRanks(2, [](RankEnv& env) {
    CUDA_OK(cudaSetDevice(0));
    auto heap = symm::SymmetricHeap::create(env.communicator(), {.allocator = makeCudaSegmentAllocator(0)});
    const size_t words = 1 << 18;
    auto buf = heap.allocate(2 * words * 4);
    const int peer = 1 - env.rank;
    SymmDeviceHandle h = makeDeviceHandle(*buf, /*channel=*/2);
    EXPECT_EQ(h.outboxSlot(peer), signalSlotAddress(*buf, peer, env.rank, 2));
    EXPECT_EQ(h.inboxSlot(peer), signalSlotAddress(*buf, env.rank, peer, 2));
    uint32_t* flags = nullptr;
    CUDA_OK(cudaMalloc(&flags, 8));
    h.timeout_flag = flags;
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int blocks = 4;
    const long long timeout_cycles = 20LL * 2'000'000'000LL;
    for (uint64_t epoch = 1; epoch <= 3; ++epoch) {
      CUDA_OK(cudaMemsetAsync(flags, 0, 8, s));
      CUDA_OK(gpucheck::launchExchange(h, flags + 1, words, epoch, epoch * blocks, timeout_cycles,
                                       gpucheck::SignalMode::kAdd, blocks, s));
      streamPutSignal(*buf, peer, 0, s);  // barrier: the peer verified before the next epoch writes
      streamWaitSignal(*buf, peer, 0, s);
      syncStream(s, "kernel epoch");
      uint32_t host[2] = {};
      CUDA_OK(cudaMemcpy(host, flags, 8, cudaMemcpyDeviceToHost));
      ASSERT_EQ(host[0], 0u) << "kernel timed out waiting for the peer, epoch " << epoch;
      ASSERT_EQ(host[1], 0u) << "wrong words from the peer, epoch " << epoch;
    }
    cudaFree(flags);
    cudaStreamDestroy(s);
    buf->free();
  });
}

void ncclAllreduceOnWindow(bool cta_policy_zero) {
  runRanks(1, [cta_policy_zero](RankEnv& env) {
    CUDA_OK(cudaSetDevice(0));
    auto comm = env.communicator();
    NcclCommOptions options;
    options.device = 0;
    options.cta_policy_zero = cta_policy_zero;
    NcclCommHolder nccl = NcclCommHolder::create(comm, options);
    EXPECT_EQ(nccl.size(), 1);
    auto heap = symm::SymmetricHeap::create(comm, {.allocator = makeCudaSegmentAllocator(0)});
    const size_t n = 1 << 20;
    auto buf = heap.allocate(n * sizeof(float));
    fprintf(stderr, "[nccl test] communicator ready (cta_policy_zero=%d)\n", cta_policy_zero);
    NcclWindow win = NcclWindow::registerBuffer(nccl, *buf);
    ASSERT_TRUE(win.valid());
    fprintf(stderr, "[nccl test] window %s\n", win.registered() ? "registered" : "declined by NCCL");
    std::vector<float> host(n);
    for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 1000);
    CUDA_OK(cudaMemcpy(buf->localPtr(), host.data(), n * 4, cudaMemcpyHostToDevice));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float* out = nullptr;
    CUDA_OK(cudaMalloc(&out, n * 4));
    nccl.check(ncclAllReduce(buf->localPtr(), out, n, ncclFloat, ncclSum, nccl.get(), s), "ncclAllReduce");
    nccl.check(ncclAllReduce(buf->localPtr(), buf->localPtr(), n, ncclFloat, ncclSum, nccl.get(), s),
               "ncclAllReduce in place");
    syncStream(s, "allreduce");
    fprintf(stderr, "[nccl test] allreduce done\n");
    nccl.checkAsync("after allreduce");
    std::vector<float> back(n), back2(n);
    CUDA_OK(cudaMemcpy(back.data(), out, n * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(back2.data(), buf->localPtr(), n * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(back[i], host[i]) << i;  // one rank: the sum is the input
      ASSERT_EQ(back2[i], host[i]) << i;
    }
    cudaFree(out);
    cudaStreamDestroy(s);
    win.deregister();
    EXPECT_FALSE(win.valid());
    fprintf(stderr, "[nccl test] window deregistered\n");
    buf->free();
  });
}

TEST_F(CudaHeapGpu, NcclSingleRankWindowAllreduce) {
  ncclAllreduceOnWindow(false);
}

TEST_F(CudaHeapGpu, NcclSingleRankCtaPolicyZero) {
  ncclAllreduceOnWindow(true);
}

}  // namespace
}  // namespace crossbar::cuda
