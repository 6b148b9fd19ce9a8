#include "comm/ucx_context.h"

#include <fmt/format.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/interrupt.h"
#include "comm/log.h"
#include "comm/store.h"

namespace crossbar::ucx {
namespace {

// Endpoint closes on destruction wait at most this long: a flush to a live peer
// takes microseconds; a dead one that UCX has not noticed must not hang us.
constexpr Millis kCloseTimeout{2000};
// Keepalive lets UCX notice a dead peer even while no traffic flows to it (UCX's
// default is 20 s); it only runs inside worker progress.
constexpr const char* kKeepaliveInterval = "1s";

[[noreturn]] void throwUcx(int rank, std::string_view operation, ucs_status_t status) {
  throw UcxError(
      fmt::format("{}{}. Check the UCX installation and UCX_* / CROSSBAR_UCX_TLS settings "
                  "(ucx_info -d lists the usable transports)",
                  errorContext(rank, operation), statusText(status)));
}

// Sets a UCX option for crossbar's context only, unless the user set it in the
// environment themselves (then theirs wins, as ucp_config_read already read it).
void setDefault(ucp_config_t* config, const char* name, const std::string& value) {
  if (const char* user = std::getenv(fmt::format("UCX_{}", name).c_str()); user && *user) return;
  ucs_status_t st = ucp_config_modify(config, name, value.c_str());
  if (st != UCS_OK) CB_WARN("ucx", "cannot set UCX option {}={}: {}", name, value, statusText(st));
}

Bytes encodeInfo(const std::string& host, int pid, const void* address, size_t length) {
  Bytes out;
  auto put32 = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  put32(static_cast<uint32_t>(host.size()));
  out.insert(out.end(), host.begin(), host.end());
  put32(static_cast<uint32_t>(pid));
  auto* a = static_cast<const uint8_t*>(address);
  out.insert(out.end(), a, a + length);
  return out;
}

// Returns the worker address part; fills host and pid.
Bytes decodeInfo(const Bytes& in, PeerInfo& info, int rank, int peer) {
  auto get32 = [&](size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{in[at + i]} << (8 * i);
    return v;
  };
  auto bad = [&] {
    return InternalError(fmt::format("{}malformed UCX address record from rank {} ({} bytes)",
                                     errorContext(rank, "ucx connect"), peer, in.size()));
  };
  if (in.size() < 8) throw bad();
  uint32_t host_len = get32(0);
  if (in.size() < 8 + size_t{host_len}) throw bad();
  info.host.assign(in.begin() + 4, in.begin() + 4 + host_len);
  info.pid = static_cast<int>(get32(4 + host_len));
  return Bytes(in.begin() + 8 + host_len, in.end());
}

struct HandshakeOp {
  bool done = false;
  ucs_status_t status = UCS_OK;
};

void handshakeSent(void*, ucs_status_t status, void* user_data) {
  auto* op = static_cast<HandshakeOp*>(user_data);
  op->done = true;
  op->status = status;
}

void handshakeReceived(void*, ucs_status_t status, const ucp_tag_recv_info_t*, void* user_data) {
  handshakeSent(nullptr, status, user_data);
}

}  // namespace

std::string statusText(ucs_status_t status) {
  // ucs_status_string gives the prose; the enum name is what people search for.
  const char* name = nullptr;
  switch (status) {
    case UCS_ERR_CONNECTION_RESET:
      name = "UCS_ERR_CONNECTION_RESET";
      break;
    case UCS_ERR_ENDPOINT_TIMEOUT:
      name = "UCS_ERR_ENDPOINT_TIMEOUT";
      break;
    case UCS_ERR_UNREACHABLE:
      name = "UCS_ERR_UNREACHABLE";
      break;
    case UCS_ERR_IO_ERROR:
      name = "UCS_ERR_IO_ERROR";
      break;
    case UCS_ERR_CANCELED:
      name = "UCS_ERR_CANCELED";
      break;
    case UCS_ERR_MESSAGE_TRUNCATED:
      name = "UCS_ERR_MESSAGE_TRUNCATED";
      break;
    case UCS_ERR_NO_DEVICE:
      name = "UCS_ERR_NO_DEVICE";
      break;
    case UCS_ERR_NO_MEMORY:
      name = "UCS_ERR_NO_MEMORY";
      break;
    case UCS_ERR_REJECTED:
      name = "UCS_ERR_REJECTED";
      break;
    case UCS_ERR_TIMED_OUT:
      name = "UCS_ERR_TIMED_OUT";
      break;
    default:
      break;
  }
  if (name) return fmt::format("{} ({})", ucs_status_string(status), name);
  return fmt::format("{} (ucs_status {})", ucs_status_string(status), static_cast<int>(status));
}

UcxContext::UcxContext(const TransportSetup& setup, const std::string& prefix)
    : rank_(setup.rank), size_(setup.size), peers_(setup.peers) {
  if (size_ > kMaxRanks)
    throw InvalidArgument(fmt::format("{}the UCX transport supports at most {} ranks, got {}",
                                      errorContext(rank_, "ucx setup"), kMaxRanks, size_));
  infos_.resize(size_);
  slots_.resize(size_);
  for (int r = 0; r < size_; ++r) {
    slots_[r].self = this;
    slots_[r].rank = r;
  }
  infos_[rank_] = PeerInfo{hostName(), static_cast<int>(getpid())};
  for (int p : peers_) {
    if (p < 0 || p >= size_ || p == rank_)
      throw InvalidArgument(fmt::format("{}peer {} is not a valid peer in a context of {} ranks",
                                        errorContext(rank_, "ucx setup"), p, size_));
  }

  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) throwUcx(rank_, "ucx setup: ucp_config_read", st);
  std::string tls = env::getString("CROSSBAR_UCX_TLS");
  if (!tls.empty()) {
    // Explicit crossbar setting: overrides UCX_TLS for this context only.
    st = ucp_config_modify(config, "TLS", tls.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      throw InvalidArgument(fmt::format("{}CROSSBAR_UCX_TLS={} is not a valid UCX_TLS value: {}",
                                        errorContext(rank_, "ucx setup"), tls, statusText(st)));
    }
  }
  // UCX warns about every UCX_* variable its context did not use; in a process
  // where other libraries (NCCL, MPI) also read UCX_* that is noise.
  setDefault(config, "WARN_UNUSED_ENV_VARS", "n");
  setDefault(config, "KEEPALIVE_INTERVAL", kKeepaliveInterval);
  // UCX 1.13 sometimes deadlocks inside ucp_init while installing its mmap hooks
  // (ucm_event_enter_exclusive waits on a rwlock forever; seen here in about 1 of
  // 15 forked ranks). Those hooks only serve the registration and memory-type
  // caches, which host memory over tcp/shm does not need: turn both off.
  setDefault(config, "RCACHE_ENABLE", "n");
  setDefault(config, "MEMTYPE_CACHE", "n");
  // Finish each endpoint's wireup inside the setup handshake (UCX 1.13 defaults to off:
  // the REQUEST/REPLY exchange then happens at the first rendezvous or RMA use, in the
  // middle of a run). A peer's late wireup REQUEST makes this worker queue a REPLY on
  // the plain tcp endpoint, behind data if its socket is full; when a failure then
  // closes that endpoint (or the worker is destroyed), UCX 1.13 purges the queued
  // REPLY into ucp_request_send_state_ff, whose assertion ("got REP message", removed
  // upstream in openucx/ucx#8175) aborts this survivor. Resolved at creation, every
  // REPLY is delivered before handshake() returns (see there) and none comes later.
  setDefault(config, "RESOLVE_REMOTE_EP_ID", "on");

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.estimated_num_eps = std::max<size_t>(1, peers_.size());
  params.mt_workers_shared = 0;
  params.name = "crossbar";
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK)
    throwUcx(rank_,
             fmt::format("ucx setup: ucp_init (transports asked: {})", tls.empty() ? "UCX default" : tls),
             st);

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // mutex_ serializes every caller
  st = ucp_worker_create(context_, &wparams, &worker_);
  if (st != UCS_OK) {
    teardown();
    throwUcx(rank_, "ucx setup: ucp_worker_create", st);
  }
  st = ucp_worker_get_efd(worker_, &efd_);
  if (st != UCS_OK) {
    teardown();
    throwUcx(rank_, "ucx setup: ucp_worker_get_efd", st);
  }
  try {
    connect(setup, prefix);
    handshake(setup.deadline);
  } catch (...) {
    teardown();
    throw;
  }
  if (log::enabled(log::Level::kTrace)) {
    // Which UCX transports carry each peer's traffic (lanes, protocols, thresholds).
    for (int p : peers_) {
      char* text = nullptr;
      size_t length = 0;
      if (FILE* f = open_memstream(&text, &length)) {
        ucp_ep_print_info(slots_[p].ep, f);
        std::fclose(f);
        CB_TRACE("ucx", "endpoint to {}:\n{}", describePeer(p), std::string(text, length));
        std::free(text);
      }
    }
  }
  CB_INFO("ucx", "connected to {} peers (TLS {})", peers_.size(), tls.empty() ? "UCX default" : tls);
}

UcxContext::~UcxContext() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  teardown();
}

void UcxContext::teardown() {
  if (worker_) {
    closeAllBounded();
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  if (context_) {
    ucp_cleanup(context_);
    context_ = nullptr;
  }
}

bool UcxContext::isPeer(int rank) const {
  return rank >= 0 && rank < size_ && std::find(peers_.begin(), peers_.end(), rank) != peers_.end();
}

ucp_ep_h UcxContext::ep(int peer) const {
  if (peer < 0 || peer >= size_) return nullptr;
  return slots_[peer].ep;
}

std::string UcxContext::describePeer(int peer) const {
  if (peer < 0 || peer >= size_) return fmt::format("rank {}", peer);
  const PeerInfo& info = infos_[peer];
  if (info.host.empty()) return fmt::format("rank {}", peer);
  return fmt::format("rank {} (host {}, pid {})", peer, info.host, info.pid);
}

void UcxContext::connect(const TransportSetup& setup, const std::string& prefix) {
  ucp_address_t* address = nullptr;
  size_t length = 0;
  ucs_status_t st = ucp_worker_get_address(worker_, &address, &length);
  if (st != UCS_OK) throwUcx(rank_, "ucx setup: ucp_worker_get_address", st);
  Bytes record = encodeInfo(infos_[rank_].host, infos_[rank_].pid, address, length);
  ucp_worker_release_address(worker_, address);
  setup.store->set(fmt::format("{}/{}", prefix, rank_), record);

  std::vector<std::string> keys;
  for (int p : peers_) keys.push_back(fmt::format("{}/{}", prefix, p));
  try {
    setup.store->wait(keys, setup.deadline);
  } catch (const Timeout&) {
    std::vector<int> missing;
    for (int p : peers_)
      if (!setup.store->check({fmt::format("{}/{}", prefix, p)})) missing.push_back(p);
    throw Timeout(fmt::format("{}{} never published a UCX address before the setup deadline. Check that "
                              "every rank creates the communicator, and raise CROSSBAR_CONNECT_TIMEOUT "
                              "if they are only slow to start",
                              errorContext(rank_, "ucx setup"), formatPeers(missing)),
                  missing);
  }

  for (size_t i = 0; i < peers_.size(); ++i) {
    int p = peers_[i];
    Bytes peer_address = decodeInfo(setup.store->get(keys[i], setup.deadline), infos_[p], rank_, p);
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                           UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = &UcxContext::onEndpointError;
    ep_params.err_handler.arg = &slots_[p];
    st = ucp_ep_create(worker_, &ep_params, &slots_[p].ep);
    if (st != UCS_OK) {
      slots_[p].ep = nullptr;
      throw UcxError(fmt::format("{}cannot create a UCX endpoint to {}: {}. Check that the hosts can reach "
                                 "each other over the transports in UCX_TLS / CROSSBAR_UCX_TLS",
                                 errorContext(rank_, "ucx setup"), describePeer(p), statusText(st)),
                     {p});
    }
  }
}

void UcxContext::handshake(Deadline deadline) {
  // 0-byte message each way: proves both directions work before setup returns,
  // and finishes UCX's wireup while every peer is progressing.
  std::vector<HandshakeOp> ops(2 * peers_.size());
  std::vector<void*> requests;
  auto release = [&] {
    for (void* req : requests) {
      if (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_request_cancel(worker_, req);
      ucp_request_free(req);
    }
    requests.clear();
  };
  try {
    for (size_t i = 0; i < peers_.size(); ++i) {
      int p = peers_[i];
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.recv = handshakeReceived;
      rp.user_data = &ops[2 * i];
      void* r =
          ucp_tag_recv_nbx(worker_, nullptr, 0, kHandshakeTagBit | (uint64_t(p) << 48), ~uint64_t{0}, &rp);
      if (UCS_PTR_IS_PTR(r))
        requests.push_back(r);
      else
        ops[2 * i] = HandshakeOp{true, UCS_PTR_STATUS(r)};

      ucp_request_param_t sp{};
      sp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      sp.cb.send = handshakeSent;
      sp.user_data = &ops[2 * i + 1];
      void* s = ucp_tag_send_nbx(slots_[p].ep, nullptr, 0, kHandshakeTagBit | (uint64_t(rank_) << 48), &sp);
      if (UCS_PTR_IS_PTR(s))
        requests.push_back(s);
      else
        ops[2 * i + 1] = HandshakeOp{true, UCS_PTR_STATUS(s)};
    }
    while (true) {
      std::vector<int> pending;
      for (size_t i = 0; i < peers_.size(); ++i) {
        int p = peers_[i];
        bool both = ops[2 * i].done && ops[2 * i + 1].done;
        // A peer that finished its side may already have closed: that is no failure.
        ucs_status_t bad = both ? UCS_OK : slots_[p].status;
        for (int k = 0; k < 2; ++k)
          if (ops[2 * i + k].done && ops[2 * i + k].status != UCS_OK) bad = ops[2 * i + k].status;
        if (bad != UCS_OK)
          throw PeerFailure(fmt::format("{}connecting to {} failed: {}. The peer may have exited or be "
                                        "unreachable over UCX_TLS / CROSSBAR_UCX_TLS",
                                        errorContext(rank_, "ucx setup"), describePeer(p), statusText(bad)),
                            {p});
        if (!ops[2 * i].done || !ops[2 * i + 1].done) pending.push_back(p);
      }
      if (pending.empty()) break;
      interruptionPoint("ucx handshake");  // comm/interrupt.h: e.g. a member of a new FT epoch died
      if (progress()) continue;
      if (deadline.expired()) {
        std::vector<std::string> hosts;
        for (int p : pending) hosts.push_back(infos_[p].host);
        throw Timeout(fmt::format("{}no UCX handshake from {} before the setup deadline. Those ranks "
                                  "published an address but did not connect back: they may be hung, or "
                                  "the network between the hosts may block UCX (check UCX_TLS)",
                                  errorContext(rank_, "ucx setup"), formatPeers(pending, hosts)),
                      pending);
      }
      if (arm()) {
        pollfd pfd{efd_, POLLIN, 0};
        ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(deadline.remaining().count(), 50)));
      }
    }
  } catch (...) {
    release();
    throw;
  }
  release();
}

void UcxContext::onEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* slot = static_cast<Slot*>(arg);
  UcxContext* self = slot->self;
  if (slot->status != UCS_OK) return;
  slot->status = status;
  CB_INFO("ucx", "endpoint to {} failed: {}", self->describePeer(slot->rank), statusText(status));
  auto listeners = self->listeners_;  // a listener may remove itself
  for (auto& [id, fn] : listeners) fn(slot->rank, status);
}

int UcxContext::addErrorListener(ErrorListener listener) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  listeners_.emplace_back(next_listener_, std::move(listener));
  return next_listener_++;
}

void UcxContext::removeErrorListener(int id) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  std::erase_if(listeners_, [id](const auto& l) { return l.first == id; });
}

bool UcxContext::progress() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!worker_) return false;
  bool moved = false;
  for (int i = 0; i < 64 && ucp_worker_progress(worker_) != 0; ++i) moved = true;
  // UCX wants a failed endpoint force-closed; not from inside its error callback.
  for (Slot& slot : slots_)
    if (slot.status != UCS_OK && slot.ep) closeEndpoint(slot, true);
  std::erase_if(close_requests_, [](void* req) {
    if (ucp_request_check_status(req) == UCS_INPROGRESS) return false;
    ucp_request_free(req);
    return true;
  });
  return moved;
}

bool UcxContext::arm() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!worker_) return true;
  ucs_status_t st = ucp_worker_arm(worker_);
  if (st == UCS_OK) return true;
  if (st != UCS_ERR_BUSY) CB_WARN("ucx", "ucp_worker_arm failed: {}", statusText(st));
  return false;
}

void UcxContext::closeEndpoint(Slot& slot, bool force) {
  if (!slot.ep) return;
  // UCX: an rkey must go before the endpoint it was unpacked on (see unpackRkey).
  for (ucp_rkey_h rkey : slot.rkeys) ucp_rkey_destroy(rkey);
  slot.rkeys.clear();
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* req = ucp_ep_close_nbx(slot.ep, &p);
  slot.ep = nullptr;
  slot.closed = true;
  if (UCS_PTR_IS_PTR(req)) {
    close_requests_.push_back(req);
  } else if (UCS_PTR_STATUS(req) != UCS_OK) {
    CB_TRACE("ucx", "closing endpoint to {}: {}", describePeer(slot.rank), statusText(UCS_PTR_STATUS(req)));
  }
}

ucp_rkey_h UcxContext::unpackRkey(int peer, const void* packed, const std::string& op) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  ucp_ep_h endpoint = ep(peer);
  if (!endpoint || slots_[peer].status != UCS_OK)
    throw PeerFailure(fmt::format("{}no usable UCX endpoint to {} ({})", errorContext(rank_, op), describePeer(peer),
                                  slots_[peer].status != UCS_OK ? statusText(slots_[peer].status)
                                                                : "it was closed"),
                      {peer});
  ucp_rkey_h rkey = nullptr;
  ucs_status_t st = ucp_ep_rkey_unpack(endpoint, packed, &rkey);
  if (st != UCS_OK)
    throw UcxError(fmt::format("{}ucp_ep_rkey_unpack for {}: {}", errorContext(rank_, op), describePeer(peer),
                               statusText(st)),
                   {peer});
  slots_[peer].rkeys.push_back(rkey);
  return rkey;
}

void UcxContext::destroyRkey(int peer, ucp_rkey_h rkey) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (peer < 0 || peer >= size_ || !rkey) return;
  auto& held = slots_[peer].rkeys;
  auto it = std::find(held.begin(), held.end(), rkey);
  if (it == held.end()) return;  // its endpoint was closed, which destroyed it
  held.erase(it);
  ucp_rkey_destroy(rkey);
}

void UcxContext::forceCloseAll() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  for (Slot& slot : slots_) closeEndpoint(slot, true);
}

void UcxContext::forceClose(int peer) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (peer >= 0 && peer < size_) closeEndpoint(slots_[peer], true);
}

void UcxContext::closeAllBounded() {
  for (Slot& slot : slots_) closeEndpoint(slot, slot.status != UCS_OK);
  auto deadline = Deadline::after(kCloseTimeout);
  while (!close_requests_.empty() && !deadline.expired()) {
    if (progress()) continue;
    if (close_requests_.empty()) break;
    if (arm()) {
      pollfd pfd{efd_, POLLIN, 0};
      ::poll(&pfd, 1, 10);
    }
  }
  if (!close_requests_.empty()) {
    CB_INFO("ucx", "{} endpoint close(s) did not finish within {} ms; destroying the worker anyway",
            close_requests_.size(), kCloseTimeout.count());
    for (void* req : close_requests_) ucp_request_free(req);
    close_requests_.clear();
  }
}

}  // namespace crossbar::ucx
