// TCP store: one server thread multiplexes every client with poll(); blocking gets
// and waits are parked in the server and answered when their keys are set, so no
// client ever polls. Clients speak a tiny length-prefixed protocol:
//
//   hello     client -> server: u32 magic, u16 version, u16 flags (bit 0: has a secret)
//             server -> client: u32 magic, u16 server version, u16 status
//                               (+ 32-byte server nonce when status is kHelloAuth)
//   auth      client -> server: 32-byte client nonce, HMAC(secret, sn || kClientLabel || cn)
//             server -> client: u16 status, u16 reserved (+ HMAC(secret, cn || kServerLabel || sn)
//                               when accepted; a rejected client is disconnected)
//   request   u16 op,     u16 reserved,   u32 nargs, nargs x (u32 length, bytes)
//   response  u16 status, u16 error code, u32 nargs, nargs x (u32 length, bytes)
//
// Integers are little-endian; integer arguments are 8 bytes. Every length is
// checked against kStoreMax*Bytes before anything is allocated for it.
#include "comm/tcp_store.h"

#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "comm/auth.h"
#include "comm/errors.h"
#include "comm/log.h"

namespace crossbar {
namespace {

constexpr uint32_t kMagic = 0x54534243;  // bytes "CBST" on the wire
constexpr uint16_t kProtocolVersion = 1;
constexpr size_t kHelloBytes = 8;
constexpr size_t kHeaderBytes = 8;
constexpr uint32_t kMaxArgs = 1u << 16;
// A compareSet carries two values; anything larger than this is not a valid frame.
constexpr size_t kMaxFrameBytes = 2 * kStoreMaxValueBytes + (1u << 20);
// Responses queued for a client that does not read stop us reading its requests.
constexpr size_t kOutHighWater = 1u << 20;
constexpr size_t kReadChunk = 64u << 10;
// How long after its deadline a client still waits for the server's own timeout reply.
constexpr Millis kReplyGrace{2000};
// How long a client tries to reconnect after losing an established connection.
constexpr Millis kReconnectWindow{5000};

enum HelloStatus : uint16_t { kHelloOk = 0, kHelloBadVersion = 1, kHelloAuth = 2 };
enum AuthStatus : uint16_t { kAuthOk = 0, kAuthRejected = 1 };
constexpr uint16_t kHelloFlagSecret = 1;
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
// Distinct labels so that neither side's proof can be replayed as the other's.
constexpr std::string_view kClientLabel = "crossbar-store-v1";
constexpr std::string_view kServerLabel = "crossbar-store-v1 server";
// A client that has not finished the handshake by then is dropped (no slot hogging).
constexpr Millis kHandshakeTimeout{10'000};
enum class Op : uint16_t { kSet = 1, kGet, kAdd, kCompareSet, kCheck, kWait, kDelete, kNumKeys };
enum class Status : uint16_t { kOk = 0, kTimeout = 1, kError = 2 };

void putU16(std::string& b, uint16_t v) {
  b.push_back(static_cast<char>(v & 0xff));
  b.push_back(static_cast<char>(v >> 8));
}
void putU32(std::string& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void putU64(std::string& b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint16_t getU16(const char* p) {
  auto u = reinterpret_cast<const uint8_t*>(p);
  return static_cast<uint16_t>(u[0] | (u[1] << 8));
}
uint32_t getU32(const char* p) {
  auto u = reinterpret_cast<const uint8_t*>(p);
  return u[0] | (u[1] << 8) | (u[2] << 16) | (static_cast<uint32_t>(u[3]) << 24);
}
uint64_t getU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Builds one frame (request or response).
class FrameBuilder {
 public:
  explicit FrameBuilder(uint16_t code, uint16_t aux = 0) {
    putU16(buf_, code);
    putU16(buf_, aux);
    putU32(buf_, 0);  // nargs, patched as arguments are added
  }
  FrameBuilder& reserve(size_t bytes) {
    buf_.reserve(buf_.size() + bytes);
    return *this;
  }
  FrameBuilder& arg(const void* data, size_t size) {
    putU32(buf_, static_cast<uint32_t>(size));
    buf_.append(static_cast<const char*>(data), size);
    ++nargs_;
    for (int i = 0; i < 4; ++i) buf_[4 + i] = static_cast<char>((nargs_ >> (8 * i)) & 0xff);
    return *this;
  }
  FrameBuilder& arg(const std::string& s) { return arg(s.data(), s.size()); }
  FrameBuilder& arg(const Bytes& b) { return arg(b.data(), b.size()); }
  FrameBuilder& argInt(int64_t v) {
    std::string tmp;
    putU64(tmp, static_cast<uint64_t>(v));
    return arg(tmp);
  }
  const std::string& data() const { return buf_; }
  std::string take() { return std::move(buf_); }

 private:
  std::string buf_;
  uint32_t nargs_ = 0;
};

struct Frame {
  uint16_t code = 0;
  uint16_t aux = 0;
  std::vector<std::string> args;
};

enum class Parse { kIncomplete, kDone, kReject };

// Parses one frame from the front of [p, p+n). check_header(code, nargs) and
// check_arg(code, index, length) return an error text to reject the frame; they
// run as soon as the lengths are known, before any argument is copied. When an
// argument is incomplete, `used` says how many bytes the frame needs up to its end
// (already validated), so the caller can reserve room once instead of regrowing.
template <class CheckHeader, class CheckArg>
Parse parseFrame(const char* p, size_t n, Frame& frame, size_t& used, std::string& error,
                 CheckHeader&& check_header, CheckArg&& check_arg) {
  used = 0;
  if (n < kHeaderBytes) return Parse::kIncomplete;
  const uint16_t code = getU16(p);
  const uint32_t nargs = getU32(p + 4);
  if (error = check_header(code, nargs); !error.empty()) return Parse::kReject;
  size_t off = kHeaderBytes, total = 0;
  for (uint32_t i = 0; i < nargs; ++i) {
    if (n < off + 4) return Parse::kIncomplete;
    const uint32_t len = getU32(p + off);
    if (error = check_arg(code, i, len); !error.empty()) return Parse::kReject;
    total += len;
    if (total > kMaxFrameBytes) {
      error = fmt::format("message of more than {} bytes exceeds the store's frame limit", total);
      return Parse::kReject;
    }
    off += 4;
    if (n < off + len) {
      used = off + len;
      return Parse::kIncomplete;
    }
    off += len;
  }
  frame.code = code;
  frame.aux = getU16(p + 2);
  frame.args.clear();
  frame.args.reserve(nargs);
  off = kHeaderBytes;
  for (uint32_t i = 0; i < nargs; ++i) {
    const uint32_t len = getU32(p + off);
    frame.args.emplace_back(p + off + 4, len);
    off += 4 + len;
  }
  used = off;
  return Parse::kDone;
}

std::string formatAddress(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

std::string keyList(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i == 16) {
      out += fmt::format(", ... ({} more)", keys.size() - i);
      break;
    }
    out += (i ? ", '" : "'") + printableKey(keys[i]) + "'";
  }
  return out;
}

struct AddrInfoList {
  addrinfo* head = nullptr;
  ~AddrInfoList() {
    if (head) freeaddrinfo(head);
  }
};

// Returns 0 or a getaddrinfo error code.
int resolve(const std::string& host, uint16_t port, bool passive, AddrInfoList& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : AI_ADDRCONFIG;
  const std::string service = std::to_string(port);
  return getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
}

void setNoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int pollTimeoutMs(Clock::time_point until) {
  auto left = std::chrono::duration_cast<Millis>(until - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1'000'000));
}

std::string peerName(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "unknown peer";
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof(host), serv, sizeof(serv),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "unknown peer";
  return formatAddress(host, static_cast<uint16_t>(std::atoi(serv)));
}

// Which arguments of a request are values (the rest are keys or 8-byte integers).
bool isValueArg(Op op, uint32_t index) {
  return (op == Op::kSet && index == 1) || (op == Op::kCompareSet && (index == 1 || index == 2));
}
bool isIntArg(Op op, uint32_t index) {
  return ((op == Op::kGet || op == Op::kAdd) && index == 1) || (op == Op::kWait && index == 0);
}

// The server's checks of a request, run before any argument is copied.
std::string checkRequestHeader(uint16_t code, uint32_t nargs) {
  const auto op = static_cast<Op>(code);
  uint32_t want = 0;
  switch (op) {
    case Op::kSet:
    case Op::kGet:
    case Op::kAdd:
      want = 2;
      break;
    case Op::kCompareSet:
      want = 3;
      break;
    case Op::kDelete:
      want = 1;
      break;
    case Op::kNumKeys:
      want = 0;
      break;
    case Op::kCheck:
      return nargs <= kMaxArgs ? "" : fmt::format("check of {} keys exceeds {}", nargs, kMaxArgs);
    case Op::kWait:
      return nargs >= 1 && nargs <= kMaxArgs ? ""
                                             : fmt::format("wait of {} keys exceeds {}", nargs, kMaxArgs);
    default:
      return fmt::format("malformed header: unknown operation {}", code);
  }
  return nargs == want ? "" : fmt::format("malformed header: operation {} with {} arguments", code, nargs);
}

std::string checkRequestArg(uint16_t code, uint32_t i, uint32_t len) {
  const auto op = static_cast<Op>(code);
  if (isIntArg(op, i))
    return len == 8 ? "" : fmt::format("malformed request: integer argument of {} bytes", len);
  if (isValueArg(op, i))
    return len <= kStoreMaxValueBytes ? ""
                                      : fmt::format("value of {} bytes exceeds the store's limit of {} bytes",
                                                    len, kStoreMaxValueBytes);
  return len <= kStoreMaxKeyBytes
             ? ""
             : fmt::format("key of {} bytes exceeds the store's limit of {} bytes", len, kStoreMaxKeyBytes);
}

// The client's checks of a reply.
std::string checkReplyHeader(uint16_t code, uint32_t nargs) {
  if (code > static_cast<uint16_t>(Status::kError) || nargs > kMaxArgs)
    return fmt::format("malformed reply header (status {}, {} parts)", code, nargs);
  return "";
}
std::string checkReplyArg(uint16_t, uint32_t, uint32_t len) {
  return len <= kStoreMaxValueBytes ? "" : fmt::format("reply part of {} bytes is too large", len);
}

std::string authMessage(std::string_view first_nonce, std::string_view label, std::string_view second_nonce) {
  std::string m;
  m.reserve(first_nonce.size() + label.size() + second_nonce.size());
  m.append(first_nonce).append(label).append(second_nonce);
  return m;
}

}  // namespace

// ======================================================================================
// Server
// ======================================================================================

namespace {

// Server threads hold this (shared) while they work, and fork() takes it exclusively:
// a child forked while a server thread held an allocator lock (ASan's, found by
// scripts/sanitize.sh) or the log mutex would deadlock on its first use of it.
pthread_rwlock_t fork_gate = PTHREAD_RWLOCK_INITIALIZER;

void installForkGate() {
#if defined(__SANITIZE_THREAD__)
  return;  // TSan serializes fork itself and cannot follow the child's re-init of the gate
#endif
  static std::once_flag once;
  std::call_once(once, [] {
    ::pthread_atfork([] { ::pthread_rwlock_wrlock(&fork_gate); }, [] { ::pthread_rwlock_unlock(&fork_gate); },
                     // The child's thread is not the owner (glibc refuses that unlock), and
                     // no server thread exists there: start from a fresh gate.
                     [] { ::pthread_rwlock_init(&fork_gate, nullptr); });
  });
}

// Shared hold of the fork gate for one loop iteration of a server thread.
class GateReader {
 public:
  GateReader() { lock(); }
  ~GateReader() {
    if (held_) unlock();
  }
  void lock() {
    ::pthread_rwlock_rdlock(&fork_gate);
    held_ = true;
  }
  void unlock() {
    ::pthread_rwlock_unlock(&fork_gate);
    held_ = false;
  }

 private:
  bool held_ = false;
};

}  // namespace

struct TcpStoreServer::Impl {
  struct Parked {
    Op op;
    std::vector<std::string> keys;
    Clock::time_point deadline;
  };
  struct Conn {
    int fd = -1;
    std::string peer;
    // kHello -> (kAuth when the server has a secret) -> kReady.
    enum class State { kHello, kAuth, kReady } state = State::kHello;
    std::string nonce;  // the server's challenge (kAuth)
    Clock::time_point handshake_deadline = Clock::now() + kHandshakeTimeout;
    std::string in;
    std::string out;
    size_t out_off = 0;
    std::optional<Parked> parked;
    bool close_after_flush = false;
    bool dead = false;
    size_t pendingOut() const { return out.size() - out_off; }
  };

  std::string host;
  uint16_t port = 0;
  std::string secret;  // empty: no authentication
  int listen_fd = -1;
  int wake_fd = -1;
  pid_t owner_pid = 0;
  std::unique_ptr<std::thread> thread;
  std::atomic<bool> stopping{false};
  std::mutex stop_mu;
  Clock::time_point accept_paused_until{};

  std::unordered_map<std::string, std::string> data;
  std::vector<std::unique_ptr<Conn>> conns;
  std::vector<char> scratch = std::vector<char>(kReadChunk);

  std::string addr() const { return formatAddress(host, port); }

  void bindAndListen(uint16_t want_port) {
    AddrInfoList ai;
    if (int rc = resolve(host, want_port, true, ai); rc != 0)
      throw InvalidArgument(errorContext(-1, "store server") +
                            fmt::format("cannot resolve bind address '{}': {}. Pass a local host name or "
                                        "IP address (or an empty host for all interfaces)",
                                        host, gai_strerror(rc)));
    // For all interfaces, prefer the IPv6 wildcard (dual-stack) and fall back to IPv4.
    std::vector<addrinfo*> candidates;
    for (addrinfo* a = ai.head; a; a = a->ai_next) candidates.push_back(a);
    if (host.empty())
      std::stable_partition(candidates.begin(), candidates.end(),
                            [](addrinfo* a) { return a->ai_family == AF_INET6; });
    int last_errno = 0;
    for (addrinfo* a : candidates) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) {
        last_errno = errno;
        continue;
      }
      int one = 1, zero = 0;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      // Wildcard IPv6 also accepts IPv4 clients.
      if (a->ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
        listen_fd = fd;
        break;
      }
      last_errno = errno;
      ::close(fd);
    }
    if (listen_fd < 0)
      throwSystemError(-1, fmt::format("store server bind {}", formatAddress(host, want_port)), last_errno,
                       last_errno == EADDRINUSE
                           ? "Another process (perhaps a previous store) uses this port; pick another "
                             "port (MASTER_PORT) or stop that process"
                           : "Check the bind address");
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len);
    port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  }

  void stop() {
    std::lock_guard<std::mutex> lock(stop_mu);
    if (thread) {
      if (getpid() == owner_pid) {
        stopping = true;
        uint64_t one = 1;
        [[maybe_unused]] ssize_t n = ::write(wake_fd, &one, sizeof(one));
        thread->join();
        thread.reset();
      } else {
        // A forked child holds a copy of the object but not the thread: just drop it.
        (void)thread.release();
      }
    }
    for (auto& c : conns)
      if (c->fd >= 0) ::close(c->fd);
    conns.clear();
    if (listen_fd >= 0) ::close(listen_fd);
    if (wake_fd >= 0) ::close(wake_fd);
    listen_fd = wake_fd = -1;
  }

  // ---- event loop ----
  void run() {
    std::vector<pollfd> pfds;
    while (!stopping.load()) {
      GateReader gate;  // released only while polling
      pfds.clear();
      pfds.push_back({wake_fd, POLLIN, 0});
      const bool accepting = Clock::now() >= accept_paused_until;
      pfds.push_back({accepting ? listen_fd : -1, POLLIN, 0});
      for (auto& c : conns) {
        short ev = POLLRDHUP;
        if (!c->parked && !c->close_after_flush && c->pendingOut() < kOutHighWater) ev |= POLLIN;
        if (c->pendingOut()) ev |= POLLOUT;
        pfds.push_back({c->fd, ev, 0});
      }
      const int timeout_ms = pollTimeout(accepting);
      gate.unlock();
      int rc = ::poll(pfds.data(), pfds.size(), timeout_ms);
      gate.lock();
      if (rc < 0) {
        if (errno == EINTR) continue;
        CB_WARN("store", "store server {}: poll failed: {}", addr(), std::strerror(errno));
        std::this_thread::sleep_for(Millis(10));
        continue;
      }
      if (pfds[0].revents) {
        uint64_t v;
        [[maybe_unused]] ssize_t n = ::read(wake_fd, &v, sizeof(v));
      }
      const size_t known = conns.size();  // accept() below appends
      for (size_t i = 0; i < known; ++i) {
        Conn& c = *conns[i];
        const short re = pfds[i + 2].revents;
        if (!re) continue;
        if (re & POLLIN)
          readFrom(c);
        else if (re & (POLLHUP | POLLERR | POLLRDHUP))
          c.dead = true;  // gone while parked
      }
      if (pfds[1].revents) acceptAll();
      expireParked();
      // Handling one client's request may unpark others; loop until nothing moves.
      for (bool progress = true; progress;) {
        progress = false;
        for (auto& c : conns) progress |= process(*c);
      }
      for (auto& c : conns) {
        if (c->pendingOut()) flush(*c);
        if (c->close_after_flush && !c->pendingOut()) c->dead = true;
      }
      reap();
    }
  }

  int pollTimeout(bool accepting) {
    std::optional<Clock::time_point> next;
    for (auto& c : conns) {
      if (c->parked && (!next || c->parked->deadline < *next)) next = c->parked->deadline;
      if (c->state != Conn::State::kReady && (!next || c->handshake_deadline < *next))
        next = c->handshake_deadline;
    }
    if (!accepting && (!next || accept_paused_until < *next)) next = accept_paused_until;
    return next ? pollTimeoutMs(*next) : -1;
  }

  void acceptAll() {
    for (;;) {
      int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          CB_WARN("store",
                  "store server {}: cannot accept more clients: {}; raise the open file "
                  "limit (ulimit -n)",
                  addr(), std::strerror(errno));
          accept_paused_until = Clock::now() + Millis(100);
        }
        return;
      }
      setNoDelay(fd);
      auto c = std::make_unique<Conn>();
      c->fd = fd;
      c->peer = peerName(fd);
      CB_TRACE("store", "store server {}: client {} connected", addr(), c->peer);
      conns.push_back(std::move(c));
    }
  }

  void readFrom(Conn& c) {
    size_t got = 0;
    // Bounded per round so one fast writer cannot starve the others.
    while (got < (4u << 20) && !c.dead) {
      ssize_t n = ::recv(c.fd, scratch.data(), scratch.size(), 0);
      if (n > 0) {
        c.in.append(scratch.data(), n);
        got += n;
        continue;
      }
      if (n < 0 && (errno == EINTR)) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      c.dead = true;  // EOF or reset: the client is gone
    }
  }

  void flush(Conn& c) {
    while (c.pendingOut() && !c.dead) {
      ssize_t n = ::send(c.fd, c.out.data() + c.out_off, c.pendingOut(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out_off += n;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      c.dead = true;
    }
    if (c.out_off == c.out.size()) {
      c.out.clear();
      c.out_off = 0;
    }
  }

  void reap() {
    for (auto& c : conns) {
      if (!c->dead) continue;
      CB_TRACE("store", "store server {}: client {} disconnected", addr(), c->peer);
      ::close(c->fd);
      c.reset();
    }
    std::erase(conns, nullptr);
  }

  void send(Conn& c, std::string frame) {
    if (c.pendingOut() == 0) {
      c.out = std::move(frame);  // big replies: no second copy
      c.out_off = 0;
    } else {
      c.out += frame;
    }
  }

  void reject(Conn& c, const std::string& why) {
    CB_WARN("store", "store server {}: closing the connection from {}: {}", addr(), c.peer, why);
    FrameBuilder f(static_cast<uint16_t>(Status::kError), static_cast<uint16_t>(ErrorCode::kInvalidArgument));
    f.arg(fmt::format("the store server at {} rejected the request: {}", addr(), why));
    send(c, f.data());
    c.close_after_flush = true;
  }

  // Returns whether a message was handled.
  bool process(Conn& c) {
    bool handled = false;
    while (!c.dead && !c.close_after_flush && !c.parked && c.pendingOut() < kOutHighWater) {
      if (c.state == Conn::State::kHello) {
        if (c.in.size() >= 4 && getU32(c.in.data()) != kMagic) {
          CB_WARN("store",
                  "store server {}: connection from {} is not a crossbar store client (bad "
                  "handshake); closed",
                  addr(), c.peer);
          c.dead = true;
          break;
        }
        if (c.in.size() < kHelloBytes) break;
        const uint16_t version = getU16(c.in.data() + 4);
        c.in.erase(0, kHelloBytes);
        std::string reply;
        putU32(reply, kMagic);
        putU16(reply, kProtocolVersion);
        putU16(reply, version == kProtocolVersion ? kHelloOk : kHelloBadVersion);
        handled = true;
        if (version != kProtocolVersion) {
          send(c, reply);
          CB_WARN("store",
                  "store server {}: client {} speaks store protocol version {}, this server "
                  "speaks {}; closed",
                  addr(), c.peer, version, kProtocolVersion);
          c.close_after_flush = true;
          break;
        }
        if (secret.empty()) {
          send(c, reply);
          c.state = Conn::State::kReady;
          continue;
        }
        reply[6] = static_cast<char>(kHelloAuth);  // status, little-endian u16
        c.nonce = auth::randomBytes(kNonceBytes);
        reply += c.nonce;
        send(c, reply);
        c.state = Conn::State::kAuth;
        continue;
      }
      if (c.state == Conn::State::kAuth) {
        if (c.in.size() < kNonceBytes + kMacBytes) break;
        const std::string client_nonce = c.in.substr(0, kNonceBytes);
        const auth::Digest want = auth::hmacSha256(secret, authMessage(c.nonce, kClientLabel, client_nonce));
        const bool ok = auth::constantTimeEqual(want.data(), c.in.data() + kNonceBytes, kMacBytes);
        c.in.erase(0, kNonceBytes + kMacBytes);
        handled = true;
        std::string reply;
        putU16(reply, ok ? kAuthOk : kAuthRejected);
        putU16(reply, 0);
        if (!ok) {
          send(c, reply);
          CB_WARN("store",
                  "store server {}: client {} failed authentication (wrong CROSSBAR_SECRET?); closed", addr(),
                  c.peer);
          c.close_after_flush = true;
          break;
        }
        const auth::Digest proof = auth::hmacSha256(secret, authMessage(client_nonce, kServerLabel, c.nonce));
        reply.append(reinterpret_cast<const char*>(proof.data()), proof.size());
        send(c, reply);
        c.state = Conn::State::kReady;
        continue;
      }
      Frame f;
      size_t used = 0;
      std::string error;
      Parse r = parseFrame(c.in.data(), c.in.size(), f, used, error, checkRequestHeader, checkRequestArg);
      if (r == Parse::kIncomplete) {
        if (used > c.in.capacity()) c.in.reserve(used);
        break;
      }
      if (r == Parse::kReject) {
        reject(c, error);
        break;
      }
      c.in.erase(0, used);
      handle(c, f);
      handled = true;
    }
    return handled;
  }

  void replyOk(Conn& c, std::initializer_list<std::string_view> args = {}) {
    FrameBuilder f(static_cast<uint16_t>(Status::kOk));
    size_t bytes = 0;
    for (auto& a : args) bytes += 4 + a.size();
    f.reserve(bytes);
    for (auto& a : args) f.arg(a.data(), a.size());
    send(c, f.take());
  }

  bool allExist(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data.count(k) > 0; });
  }

  void park(Conn& c, Op op, std::vector<std::string> keys, int64_t timeout_ms) {
    timeout_ms = std::clamp<int64_t>(timeout_ms, 0, 86'400'000);
    c.parked = Parked{op, std::move(keys), Clock::now() + Millis(timeout_ms)};
  }

  void answerParked(Conn& c) {
    if (c.parked->op == Op::kGet)
      replyOk(c, {data.at(c.parked->keys[0])});
    else
      replyOk(c);
    c.parked.reset();
  }

  // A key appeared: answer the parked requests it completes.
  void keySet(const std::string& key) {
    for (auto& c : conns) {
      if (!c->parked || c->dead) continue;
      auto& keys = c->parked->keys;
      if (std::find(keys.begin(), keys.end(), key) != keys.end() && allExist(keys)) answerParked(*c);
    }
  }

  void expireParked() {
    const auto now = Clock::now();
    for (auto& c : conns) {
      if (c->state != Conn::State::kReady && !c->dead && c->handshake_deadline <= now) {
        CB_WARN("store", "store server {}: client {} did not complete the handshake in {} ms; closed", addr(),
                c->peer, kHandshakeTimeout.count());
        c->dead = true;
        continue;
      }
      if (!c->parked || c->dead || c->parked->deadline > now) continue;
      FrameBuilder f(static_cast<uint16_t>(Status::kTimeout));
      for (auto& k : c->parked->keys)
        if (!data.count(k)) f.arg(k);
      send(*c, f.data());
      c->parked.reset();
    }
  }

  void handle(Conn& c, Frame& f) {
    auto& a = f.args;
    switch (static_cast<Op>(f.code)) {
      case Op::kSet: {
        data[a[0]] = std::move(a[1]);
        replyOk(c);
        keySet(a[0]);
        break;
      }
      case Op::kGet: {
        auto it = data.find(a[0]);
        if (it != data.end())
          replyOk(c, {it->second});
        else
          park(c, Op::kGet, {a[0]}, static_cast<int64_t>(getU64(a[1].data())));
        break;
      }
      case Op::kAdd: {
        const int64_t delta = static_cast<int64_t>(getU64(a[1].data()));
        int64_t value = 0;
        auto it = data.find(a[0]);
        if (it != data.end()) {
          const std::string& text = it->second;
          char* end = nullptr;
          errno = 0;
          long long parsed = std::strtoll(text.c_str(), &end, 10);
          if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE) {
            replyError(c, ErrorCode::kInvalidArgument,
                       fmt::format("add('{}'): the key holds '{}', not a decimal integer; use add() only on "
                                   "counters",
                                   printableKey(a[0]), printableKey(text)));
            break;
          }
          value = parsed;
        }
        if (__builtin_add_overflow(value, delta, &value)) {
          replyError(c, ErrorCode::kInvalidArgument,
                     fmt::format("add('{}', {}): the counter would overflow int64", printableKey(a[0]), delta));
          break;
        }
        data[a[0]] = std::to_string(value);
        std::string out;
        putU64(out, static_cast<uint64_t>(value));
        replyOk(c, {out});
        keySet(a[0]);
        break;
      }
      case Op::kCompareSet: {
        auto it = data.find(a[0]);
        const bool matches = it == data.end() ? a[1].empty() : it->second == a[1];
        if (matches) {
          data[a[0]] = a[2];
          replyOk(c, {a[2]});
          keySet(a[0]);
        } else {
          replyOk(c, {it == data.end() ? std::string() : it->second});
        }
        break;
      }
      case Op::kCheck:
        replyOk(c, {std::string(1, allExist(a) ? 1 : 0)});
        break;
      case Op::kWait: {
        const auto timeout_ms = static_cast<int64_t>(getU64(a[0].data()));
        a.erase(a.begin());
        if (allExist(a))
          replyOk(c);
        else
          park(c, Op::kWait, std::move(a), timeout_ms);
        break;
      }
      case Op::kDelete:
        replyOk(c, {std::string(1, data.erase(a[0]) ? 1 : 0)});
        break;
      case Op::kNumKeys: {
        std::string out;
        putU64(out, data.size());
        replyOk(c, {out});
        break;
      }
    }
  }

  void replyError(Conn& c, ErrorCode code, const std::string& message) {
    FrameBuilder f(static_cast<uint16_t>(Status::kError), static_cast<uint16_t>(code));
    f.arg(message);
    send(c, f.data());
  }
};

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port, std::optional<std::string> secret)
    : impl_(std::make_unique<Impl>()) {
  impl_->host = host;
  impl_->secret = secret ? std::move(*secret) : auth::loadSecret();
  impl_->bindAndListen(port);
  impl_->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl_->wake_fd < 0) {
    int err = errno;
    impl_->stop();
    throwSystemError(-1, "store server eventfd", err);
  }
  impl_->owner_pid = getpid();
  installForkGate();
  // Return only once the thread runs: its start-up (the sanitizers' per-thread setup
  // allocates) is not covered by the fork gate, and callers fork right after this.
  std::promise<void> started;
  auto running = started.get_future();
  impl_->thread = std::make_unique<std::thread>([impl = impl_.get(), &started] {
    started.set_value();
    impl->run();
  });
  running.wait();
  CB_INFO("store", "store server listening on {}{}", impl_->addr(),
          impl_->secret.empty() ? " (no authentication: CROSSBAR_SECRET unset)" : " (authenticated)");
}

TcpStoreServer::~TcpStoreServer() {
  impl_->stop();
}
uint16_t TcpStoreServer::port() const {
  return impl_->port;
}
void TcpStoreServer::stop() {
  impl_->stop();
}

std::string TcpStoreServer::serveBytesForTesting(std::string_view input, const std::string& secret,
                                                 size_t chunk, bool* closed) {
  Impl impl;  // never listens: no socket, no thread
  impl.secret = secret;
  impl.conns.push_back(std::make_unique<Impl::Conn>());
  Impl::Conn& c = *impl.conns.back();
  c.peer = "test input";
  std::string sent;
  chunk = std::max<size_t>(chunk, 1);
  for (size_t off = 0; off < input.size() && !c.dead && !c.close_after_flush; off += chunk) {
    c.in.append(input.substr(off, chunk));
    for (bool progress = true; progress && !c.dead;) {
      progress = impl.process(c);
      sent.append(c.out, c.out_off);  // the peer reads everything at once
      c.out.clear();
      c.out_off = 0;
    }
  }
  if (closed) *closed = c.dead || c.close_after_flush;
  return sent;
}

size_t TcpStoreServer::decodeRepliesForTesting(std::string_view input, std::string& error) {
  size_t count = 0, off = 0;
  for (;;) {
    Frame f;
    size_t used = 0;
    Parse r =
        parseFrame(input.data() + off, input.size() - off, f, used, error, checkReplyHeader, checkReplyArg);
    if (r != Parse::kDone) return count;
    off += used;
    ++count;
  }
}

// ======================================================================================
// Client
// ======================================================================================

namespace {

// Internal signals of the client's I/O; turned into typed errors by call().
struct ConnectionLost {
  int err;  // 0: the server closed the connection
};
struct ReplyTimeout {};

}  // namespace

namespace {
// One connection to the server. Its requests go one at a time: a blocking get or wait
// holds it until the server answers.
struct StoreConn {
  int fd = -1;
  std::string in;  // bytes received and not yet parsed
  StoreConn() = default;
  StoreConn(const StoreConn&) = delete;
  StoreConn& operator=(const StoreConn&) = delete;
  ~StoreConn() { close(); }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
    in.clear();
  }
};
}  // namespace

struct TcpStore::Impl {
  // Connections: one per thread that uses the store at the same time, so one thread's
  // blocking get never holds up another's request (threads on several communicators
  // splitting at once waited on each other across processes, each one's request queued
  // behind another one's get: seconds of stall, docs/reliability.md). Gets and waits
  // (parked by the server until their keys are set) share at most kMaxConnections; a
  // request that the server answers at once never waits for one (the sets a parked get
  // waits for must not queue behind it), and a connection released beyond the limit closes.
  static constexpr int kMaxConnections = 16;

  TcpStoreOptions options;
  std::string secret;  // empty: no authentication
  std::unique_ptr<TcpStoreServer> server;
  std::string host;  // where the client connects
  uint16_t port = 0;
  std::string addr;
  std::mutex mu;  // guards the pool below
  std::condition_variable idle_cv;
  std::vector<std::unique_ptr<StoreConn>> idle;  // connected, not in use (most recent last)
  int open = 0;                                  // connections of this process, idle or in use
  pid_t pid = 0;                                 // the process the pool belongs to

  std::string context(std::string_view op) const { return errorContext(-1, fmt::format("store {}", op)); }

  // A connection for one request: an idle one, else a new (unconnected) one, else (a
  // parked request at kMaxConnections) the next one released. Back with release().
  std::unique_ptr<StoreConn> acquire(std::string_view op, Deadline deadline, bool parks) {
    std::unique_lock<std::mutex> lock(mu);
    if (pid != getpid()) {  // a forked child needs its own connections
      idle.clear();
      open = 0;
      pid = getpid();
    }
    while (parks && idle.empty() && open >= kMaxConnections) {
      if (deadline.expired())
        throw Timeout(fmt::format("{}all {} connections to the store at {} stayed busy until the deadline",
                                  context(op), kMaxConnections, addr));
      idle_cv.wait_for(lock, std::min<Millis>(deadline.remaining(), Millis(100)));
    }
    if (!idle.empty()) {
      std::unique_ptr<StoreConn> c = std::move(idle.back());
      idle.pop_back();
      return c;
    }
    ++open;
    return std::make_unique<StoreConn>();
  }

  // Returns `c` to the pool (a closed one is dropped).
  void release(std::unique_ptr<StoreConn> c) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (pid != getpid()) return;  // leased before a fork: not this process's
      if (c->fd >= 0 && open <= kMaxConnections)
        idle.push_back(std::move(c));
      else
        --open;
    }
    idle_cv.notify_one();
  }

  // Holds a leased connection for the length of one request.
  struct Lease {
    Impl& impl;
    std::unique_ptr<StoreConn> c;
    Lease(Impl& i, std::string_view op, Deadline deadline, bool parks)
        : impl(i), c(i.acquire(op, deadline, parks)) {}
    ~Lease() { impl.release(std::move(c)); }
    StoreConn* operator->() const { return c.get(); }
    StoreConn& operator*() const { return *c; }
  };

  void sendAll(StoreConn& c, const std::string& buf, Deadline deadline) {
    size_t off = 0;
    while (off < buf.size()) {
      ssize_t n = ::send(c.fd, buf.data() + off, buf.size() - off, MSG_NOSIGNAL);
      if (n > 0) {
        off += n;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        pollfd p{c.fd, POLLOUT, 0};
        int rc = ::poll(&p, 1, pollTimeoutMs(deadline.at()));
        if (rc == 0 && deadline.expired()) throw ReplyTimeout{};
        continue;
      }
      throw ConnectionLost{errno};
    }
  }

  // Reads more bytes into `c.in`, waiting until `deadline`.
  void recvSome(StoreConn& c, Deadline deadline) {
    for (;;) {
      char buf[kReadChunk];
      ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
      if (n > 0) {
        c.in.append(buf, n);
        return;
      }
      if (n == 0) throw ConnectionLost{0};
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) throw ConnectionLost{errno};
      if (deadline.expired()) throw ReplyTimeout{};
      pollfd p{c.fd, POLLIN, 0};
      ::poll(&p, 1, pollTimeoutMs(deadline.at()));
    }
  }

  Frame recvFrame(StoreConn& c, Deadline deadline) {
    for (;;) {
      Frame f;
      size_t used = 0;
      std::string error;
      Parse r = parseFrame(c.in.data(), c.in.size(), f, used, error, checkReplyHeader, checkReplyArg);
      if (r == Parse::kDone) {
        c.in.erase(0, used);
        return f;
      }
      if (r == Parse::kIncomplete && used > c.in.capacity()) c.in.reserve(used);
      if (r == Parse::kReject) {
        c.close();
        throw SystemError(
            fmt::format("{}the store at {} sent a {}; is it a crossbar store of the same version?",
                        context("reply"), addr, error));
      }
      recvSome(c, deadline);
    }
  }

  // One connection attempt to one address, handshake included: true with `c` connected,
  // or false with `err` set when worth retrying; throws when retrying cannot help.
  bool tryConnect(StoreConn& c, const addrinfo* a, Deadline deadline, int& err) {
    c.close();
    int s = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (s < 0) {
      err = errno;
      return false;
    }
    if (::connect(s, a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        err = errno;
        ::close(s);
        return false;
      }
      pollfd p{s, POLLOUT, 0};
      int rc = ::poll(&p, 1, pollTimeoutMs(deadline.at()));
      int so_error = 0;
      socklen_t len = sizeof(so_error);
      if (rc <= 0)
        so_error = ETIMEDOUT;
      else
        ::getsockopt(s, SOL_SOCKET, SO_ERROR, &so_error, &len);
      if (so_error != 0) {
        err = so_error;
        ::close(s);
        return false;
      }
    }
    setNoDelay(s);
    c.fd = s;
    try {
      std::string hello;
      putU32(hello, kMagic);
      putU16(hello, kProtocolVersion);
      putU16(hello, secret.empty() ? 0 : kHelloFlagSecret);
      sendAll(c, hello, deadline);
      while (c.in.size() < kHelloBytes) recvSome(c, deadline);
      if (getU32(c.in.data()) == kMagic && getU16(c.in.data() + 6) == kHelloAuth) {
        while (c.in.size() < kHelloBytes + kNonceBytes) recvSome(c, deadline);
        if (secret.empty()) {
          c.close();
          throw InvalidUsage(
              fmt::format("{}the store at {} requires authentication: set CROSSBAR_SECRET (or "
                          "CROSSBAR_SECRET_FILE) to the job's secret on this rank too",
                          context("connect"), addr));
        }
        authenticate(c, c.in.substr(kHelloBytes, kNonceBytes), deadline);
        c.in.erase(kHelloBytes, kNonceBytes);
      }
    } catch (const ConnectionLost& e) {
      err = e.err ? e.err : ECONNRESET;
      c.close();
      return false;
    } catch (const ReplyTimeout&) {
      err = ETIMEDOUT;
      c.close();
      return false;
    }
    const uint32_t magic = getU32(c.in.data());
    const uint16_t version = getU16(c.in.data() + 4), status = getU16(c.in.data() + 6);
    c.in.erase(0, kHelloBytes);
    if (magic != kMagic) {
      c.close();
      throw SystemError(
          fmt::format("{}the service at {} is not a crossbar store (bad handshake); check the "
                      "store address (MASTER_ADDR/MASTER_PORT or CROSSBAR_STORE_ADDR)",
                      context("connect"), addr));
    }
    if (status == kHelloOk && !secret.empty()) {
      // We could not tell this server from an impostor: refuse rather than leak keys to it.
      c.close();
      throw InvalidUsage(
          fmt::format("{}CROSSBAR_SECRET (or CROSSBAR_SECRET_FILE) is set here, but the store at {} does "
                      "not authenticate: set the same secret where the store runs (rank 0 or "
                      "crossbar-store), or unset it on every rank",
                      context("connect"), addr));
    }
    if (status != kHelloOk && status != kHelloAuth) {
      c.close();
      throw InvalidUsage(
          fmt::format("{}the store at {} speaks store protocol version {}, this client speaks {}; "
                      "run the same crossbar version everywhere",
                      context("connect"), addr, version, kProtocolVersion));
    }
    return true;
  }

  // Answers the server's challenge and checks its proof. Throws InvalidUsage when
  // either side's secret is wrong (retrying cannot help); I/O errors propagate.
  void authenticate(StoreConn& c, const std::string& server_nonce, Deadline deadline) {
    const std::string client_nonce = auth::randomBytes(kNonceBytes);
    const auth::Digest mac = auth::hmacSha256(secret, authMessage(server_nonce, kClientLabel, client_nonce));
    std::string answer = client_nonce;
    answer.append(reinterpret_cast<const char*>(mac.data()), mac.size());
    sendAll(c, answer, deadline);
    const size_t at = kHelloBytes + kNonceBytes;  // `in` still holds hello and nonce
    while (c.in.size() < at + 4) recvSome(c, deadline);
    if (getU16(c.in.data() + at) != kAuthOk) {
      c.close();
      throw InvalidUsage(
          fmt::format("{}the store at {} rejected our credentials: CROSSBAR_SECRET differs "
                      "between ranks? Give every rank and the store the same secret",
                      context("connect"), addr));
    }
    while (c.in.size() < at + 4 + kMacBytes) recvSome(c, deadline);
    const auth::Digest want = auth::hmacSha256(secret, authMessage(client_nonce, kServerLabel, server_nonce));
    if (!auth::constantTimeEqual(want.data(), c.in.data() + at + 4, kMacBytes)) {
      c.close();
      throw InvalidUsage(
          fmt::format("{}the store at {} could not prove it knows CROSSBAR_SECRET: the "
                      "secret differs between ranks, or something else answers at that "
                      "address",
                      context("connect"), addr));
    }
    c.in.erase(at, 4 + kMacBytes);
  }

  // Connects `c` with retry until `window` passes (the server may start later).
  // Returns false with `last_error` when it could not.
  bool connectWithin(StoreConn& c, Millis window, std::string& last_error) {
    const Deadline deadline = Deadline::after(window);
    Millis backoff(10);
    for (;;) {
      AddrInfoList ai;
      if (int rc = resolve(host, port, false, ai); rc != 0) {
        last_error = fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc));
      } else {
        for (addrinfo* a = ai.head; a; a = a->ai_next) {
          int err = 0;
          if (tryConnect(c, a, deadline.min(Deadline::after(Millis(5000))), err)) return true;
          last_error = std::strerror(err);
        }
      }
      if (deadline.expired()) return false;
      std::this_thread::sleep_for(std::min(backoff, deadline.remaining()));
      backoff = std::min(backoff * 2, Millis(500));
    }
  }

  [[noreturn]] void throwLost(std::string_view op, const std::string& why) {
    throw SystemError(
        fmt::format("{}lost connection to the store at {} ({}); is the store (rank 0 or "
                    "crossbar-store) still running? If rank 0 serves it, rank 0 probably "
                    "exited or crashed: check its log",
                    context(op), addr, why));
  }

  // The server closes idle connections only when it goes away; notice before sending.
  static bool idleConnectionBroken(const StoreConn& c) {
    pollfd p{c.fd, POLLIN | POLLRDHUP, 0};
    return ::poll(&p, 1, 0) > 0;
  }

  // Sends a request on a connection of the pool and returns the reply; reconnects on a
  // broken connection and, for idempotent requests, retries once after a failure
  // mid-request. `parks`: a get or wait, which the server answers when its keys are set.
  Frame call(std::string_view op, const std::string& request, Deadline reply_deadline, bool idempotent,
             bool parks = false) {
    Lease c(*this, op, reply_deadline, parks);
    for (int attempt = 0;; ++attempt) {
      if (c->fd >= 0 && idleConnectionBroken(*c)) c->close();
      if (c->fd < 0) {
        std::string why;
        if (!connectWithin(*c, std::min(options.connect_timeout, kReconnectWindow), why)) throwLost(op, why);
      }
      try {
        sendAll(*c, request, reply_deadline);
        Frame reply = recvFrame(*c, reply_deadline);
        if (reply.code == static_cast<uint16_t>(Status::kError)) {
          std::string msg =
              context(op) + (reply.args.empty() ? "the store reported an error" : reply.args[0]);
          if (reply.aux == static_cast<uint16_t>(ErrorCode::kInvalidUsage)) throw InvalidUsage(msg);
          throw InvalidArgument(msg);
        }
        return reply;
      } catch (const ConnectionLost& e) {
        c->close();
        const std::string why = e.err ? std::strerror(e.err) : "the server closed the connection";
        if (!idempotent || attempt >= 1) throwLost(op, why);
        CB_WARN("store", "store {}: connection to {} broke ({}); reconnecting and retrying once", op, addr,
                why);
      } catch (const ReplyTimeout&) {
        c->close();  // a late reply would desynchronize the stream
        throw Timeout(
            fmt::format("{}no reply from the store at {} in time; the store may be overloaded or hung",
                        context(op), addr));
      }
    }
  }

  static void checkKey(std::string_view op, const std::string& key) {
    checkStoreKey(errorContext(-1, fmt::format("store {}", op)), key);
  }
  static void checkValue(std::string_view op, const std::string& key, size_t size) {
    checkStoreValue(errorContext(-1, fmt::format("store {}", op)), key, size);
  }
  static void checkKeys(std::string_view op, const std::vector<std::string>& keys) {
    if (keys.size() >= kMaxArgs)
      throw InvalidArgument(errorContext(-1, fmt::format("store {}", op)) +
                            fmt::format("{} keys in one call, the limit is {}", keys.size(), kMaxArgs - 1));
    for (auto& k : keys) checkKey(op, k);
  }

  static Deadline shortDeadline() { return Deadline::after(defaultTimeout()); }
};

TcpStore::TcpStore(const TcpStoreOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->options = options;
  impl_->secret = options.secret ? *options.secret : auth::loadSecret();
  impl_->host = options.host;
  impl_->port = options.port;
  if (options.is_server) {
    impl_->server = std::make_unique<TcpStoreServer>(options.host, options.port, impl_->secret);
    impl_->port = impl_->server->port();
    // A wildcard bind address is not a destination; reach our own server on loopback.
    if (options.host.empty() || options.host == "0.0.0.0")
      impl_->host = "127.0.0.1";
    else if (options.host == "::")
      impl_->host = "::1";
  }
  impl_->addr = formatAddress(impl_->host, impl_->port);
  if (impl_->port == 0)
    throw InvalidArgument(errorContext(-1, "store connect") +
                          "port 0 names no store; give the store's port (or is_server=true to serve one)");
  std::string why;
  // The first connection, kept in the pool: the store must be there before anything runs.
  Impl::Lease first(*impl_, "connect", Deadline::never(), false);
  if (!impl_->connectWithin(*first, options.connect_timeout, why))
    throw Timeout(
        fmt::format("{}could not connect to the store at {} within {} ms (last error: {}). Is the "
                    "store (rank 0 or crossbar-store) running and reachable from this host? Check "
                    "MASTER_ADDR/MASTER_PORT or CROSSBAR_STORE_ADDR, and firewalls",
                    impl_->context("connect"), impl_->addr, options.connect_timeout.count(), why));
}

TcpStore::~TcpStore() = default;

uint16_t TcpStore::port() const {
  return impl_->port;
}

void TcpStore::set(const std::string& key, const Bytes& value) {
  Impl::checkKey("set", key);
  Impl::checkValue("set", key, value.size());
  FrameBuilder f(static_cast<uint16_t>(Op::kSet));
  f.reserve(8 + key.size() + value.size()).arg(key).arg(value);
  impl_->call("set", f.data(), Impl::shortDeadline(), true);
}

Bytes TcpStore::get(const std::string& key, Deadline deadline) {
  Impl::checkKey("get", key);
  const Millis timeout = deadline.remaining();
  FrameBuilder f(static_cast<uint16_t>(Op::kGet));
  f.arg(key).argInt(timeout.count());
  Frame reply = impl_->call("get", f.data(), Deadline::after(timeout + kReplyGrace), true, true);
  if (reply.code == static_cast<uint16_t>(Status::kTimeout))
    throw Timeout(
        fmt::format("{}key '{}' was not set within {} ms on the store at {}. Check that the rank "
                    "that sets it is alive and uses the same store and key prefix; raise "
                    "CROSSBAR_TIMEOUT if it is only slow",
                    impl_->context("get"), printableKey(key), timeout.count(), impl_->addr));
  if (reply.args.size() != 1) throw InternalError(impl_->context("get") + "malformed reply");
  return toBytes(reply.args[0]);
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  Impl::checkKey("add", key);
  FrameBuilder f(static_cast<uint16_t>(Op::kAdd));
  f.arg(key).argInt(delta);
  Frame reply = impl_->call("add", f.data(), Impl::shortDeadline(), false);
  if (reply.args.size() != 1 || reply.args[0].size() != 8)
    throw InternalError(impl_->context("add") + "malformed reply");
  return static_cast<int64_t>(getU64(reply.args[0].data()));
}

Bytes TcpStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  Impl::checkKey("compareSet", key);
  Impl::checkValue("compareSet", key, expected.size());
  Impl::checkValue("compareSet", key, desired.size());
  FrameBuilder f(static_cast<uint16_t>(Op::kCompareSet));
  f.reserve(12 + key.size() + expected.size() + desired.size()).arg(key).arg(expected).arg(desired);
  Frame reply = impl_->call("compareSet", f.data(), Impl::shortDeadline(), false);
  if (reply.args.size() != 1) throw InternalError(impl_->context("compareSet") + "malformed reply");
  return toBytes(reply.args[0]);
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  Impl::checkKeys("check", keys);
  FrameBuilder f(static_cast<uint16_t>(Op::kCheck));
  for (auto& k : keys) f.arg(k);
  Frame reply = impl_->call("check", f.data(), Impl::shortDeadline(), true);
  if (reply.args.size() != 1 || reply.args[0].size() != 1)
    throw InternalError(impl_->context("check") + "malformed reply");
  return reply.args[0][0] != 0;
}

void TcpStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  Impl::checkKeys("wait", keys);
  const Millis timeout = deadline.remaining();
  FrameBuilder f(static_cast<uint16_t>(Op::kWait));
  f.argInt(timeout.count());
  for (auto& k : keys) f.arg(k);
  Frame reply = impl_->call("wait", f.data(), Deadline::after(timeout + kReplyGrace), true, true);
  if (reply.code == static_cast<uint16_t>(Status::kTimeout))
    throw Timeout(
        fmt::format("{}{} of {} keys not set within {} ms on the store at {}: missing {}. Check that "
                    "the ranks that set them are alive and use the same store and key prefix; raise "
                    "CROSSBAR_TIMEOUT if they are only slow",
                    impl_->context("wait"), reply.args.size(), keys.size(), timeout.count(), impl_->addr,
                    keyList(reply.args)));
}

bool TcpStore::deleteKey(const std::string& key) {
  Impl::checkKey("deleteKey", key);
  FrameBuilder f(static_cast<uint16_t>(Op::kDelete));
  f.arg(key);
  Frame reply = impl_->call("deleteKey", f.data(), Impl::shortDeadline(), false);
  if (reply.args.size() != 1 || reply.args[0].size() != 1)
    throw InternalError(impl_->context("deleteKey") + "malformed reply");
  return reply.args[0][0] != 0;
}

int64_t TcpStore::numKeys() {
  FrameBuilder f(static_cast<uint16_t>(Op::kNumKeys));
  Frame reply = impl_->call("numKeys", f.data(), Impl::shortDeadline(), true);
  if (reply.args.size() != 1 || reply.args[0].size() != 8)
    throw InternalError(impl_->context("numKeys") + "malformed reply");
  return static_cast<int64_t>(getU64(reply.args[0].data()));
}

}  // namespace crossbar
