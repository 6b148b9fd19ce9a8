// Transport: tagged, nonblocking point-to-point messages between the ranks of one
// Context (world ranks). Tags are below 2^48 (kMaxTransportTag): the Communicator
// puts a 16-bit communicator id above a 32-bit user tag. Messages between a pair
// with the same tag are matched in order. A receive may be larger than the message (status().bytes says how much
// came); a message larger than the receive fails it with InvalidUsage.
//
// Transports make progress only inside progress(), called by the ProgressEngine;
// they expose file descriptors so a waiting engine can block in poll() instead of
// spinning.
#pragma once

#include <poll.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/deadline.h"
#include "comm/request.h"

namespace crossbar {

class Store;
class Topology;
namespace ucx {
class Fabric;
}

constexpr uint64_t kMaxTransportTag = (uint64_t{1} << 48) - 1;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;

  virtual RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) = 0;
  virtual RequestPtr irecv(int peer, uint64_t tag, void* data, size_t capacity) = 0;
  // Any-source receive support (comm/any_source.h): if a message with `tag` from any
  // peer has arrived that no posted receive was waiting for, receive it into `data`
  // now and return its request (status().source: the sender's rank); otherwise
  // nullptr, leaving nothing posted. Of several such messages the first to arrive is
  // taken. Thread-safe like isend/irecv.
  virtual RequestPtr tryRecvAny(uint64_t tag, void* data, size_t capacity) = 0;

  // Advances pending work; returns true if anything moved.
  virtual bool progress() = 0;
  // Blocking support: fds to poll (any event => wake up and call progress()).
  virtual void pollFds(std::vector<pollfd>& fds) = 0;
  // Called before the engine sleeps: returns false if there is work to do now (no sleep).
  virtual bool prepareSleep() = 0;
  // Called after waking.
  virtual void finishSleep() {}

  // Fails every pending request with `error` and stops; idempotent, thread-safe.
  virtual void abort(std::exception_ptr error) = 0;
};

// What a transport needs to connect. Construction is collective over `peers`
// (every listed peer constructs its side) and finishes by `deadline`.
struct TransportSetup {
  std::shared_ptr<Store> store;  // namespaced for this context
  int rank = 0;                  // this process's rank in the context
  int size = 0;
  std::vector<int> peers;        // ranks this transport connects to (excludes rank)
  const Topology* topology = nullptr;
  ProgressEngine* engine = nullptr;
  Deadline deadline = Deadline::never();
  // UCX only. Fault tolerance keeps one worker and its endpoints across epochs
  // (comm/ucx_context.h, "Kept workers"); wire ids ucx_wire_base + rank tag this
  // context's messages (agreed by Context::create).
  std::shared_ptr<ucx::Fabric> ucx_fabric;
  uint32_t ucx_wire_base = 0;
};

std::unique_ptr<Transport> makeShmTransport(const TransportSetup& setup);
std::unique_ptr<Transport> makeUcxTransport(const TransportSetup& setup);

}  // namespace crossbar
