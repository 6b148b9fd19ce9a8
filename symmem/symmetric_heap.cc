#include "symmem/symmetric_heap.h"

#include <fmt/format.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "comm/context.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/fence.h"
#include "comm/fd_exchange.h"
#include "comm/log.h"
#include "comm/store.h"
#include "comm/ucx_context.h"
#include "symmem/copy_engine.h"

namespace crossbar::symm {

namespace {

constexpr uint32_t kAllocMagic = 0x4D4D5953;  // "SYMM"
constexpr size_t kPadAlign = 4096;
const Millis kSleepSlice{100};  // longest single sleep; peers' death is checked in between

// One counter of a signal pad: written by one sender, read by the owner.
struct PadSlot {
  std::atomic<uint64_t> value;
  std::atomic<uint32_t> waiters;  // the owner sleeps on `value` (FUTEX_WAKE needed)
  uint32_t reserved;
};
static_assert(sizeof(PadSlot) == SymmetricBuffer::kSignalSlotBytes);  // the layout symmem/cuda relies on
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// Low 32 bits of the counter (x86-64 is little-endian): the futex word.
uint32_t* futexWord(PadSlot* s) {
  return reinterpret_cast<uint32_t*>(&s->value);
}

// Shared (not FUTEX_PRIVATE) futexes: the slot lives in memory mapped by two processes.
void futexWait(PadSlot* s, uint32_t expected, Millis timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000),
              static_cast<long>(timeout.count() % 1000) * 1000000};
  syscall(SYS_futex, futexWord(s), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futexWake(PadSlot* s) {
  syscall(SYS_futex, futexWord(s), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

size_t roundUp(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}

struct AllocHeader {
  uint32_t magic;
  uint32_t info_bytes;
  uint64_t heap_id;
  uint64_t buffer_id;
  uint64_t requested;
  uint64_t segment_bytes;
};

int spinMicros() {
  static const int us = static_cast<int>(env::getInt("CROSSBAR_SPIN_US"));
  return us;
}

// Blocking on a UCX worker: its event fd is not reliably signaled for software-
// emulated RMA (measured: ~1 ms per hop), so after the spin we yield for a while
// (low latency when the peer answers soon) and only then nap on the fd in 1 ms polls.
const Millis kYieldPhase{2};
void napOnWorker(ucx::UcxContext& ctx, Clock::time_point yield_until, Deadline deadline) {
  if (Clock::now() < yield_until) {
    sched_yield();
    return;
  }
  bool armed;
  {
    std::lock_guard<std::recursive_mutex> lock(ctx.mutex());
    armed = ctx.arm();
  }
  if (armed) pollOne(ctx.efd(), POLLIN, deadline.min(Deadline::after(Millis(1))));
}

// A UCX request: wait for it (progressing the worker), with a deadline.
void waitUcx(ucx::UcxContext& ctx, void* request, Deadline deadline, const std::function<std::string()>& what,
             int rank, int peer) {
  if (request == nullptr) return;
  if (UCS_PTR_IS_ERR(request))
    throw UcxError(fmt::format("{}{}", what(), ucx::statusText(UCS_PTR_STATUS(request))), {peer});
  const auto spin_until = Clock::now() + std::chrono::microseconds(spinMicros());
  while (true) {
    ucs_status_t st;
    {
      std::lock_guard<std::recursive_mutex> lock(ctx.mutex());
      ctx.progress();
      st = ucp_request_check_status(request);
      if (st != UCS_INPROGRESS) ucp_request_free(request);
    }
    if (st == UCS_OK) return;
    if (st != UCS_INPROGRESS)
      throw PeerFailure(fmt::format("{}{}; the peer may have died", what(), ucx::statusText(st)), {peer});
    if (deadline.expired()) {
      std::lock_guard<std::recursive_mutex> lock(ctx.mutex());
      ucp_request_free(request);  // UCX finishes or purges it later
      throw Timeout(fmt::format("{}not complete at the deadline; the peer must progress (any crossbar wait "
                                "does) -- is it stuck outside crossbar or dead?",
                                what()),
                    {peer});
    }
    if (Clock::now() > spin_until) napOnWorker(ctx, spin_until + kYieldPhase, deadline);
    (void)rank;
  }
}

}  // namespace

namespace detail {

// What a buffer knows about a peer's segment on another node.
// The endpoint is never cached: the context closes (and UCX frees) it, with the rkey
// unpacked on it, from whichever thread progresses when the peer fails or the
// communicator aborts; see liveEndpoint().
struct RemoteRegion {
  uint64_t base = 0;
  uint64_t bytes = 0;
  ucp_rkey_h rkey = nullptr;  // owned by ctx (UcxContext::unpackRkey)
  int ep_rank = -1;           // the peer's rank in ctx
  std::shared_ptr<ucx::UcxContext> ctx;
  ~RemoteRegion() {
    if (rkey) ctx->destroyRkey(ep_rank, rkey);
  }
};

struct HeapImpl {
  // Fixed at creation, so buffers work after the communicator is destroyed.
  int rank = 0, size = 0, channels = 0;
  uint64_t id = 0;
  std::string name;
  Millis timeout{0};
  std::vector<int> node_of;                           // by rank
  std::vector<std::string> hosts;                     // by rank
  std::vector<int> local_peers;                       // other ranks on this node
  std::vector<UnixConn> conns;                        // by rank; local peers only
  std::vector<std::shared_ptr<ucx::UcxContext>> ucx;  // by rank; off-node peers with a UCX route
  std::vector<int> world;                             // communicator rank -> context rank (UCX endpoints)
  std::vector<std::string> no_route;         // by rank: why an off-node peer is unreachable ("" if fine)
  std::shared_ptr<ucx::UcxContext> any_ucx;  // the (shared) context, if any
  std::weak_ptr<Context> context;            // to notice abort/revoke while waiting
  // The communicator the heap was made on: a split's own abort (its context's covers the
  // others) also releases the waits. Weak: buffers may outlive the communicator.
  std::weak_ptr<const Communicator> comm;
  std::shared_ptr<Store> store;
  std::shared_ptr<SegmentAllocator> allocator;
  std::mutex mutex;  // allocation order
  uint64_t next_buffer = 0;

  bool isLocal(int r) const { return node_of[r] == node_of[rank]; }
  std::string peerText(int r) const { return fmt::format("rank {} (host {})", r, hosts[r]); }
  std::string ctx(std::string_view op) const {
    return errorContext(rank, fmt::format("symmem {} {}", name, op));
  }
  bool hasRemote() const {
    for (int r = 0; r < size; ++r)
      if (ucx[r]) return true;
    return false;
  }

  std::shared_ptr<SymmetricBuffer> allocate(std::shared_ptr<HeapImpl> self, size_t bytes);

  // Throws if the communicator was aborted (revoked): the abort's own error type and
  // peers, prefixed with this operation and `waiting` (what it was waiting for).
  void throwIfAborted(std::string_view op, std::string_view waiting) const {
    auto c = context.lock();
    if (c) c->throwIfAborted(ctx(op) + fmt::format("the communicator was aborted while this rank waited for {}: ", waiting));
    throwIfSplitAborted(op, waiting);
  }
  void throwIfSplitAborted(std::string_view op, std::string_view waiting) const {
    if (auto cm = comm.lock(); cm && cm->aborted())
      throw Aborted(ctx(op) + fmt::format("the communicator ({}) was aborted while this rank waited for {}",
                                          cm->name(), waiting));
  }

  // Runs a blocking rendezvous step in slices of at most kSleepSlice, so an abort or
  // revoke of the communicator (a peer died before it got here) ends the wait within
  // a slice instead of at `deadline`. The step must be safe to repeat after its own
  // Timeout: accept, connect, a whole-message send/recv (SOCK_SEQPACKET), a store get.
  template <class Step>
  auto abortable(Deadline deadline, std::string_view op, std::string_view waiting, Step&& step) const {
    while (true) {
      throwIfAborted(op, waiting);
      try {
        return step(deadline.min(Deadline::after(kSleepSlice)));
      } catch (const Timeout&) {
        if (deadline.expired()) throw;
      }
    }
  }
};

}  // namespace detail

using detail::HeapImpl;
using detail::RemoteRegion;

namespace {
void registerBuffer(const std::shared_ptr<SymmetricBuffer>& b);  // findBuffer() (below)
void unregisterBuffer(const SymmetricBuffer* b);
// The endpoint to `peer` (with r.rkey still valid); call with r.ctx->mutex() held and
// use the result only under it. Throws once the endpoint was closed.
ucp_ep_h liveEndpoint(const RemoteRegion& r, const HeapImpl& heap, int peer, std::string_view op) {
  if (ucp_ep_h ep = r.ctx->ep(r.ep_rank)) return ep;
  heap.throwIfAborted(op, fmt::format("UCX access to {}", heap.peerText(peer)));
  const ucs_status_t st = r.ctx->peerStatus(r.ep_rank);
  throw PeerFailure(heap.ctx(op) + fmt::format("the UCX endpoint to {} is closed ({}); the peer probably died "
                                               "or its host became unreachable",
                                               heap.peerText(peer),
                                               st != UCS_OK ? ucx::statusText(st) : "closed by this rank"),
                    {peer});
}
}  // namespace

// ---------------------------------------------------------------------------- heap

SymmetricHeap SymmetricHeap::create(std::shared_ptr<Communicator> comm, HeapOptions options) {
  if (!comm) throw InvalidArgument(errorContext(-1, "SymmetricHeap::create") + "null communicator");
  auto h = std::make_shared<HeapImpl>();
  h->rank = comm->rank();
  h->size = comm->size();
  h->name = options.name;
  h->timeout = comm->timeout();
  h->channels =
      options.channels >= 0 ? options.channels : static_cast<int>(env::getInt("CROSSBAR_SYMMEM_CHANNELS"));
  if (h->channels < 1 || h->channels > 4096)
    throw InvalidArgument(h->ctx("create") +
                          fmt::format("{} signal channels asked; use 1 to 4096", h->channels));
  h->allocator =
      options.allocator ? options.allocator : std::shared_ptr<SegmentAllocator>(makeHostSegmentAllocator());
  h->store = comm->storePtr();
  h->context = comm->contextHandle();
  h->comm = comm;
  for (int r = 0; r < h->size; ++r) {
    h->node_of.push_back(comm->nodeOf(r));
    h->hosts.push_back(comm->host(r));
    h->world.push_back(comm->worldRank(r));
  }
  h->local_peers = comm->nodePeers(h->rank);
  h->local_peers.erase(std::remove(h->local_peers.begin(), h->local_peers.end(), h->rank),
                       h->local_peers.end());
  const Deadline deadline = comm->defaultDeadline();
  // Heap number: every rank's arrival lands in the same window of `size` because the
  // creation ends in a barrier (no rank starts heap k+1 before all arrived at k).
  Store& store = *h->store;
  h->id = static_cast<uint64_t>(store.add("symmem/heap_arrivals", 1) - 1) / h->size;

  // UCX routes to off-node peers (the communicator's own context and endpoints).
  h->ucx.resize(h->size);
  h->no_route.resize(h->size);
  for (int r = 0; r < h->size; ++r) {
    if (h->isLocal(r)) continue;
    Transport& t = comm->context().transportTo(h->world[r]);
    auto u = ucx::ucxContextOf(t);
    if (u && options.remote_access && h->allocator->hostAccessible()) {
      h->ucx[r] = u;
      h->any_ucx = u;
    } else {
      h->no_route[r] =
          !options.remote_access ? "remote access is disabled for this heap (HeapOptions)"
          : !u                   ? fmt::format(
                                       "it is reached over the '{}' transport, and remote symmetric memory "
                                                         "needs UCX (CROSSBAR_TRANSPORT=auto or ucx)",
                                       t.name())
               : fmt::format("the '{}' backend's memory is not host accessible", h->allocator->name());
    }
  }

  // One Unix-socket connection per local peer pair: lower ranks listen, higher ones connect.
  h->conns.resize(h->size);
  if (!h->local_peers.empty()) {
    const std::string nonce = jobNonce(store, "symmem/nonce");
    const std::string purpose = fmt::format("symm{}", h->id);
    UnixListener listener(socketName(nonce, purpose, h->rank), h->rank);
    store.set(fmt::format("symmem/{}/listening/{}", h->id, h->rank), std::string("1"));
    for (int p : h->local_peers) {
      if (p >= h->rank) continue;
      try {
        h->abortable(deadline, "create", h->peerText(p) + " to create the heap", [&](Deadline d) {
          return store.get(fmt::format("symmem/{}/listening/{}", h->id, p), d);
        });
      } catch (const Timeout&) {
        throw Timeout(h->ctx("create") + fmt::format("{} never created the heap; every rank must call "
                                                     "SymmetricHeap::create()",
                                                     h->peerText(p)),
                      {p});
      }
      const std::string waiting = h->peerText(p) + "'s heap socket";
      UnixConn c = h->abortable(deadline, "create", waiting, [&](Deadline d) {
        return UnixConn::connect(socketName(nonce, purpose, p), d, h->rank, h->peerText(p));
      });
      int32_t me = h->rank;
      h->abortable(deadline, "create", waiting, [&](Deadline d) { c.send(&me, sizeof(me), {}, d); });
      h->conns[p] = std::move(c);
    }
    int higher = 0;
    for (int p : h->local_peers) higher += p > h->rank;
    for (int i = 0; i < higher; ++i) {
      const char* waiting = "a higher local rank of the symmetric heap";
      UnixConn c = h->abortable(deadline, "create", waiting,
                                [&](Deadline d) { return listener.accept(d, waiting); });
      UnixMessage m = h->abortable(deadline, "create", waiting, [&](Deadline d) { return c.recv(d); });
      int32_t who = -1;
      if (m.bytes.size() == sizeof(who)) std::memcpy(&who, m.bytes.data(), sizeof(who));
      if (who <= h->rank || who >= h->size || !h->isLocal(who) || h->conns[who].valid())
        throw InternalError(h->ctx("create") + fmt::format("unexpected hello from local rank {}", who));
      h->conns[who] = std::move(c);
    }
  }
  comm->barrier(deadline);
  CB_INFO("symmem", "heap '{}' #{}: {} local peers, {} remote via UCX, {} channels, backend {}", h->name,
          h->id, h->local_peers.size(),
          std::count_if(h->ucx.begin(), h->ucx.end(), [](auto& u) { return !!u; }), h->channels,
          h->allocator->name());
  SymmetricHeap heap;
  heap.impl_ = std::move(h);
  return heap;
}

int SymmetricHeap::rank() const {
  return impl_->rank;
}
int SymmetricHeap::size() const {
  return impl_->size;
}
int SymmetricHeap::channels() const {
  return impl_->channels;
}
uint64_t SymmetricHeap::id() const {
  return impl_->id;
}
const SegmentAllocator& SymmetricHeap::allocator() const {
  return *impl_->allocator;
}

std::shared_ptr<SymmetricBuffer> SymmetricHeap::allocate(size_t bytes) {
  if (!impl_) throw InvalidUsage(errorContext(-1, "symmem allocate") + "the heap was not created");
  return impl_->allocate(impl_, bytes);
}

std::shared_ptr<SymmetricBuffer> HeapImpl::allocate(std::shared_ptr<HeapImpl> self, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex);
  const uint64_t bid = next_buffer++;
  const std::string op = fmt::format("allocate (buffer #{}, {} bytes)", bid, bytes);
  const Deadline deadline = Deadline::after(timeout);
  std::shared_ptr<SymmetricBuffer> b(new SymmetricBuffer());
  b->heap_ = self;
  b->id_ = bid;
  b->rank_ = rank;
  b->size_ = size;
  b->channels_ = channels;
  b->bytes_ = bytes;
  const size_t granularity = std::max<size_t>(allocator->granularity(), kPadAlign);
  b->pad_offset_ = roundUp(std::max<size_t>(bytes, 1), kPadAlign);
  const size_t slots = static_cast<size_t>(channels + 1) * size;  // + the internal channel of free()
  const size_t total = roundUp(b->pad_offset_ + slots * sizeof(PadSlot), granularity);
  b->own_ = allocator->allocate({total, fmt::format("crossbar-symm-{}-r{}-b{}", name, rank, bid), rank});
  b->local_ = b->own_->ptr();
  b->sent_ = std::make_unique<std::atomic<uint64_t>[]>(slots);
  b->consumed_.assign(slots, 0);
  b->dirty_.assign(size, false);
  b->ptrs_.assign(size, nullptr);
  b->mapped_.resize(size);
  b->remote_.resize(size);
  b->ptrs_[rank] = static_cast<char*>(b->local_);

  // Local peers: send our fd, map theirs. Messages are FIFO per connection, and every
  // rank allocates in the same order, so the next message of a peer is this buffer.
  if (!local_peers.empty()) {
    AllocHeader hdr{kAllocMagic, 0, id, bid, bytes, b->own_->size()};
    std::vector<uint8_t> info = b->own_->exportInfo();
    hdr.info_bytes = static_cast<uint32_t>(info.size());
    std::vector<uint8_t> msg(sizeof(hdr) + info.size());
    std::memcpy(msg.data(), &hdr, sizeof(hdr));
    if (!info.empty()) std::memcpy(msg.data() + sizeof(hdr), info.data(), info.size());
    UniqueFd fd(b->own_->exportFd());
    if (!fd) throwSystemError(rank, ctx(op) + "exporting the segment", errno);
    for (int p : local_peers)
      abortable(deadline, op, peerText(p) + " to take our segment",
                [&](Deadline d) { conns[p].send(msg, {fd.get()}, d); });
    for (int p : local_peers) {
      UnixMessage m;
      try {
        m = abortable(deadline, op, peerText(p) + "'s segment", [&](Deadline d) { return conns[p].recv(d); });
      } catch (const Timeout&) {
        throw Timeout(
            ctx(op) + fmt::format("{} did not allocate buffer #{}; every rank must allocate the same "
                                  "sizes in the same order",
                                  peerText(p), bid),
            {p});
      } catch (const PeerFailure&) {
        throw PeerFailure(ctx(op) + fmt::format("{} hung up (it exited or crashed)", peerText(p)), {p});
      }
      AllocHeader theirs{};
      if (m.bytes.size() < sizeof(theirs) || m.fds.size() != 1)
        throw InternalError(ctx(op) + fmt::format("malformed allocation message from {}", peerText(p)));
      std::memcpy(&theirs, m.bytes.data(), sizeof(theirs));
      if (theirs.magic != kAllocMagic || theirs.heap_id != id || theirs.buffer_id != bid ||
          theirs.requested != bytes || m.bytes.size() != sizeof(theirs) + theirs.info_bytes) {
        throw InvalidUsage(
            ctx(op) + fmt::format("{} allocated {} bytes as buffer #{} of heap #{}; ranks must "
                                  "allocate the same sizes in the same order",
                                  peerText(p), theirs.requested, theirs.buffer_id, theirs.heap_id),
            {p});
      }
      b->mapped_[p] = allocator->import(m.fds[0].get(), {m.bytes.data() + sizeof(theirs), theirs.info_bytes},
                                        theirs.segment_bytes, rank);
      b->ptrs_[p] = static_cast<char*>(b->mapped_[p]->ptr());
    }
  }

  // Off-node peers: register the segment with UCX and swap (address, rkey) through the store.
  if (any_ucx) {
    ucx::UcxContext& u = *any_ucx;
    std::vector<uint8_t> blob(16);
    {
      std::lock_guard<std::recursive_mutex> ul(u.mutex());
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = b->local_;
      mp.length = b->own_->size();
      ucp_mem_h memh = nullptr;
      ucs_status_t st = ucp_mem_map(u.context(), &mp, &memh);
      if (st != UCS_OK)
        throw UcxError(ctx(op) + fmt::format("ucp_mem_map of {} bytes: {}", mp.length, ucx::statusText(st)));
      b->memh_ = memh;
      void* packed = nullptr;
      size_t packed_size = 0;
      st = ucp_rkey_pack(u.context(), memh, &packed, &packed_size);
      if (st != UCS_OK) throw UcxError(ctx(op) + fmt::format("ucp_rkey_pack: {}", ucx::statusText(st)));
      uint64_t base = reinterpret_cast<uint64_t>(b->local_), len = b->own_->size();
      std::memcpy(blob.data(), &base, 8);
      std::memcpy(blob.data() + 8, &len, 8);
      blob.insert(blob.end(), static_cast<uint8_t*>(packed), static_cast<uint8_t*>(packed) + packed_size);
      ucp_rkey_buffer_release(packed);
    }
    store->set(fmt::format("symmem/{}/{}/rkey/{}", id, bid, rank), blob);
    for (int p = 0; p < size; ++p) {
      if (!ucx[p]) continue;
      Bytes theirs;
      try {
        theirs = abortable(deadline, op, peerText(p) + "'s UCX key", [&](Deadline d) {
          return store->get(fmt::format("symmem/{}/{}/rkey/{}", id, bid, p), d);
        });
      } catch (const Timeout&) {
        throw Timeout(ctx(op) + fmt::format("{} did not publish its UCX key for buffer #{}; every rank must "
                                            "allocate the same sizes in the same order",
                                            peerText(p), bid),
                      {p});
      }
      auto r = std::make_unique<RemoteRegion>();
      r->ctx = ucx[p];
      std::memcpy(&r->base, theirs.data(), 8);
      std::memcpy(&r->bytes, theirs.data() + 8, 8);
      if (r->bytes != b->own_->size())
        throw InvalidUsage(
            ctx(op) + fmt::format("{} has a {}-byte segment for buffer #{}, this rank {}; ranks "
                                  "must allocate the same sizes in the same order",
                                  peerText(p), r->bytes, bid, b->own_->size()),
            {p});
      r->ep_rank = world[p];
      r->rkey = r->ctx->unpackRkey(r->ep_rank, theirs.data() + 16, fmt::format("symmem {} {}", name, op));
      b->remote_[p] = std::move(r);
    }
  }
  // Everyone local has our fd now; drop export resources (a buffer then costs no descriptor).
  b->own_->exportDone();
  registerBuffer(b);
  CB_TRACE("symmem", "heap #{} buffer #{}: {} bytes, {}", id, bid, bytes, b->own_->describe());
  return b;
}

// -------------------------------------------------------------------------- registry

namespace {
struct Registered {
  const SymmetricBuffer* key;
  uintptr_t begin, end;
  uint64_t heap_id, buffer_id;
  std::weak_ptr<SymmetricBuffer> buffer;
};
struct Registry {
  std::mutex mutex;
  std::vector<Registered> entries;
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: buffers may be freed during exit
  return *r;
}
void registerBuffer(const std::shared_ptr<SymmetricBuffer>& b) {
  const auto begin = reinterpret_cast<uintptr_t>(b->localPtr());
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.entries.push_back({b.get(), begin, begin + b->size(), b->heapId(), b->id(), b});
}
void unregisterBuffer(const SymmetricBuffer* b) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::erase_if(r.entries, [&](const Registered& e) { return e.key == b; });
}
}  // namespace

BufferRange findBuffer(const void* ptr, size_t bytes) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const Registered& e : r.entries)
    if (bytes > 0 && p >= e.begin && p + bytes <= e.end)
      if (auto b = e.buffer.lock()) return {std::move(b), static_cast<size_t>(p - e.begin)};
  return {};
}

std::shared_ptr<SymmetricBuffer> findBuffer(uint64_t heap_id, uint64_t buffer_id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const Registered& e : r.entries)
    if (e.heap_id == heap_id && e.buffer_id == buffer_id) return e.buffer.lock();
  return nullptr;
}

// -------------------------------------------------------------------------- buffer

SymmetricBuffer::~SymmetricBuffer() {
  if (freed_) return;
  try {
    release(heap_ && heap_->hasRemote(), Deadline::after(std::min(heap_->timeout, Millis(10'000))));
  } catch (const std::exception& e) {
    CB_WARN("symmem", "releasing buffer #{} in its destructor: {}", id_, e.what());
  }
}

uint64_t SymmetricBuffer::heapId() const {
  return heap_->id;
}

bool SymmetricBuffer::createdOver(const Communicator& comm) const {
  auto c = heap_->comm.lock();
  return c.get() == &comm;
}

void SymmetricBuffer::checkUsable(const char* op) const {
  if (freed_) throw InvalidUsage(heap_->ctx(op) + fmt::format("buffer #{} was already freed", id_));
}

void SymmetricBuffer::checkPeer(int peer, const char* op) const {
  checkUsable(op);
  if (!heap_->allocator->hostAccessible())
    throw Unsupported(heap_->ctx(op) +
                      fmt::format("the '{}' backend's memory is not CPU accessible: signal and "
                                  "copy from device code or streams (its device handle)",
                                  heap_->allocator->name()));
  if (peer < 0 || peer >= size_)
    throw InvalidArgument(heap_->ctx(op) +
                          fmt::format("peer {} is not a rank of this {}-rank communicator", peer, size_));
  if (!ptrs_[peer] && !remote_[peer])
    throw Unsupported(heap_->ctx(op) + fmt::format("{} is on another node and {}", heap_->peerText(peer),
                                                   heap_->no_route[peer]),
                      {peer});
}

void SymmetricBuffer::checkRange(int peer, size_t offset, size_t bytes, const char* op) const {
  checkPeer(peer, op);
  if (offset > bytes_ || bytes > bytes_ - offset)
    throw InvalidArgument(heap_->ctx(op) +
                          fmt::format("[{}, {}+{}) is outside the {}-byte buffer #{} (peer {})", offset,
                                      offset, bytes, bytes_, id_, peer));
}

void SymmetricBuffer::checkChannel(int channel, const char* op) const {
  if (channel < 0 || channel >= channels_)
    throw InvalidArgument(heap_->ctx(op) + fmt::format("channel {} is out of range: the heap has {} channels "
                                                       "(HeapOptions::channels, CROSSBAR_SYMMEM_CHANNELS)",
                                                       channel, channels_));
}

std::string SymmetricBuffer::describeChannel(int channel) const {
  return channel == channels_ ? std::string("the internal free() channel")
                              : fmt::format("channel {}", channel);
}

void* SymmetricBuffer::peerPtr(int rank) const {
  if (rank < 0 || rank >= size_) return nullptr;
  return ptrs_[rank];
}

bool SymmetricBuffer::isLocalPeer(int rank) const {
  return rank >= 0 && rank < size_ && ptrs_[rank];
}

size_t SymmetricBuffer::offsetOf(const void* ptr) const {
  auto p = static_cast<const char*>(ptr), base = static_cast<const char*>(local_);
  if (p < base || p > base + bytes_)
    throw InvalidArgument(heap_->ctx("offsetOf") +
                          fmt::format("{} is not inside this rank's buffer #{} ({} bytes "
                                      "at {})",
                                      ptr, id_, bytes_, local_));
  return static_cast<size_t>(p - base);
}

namespace {
PadSlot* padOf(void* base, size_t pad_offset) {
  return reinterpret_cast<PadSlot*>(static_cast<char*>(base) + pad_offset);
}
}  // namespace

void SymmetricBuffer::signalTo(int peer, size_t slot_index, const char* op) {
  const uint64_t value = sent_[slot_index].fetch_add(1, std::memory_order_relaxed) + 1;
  const size_t their_slot = slot_index - static_cast<size_t>(peer) + static_cast<size_t>(rank_);
  if (char* p = ptrs_[peer]) {
    PadSlot* s = padOf(p, pad_offset_) + their_slot;
    // Store, then the waiter flag: pairs with the waiter's flag-then-recheck (fence.h),
    // so a sleeping waiter is always woken and an awake one costs no syscall.
    s->value.store(value, std::memory_order_release);
    fence::light();
    if (s->waiters.load(std::memory_order_relaxed) != 0) futexWake(s);
    return;
  }
  RemoteRegion& r = *remote_[peer];
  std::lock_guard<std::recursive_mutex> lock(r.ctx->mutex());
  ucp_ep_h ep = liveEndpoint(r, *heap_, peer, op);
  // Orders the counter after every earlier put to this peer (its data).
  ucp_worker_fence(r.ctx->worker());
  ucp_request_param_t param{};
  // The source is our own counter array: it lives until free(), which quiets first.
  void* req = ucp_put_nbx(ep, &sent_[slot_index], sizeof(uint64_t),
                          r.base + pad_offset_ + their_slot * sizeof(PadSlot), r.rkey, &param);
  if (UCS_PTR_IS_ERR(req))
    throw UcxError(heap_->ctx(op) + fmt::format("signal put to {}: {}", heap_->peerText(peer),
                                                ucx::statusText(UCS_PTR_STATUS(req))),
                   {peer});
  if (req) ucp_request_free(req);  // completes in the background; quiet() flushes
  dirty_[peer] = true;
}

void SymmetricBuffer::putSignal(int peer, int channel) {
  checkPeer(peer, "putSignal");
  checkChannel(channel, "putSignal");
  signalTo(peer, static_cast<size_t>(channel) * size_ + peer, "putSignal");
}

uint64_t SymmetricBuffer::signalValue(int peer, int channel) const {
  checkUsable("signalValue");
  checkChannel(channel, "signalValue");
  if (!heap_->allocator->hostAccessible())
    throw Unsupported(heap_->ctx("signalValue") +
                      fmt::format("the '{}' backend's signal pad is not CPU accessible: read it from a "
                                  "stream or kernel",
                                  heap_->allocator->name()));
  return padOf(local_, pad_offset_)[static_cast<size_t>(channel) * size_ + peer].value.load(
      std::memory_order_acquire);
}

MemoryKind SymmetricBuffer::memoryKind() const {
  return heap_->allocator->kind();
}

uint64_t SymmetricBuffer::reserveSignal(int peer, int channel) {
  checkUsable("reserveSignal");
  checkChannel(channel, "reserveSignal");
  if (!isLocalPeer(peer))
    throw InvalidArgument(heap_->ctx("reserveSignal") +
                          fmt::format("peer {} is not an on-node rank of this {}-rank buffer", peer, size_));
  return sent_[signalSlot(peer, channel)].fetch_add(1, std::memory_order_relaxed) + 1;
}

uint64_t SymmetricBuffer::reserveWait(int peer, int channel) {
  checkUsable("reserveWait");
  checkChannel(channel, "reserveWait");
  if (!isLocalPeer(peer))
    throw InvalidArgument(heap_->ctx("reserveWait") +
                          fmt::format("peer {} is not an on-node rank of this {}-rank buffer", peer, size_));
  return ++consumed_[signalSlot(peer, channel)];
}

void SymmetricBuffer::waitSlot(int peer, size_t slot_index, uint64_t value, int channel, Deadline deadline,
                               const char* op) {
  PadSlot* s = padOf(local_, pad_offset_) + slot_index;
  auto reached = [&] { return s->value.load(std::memory_order_acquire) >= value; };
  if (reached()) return;
  const auto spin_until = Clock::now() + std::chrono::microseconds(spinMicros());
  while (Clock::now() < spin_until) {
    if (reached()) return;
    __builtin_ia32_pause();
  }
  // Remote signals land through UCX (possibly only when we progress our worker);
  // while anything is remote we also keep progressing it for the peers' RMA.
  ucx::UcxContext* u = heap_->any_ucx.get();
  const bool local = ptrs_[peer] != nullptr;
  auto next_check = Clock::now() + kSleepSlice;
  // An aborted (revoked) communicator releases every wait on its buffers, with its
  // error (e.g. the failure detector's "not responding"), which also wins over a
  // deadline that ends at the same moment (a caller's short slice).
  auto throwIfAborted = [&] {
    if (auto c = heap_->context.lock(); c && c->aborted()) {
      if (auto e = c->abortError()) std::rethrow_exception(e);
      throw Aborted(heap_->ctx(op) + fmt::format("the communicator was aborted ({}) while this rank waited "
                                                 "for {}'s signal on {}",
                                                 c->abortReason(), heap_->peerText(peer), describeChannel(channel)));
    }
  };
  while (!reached()) {
    if (deadline.expired()) {
      throwIfAborted();
      throw Timeout(
          heap_->ctx(op) + fmt::format("{} did not signal {} of buffer #{} within the deadline "
                                       "(counter {}, waiting for {}); check that it calls the matching "
                                       "putSignal / barrier with the same channel",
                                       heap_->peerText(peer), describeChannel(channel), id_, s->value.load(),
                                       value),
          {peer});
    }
    if (u) {
      std::lock_guard<std::recursive_mutex> lock(u->mutex());
      u->progress();
    }
    if (local) {
      // Flag, re-check, sleep (Dekker with signalTo's store-then-load).
      s->waiters.fetch_add(1, std::memory_order_seq_cst);
      fence::heavy();  // signalTo() only has fence::light()
      const uint64_t seen = s->value.load(std::memory_order_seq_cst);
      if (seen < value) {
        Millis slice = std::min(deadline.remaining(), u ? Millis(1) : kSleepSlice);
        futexWait(s, static_cast<uint32_t>(seen), std::max(slice, Millis(1)));
      }
      s->waiters.fetch_sub(1, std::memory_order_seq_cst);
    } else if (u) {
      napOnWorker(*u, spin_until + kYieldPhase, deadline);
    }
    if (Clock::now() >= next_check) {
      next_check = Clock::now() + kSleepSlice;
      throwIfAborted();
      heap_->throwIfSplitAborted(op, fmt::format("{}'s signal on {}", heap_->peerText(peer), describeChannel(channel)));
      if (local && heap_->conns[peer].valid() && heap_->conns[peer].peerClosed() && !reached())
        throw PeerFailure(heap_->ctx(op) + fmt::format("{} exited or crashed while this rank waited for its "
                                                       "signal on {} of buffer #{}",
                                                       heap_->peerText(peer), describeChannel(channel), id_),
                          {peer});
      if (!local && heap_->ucx[peer] && heap_->ucx[peer]->peerStatus(heap_->world[peer]) != UCS_OK && !reached())
        throw PeerFailure(
            heap_->ctx(op) + fmt::format("UCX reported {} failed ({}) while this rank waited for "
                                         "its signal on {}",
                                         heap_->peerText(peer),
                                         ucx::statusText(heap_->ucx[peer]->peerStatus(heap_->world[peer])),
                                         describeChannel(channel)),
            {peer});
    }
  }
}

void SymmetricBuffer::waitSignal(int peer, int channel, Deadline deadline) {
  checkPeer(peer, "waitSignal");
  checkChannel(channel, "waitSignal");
  const size_t idx = static_cast<size_t>(channel) * size_ + peer;
  waitSlot(peer, idx, consumed_[idx] + 1, channel, deadline, "waitSignal");
  ++consumed_[idx];
}

void SymmetricBuffer::waitSignalValue(int peer, int channel, uint64_t value, Deadline deadline) {
  checkPeer(peer, "waitSignalValue");
  checkChannel(channel, "waitSignalValue");
  waitSlot(peer, static_cast<size_t>(channel) * size_ + peer, value, channel, deadline, "waitSignalValue");
}

void SymmetricBuffer::syncAll(int channel, Deadline deadline, const char* op) {
  for (int p = 0; p < size_; ++p)
    if (p != rank_ && (ptrs_[p] || remote_[p])) signalTo(p, static_cast<size_t>(channel) * size_ + p, op);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || !(ptrs_[p] || remote_[p])) continue;
    const size_t idx = static_cast<size_t>(channel) * size_ + p;
    waitSlot(p, idx, consumed_[idx] + 1, channel, deadline, op);
    ++consumed_[idx];
  }
}

void SymmetricBuffer::barrier(int channel, Deadline deadline) {
  checkUsable("barrier");
  checkChannel(channel, "barrier");
  for (int p = 0; p < size_; ++p) checkPeer(p, "barrier");
  syncAll(channel, deadline, "barrier");
}

void SymmetricBuffer::put(int peer, size_t dst_offset, const void* src, size_t bytes) {
  checkRange(peer, dst_offset, bytes, "put");
  if (bytes == 0) return;
  if (char* p = ptrs_[peer]) {
    copyBytes(p + dst_offset, src, bytes, defaultNtThreshold());
    return;
  }
  RemoteRegion& r = *remote_[peer];
  void* req;
  {
    std::lock_guard<std::recursive_mutex> lock(r.ctx->mutex());
    ucp_ep_h ep = liveEndpoint(r, *heap_, peer, "put");
    ucp_request_param_t param{};
    req = ucp_put_nbx(ep, src, bytes, r.base + dst_offset, r.rkey, &param);
  }
  dirty_[peer] = true;
  waitUcx(
      *r.ctx, req, Deadline::after(heap_->timeout),
      [&] {
        return heap_->ctx("put") + fmt::format("UCX put of {} bytes to {}: ", bytes, heap_->peerText(peer));
      },
      rank_, peer);
}

void SymmetricBuffer::get(int peer, size_t src_offset, void* dst, size_t bytes) {
  checkRange(peer, src_offset, bytes, "get");
  if (bytes == 0) return;
  if (char* p = ptrs_[peer]) {
    copyBytes(dst, p + src_offset, bytes, defaultNtThreshold());
    return;
  }
  RemoteRegion& r = *remote_[peer];
  void* req;
  {
    std::lock_guard<std::recursive_mutex> lock(r.ctx->mutex());
    ucp_ep_h ep = liveEndpoint(r, *heap_, peer, "get");
    ucp_request_param_t param{};
    req = ucp_get_nbx(ep, dst, bytes, r.base + src_offset, r.rkey, &param);
  }
  waitUcx(
      *r.ctx, req, Deadline::after(heap_->timeout),
      [&] {
        return heap_->ctx("get") + fmt::format("UCX get of {} bytes from {}: ", bytes, heap_->peerText(peer));
      },
      rank_, peer);
}

void SymmetricBuffer::putWithSignal(int peer, size_t dst_offset, const void* src, size_t bytes, int channel) {
  checkChannel(channel, "putWithSignal");
  put(peer, dst_offset, src, bytes);
  signalTo(peer, static_cast<size_t>(channel) * size_ + peer, "putWithSignal");
}

void SymmetricBuffer::quiet() {
  quiet(Deadline::after(heap_->timeout));
}

void SymmetricBuffer::quiet(Deadline deadline) {
  checkUsable("quiet");
  flushRemote(deadline);
}

void SymmetricBuffer::flushRemote(Deadline deadline) {
  // Local puts are plain stores, complete on return (streaming ones are fenced).
  for (int p = 0; p < size_; ++p) {
    if (!dirty_[p]) continue;
    RemoteRegion& r = *remote_[p];
    void* req;
    {
      std::lock_guard<std::recursive_mutex> lock(r.ctx->mutex());
      ucp_ep_h ep = liveEndpoint(r, *heap_, p, "quiet");
      ucp_request_param_t param{};
      req = ucp_ep_flush_nbx(ep, &param);
    }
    waitUcx(
        *r.ctx, req, deadline,
        [&] { return heap_->ctx("quiet") + fmt::format("flushing puts to {}: ", heap_->peerText(p)); }, rank_,
        p);
    dirty_[p] = false;
  }
}

void SymmetricBuffer::free() {
  free(Deadline::after(heap_->timeout));
}

void SymmetricBuffer::free(Deadline deadline) {
  checkUsable("free");
  release(heap_->hasRemote(), deadline);
}

void SymmetricBuffer::release(bool synchronize, Deadline deadline) {
  if (freed_) return;
  freed_ = true;  // whatever happens below, the buffer is unusable now
  unregisterBuffer(this);
  std::exception_ptr error;
  if (synchronize) {
    // Off-node peers write into our segment through UCX: nobody may deregister
    // while a peer could still put. Quiet our own puts, then meet every peer.
    try {
      flushRemote(deadline);
      syncAll(channels_, deadline, "free");
    } catch (...) {
      error = std::current_exception();
    }
  }
  remote_.clear();  // rkeys
  if (memh_) {
    ucx::UcxContext& u = *heap_->any_ucx;
    std::lock_guard<std::recursive_mutex> lock(u.mutex());
    ucp_mem_unmap(u.context(), static_cast<ucp_mem_h>(memh_));
    memh_ = nullptr;
  }
  if (synchronize && !error) {
    try {
      heap_->store->deleteKey(fmt::format("symmem/{}/{}/rkey/{}", heap_->id, id_, rank_));
    } catch (...) {
      // The store may be gone with the communicator; the key is only garbage.
    }
  }
  mapped_.clear();  // peers' segments (theirs stay alive for anyone still mapping them)
  own_.reset();
  ptrs_.assign(size_, nullptr);
  local_ = nullptr;
  CB_TRACE("symmem", "heap #{} buffer #{} freed", heap_->id, id_);
  if (error) std::rethrow_exception(error);
}

}  // namespace crossbar::symm
