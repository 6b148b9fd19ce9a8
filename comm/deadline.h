// Deadlines: every wait in crossbar is bounded by one.
#pragma once

#include <chrono>
#include <cstdint>

namespace crossbar {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

class Deadline {
 public:
  static Deadline after(Millis timeout) { return Deadline(Clock::now() + timeout); }
  static Deadline never() { return Deadline(Clock::time_point::max()); }

  bool expired() const { return Clock::now() >= at_; }
  Clock::time_point at() const { return at_; }
  // Time left, clamped at zero (and at ~1 day so callers can convert safely).
  Millis remaining() const {
    if (at_ == Clock::time_point::max()) return Millis(86'400'000);
    auto left = std::chrono::duration_cast<Millis>(at_ - Clock::now());
    return left.count() < 0 ? Millis(0) : left;
  }
  // The earlier of two deadlines.
  Deadline min(Deadline other) const { return at_ < other.at_ ? *this : other; }

 private:
  explicit Deadline(Clock::time_point at) : at_(at) {}
  Clock::time_point at_;
};

}  // namespace crossbar
