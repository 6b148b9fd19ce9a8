// Receiving a CUDA tensor from any source. NCCL pairs point-to-point operations by peer
// and order, never by tag or "any sender", so the receiver first learns the sender on the
// host: every CUDA send of the backend announces itself (tag, bytes, per-destination
// sequence number) with a small message on the group's host Communicator. A receive from
// any source takes the first announcement with its tag from any rank (the
// Communicator's any-source matching, comm/any_source.h) and then receives from that rank
// through NCCL, on the caller's stream. A receive naming its sender consumes that
// sender's announcement without waiting for it, so none is left over for a later
// any-source receive.
//
// NCCL pairs one peer's sends and receives in posting order: an announcement whose
// sequence number is not the next one expected from its sender means the receives were
// posted in another order than the sends (by tag), which would pair the wrong messages;
// that is reported (InvalidUsage) instead.
//
// Host code only (no CUDA): unit-tested on CPU by tests/comm/test_p2p_announce.cc.
#pragma once

#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/communicator.h"

namespace crossbar::torch_backend {

class P2pAnnouncer {
 public:
  // User tags that are announced (the announcement's tag is kTagBase | tag).
  static constexpr uint32_t kTagLimit = 1u << 26;
  static bool announces(int tag) { return tag >= 0 && static_cast<uint32_t>(tag) < kTagLimit; }

  explicit P2pAnnouncer(std::shared_ptr<Communicator> comm);
  // Waits (bounded by the communicator's timeout) for outstanding announcements.
  ~P2pAnnouncer();

  // Sender: announces a send of `bytes` to `dst` (nonblocking). The request completes
  // when the announcement went out.
  RequestPtr announceSend(int dst, int tag, size_t bytes);
  // Receive from any source: blocks until some rank announced a send with `tag` (or
  // `deadline`: Timeout); returns that rank after checking size and order.
  int awaitAnySource(int tag, size_t bytes, Deadline deadline);
  // Receive naming `src`: consumes src's next announcement of `tag` (nonblocking); the
  // request completes when it arrived; poll() checks it.
  RequestPtr expectFrom(int src, int tag, size_t bytes);
  // Checks the announcements consumed since the last call and frees finished ones:
  // the first size or order mismatch, or nullptr.
  std::exception_ptr poll();

 private:
  struct Msg {
    uint32_t magic = 0;
    uint32_t tag = 0;
    uint64_t bytes = 0;
    uint64_t seq = 0;  // the sender's count of announced sends to this receiver before this one
  };
  struct Pending {
    RequestPtr req;
    std::unique_ptr<Msg> msg;
    bool receive = false;
    int peer = -1;  // kAnySource: a receive from any rank
    int tag = 0;
    size_t bytes = 0;
    uint64_t seq = 0;  // receive: the sequence number expected
  };
  static uint32_t wireTag(int tag);
  // Throws InvalidUsage when `m` (from `src`) is not the message expected.
  void check(const Msg& m, const Status& st, int src, int tag, size_t bytes, uint64_t expected_seq,
             const char* op) const;
  std::exception_ptr reapLocked();

  std::shared_ptr<Communicator> comm_;
  std::mutex mu_;
  std::vector<uint64_t> sent_;      // per destination: announced sends so far
  std::vector<uint64_t> received_;  // per source: announcements consumed (or expected) so far
  std::deque<Pending> pending_;
};

}  // namespace crossbar::torch_backend
