// NCCL interop for symmetric buffers: a non-blocking NCCL communicator built from a
// crossbar Communicator (the ncclUniqueId travels through comm->store()), and RAII
// registration of a buffer as an NCCL window, so NCCL's symmetric-memory kernels
// (NCCL_WIN_COLL_SYMMETRIC) run on crossbar's VMM buffers.
//
//   auto nccl = cuda::NcclCommHolder::create(comm, {.device = local_rank});
//   auto heap = symm::SymmetricHeap::create(comm, {.allocator = cuda::makeCudaSegmentAllocator(local_rank)});
//   auto buf = heap.allocate(bytes);
//   cuda::NcclWindow win = cuda::NcclWindow::registerBuffer(nccl, *buf);  // collective
//   nccl.check(ncclAllReduce(p, p, n, ncclFloat, ncclSum, nccl.get(), stream), "ncclAllReduce");
//
// Every NCCL call on a non-blocking communicator may return ncclInProgress; check()
// then polls ncclCommGetAsyncError until it settles, under a deadline (the
// communicator's timeout unless given): Timeout names the rank and operation, and
// NcclError carries NCCL's own last-error text. A wait never blocks forever.
//
// Lifetime: windows keep the NCCL communicator alive; it is finalized and destroyed
// (bounded; aborted if that fails) when the holder and every window are gone.
// Window (de)registration is collective over the NCCL communicator's ranks.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "comm/communicator.h"
#include "comm/deadline.h"
#include "symmem/symmetric_heap.h"

namespace crossbar::cuda {

struct NcclCommOptions {
  int device = -1;               // CUDA device of this rank; -1: the current device
  bool cta_policy_zero = false;  // config.CTAPolicy = NCCL_CTA_POLICY_ZERO (no SMs where NCCL can)
  std::string name;              // config.commName (NCCL logs); "" none
  Millis timeout{0};             // NCCL waits (init, windows, finalize); 0: the communicator's timeout
};

namespace detail {
struct NcclState;
}

class NcclCommHolder {
 public:
  // Collective over every rank of `comm`: rank 0 makes the unique id and publishes
  // it in comm->store(); each rank then inits its NCCL rank and waits until ready.
  static NcclCommHolder create(const std::shared_ptr<Communicator>& comm, NcclCommOptions options = {});

  NcclCommHolder() = default;
  ncclComm_t get() const;
  int rank() const;
  int size() const;
  int device() const;
  Millis timeout() const;
  bool valid() const { return state_ != nullptr; }

  // Result of an NCCL call on this communicator: success returns; ncclInProgress
  // waits (waitReady) for it to complete; anything else raises NcclError.
  void check(ncclResult_t result, std::string_view call) const;
  void check(ncclResult_t result, std::string_view call, Deadline deadline) const;
  // Polls ncclCommGetAsyncError until it leaves ncclInProgress (NcclError on an error,
  // Timeout at the deadline).
  void waitReady(std::string_view op, Deadline deadline) const;
  // One poll: raises NcclError if the communicator hit an asynchronous error.
  void checkAsync(std::string_view op) const;
  // ncclCommAbort: unblocks every pending NCCL operation of this communicator; the
  // holder and its windows are unusable afterwards (destruction stays safe).
  void abort() noexcept;

 private:
  friend class NcclWindow;
  std::shared_ptr<detail::NcclState> state_;
};

class NcclWindow {
 public:
  // Collective: registers [ptr, ptr+bytes) with ncclCommWindowRegister(..., flags).
  // ptr must be 4096-byte aligned (NCCL_WIN_REQUIRED_ALIGNMENT) and, for symmetric
  // windows, the same size on every rank (cuMem/VMM memory: crossbar's CUDA heap).
  static NcclWindow registerBuffer(const NcclCommHolder& comm, void* ptr, size_t bytes,
                                   int flags = NCCL_WIN_COLL_SYMMETRIC);
  // This rank's whole buffer (localPtr(), size()); InvalidArgument for host buffers.
  static NcclWindow registerBuffer(const NcclCommHolder& comm, const symm::SymmetricBuffer& buffer,
                                   int flags = NCCL_WIN_COLL_SYMMETRIC);

  NcclWindow() = default;
  NcclWindow(NcclWindow&& other) noexcept;
  NcclWindow& operator=(NcclWindow&& other) noexcept;
  NcclWindow(const NcclWindow&) = delete;
  NcclWindow& operator=(const NcclWindow&) = delete;
  ~NcclWindow();  // deregisters (collective); errors are logged, not thrown

  // Collective; raises on failure (the destructor only logs).
  void deregister();
  // nullptr when NCCL declined the registration (see registered()).
  ncclWindow_t get() const { return window_; }
  void* ptr() const { return ptr_; }
  size_t size() const { return bytes_; }
  bool valid() const { return registered_; }  // registerBuffer() succeeded and not deregistered
  // NCCL returns success but no window where symmetric windows are unsupported (seen on
  // a one-rank communicator on one H200): collectives on the buffer still work, only
  // without NCCL's symmetric kernels. True when NCCL gave a window.
  bool registered() const { return window_ != nullptr; }

 private:
  std::shared_ptr<detail::NcclState> state_;
  bool registered_ = false;
  ncclWindow_t window_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// "ncclInvalidUsage (invalid usage)" style text for a result.
std::string ncclResultText(ncclResult_t result);

}  // namespace crossbar::cuda
