// CPU-side tests of symmem/cuda: pure helpers, handle serialization, and clean
// failures (no crashes) on machines without a CUDA driver or device.
#include <gtest/gtest.h>

#include <limits>
#include <type_traits>

#include "comm/errors.h"
#include "symmem/cuda/copy_engine_cuda.h"
#include "symmem/cuda/device_handle.h"
#include "symmem/cuda/driver_api.h"
#include "symmem/cuda/stream_signal.h"
#include "symmem/cuda/vmm.h"

namespace crossbar::cuda {
namespace {

constexpr size_t kMiB = 1 << 20;

TEST(Granularity, RoundsUpToGranularity) {
  EXPECT_EQ(roundToGranularity(1, 2 * kMiB), 2 * kMiB);
  EXPECT_EQ(roundToGranularity(2 * kMiB, 2 * kMiB), 2 * kMiB);
  EXPECT_EQ(roundToGranularity(2 * kMiB + 1, 2 * kMiB), 4 * kMiB);
  EXPECT_EQ(roundToGranularity(0, 2 * kMiB), 2 * kMiB);  // an empty buffer still gets one unit
}

TEST(Granularity, AtLeastPageAlignedAndLcmForOddGranularity) {
  EXPECT_EQ(roundToGranularity(1, 512), 4096u);
  EXPECT_EQ(roundToGranularity(4097, 512), 8192u);
  EXPECT_EQ(roundToGranularity(1, 6144), 12288u);  // lcm(6144, 4096)
  EXPECT_EQ(roundToGranularity(12289, 6144), 24576u);
}

TEST(Granularity, RejectsZeroAndOverflow) {
  EXPECT_THROW(roundToGranularity(10, 0), InvalidArgument);
  EXPECT_THROW(roundToGranularity(std::numeric_limits<size_t>::max() - 5, 2 * kMiB), InvalidArgument);
}

TEST(Granularity, AlignOffset) {
  EXPECT_EQ(alignOffset(0), 0u);
  EXPECT_EQ(alignOffset(1), 4096u);
  EXPECT_EQ(alignOffset(4096), 4096u);
  EXPECT_EQ(alignOffset(5, 8), 8u);
  EXPECT_THROW(alignOffset(5, 3), InvalidArgument);
  EXPECT_THROW(alignOffset(5, 0), InvalidArgument);
}

VmmHandleInfo sampleInfo() {
  VmmHandleInfo info;
  info.size = 64 * kMiB;
  info.granularity = 2 * kMiB;
  info.device = 3;
  info.handle_types = kVmmHandlePosixFd | kVmmHandleFabric;
  info.pid = 4242;
  info.allocation_id = 0x1234567890ull;
  for (int i = 0; i < 16; ++i) info.device_uuid[i] = static_cast<uint8_t>(i * 7);
  for (int i = 0; i < 64; ++i) info.fabric_handle[i] = static_cast<uint8_t>(255 - i);
  return info;
}

TEST(VmmHandleInfo, RoundTrip) {
  VmmHandleInfo info = sampleInfo();
  auto bytes = info.serialize();
  EXPECT_EQ(VmmHandleInfo::deserialize(bytes), info);
  info.handle_types = kVmmHandlePosixFd;
  info.fabric_handle = {};
  EXPECT_EQ(VmmHandleInfo::deserialize(info.serialize()), info);
}

void expectCorrupt(const std::vector<uint8_t>& bytes, const char* what) {
  try {
    VmmHandleInfo::deserialize(bytes);
    ADD_FAILURE() << what << ": expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("VmmHandleInfo::deserialize"), std::string::npos) << e.what();
  }
}

TEST(VmmHandleInfo, CorruptInputIsInvalidArgument) {
  const auto good = sampleInfo().serialize();
  expectCorrupt({}, "empty");
  expectCorrupt({good.begin(), good.begin() + 7}, "shorter than header");
  expectCorrupt({good.begin(), good.end() - 1}, "truncated");
  auto longer = good;
  longer.push_back(0);
  expectCorrupt(longer, "trailing byte");
  auto magic = good;
  magic[0] ^= 0xFF;
  expectCorrupt(magic, "magic");
  auto version = good;
  version[4] = 99;
  expectCorrupt(version, "version");
  // Every single-bit flip anywhere is caught (checksum or header checks).
  for (size_t i = 0; i < good.size(); ++i) {
    auto flipped = good;
    flipped[i] ^= 0x10;
    expectCorrupt(flipped, "bit flip");
  }
}

TEST(VmmHandleInfo, InvalidFieldsWithValidChecksum) {
  auto bad = [](auto mutate) {
    VmmHandleInfo info = sampleInfo();
    mutate(info);
    return info.serialize();
  };
  expectCorrupt(bad([](VmmHandleInfo& i) { i.size = 0; }), "size 0");
  expectCorrupt(bad([](VmmHandleInfo& i) { i.size = 3 * kMiB; }), "size not a multiple");
  expectCorrupt(bad([](VmmHandleInfo& i) { i.granularity = 0; }), "granularity 0");
  expectCorrupt(bad([](VmmHandleInfo& i) { i.device = -1; }), "device");
  expectCorrupt(bad([](VmmHandleInfo& i) { i.handle_types = 0; }), "no handle types");
  expectCorrupt(bad([](VmmHandleInfo& i) { i.handle_types = 0x8; }), "unknown handle type");
  expectCorrupt(bad([](VmmHandleInfo& i) { i.pid = 0; }), "pid");
}

TEST(SymmDeviceHandle, PlainStructWithHostHelpers) {
  static_assert(std::is_trivially_copyable_v<SymmDeviceHandle>);
  static_assert(std::is_standard_layout_v<SymmDeviceHandle>);
  alignas(8) static char buf[2][256];
  alignas(8) static uint64_t pads[2][kMaxLocalRanks];
  SymmDeviceHandle h{};
  h.rank = 1;
  h.local_size = 2;
  h.size = 256;
  h.peer_ptrs[0] = buf[0];
  h.peer_ptrs[1] = buf[1];
  h.signal_pads[0] = pads[0];
  h.signal_pads[1] = pads[1];
  EXPECT_EQ(h.peer<char>(0, 16), &buf[0][16]);
  EXPECT_EQ(h.peer<uint32_t>(1), reinterpret_cast<uint32_t*>(buf[1]));
  EXPECT_EQ(h.outboxSlot(0), &pads[0][1]);  // rank 1 writes slot 1 of rank 0's pad
  EXPECT_EQ(h.inboxSlot(0), &pads[1][0]);   // and reads slot 0 of its own
}

// ---- without a driver: clear errors, no crashes ----------------------------------------

class NoDriver : public ::testing::Test {
 protected:
  void SetUp() override {
    if (driverAvailable())
      GTEST_SKIP() << "a CUDA driver and device are present; these cover machines without";
  }
};

template <typename Fn>
void expectUnsupported(Fn fn, const char* what) {
  try {
    fn();
    ADD_FAILURE() << what << ": expected Unsupported";
  } catch (const Unsupported& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("CUDA"), std::string::npos) << msg;
    EXPECT_NE(msg.find("host"), std::string::npos) << msg;  // names the host and suggests a fix
  }
}

TEST_F(NoDriver, ProbeReportsWhy) {
  EXPECT_FALSE(driverUnavailableReason().empty());
  EXPECT_EQ(deviceCount(), 0);
  EXPECT_FALSE(multicastSupported(0));
  EXPECT_FALSE(streamMemOps64Supported(0));
  EXPECT_EQ(deviceAttribute(0, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, -7), -7);
  expectUnsupported([] { driver("test"); }, "driver()");
}

TEST_F(NoDriver, EveryApiFailsCleanly) {
  expectUnsupported([] { VmmAllocation::create(kMiB, 0); }, "VmmAllocation::create");
  expectUnsupported([] { MappedPeerAllocation::import(sampleInfo(), 5, 0); }, "import");
  expectUnsupported([] { MulticastObject::create(kMiB, 1, 0); }, "MulticastObject::create");
  alignas(8) uint64_t word = 0;
  expectUnsupported([&] { streamWriteValue32(nullptr, reinterpret_cast<uint32_t*>(&word), 1); }, "write32");
  expectUnsupported([&] { streamWriteValue64(nullptr, &word, 1); }, "write64");
  expectUnsupported([&] { streamWaitValue32(nullptr, reinterpret_cast<uint32_t*>(&word), 1, WaitCond::kEq); },
                    "wait32");
  expectUnsupported([&] { streamWaitValue64(nullptr, &word, 1, WaitCond::kGeq); }, "wait64");
  expectUnsupported([] { CudaCopyEngine ce(0); }, "CudaCopyEngine");
  expectUnsupported([] { ensureContext(0, "test"); }, "ensureContext");
  // Empty (default/moved-from) objects are safe to destroy and to query.
  VmmAllocation empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_THROW(empty.exportFd(), InvalidUsage);
  MappedPeerAllocation none;
  EXPECT_FALSE(none.valid());
}

TEST(CudaErrors, MessagesNameCallDeviceAndResult) {
  try {
    checkCu(CUDA_ERROR_INVALID_VALUE, "cuMemMap", 2);
    ADD_FAILURE() << "expected CudaError";
  } catch (const CudaError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("cuMemMap"), std::string::npos) << msg;
    EXPECT_NE(msg.find("device 2"), std::string::npos) << msg;
    // The name comes from the driver when present, else the number.
    EXPECT_TRUE(msg.find("CUDA_ERROR_INVALID_VALUE") != std::string::npos ||
                msg.find("CUresult 1") != std::string::npos)
        << msg;
  }
  try {
    checkCuda(cudaErrorMemoryAllocation, "cudaMalloc", 0);
    ADD_FAILURE() << "expected CudaError";
  } catch (const CudaError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("cudaErrorMemoryAllocation"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Free GPU memory"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(checkCu(CUDA_SUCCESS, "x", 0));
  EXPECT_NO_THROW(checkCuda(cudaSuccess, "x", 0));
}

}  // namespace
}  // namespace crossbar::cuda
