#include "symmem/cuda/copy_engine_cuda.h"

#include <fmt/format.h>

#include <thread>

#include "comm/errors.h"
#include "comm/log.h"
#include "symmem/cuda/driver_api.h"

namespace crossbar::cuda {
namespace {

// Keeps the current device across a call that needs `device` current.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int cur = -1;
    if (prev_ >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

}  // namespace

CudaCopyEngine::CudaCopyEngine(int device) : CudaCopyEngine(device, Options{}) {}

CudaCopyEngine::CudaCopyEngine(int device, Options options) : device_(device), use_batch_(options.use_batch) {
  ensureContext(device, "CudaCopyEngine");
  checkCuda(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, options.priority),
            "CudaCopyEngine: cudaStreamCreateWithPriority", device);
  cudaError_t e = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    cudaStreamDestroy(stream_);
    checkCuda(e, "CudaCopyEngine: cudaEventCreateWithFlags", device);
  }
}

CudaCopyEngine::~CudaCopyEngine() {
  if (!stream_) return;
  DeviceGuard guard(device_);
  // Destroying a stream with queued copies is legal (they still finish); the
  // owner is responsible for keeping buffers alive until synchronize().
  cudaEventDestroy(done_);
  cudaStreamDestroy(stream_);
}

void CudaCopyEngine::enqueue(std::span<const CopyOp> copies) {
  constexpr std::string_view kOp = "CudaCopyEngine::enqueue";
  dsts_.clear();
  srcs_.clear();
  sizes_.clear();
  uint64_t total = 0;
  for (size_t i = 0; i < copies.size(); ++i) {
    const CopyOp& c = copies[i];
    if (c.bytes == 0) continue;
    if (!c.src || !c.dst) {
      throw InvalidArgument(fmt::format("{}copy {} of {} has a null pointer (src {}, dst {}, {} bytes)",
                                        errorContext(-1, kOp), i, copies.size(), c.src,
                                        static_cast<void*>(c.dst), c.bytes));
    }
    dsts_.push_back(c.dst);
    srcs_.push_back(c.src);
    sizes_.push_back(c.bytes);
    total += c.bytes;
  }
  if (dsts_.empty()) return;
  DeviceGuard guard(device_);
  if (use_batch_ && dsts_.size() > 1) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagDefault;
    size_t attr_index = 0;
    cudaError_t e = cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), dsts_.size(), &attr,
                                         &attr_index, 1, stream_);
    if (e == cudaSuccess) {
      bytes_enqueued_ += total;
      return;
    }
    cudaGetLastError();
    // Older drivers / some pointer kinds reject batches; copy one by one from now on.
    use_batch_ = false;
    CB_INFO("symmem", "cudaMemcpyBatchAsync failed on device {} ({}); using cudaMemcpyAsync per copy",
            device_, cudaGetErrorString(e));
  }
  enqueueEach(copies);
  bytes_enqueued_ += total;
}

void CudaCopyEngine::enqueueEach(std::span<const CopyOp> copies) {
  for (size_t i = 0; i < copies.size(); ++i) {
    const CopyOp& c = copies[i];
    if (c.bytes == 0) continue;
    checkCuda(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream_),
              fmt::format("CudaCopyEngine::enqueue: cudaMemcpyAsync(copy {} of {}, {} bytes, {} -> {})", i,
                          copies.size(), c.bytes, c.src, static_cast<void*>(c.dst)),
              device_, "Both pointers must be CUDA-accessible (device, mapped peer, or pinned host memory)");
  }
}

void CudaCopyEngine::waitFor(cudaStream_t stream) {
  DeviceGuard guard(device_);
  cudaEvent_t ev = nullptr;
  checkCuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "CudaCopyEngine::waitFor: cudaEventCreate",
            device_);
  cudaError_t e = cudaEventRecord(ev, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(stream_, ev, 0);
  cudaEventDestroy(ev);  // safe: destruction is deferred until the event completes
  checkCuda(e, "CudaCopyEngine::waitFor: cudaEventRecord/cudaStreamWaitEvent", device_);
}

void CudaCopyEngine::record() {
  DeviceGuard guard(device_);
  checkCuda(cudaEventRecord(done_, stream_), "CudaCopyEngine::record: cudaEventRecord", device_);
  recorded_ = true;
  bytes_at_record_ = bytes_enqueued_;
}

void CudaCopyEngine::wait(cudaStream_t stream) const {
  if (!recorded_) {
    throw InvalidUsage(errorContext(-1, "CudaCopyEngine::wait") + "call record() after enqueue() first");
  }
  checkCuda(cudaStreamWaitEvent(stream, done_, 0), "CudaCopyEngine::wait: cudaStreamWaitEvent", device_);
}

bool CudaCopyEngine::query() const {
  if (!recorded_) return true;
  cudaError_t e = cudaEventQuery(done_);
  if (e == cudaErrorNotReady) return false;
  checkCuda(e, "CudaCopyEngine::query: cudaEventQuery", device_,
            "A copy faulted (bad address or a peer's memory was unmapped); the CUDA context is unusable");
  return true;
}

void CudaCopyEngine::synchronize(Deadline deadline) const {
  // Spin briefly (copies of small batches finish in microseconds), then back off.
  auto sleep = std::chrono::microseconds(0);
  for (int polls = 0;; ++polls) {
    if (query()) return;
    if (deadline.expired()) {
      throw Timeout(
          fmt::format("{}device {}: copies enqueued before the last record() ({} bytes total) did not "
                      "complete before the deadline. A stream wait on a peer's signal may never be "
                      "satisfied (peer dead or behind?), or the GPU is hung; check nvidia-smi and "
                      "the peers' logs",
                      errorContext(-1, "CudaCopyEngine::synchronize"), device_, bytes_at_record_));
    }
    if (polls < 1000) continue;
    sleep = std::min(std::chrono::microseconds(1000), sleep + std::chrono::microseconds(20));
    std::this_thread::sleep_for(sleep);
  }
}

}  // namespace crossbar::cuda
