#include "symmem/symmetric_pool.h"

#include <fmt/format.h>

namespace crossbar::symm {

std::shared_ptr<SymmetricPool> SymmetricPool::create(SymmetricHeap& heap, size_t bytes) {
  return std::make_shared<SymmetricPool>(heap.allocate(bytes));
}

SymmetricPool::SymmetricPool(std::shared_ptr<SymmetricBuffer> buffer) : buffer_(std::move(buffer)) {
  if (!buffer_) throw InvalidArgument(errorContext(-1, "SymmetricPool") + "null buffer");
  capacity_ = buffer_->size();
  if (capacity_) free_[0] = capacity_;
}

PoolBlock SymmetricPool::allocate(size_t bytes, size_t alignment) {
  const int rank = buffer_->rank();
  if (bytes == 0) throw InvalidArgument(errorContext(rank, "symmetric pool allocate") + "0 bytes asked");
  if (alignment == 0 || (alignment & (alignment - 1)))
    throw InvalidArgument(errorContext(rank, "symmetric pool allocate") +
                          fmt::format("alignment {} is not a power of two", alignment));
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    const size_t start = it->first, len = it->second;
    const size_t aligned = (start + alignment - 1) / alignment * alignment;
    if (aligned < start || aligned - start > len || len - (aligned - start) < bytes) continue;
    // Take [start, aligned + bytes); the rest of the run stays free.
    const size_t taken = aligned - start + bytes;
    free_.erase(it);
    if (len > taken) free_[start + taken] = len - taken;
    live_[aligned] = {start, taken};
    used_ += taken;
    return PoolBlock{aligned, bytes};
  }
  throw PoolExhausted(
      errorContext(rank, "symmetric pool allocate") +
      fmt::format("no room for {} bytes (alignment {}) in the {}-byte pool: {} bytes in {} blocks, "
                  "largest free run {} bytes. Free blocks, or create a larger pool "
                  "(SymmetricPool::create(heap, bytes))",
                  bytes, alignment, capacity_, used_, live_.size(), largestFree()));
}

void SymmetricPool::free(const PoolBlock& block) {
  auto it = live_.find(block.offset);
  if (it == live_.end())
    throw InvalidUsage(
        errorContext(buffer_->rank(), "symmetric pool free") +
        fmt::format("no live block at offset {} ({} bytes): freed twice, or not from this pool", block.offset,
                    block.bytes));
  auto [start, len] = it->second;
  live_.erase(it);
  used_ -= len;
  // Coalesce with the neighbours so fragmentation does not depend on free order.
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      prev->second += len;
      return;
    }
  }
  free_[start] = len;
}

size_t SymmetricPool::largestFree() const {
  size_t best = 0;
  for (auto& [off, len] : free_) best = std::max(best, len);
  return best;
}

uint64_t SymmetricPool::fingerprint() const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over (offset, length) of live blocks
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  };
  for (auto& [off, run] : live_) {
    mix(off);
    mix(run.second);
  }
  return h;
}

}  // namespace crossbar::symm
