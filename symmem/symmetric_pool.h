// SymmetricPool: one big collective SymmetricBuffer carved into blocks by a
// deterministic allocator, so tensors get symmetric offsets without a collective
// each: as long as every rank makes the same allocate()/free() calls in the same
// order, every rank gets the same offsets (first fit over an offset-ordered free
// list, coalesced on free; no dependence on addresses, time or threads).
//
//   auto pool = SymmetricPool::create(heap, 256 << 20);   // collective, once
//   PoolBlock b = pool->allocate(n * sizeof(float));     // local, same offset everywhere
//   float* mine = pool->local<float>(b);  float* theirs = pool->peer<float>(b, peer);
//   pool->buffer().putWithSignal(peer, b.offset, src, b.bytes, 0);
//   pool->free(b);
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "comm/errors.h"
#include "symmem/symmetric_heap.h"

namespace crossbar::symm {

// The pool has no free run large enough (the message says how much is in use).
class PoolExhausted : public Error {
 public:
  explicit PoolExhausted(const std::string& message) : Error(ErrorCode::kInvalidUsage, message) {}
};

struct PoolBlock {
  size_t offset = 0;  // from the start of the pool's buffer (same on every rank)
  size_t bytes = 0;   // as asked
  explicit operator bool() const { return bytes != 0; }
};

class SymmetricPool {
 public:
  static constexpr size_t kDefaultAlignment = 256;

  // Collective: allocates the pool's buffer from `heap`.
  static std::shared_ptr<SymmetricPool> create(SymmetricHeap& heap, size_t bytes);
  explicit SymmetricPool(std::shared_ptr<SymmetricBuffer> buffer);

  // Local and deterministic. alignment: a power of two. PoolExhausted when no free
  // run fits; InvalidArgument for 0 bytes or a bad alignment.
  PoolBlock allocate(size_t bytes, size_t alignment = kDefaultAlignment);
  // InvalidUsage for a block this pool did not hand out (or freed twice).
  void free(const PoolBlock& block);

  void* localPtr(const PoolBlock& b) const { return buffer_->local<char>(b.offset); }
  void* peerPtr(const PoolBlock& b, int rank) const { return buffer_->peer<char>(rank, b.offset); }
  template <typename T>
  T* local(const PoolBlock& b) const {
    return buffer_->local<T>(b.offset);
  }
  template <typename T>
  T* peer(const PoolBlock& b, int rank) const {
    return buffer_->peer<T>(rank, b.offset);
  }
  SymmetricBuffer& buffer() const { return *buffer_; }

  size_t capacity() const { return capacity_; }
  size_t used() const { return used_; }  // bytes in blocks, including alignment padding
  size_t largestFree() const;
  size_t blocks() const { return live_.size(); }
  // Hash of the allocation state: equal on every rank that made the same calls.
  uint64_t fingerprint() const;

 private:
  std::shared_ptr<SymmetricBuffer> buffer_;
  size_t capacity_ = 0;
  size_t used_ = 0;
  std::map<size_t, size_t> free_;                     // offset -> length, coalesced
  std::map<size_t, std::pair<size_t, size_t>> live_;  // block offset -> (run start, run length)
};

}  // namespace crossbar::symm
