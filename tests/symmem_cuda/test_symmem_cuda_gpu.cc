// GPU tests of symmem/cuda. Each case runs in forked child processes (see
// gpu_checks.h) and is skipped without a CUDA device/driver. The same checks run
// without gtest through perf/gpu/gpu_selftest (perf/gpu_check.sh).
#include <gtest/gtest.h>

#include "gpu_checks.h"

namespace crossbar::gpucheck {
namespace {

void runNamed(const char* name) {
  if (!gpuUnavailableReason().empty()) GTEST_SKIP() << gpuUnavailableReason();
  const Check* check = findCheck(name);
  ASSERT_NE(check, nullptr) << name;
  Result r = runCheck(*check, 180);
  if (r.status == Status::kSkip) GTEST_SKIP() << r.message;
  EXPECT_EQ(r.status, Status::kPass) << check->description << ": " << r.message;
}

TEST(SymmemCudaGpu, VmmLocal) {
  runNamed("vmm_local");
}
TEST(SymmemCudaGpu, VmmTwoProcess) {
  runNamed("vmm_two_process");
}
TEST(SymmemCudaGpu, StreamSignals) {
  runNamed("stream_signals");
}
TEST(SymmemCudaGpu, CopyEngine) {
  runNamed("copy_engine");
}
TEST(SymmemCudaGpu, KernelPutSignal) {
  runNamed("kernel_put_signal");
}
TEST(SymmemCudaGpu, Multicast) {
  runNamed("multicast");
}

TEST(SymmemCudaGpu, EveryCheckHasATest) {
  EXPECT_EQ(allChecks().size(), 6u);
}

}  // namespace
}  // namespace crossbar::gpucheck
