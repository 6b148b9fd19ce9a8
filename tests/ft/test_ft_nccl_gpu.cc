// NCCL fault tolerance against the real NCCL on one GPU (one rank: NCCL allows one rank
// per GPU, so no rank can be excluded here). Verifies that the calls fault tolerance
// makes work on a real communicator: nonblocking init from the store, a collective,
// ncclCommRevoke on revoke, ncclCommShrink (excluding nobody) or the agreed fallback,
// re-creation with ncclCommInitRankConfig, and a correct collective after each.
// Skips without a CUDA device.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <vector>

#include "comm/ft.h"
#include "comm/tcp_store.h"
#include "symmem/cuda/nccl_ft.h"

namespace crossbar::testing {
namespace {

using cuda::NcclFtComm;

// Sum over one rank: the output equals the input.
void allreduceWorks(ncclComm_t comm, const std::string& what) {
  SCOPED_TRACE(what);
  constexpr size_t kCount = 1 << 16;
  float* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, kCount * sizeof(float)), cudaSuccess);
  std::vector<float> host(kCount);
  for (size_t i = 0; i < kCount; ++i) host[i] = static_cast<float>(i % 251);
  ASSERT_EQ(cudaMemcpy(buf, host.data(), kCount * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ncclResult_t r = ncclAllReduce(buf, buf, kCount, ncclFloat, ncclSum, comm, stream);
  auto deadline = Deadline::after(Millis(60'000));
  ncclResult_t state = r;
  while (state == ncclInProgress && !deadline.expired()) ncclCommGetAsyncError(comm, &state);
  EXPECT_EQ(state, ncclSuccess) << ncclGetErrorString(state);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<float> out(kCount, -1);
  ASSERT_EQ(cudaMemcpy(out.data(), buf, kCount * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(out, host);
  cudaStreamDestroy(stream);
  cudaFree(buf);
}

TEST(NcclFtGpu, OneRankRevokeShrinkReinit) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  auto api = cuda::NcclFtApi::real();
  std::printf("NCCL %d: ncclCommShrink %s, ncclCommRevoke %s\n", api.version, api.shrink ? "yes" : "no",
              api.revoke ? "yes" : "no");
  TcpStoreServer server("127.0.0.1", 0);
  TcpStoreOptions so;
  so.port = server.port();
  auto store = std::make_shared<TcpStore>(so);
  ft::FtOptions fo;
  fo.detector_store = std::make_shared<TcpStore>(so);
  auto ft = ft::FaultTolerantComm::create(store, 0, 1, fo);

  cuda::NcclFtOptions shrinking;
  shrinking.device = 0;
  shrinking.timeout = Millis(15'000);  // a stuck revoke or shrink falls back within the GPU run's budget
  auto nccl = NcclFtComm::create(*ft, shrinking);
  cuda::NcclFtOptions recreating = shrinking;
  recreating.allow_shrink = false;
  recreating.name = "recreating";
  auto nccl2 = NcclFtComm::create(*ft, recreating);
  allreduceWorks(nccl->get(), "epoch 0");
  allreduceWorks(nccl2->get(), "epoch 0, second communicator");

  for (int cycle = 1; cycle <= 2; ++cycle) {
    ft->abort(fmt::format("test: revoke {}", cycle));
    EXPECT_TRUE(nccl->revoked());
    EXPECT_TRUE(nccl2->revoked());
    EXPECT_THROW(nccl->get(), InvalidUsage);
    ft->shrink();
    std::printf("cycle %d: shrink-capable communicator: %s; forced re-creation: %s\n", cycle,
                nccl->lastRebuild().c_str(), nccl2->lastRebuild().c_str());
    if (api.shrink) {
      // Either NCCL shrank (excluding nobody) or every rank agreed to re-create.
      EXPECT_TRUE(nccl->lastRebuild() == "shrink" ||
                  nccl->lastRebuild().rfind("reinit: shrink failed", 0) == 0)
          << nccl->lastRebuild();
    }
    EXPECT_EQ(nccl2->lastRebuild().rfind("reinit:", 0), 0u) << nccl2->lastRebuild();
    EXPECT_EQ(nccl->epoch(), static_cast<uint64_t>(cycle));
    allreduceWorks(nccl->get(), fmt::format("after cycle {}", cycle));
    allreduceWorks(nccl2->get(), fmt::format("after cycle {}, second communicator", cycle));
  }
  nccl2->close();
  nccl->close();
}

}  // namespace
}  // namespace crossbar::testing
