#include "comm/fd_exchange.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "comm/errors.h"
#include "comm/interrupt.h"
#include "comm/log.h"
#include "comm/store.h"

namespace crossbar {

namespace {

constexpr size_t kMaxFds = 16;
constexpr size_t kMaxMessage = 64 * 1024;

// Builds an abstract sockaddr (sun_path[0] == '\0'); returns its length.
socklen_t abstractAddr(const std::string& name, sockaddr_un& addr) {
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  size_t n = std::min(name.size(), sizeof(addr.sun_path) - 1);
  std::memcpy(addr.sun_path + 1, name.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

int newSocket(int rank, const char* what) {
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throwSystemError(rank, what, errno);
  return fd;
}

int timeoutMs(Deadline deadline) {
  auto ms = deadline.remaining().count();
  return static_cast<int>(std::min<int64_t>(ms, 60'000));
}

}  // namespace

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

int pollOne(int fd, short events, Deadline deadline, std::string_view step) {
  while (true) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, interruptSliceMs(timeoutMs(deadline)));
    if (r > 0) return p.revents;
    if (r < 0 && errno != EINTR) return POLLERR;
    if (deadline.expired()) return 0;
    interruptionPoint(step);
  }
}

std::string jobNonce(Store& store, const std::string& key) {
  std::random_device rd;
  uint64_t a = (uint64_t{rd()} << 32) ^ rd();
  uint64_t b = static_cast<uint64_t>(Clock::now().time_since_epoch().count()) ^
               (uint64_t{static_cast<uint32_t>(getpid())} << 40);
  std::string mine = fmt::format("{:016x}{:08x}", a, static_cast<uint32_t>(b ^ (b >> 32)));
  Bytes got = store.compareSet(key, Bytes{}, toBytes(mine));
  return toString(got);
}

std::string socketName(const std::string& nonce, const std::string& purpose, int rank) {
  return fmt::format("crossbar-{}-{}-{}", nonce, purpose, rank);
}

UnixListener::UnixListener(const std::string& name, int rank) : name_(name), rank_(rank) {
  fd_.reset(newSocket(rank, "creating a Unix socket"));
  sockaddr_un addr;
  socklen_t len = abstractAddr(name, addr);
  if (::bind(fd_.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    throwSystemError(
        rank, fmt::format("binding abstract Unix socket '@{}'", name), errno,
        errno == EADDRINUSE ? "another process uses this name: two jobs share a store namespace?" : "");
  }
  if (::listen(fd_.get(), 256) != 0) throwSystemError(rank, fmt::format("listen on '@{}'", name), errno);
}

UnixConn UnixListener::accept(Deadline deadline, const std::string& waiting_for) {
  interruptionPoint("unix accept");
  while (true) {
    int fd = ::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) return UnixConn(UniqueFd(fd), rank_);
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
      throwSystemError(rank_, fmt::format("accept on '@{}'", name_), errno);
    if (pollOne(fd_.get(), POLLIN, deadline, "unix accept") == 0) {
      throw Timeout(
          fmt::format("{}{} did not connect before the deadline. Did every rank construct the "
                      "transport? Check those ranks' logs; raise CROSSBAR_CONNECT_TIMEOUT if slow",
                      errorContext(rank_, "shared-memory connection setup"), waiting_for));
    }
  }
}

UnixConn UnixConn::connect(const std::string& name, Deadline deadline, int rank, const std::string& what) {
  sockaddr_un addr;
  socklen_t len = abstractAddr(name, addr);
  auto backoff = std::chrono::microseconds(100);
  while (true) {
    interruptionPoint("unix connect");
    UniqueFd fd(newSocket(rank, "creating a Unix socket"));
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) == 0)
      return UnixConn(std::move(fd), rank);
    int e = errno;
    if (e == EINPROGRESS || e == EAGAIN) {
      // Backlog full: wait until writable, then check the outcome.
      if (pollOne(fd.get(), POLLOUT, deadline, "unix connect") & POLLOUT) {
        int err = 0;
        socklen_t l = sizeof(err);
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &l);
        if (err == 0) return UnixConn(std::move(fd), rank);
        e = err;
      }
    }
    // ECONNREFUSED/ENOENT: the listener is not there (yet).
    if (e != ECONNREFUSED && e != ENOENT && e != EAGAIN && e != EINPROGRESS && e != EINTR)
      throwSystemError(rank, fmt::format("connecting to {} at '@{}'", what, name), e);
    if (deadline.expired()) {
      throw Timeout(
          fmt::format("{}{} never started listening before the deadline (it did not construct the "
                      "transport, or died). Check that rank's log; raise CROSSBAR_CONNECT_TIMEOUT if slow",
                      errorContext(rank, "shared-memory connection setup"), what),
          {});
    }
    std::this_thread::sleep_for(std::min<std::chrono::microseconds>(backoff, deadline.remaining()));
    backoff = std::min(backoff * 2, std::chrono::microseconds(20'000));
  }
}

void UnixConn::send(const void* data, size_t bytes, const std::vector<int>& fds, Deadline deadline) {
  interruptionPoint("unix send");
  if (fds.size() > kMaxFds || bytes > kMaxMessage)
    throw InternalError(
        fmt::format("UnixConn::send: {} fds / {} bytes exceed the limits", fds.size(), bytes));
  iovec iov{const_cast<void*>(data), bytes};
  uint8_t dummy = 0;
  if (bytes == 0) iov = {&dummy, 1};  // SEQPACKET needs a byte to carry ancillary data reliably
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  while (true) {
    ssize_t n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL);
    if (n >= 0) return;
    if (errno == EPIPE || errno == ECONNRESET)
      throw PeerFailure(fmt::format("{}the peer hung up (its process exited or was killed)",
                                    errorContext(rank_, "sending on a Unix socket")));
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      throwSystemError(rank_, "sendmsg on a Unix socket", errno);
    if (pollOne(fd_.get(), POLLOUT, deadline, "unix send") == 0)
      throw Timeout(fmt::format("{}the peer did not drain its socket before the deadline",
                                errorContext(rank_, "sending on a Unix socket")));
  }
}

UnixMessage UnixConn::recv(Deadline deadline) {
  interruptionPoint("unix recv");
  UnixMessage out;
  out.bytes.resize(kMaxMessage);
  while (true) {
    iovec iov{out.bytes.data(), out.bytes.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(fd_.get(), &msg, MSG_CMSG_CLOEXEC);
    if (n > 0) {
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (size_t i = 0; i < k; ++i) {
            int f;
            std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            out.fds.emplace_back(f);
          }
        }
      }
      if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
        throw InternalError(
            fmt::format("{}message or fds truncated", errorContext(rank_, "recvmsg on a Unix socket")));
      out.bytes.resize(static_cast<size_t>(n));
      return out;
    }
    if (n == 0 || errno == ECONNRESET)
      throw PeerFailure(fmt::format("{}the peer hung up (its process exited or was killed)",
                                    errorContext(rank_, "receiving on a Unix socket")));
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      throwSystemError(rank_, "recvmsg on a Unix socket", errno);
    if (pollOne(fd_.get(), POLLIN, deadline, "unix recv") == 0)
      throw Timeout(fmt::format("{}the peer sent nothing before the deadline",
                                errorContext(rank_, "receiving on a Unix socket")));
  }
}

pid_t UnixConn::peerPid() const {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return -1;
  return cred.pid;
}

bool UnixConn::peerClosed() const {
  pollfd p{fd_.get(), 0, 0};
  int r = ::poll(&p, 1, 0);
  return r > 0 && (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL));
}

}  // namespace crossbar
