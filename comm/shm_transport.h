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
  // How rendezvous payloads move. kRing: streamed through the ring (two copies,
  // pipelined on both ranks' cores). kCma: one copy, the receiver reads the
  // sender's buffer with process_vm_readv. kAuto: CMA up to cma_max_bytes, the ring
  // above. CMA silently falls back to the ring where the kernel refuses (EPERM:
  // ptrace policy, other user). Measured on our 2-core VM: CMA wins for 1-16 MiB
  // (about 5-9 GB/s vs 2-3), the ring wins from 64 MiB on (5-7 GB/s vs 1-2: the
  // kernel copy runs at about half of memcpy speed once data leaves the cache).
  enum class LargePath { kAuto, kRing, kCma } large_path = LargePath::kAuto;
  size_t cma_max_bytes = 16 << 20;
  // Bytes moved per progress() call and peer before other work gets a turn.
  size_t chunk_bytes = 1 << 20;
  // Granularity at which a streaming producer publishes data and the consumer
  // frees space: small enough that the consumer reads what is still in cache.
  size_t pipeline_bytes = 256 << 10;
};

std::unique_ptr<Transport> makeShmTransport(const TransportSetup& setup, const ShmTransportOptions& options);

}  // namespace crossbar
