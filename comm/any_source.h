// Any-source receives (Communicator::irecv with kAnySource) over every transport of a
// Context. A message may come through shm or UCX, and must be taken by exactly one
// receive, so nothing is posted to the transports in advance: after every progress
// pass (a ProgressEngine hook) each pending any-source receive asks the transports,
// in turn, for a message with its tag that no receive naming the sender was waiting
// for (Transport::tryRecvAny), and receives it there. Pending any-source receives of
// a tag are served in posting order; a transport hands out its messages in arrival
// order. A receive naming the sender takes precedence over an any-source receive for
// a message that arrives while both are posted.
//
// The request handed to the caller completes when the transport's receive does, with
// status().source the sender's rank in the receiving communicator. Request::cancel
// withdraws it while it waits (no message taken yet); once a message was taken, it
// completes with that message.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/request.h"

namespace crossbar {

class ProgressEngine;
class Transport;

class AnySourceMatcher {
 public:
  // `transports` outlive the matcher; registers itself as a hook of `engine`.
  AnySourceMatcher(int rank, ProgressEngine& engine, std::vector<Transport*> transports);
  // Unregisters; pending receives fail with Aborted.
  ~AnySourceMatcher();
  AnySourceMatcher(const AnySourceMatcher&) = delete;
  AnySourceMatcher& operator=(const AnySourceMatcher&) = delete;

  // A receive of up to `capacity` bytes with transport tag `tag` from any peer.
  // `members` maps the receiving communicator's ranks to world ranks (status().source
  // is reported in communicator ranks); `user_tag` is reported in status().tag.
  RequestPtr post(uint64_t tag, uint32_t user_tag, void* data, size_t capacity, std::vector<int> members,
                  std::string what);

  // Fails every pending and in-flight any-source receive with `error`.
  void abort(std::exception_ptr error);

 private:
  struct Pending {
    RequestPtr outer;  // what the caller holds
    RequestPtr inner;  // the transport's receive, once matched
    uint64_t tag = 0;
    uint32_t user_tag = 0;
    void* data = nullptr;
    size_t capacity = 0;
    std::vector<int> members;
  };
  bool progress();  // the engine hook
  bool withdraw(Request& outer, std::exception_ptr error);  // Request::cancel
  bool tryMatch(Pending& p);
  bool forward(Pending& p);  // true once `outer` is finished
  int commRank(const Pending& p, int world_rank) const;

  int rank_;
  ProgressEngine& engine_;
  std::vector<Transport*> transports_;
  int hook_id_ = -1;
  std::mutex mutex_;
  std::deque<Pending> waiting_;    // not matched yet, in posting order
  std::vector<Pending> matched_;   // matched, the transport's receive still running
  std::atomic<bool> busy_{false};  // waiting_ or matched_ non-empty (cheap idle check)
  size_t next_transport_ = 0;      // round robin: no transport starves the others
  std::exception_ptr aborted_;
  std::shared_ptr<CancelGate> cancel_gate_ = std::make_shared<CancelGate>();
};

}  // namespace crossbar
