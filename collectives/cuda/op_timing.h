// Telemetry for stream-ordered operations: the host cannot time a CUDA collective
// (the call returns before the GPU runs it), so each recorded operation gets a slot of
// pooled CUDA events and waits here until its events have completed; resolve() then
// turns the event times into a telemetry record. Nothing here blocks or synchronizes:
// resolve() is called at the next operation, at Work completion and at
// telemetry::Recorder::step(), and takes only the operations that are finished.
//
// No CUDA here (the caller's probe reads the events), so the ring and the clock
// conversion are tested on the CPU (tests/collectives_cuda/test_collectives_cuda.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

namespace crossbar::cudacoll {

// What a record needs besides the GPU times.
struct PendingOp {
  char name[24] = {};
  char algo[24] = {};
  uint64_t bytes = 0;
  int64_t op_seq = -1;
  int64_t enqueue_ns = 0;
  bool has_wait = false;  // the wait events were recorded (heap algorithms' first barrier)

  void setNames(std::string_view n, std::string_view a) {
    copy(name, sizeof name, n);
    copy(algo, sizeof algo, a);
  }

 private:
  static void copy(char* dst, size_t cap, std::string_view s) {
    const size_t k = std::min(cap - 1, s.size());
    std::memcpy(dst, s.data(), k);
    dst[k] = 0;
  }
};

// Host-clock times of one finished operation.
struct OpTimes {
  int64_t start_ns = 0, end_ns = 0, wait_ns = 0;
};

// Converts event times to the host clock. `anchor_host_ns`: host time when the anchor
// event ran (recorded on an idle stream); the *_ms arguments are cudaEventElapsedTime
// results. The anchor's host time is late by at most the launch latency, so a start
// that lands before the enqueue is clamped to it; the wait lies within the operation.
inline OpTimes eventTimesToHost(int64_t anchor_host_ns, float anchor_to_start_ms, float start_to_end_ms,
                                float wait_ms, int64_t enqueue_ns) {
  auto ns = [](float ms) { return static_cast<int64_t>(static_cast<double>(ms) * 1e6); };
  OpTimes t;
  t.start_ns = std::max(anchor_host_ns + ns(anchor_to_start_ms), enqueue_ns);
  t.end_ns = t.start_ns + std::max<int64_t>(0, ns(start_to_end_ms));
  t.wait_ns = std::clamp<int64_t>(ns(wait_ms), 0, t.end_ns - t.start_ns);
  return t;
}

enum class Probe { kPending, kDone, kFailed };

// FIFO of recorded operations whose events have not been read yet. A slot index names
// the caller's events for that operation (allocated once per slot, reused). Operations
// run in issue order on one stream, so resolution stops at the first unfinished one.
class PendingOpRing {
 public:
  explicit PendingOpRing(size_t capacity) : ops_(capacity), closed_(capacity, false) {}

  size_t capacity() const { return ops_.size(); }
  size_t size() const { return count_; }

  // Reserves the next slot for `op` (its end not recorded yet: close() it); -1 when
  // every slot is pending (the caller drops the record and counts it).
  int push(const PendingOp& op) {
    if (count_ == ops_.size()) return -1;
    const size_t slot = (head_ + count_) % ops_.size();
    ops_[slot] = op;
    closed_[slot] = false;
    count_++;
    return static_cast<int>(slot);
  }
  PendingOp& at(int slot) { return ops_[static_cast<size_t>(slot)]; }
  // The operation's last event is recorded: it may be probed.
  void close(int slot) { closed_[static_cast<size_t>(slot)] = true; }
  // Forgets the newest slot (its operation failed to enqueue).
  void cancelNewest() {
    if (count_ > 0) count_--;
  }

  // probe(slot, OpTimes*) -> Probe; emit(const PendingOp&, const OpTimes&) for each
  // finished operation, oldest first; failed ones are dropped. Returns how many were emitted.
  template <class ProbeFn, class EmitFn>
  size_t resolve(ProbeFn&& probe, EmitFn&& emit) {
    size_t emitted = 0;
    while (count_ > 0 && closed_[head_]) {
      OpTimes t;
      const Probe p = probe(static_cast<int>(head_), &t);
      if (p == Probe::kPending) break;
      if (p == Probe::kDone) {
        emit(ops_[head_], t);
        emitted++;
      }
      head_ = (head_ + 1) % ops_.size();
      count_--;
    }
    return emitted;
  }

 private:
  std::vector<PendingOp> ops_;
  std::vector<bool> closed_;
  size_t head_ = 0, count_ = 0;
};

}  // namespace crossbar::cudacoll
