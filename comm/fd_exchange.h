// Unix-domain sockets in the Linux ABSTRACT namespace, for passing file
// descriptors (memfd segments, eventfds) between the processes of one node with
// SCM_RIGHTS. Abstract names never touch the file system, so nothing is left behind
// after a crash; names embed a per-job nonce agreed through the store, so
// concurrent jobs and tests never collide.
//
//   std::string nonce = jobNonce(*store, "shm/nonce");         // same on every rank
//   UnixListener l(socketName(nonce, "shm", rank), rank);      // before peers connect
//   UnixConn c = UnixConn::connect(socketName(nonce, "shm", peer), deadline, rank);
//   c.send(bytes, {fd1, fd2}, deadline);  auto m = other.recv(deadline);  // m.fds
//
// Sockets are SOCK_SEQPACKET: message boundaries are kept, and a peer that exits
// (or is killed) shows as POLLHUP / a 0-byte read on the connection.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "comm/deadline.h"

namespace crossbar {

class Store;

// A random token, agreed by every caller through store.compareSet() on `key`
// (the first caller's proposal wins). Use a key unique to the purpose.
std::string jobNonce(Store& store, const std::string& key);

// "crossbar-<nonce>-<purpose>-<rank>" (the leading NUL of an abstract name is added internally).
std::string socketName(const std::string& nonce, const std::string& purpose, int rank);

// An fd closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1);
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

struct UnixMessage {
  std::vector<uint8_t> bytes;
  std::vector<UniqueFd> fds;
};

// A connected SOCK_SEQPACKET socket (nonblocking; every call takes a deadline).
class UnixConn {
 public:
  UnixConn() = default;
  UnixConn(UniqueFd fd, int rank) : fd_(std::move(fd)), rank_(rank) {}

  // Connects to a listener named `name`, retrying while it does not exist yet,
  // until `deadline` (then Timeout). `what` names the peer in errors, e.g. "rank 3".
  static UnixConn connect(const std::string& name, Deadline deadline, int rank, const std::string& what);

  // Sends one message (up to 64 KiB) with `fds` attached (the fds stay owned by the caller).
  void send(const void* data, size_t bytes, const std::vector<int>& fds, Deadline deadline);
  void send(const std::vector<uint8_t>& bytes, const std::vector<int>& fds, Deadline deadline) {
    send(bytes.data(), bytes.size(), fds, deadline);
  }
  // Receives one message; PeerFailure if the peer hung up, Timeout at `deadline`.
  UnixMessage recv(Deadline deadline);

  // The peer's process credentials as seen from this pid namespace (SO_PEERCRED).
  pid_t peerPid() const;

  // True when the peer closed its end or died (POLLHUP / POLLERR now; no waiting).
  bool peerClosed() const;

  int fd() const { return fd_.get(); }
  bool valid() const { return static_cast<bool>(fd_); }
  void close() { fd_.reset(); }

 private:
  UniqueFd fd_;
  int rank_ = -1;
};

// A listening socket on an abstract name; exists until destroyed.
class UnixListener {
 public:
  UnixListener() = default;
  // Throws SystemError (e.g. EADDRINUSE: another process already owns the name).
  UnixListener(const std::string& name, int rank);
  // Accepts one connection, waiting until `deadline` (Timeout; `waiting_for` names whom).
  UnixConn accept(Deadline deadline, const std::string& waiting_for);
  int fd() const { return fd_.get(); }
  const std::string& name() const { return name_; }
  void close() { fd_.reset(); }

 private:
  UniqueFd fd_;
  std::string name_;
  int rank_ = -1;
};

// Waits for `events` on `fd` until `deadline`; returns the revents (0 on timeout).
// Interruptible (comm/interrupt.h): calls interruptionPoint(step) between slices.
int pollOne(int fd, short events, Deadline deadline, std::string_view step = "socket wait");

}  // namespace crossbar
