#include "comm/request.h"

#include <fmt/format.h>

#include "comm/errors.h"
#include "comm/progress.h"
#include "comm/store.h"

namespace crossbar {

// complete() and fail() may race (a transport finishing a receive on the progress
// thread, an abort failing it on another): the first to leave kPending decides.
void Request::complete(int source, uint64_t tag, size_t bytes) {
  State pending = State::kPending;
  if (!state_.compare_exchange_strong(pending, State::kFinishing, std::memory_order_acquire)) return;
  status_.source = source;
  status_.tag = tag;
  status_.bytes = bytes;
  state_.store(State::kDone, std::memory_order_release);
}

void Request::fail(std::exception_ptr error) {
  State pending = State::kPending;
  if (!state_.compare_exchange_strong(pending, State::kFinishing, std::memory_order_acquire)) return;
  error_ = std::move(error);
  state_.store(State::kFailed, std::memory_order_release);
}

bool Request::cancel(std::exception_ptr error) {
  if (!cancel_gate_) return false;  // a send, or nothing that can withdraw it
  std::lock_guard<std::mutex> lock(cancel_gate_->mutex);
  if (!cancel_gate_->withdraw) return false;  // its transport is gone (it failed everything)
  return cancel_gate_->withdraw(*this, std::move(error));
}

std::exception_ptr Request::cancelledError(int rank, int peer) const {
  return std::make_exception_ptr(
      Aborted(fmt::format("{}cancelled before a message matched it; the next message with this tag "
                          "goes to the next matching receive",
                          errorContext(rank, what_)),
              peer >= 0 ? std::vector<int>{peer} : std::vector<int>{}));
}

void Request::rethrowIfFailed() const {
  if (failed()) std::rethrow_exception(error_);
}

bool Request::test() {
  if (!done() && engine_) engine_->progressOnce();
  // The state is read once, before the failure check: another thread's progress (or an
  // abort) may fail the request at any moment, and a second read after rethrowIfFailed()
  // would report that failure as done -- a success -- without throwing it.
  const bool finished = done();
  rethrowIfFailed();
  return finished;
}

void Request::wait(Deadline deadline) {
  if (!done()) {
    if (!engine_) throw InternalError(fmt::format("request '{}' has no progress engine", what_));
    // Another thread's progress may finish it after the last look before the deadline:
    // then it is done, not timed out (a caller that gives up on a timed-out receive
    // would lose a message that is already in its buffer).
    if (!engine_->waitUntil([this] { return done(); }, deadline) && !done()) {
      throw Timeout(fmt::format("{}did not complete before its deadline. The peer may be slow, hung or "
                                "not calling the matching operation; raise CROSSBAR_TIMEOUT if it is only slow",
                                errorContext(-1, what_)));
    }
  }
  rethrowIfFailed();
}

void Request::wait() { wait(Deadline::after(defaultTimeout())); }

}  // namespace crossbar
