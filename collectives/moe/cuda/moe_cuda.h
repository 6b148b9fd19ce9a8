// Two-level MoE dispatch / combine on CUDA device memory: the host path's API and results
// (moe.h; same layout, row order, local expert ids, capacity, expert-major index, f32
// combine, payload formats with the same bytes), enqueued on the caller's stream like NCCL.
//
//   CudaMoeBuffer::Options o{.device = local_rank};
//   auto buf = CudaMoeBuffer::create(comm, cfg, o);                          // collective
//   auto d = buf->dispatch(d_x, tokens, d_topk_idx, d_topk_weights, stream);  // collective
//   experts<<<..., stream>>>(d.x, d.topk_idx, d.topk_weights, d_y);
//   auto c = buf->combine(d_y, DataType::kBFloat16, *d.handle, stream);      // c.out: device
//   buf->synchronize(stream, deadline);                                       // optional, bounded
//
// Data path: every rank quantizes (or copies) each token once into a wire record (kernels,
// collectives/moe/cuda/moe_codec.h). Across nodes the records bound for node m go in one NCCL
// send to the rank there with the sender's local index (the forwarder), which writes them
// inside its node. Within a node, kernels write each record once per destination rank
// straight into that rank's CUDA symmetric buffer (VMM memory mapped on every local GPU,
// symmem/cuda) at its final slot, then signal with a stream memory operation; the receiver's
// stream waits for the signals and decodes (dequantize kernels) into (source rank, token)
// order. Combine mirrors it: each rank writes its f32 (weighted) rows back to the
// forwarders' symmetric buffers, the forwarders sum them and send each remote node its
// partial sums in one NCCL send, and the source sums the nodes' partials in node order.
// Sums follow the host path's order, so results are bit-identical to it.
//
// Host blocking: a dispatch without a cached handle waits (bounded by the deadline) for
// topk_idx to be readable on the host (a device-to-host copy on `stream`, so it waits for the
// work queued before it) and for the routing metadata exchange, a host p2p exchange over the
// communicator (cuda/moe_cuda_plan.h) that tells every rank where its rows go and where the
// rows it receives land. A dispatch with a cached handle and every combine only enqueue
// work. The GPU waits on signals without a deadline: use synchronize() (or your own event
// with a deadline) to bound it.
//
// Several nodes: the NCCL phase runs on an internal second stream, forked from and joined
// back into `stream` within the call (events), so that the intra-node delivery of the own
// node's tokens (dispatch) and the sum of the own node's rows (combine) overlap the network;
// each call's work is complete once `stream` has reached its end, as before.
//
// Every call is collective, in the same order on every rank; one stream at a time per buffer
// (calls on different streams must be ordered by the caller). Results are device memory
// owned by the result object, valid once `stream` has reached the call. They come from
// Options::allocate (default: cudaMalloc, freed with cudaFree when the result goes away, which
// synchronizes the device; a stream-ordered allocator such as torch's caching allocator
// avoids that, see torch_backend/bind_moe.cc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "collectives/moe/moe.h"
#include "comm/deadline.h"

namespace crossbar::moe {

struct CudaMoeHandle;

// Device memory, released by its deleter when the last owner goes away.
using DeviceStorage = std::shared_ptr<void>;
// Per-call device memory (results, a dispatch's routing indices, combine temporaries) of
// `bytes` (> 0) for work enqueued on `stream`; must stay valid until the storage's last owner
// goes away and the stream has passed the work that uses it (stream-ordered allocators free
// into the allocating stream, which is `stream`). Null: cudaMalloc / cudaFree.
using DeviceAllocator = std::function<DeviceStorage(size_t bytes, cudaStream_t stream)>;

struct CudaDispatchResult {
  size_t num_recv = 0;
  // Device arrays (null when empty), shapes as in DispatchResult.
  void* x = nullptr;  // [num_recv x hidden] in MoeConfig::dtype
  const int32_t* src_rank = nullptr;
  const int32_t* src_token = nullptr;
  const int64_t* topk_idx = nullptr;  // [num_recv x topk]: local expert or -1
  float* topk_weights = nullptr;      // [num_recv x topk]
  const int32_t* expert_rows = nullptr;
  float* expert_weights = nullptr;
  void* x_expert_major = nullptr;  // expert_major_copy
  uint8_t* q_payload = nullptr;    // quantized form (return_quantized / RecvOutput::kQuantized / kBoth)
  uint8_t* q_scales = nullptr;
  float* q_global_scale = nullptr;
  uint8_t* q_payload_expert_major = nullptr;  // ... its expert-major copy (expert_major_copy)
  uint8_t* q_scales_expert_major = nullptr;
  // Host copies of the counts (known when dispatch returns).
  std::vector<int> recv_per_rank, tokens_per_expert, expert_offsets;
  std::shared_ptr<const CudaMoeHandle> handle;
  MoeMetrics metrics;
  std::vector<DeviceStorage> storage;  // owns the arrays above
};

struct CudaCombineResult {
  float* out = nullptr;  // device [tokens x hidden]
  MoeMetrics metrics;
  DeviceStorage storage;
};

class CudaMoeBuffer {
 public:
  struct Options {
    int device = -1;  // CUDA device of this rank; -1: the current device
    DeviceAllocator allocate = nullptr;  // per-call device memory (see DeviceAllocator); null: cudaMalloc
  };
  // Collective. InvalidArgument for a bad config (as MoeBuffer), Unsupported without a CUDA
  // device / driver, more than 8 ranks per node, or a heap that cannot map the peers' GPU
  // memory. Several nodes need NCCL (created here; NCCL refuses two ranks on one GPU).
  static std::unique_ptr<CudaMoeBuffer> create(std::shared_ptr<Communicator> comm, const MoeConfig& config,
                                               Options options);
  static std::unique_ptr<CudaMoeBuffer> create(std::shared_ptr<Communicator> comm, const MoeConfig& config) {
    return create(std::move(comm), config, Options{});
  }
  ~CudaMoeBuffer();

  // Local: routing statistics of a host topk_idx (MoeBuffer::layout).
  Layout layout(const int64_t* topk_idx, size_t tokens, int num_experts) const;

  // Collective. x: device [tokens x hidden] (config dtype); topk_idx (int64) / topk_weights
  // (f32, may be null: 1): device [tokens x topk]. `cached`: a handle of an earlier dispatch
  // of the same topk_idx (every rank passes its own): no host blocking at all.
  CudaDispatchResult dispatch(const void* x, size_t tokens, const int64_t* topk_idx, const float* topk_weights,
                              cudaStream_t stream, std::shared_ptr<const CudaMoeHandle> cached = nullptr);
  // Collective. MoeBuffer::dispatch(DispatchArgs)'s options on device memory: x or
  // x_quantized (device codes and scales, copied into the wire records as they are; the
  // nvfp4 global_scale is a host value), output forms as on the host (x null when not
  // returned); the same checks (InvalidUsage). args.cached must be null (a host handle; the
  // cached CUDA handle is `cached`, as above); args.recycle is ignored (results come from
  // Options::allocate).
  CudaDispatchResult dispatch(const MoeBuffer::DispatchArgs& args, cudaStream_t stream,
                              std::shared_ptr<const CudaMoeHandle> cached = nullptr);

  // Collective. y: device [num_recv x hidden] of y_type (bf16 / f32), rows as dispatched;
  // weights: optional device [num_recv]. Sums in f32; out = per source token the sum.
  CudaCombineResult combine(const void* y, DataType y_type, const CudaMoeHandle& handle, cudaStream_t stream,
                            const float* weights = nullptr);

  // Collective. Combine of expert-major outputs (y: device [expert_rows x hidden]): the rows of
  // one token are summed first (times `weights` per expert-major row when given), as
  // MoeBuffer::combineExpertMajor.
  CudaCombineResult combineExpertMajor(const void* y, DataType y_type, const CudaDispatchResult& dispatched,
                                       cudaStream_t stream, const float* weights = nullptr);

  // Waits for the work queued on `stream` so far; Timeout (naming the buffer's last call)
  // when the deadline passes first, CudaError when it failed.
  void synchronize(cudaStream_t stream, Deadline deadline) const;

  const MoeConfig& config() const;
  int numLocalExperts() const;
  size_t rowBytes() const;
  int device() const;

  struct Impl;

 private:
  explicit CudaMoeBuffer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

size_t handleNumRecv(const CudaMoeHandle& handle);
size_t handleTokens(const CudaMoeHandle& handle);  // tokens of the dispatch (rows of combine's out)
// The device memory of a handle's routing indices (src_rank, src_token, topk_idx, expert_rows
// of its dispatch point into it); every combine with the handle reads it on its stream.
DeviceStorage handleStorage(const CudaMoeHandle& handle);

}  // namespace crossbar::moe
