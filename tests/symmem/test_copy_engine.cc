// Host copy engine and the streaming-store copy: odd sizes and alignments, batches
// across workers, fences, inline mode.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "comm/errors.h"
#include "symmem/copy_engine.h"

namespace crossbar::symm {
namespace {

uint8_t byteAt(uint64_t seed, size_t i) {
  return static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 9)) & 0xff);
}

TEST(CopyBytes, NonTemporalOddSizesAndAlignments) {
  std::vector<uint8_t> src(1 << 16), dst((1 << 16) + 128);
  for (size_t i = 0; i < src.size(); ++i) src[i] = byteAt(1, i);
  for (size_t bytes :
       {0ul, 1ul, 15ul, 31ul, 63ul, 64ul, 127ul, 128ul, 129ul, 1000ul, 4095ul, 4096ul, 40001ul}) {
    for (size_t soff : {0ul, 1ul, 7ul, 16ul, 33ul}) {
      for (size_t doff : {0ul, 3ul, 8ul, 31ul, 32ul}) {
        if (soff + bytes > src.size() || doff + bytes + 64 > dst.size()) continue;
        std::fill(dst.begin(), dst.end(), 0xEE);
        copyBytesNonTemporal(dst.data() + doff, src.data() + soff, bytes);
        ASSERT_EQ(std::memcmp(dst.data() + doff, src.data() + soff, bytes), 0)
            << bytes << " bytes, src+" << soff << " dst+" << doff;
        // Nothing written outside [doff, doff + bytes).
        for (size_t i = 0; i < doff; ++i) ASSERT_EQ(dst[i], 0xEE);
        for (size_t i = doff + bytes; i < doff + bytes + 64; ++i) ASSERT_EQ(dst[i], 0xEE);
      }
    }
  }
}

TEST(CopyBytes, LargeUsesStreamingPathAndMatchesMemcpy) {
  const size_t n = (3u << 20) + 77;
  std::vector<uint8_t> src(n + 5), a(n + 5), b(n + 5);
  for (size_t i = 0; i < src.size(); ++i) src[i] = byteAt(2, i);
  copyBytes(a.data() + 1, src.data() + 3, n, 1 << 20);  // above threshold: streaming
  std::memcpy(b.data() + 1, src.data() + 3, n);
  EXPECT_EQ(a, b);
}

class CopyEngineTest : public ::testing::TestWithParam<int> {};

TEST_P(CopyEngineTest, BatchOfOddCopies) {
  CopyEngineOptions o;
  o.threads = GetParam();
  o.nt_threshold = 4096;     // exercise both paths
  o.chunk_bytes = 64 << 10;  // several chunks per large copy
  CopyEngine ce(o);
  EXPECT_EQ(ce.threads(), GetParam());
  std::mt19937_64 rng(42);
  const size_t arena = 8 << 20;
  std::vector<uint8_t> src(arena), dst(arena, 0);
  for (size_t i = 0; i < arena; ++i) src[i] = byteAt(3, i);
  std::vector<CopyOp> ops;
  size_t pos = 0;
  while (pos < arena - (1 << 20)) {
    size_t bytes = rng() % 3 == 0 ? rng() % 700'000 : rng() % 5000;
    size_t gap = rng() % 61;
    ops.push_back({src.data() + pos + gap, dst.data() + pos + gap, bytes});
    pos += gap + bytes + 1;
  }
  ops.push_back({src.data(), dst.data(), 0});  // empty copies are fine
  auto done = ce.submit(ops);
  done.wait(Deadline::after(Millis(30'000)));
  EXPECT_TRUE(done.done());
  for (const auto& op : ops) ASSERT_EQ(std::memcmp(op.dst, op.src, op.bytes), 0) << op.bytes << " bytes";
}

TEST_P(CopyEngineTest, FenceOrdersBatches) {
  CopyEngineOptions o;
  o.threads = GetParam();
  o.chunk_bytes = 64 << 10;
  CopyEngine ce(o);
  const size_t n = 2 << 20;
  std::vector<uint8_t> a(n), b(n, 0), c(n, 0);
  for (int round = 0; round < 20; ++round) {
    for (size_t i = 0; i < n; i += 4093) a[i] = byteAt(round, i);
    ce.submit(a.data(), b.data(), n);
    ce.fence();  // b is complete before the next batch reads it
    auto last = ce.submit(b.data(), c.data(), n);
    ce.fence();
    last.wait(Deadline::after(Millis(30'000)));
    ASSERT_EQ(std::memcmp(a.data(), c.data(), n), 0) << "round " << round;
  }
  ce.synchronize(Deadline::after(Millis(30'000)));
}

INSTANTIATE_TEST_SUITE_P(Workers, CopyEngineTest, ::testing::Values(0, 1, 3),
                         [](const auto& info) { return "threads" + std::to_string(info.param); });

TEST(CopyEngine, DefaultThreadsFromEnvironment) {
  setenv("CROSSBAR_COPY_ENGINE_THREADS", "2", 1);
  CopyEngine ce;
  EXPECT_EQ(ce.threads(), 2);
  unsetenv("CROSSBAR_COPY_ENGINE_THREADS");
  CopyEngineOptions o;
  o.threads = -5;
  EXPECT_THROW(CopyEngine bad(o), InvalidArgument);
}

TEST(CopyEngine, NullPointerIsInvalidArgument) {
  CopyEngineOptions o;
  o.threads = 1;
  CopyEngine ce(o);
  std::vector<uint8_t> d(8);
  EXPECT_THROW(ce.submit(nullptr, d.data(), 8), InvalidArgument);
}

}  // namespace
}  // namespace crossbar::symm
