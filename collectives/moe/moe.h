// Two-level hierarchical MoE all-to-all (expert parallelism): dispatch tokens to the ranks
// that hold their top-k experts, combine the experts' outputs back. Host-memory path.
//
//   MoeConfig cfg{.max_tokens = 4096, .hidden = 7168, .topk = 8, .num_experts = 256};
//   auto buf = MoeBuffer::create(comm, cfg);                 // collective
//   auto d = buf->dispatch(x, tokens, topk_idx, topk_weights); // collective
//   ... experts: y[i] = sum_j d.topk_weights[i, j] * expert_{d.topk_idx[i, j]}(d.x[i]) ...
//   auto c = buf->combine(y.data(), DataType::kBFloat16, *d.handle);  // collective
//
// Placement: expert e lives on rank e / (E / R). Routing (DeepEP's design): a token goes
// over the network at most once per destination node, to the rank there with the sender's
// local index, modulo that node's size when nodes differ (its "forwarder"); the forwarder (or the sender itself for its own node)
// writes it once per destination rank into that rank's symmetric buffer. Combine mirrors
// it: each rank writes its outputs back to the forwarder, which sums them (f32) before
// the partial sums cross the network once per node; the source sums the nodes' partials.
//
// Received tokens are ordered by (source rank, source token). Every call is collective
// over the communicator, in the same order on every rank; one call at a time per buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "collectives/dtype.h"
#include "collectives/quant.h"
#include "comm/communicator.h"

namespace crossbar::moe {

// Wire format of dispatched activations.
enum class PayloadFormat {
  kNative,  // x's own type (bf16 or f32), bit exact
  kFp8,     // e4m3, one f32 scale per 128 channels (DeepSeek-V3)
  kMxfp8,   // OCP MXFP8: e4m3, E8M0 scale per 32
  kNvfp4,   // e2m1 packed, E4M3 scale per 16, f32 per-tensor scale (of the source rank's x)
};
const char* payloadFormatName(PayloadFormat f);
// The codec of a quantized format (kNative has none: InvalidArgument).
PayloadCodec payloadCodec(PayloadFormat f);

struct MoeConfig {
  size_t max_tokens = 0;  // per rank and call (dispatch's `tokens` <= this)
  size_t hidden = 0;
  int topk = 0;
  int num_experts = 0;                   // multiple of the communicator size
  DataType dtype = DataType::kBFloat16;  // x and the received tokens: kBFloat16 or kFloat32
  PayloadFormat format = PayloadFormat::kNative;
  // Also hand the received quantized payload and scales to the caller (DispatchResult::q_*).
  bool return_quantized = false;
  // Fill DispatchResult::x_expert_major (one copy of x per (row, local expert)). false: only
  // the expert-major index (expert_offsets / expert_rows / expert_weights) is filled, which
  // saves that copy for callers that gather rows themselves or use the row-major x.
  bool expert_major_copy = true;
  // Per local expert, the most (token, expert) assignments a rank accepts per dispatch; the
  // rest are dropped (index -1, weight 0) in (source rank, token) order. -1: no limit.
  int64_t expert_capacity = -1;
  // Tokens per pipelined chunk: the network phase of chunk k+1 overlaps the intra-node phase
  // of chunk k (dispatch) and the reduction of chunk k+1 overlaps chunk k's network transfer
  // (combine). 0: one chunk; -1: CROSSBAR_MOE_CHUNK_TOKENS. Results do not depend on it.
  int64_t chunk_tokens = -1;
  // Type of combine's partial sums on the network: kFloat32 (exact f32 sums) or kBFloat16
  // (DeepEP's choice: half the bytes, each node's partial rounded once to bf16).
  DataType combine_wire = DataType::kFloat32;
  Millis timeout{0};  // 0: the communicator's
};

// Routing statistics of one rank's tokens (DeepEP's get_dispatch_layout).
struct Layout {
  size_t tokens = 0;
  std::vector<int> tokens_per_rank;       // [ranks]: tokens with an expert on that rank
  std::vector<int> tokens_per_node;       // [nodes]
  std::vector<int> tokens_per_expert;     // [experts]
  std::vector<uint8_t> is_token_in_rank;  // [tokens x ranks]
  size_t token_expert_pairs = 0;          // valid (token, expert) entries
  size_t token_rank_pairs = 0;            // distinct (token, rank)
  size_t token_node_pairs = 0;            // distinct (token, node)
  size_t remote_token_node_pairs = 0;     // ... with a node other than this rank's
  size_t remote_token_expert_pairs = 0;   // (token, expert) with the expert on another node
};

// What one rank moved in one dispatch or combine.
struct MoeMetrics {
  uint64_t inter_node_bytes = 0;  // sent over the network
  uint64_t intra_node_bytes = 0;  // written into other local ranks' symmetric buffers
  uint64_t flat_bytes = 0;        // a flat all-to-all: one row per off-rank (token, expert)
  double dedup_factor = 1.0;      // flat_bytes / (inter + intra)
  double network_dedup = 1.0;     // off-node (token, expert) pairs / off-node (token, node) pairs
  uint64_t dropped = 0;           // (token, expert) assignments over expert_capacity (receiver)
  double expert_imbalance = 1.0;  // max / mean of received tokens per local expert
  // Wall time of the call's phases on this rank (seconds), in first-seen order: where the
  // time goes (CPU work such as "encode"/"decode" vs waits such as "wait net"/"wait local").
  std::vector<std::pair<const char*, double>> phases;
};

// Routing state of a dispatch, reused by combine and by a cached dispatch with the same
// topk_idx. Opaque.
struct MoeHandle;

// x already quantized by the caller (DeepEP / DeepSeek-V3's fp8 path: the activations are
// quantized once for the fp8 expert GEMMs anyway): the codes and scales of the buffer's
// payload format, row-major, one row per token. Dispatch sends these bytes as they are (no
// encode); the received rows are bit-identical to dispatching the dequantizable x they came
// from with the buffer's own encoder when they are that encoder's bytes.
//   kFp8    payload e4m3 [tokens x hidden], scales f32 [tokens x ceil(hidden / 128)]
//   kMxfp8  payload e4m3 [tokens x hidden], scales E8M0 [tokens x ceil(hidden / 32)]
//   kNvfp4  payload e2m1 packed (low nibble first) [tokens x ceil(hidden / 2)], scales e4m3
//           [tokens x ceil(hidden / 16)], plus the per-tensor global_scale the codes use
struct QuantizedTokens {
  PayloadFormat format = PayloadFormat::kFp8;  // must be the buffer's format
  const void* payload = nullptr;
  const void* scales = nullptr;
  // Bytes per token of the caller's arrays: must be payloadBytes / scaleBytes of the format's
  // codec for the buffer's hidden size (checked: a wrong shape is InvalidUsage, not a misread).
  size_t payload_row_bytes = 0;
  size_t scale_row_bytes = 0;
  float global_scale = 1.0f;  // kNvfp4 only: nvfp4GlobalScale of the caller's tensor
};

// Which forms of the received tokens a dispatch returns (quantized payload formats).
enum class RecvOutput {
  kConfig,       // x (dequantized), plus q_* when MoeConfig::return_quantized
  kDequantized,  // x only
  kQuantized,    // q_payload / q_scales / q_global_scale only: no decode, x stays empty
                 // (DeepEP's fp8 recv_x: codes + scales for the fp8 expert GEMMs)
  kBoth,         // x and q_*
};

struct DispatchResult {
  size_t num_recv = 0;
  std::vector<uint8_t> x;                    // [num_recv x hidden] in MoeConfig::dtype (dequantized)
  std::vector<int32_t> src_rank, src_token;  // [num_recv]
  std::vector<int> recv_per_rank;            // [ranks]: rows from each source (rows are grouped by source)
  std::vector<int64_t> topk_idx;             // [num_recv x topk]: local expert id, -1 if not on this rank
  std::vector<float> topk_weights;           // [num_recv x topk]: 0 where topk_idx is -1
  std::vector<int> tokens_per_expert;        // [local experts]
  // Expert-major copy: rows of local expert e are [expert_offsets[e], expert_offsets[e+1]).
  std::vector<int> expert_offsets;      // [local experts + 1]
  std::vector<int32_t> expert_rows;     // row of x each expert-major row copies
  std::vector<float> expert_weights;    // its weight
  std::vector<uint8_t> x_expert_major;  // [expert_rows.size() x hidden] in MoeConfig::dtype (expert_major_copy)
  // Quantized form (return_quantized / RecvOutput::kQuantized / kBoth): payloadBytes /
  // scaleBytes per row as on the wire, and each row's nvfp4 per-tensor scale (its source's).
  std::vector<uint8_t> q_payload, q_scales;
  std::vector<float> q_global_scale;
  // ... and its expert-major copy (expert_major_copy; rows as x_expert_major's).
  std::vector<uint8_t> q_payload_expert_major, q_scales_expert_major;
  std::shared_ptr<const MoeHandle> handle;
  MoeMetrics metrics;
};

struct CombineResult {
  std::vector<float> out;  // [tokens x hidden]: per source token, the sum of its rows' y
  MoeMetrics metrics;
};

class MoeBuffer {
 public:
  // Collective. InvalidArgument for a bad config (E not divisible by R, dtype, sizes).
  static std::unique_ptr<MoeBuffer> create(std::shared_ptr<Communicator> comm, const MoeConfig& config);
  ~MoeBuffer();

  // Local: routing statistics of topk_idx [tokens x topk] (-1 = no expert).
  // InvalidArgument for an expert id outside [-1, num_experts) or E % R != 0.
  Layout layout(const int64_t* topk_idx, size_t tokens, int num_experts) const;

  // Collective. x: [tokens x hidden] in config dtype; topk_idx/topk_weights: [tokens x topk]
  // (weights may be null: 1). With `cached` (a handle from an earlier dispatch of the same
  // topk_idx) the layout step is skipped and the routing reused. `recycle` (optional): an
  // earlier result the caller is done with; its x / x_expert_major / q_* memory is reused
  // for the new result where its capacity suffices (a fresh x of tens of MB costs page
  // faults on every call, as much as decoding it). Afterwards `recycle` holds only the
  // arrays the result did not take (too small, or not produced by this buffer's config),
  // untouched in the same memory; everything else of it is cleared. If the call throws,
  // `recycle` keeps its arrays (same memory).
  DispatchResult dispatch(const void* x, size_t tokens, const int64_t* topk_idx, const float* topk_weights,
                          std::shared_ptr<const MoeHandle> cached = nullptr,
                          DispatchResult* recycle = nullptr);

  // Every dispatch option (the call above is dispatch({.tokens, .x, .topk_idx, ...})).
  struct DispatchArgs {
    size_t tokens = 0;
    const void* x = nullptr;                       // [tokens x hidden] in MoeConfig::dtype, or
    const QuantizedTokens* x_quantized = nullptr;  // pre-quantized x (quantized formats; x null)
    const int64_t* topk_idx = nullptr;
    const float* topk_weights = nullptr;
    std::shared_ptr<const MoeHandle> cached;
    DispatchResult* recycle = nullptr;
    RecvOutput output = RecvOutput::kConfig;
  };
  // Collective. Input and output forms are independent: pre-quantized in + x out = decode
  // only; x in + kQuantized out = encode only; both = no codec work at all. InvalidUsage
  // (naming rank and operation, before any traffic) for a format mismatch, x and x_quantized
  // both or neither given, wrong row byte counts, or a quantized form on a native buffer.
  DispatchResult dispatch(const DispatchArgs& args);

  // Collective. y: [handle's num_recv x hidden] of y_type (kBFloat16 or kFloat32), rows as
  // dispatch returned them; weights (optional, [num_recv]) scale each row. Sums in f32.
  CombineResult combine(const void* y, DataType y_type, const MoeHandle& handle,
                        const float* weights = nullptr);

  // Combine of expert-major outputs ([expert_rows.size() x hidden]): rows of one token are
  // summed here (times `weights` per expert-major row when given), then combine().
  CombineResult combineExpertMajor(const void* y, DataType y_type, const DispatchResult& dispatched,
                                   const float* weights = nullptr);

  const MoeConfig& config() const;
  int numLocalExperts() const;
  size_t rowBytes() const;  // one token on the wire (header, routing, scales, payload)

 private:
  struct Impl;
  explicit MoeBuffer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The handle's row count (for sizing y).
size_t handleNumRecv(const MoeHandle& handle);

}  // namespace crossbar::moe
