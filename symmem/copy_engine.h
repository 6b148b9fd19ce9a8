// Host copy engine: worker threads that run batches of (src, dst, bytes) copies
// off the caller's thread, with a completion handle per batch and fences between
// batches. Large copies use non-temporal (streaming) stores so a multi-MiB copy
// does not evict the caller's cache; each copy is split into chunks so several
// workers share it.
//
//   CopyEngine ce;                                     // CROSSBAR_COPY_ENGINE_THREADS workers
//   auto done = ce.submit({{src, dst, n}, {src2, dst2, m}});
//   ce.fence();                                        // later batches start after earlier ones end
//   done.wait(Deadline::after(Millis(1000)));          // Timeout if not complete
//
// The CUDA counterpart is cuda::CudaCopyEngine (symmem/cuda/copy_engine_cuda.h).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/deadline.h"

namespace crossbar::symm {

struct CopyOp {
  const void* src = nullptr;
  void* dst = nullptr;
  size_t bytes = 0;
};

// Copies `bytes` like memcpy (no overlap). From `nt_threshold` bytes up it uses
// streaming stores (AVX when the CPU has it, else SSE2) followed by sfence, so the
// data is globally visible on return; smaller copies, and CPUs without SSE2, use memcpy.
void copyBytes(void* dst, const void* src, size_t bytes, size_t nt_threshold);
// The streaming path regardless of size (tests, benchmarks).
void copyBytesNonTemporal(void* dst, const void* src, size_t bytes);
// CROSSBAR_COPY_ENGINE_NT_THRESHOLD (read once).
size_t defaultNtThreshold();

struct CopyEngineOptions {
  int threads = -1;                 // -1: CROSSBAR_COPY_ENGINE_THREADS; 0: copies run inside submit()
  int64_t nt_threshold = -1;        // bytes; -1: CROSSBAR_COPY_ENGINE_NT_THRESHOLD
  size_t chunk_bytes = 4u << 20;    // copies are split into chunks of this size across workers
  bool pin_to_caller_node = false;  // run the workers on the CPUs of the creating thread's NUMA node
};

class CopyEngine {
  struct Batch;

 public:
  // Completion of one submitted batch. Copyable; an empty handle is complete.
  class Completion {
   public:
    Completion() = default;
    bool done() const;
    // Waits until every copy of the batch finished; Timeout at `deadline`.
    void wait(Deadline deadline) const;

   private:
    friend class CopyEngine;
    explicit Completion(std::shared_ptr<Batch> b) : batch_(std::move(b)) {}
    std::shared_ptr<Batch> batch_;
  };

  explicit CopyEngine(CopyEngineOptions options = {});
  ~CopyEngine();  // finishes queued work, then joins the workers
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Enqueues the copies; they run in any order and in parallel with each other (and
  // with earlier batches, unless a fence() separates them).
  Completion submit(const std::vector<CopyOp>& copies);
  Completion submit(const void* src, void* dst, size_t bytes) { return submit({{src, dst, bytes}}); }
  // Batches submitted after a fence start only once everything before it completed.
  void fence();
  // Waits for everything submitted so far.
  void synchronize(Deadline deadline);

  int threads() const { return static_cast<int>(workers_.size()); }
  size_t ntThreshold() const { return nt_threshold_; }

 private:
  struct Chunk {
    std::shared_ptr<Batch> batch;
    CopyOp op;
    uint64_t seq = 0;       // position in submission order
    uint64_t wait_for = 0;  // chunks with seq < wait_for must be done first (fence)
  };
  void workerLoop();
  void runChunk(const Chunk& c);

  size_t nt_threshold_;
  size_t chunk_bytes_;
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Chunk> queue_;
  uint64_t next_seq_ = 0;
  uint64_t fence_seq_ = 0;        // seq every newly queued chunk waits for
  uint64_t done_below_ = 0;       // every chunk with seq < done_below_ is done
  std::deque<bool> done_window_;  // done flags of seq >= done_below_ (out-of-order completion)
  bool stopping_ = false;
  std::shared_ptr<Batch> last_batch_;
  std::vector<std::thread> workers_;
};

}  // namespace crossbar::symm
