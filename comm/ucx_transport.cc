// Inter-node transport over UCX tag matching. A message from rank s with
// transport tag t travels with UCP tag (wire id of s << 48) | t (wire id: s plus the
// context's base, comm/ucx_context.h) and is received with a full mask, so UCX's own matching gives the
// per-(peer, tag) ordering the Transport contract asks for. Large messages go through UCX's rendezvous
// (zero-copy where the transport allows), so a send may stay pending until the peer receives.
//
// Cancellation (Request::cancel): ucp_request_cancel withdraws a receive still in
// UCX's expected queue (no message matched it) and completes it at once with
// UCS_ERR_CANCELED; a receive a message matched (eager fragments or rendezvous under
// way, or taken by tryRecvAny) is left alone and completes with its message.
//
// Failure handling: endpoints use UCP_ERR_HANDLING_MODE_PEER. When UCX reports a
// peer's endpoint failed, every pending operation with that peer fails with
// PeerFailure (receives are also cancelled in UCX, since UCX only fails sends on
// an endpoint error), and later operations with it fail at once. Keepalive
// (ucx_context.cc) bounds how long a dead peer with no traffic goes unnoticed.
//
// Wake-ups: the worker is also progressed outside the engine (the symmetric heap's
// remote waits progress it directly, an abort fails requests from any thread). A request
// finished there consumed the event the engine's blocked waiters sleep on (the worker's
// fd is level-triggered: once read, it stays quiet), so its waiter would sleep to its
// bound. Every operation finished outside one of our own progress passes therefore
// wakes the engine, and a pass reports "moved" when it finished any operation, whatever
// ucp_worker_progress counted (failed endpoints closed in the pass fail operations too).
#include <fmt/format.h>

#include <unordered_map>
#include <utility>

#include "comm/errors.h"
#include "comm/log.h"
#include "comm/progress.h"
#include "comm/store.h"
#include "comm/transport.h"
#include "comm/ucx_context.h"

namespace crossbar {
namespace {

// After destruction fails the pending operations, how long to wait for UCX to
// hand back their requests (sends may need the peer) before force-closing.
constexpr Millis kDrainTimeout{500};

class UcxTransport;

struct Op {
  UcxTransport* self = nullptr;  // nullptr once orphaned by the destructor
  RequestPtr req;
  int peer = -1;
  uint64_t tag = 0;
  size_t bytes = 0;  // send size or receive capacity
  bool is_send = false;
  uint64_t id = 0;
  void* ucp_req = nullptr;
  bool registered = false;  // the ucp request pointer is stored in pending_
  bool finished = false;    // UCX completed it before we registered it
  bool cancelling = false;  // Request::cancel asked UCX to withdraw it
  std::exception_ptr cancel_error = nullptr;  // what it fails with then (null: Request::cancelledError)
};

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(const TransportSetup& setup)
      : ctx_(std::make_shared<ucx::UcxContext>(setup, "ucx/addr")), rank_(setup.rank), engine_(setup.engine) {
    listener_ = ctx_->addErrorListener([this](int peer, ucs_status_t status) { onPeerError(peer, status); });
    cancel_gate_->withdraw = [this](Request& r, std::exception_ptr e) { return withdraw(r, std::move(e)); };
  }

  ~UcxTransport() override {
    cancel_gate_->close();  // first: a cancel() running now holds the gate, then the context's mutex
    std::lock_guard<std::recursive_mutex> lock(ctx_->mutex());
    ctx_->removeErrorListener(listener_);
    if (!pending_.empty()) {
      CB_INFO("ucx", "transport destroyed with {} operation(s) pending; cancelling them", pending_.size());
      failAll(std::make_exception_ptr(
          Aborted(fmt::format("{}the UCX transport was destroyed while this operation was pending",
                              errorContext(rank_, "ucx")))));
      auto deadline = Deadline::after(kDrainTimeout);
      while (!pending_.empty() && !deadline.expired()) {
        if (!ctx_->progress() && ctx_->arm()) {
          pollfd pfd{ctx_->efd(), POLLIN, 0};
          ::poll(&pfd, 1, 10);
        }
      }
      // Sends the peer never took: force-closing their endpoints purges them.
      if (!pending_.empty()) {
        std::vector<int> peers;  // collected first: closing completes (erases) ops
        for (auto& [id, op] : pending_) peers.push_back(op->peer);
        for (int peer : peers) ctx_->forceClose(peer);
        ctx_->progress();
      }
      // Anything still left completes after we are gone; its callback frees it.
      for (auto& [id, op] : pending_) {
        op->self = nullptr;
        op.release();
      }
      pending_.clear();
    }
  }

  const char* name() const override { return "ucx"; }

  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    auto req = std::make_shared<Request>(
        engine_, fmt::format("ucx send to {} tag {} ({} B)", ctx_->describePeer(peer), tag, bytes));
    std::lock_guard<std::recursive_mutex> lock(ctx_->mutex());
    if (!admit(req, peer, tag)) return req;
    auto op = std::make_unique<Op>(Op{this, req, peer, tag, bytes, true, next_id_++});
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &UcxTransport::onSendDone;
    p.user_data = op.get();
    void* r = ucp_tag_send_nbx(ctx_->ep(peer), data, bytes, ctx_->wireTag(rank_) | tag, &p);
    post(std::move(op), r, bytes);
    return req;
  }

  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t capacity) override {
    auto req = std::make_shared<Request>(engine_, fmt::format("ucx recv from {} tag {} ({} B buffer)",
                                                              ctx_->describePeer(peer), tag, capacity));
    req->setCancelGate(cancel_gate_);
    std::lock_guard<std::recursive_mutex> lock(ctx_->mutex());
    // A peer that failed (or closed after its last send) may have left complete
    // messages in UCX's unexpected queue: those are still delivered.
    if (!admit(req, peer, tag, /*allow_failed_peer=*/true)) return req;
    auto op = std::make_unique<Op>(Op{this, req, peer, tag, capacity, false, next_id_++});
    uint64_t id = op->id;
    ucp_request_param_t p{};
    // Always through the callback, which is what reports the received length.
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = &UcxTransport::onRecvDone;
    p.user_data = op.get();
    void* r = ucp_tag_recv_nbx(ctx_->worker(), data, capacity, ctx_->wireTag(peer) | tag, ~uint64_t{0}, &p);
    post(std::move(op), r, 0);
    if (!req->done() && ctx_->peerStatus(peer) != UCS_OK) {
      // Nothing queued matched, and nothing more will come from a failed peer.
      req->fail(peerFailure(peer, req->what(), ctx_->peerStatus(peer)));
      cancel(id);
    }
    return req;
  }

  RequestPtr tryRecvAny(uint64_t tag, void* data, size_t capacity) override {
    if (tag > kMaxTransportTag)
      throw InvalidArgument(
          fmt::format("{}tag {} is above the transport limit 2^48-1", errorContext(rank_, "ucx recv"), tag));
    std::lock_guard<std::recursive_mutex> lock(ctx_->mutex());
    if (aborted_) return nullptr;
    // Probing with remove=1 takes the oldest unexpected match out of UCX's queue; it
    // must then be received with ucp_tag_msg_recv_nbx (which we do right away).
    ucp_tag_recv_info_t info{};
    // The mask keeps the handshake bit clear and the wire id within this context's
    // block: messages of other epochs on a kept worker never match.
    ucp_tag_message_h msg =
        ucp_tag_probe_nb(ctx_->worker(), ctx_->wireTag(0) | tag, ctx_->anySourceMask(), 1, &info);
    if (!msg) return nullptr;
    const int peer = ctx_->rankOfTag(info.sender_tag);
    auto req = std::make_shared<Request>(
        engine_, fmt::format("ucx recv from any rank (matched {}) tag {} ({} B buffer)",
                             ctx_->describePeer(peer), tag, capacity));
    auto op = std::make_unique<Op>(Op{this, req, peer, tag, capacity, false, next_id_++});
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = &UcxTransport::onRecvDone;
    p.user_data = op.get();
    void* r = ucp_tag_msg_recv_nbx(ctx_->worker(), data, capacity, msg, &p);
    post(std::move(op), r, 0);
    return req;
  }

  bool progress() override {
    std::lock_guard<std::recursive_mutex> lock(ctx_->mutex());
    const bool outer = std::exchange(in_pass_, true);
    const uint64_t finished_before = finished_;
    bool moved = ctx_->progress();
    moved |= cancelDeferred();
    in_pass_ = outer;
    return moved || finished_ != finished_before;
  }

  void pollFds(std::vector<pollfd>& fds) override { fds.push_back(pollfd{ctx_->efd(), POLLIN, 0}); }

  bool prepareSleep() override {
    std::lock_guard<std::recursive_mutex> lock(ctx_->mutex());
    if (!to_cancel_.empty()) return false;
    return ctx_->arm();
  }

  void abort(std::exception_ptr error) override {
    std::lock_guard<std::recursive_mutex> lock(ctx_->mutex());
    if (aborted_) return;
    aborted_ = error;
    CB_INFO("ucx", "aborting: failing {} pending operation(s) and closing {}", pending_.size(),
            ctx_->kept() ? "the endpoints still busy with them" : "every endpoint");
    failAll(error);  // also withdraws the receives no message matched (gone from pending_ now)
    finishedOutsidePass();
    if (ctx_->kept()) {
      // A kept worker's endpoints serve the next epoch (comm/ucx_context.h). What this
      // epoch still has on one (a send, a receive a message matched) could read or
      // write user memory after the abort: force-closing that endpoint purges it, and
      // the next epoch wires that pair up anew. Idle endpoints stay.
      std::vector<int> busy;
      for (auto& [id, op] : pending_) busy.push_back(op->peer);
      for (int peer : busy) ctx_->forceClose(peer);
    }
    // Purges sends still reading user memory (kept worker: only RMA endpoints); this
    // context talks to no one after this.
    ctx_->forceCloseAll();
    ctx_->progress();
  }

  std::shared_ptr<ucx::UcxContext> context() const { return ctx_; }

 private:
  // Checks arguments and peer state; fails `req` and returns false if it must not be posted.
  bool admit(const RequestPtr& req, int peer, uint64_t tag, bool allow_failed_peer = false) {
    if (tag > kMaxTransportTag)
      throw InvalidArgument(
          fmt::format("{}tag {} is above the transport limit 2^48-1", errorContext(rank_, req->what()), tag));
    if (!ctx_->isPeer(peer))
      throw InvalidArgument(fmt::format("{}rank {} is not a peer of this UCX transport (connected peers: {})",
                                        errorContext(rank_, req->what()), peer,
                                        fmt::join(ctx_->peers(), ", ")));
    if (aborted_) {
      req->fail(aborted_);
      return false;
    }
    if (allow_failed_peer && ctx_->peerStatus(peer) != UCS_OK) return true;
    if (ctx_->peerStatus(peer) != UCS_OK || !ctx_->ep(peer)) {
      req->fail(peerFailure(peer, req->what(), ctx_->peerStatus(peer)));
      return false;
    }
    return true;
  }

  // Registers a posted operation, or finishes it when UCX completed it inline.
  void post(std::unique_ptr<Op> op, void* r, size_t immediate_bytes) {
    if (UCS_PTR_IS_PTR(r)) {
      if (op->finished) {  // the callback already ran inside the post
        ucp_request_free(r);
        return;
      }
      op->ucp_req = r;
      op->registered = true;
      uint64_t id = op->id;
      pending_.emplace(id, std::move(op));
      return;
    }
    ucs_status_t st = UCS_PTR_STATUS(r);
    finish(op.get(), st, immediate_bytes, immediate_bytes);
  }

  static void onSendDone(void* request, ucs_status_t status, void* user_data) {
    complete(request, static_cast<Op*>(user_data), status, static_cast<Op*>(user_data)->bytes,
             static_cast<Op*>(user_data)->bytes);
  }

  static void onRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                         void* user_data) {
    auto* op = static_cast<Op*>(user_data);
    size_t length = info ? info->length : 0;
    complete(request, op, status, std::min(length, op->bytes), length);
  }

  static void complete(void* request, Op* op, ucs_status_t status, size_t bytes, size_t message_bytes) {
    if (!op->self) {  // orphaned by a destroyed transport
      ucp_request_free(request);
      delete op;
      return;
    }
    op->self->finish(op, status, bytes, message_bytes);
    if (op->registered) {
      UcxTransport* self = op->self;
      ucp_request_free(request);
      self->pending_.erase(op->id);  // deletes op
      ++self->finished_;
      if (!self->in_pass_) self->finishedOutsidePass();
    } else {
      op->finished = true;
    }
  }

  void finish(Op* op, ucs_status_t status, size_t bytes, size_t message_bytes) {
    if (status == UCS_ERR_CANCELED && op->cancelling) {  // withdrawn by Request::cancel
      op->req->fail(op->cancel_error ? op->cancel_error : op->req->cancelledError(rank_, op->peer));
      return;
    }
    if (op->req->done()) return;  // already failed (peer failure, abort, destruction)
    if (status == UCS_OK) {
      op->req->complete(op->peer, op->tag, bytes);
      return;
    }
    op->req->fail(errorFor(op, status, message_bytes));
  }

  std::exception_ptr errorFor(const Op* op, ucs_status_t status, size_t message_bytes) {
    const std::string& what = op->req->what();
    if (status == UCS_ERR_MESSAGE_TRUNCATED) {
      std::string size = message_bytes > op->bytes ? fmt::format("{} B", message_bytes) : "more";
      return std::make_exception_ptr(InvalidUsage(
          fmt::format("{}the message from {} with tag {} ({}) is larger than the receive buffer ({} B). "
                      "Post a receive at least as large as the matching send",
                      errorContext(rank_, what), ctx_->describePeer(op->peer), op->tag, size, op->bytes),
          {op->peer}));
    }
    if (ctx_->peerStatus(op->peer) != UCS_OK || status == UCS_ERR_CONNECTION_RESET ||
        status == UCS_ERR_ENDPOINT_TIMEOUT || status == UCS_ERR_UNREACHABLE)
      return peerFailure(op->peer, what,
                         ctx_->peerStatus(op->peer) != UCS_OK ? ctx_->peerStatus(op->peer) : status);
    if (status == UCS_ERR_CANCELED)
      return std::make_exception_ptr(
          Aborted(fmt::format("{}the operation was cancelled", errorContext(rank_, what)), {op->peer}));
    return std::make_exception_ptr(UcxError(
        fmt::format("{}UCX failed it: {}", errorContext(rank_, what), ucx::statusText(status)), {op->peer}));
  }

  std::exception_ptr peerFailure(int peer, const std::string& what, ucs_status_t status) {
    std::string cause = status != UCS_OK ? ucx::statusText(status) : "its endpoint was closed";
    return std::make_exception_ptr(PeerFailure(
        fmt::format("{}peer {} failed: UCX reported {}. The peer process probably died or its host became "
                    "unreachable; look at its log",
                    errorContext(rank_, what), ctx_->describePeer(peer), cause),
        {peer}));
  }

  // From the context's endpoint error callback (inside worker progress).
  void onPeerError(int peer, ucs_status_t status) {
    size_t failed = 0;
    for (auto& [id, op] : pending_) {
      if (op->peer != peer || op->req->done()) continue;
      op->req->fail(peerFailure(peer, op->req->what(), status));
      ++failed;
      // UCX fails sends on the endpoint itself; receives sit in the worker's
      // queue, so cancel them -- outside UCX's callback, in progress().
      if (!op->is_send) to_cancel_.push_back(op->id);
    }
    finished_ += failed;
    if (failed && !in_pass_) finishedOutsidePass();
    if (failed)
      CB_WARN("ucx", "{} failed ({}): failed {} pending operation(s) with it", ctx_->describePeer(peer),
              ucx::statusText(status), failed);
  }

  // A request finished outside our progress passes: its waiter may sleep on the event that
  // finished it (file comment, "Wake-ups").
  void finishedOutsidePass() {
    if (engine_) engine_->notifyMoved();
  }

  bool cancelDeferred() {
    if (to_cancel_.empty()) return false;
    auto reqs = std::move(to_cancel_);
    to_cancel_.clear();
    for (uint64_t id : reqs) cancel(id);
    return true;
  }

  // Request::cancel of a receive from irecv. UCX completes a receive it withdraws inside
  // ucp_request_cancel (the callback erases it from pending_); one a message matched
  // stays, and completes with that message.
  bool withdraw(Request& request, std::exception_ptr error) {
    std::lock_guard<std::recursive_mutex> lock(ctx_->mutex());
    for (auto& [id, op] : pending_) {
      if (op->req.get() != &request || op->is_send) continue;
      const uint64_t op_id = id;
      op->cancelling = true;
      op->cancel_error = std::move(error);
      ucp_request_cancel(ctx_->worker(), op->ucp_req);  // invalidates the loop
      return pending_.find(op_id) == pending_.end();
    }
    return false;
  }

  // Cancelling a receive completes it at once (its callback erases it from pending_).
  void cancel(uint64_t id) {
    auto it = pending_.find(id);
    if (it != pending_.end()) ucp_request_cancel(ctx_->worker(), it->second->ucp_req);
  }

  void failAll(std::exception_ptr error) {
    std::vector<uint64_t> recvs;
    for (auto& [id, op] : pending_) {
      op->req->fail(error);
      if (!op->is_send) recvs.push_back(id);
    }
    to_cancel_.clear();
    for (uint64_t id : recvs) cancel(id);
  }

  std::shared_ptr<ucx::UcxContext> ctx_;
  int rank_;
  ProgressEngine* engine_;
  int listener_ = -1;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, std::unique_ptr<Op>> pending_;  // by Op::id
  std::vector<uint64_t> to_cancel_;                            // Op ids
  // Under ctx_->mutex(): inside one of our progress() passes; operations finished (ever).
  bool in_pass_ = false;
  uint64_t finished_ = 0;
  std::exception_ptr aborted_;
  std::shared_ptr<CancelGate> cancel_gate_ = std::make_shared<CancelGate>();
};

}  // namespace

std::unique_ptr<Transport> makeUcxTransport(const TransportSetup& setup) {
  if (!setup.store)
    throw InvalidArgument(
        fmt::format("{}TransportSetup.store is null", errorContext(setup.rank, "ucx setup")));
  return std::make_unique<UcxTransport>(setup);
}

namespace ucx {
std::shared_ptr<UcxContext> ucxContextOf(Transport& transport) {
  auto* t = dynamic_cast<UcxTransport*>(&transport);
  return t ? t->context() : nullptr;
}
}  // namespace ucx

}  // namespace crossbar
