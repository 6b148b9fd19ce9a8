// Interruptible setup waits. A blocking setup step (connecting sockets, the UCX
// handshake) only knows its own deadline; a layer above it may learn first that the
// step can never finish: fault tolerance sees a member of the epoch being built die
// while this rank waits in accept() for it. That layer installs a check on its thread
// for the duration of the call:
//
//   ScopedInterruptCheck scope([&](std::string_view step) { if (member_failed) throw PeerFailure(...); });
//   auto comm = Communicator::create(...);   // its setup waits call the check
//
// Waits that support it (comm/fd_exchange: Unix-socket connect/accept/send/recv; the
// UCX setup handshake) call interruptionPoint(step) when they start and then at least
// every kInterruptSlice while they wait; the check throws to end the step (its
// exception propagates out of the setup, which releases what it built). With no check
// installed interruptionPoint() does nothing and waits are not sliced.
#pragma once

#include <functional>
#include <string_view>

#include "comm/deadline.h"

namespace crossbar {

using InterruptCheck = std::function<void(std::string_view step)>;

// Longest a supporting wait sleeps between two interruption points.
constexpr Millis kInterruptSlice{100};

// Installs `check` on this thread until destruction (restores the previous one).
class ScopedInterruptCheck {
 public:
  explicit ScopedInterruptCheck(InterruptCheck check);
  ~ScopedInterruptCheck();
  ScopedInterruptCheck(const ScopedInterruptCheck&) = delete;
  ScopedInterruptCheck& operator=(const ScopedInterruptCheck&) = delete;

 private:
  InterruptCheck check_;
  const InterruptCheck* previous_;
};

// True while a check is installed on this thread (waits then sleep in slices).
bool interruptible();
// Runs this thread's check, if any, naming the step ("unix accept", "ucx handshake").
void interruptionPoint(std::string_view step);
// `ms` capped at kInterruptSlice while interruptible(), for poll() timeouts.
int interruptSliceMs(int ms);

}  // namespace crossbar
