#include "comm/any_source.h"

#include <fmt/format.h>

#include <algorithm>

#include "comm/errors.h"
#include "comm/progress.h"
#include "comm/transport.h"

namespace crossbar {

AnySourceMatcher::AnySourceMatcher(int rank, ProgressEngine& engine, std::vector<Transport*> transports)
    : rank_(rank), engine_(engine), transports_(std::move(transports)) {
  hook_id_ = engine_.addHook([this] { return progress(); });
  cancel_gate_->withdraw = [this](Request& r, std::exception_ptr e) { return withdraw(r, std::move(e)); };
}

AnySourceMatcher::~AnySourceMatcher() {
  cancel_gate_->close();  // first: a cancel() running now holds the gate, then our mutex
  engine_.removeHook(hook_id_);
  abort(std::make_exception_ptr(Aborted(errorContext(rank_, "recv from any rank") +
                                        "the communicator was destroyed while this receive was pending")));
}

RequestPtr AnySourceMatcher::post(uint64_t tag, uint32_t user_tag, void* data, size_t capacity,
                                  std::vector<int> members, std::string what) {
  auto outer = std::make_shared<Request>(&engine_, std::move(what));
  outer->setCancelGate(cancel_gate_);
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) {
    outer->fail(aborted_);
    return outer;
  }
  Pending p{outer, nullptr, tag, user_tag, data, capacity, std::move(members)};
  // An earlier any-source receive of the same tag gets the next message first.
  bool queued_before =
      std::any_of(waiting_.begin(), waiting_.end(), [&](const Pending& w) { return w.tag == tag; });
  if (!queued_before && tryMatch(p)) {
    if (!forward(p)) matched_.push_back(std::move(p));
  } else {
    waiting_.push_back(std::move(p));
  }
  busy_.store(!waiting_.empty() || !matched_.empty(), std::memory_order_release);
  return outer;
}

bool AnySourceMatcher::tryMatch(Pending& p) {
  const size_t n = transports_.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (next_transport_ + k) % n;
    if (RequestPtr inner = transports_[i]->tryRecvAny(p.tag, p.data, p.capacity)) {
      p.inner = std::move(inner);
      next_transport_ = (i + 1) % n;
      return true;
    }
  }
  return false;
}

int AnySourceMatcher::commRank(const Pending& p, int world_rank) const {
  auto it = std::find(p.members.begin(), p.members.end(), world_rank);
  return it == p.members.end() ? -1 : static_cast<int>(it - p.members.begin());
}

bool AnySourceMatcher::forward(Pending& p) {
  if (!p.inner->done()) return false;
  if (p.inner->failed()) {
    try {
      p.inner->rethrowIfFailed();
    } catch (...) {
      p.outer->fail(std::current_exception());
    }
    return true;
  }
  const Status& st = p.inner->status();
  p.outer->complete(commRank(p, st.source), p.user_tag, st.bytes);
  return true;
}

bool AnySourceMatcher::progress() {
  if (!busy_.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  bool moved = false;
  std::erase_if(matched_, [&](Pending& p) {
    bool done = forward(p);
    moved |= done;
    return done;
  });
  std::deque<Pending> still_waiting;
  std::vector<uint64_t> nothing_for;  // tags no transport had a message for in this pass
  for (Pending& p : waiting_) {
    if (std::find(nothing_for.begin(), nothing_for.end(), p.tag) != nothing_for.end()) {
      still_waiting.push_back(std::move(p));
      continue;
    }
    bool matched = false;
    try {
      matched = tryMatch(p);
    } catch (...) {
      p.outer->fail(std::current_exception());
      moved = true;
      continue;
    }
    if (!matched) {
      nothing_for.push_back(p.tag);
      still_waiting.push_back(std::move(p));
      continue;
    }
    moved = true;
    if (!forward(p)) matched_.push_back(std::move(p));
  }
  waiting_ = std::move(still_waiting);
  busy_.store(!waiting_.empty() || !matched_.empty(), std::memory_order_release);
  return moved;
}

// Nothing is posted to a transport while a receive waits here, so withdrawing it is
// taking it off the queue. A matched one has its message (taken from a transport's
// unexpected queue, maybe still arriving): it completes with it.
bool AnySourceMatcher::withdraw(Request& outer, std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](const Pending& p) { return p.outer.get() == &outer; });
  if (it == waiting_.end()) return false;
  waiting_.erase(it);
  busy_.store(!waiting_.empty() || !matched_.empty(), std::memory_order_release);
  outer.fail(error ? std::move(error) : outer.cancelledError(rank_, -1));
  return true;
}

void AnySourceMatcher::abort(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!aborted_) aborted_ = error;
  for (Pending& p : waiting_) p.outer->fail(error);
  for (Pending& p : matched_) p.outer->fail(error);
  waiting_.clear();
  matched_.clear();
  busy_.store(false, std::memory_order_release);
}

}  // namespace crossbar
