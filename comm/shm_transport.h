// Intra-node shared-memory transport (see shm_transport.cc for the protocol).
// makeShmTransport(setup) in comm/transport.h uses the defaults below; tests and
// benchmarks pass options explicitly.
#pragma once

#include <cstddef>
#include <memory>

#include "comm/transport.h"

namespace crossbar {

struct ShmTransportOptions {
  // Bytes of each receive ring (rounded up to a power of two, at least 64 KiB).
  // 0: CROSSBAR_SHM_RING_SIZE.
  size_t ring_bytes = 0;
  // Messages up to this size are copied through the ring without waiting for the
  // receiver (eager); larger ones wait for the matching receive (rendezvous).
  // Capped at ring_bytes / 2.
  size_t eager_limit = 64 * 1024;
  // How rendezvous payloads move: kAuto = single copy with process_vm_readv (CMA)
  // when the kernel allows it, else streamed through the ring.
  enum class LargePath { kAuto, kCma, kRing } large_path = LargePath::kAuto;
  // Bytes moved per progress() call and peer before other work gets a turn.
  size_t chunk_bytes = 1 << 20;
};

std::unique_ptr<Transport> makeShmTransport(const TransportSetup& setup, const ShmTransportOptions& options);

}  // namespace crossbar
