// torch.distributed.monitored_barrier on crossbar: gloo's protocol over the Communicator's
// small messages. Every rank but 0 reports to rank 0 and waits for its reply; rank 0 waits
// for the reports and names the ranks that did not arrive within the timeout (the first in
// rank order, or all of them with wait_all_ranks).
//
// A failed barrier leaves the group usable for the next one (and for everything else):
//  * every message carries the group's monitored_barrier call number, so a report or reply
//    that arrives after its barrier ended (a late rank, a rank that timed out first) is
//    recognised as stale by the next barrier and dropped;
//  * rank 0 replies "failed" instead of staying silent, so ranks that arrived raise at once
//    (not at their own timeout), and a late rank learns it was late when it arrives;
//  * receives still posted when a barrier fails are withdrawn (Request::cancel, withdraw.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "comm/errors.h"
#include "torch_backend/backend.h"
#include "torch_backend/withdraw.h"

namespace crossbar::torch_backend {

namespace {
// Internal tag (users cannot send on it), apart from the Communicator's barrier
// (kInternalTagBase + 1), fault tolerance's probes (+ 0x100) and the collectives' range.
constexpr uint32_t kMonitoredBarrierTag = kInternalTagBase + 0x200;

enum : uint64_t { kReport = 1, kPassed = 2, kFailed = 3 };

struct BarrierMessage {
  uint64_t call = 0;  // the group's monitored_barrier calls before this one
  uint64_t kind = 0;  // kReport (to rank 0), kPassed / kFailed (rank 0's reply)
  // kFailed: the first rank rank 0 found missing, how many, and rank 0's timeout.
  uint64_t first_missing = 0;
  uint64_t missing = 0;
  uint64_t timeout_ms = 0;
};

// Waits for `peer`'s message of barrier `call` in *slot, posting the receive again over
// stale messages (earlier barriers' that arrived after those ended). Returns false at the
// deadline; throws InvalidUsage when the peer is at a later call than this rank.
bool receiveCall(Communicator& comm, RequestPtr& req, BarrierMessage* slot, int peer, uint64_t call,
                 Deadline deadline, const char* op) {
  while (true) {
    try {
      req->wait(deadline);
    } catch (const Timeout&) {
      return false;
    }
    if (slot->call == call) return true;
    if (slot->call > call)
      throw InvalidUsage(fmt::format("{}rank {} (host {}) is at its monitored_barrier call #{} on this group, this "
                                     "rank at #{}: every rank must call monitored_barrier on the group the same "
                                     "number of times",
                                     errorContext(comm.rank(), op), peer, comm.host(peer), slot->call, call),
                         {peer});
    req = comm.irecv(slot, sizeof(BarrierMessage), peer, kMonitoredBarrierTag);  // stale: the next one
  }
}
}  // namespace

void CrossbarBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const char* op = "monitored_barrier";
  ensureUsable(op);
  // An explicit 0 is a zero timeout (as in gloo), not "unset" (negative: the group's).
  const Millis timeout = opts.timeout.count() >= 0 ? Millis(opts.timeout.count()) : Millis(timeout_ms_.load());
  const Deadline deadline = Deadline::after(timeout);
  Communicator& comm = *comm_;
  if (size_ == 1) return;
  const uint64_t call = monitored_barrier_calls_++;  // alike on every rank of the group

  if (rank_ != 0) {
    // [0]: our report, [1]: rank 0's reply. Shared: a transport may outlive this call.
    auto msgs = std::make_shared<std::array<BarrierMessage, 2>>();
    (*msgs)[0] = {call, kReport, 0, 0, 0};
    RequestPtr reply = comm.irecv(&(*msgs)[1], sizeof(BarrierMessage), 0, kMonitoredBarrierTag);
    RequestPtr report = comm.isend(&(*msgs)[0], sizeof(BarrierMessage), 0, kMonitoredBarrierTag);
    bool replied = false;
    try {
      replied = receiveCall(comm, reply, &(*msgs)[1], 0, call, deadline, op);
    } catch (...) {
      withdrawAndHold({reply, report}, msgs);
      throw;
    }
    withdrawAndHold({reply, report}, msgs);
    // Opens with gloo's sentence for this case, which scripts (and torch's tests) match on.
    const std::string rank0 = fmt::format(
        "{}Rank {} successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank "
        "0: rank 0 (host {}) did not acknowledge",
        errorContext(rank_, op), rank_, comm.host(0));
    if (!replied)
      throw Timeout(fmt::format("{} within {} ms: it is hung, slow, or not calling monitored_barrier on this group",
                                rank0, timeout.count()),
                    {0});
    const BarrierMessage& r = (*msgs)[1];
    if (r.kind == kFailed && r.missing == 0)
      throw InvalidUsage(fmt::format("{}: the ranks are at different monitored_barrier calls on this group "
                                     "(rank 0's error names them); call #{} here",
                                     rank0, call),
                         {0});
    if (r.kind == kFailed) {
      const auto first = static_cast<int>(r.first_missing);
      const std::string others = r.missing > 1 ? fmt::format(" and {} more", r.missing - 1) : "";
      if (first == rank_)
        throw Timeout(fmt::format("{}: this rank arrived at monitored_barrier call #{} after rank 0 ended it (rank 0 "
                                  "waited {} ms and found this rank{} missing)",
                                  rank0, call, r.timeout_ms, others),
                      {0});
      throw Timeout(fmt::format("{}: it found rank {} (host {}){} missing within {} ms and ended monitored_barrier "
                                "call #{} (rank 0's error names them)",
                                rank0, first, comm.host(first), others, r.timeout_ms, call),
                    {first});
    }
    return;
  }

  // Rank 0. msgs[r]: rank r's report; msgs[size + r]: the reply to it.
  auto msgs = std::make_shared<std::vector<BarrierMessage>>(2 * static_cast<size_t>(size_));
  std::vector<RequestPtr> reqs(static_cast<size_t>(size_));
  for (int r = 1; r < size_; ++r)
    reqs[r] = comm.irecv(&(*msgs)[r], sizeof(BarrierMessage), r, kMonitoredBarrierTag);
  std::vector<int> missing;
  std::exception_ptr usage;  // a rank at another call number
  // Fail fast: rank 0's time ran out before it got to check rank `unchecked` (a zero
  // timeout, or the ranks before it took all of it); it then blames itself, not that rank.
  int unchecked = -1;
  for (int r = 1; r < size_ && !usage; ++r) {
    const bool out_of_time = deadline.expired();
    try {
      if (receiveCall(comm, reqs[r], &(*msgs)[r], r, call, deadline, op)) continue;
    } catch (const InvalidUsage&) {
      usage = std::current_exception();
      break;
    } catch (...) {  // aborted, a peer failed: nothing to reply to
      withdrawAndHold(reqs, msgs);
      throw;
    }
    missing.push_back(r);
    if (!wait_all_ranks) {  // fail fast: the first rank (in rank order) missing
      if (out_of_time) unchecked = r;
      break;
    }
  }
  const bool failed = usage || !missing.empty();
  for (int r = 1; r < size_; ++r) {
    BarrierMessage& reply = (*msgs)[static_cast<size_t>(size_ + r)];
    reply = {call, failed ? kFailed : kPassed, missing.empty() ? 0 : static_cast<uint64_t>(missing.front()),
             missing.size(), static_cast<uint64_t>(timeout.count())};
    reqs.push_back(comm.isend(&reply, sizeof(BarrierMessage), r, kMonitoredBarrierTag));
  }
  if (!failed) {
    std::vector<RequestPtr> replies(reqs.begin() + size_, reqs.end());
    try {
      comm.waitAll(replies, deadline);
    } catch (...) {
      withdrawAndHold(reqs, msgs);
      throw;
    }
    withdrawAndHold(reqs, msgs);
    return;
  }
  // Failed: the replies go out without waiting for them (a missing rank may never take its).
  withdrawAndHold(reqs, msgs);
  if (usage) std::rethrow_exception(usage);
  if (unchecked >= 0) {
    // Worded like gloo's ("Rank 0 timed out in monitoredBarrier").
    throw Timeout(fmt::format("{}Rank 0 timed out in monitoredBarrier after {} ms, before it checked rank {} (host "
                              "{}); {}: give monitored_barrier a longer timeout",
                              errorContext(rank_, op), timeout.count(), unchecked, comm.host(unchecked),
                              unchecked == 1 ? "no rank checked yet"
                                             : fmt::format("ranks 1-{} passed", unchecked - 1)),
                  {unchecked});
  }
  std::vector<std::string> hosts;
  for (int r : missing) hosts.push_back(comm.host(r));
  // Worded like gloo's ("Rank 1 failed to pass monitoredBarrier"), which scripts match on.
  throw Timeout(fmt::format("{}{} {} failed to pass monitoredBarrier in {} ms ({}): hung, slow, crashed, or "
                            "not calling monitored_barrier on this group",
                            errorContext(rank_, op), missing.size() == 1 ? "Rank" : "Ranks", fmt::join(missing, ", "),
                            timeout.count(), formatPeers(missing, hosts)),
                missing);
}

}  // namespace crossbar::torch_backend
