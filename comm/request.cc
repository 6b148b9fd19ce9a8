#include "comm/request.h"

#include <fmt/format.h>

#include "comm/errors.h"
#include "comm/progress.h"
#include "comm/store.h"

namespace crossbar {

void Request::complete(int source, uint64_t tag, size_t bytes) {
  status_.source = source;
  status_.tag = tag;
  status_.bytes = bytes;
  state_.store(State::kDone, std::memory_order_release);
}

void Request::fail(std::exception_ptr error) {
  if (done()) return;
  error_ = std::move(error);
  state_.store(State::kFailed, std::memory_order_release);
}

void Request::rethrowIfFailed() const {
  if (failed()) std::rethrow_exception(error_);
}

bool Request::test() {
  if (!done() && engine_) engine_->progressOnce();
  rethrowIfFailed();
  return done();
}

void Request::wait(Deadline deadline) {
  if (!done()) {
    if (!engine_) throw InternalError(fmt::format("request '{}' has no progress engine", what_));
    if (!engine_->waitUntil([this] { return done(); }, deadline)) {
      throw Timeout(fmt::format("{}did not complete before its deadline. The peer may be slow, hung or "
                                "not calling the matching operation; raise CROSSBAR_TIMEOUT if it is only slow",
                                errorContext(-1, what_)));
    }
  }
  rethrowIfFailed();
}

void Request::wait() { wait(Deadline::after(defaultTimeout())); }

}  // namespace crossbar
