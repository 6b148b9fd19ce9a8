// ProgressEngine::waitUntil blocks (does not spin) for the rest of a wait, also when less
// than a millisecond of it is left: its poll timeout has sub-millisecond resolution.
#include <gtest/gtest.h>
#include <poll.h>
#include <unistd.h>

#include <array>
#include <cstdlib>

#include "comm/deadline.h"
#include "comm/progress.h"
#include "comm/transport.h"

namespace crossbar {
namespace {

// A transport with nothing to do whose fd never becomes ready; counts progress passes.
class IdleTransport : public Transport {
 public:
  IdleTransport() { EXPECT_EQ(::pipe(fds_.data()), 0); }
  ~IdleTransport() override {
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  const char* name() const override { return "idle"; }
  RequestPtr isend(int, uint64_t, const void*, size_t) override { return nullptr; }
  RequestPtr irecv(int, uint64_t, void*, size_t) override { return nullptr; }
  RequestPtr tryRecvAny(uint64_t, void*, size_t) override { return nullptr; }
  bool progress() override {
    ++passes;
    return false;
  }
  void pollFds(std::vector<pollfd>& fds) override { fds.push_back(pollfd{fds_[0], POLLIN, 0}); }
  bool prepareSleep() override { return true; }
  void abort(std::exception_ptr) override {}

  long passes = 0;

 private:
  std::array<int, 2> fds_{};
};

TEST(ProgressEngine, SubMillisecondWaitSleepsInsteadOfSpinning) {
  ::setenv("CROSSBAR_SPIN_US", "0", 1);  // read by the engine's constructor
  ProgressEngine engine;
  ::unsetenv("CROSSBAR_SPIN_US");
  IdleTransport idle;
  engine.add(&idle);
  constexpr int kWaits = 20;
  for (int i = 0; i < kWaits; ++i) {
    const auto start = Clock::now();
    // 1 ms: under a millisecond is left as soon as the wait starts.
    EXPECT_FALSE(engine.waitUntil([] { return false; }, Deadline::after(Millis(1))));
    EXPECT_GE(Clock::now() - start, Millis(1));  // not before its deadline
  }
  // Sleeping: a pass before and after each blocking poll (a handful per wait). The old
  // whole-millisecond timeout polled with timeout 0 and made a pass every ~microsecond.
  EXPECT_LE(idle.passes, 10L * kWaits) << idle.passes << " progress passes in " << kWaits << " waits of 1 ms";
  engine.remove(&idle);
}

}  // namespace
}  // namespace crossbar
