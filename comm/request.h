// A nonblocking operation's handle. Transports complete or fail it; callers wait
// on it through the ProgressEngine that drives its transport.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "comm/deadline.h"

namespace crossbar {

class ProgressEngine;

constexpr int kAnySource = -1;

struct Status {
  int source = -1;    // rank the data came from (recv) or went to (send)
  uint64_t tag = 0;
  size_t bytes = 0;   // bytes transferred
};

class Request {
 public:
  enum class State : int { kPending, kDone, kFailed };

  // `what` describes the operation for error messages, e.g. "recv from rank 3 tag 7".
  Request(ProgressEngine* engine, std::string what) : engine_(engine), what_(std::move(what)) {}
  virtual ~Request() = default;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

  bool done() const { return state_.load(std::memory_order_acquire) != State::kPending; }
  bool failed() const { return state_.load(std::memory_order_acquire) == State::kFailed; }
  // Progresses once; true when complete. Rethrows the failure if it failed.
  bool test();
  // Progresses until complete or `deadline`; throws Timeout (naming what_) or the failure.
  void wait(Deadline deadline);
  void wait();  // CROSSBAR_TIMEOUT
  const Status& status() const { return status_; }
  const std::string& what() const { return what_; }

  // --- for transports ---
  void complete(int source, uint64_t tag, size_t bytes);
  void fail(std::exception_ptr error);
  void rethrowIfFailed() const;
  ProgressEngine* engine() const { return engine_; }

 private:
  ProgressEngine* engine_;
  std::string what_;
  std::atomic<State> state_{State::kPending};
  Status status_;
  std::exception_ptr error_;
};

using RequestPtr = std::shared_ptr<Request>;

}  // namespace crossbar
