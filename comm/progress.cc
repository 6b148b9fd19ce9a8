#include "comm/progress.h"

#include <poll.h>
#include <time.h>

#include <algorithm>
#include <thread>

#include "comm/env.h"
#include "comm/transport.h"

namespace crossbar {
namespace {

// How long one blocking poll may last: what is left of the deadline, to the nanosecond, at
// most 100 ms. (poll()'s whole milliseconds made a wait with under 1 ms left poll with
// timeout 0 until its deadline, spinning on a core other ranks needed.)
std::chrono::nanoseconds sleepBound(Deadline deadline) {
  constexpr std::chrono::nanoseconds kMax = std::chrono::milliseconds(100);
  if (deadline.at() == Clock::time_point::max()) return kMax;
  const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.at() - Clock::now());
  return std::clamp(left, std::chrono::nanoseconds(0), kMax);
}

}  // namespace

ProgressEngine::ProgressEngine() : spin_us_(static_cast<int>(env::getInt("CROSSBAR_SPIN_US"))) {}

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
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  bool moved = false;
  for (Transport* t : transports_) moved |= t->progress();
  for (auto& [id, hook] : hooks_) moved |= hook();
  return moved;
}

bool ProgressEngine::waitUntil(const std::function<bool()>& done, Deadline deadline) {
  // Phase 1: spin (progressing) for a short while; most waits end here.
  auto spin_end = Clock::now() + std::chrono::microseconds(spin_us_);
  while (true) {
    progressOnce();
    if (done()) return true;
    if (Clock::now() >= spin_end) break;
  }
  // Phase 2: block in poll() on the transports' fds between progress passes, so
  // ranks oversubscribing cores yield the CPU to the peers they wait for.
  std::vector<pollfd> fds;
  while (true) {
    if (progressOnce()) {
      if (done()) return true;
      continue;
    }
    if (done()) return true;
    if (deadline.expired()) return false;
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
      const std::chrono::nanoseconds left = sleepBound(deadline);
      if (fds.empty()) {
        std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(left, std::chrono::microseconds(200)));
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
  }
}

}  // namespace crossbar
