// Ending a failed exchange of small internal messages (monitored_barrier's reports and
// acknowledgements, crossbar.symm.empty's descriptors) without leaving a posted receive that
// would take a later exchange's message: receives no message has matched yet are withdrawn
// (Request::cancel); what a transport still holds (a send in flight, a receive whose message
// is already arriving) keeps its buffers alive until the transport lets go of it.
#pragma once

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "comm/request.h"

namespace crossbar::torch_backend {

namespace detail {
struct HeldRequests {
  std::mutex mutex;
  std::vector<std::pair<RequestPtr, std::shared_ptr<const void>>> held;
};
// Never destroyed: transports may still finish requests during exit.
inline HeldRequests& heldRequests() {
  static auto* h = new HeldRequests;
  return *h;
}
}  // namespace detail

// A transport holds a request while it may touch the request's buffer.
inline bool transportHolds(const RequestPtr& r) { return r.use_count() > 1; }

// Withdraws `requests`' receives that no message matched, and keeps `buffers` (what the
// requests read or write) alive while a transport still holds any of them.
inline void withdrawAndHold(const std::vector<RequestPtr>& requests, std::shared_ptr<const void> buffers) {
  for (const auto& r : requests)
    if (r && !r->done()) r->cancel();  // false for sends and matched receives: they finish alone
  auto& h = detail::heldRequests();
  std::lock_guard<std::mutex> lock(h.mutex);
  std::erase_if(h.held, [](const auto& e) { return !transportHolds(e.first); });
  for (const auto& r : requests)
    if (r && transportHolds(r)) h.held.emplace_back(r, buffers);
}

}  // namespace crossbar::torch_backend
