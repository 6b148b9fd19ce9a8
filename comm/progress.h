// ProgressEngine: drives every transport of a context. Waits spin for
// CROSSBAR_SPIN_US, then block in ppoll() on the transports' fds (timeout: the deadline's
// remaining time to the nanosecond, at most 100 ms), so many ranks on few cores stay fast
// and nothing busy-spins without bound, also in waits shorter than a millisecond.
#pragma once

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

 private:
  std::recursive_mutex mutex_;  // transports are single-threaded inside; the engine serializes
  std::vector<Transport*> transports_;
  std::vector<std::pair<int, Hook>> hooks_;
  int next_hook_ = 0;
  int spin_us_;
};

}  // namespace crossbar
