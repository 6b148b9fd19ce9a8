// CPU tests of the CUDA symmetric-heap pieces: the CUDA segment allocator's contract
// and its clean failures without a driver, handle bytes through the allocator API,
// the heap's pad hooks, stream-signal / device-handle argument checks, and NCCL
// interop failing cleanly without a GPU. Ranks run as forked processes, so the
// gtest process never initializes CUDA for these.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/errors.h"
#include "harness/multiprocess.h"
#include "symmem/cuda/cuda_segment_allocator.h"
#include "symmem/cuda/cuda_symmetric.h"
#include "symmem/cuda/driver_api.h"
#include "symmem/cuda/nccl_window.h"
#include "symmem/cuda/vmm.h"
#include "symmem/symmetric_heap.h"

namespace crossbar::cuda {
namespace {

using crossbar::testing::RankEnv;
using crossbar::testing::runRanks;

VmmHandleInfo infoOf(size_t bytes) {
  VmmHandleInfo info;
  info.size = bytes;
  info.granularity = 2 << 20;
  info.device = 0;
  info.handle_types = kVmmHandlePosixFd;
  info.pid = 4242;
  info.allocation_id = 7;
  return info;
}

TEST(CudaSegmentAllocator, DescribesItselfWithoutTouchingTheDriver) {
  auto a = makeCudaSegmentAllocator(0);
  EXPECT_STREQ(a->name(), "cuda");
  EXPECT_EQ(a->kind(), symm::MemoryKind::kCuda);
  EXPECT_FALSE(a->hostAccessible());
  EXPECT_THROW(makeCudaSegmentAllocator(-1), InvalidArgument);
}

TEST(CudaSegmentAllocator, ImportRejectsBadHandleBytesBeforeTheDriver) {
  auto a = makeCudaSegmentAllocator(0);
  const size_t bytes = 4 << 20;
  EXPECT_THROW(a->import(0, {}, bytes, 1), InvalidArgument);  // no info (a host-backend peer)
  std::vector<uint8_t> garbage(40, 0xAB);
  EXPECT_THROW(a->import(0, garbage, bytes, 1), InvalidArgument);
  auto good = infoOf(bytes).serialize();
  auto truncated = good;
  truncated.resize(good.size() - 3);
  EXPECT_THROW(a->import(0, truncated, bytes, 1), InvalidArgument);
  try {
    a->import(0, good, 2 * bytes, 1);  // the heap announced another size
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(a->import(-1, good, bytes, 1), InvalidArgument);
}

// Everything below needs to know there is no driver: probe in a child (the probe
// initializes the CUDA runtime, which must not happen in a process that forks).
bool childSeesDriver() {
  pid_t pid = fork();
  if (pid == 0) _exit(driverAvailable() ? 0 : 1);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

class NoDriverHeap : public ::testing::Test {
 protected:
  void SetUp() override {
    if (childSeesDriver())
      GTEST_SKIP() << "a CUDA driver and device are present; these cover machines without";
  }
};

TEST_F(NoDriverHeap, AllocatorRaisesUnsupported) {
  runRanks(1, [](RankEnv&) {
    auto a = makeCudaSegmentAllocator(0);
    EXPECT_THROW(a->granularity(), Unsupported);
    EXPECT_THROW(a->allocate({1 << 20, "t", 0}), Unsupported);
    // Well-formed bytes get past parsing and stop at the driver: the bytes round-trip.
    const size_t bytes = 4 << 20;
    int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    EXPECT_THROW(a->import(fd, infoOf(bytes).serialize(), bytes, 1), Unsupported);
    ::close(fd);
  });
}

TEST_F(NoDriverHeap, HeapCreatesButAllocateIsUnsupported) {
  runRanks(2, [](RankEnv& env) {
    auto heap = symm::SymmetricHeap::create(env.communicator(), {.allocator = makeCudaSegmentAllocator(0)});
    EXPECT_EQ(heap.allocator().kind(), symm::MemoryKind::kCuda);
    try {
      heap.allocate(1 << 20);
      ADD_FAILURE() << "expected Unsupported";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
    }
  });
}

TEST_F(NoDriverHeap, NcclCommHolderIsUnsupported) {
  runRanks(1, [](RankEnv& env) { EXPECT_THROW(NcclCommHolder::create(env.communicator()), Unsupported); });
}

TEST(NcclInterop, UnsetHolderAndResultText) {
  NcclCommHolder h;
  EXPECT_FALSE(h.valid());
  EXPECT_THROW(h.get(), InvalidUsage);
  EXPECT_THROW(NcclWindow::registerBuffer(h, nullptr, 4096), InvalidUsage);
  NcclWindow w;
  EXPECT_FALSE(w.valid());
  w.deregister();  // nothing registered: a no-op
  EXPECT_NE(ncclResultText(ncclInvalidUsage).find("ncclInvalidUsage"), std::string::npos);
  EXPECT_NE(ncclResultText(ncclInProgress).find("ncclInProgress"), std::string::npos);
}

TEST(HeapPadHooks, LayoutAndCountersOnTheHostBackend) {
  runRanks(2, [](RankEnv& env) {
    symm::HeapOptions options;
    options.channels = 4;
    auto heap = symm::SymmetricHeap::create(env.communicator(), options);
    auto buf = heap.allocate(10000);
    const int peer = 1 - env.rank;
    EXPECT_EQ(buf->memoryKind(), symm::MemoryKind::kHost);
    EXPECT_GE(buf->signalPadOffset(), buf->size());
    EXPECT_EQ(buf->signalPadOffset() % 4096, 0u);
    EXPECT_EQ(buf->signalSlot(1, 2), 2u * 2 + 1);
    EXPECT_EQ(buf->reserveSignal(peer, 3), 1u);
    EXPECT_EQ(buf->reserveSignal(peer, 3), 2u);
    EXPECT_EQ(buf->reserveWait(peer, 3), 1u);
    EXPECT_THROW(buf->reserveSignal(2, 0), InvalidArgument);
    EXPECT_THROW(buf->reserveWait(peer, 4), InvalidArgument);
    // The hooks share the host path's counters: a host signal now carries value 3.
    buf->putSignal(peer, 3);
    buf->waitSignalValue(peer, 3, 3, env.communicator()->defaultDeadline());
    EXPECT_EQ(buf->signalValue(peer, 3), 3u);
    // The slot arithmetic matches where the host path writes.
    auto* slot = reinterpret_cast<uint64_t*>(buf->local<char>(
        buf->signalPadOffset() + buf->signalSlot(peer, 3) * symm::SymmetricBuffer::kSignalSlotBytes));
    EXPECT_EQ(__atomic_load_n(slot, __ATOMIC_ACQUIRE), 3u);
    // CUDA helpers refuse host buffers with a clear message (no driver needed).
    EXPECT_THROW(makeDeviceHandle(*buf), InvalidArgument);
    EXPECT_THROW(streamPutSignal(*buf, peer, 0, nullptr), InvalidArgument);
    EXPECT_THROW(streamWaitSignal(*buf, peer, 0, nullptr), InvalidArgument);
    EXPECT_THROW(signalSlotAddress(*buf, peer, env.rank, 0), InvalidArgument);
    buf->barrier(0, env.communicator()->defaultDeadline());
    buf->free();
  });
}

}  // namespace
}  // namespace crossbar::cuda
