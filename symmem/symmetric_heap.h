// Symmetric memory: collective allocations that every rank of a communicator makes
// with the same size in the same order. Each rank maps every intra-node peer's
// buffer (memfd segments on the host backend; the fds travel over abstract Unix
// sockets), so peers load/store each other's memory directly; peers on other nodes
// are reached with UCX RMA on the same API (NVSHMEM style).
//
//   auto heap = symm::SymmetricHeap::create(comm);          // collective
//   auto buf = heap.allocate(1 << 20);                       // collective: same size, same order
//   buf->putWithSignal(peer, 0, src, n, /*channel=*/0);      // data lands in peer's buffer at offset 0
//   buf->waitSignal(peer, 0, comm->defaultDeadline());       // on the peer: then the data is visible
//   buf->barrier(1, deadline);                               // every rank signals and waits on channel 1
//   buf->free();                                             // collective
//
// Signal pads: every buffer has `channels` counters per (channel, sending rank)
// beside its data. Slot (c, s) of rank r's pad is written only by rank s (a local
// peer's release store, or a remote peer's UCX put ordered after its data by a
// fence) and read by r with acquire loads. Counters only grow, so nothing is ever
// reset: waitSignal() consumes one signal, barrier() one round. Use a channel either
// for barriers or for point-to-point signals, not both at once.
//
// Waiting spins CROSSBAR_SPIN_US, then sleeps (futex on the pad word for local
// peers, who FUTEX_WAKE only when a waiter is flagged; short polls of the UCX
// worker for remote ones). Every wait has a deadline; Timeout names the peer and
// channel, PeerFailure a local peer whose process died.
//
// Lifetime: the heap and its buffers share state; a buffer stays valid after the
// heap handle and even the communicator are gone (it keeps what it needs). free() is
// collective; a peer may keep using its mapping of a buffer this rank already
// freed (memfd memory lives until the last process unmaps it). Buffers with
// off-node peers synchronize in free() before deregistering from UCX.
//
// Threads: a buffer's operations may be called from one thread at a time.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/deadline.h"
#include "symmem/segment_allocator.h"

namespace crossbar::symm {

namespace detail {
struct HeapImpl;
struct RemoteRegion;
}  // namespace detail

struct HeapOptions {
  int channels = -1;  // signal channels per buffer; -1: CROSSBAR_SYMMEM_CHANNELS
  // Backend; default the host one (memfd). A CUDA backend plugs in here.
  std::shared_ptr<SegmentAllocator> allocator;
  std::string name = "heap";  // in segment names and errors
  // Register buffers with UCX for peers on other nodes (requires a UCX route to them).
  bool remote_access = true;
};

class SymmetricBuffer;

class SymmetricHeap {
 public:
  // Collective over every rank of `comm`.
  static SymmetricHeap create(std::shared_ptr<Communicator> comm, HeapOptions options = {});
  SymmetricHeap() = default;

  // Collective: every rank asks the same `bytes`, in the same order; InvalidUsage
  // names the ranks that disagree. Returns a zero-filled buffer.
  std::shared_ptr<SymmetricBuffer> allocate(size_t bytes);

  int rank() const;
  int size() const;
  int channels() const;
  uint64_t id() const;
  const SegmentAllocator& allocator() const;
  bool valid() const { return impl_ != nullptr; }

 private:
  std::shared_ptr<detail::HeapImpl> impl_;
};

class SymmetricBuffer {
 public:
  ~SymmetricBuffer();  // not freed yet: releases like free(), synchronizing only if needed (bounded)
  SymmetricBuffer(const SymmetricBuffer&) = delete;
  SymmetricBuffer& operator=(const SymmetricBuffer&) = delete;

  // --- addresses
  void* localPtr() const { return local_; }
  // `rank`'s buffer mapped here: localPtr() for this rank, nullptr for off-node peers.
  void* peerPtr(int rank) const;
  template <typename T>
  T* local(size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(local_) + byte_offset);
  }
  template <typename T>
  T* peer(int rank, size_t byte_offset = 0) const {
    char* p = static_cast<char*>(peerPtr(rank));
    return p ? reinterpret_cast<T*>(p + byte_offset) : nullptr;
  }
  // Offset of `ptr` (inside this rank's buffer) from localPtr(); InvalidArgument if outside.
  size_t offsetOf(const void* ptr) const;
  size_t size() const { return bytes_; }  // as allocated (same on every rank)
  uint64_t id() const { return id_; }
  int rank() const { return rank_; }
  int worldSize() const { return size_; }
  int channels() const { return channels_; }
  bool isLocalPeer(int rank) const;
  bool freed() const { return freed_; }
  uint64_t heapId() const;  // SymmetricHeap::id(): the same on every rank
  // Whether the heap was created over `comm` (that very object, still alive): then every
  // rank of `comm` maps this buffer, so a collective over it may read peers' copies.
  bool createdOver(const Communicator& comm) const;

  // --- signals (channel in [0, channels()))
  // Adds one to this rank's counter in `peer`'s pad for `channel`. Local peers:
  // release store (+ futex wake if the peer sleeps). Remote: ordered after every
  // earlier put to that peer.
  void putSignal(int peer, int channel);
  // Waits for the next signal from `peer` on `channel` (acquire: data written
  // before it is visible). Timeout names the peer and channel.
  void waitSignal(int peer, int channel, Deadline deadline);
  // Waits until `peer`'s counter for `channel` here reaches `value` (absolute; does
  // not change what waitSignal() consumes).
  void waitSignalValue(int peer, int channel, uint64_t value, Deadline deadline);
  uint64_t signalValue(int peer, int channel) const;  // current counter (acquire)
  // Every rank signals every other rank on `channel`, then waits for all of them.
  void barrier(int channel, Deadline deadline);

  // --- one-sided data movement (offsets are into the peer's / this rank's buffer)
  // Writes [src, src+bytes) to `peer`'s buffer at `dst_offset`. Returns when `src`
  // may be reused; the data is visible to the peer after its waitSignal() of a later
  // putSignal, or to anyone after quiet().
  void put(int peer, size_t dst_offset, const void* src, size_t bytes);
  // Reads `peer`'s buffer at `src_offset`; returns when the data is in `dst`.
  void get(int peer, size_t src_offset, void* dst, size_t bytes);
  // put(), then putSignal() ordered after it.
  void putWithSignal(int peer, size_t dst_offset, const void* src, size_t bytes, int channel);
  // Waits until every earlier put of this rank is complete at its target.
  void quiet(Deadline deadline);
  void quiet();

  // Collective; afterwards only freed() and size() may be called.
  void free();
  void free(Deadline deadline);

  // --- hooks for backends whose memory the CPU cannot touch (symmem/cuda signals
  // from streams and kernels into the same pad slots; the host calls above refuse).
  // Pad layout: at signalPadOffset() of every rank's segment, one kSignalSlotBytes
  // slot per (channel, sender), index signalSlot(sender, channel), a uint64 counter at
  // offset 0 of the slot.
  static constexpr size_t kSignalSlotBytes = 16;
  MemoryKind memoryKind() const;
  size_t signalPadOffset() const { return pad_offset_; }
  size_t signalSlot(int sender, int channel) const {
    return static_cast<size_t>(channel) * static_cast<size_t>(size_) + static_cast<size_t>(sender);
  }
  // Counts one more signal from this rank to on-node `peer` on `channel` and returns
  // the counter value the caller must write into the peer's slot.
  uint64_t reserveSignal(int peer, int channel);
  // Consumes one signal from on-node `peer` on `channel`; returns the counter value
  // to wait for in this rank's slot (what waitSignal() would wait for).
  uint64_t reserveWait(int peer, int channel);

 private:
  friend class SymmetricHeap;
  friend struct detail::HeapImpl;
  SymmetricBuffer() = default;
  void checkUsable(const char* op) const;
  void checkPeer(int peer, const char* op) const;
  void checkRange(int peer, size_t offset, size_t bytes, const char* op) const;
  void checkChannel(int channel, const char* op) const;
  void signalTo(int peer, size_t slot_index, const char* op);
  void waitSlot(int peer, size_t slot_index, uint64_t value, int channel, Deadline deadline, const char* op);
  void release(bool synchronize, Deadline deadline);
  void flushRemote(Deadline deadline);
  void syncAll(int internal_channel, Deadline deadline, const char* op);
  std::string describeChannel(int channel) const;

  std::shared_ptr<detail::HeapImpl> heap_;
  uint64_t id_ = 0;
  int rank_ = 0, size_ = 0, channels_ = 0;
  size_t bytes_ = 0;
  size_t pad_offset_ = 0;
  void* local_ = nullptr;
  std::unique_ptr<Segment> own_;
  std::vector<std::unique_ptr<Segment>> mapped_;               // by rank; local peers only
  std::vector<char*> ptrs_;                                    // by rank; nullptr off-node
  std::vector<std::unique_ptr<detail::RemoteRegion>> remote_;  // by rank; off-node only
  void* memh_ = nullptr;                                       // ucp_mem_h of our segment
  std::unique_ptr<std::atomic<uint64_t>[]> sent_;  // [slot]: signals we sent to each (channel, peer)
  std::vector<uint64_t> consumed_;  // [slot]: signals waitSignal() took from each (channel, peer)
  std::vector<bool> dirty_;         // by rank: remote puts since the last quiet()
  bool freed_ = false;
};

// Lookup of live buffers of this process (zero-copy collectives: a user pointer that
// already lies in symmetric memory need not be staged). Buffers enter the registry when
// allocated and leave it when freed; the registry holds no reference.
struct BufferRange {
  std::shared_ptr<SymmetricBuffer> buffer;  // null: not inside one live buffer
  size_t offset = 0;                        // of ptr from buffer->localPtr()
};
// The buffer whose local range holds all of [ptr, ptr + bytes) (bytes > 0).
BufferRange findBuffer(const void* ptr, size_t bytes);
// This rank's buffer `buffer_id` of heap `heap_id` (ids as every rank numbers them), or null.
std::shared_ptr<SymmetricBuffer> findBuffer(uint64_t heap_id, uint64_t buffer_id);

}  // namespace crossbar::symm
