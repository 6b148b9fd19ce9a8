#include "torch_backend/p2p_announce.h"

#include <fmt/format.h>

#include "comm/errors.h"
#include "comm/log.h"

namespace crossbar::torch_backend {

namespace {
// Above the collectives' (kInternalTagBase | 0x08000000, 26 bits) and the call check's
// (| 0x04000000) ranges of the internal tag space.
constexpr uint32_t kTagBase = kInternalTagBase | 0x0C000000u;
constexpr uint32_t kMagic = 0x6e614243;  // "CBan"
}  // namespace

uint32_t P2pAnnouncer::wireTag(int tag) { return kTagBase | static_cast<uint32_t>(tag); }

P2pAnnouncer::P2pAnnouncer(std::shared_ptr<Communicator> comm)
    : comm_(std::move(comm)), sent_(comm_->size(), 0), received_(comm_->size(), 0) {}

P2pAnnouncer::~P2pAnnouncer() {
  std::lock_guard<std::mutex> lk(mu_);
  Deadline deadline = Deadline::after(std::min(comm_->timeout(), Millis(5'000)));
  for (auto& p : pending_) {
    if (p.receive || p.req->done()) continue;
    try {
      p.req->wait(deadline);
    } catch (const std::exception& e) {
      CB_WARN("torch", "announcement of a CUDA send to rank {} did not go out: {}", p.peer, e.what());
    }
  }
  // A transport may still write into an unfinished receive's buffer: leave those.
  for (auto& p : pending_)
    if (!p.req->done()) (void)p.msg.release();
}

RequestPtr P2pAnnouncer::announceSend(int dst, int tag, size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  (void)reapLocked();
  Pending p;
  p.msg = std::make_unique<Msg>();
  p.msg->magic = kMagic;
  p.msg->tag = static_cast<uint32_t>(tag);
  p.msg->bytes = bytes;
  p.msg->seq = sent_.at(dst)++;
  p.peer = dst;
  p.tag = tag;
  p.bytes = bytes;
  p.req = comm_->isend(p.msg.get(), sizeof(Msg), dst, wireTag(tag));
  RequestPtr req = p.req;
  pending_.push_back(std::move(p));
  return req;
}

void P2pAnnouncer::check(const Msg& m, const Status& st, int src, int tag, size_t bytes, uint64_t expected_seq,
                         const char* op) const {
  const std::string where = errorContext(comm_->rank(), op);
  if (st.bytes != sizeof(Msg) || m.magic != kMagic || m.tag != static_cast<uint32_t>(tag))
    throw InvalidUsage(fmt::format("{}rank {} sent a malformed CUDA send announcement ({} bytes); do both ranks "
                                   "run the same crossbar version?",
                                   where, src, st.bytes),
                       {src});
  if (m.seq != expected_seq)
    throw InvalidUsage(fmt::format("{}the next CUDA tensor from rank {} is its send #{}, but this receive (tag {}) "
                                   "matched its send #{}: NCCL pairs a peer's sends and receives in order, so "
                                   "receive a rank's CUDA tensors in the order it sent them",
                                   where, src, expected_seq, tag, m.seq),
                       {src});
  if (m.bytes != bytes)
    throw InvalidUsage(fmt::format("{}rank {} sends {} bytes with tag {}, this receive expects {}; do the tensor "
                                   "sizes match?",
                                   where, src, m.bytes, tag, bytes),
                       {src});
}

int P2pAnnouncer::awaitAnySource(int tag, size_t bytes, Deadline deadline) {
  const char* op = "recv from any rank (CUDA)";
  RequestPtr req;
  Msg* msg = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (auto e = reapLocked()) std::rethrow_exception(e);
    // A receive that timed out earlier is still posted (a posted receive cannot be
    // withdrawn): it is this one's, and may have taken an announcement since.
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->receive && it->peer == kAnySource && it->tag == tag) {
        req = it->req;
        msg = it->msg.get();
        break;
      }
    }
    if (!req) {
      Pending p;
      p.msg = std::make_unique<Msg>();
      p.receive = true;
      p.tag = tag;
      p.peer = kAnySource;
      p.bytes = bytes;
      p.req = comm_->irecv(p.msg.get(), sizeof(Msg), kAnySource, wireTag(tag));
      req = p.req;
      msg = p.msg.get();
      pending_.push_back(std::move(p));
    }
  }
  try {
    req->wait(deadline);
  } catch (const Timeout&) {
    throw Timeout(fmt::format("{}no rank sent a CUDA tensor with tag {} to this rank in time (timeout {} ms)",
                              errorContext(comm_->rank(), op), tag, comm_->timeout().count()));
  }
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->req != req) continue;
    Msg m = *msg;
    pending_.erase(it);
    const int src = req->status().source;
    if (src < 0 || src >= comm_->size())
      throw InvalidUsage(fmt::format("{}announcement from unknown rank {}", errorContext(comm_->rank(), op), src));
    check(m, req->status(), src, tag, bytes, received_[src], op);
    ++received_[src];
    return src;
  }
  throw InvalidUsage(errorContext(comm_->rank(), op) + "two threads received from any source with one tag at once");
}

RequestPtr P2pAnnouncer::expectFrom(int src, int tag, size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  (void)reapLocked();  // mismatches surface through poll()
  Pending p;
  p.msg = std::make_unique<Msg>();
  p.receive = true;
  p.peer = src;
  p.bytes = bytes;
  p.seq = received_.at(src)++;
  p.tag = tag;
  p.req = comm_->irecv(p.msg.get(), sizeof(Msg), src, wireTag(tag));
  RequestPtr req = p.req;
  pending_.push_back(std::move(p));
  return req;
}

std::exception_ptr P2pAnnouncer::poll() {
  std::lock_guard<std::mutex> lk(mu_);
  return reapLocked();
}

std::exception_ptr P2pAnnouncer::reapLocked() {
  std::exception_ptr first;
  for (auto it = pending_.begin(); it != pending_.end();) {
    // Any-source receives are finished by awaitAnySource; failed ones are the caller's.
    if (!it->req->done() || it->peer == kAnySource) {
      ++it;
      continue;
    }
    if (it->receive && !it->req->failed()) {
      try {
        check(*it->msg, it->req->status(), it->peer, it->tag, it->bytes, it->seq,
              "recv (CUDA)");
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    it = pending_.erase(it);
  }
  return first;
}

}  // namespace crossbar::torch_backend
