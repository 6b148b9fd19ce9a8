#include "comm/progress.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "comm/env.h"
#include "comm/topology.h"
#include "comm/transport.h"

namespace crossbar {
namespace {

// How long a wait yields between progress passes before it blocks, when processes
// outnumber cores (as the symmetric-memory collectives' waits do, symm_algorithms.cc).
constexpr std::chrono::milliseconds kYieldPhase{2};

// How long one blocking poll may last: what is left of the deadline, to the nanosecond, at
// most max_sleep_ (100 ms). (poll()'s whole milliseconds made a wait with under 1 ms left poll with
// timeout 0 until its deadline, spinning on a core other ranks needed.)
std::chrono::nanoseconds sleepBound(Deadline deadline, std::chrono::nanoseconds max) {
  if (deadline.at() == Clock::time_point::max()) return max;
  const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.at() - Clock::now());
  return std::clamp(left, std::chrono::nanoseconds(0), max);
}

}  // namespace

ProgressEngine::ProgressEngine() : spin_us_(static_cast<int>(env::getInt("CROSSBAR_SPIN_US"))) {
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);  // -1: the poller wakes by its timeout only
}

void ProgressEngine::setProcessesOnMachine(int n) {
  yield_ = !everyRankHasACore(n);
}

ProgressEngine::~ProgressEngine() {
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void ProgressEngine::add(Transport* transport) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  transports_.push_back(transport);
}

void ProgressEngine::remove(Transport* transport) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  transports_.erase(std::remove(transports_.begin(), transports_.end(), transport), transports_.end());
}

int ProgressEngine::addHook(Hook hook) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  hooks_.emplace_back(next_hook_, std::move(hook));
  return next_hook_++;
}

void ProgressEngine::removeHook(int id) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  std::erase_if(hooks_, [id](const auto& h) { return h.first == id; });
}

bool ProgressEngine::progressOnce() {
  bool moved = false;
  {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    for (Transport* t : transports_) moved |= t->progress();
    for (auto& [id, hook] : hooks_) moved |= hook();
  }
  if (moved) notifyMoved();
  return moved;
}

void ProgressEngine::notifyMoved() {
  // Dekker with waitUntil: the pass's completions, then the count of blocked waiters.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (blocking_waiters_.load(std::memory_order_relaxed) == 0) return;
  bool poke;
  {
    std::lock_guard<std::mutex> lock(wait_mutex_);
    ++generation_;
    poke = polling_;
  }
  wait_cv_.notify_all();
  if (poke && wake_fd_ >= 0) {
    const uint64_t one = 1;
    ssize_t n = ::write(wake_fd_, &one, sizeof one);
    (void)n;  // EAGAIN: the counter is full, so the poller wakes anyway
  }
}

bool ProgressEngine::waitUntil(const std::function<bool()>& done, Deadline deadline) {
  // Phase 1: spin (progressing) for a short while; most waits end here. With more
  // processes than cores, yield the core between passes instead, for up to kYieldPhase:
  // the peer this wait needs may be the one waiting for this core (4 ranks on 2 cores: an
  // 8 B sendrecv 66-75 -> 5-15 us, docs/performance.md session 18).
  const auto spin_end = Clock::now() + (yield_ ? kYieldPhase : std::chrono::microseconds(spin_us_));
  while (true) {
    progressOnce();
    if (done()) return true;
    if (Clock::now() >= spin_end) break;
    if (yield_) sched_yield();
  }
  // Phase 2: block between progress passes, so ranks oversubscribing cores yield the CPU
  // to the peers they wait for: one waiter in poll() on the transports' fds, any others
  // on wait_cv_ (header comment).
  blocking_waiters_.fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the count, then done() (notifyMoved)
  struct Leave {
    std::atomic<int>& n;
    ~Leave() { n.fetch_sub(1, std::memory_order_relaxed); }
  } leave{blocking_waiters_};
  std::vector<pollfd> fds;
  while (true) {
    uint64_t seen;  // before the look at done(): a pass after it shows as a new generation
    {
      std::lock_guard<std::mutex> lock(wait_mutex_);
      seen = generation_;
    }
    if (progressOnce()) {
      if (done()) return true;
      continue;
    }
    if (done()) return true;
    if (deadline.expired()) return false;
    std::unique_lock<std::mutex> wl(wait_mutex_);
    if (generation_ != seen) continue;  // another thread's pass moved something: look again
    if (polling_) {
      // Another waiter blocks on the fds: wait for a pass that moves something, or for it
      // to stop polling (then one of us takes over).
      wait_cv_.wait_for(wl, sleepBound(deadline, max_sleep_.load(std::memory_order_relaxed)),
                        [&] { return generation_ != seen || !polling_; });
      continue;
    }
    polling_ = true;
    wl.unlock();
    struct StopPolling {
      ProgressEngine& e;
      ~StopPolling() {
        {
          std::lock_guard<std::mutex> lock(e.wait_mutex_);
          e.polling_ = false;
        }
        e.wait_cv_.notify_all();
      }
    } stop_polling{*this};
    fds.clear();
    bool can_sleep = true;
    {
      std::lock_guard<std::recursive_mutex> lock(mutex_);
      for (Transport* t : transports_) {
        if (!t->prepareSleep()) can_sleep = false;
        t->pollFds(fds);
      }
    }
    if (can_sleep) {
      // Bounded sleep: a lost wake-up costs at most this long, never a hang.
      std::chrono::nanoseconds left = sleepBound(deadline, max_sleep_.load(std::memory_order_relaxed));
      // No transport fd: nothing but a timeout ends the sleep, so keep it short.
      if (fds.empty()) left = std::min<std::chrono::nanoseconds>(left, std::chrono::microseconds(200));
      if (wake_fd_ >= 0) fds.push_back({wake_fd_, POLLIN, 0});
      if (fds.empty()) {
        std::this_thread::sleep_for(left);
      } else {
        const timespec ts{static_cast<time_t>(left.count() / 1'000'000'000),
                          static_cast<long>(left.count() % 1'000'000'000)};
        ::ppoll(fds.data(), fds.size(), &ts, nullptr);
      }
    } else {
      std::this_thread::yield();
    }
    {
      std::lock_guard<std::recursive_mutex> lock(mutex_);
      for (Transport* t : transports_) t->finishSleep();
    }
    if (wake_fd_ >= 0) {
      uint64_t v;
      ssize_t n = ::read(wake_fd_, &v, sizeof v);  // only the poller reads it
      (void)n;
    }
  }
}

}  // namespace crossbar
