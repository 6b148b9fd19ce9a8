// CudaCopyEngine: moves bytes with the GPU's copy engines only (no kernels, zero
// SMs) on a dedicated non-blocking stream. A batch goes through one
// cudaMemcpyBatchAsync call where the runtime and driver support it, else one
// cudaMemcpyAsync per copy. Completion is tracked with an event and waited for
// with a deadline.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "comm/deadline.h"

namespace crossbar::cuda {

struct CopyOp {
  const void* src = nullptr;
  void* dst = nullptr;
  size_t bytes = 0;
};

class CudaCopyEngine {
 public:
  struct Options {
    bool use_batch = true;  // try cudaMemcpyBatchAsync first
    int priority = 0;       // stream priority (0 = default; lower is higher priority)
  };

  // Creates the copy stream and completion event on `device`. Unsupported without a driver.
  explicit CudaCopyEngine(int device);
  CudaCopyEngine(int device, Options options);
  ~CudaCopyEngine();
  CudaCopyEngine(const CudaCopyEngine&) = delete;
  CudaCopyEngine& operator=(const CudaCopyEngine&) = delete;

  // Enqueues the copies (any order among them; none may overlap another's dst).
  void enqueue(std::span<const CopyOp> copies);
  // Makes later copies wait for the work currently queued in `stream` (input readiness).
  void waitFor(cudaStream_t stream);
  // Records completion of everything enqueued so far.
  void record();
  // Makes `stream` wait (on the GPU) for the last record().
  void wait(cudaStream_t stream) const;
  // True when the last record() has completed.
  bool query() const;
  // Polls the last record() until done; Timeout when `deadline` passes first.
  void synchronize(Deadline deadline) const;

  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  // Whether batches currently go through cudaMemcpyBatchAsync (false after a fallback).
  bool usingBatch() const { return use_batch_; }
  uint64_t bytesEnqueued() const { return bytes_enqueued_; }

 private:
  void enqueueEach(std::span<const CopyOp> copies);
  int device_ = -1;
  bool use_batch_ = true;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  bool recorded_ = false;
  uint64_t bytes_enqueued_ = 0;
  uint64_t bytes_at_record_ = 0;
  // Scratch for the batch call, kept to avoid per-call allocations.
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
};

}  // namespace crossbar::cuda
