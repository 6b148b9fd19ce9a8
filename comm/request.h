// A nonblocking operation's handle. Transports complete or fail it; callers wait
// on it through the ProgressEngine that drives its transport.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm/deadline.h"

namespace crossbar {

class ProgressEngine;
class Request;

constexpr int kAnySource = -1;

// How Request::cancel() reaches whatever posted a receive (a transport, the any-source
// matcher). One per transport, shared with its receives; the owner closes it before it
// goes away, so a cancel() racing with or following that is a no-op.
struct CancelGate {
  std::mutex mutex;  // held while `withdraw` runs; close() waits for a running one
  // Withdraws `request` if it can (see Request::cancel); `error` may be null.
  std::function<bool(Request& request, std::exception_ptr error)> withdraw;
  void close() {
    std::lock_guard<std::mutex> lock(mutex);
    withdraw = nullptr;
  }
};

struct Status {
  int source = -1;    // rank the data came from (recv) or went to (send)
  uint64_t tag = 0;
  size_t bytes = 0;   // bytes transferred
};

class Request {
 public:
  // kFinishing: complete() or fail() won the request and is filling in its result.
  enum class State : int { kPending, kFinishing, kDone, kFailed };

  // `what` describes the operation for error messages, e.g. "recv from rank 3 tag 7".
  Request(ProgressEngine* engine, std::string what) : engine_(engine), what_(std::move(what)) {}
  virtual ~Request() = default;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

  bool done() const {
    State s = state_.load(std::memory_order_acquire);
    return s == State::kDone || s == State::kFailed;
  }
  bool failed() const { return state_.load(std::memory_order_acquire) == State::kFailed; }
  // Progresses once; true when complete. Rethrows the failure if it failed.
  bool test();
  // Progresses until complete or `deadline`; throws Timeout (naming what_) or the failure.
  void wait(Deadline deadline);
  void wait();  // CROSSBAR_TIMEOUT
  const Status& status() const { return status_; }
  const std::string& what() const { return what_; }

  // Withdraws a receive that no message has matched yet (shm, UCX, any source).
  //  * true: withdrawn. The request has failed with `error` (null: Aborted naming this
  //    rank, the operation, the peer and the tag) -- unless something failed it before,
  //    then it keeps that error; its transport no longer holds it and never writes into
  //    its buffer again (from the moment cancel() returns); the next message with its
  //    tag goes to the next matching receive, as if this one had never been posted.
  //  * false: nothing to withdraw. A send, a request already finished by its transport,
  //    or a receive a message has matched already (its data may be partly written): that
  //    one finishes on its own with its message (or the peer's failure, or the
  //    transports' abort); a message is never split between receives. Its buffer must
  //    stay valid until then: while a transport may still use a request's buffer it
  //    holds a reference to the request (use_count() > 1 once the caller holds the only
  //    other one).
  // Never waits for the network; thread-safe; a second cancel() returns false.
  bool cancel(std::exception_ptr error = nullptr);

  // --- for transports ---
  // Both are no-ops on a finished request: the first of them decides the result.
  void complete(int source, uint64_t tag, size_t bytes);
  void fail(std::exception_ptr error);
  // Makes cancel() ask `gate` (set before the request is handed out).
  void setCancelGate(std::shared_ptr<CancelGate> gate) { cancel_gate_ = std::move(gate); }
  // The failure of a withdrawn receive: Aborted, naming `rank`, what() and `peer`.
  std::exception_ptr cancelledError(int rank, int peer) const;
  void rethrowIfFailed() const;
  ProgressEngine* engine() const { return engine_; }

 private:
  ProgressEngine* engine_;
  std::string what_;
  std::atomic<State> state_{State::kPending};
  Status status_;
  std::exception_ptr error_;
  std::shared_ptr<CancelGate> cancel_gate_;  // receives that can be withdrawn
};

using RequestPtr = std::shared_ptr<Request>;

}  // namespace crossbar
