// Stream-ordered collectives on CUDA device memory (the NCCL model): every call
// validates its arguments, picks an algorithm (selection.h, memory = cuda), enqueues
// the whole operation on `stream` and returns at once. Later work on `stream` sees
// the result; the returned Work polls a CUDA event (test(), wait(deadline): Timeout
// names the operation, nothing blocks forever).
//
//   CudaCollectives cc(comm);                                   // collective
//   WorkPtr w = cc.allreduce(d_in, d_out, n, DataType::kBFloat16, ReduceOp::kSum, stream);
//   next_kernel<<<g, b, 0, stream>>>(d_out);                    // ordered after the allreduce
//   w->wait(comm->defaultDeadline());                           // optional host-side wait
//
// Semantics are the host API's (collectives.h): counts in elements, per-rank blocks at
// rank * count, in place when send == recv (allgather: send == recv + rank * count;
// reduce_scatter: recv == send + rank * count), recv of reduce/gather and send of
// scatter significant on the root only. Every rank must issue the same operations in
// the same order (like NCCL). Pointers are device memory of this object's device (or
// host memory the device can access); they must stay valid until the operation has
// completed on the stream.
//
// Execution: the operations of one CudaCollectives run in issue order on one internal
// stream, joined to the caller's stream with events at both ends (so callers may use
// several streams; the cross-rank signal counters stay in order). Algorithms:
//   * one node, <= 8 ranks: a CUDA symmetric heap (staging allocated once, grown on
//     demand; a buffer from allocateSymmetric() is used in place, no staging copy).
//     Reductions run in kernels that read the peers' staging through peer pointers
//     (one-shot, two-shot allreduce, direct reduce_scatter / reduce; f16/bf16/fp8
//     accumulate in f32 with collectives/reduce.h); allgather, alltoall(v), broadcast,
//     gather, scatter copy with the copy engines (no SMs). Ranks synchronize with
//     stream memory operations on the heap's signal pads between kernels (never by
//     spinning inside a kernel).
//   * everything else (several nodes, > 8 ranks, send/recv, CROSSBAR_ALGO=nccl): NCCL,
//     created lazily on first use (collective at that call), with NCCL_CTA_POLICY_ZERO
//     and NCCL windows for buffers from allocateSymmetric(). If NCCL cannot be created
//     (e.g. it refuses two ranks on one GPU) the call raises NcclError saying so.
// Selection per call: CollOptions::algorithm, then CROSSBAR_ALGO, then the table
// (crossbar-info prints the cuda rows); CollOptions::timeout bounds the host-side waits
// inside the call (CudaCollectivesOptions::timeout when 0).
//
// Errors: InvalidArgument for bad arguments (before anything is enqueued), Unsupported
// without a CUDA driver/device, CudaError / NcclError naming the call, Timeout from
// Work::wait. A failed or timed-out operation leaves the peers in an unknown state:
// abort the communicator and build a new CudaCollectives.
//
// Threads: calls may come from several threads; a mutex serializes them, and they run
// in the order they were issued. The Work objects are thread-safe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/dtype.h"
#include "comm/communicator.h"
#include "comm/deadline.h"
#include "symmem/symmetric_heap.h"

namespace crossbar {

struct CudaCollectivesOptions {
  int device = -1;                   // CUDA device of this rank; -1: the current device
  bool symmetric_heap = true;        // false: never use the heap algorithms (NCCL only)
  bool nccl_cta_policy_zero = true;  // NCCL communicator with NCCL_CTA_POLICY_ZERO
  size_t initial_staging_bytes = 0;  // staging per rank allocated up front (0: on first use)
  // Host-side waits inside a call (staging growth, alltoallv exchange, NCCL creation);
  // 0: the communicator's timeout. Work::wait() without a deadline uses CROSSBAR_TIMEOUT.
  Millis timeout{0};
};

class CudaCollectives {
 public:
  // Collective over every rank of `comm` (creates the symmetric heap when the
  // communicator is one node of at most 8 ranks). Unsupported without a CUDA driver.
  explicit CudaCollectives(std::shared_ptr<Communicator> comm, CudaCollectivesOptions options = {});
  ~CudaCollectives();  // waits (bounded) for this object's queued work, then frees the staging
  CudaCollectives(const CudaCollectives&) = delete;
  CudaCollectives& operator=(const CudaCollectives&) = delete;

  Communicator& comm() const;
  int device() const;

  WorkPtr allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                    cudaStream_t stream, const CollOptions& o = {});
  // recv holds size() * count elements, rank r's block at r * count.
  WorkPtr allgather(const void* send, void* recv, size_t count, DataType type, cudaStream_t stream,
                    const CollOptions& o = {});
  // send holds size() * count elements; recv gets this rank's reduced block of count.
  WorkPtr reduceScatter(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                        cudaStream_t stream, const CollOptions& o = {});
  WorkPtr broadcast(void* buffer, size_t count, DataType type, int root, cudaStream_t stream,
                    const CollOptions& o = {});
  // recv is significant on root only (may be null elsewhere).
  WorkPtr reduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op, int root,
                 cudaStream_t stream, const CollOptions& o = {});
  // send and recv hold size() * count elements; block r goes to / came from rank r.
  WorkPtr alltoall(const void* send, void* recv, size_t count, DataType type, cudaStream_t stream,
                   const CollOptions& o = {});
  // Counts and displacements in elements, one per rank.
  WorkPtr alltoallv(const void* send, const std::vector<size_t>& send_counts,
                    const std::vector<size_t>& send_displs, void* recv,
                    const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                    DataType type, cudaStream_t stream, const CollOptions& o = {});
  // recv (root only) holds size() * count elements.
  WorkPtr gather(const void* send, void* recv, size_t count, int root, DataType type, cudaStream_t stream,
                 const CollOptions& o = {});
  // send (root only) holds size() * count elements.
  WorkPtr scatter(const void* send, void* recv, size_t count, int root, DataType type, cudaStream_t stream,
                  const CollOptions& o = {});
  // Later work on `stream` starts after every rank reached the barrier on its stream.
  WorkPtr barrier(cudaStream_t stream, const CollOptions& o = {});
  // Point to point (NCCL); `tag` is checked like the host API's but NCCL matches in order.
  WorkPtr send(const void* data, size_t count, DataType type, int peer, uint32_t tag, cudaStream_t stream,
               const CollOptions& o = {});
  WorkPtr recv(void* data, size_t count, DataType type, int peer, uint32_t tag, cudaStream_t stream,
               const CollOptions& o = {});

  // NCCL group semantics (batch_isend_irecv): NCCL operations issued between
  // groupStart() and groupEnd() are launched together at groupEnd(), which returns
  // the group's Work; heap algorithms inside a group are enqueued at their call.
  void groupStart();
  WorkPtr groupEnd();

  // Collective (same bytes, same order on every rank): a buffer of this object's CUDA
  // heap. Collectives whose buffers lie inside it skip the staging copy, and NCCL
  // registers it as a window (symmetric kernels). Keep it alive while in use.
  std::shared_ptr<symm::SymmetricBuffer> allocateSymmetric(size_t bytes);

  // Whether the heap algorithms are usable here, or why not ("" = usable).
  const std::string& heapUnavailableReason() const;
  // Whether an NCCL communicator exists (it is created lazily by the first NCCL call).
  bool ncclCreated() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace crossbar
