// ProgressEngine: drives every transport of a context. Waits spin for
// CROSSBAR_SPIN_US (when the job's processes on this machine outnumber its cores, they
// yield the core between passes for up to 2 ms instead), then block in ppoll() on the
// transports' fds (timeout: the deadline's remaining time to the nanosecond, at most
// 100 ms), so many ranks on few cores stay fast and nothing busy-spins without bound,
// also in waits shorter than a millisecond.
//
// Several threads may wait at once (the torch backend's threads and its caller, a
// helper thread, the failure detector's probes). One of them blocks on the transports'
// fds, the others on a condition variable, and a progress pass that moved anything wakes
// them all (the one in ppoll through an eventfd): a transport's wake-up serves one
// sleeper (two sleepers cleared each other's flags and drained each other's eventfd),
// and a request another thread finished must not leave its waiter asleep until its
// timeout. (Both cost waits ~100 ms each when a second thread waited on the engine.)
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "comm/deadline.h"

namespace crossbar {

class Transport;

class ProgressEngine {
 public:
  ProgressEngine();
  ~ProgressEngine();
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;
  void add(Transport* transport);
  void remove(Transport* transport);
  // Work that runs after the transports in every pass (any-source matching): returns
  // true if it moved anything. Never blocks; called with the engine's lock held.
  using Hook = std::function<bool()>;
  int addHook(Hook hook);  // returns an id for removeHook()
  void removeHook(int id);
  // One pass over all transports, then the hooks; true if anything moved.
  bool progressOnce();
  // Progresses until done() is true (returns true) or deadline passes (returns false).
  bool waitUntil(const std::function<bool()>& done, Deadline deadline);
  // Wakes the blocked waiters to look again: for a transport that finished a request
  // outside progressOnce() (its worker progressed by another user, as the symmetric
  // heap's remote waits progress the UCX worker, or an abort). Cheap when nobody blocks.
  void notifyMoved();
  // Longest single blocking sleep (default 100 ms): a lost wake-up costs at most this. Tests
  // raise it so that a missed wake-up shows as a wait of seconds, whatever the machine's load.
  void setSleepBound(std::chrono::nanoseconds bound) { max_sleep_.store(bound, std::memory_order_relaxed); }
  // How many processes of the job share this machine's cores. When they outnumber the
  // cores, a wait does not spin on a core its peer may need: it yields between passes.
  void setProcessesOnMachine(int n);

 private:
  std::recursive_mutex mutex_;  // transports are single-threaded inside; the engine serializes
  std::vector<Transport*> transports_;
  std::vector<std::pair<int, Hook>> hooks_;
  int next_hook_ = 0;
  int spin_us_;
  bool yield_ = false;  // processes outnumber cores: passes yield the core in the spin phase
  std::atomic<std::chrono::nanoseconds> max_sleep_{std::chrono::milliseconds(100)};

  std::atomic<int> blocking_waiters_{0};  // waits past their spin (read without wait_mutex_)
  std::mutex wait_mutex_;
  std::condition_variable wait_cv_;
  uint64_t generation_ = 0;  // passes that moved something while waiters blocked (wait_mutex_)
  bool polling_ = false;     // a waiter blocks in ppoll on the transports' fds (wait_mutex_)
  int wake_fd_ = -1;         // eventfd in that waiter's poll set
};

}  // namespace crossbar
