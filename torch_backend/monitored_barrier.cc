// torch.distributed.monitored_barrier on crossbar: gloo's protocol over the Communicator's
// zero-byte messages. Every rank but 0 reports to rank 0 and waits for its
// acknowledgement; rank 0 waits for the reports and names the ranks that did not arrive
// within the timeout (the first in rank order, or all of them with wait_all_ranks).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "comm/errors.h"
#include "torch_backend/backend.h"

namespace crossbar::torch_backend {

namespace {
// Internal tag (users cannot send on it), apart from the Communicator's barrier
// (kInternalTagBase + 1), fault tolerance's probes (+ 0x100) and the collectives' range.
constexpr uint32_t kMonitoredBarrierTag = kInternalTagBase + 0x200;
}  // namespace

void CrossbarBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const char* op = "monitored_barrier";
  ensureUsable(op);
  const Millis timeout = timeoutOf(opts.timeout);
  const Deadline deadline = Deadline::after(timeout);
  Communicator& comm = *comm_;
  if (size_ == 1) return;
  if (rank_ != 0) {
    // Zero bytes: nothing for a late message to write into after a timeout.
    RequestPtr ack = comm.irecv(nullptr, 0, 0, kMonitoredBarrierTag);
    RequestPtr report = comm.isend(nullptr, 0, 0, kMonitoredBarrierTag);
    try {
      report->wait(deadline);
      ack->wait(deadline);
    } catch (const Timeout&) {
      throw Timeout(fmt::format("{}rank 0 (host {}) did not acknowledge within {} ms: it found ranks missing "
                                "(its error names them) or did not reach monitored_barrier itself",
                                errorContext(rank_, op), comm.host(0), timeout.count()),
                    {0});
    }
    return;
  }
  std::vector<RequestPtr> reports;
  for (int r = 1; r < size_; ++r) reports.push_back(comm.irecv(nullptr, 0, r, kMonitoredBarrierTag));
  std::vector<int> missing;
  for (int r = 1; r < size_; ++r) {
    try {
      reports[r - 1]->wait(deadline);
    } catch (const Timeout&) {
      missing.push_back(r);
      if (!wait_all_ranks) break;  // fail fast: the first rank (in rank order) missing
    }
  }
  if (!missing.empty()) {
    std::vector<std::string> hosts;
    for (int r : missing) hosts.push_back(comm.host(r));
    // Worded like gloo's ("Rank 1 failed to pass monitoredBarrier"), which scripts match on.
    throw Timeout(fmt::format("{}{} {} failed to pass monitoredBarrier in {} ms ({}): hung, slow, crashed, or "
                              "not calling monitored_barrier on this group",
                              errorContext(rank_, op), missing.size() == 1 ? "Rank" : "Ranks",
                              fmt::join(missing, ", "), timeout.count(), formatPeers(missing, hosts)),
                  missing);
  }
  std::vector<RequestPtr> acks;
  for (int r = 1; r < size_; ++r) acks.push_back(comm.isend(nullptr, 0, r, kMonitoredBarrierTag));
  comm.waitAll(acks, deadline);
}

}  // namespace crossbar::torch_backend
