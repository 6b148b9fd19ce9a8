// Shared-memory transport between the ranks of one node.
//
// Memory: every rank owns one memfd "inbox" segment holding a header (with its
// "sleeping" flag) and one single-producer single-consumer byte ring per peer
// that sends to it. Peers map each other's inboxes after exchanging the memfd and
// a wake-up eventfd over an abstract Unix socket; that socket stays open for the
// transport's life, and its hang-up is how a dead peer is detected.
//
// Protocol: each ring carries a stream of 40-byte frames, some followed by payload
// that is streamed as the ring drains:
//   EAGER(tag, size) + payload      messages <= eager_limit, sent without waiting
//   RTS(tag, size, id, addr)        larger messages: "ready to send", then either
//     the receiver reads the payload with process_vm_readv (one copy) and answers
//     FIN(id), or answers CTS(id) and the sender streams DATA(id, size) + payload;
//   NACK(id, capacity)              the matching receive was too small.
// Frames of a pair are processed in stream order, so matching per (peer, tag) is
// FIFO. Consuming never waits on producing, so two ranks streaming to each other
// through full rings cannot deadlock.
//
// Waiting: before the engine blocks, prepareSleep() sets this rank's sleeping
// flag, then re-checks its rings (Dekker-style with the producers' seq_cst fence
// after publishing), so a producer writes the sleeper's eventfd only when it is
// actually asleep, and no wake-up is lost.
#include "comm/shm_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/fd_exchange.h"
#include "comm/fence.h"
#include "comm/log.h"
#include "comm/progress.h"
#include "comm/shm_segment.h"
#include "comm/store.h"

namespace crossbar {

namespace {

constexpr uint32_t kMagic = 0x48534243;  // "CBSH"
constexpr uint32_t kVersion = 1;
constexpr size_t kCacheLine = 64;
constexpr size_t kPage = 4096;
constexpr size_t kMinRing = 64 * 1024;
constexpr uint64_t kPopulateWindow = 256 * 1024;  // bytes mapped per madvise() (Ring::populate)

enum FrameType : uint32_t { kEager = 1, kRts = 2, kCts = 3, kData = 4, kFin = 5, kNack = 6 };

struct Frame {
  uint32_t type = 0;
  uint32_t reserved = 0;
  uint64_t tag = 0;
  uint64_t size = 0;  // payload bytes; NACK: the receive's capacity
  uint64_t id = 0;    // rendezvous id, chosen by the sender
  uint64_t addr = 0;  // RTS: the sender's buffer address (for CMA)
};
static_assert(sizeof(Frame) == 40);

struct RingCtrl {
  alignas(kCacheLine) std::atomic<uint64_t> head;  // bytes ever written (producer)
  alignas(kCacheLine) std::atomic<uint64_t> tail;  // bytes ever consumed (consumer)
};
static_assert(sizeof(RingCtrl) <= kPage);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

struct InboxHeader {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  uint32_t slots;
  uint64_t ring_bytes;
  uint64_t slot_stride;
  alignas(kCacheLine) std::atomic<uint32_t> sleeping;  // owner is (about to be) blocked in poll()
  // The owner aborted this transport: the hang-up that follows is an abort, not a death.
  std::atomic<uint32_t> aborted;
};
static_assert(sizeof(InboxHeader) <= kPage);

constexpr size_t slotOffset(size_t slot, size_t stride) {
  return kPage + slot * stride;
}

// Sent once each way when a pair connects, with fds {inbox memfd, wake eventfd}.
struct Hello {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t slot;  // the receiver of this hello writes into this slot of the sender's inbox
  uint64_t ring_bytes;
  uint64_t seg_bytes;
  int32_t pid;
  char host[68];
};

// One direction of a pair: a view of a ring in some inbox.
struct Ring {
  RingCtrl* ctrl = nullptr;
  uint8_t* data = nullptr;
  uint64_t size = 0;
  uint64_t mask = 0;
  uint64_t pos = 0;     // producer: head not yet published; consumer: tail not yet published
  uint64_t cached = 0;  // producer: last tail seen; consumer: last head seen
  uint64_t mapped = 0;  // bytes of data (from the start) this side has faulted in (populate())

  void write(const void* src, size_t n) {
    if (mapped < size && pos + n > mapped) populate(pos + n, MADV_POPULATE_WRITE);
    size_t off = pos & mask, first = std::min<size_t>(n, size - off);
    std::memcpy(data + off, src, first);
    if (n > first) std::memcpy(data, static_cast<const uint8_t*>(src) + first, n - first);
    pos += n;
  }
  void read(void* dst, size_t n) {
    if (mapped < size && pos + n > mapped) populate(pos + n, MADV_POPULATE_READ);
    size_t off = pos & mask, first = std::min<size_t>(n, size - off);
    if (dst) {
      std::memcpy(dst, data + off, first);
      if (n > first) std::memcpy(static_cast<uint8_t*>(dst) + first, data, n - first);
    }
    pos += n;
  }
  // The ring's pages are mapped lazily (an idle pair costs no memory), and a page fault
  // per 4 KiB made the first pass through a ring slow for small messages (4 KiB ping-pong
  // 7-8 us, 3.5-4.5 us with this; steady state 1-1.5). So each side maps the first pass
  // ahead of its position in windows of kPopulateWindow, one madvise() each; the region is
  // past what the producer published, so the other side does not touch it meanwhile. (The
  // rest of a first pass is the memory itself being provided: on this VM 2-3 us per fresh
  // page from the host, which no way of mapping avoids.) On a kernel without
  // MADV_POPULATE_* (before 5.14) pages fault in one by one, as before.
  void populate(uint64_t upto, int advice) {
    static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uint64_t end = std::min<uint64_t>(size, std::max(upto, mapped + kPopulateWindow));
    const uintptr_t from =
        reinterpret_cast<uintptr_t>(data + mapped) & ~(page - 1);  // madvise: aligned start
    if (::madvise(reinterpret_cast<void*>(from), reinterpret_cast<uintptr_t>(data + end) - from, advice) !=
        0) {
      mapped = size;  // unsupported (or out of memory: the fault then reports it)
      return;
    }
    mapped = end;
  }

  // Producer: free bytes, refreshing the consumer's tail only when needed.
  size_t space(size_t want) {
    size_t free = size - (pos - cached);
    if (free < want) {
      cached = ctrl->tail.load(std::memory_order_acquire);
      free = size - (pos - cached);
    }
    return free;
  }
  // Consumer: readable bytes, refreshing the producer's head only when needed.
  size_t avail(size_t want) {
    size_t a = cached - pos;
    if (a < want) {
      cached = ctrl->head.load(std::memory_order_acquire);
      a = cached - pos;
    }
    return a;
  }
};

struct RecvOp {
  RequestPtr req;
  uint64_t tag = 0;
  uint8_t* data = nullptr;
  size_t capacity = 0;
};

struct SendOp {
  RequestPtr req;  // null for control frames (CTS, FIN, NACK)
  Frame frame;
  const uint8_t* data = nullptr;  // payload of EAGER / DATA
  size_t offset = 0;              // payload bytes written so far
  bool header_done = false;
};

struct RndvSend {
  RequestPtr req;
  uint64_t tag = 0;
  const uint8_t* data = nullptr;
  size_t size = 0;
};

// A message that arrived before its receive was posted.
struct Unexpected {
  Frame frame;                   // EAGER or RTS
  std::vector<uint8_t> payload;  // EAGER only
  bool complete = false;         // whole EAGER payload has arrived (RTS: always)
  std::optional<RecvOp> waiter;  // a receive matched it while its payload was still arriving
  uint64_t arrival = 0;          // order of arrival over all peers (any-source receives take the oldest)
};

struct CmaOp {
  int peer_index = 0;
  RecvOp recv;
  uint64_t id = 0;
  uint64_t addr = 0;
  size_t size = 0;
  size_t offset = 0;
};

struct Peer {
  int rank = -1;
  pid_t pid = -1;
  std::string host;
  UnixConn conn;
  UniqueFd wake_fd;  // the peer's eventfd
  ShmSegment seg;    // the peer's inbox, mapped here
  InboxHeader* hdr = nullptr;
  Ring out;  // my ring in the peer's inbox
  Ring in;   // the peer's ring in my inbox
  bool cma_ok = true;
  uint64_t next_id = 1;

  std::deque<SendOp> sendq;
  std::unordered_map<uint64_t, RndvSend> rndv_sends;  // by id: waiting for CTS / FIN / NACK
  std::unordered_map<uint64_t, RecvOp> rndv_recvs;    // by id: waiting for DATA
  std::unordered_map<uint64_t, std::deque<RecvOp>> posted;
  std::unordered_map<uint64_t, std::deque<std::shared_ptr<Unexpected>>> unexpected;

  // Inbound frame being consumed.
  bool in_payload = false;
  Frame cur;
  size_t remaining = 0;
  uint8_t* dst = nullptr;  // null: discard
  std::optional<RecvOp> cur_recv;
  std::shared_ptr<Unexpected> cur_unexp;

  bool draining = false;  // failPeer() is delivering what arrived before the failure
  bool corrupt = false;   // a bad frame arrived: stop reading this ring
  bool failed = false;
  std::string failure;  // why (for requests posted later)
};

size_t roundPow2(size_t v) {
  size_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

class ShmTransport final : public Transport {
 public:
  ShmTransport(const TransportSetup& setup, const ShmTransportOptions& options);
  ~ShmTransport() override;
  const char* name() const override { return "shm"; }

  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override;
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t capacity) override;
  RequestPtr tryRecvAny(uint64_t tag, void* data, size_t capacity) override;
  bool progress() override;
  void pollFds(std::vector<pollfd>& fds) override;
  bool prepareSleep() override;
  void finishSleep() override;
  void abort(std::exception_ptr error) override;

 private:
  // Request::cancel of a receive: withdrawn while it is still posted (no message matched it).
  bool withdraw(Request& request, std::exception_ptr error);
  void connectAll(const TransportSetup& setup);
  Peer& peerFor(int rank, const char* op);
  bool pumpSend(Peer& p);
  bool drainInbound(Peer& p);
  void handleFrame(Peer& p, const Frame& f);
  void finishPayload(Peer& p);
  void startRendezvous(Peer& p, RecvOp r, const Frame& f);
  void matchUnexpected(Peer& p, std::shared_ptr<Unexpected> u, RecvOp r);
  bool progressCma();
  void sendControl(Peer& p, uint32_t type, uint64_t id, uint64_t size);
  void wake(Peer& p);
  bool hasWork(Peer& p);
  void checkLiveness(bool force);
  void failPeer(Peer& p, const std::string& why);
  void failAll(std::exception_ptr error);
  void failTruncated(Peer& p, const RecvOp& r, size_t message_bytes);
  std::optional<RecvOp> popPosted(Peer& p, uint64_t tag);

  int rank_;
  int size_;
  ProgressEngine* engine_;
  ShmTransportOptions opt_;
  size_t ring_bytes_ = 0;
  std::mutex mutex_;
  std::vector<Peer> peers_;
  std::vector<int> index_;  // world rank -> index in peers_, or -1
  ShmSegment inbox_;
  InboxHeader* my_hdr_ = nullptr;
  UniqueFd my_wake_;
  std::deque<CmaOp> cma_;
  std::exception_ptr aborted_;
  Clock::time_point next_liveness_check_{};
  uint64_t next_arrival_ = 0;
  bool sleeping_ = false;
  std::shared_ptr<CancelGate> cancel_gate_ = std::make_shared<CancelGate>();
};

ShmTransport::ShmTransport(const TransportSetup& setup, const ShmTransportOptions& options)
    : rank_(setup.rank), size_(setup.size), engine_(setup.engine), opt_(options) {
  if (rank_ < 0 || rank_ >= size_)
    throw InvalidArgument(fmt::format("{}rank {} is outside [0, {})",
                                      errorContext(rank_, "shm transport setup"), rank_, size_));
  index_.assign(size_, -1);
  cancel_gate_->withdraw = [this](Request& r, std::exception_ptr e) { return withdraw(r, std::move(e)); };
  std::vector<int> peers = setup.peers;
  std::sort(peers.begin(), peers.end());
  for (size_t i = 0; i < peers.size(); ++i) {
    int r = peers[i];
    if (r < 0 || r >= size_ || r == rank_ || (i > 0 && peers[i - 1] == r))
      throw InvalidArgument(
          fmt::format("{}peer list has {} (invalid, duplicate or this rank); pass each other "
                      "local rank once",
                      errorContext(rank_, "shm transport setup"), r));
  }
  ring_bytes_ = opt_.ring_bytes ? opt_.ring_bytes : env::getSize("CROSSBAR_SHM_RING_SIZE");
  ring_bytes_ = roundPow2(std::max(ring_bytes_, kMinRing));
  opt_.eager_limit = std::min(opt_.eager_limit, ring_bytes_ / 2);
  opt_.chunk_bytes = std::max<size_t>(opt_.chunk_bytes, 4096);
  opt_.pipeline_bytes = std::clamp<size_t>(opt_.pipeline_bytes, 4096, ring_bytes_ / 2);
  peers_.resize(peers.size());
  for (size_t i = 0; i < peers.size(); ++i) {
    peers_[i].rank = peers[i];
    index_[peers[i]] = static_cast<int>(i);
  }
  if (peers_.empty()) return;

  // My inbox: header page, then one (control page + ring) slot per peer. Pages are
  // touched lazily; a ring costs memory only once traffic reaches it.
  size_t stride = kPage + ring_bytes_;
  ShmOptions so;
  so.name = fmt::format("crossbar-shm-inbox-r{}", rank_);
  so.rank = rank_;
  inbox_ = ShmSegment::create(slotOffset(peers_.size(), stride), so);
  my_hdr_ = new (inbox_.data()) InboxHeader{};
  my_hdr_->magic = kMagic;
  my_hdr_->version = kVersion;
  my_hdr_->rank = rank_;
  my_hdr_->slots = static_cast<uint32_t>(peers_.size());
  my_hdr_->ring_bytes = ring_bytes_;
  my_hdr_->slot_stride = stride;
  my_hdr_->sleeping.store(0);
  my_hdr_->aborted.store(0);
  for (size_t i = 0; i < peers_.size(); ++i) {
    auto* ctrl = new (inbox_.as<char>(slotOffset(i, stride))) RingCtrl{};
    ctrl->head.store(0);
    ctrl->tail.store(0);
    Ring& in = peers_[i].in;
    in.ctrl = ctrl;
    in.data = inbox_.as<uint8_t>(slotOffset(i, stride) + kPage);
    in.size = ring_bytes_;
    in.mask = ring_bytes_ - 1;
  }
  int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd < 0) throwSystemError(rank_, "eventfd for the shm transport", errno);
  my_wake_.reset(efd);

  connectAll(setup);
  inbox_.closeFd();  // every peer holds its own reference now
  next_liveness_check_ = Clock::now();
  CB_INFO("shm", "shm transport up: {} peers, ring {} bytes, eager limit {} bytes, large messages via {}",
          peers_.size(), ring_bytes_, opt_.eager_limit,
          opt_.large_path == ShmTransportOptions::LargePath::kRing ? std::string("the ring")
          : opt_.large_path == ShmTransportOptions::LargePath::kCma
              ? std::string("process_vm_readv")
              : fmt::format("process_vm_readv up to {} bytes, "
                            "the ring above",
                            opt_.cma_max_bytes));
}

void ShmTransport::connectAll(const TransportSetup& setup) {
  if (!setup.store)
    throw InvalidArgument(errorContext(rank_, "shm transport setup") + "TransportSetup.store is null");
  Store& store = *setup.store;
  Deadline deadline = setup.deadline;
  // One nonce per (context, instance): the k-th shm transport of each rank agrees.
  int64_t instance = store.add(fmt::format("shm/instance/{}", rank_), 1);
  std::string nonce = jobNonce(store, fmt::format("shm/nonce/{}", instance));
  UnixListener listener(socketName(nonce, "shm", rank_), rank_);

  auto makeHello = [&](const Peer& p) {
    Hello h{};
    h.magic = kMagic;
    h.version = kVersion;
    h.rank = rank_;
    h.slot = index_[p.rank];
    h.ring_bytes = ring_bytes_;
    h.seg_bytes = inbox_.size();
    h.pid = getpid();
    std::snprintf(h.host, sizeof(h.host), "%s", hostName().c_str());
    return h;
  };
  std::vector<int> fds = {inbox_.fd(), my_wake_.get()};
  auto acceptHello = [&](UnixMessage& m, int expect_rank) -> Peer& {
    Hello h{};
    if (m.bytes.size() != sizeof(Hello) || m.fds.size() != 2) {
      throw InternalError(fmt::format("{}malformed hello ({} bytes, {} fds) on the shm socket",
                                      errorContext(rank_, "shm transport setup"), m.bytes.size(),
                                      m.fds.size()));
    }
    std::memcpy(&h, m.bytes.data(), sizeof(h));
    if (h.magic != kMagic || h.version != kVersion)
      throw InvalidUsage(
          fmt::format("{}a peer speaks another shm protocol version ({} vs {}); mixed crossbar builds?",
                      errorContext(rank_, "shm transport setup"), h.version, kVersion));
    if (h.rank < 0 || h.rank >= size_ || index_[h.rank] < 0 || (expect_rank >= 0 && h.rank != expect_rank)) {
      throw InvalidUsage(
          fmt::format("{}rank {} connected but is not an expected peer; ranks disagree about the "
                      "shm peer lists",
                      errorContext(rank_, "shm transport setup"), h.rank));
    }
    Peer& p = peers_[index_[h.rank]];
    if (p.seg.valid())
      throw InvalidUsage(
          fmt::format("{}rank {} connected twice", errorContext(rank_, "shm transport setup"), h.rank));
    p.host = std::string(h.host, strnlen(h.host, sizeof(h.host)));
    ShmOptions so;
    so.rank = rank_;
    p.seg = ShmSegment::attach(m.fds[0].release(), h.seg_bytes, so);
    p.wake_fd = std::move(m.fds[1]);
    p.hdr = p.seg.as<InboxHeader>();
    if (p.hdr->magic != kMagic || h.slot < 0 || static_cast<uint32_t>(h.slot) >= p.hdr->slots)
      throw InternalError(
          fmt::format("{}rank {} sent a bad inbox", errorContext(rank_, "shm transport setup"), h.rank));
    size_t off = slotOffset(h.slot, p.hdr->slot_stride);
    p.out.ctrl = p.seg.as<RingCtrl>(off);
    p.out.data = p.seg.as<uint8_t>(off + kPage);
    p.out.size = p.hdr->ring_bytes;
    p.out.mask = p.out.size - 1;
    return p;
  };

  // 1. Connect to every lower peer (its listener queues us; no accept needed yet).
  for (Peer& p : peers_) {
    if (p.rank > rank_) break;
    p.conn = UnixConn::connect(socketName(nonce, "shm", p.rank), deadline, rank_,
                               fmt::format("peer rank {}", p.rank));
    Hello h = makeHello(p);
    p.conn.send(&h, sizeof(h), fds, deadline);
  }
  // 2. Accept every higher peer, read its hello, answer with mine.
  size_t higher = std::count_if(peers_.begin(), peers_.end(), [&](const Peer& p) { return p.rank > rank_; });
  for (size_t k = 0; k < higher; ++k) {
    std::vector<int> missing;
    for (const Peer& p : peers_)
      if (p.rank > rank_ && !p.conn.valid()) missing.push_back(p.rank);
    UnixConn c = listener.accept(deadline, "peer " + formatPeers(missing));
    UnixMessage m = c.recv(deadline);
    Peer& p = acceptHello(m, -1);
    p.conn = std::move(c);
    Hello h = makeHello(p);
    p.conn.send(&h, sizeof(h), fds, deadline);
  }
  // 3. Read each lower peer's answer.
  for (Peer& p : peers_) {
    if (p.rank > rank_) break;
    UnixMessage m;
    try {
      m = p.conn.recv(deadline);
    } catch (const PeerFailure&) {
      throw PeerFailure(
          fmt::format("{}peer rank {} hung up during connection setup (it exited or was killed); "
                      "check that rank's log",
                      errorContext(rank_, "shm transport setup"), p.rank),
          {p.rank});
    } catch (const Timeout&) {
      throw Timeout(
          fmt::format("{}peer rank {} accepted the connection but never answered before the deadline; "
                      "check that rank's log, raise CROSSBAR_CONNECT_TIMEOUT if it is only slow",
                      errorContext(rank_, "shm transport setup"), p.rank),
          {p.rank});
    }
    acceptHello(m, p.rank);
  }
  for (Peer& p : peers_) {
    pid_t pid = p.conn.peerPid();
    p.pid = pid;
  }
}

ShmTransport::~ShmTransport() {
  cancel_gate_->close();  // first: a cancel() running now holds the gate, then our mutex
  std::lock_guard<std::mutex> lock(mutex_);
  if (!aborted_) {
    failAll(std::make_exception_ptr(Aborted(errorContext(rank_, "shm transport") +
                                            "the transport was destroyed while this request was pending")));
  }
}

Peer& ShmTransport::peerFor(int rank, const char* op) {
  if (rank < 0 || rank >= size_ || index_[rank] < 0) {
    std::vector<int> ranks;
    for (const Peer& p : peers_) ranks.push_back(p.rank);
    throw InvalidArgument(
        fmt::format("{}rank {} is not a peer of this shm transport (its peers: {}); route it "
                    "through another transport",
                    errorContext(rank_, op), rank, ranks.empty() ? "none" : formatPeers(ranks)));
  }
  return peers_[index_[rank]];
}

RequestPtr ShmTransport::isend(int peer, uint64_t tag, const void* data, size_t bytes) {
  if (tag > kMaxTransportTag)
    throw InvalidArgument(fmt::format("{}tag {} exceeds 2^48-1", errorContext(rank_, "shm send"), tag));
  std::lock_guard<std::mutex> lock(mutex_);
  Peer& p = peerFor(peer, "shm send");
  auto req = std::make_shared<Request>(
      engine_, fmt::format("shm send of {} bytes tag {} to rank {}", bytes, tag, peer));
  if (aborted_) {
    req->fail(aborted_);
    return req;
  }
  if (p.failed) {
    req->fail(std::make_exception_ptr(
        PeerFailure(fmt::format("{}{}", errorContext(rank_, req->what()), p.failure), {p.rank})));
    return req;
  }
  SendOp op;
  op.req = req;
  op.frame.tag = tag;
  op.frame.size = bytes;
  op.data = static_cast<const uint8_t*>(data);
  if (bytes <= opt_.eager_limit) {
    op.frame.type = kEager;
  } else {
    op.frame.type = kRts;
    op.frame.id = p.next_id++;
    op.frame.addr = reinterpret_cast<uint64_t>(data);
  }
  p.sendq.push_back(std::move(op));
  if (p.sendq.size() == 1) pumpSend(p);  // fast path: small messages complete right here
  return req;
}

RequestPtr ShmTransport::irecv(int peer, uint64_t tag, void* data, size_t capacity) {
  if (tag > kMaxTransportTag)
    throw InvalidArgument(fmt::format("{}tag {} exceeds 2^48-1", errorContext(rank_, "shm recv"), tag));
  if (peer == kAnySource)
    throw InvalidArgument(errorContext(rank_, "shm recv") +
                          "irecv needs a peer; any-source receives go through tryRecvAny()");
  std::lock_guard<std::mutex> lock(mutex_);
  Peer& p = peerFor(peer, "shm recv");
  auto req = std::make_shared<Request>(
      engine_, fmt::format("shm recv of up to {} bytes tag {} from rank {}", capacity, tag, peer));
  req->setCancelGate(cancel_gate_);
  if (aborted_) {
    req->fail(aborted_);
    return req;
  }
  RecvOp r{req, tag, static_cast<uint8_t*>(data), capacity};
  auto it = p.unexpected.find(tag);
  if (it != p.unexpected.end()) {
    auto u = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) p.unexpected.erase(it);
    matchUnexpected(p, std::move(u), std::move(r));
    return req;
  }
  if (p.failed) {
    req->fail(std::make_exception_ptr(
        PeerFailure(fmt::format("{}{}", errorContext(rank_, req->what()), p.failure), {p.rank})));
    return req;
  }
  p.posted[tag].push_back(std::move(r));
  return req;
}

RequestPtr ShmTransport::tryRecvAny(uint64_t tag, void* data, size_t capacity) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) return nullptr;
  // The oldest unmatched message with this tag, over every peer.
  Peer* from = nullptr;
  for (Peer& p : peers_) {
    auto it = p.unexpected.find(tag);
    if (it == p.unexpected.end()) continue;
    if (!from || it->second.front()->arrival < from->unexpected[tag].front()->arrival) from = &p;
  }
  if (!from) return nullptr;
  auto req = std::make_shared<Request>(
      engine_, fmt::format("shm recv of up to {} bytes tag {} from any rank (matched rank {})", capacity, tag,
                           from->rank));
  auto it = from->unexpected.find(tag);
  auto u = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) from->unexpected.erase(it);
  matchUnexpected(*from, std::move(u), RecvOp{req, tag, static_cast<uint8_t*>(data), capacity});
  return req;
}

// Only a posted receive can be withdrawn: once a frame matched it, its payload is
// streamed into its buffer (or read there by CMA), or the sender waits for its CTS/FIN,
// and taking it back would split or lose that message.
bool ShmTransport::withdraw(Request& request, std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Peer& p : peers_) {
    for (auto it = p.posted.begin(); it != p.posted.end(); ++it) {
      auto& q = it->second;
      auto found = std::find_if(q.begin(), q.end(), [&](const RecvOp& r) { return r.req.get() == &request; });
      if (found == q.end()) continue;
      q.erase(found);  // later receives of the tag keep their order
      if (q.empty()) p.posted.erase(it);
      request.fail(error ? std::move(error) : request.cancelledError(rank_, p.rank));
      return true;
    }
  }
  return false;
}

std::optional<RecvOp> ShmTransport::popPosted(Peer& p, uint64_t tag) {
  auto it = p.posted.find(tag);
  if (it == p.posted.end()) return std::nullopt;
  RecvOp r = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) p.posted.erase(it);
  return r;
}

void ShmTransport::failTruncated(Peer& p, const RecvOp& r, size_t message_bytes) {
  r.req->fail(std::make_exception_ptr(InvalidUsage(
      fmt::format(
          "{}rank {} sent {} bytes with tag {} but the receive holds only {} bytes; post a receive at least "
          "as large as the message (the message was dropped, later messages are unaffected)",
          errorContext(rank_, r.req->what()), p.rank, message_bytes, r.tag, r.capacity),
      {p.rank})));
}

void ShmTransport::matchUnexpected(Peer& p, std::shared_ptr<Unexpected> u, RecvOp r) {
  if (u->frame.type == kRts) {
    startRendezvous(p, std::move(r), u->frame);
    return;
  }
  if (r.capacity < u->frame.size) {
    failTruncated(p, r, u->frame.size);  // the payload keeps arriving into the orphaned buffer
    return;
  }
  if (!u->complete) {
    u->waiter = std::move(r);
    return;
  }
  if (u->frame.size) std::memcpy(r.data, u->payload.data(), u->frame.size);
  r.req->complete(p.rank, r.tag, u->frame.size);
}

void ShmTransport::startRendezvous(Peer& p, RecvOp r, const Frame& f) {
  if (r.capacity < f.size) {
    failTruncated(p, r, f.size);
    sendControl(p, kNack, f.id, r.capacity);
    return;
  }
  using LP = ShmTransportOptions::LargePath;
  bool cma = opt_.large_path == LP::kCma || (opt_.large_path == LP::kAuto && f.size <= opt_.cma_max_bytes);
  if (p.cma_ok && cma) {
    cma_.push_back(CmaOp{index_[p.rank], std::move(r), f.id, f.addr, f.size, 0});
    return;
  }
  p.rndv_recvs.emplace(f.id, std::move(r));
  sendControl(p, kCts, f.id, f.size);
}

void ShmTransport::sendControl(Peer& p, uint32_t type, uint64_t id, uint64_t size) {
  SendOp op;
  op.frame.type = type;
  op.frame.id = id;
  op.frame.size = size;
  p.sendq.push_back(std::move(op));
}

void ShmTransport::wake(Peer& p) {
  // Pairs with prepareSleep(): publish, fence (fence.h), then look at the flag.
  fence::light();
  auto& flag = p.hdr->sleeping;
  if (flag.load(std::memory_order_relaxed) && flag.exchange(0, std::memory_order_acq_rel)) {
    uint64_t one = 1;
    ssize_t n = ::write(p.wake_fd.get(), &one, sizeof(one));
    (void)n;  // EAGAIN (counter full) still wakes it; a dead peer is found through its socket
  }
}

bool ShmTransport::pumpSend(Peer& p) {
  bool moved = false;
  size_t budget = opt_.chunk_bytes;
  Ring& ring = p.out;
  uint64_t start = ring.pos;
  while (!p.sendq.empty()) {
    SendOp& op = p.sendq.front();
    if (!op.header_done) {
      if (ring.space(sizeof(Frame)) < sizeof(Frame)) break;
      ring.write(&op.frame, sizeof(Frame));
      op.header_done = true;
      moved = true;
    }
    if (op.frame.type == kEager || op.frame.type == kData) {
      bool stalled = false;
      while (op.offset < op.frame.size) {
        size_t want = std::min({op.frame.size - op.offset, budget, opt_.pipeline_bytes});
        size_t n = std::min(want, ring.space(want));
        if (n == 0) {
          stalled = true;
          break;
        }
        ring.write(op.data + op.offset, n);
        op.offset += n;
        budget -= n;
        moved = true;
        if (op.offset < op.frame.size) {
          // Let the consumer start on this chunk while we write the next.
          ring.ctrl->head.store(ring.pos, std::memory_order_release);
          wake(p);
        }
        if (budget == 0) {
          stalled = true;
          break;
        }
      }
      if (stalled) break;
    }
    SendOp done = std::move(p.sendq.front());
    p.sendq.pop_front();
    if (done.frame.type == kRts) {
      p.rndv_sends.emplace(done.frame.id,
                           RndvSend{std::move(done.req), done.frame.tag, done.data, done.frame.size});
    } else if (done.req) {
      done.req->complete(p.rank, done.frame.tag, done.frame.size);
    }
  }
  if (ring.pos != start) {
    ring.ctrl->head.store(ring.pos, std::memory_order_release);
    wake(p);
  }
  return moved;
}

bool ShmTransport::drainInbound(Peer& p) {
  Ring& ring = p.in;
  uint64_t start = ring.pos;
  uint64_t published = ring.pos;
  size_t budget = opt_.chunk_bytes;
  while (true) {
    if (!p.in_payload) {
      if (ring.avail(sizeof(Frame)) < sizeof(Frame)) break;
      Frame f;
      ring.read(&f, sizeof(f));
      handleFrame(p, f);
      if (p.failed || p.corrupt) break;
      continue;
    }
    size_t want = std::min({p.remaining, budget, opt_.pipeline_bytes});
    size_t n = std::min(want, ring.avail(want));
    if (n == 0) break;
    ring.read(p.dst, n);
    if (p.dst) p.dst += n;
    p.remaining -= n;
    budget -= n;
    if (ring.pos - published >= opt_.pipeline_bytes) {
      // Free space early so a producer blocked on a full ring can continue.
      ring.ctrl->tail.store(ring.pos, std::memory_order_release);
      published = ring.pos;
      wake(p);
    }
    if (p.remaining == 0) finishPayload(p);
    if (budget == 0) break;
  }
  if (ring.pos != published) {
    ring.ctrl->tail.store(ring.pos, std::memory_order_release);
    wake(p);
  }
  return ring.pos != start;
}

void ShmTransport::handleFrame(Peer& p, const Frame& f) {
  switch (f.type) {
    case kEager: {
      p.in_payload = true;
      p.cur = f;
      p.remaining = f.size;
      p.dst = nullptr;
      if (auto r = popPosted(p, f.tag)) {
        if (r->capacity < f.size) {
          failTruncated(p, *r, f.size);  // payload is skipped
        } else {
          p.dst = r->data;
          p.cur_recv = std::move(r);
        }
      } else {
        auto u = std::make_shared<Unexpected>();
        u->frame = f;
        u->payload.resize(f.size);
        u->arrival = next_arrival_++;
        p.dst = u->payload.data();
        p.cur_unexp = u;
        p.unexpected[f.tag].push_back(std::move(u));
      }
      if (p.remaining == 0) finishPayload(p);
      break;
    }
    case kRts: {
      if (auto r = popPosted(p, f.tag)) {
        startRendezvous(p, std::move(*r), f);
      } else {
        auto u = std::make_shared<Unexpected>();
        u->frame = f;
        u->complete = true;
        u->arrival = next_arrival_++;
        p.unexpected[f.tag].push_back(std::move(u));
      }
      break;
    }
    case kData: {
      p.in_payload = true;
      p.cur = f;
      p.remaining = f.size;
      p.dst = nullptr;
      auto it = p.rndv_recvs.find(f.id);
      if (it != p.rndv_recvs.end()) {
        p.dst = it->second.data;
        p.cur_recv = std::move(it->second);
        p.rndv_recvs.erase(it);
      } else {
        CB_WARN("shm", "rank {}: DATA for unknown rendezvous id {} from rank {} (dropped)", rank_, f.id,
                p.rank);
      }
      if (p.remaining == 0) finishPayload(p);
      break;
    }
    case kCts: {
      auto it = p.rndv_sends.find(f.id);
      if (it == p.rndv_sends.end()) break;  // already failed locally
      SendOp op;
      op.req = std::move(it->second.req);
      op.frame.type = kData;
      op.frame.tag = it->second.tag;
      op.frame.size = it->second.size;
      op.frame.id = f.id;
      op.data = it->second.data;
      p.rndv_sends.erase(it);
      p.sendq.push_back(std::move(op));
      break;
    }
    case kFin: {
      auto it = p.rndv_sends.find(f.id);
      if (it == p.rndv_sends.end()) break;
      it->second.req->complete(p.rank, it->second.tag, it->second.size);
      p.rndv_sends.erase(it);
      break;
    }
    case kNack: {
      auto it = p.rndv_sends.find(f.id);
      if (it == p.rndv_sends.end()) break;
      RndvSend& s = it->second;
      s.req->fail(std::make_exception_ptr(InvalidUsage(
          fmt::format(
              "{}rank {} matched this {}-byte message (tag {}) with a receive of only {} bytes; the message "
              "was dropped. Post receives at least as large as the messages",
              errorContext(rank_, s.req->what()), p.rank, s.size, s.tag, f.size),
          {p.rank})));
      p.rndv_sends.erase(it);
      break;
    }
    default:
      p.corrupt = true;
      failPeer(
          p, fmt::format("rank {} sent a corrupt frame (type {}): memory corruption or mixed crossbar builds",
                         p.rank, f.type));
  }
}

void ShmTransport::finishPayload(Peer& p) {
  p.in_payload = false;
  p.dst = nullptr;
  if (p.cur_recv) {
    p.cur_recv->req->complete(p.rank, p.cur.tag, p.cur.size);
    p.cur_recv.reset();
  }
  if (p.cur_unexp) {
    auto u = std::move(p.cur_unexp);
    p.cur_unexp.reset();
    u->complete = true;
    if (u->waiter) {
      RecvOp r = std::move(*u->waiter);
      u->waiter.reset();
      if (u->frame.size) std::memcpy(r.data, u->payload.data(), u->frame.size);
      r.req->complete(p.rank, r.tag, u->frame.size);
    }
  }
}

bool ShmTransport::progressCma() {
  if (cma_.empty()) return false;
  size_t n_ops = cma_.size();
  for (size_t k = 0; k < n_ops && !cma_.empty(); ++k) {
    CmaOp op = std::move(cma_.front());
    cma_.pop_front();
    Peer& p = peers_[op.peer_index];
    if (p.failed) continue;  // already failed with the peer
    size_t n = std::min(op.size - op.offset, opt_.chunk_bytes * 4);
    iovec local{op.recv.data + op.offset, n};
    iovec remote{reinterpret_cast<void*>(op.addr + op.offset), n};
    ssize_t got = ::process_vm_readv(p.pid, &local, 1, &remote, 1, 0);
    if (got > 0) {
      op.offset += static_cast<size_t>(got);
      if (op.offset == op.size) {
        op.recv.req->complete(p.rank, op.recv.tag, op.size);
        sendControl(p, kFin, op.id, op.size);
      } else {
        cma_.push_back(std::move(op));
      }
      continue;
    }
    int e = got < 0 ? errno : EIO;
    if (e == ESRCH) {
      cma_.push_front(std::move(op));  // failPeer() fails it with a proper message
      failPeer(p, "its process is gone (process_vm_readv: ESRCH)");
      continue;
    }
    // EPERM (ptrace policy, other user, container), ENOSYS, EFAULT: stream through the ring instead.
    CB_INFO("shm", "process_vm_readv from rank {} (pid {}) failed: {}; using the ring for its large messages",
            p.rank, p.pid, std::strerror(e));
    p.cma_ok = false;
    p.rndv_recvs.emplace(op.id, std::move(op.recv));
    sendControl(p, kCts, op.id, op.size);
  }
  return true;
}

bool ShmTransport::progress() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) return false;
  bool moved = false;
  for (Peer& p : peers_) {
    if (p.failed) continue;
    moved |= drainInbound(p);
    if (!p.failed) moved |= pumpSend(p);
  }
  moved |= progressCma();
  for (Peer& p : peers_)
    if (!p.failed && !p.sendq.empty()) moved |= pumpSend(p);  // control frames queued by CMA / drains
  checkLiveness(false);
  return moved;
}

bool ShmTransport::hasWork(Peer& p) {
  if (p.failed) return false;
  if (p.in.avail(1) > 0) return true;
  if (!p.sendq.empty()) {
    const SendOp& op = p.sendq.front();
    size_t need = op.header_done ? 1 : sizeof(Frame);
    if (p.out.space(need) >= need) return true;
  }
  return false;
}

bool ShmTransport::prepareSleep() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_ || peers_.empty()) return true;
  if (!cma_.empty()) return false;
  my_hdr_->sleeping.store(1, std::memory_order_seq_cst);
  fence::heavy();  // wake() only has fence::light()
  for (Peer& p : peers_) {
    if (hasWork(p)) {
      my_hdr_->sleeping.store(0, std::memory_order_relaxed);
      return false;
    }
  }
  sleeping_ = true;
  return true;
}

void ShmTransport::pollFds(std::vector<pollfd>& fds) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_ || peers_.empty()) return;
  fds.push_back({my_wake_.get(), POLLIN, 0});
  for (Peer& p : peers_)
    if (!p.failed && p.conn.valid()) fds.push_back({p.conn.fd(), POLLIN, 0});  // hang-up shows as POLLHUP
}

void ShmTransport::finishSleep() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!my_hdr_) return;
  my_hdr_->sleeping.store(0, std::memory_order_relaxed);
  if (sleeping_) {
    sleeping_ = false;
    uint64_t v;
    ssize_t n = ::read(my_wake_.get(), &v, sizeof(v));  // clear pending wake-ups
    (void)n;
    checkLiveness(true);
  }
}

void ShmTransport::checkLiveness(bool force) {
  auto now = Clock::now();
  if (!force && now < next_liveness_check_) return;
  next_liveness_check_ = now + std::chrono::milliseconds(1);
  for (Peer& p : peers_) {
    if (p.failed || !p.conn.valid()) continue;
    if (!p.conn.peerClosed()) continue;
    if (p.hdr && p.hdr->aborted.load(std::memory_order_acquire))
      failPeer(p, "it aborted its communicator (abort(), or a failure it detected) and left; it may be alive");
    else
      failPeer(p, "its socket closed: the process exited, crashed or was killed");
  }
}

void ShmTransport::failPeer(Peer& p, const std::string& why) {
  if (p.failed || p.draining) return;
  // Deliver whatever the peer finished writing before it went away.
  p.draining = true;
  if (!p.corrupt)
    while (drainInbound(p)) {
    }
  p.draining = false;
  p.failed = true;
  const std::string who = fmt::format("peer rank {} (host {}, pid {})", p.rank, p.host, p.pid);
  const std::string advice = fmt::format(
      "Check rank {}'s log for the cause; this transport cannot reach it any more (abort the communicator, "
      "then "
      "shrink it or restart the job)",
      p.rank);
  p.failure = fmt::format("{} hung up or died earlier ({}). {}", who, why, advice);
  bool pending = !p.sendq.empty() || !p.rndv_sends.empty() || !p.rndv_recvs.empty() || !p.posted.empty() ||
                 p.cur_recv || std::any_of(cma_.begin(), cma_.end(), [&](const CmaOp& op) {
                   return peers_[op.peer_index].rank == p.rank;
                 });
  // A peer that leaves with nothing pending with us is a normal shutdown.
  if (pending)
    CB_WARN("shm", "rank {}: {} failed with operations pending: {}", rank_, who, why);
  else
    CB_INFO("shm", "rank {}: {} is gone ({})", rank_, who, why);
  auto err = [&](const RequestPtr& req, size_t bytes, uint64_t tag, const char* dir) {
    return std::make_exception_ptr(
        PeerFailure(fmt::format("{}{} hung up or died during {} of {} bytes tag {} ({}). {}",
                                errorContext(rank_, req->what()), who, dir, bytes, tag, why, advice),
                    {p.rank}));
  };
  for (SendOp& op : p.sendq)
    if (op.req) op.req->fail(err(op.req, op.frame.size, op.frame.tag, "send"));
  p.sendq.clear();
  for (auto& [id, s] : p.rndv_sends) s.req->fail(err(s.req, s.size, s.tag, "send"));
  p.rndv_sends.clear();
  for (auto& [id, r] : p.rndv_recvs) r.req->fail(err(r.req, r.capacity, r.tag, "recv"));
  p.rndv_recvs.clear();
  for (auto& [tag, q] : p.posted)
    for (RecvOp& r : q) r.req->fail(err(r.req, r.capacity, r.tag, "recv"));
  p.posted.clear();
  if (p.cur_recv) p.cur_recv->req->fail(err(p.cur_recv->req, p.cur.size, p.cur.tag, "recv"));
  p.cur_recv.reset();
  p.cur_unexp.reset();
  p.in_payload = false;
  // Keep complete eager messages (they may still be received); drop the rest.
  for (auto it = p.unexpected.begin(); it != p.unexpected.end();) {
    auto& q = it->second;
    for (auto& u : q)
      if (!u->complete && u->waiter)
        u->waiter->req->fail(err(u->waiter->req, u->frame.size, u->frame.tag, "recv"));
    q.erase(std::remove_if(q.begin(), q.end(),
                           [](const auto& u) { return !u->complete || u->frame.type == kRts; }),
            q.end());
    it = q.empty() ? p.unexpected.erase(it) : std::next(it);
  }
  for (auto it = cma_.begin(); it != cma_.end();) {
    if (peers_[it->peer_index].rank == p.rank) {
      it->recv.req->fail(err(it->recv.req, it->size, it->recv.tag, "recv"));
      it = cma_.erase(it);
    } else {
      ++it;
    }
  }
  p.conn.close();  // out of the poll set
}

void ShmTransport::failAll(std::exception_ptr error) {
  for (Peer& p : peers_) {
    for (SendOp& op : p.sendq)
      if (op.req) op.req->fail(error);
    p.sendq.clear();
    for (auto& [id, s] : p.rndv_sends) s.req->fail(error);
    p.rndv_sends.clear();
    for (auto& [id, r] : p.rndv_recvs) r.req->fail(error);
    p.rndv_recvs.clear();
    for (auto& [tag, q] : p.posted)
      for (RecvOp& r : q) r.req->fail(error);
    p.posted.clear();
    if (p.cur_recv) p.cur_recv->req->fail(error);
    p.cur_recv.reset();
    for (auto& [tag, q] : p.unexpected)
      for (auto& u : q)
        if (u->waiter) u->waiter->req->fail(error);
    if (p.cur_unexp && p.cur_unexp->waiter) p.cur_unexp->waiter->req->fail(error);
  }
  for (CmaOp& op : cma_) op.recv.req->fail(error);
  cma_.clear();
}

void ShmTransport::abort(std::exception_ptr error) {
  if (!error) error = std::make_exception_ptr(Aborted(errorContext(rank_, "shm transport") + "aborted"));
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) return;
  aborted_ = error;
  // Before the peers can see this process close its sockets (they name the cause).
  if (my_hdr_) my_hdr_->aborted.store(1, std::memory_order_release);
  failAll(error);
  if (my_wake_) {
    uint64_t one = 1;  // a thread blocked in the engine's poll() returns now, not at its 100 ms cap
    ssize_t n = ::write(my_wake_.get(), &one, sizeof(one));
    (void)n;
  }
  CB_INFO("shm", "rank {}: shm transport aborted", rank_);
}

}  // namespace

std::unique_ptr<Transport> makeShmTransport(const TransportSetup& setup, const ShmTransportOptions& options) {
  return std::make_unique<ShmTransport>(setup, options);
}

std::unique_ptr<Transport> makeShmTransport(const TransportSetup& setup) {
  return makeShmTransport(setup, ShmTransportOptions{});
}

}  // namespace crossbar
