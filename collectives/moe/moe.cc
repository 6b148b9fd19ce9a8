// Host path of the two-level MoE all-to-all (see moe.h). Phases of a dispatch:
//   1. network: the tokens bound for node m go, once each, to the rank of node m that
//      forwards for this rank (MoeTopology::forwarderOn: the same local index on even nodes;
//      one stream per node: a count, then wire rows);
//   2. forward: every rank holds its "forwarded set" F (its own tokens for its node, then
//      those each rank it forwards for sent it) and writes each row once per destination
//      rank of its node into that rank's symmetric buffer (slot = the writer's local index);
//   3. receive: rows are decoded in (source rank, token) order.
// Combine runs the same paths backwards with f32 partial sums.
#include "collectives/moe/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <thread>

#include "collectives/float_types.h"
#include "collectives/moe/host_codec.h"
#include "collectives/moe/moe_plan.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"
#include "comm/progress.h"
#include "symmem/symmetric_heap.h"

namespace crossbar::moe {

const char* payloadFormatName(PayloadFormat f) {
  switch (f) {
    case PayloadFormat::kNative:
      return "native";
    case PayloadFormat::kFp8:
      return "fp8";
    case PayloadFormat::kMxfp8:
      return "mxfp8";
    case PayloadFormat::kNvfp4:
      return "nvfp4";
  }
  return "unknown";
}

PayloadCodec payloadCodec(PayloadFormat f) {
  switch (f) {
    case PayloadFormat::kFp8:
      return PayloadCodec::kFp8Block128;
    case PayloadFormat::kMxfp8:
      return PayloadCodec::kMxfp8;
    case PayloadFormat::kNvfp4:
      return PayloadCodec::kNvfp4;
    default:
      throw InvalidArgument("payloadCodec: the native format has no codec");
  }
}

struct MoeHandle {
  const void* owner = nullptr;
  size_t tokens = 0, num_recv = 0;
  size_t chunk = 1;                             // rows per network chunk this rank sends
  std::vector<std::vector<int32_t>> node_send;  // [node]: own tokens bound for it, in order
  // F, the rows this rank forwards, a block per source (MoeTopology::fwd_sources; [0] is the
  // own rows for this node): source s's are F[fwd_start[s], + fwd_count[s]), sent to us in
  // chunks of fwd_chunk[s] rows.
  std::vector<size_t> fwd_start, fwd_count, fwd_chunk;
  std::vector<std::vector<int32_t>> fwd_to_local;  // [local j]: F indices written to local rank j, in order
  std::vector<std::vector<int32_t>> recv_rows;     // [local j]: output row of forwarder j's p-th row
  Layout stats;                                    // counts only (is_token_in_rank left empty)
};

size_t handleNumRecv(const MoeHandle& h) {
  return h.num_recv;
}

namespace {

constexpr size_t align16(size_t v) {
  return (v + 15) & ~size_t{15};
}
// Tags: 'M', below kInternalTagBase; each call owns 2^16 tags (one per network chunk).
constexpr uint32_t kTagBase = 0x4D000000u;
constexpr uint32_t kTagCalls = 0x800;
constexpr size_t kMaxChunks = 0xFFFF;
// Network messages of a dispatch to one node: at least one (it carries the row count).
size_t dispatchChunks(size_t rows, size_t chunk) {
  return std::max<size_t>(1, (rows + chunk - 1) / chunk);
}
// Data messages of a dispatch to one node (the header is a message of its own).
size_t dataChunks(size_t rows, size_t chunk) {
  return (rows + chunk - 1) / chunk;
}
// A dispatch slot (one per forwarder in each rank's buffer) starts with a header:
// [rows written so far][state][rows per source rank x R], then the rows. State: the
// forwarder's signals this call (low 32 bits) and these flags.
constexpr uint64_t kSlotCounts = uint64_t{1} << 32;  // rows per source node are filled in
constexpr uint64_t kSlotFinal = uint64_t{1} << 33;   // every row is in
// Rows a forwarder decodes between two looks at its network (dispatch).
constexpr size_t kDecodeBatch = 16;
enum Channel { kDispatchData = 0, kDispatchAck = 1, kCombineData = 2, kCombineAck = 3, kNumChannels = 4 };

// There is no progress thread: the CPU drives pending network requests between rows.
void pump(const std::vector<RequestPtr>& reqs) {
  for (const auto& r : reqs)
    if (!r->done()) {
      r->test();
      return;
    }
}

// Accumulates wall time per named phase into MoeMetrics::phases: lap(name) charges the time
// since the previous lap to `name`.
class PhaseClock {
 public:
  explicit PhaseClock(std::vector<std::pair<const char*, double>>& out) : out_(out) {}
  void lap(const char* name) {
    const auto now = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    for (auto& p : out_)
      if (std::strcmp(p.first, name) == 0) {
        p.second += s;
        return;
      }
    out_.emplace_back(name, s);
  }

 private:
  std::vector<std::pair<const char*, double>>& out_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

}  // namespace

struct MoeBuffer::Impl {
  std::shared_ptr<Communicator> comm;
  MoeConfig cfg;
  MoeTopology topo;  // nodes, forwarders and experts (moe_plan.h, shared with the CUDA executor)
  size_t es = 2;                             // element size of cfg.dtype
  size_t off_topk = 0, off_w = 0, off_scales = 0, off_payload = 0, scale_bytes = 0, payload_bytes = 0;
  size_t row = 0, fmax = 0, dslot = 0, cslot = 0, slot_hdr = 16;
  std::vector<uint64_t> dsig_base;  // [local j]: dispatch-data signals forwarder j sent before this call
  size_t chunk = 1;          // rows per network chunk
  size_t net_msg = 0;        // bytes per network message (a chunk is several); 0: one per chunk
  std::vector<uint8_t> enc;  // this call's encoded tokens
  symm::SymmetricHeap heap;
  std::shared_ptr<symm::SymmetricBuffer> dbuf, cbuf;
  uint64_t dispatches = 0, combines = 0, ops = 0;
  std::vector<std::vector<uint8_t>> net_send, net_recv;  // [node]
  // Combine's scratch, kept across calls: fresh tens of MB per call cost page faults.
  std::vector<std::vector<uint8_t>> comb_back;  // [node]: partials coming back
  std::vector<float> comb_acc;                  // [F rows x hidden]: this forwarder's sums
  std::vector<uint8_t> comb_acc16;              // ... as bf16 for the wire

  std::string ctx(const char* op) const { return errorContext(topo.rank, op); }
  Deadline deadline() const {
    return cfg.timeout.count() > 0 ? Deadline::after(cfg.timeout) : comm->defaultDeadline();
  }
  uint32_t opTag() { return kTagBase + (static_cast<uint32_t>(ops++ % kTagCalls) << 16); }
  bool quantized() const { return cfg.format != PayloadFormat::kNative; }

  Layout layout(const int64_t* topk_idx, size_t tokens, int num_experts, const char* op) const;
  // A chunk crosses the network as messages of at most net_msg bytes on one tag (matched in
  // order): small enough to go eagerly, so no chunk waits for a rendezvous reply.
  size_t pieceBytes(size_t bytes) const { return net_msg ? net_msg : bytes; }
  void sendPieces(std::vector<RequestPtr>& out, const uint8_t* p, size_t bytes, int peer, uint32_t tag) {
    const size_t step = pieceBytes(bytes);
    for (size_t off = 0; off < bytes; off += step)
      out.push_back(comm->isend(p + off, std::min(step, bytes - off), peer, tag));
  }
  std::vector<RequestPtr> recvPieces(uint8_t* p, size_t bytes, int peer, uint32_t tag) {
    std::vector<RequestPtr> out;
    const size_t step = pieceBytes(bytes);
    for (size_t off = 0; off < bytes; off += step)
      out.push_back(comm->irecv(p + off, std::min(step, bytes - off), peer, tag));
    return out;
  }
  // Waits until on-node `peer`'s signal counter on `channel` of `buf` reaches `value`,
  // progressing the network meanwhile while any of `reqs` is pending (a sleeping rank would
  // leave its peers' rendezvous unanswered and its sockets undrained).
  void waitCounter(symm::SymmetricBuffer& buf, int peer, int channel, uint64_t value,
                   const std::vector<std::vector<RequestPtr>>& reqs, Deadline dl, const char* op) const {
    while (buf.signalValue(peer, channel) < value) {
      RequestPtr pending;
      for (const auto& list : reqs)
        for (const auto& r : list)
          if (!pending && !r->done()) pending = r;
      if (!pending || !pending->engine()) {
        buf.waitSignalValue(peer, channel, value, dl);
        return;
      }
      if (dl.expired())
        throw Timeout(ctx(op) + fmt::format("rank {} did not write its rows within the deadline; check that "
                                            "every rank calls combine",
                                            peer),
                      {peer});
      pending->engine()->waitUntil([&] { return pending->done() || buf.signalValue(peer, channel) >= value; },
                                   Deadline::after(Millis(1)));
    }
  }
  // One wire record of token t: x encoded, or with `xq` its codes and scales copied as they are.
  void encodeRow(const void* x, const QuantizedTokens* xq, size_t t, const int64_t* topk_idx, const float* w,
                 float gscale, uint8_t* out) const;
  RowFormat fmt;  // the wire record (makeRowFormat)
  void decodeRow(const uint8_t* rec, void* out) const;
};

MoeBuffer::MoeBuffer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeBuffer::~MoeBuffer() = default;
const MoeConfig& MoeBuffer::config() const {
  return impl_->cfg;
}
int MoeBuffer::numLocalExperts() const {
  return impl_->topo.epr;
}
size_t MoeBuffer::rowBytes() const {
  return impl_->row;
}

std::unique_ptr<MoeBuffer> MoeBuffer::create(std::shared_ptr<Communicator> comm, const MoeConfig& cfg) {
  if (!comm) throw InvalidArgument("MoeBuffer::create: null communicator");
  auto im = std::make_unique<Impl>();
  im->comm = comm;
  im->cfg = cfg;
  const char* op = "moe create";
  im->topo = makeTopology(*comm, cfg, op);
  {
    const RowFormat f = makeRowFormat(cfg);
    im->fmt = f;
    im->es = f.es;
    im->off_topk = f.off_topk;
    im->off_w = f.off_w;
    im->off_scales = f.off_scales;
    im->off_payload = f.off_payload;
    im->scale_bytes = f.scale_bytes;
    im->payload_bytes = f.payload_bytes;
    im->row = f.row;
  }
  // A forwarder's F: at most max_tokens rows from each source it forwards for.
  im->fmax = static_cast<size_t>(im->topo.max_sources) * cfg.max_tokens;
  {
    const int64_t ct = cfg.chunk_tokens != -1 ? cfg.chunk_tokens : env::getInt("CROSSBAR_MOE_CHUNK_TOKENS");
    if (ct < 0)
      throw InvalidArgument(im->ctx(op) + fmt::format("chunk of {} tokens: use 0 (no pipelining) or more "
                                                      "(CROSSBAR_MOE_CHUNK_TOKENS / MoeConfig::chunk_tokens)",
                                                      ct));
    im->chunk = ct == 0 ? cfg.max_tokens : std::min<size_t>(static_cast<size_t>(ct), cfg.max_tokens);
    im->chunk = std::max(im->chunk, (cfg.max_tokens + kMaxChunks - 1) / kMaxChunks);
  }
  im->slot_hdr = align16(16 + 8 * static_cast<size_t>(im->topo.R));
  im->dslot = im->slot_hdr + im->fmax * im->row;
  {
    const int64_t mb = env::getInt("CROSSBAR_MOE_NET_MESSAGE_BYTES");
    if (mb < 0)
      throw InvalidArgument(im->ctx(op) + fmt::format("CROSSBAR_MOE_NET_MESSAGE_BYTES={}: use 0 (one message per "
                                                      "chunk) or a positive size",
                                                      mb));
    im->net_msg = static_cast<size_t>(mb);
  }
  im->dsig_base.assign(im->topo.L, 0);
  im->cslot = im->fmax * cfg.hidden * sizeof(float);

  symm::HeapOptions ho;
  ho.channels = kNumChannels;
  ho.name = "moe";
  ho.remote_access = false;  // off-node traffic goes through the communicator's p2p
  im->heap = symm::SymmetricHeap::create(comm, ho);
  // A slot per forwarder of the largest node: the same size on every rank.
  im->dbuf = im->heap.allocate(static_cast<size_t>(im->topo.max_node) * im->dslot);
  im->cbuf = im->heap.allocate(static_cast<size_t>(im->topo.max_node) * im->cslot);
  im->net_send.resize(im->topo.N);
  im->net_recv.resize(im->topo.fwd_sources.size());
  CB_INFO("moe",
          "MoE buffer: {} experts, top-{}, hidden {}, {} ({}), {} nodes, {} ranks on this one, row {} B",
          cfg.num_experts, cfg.topk, cfg.hidden, payloadFormatName(cfg.format),
          cfg.dtype == DataType::kFloat32 ? "f32" : "bf16", im->topo.N, im->topo.L, im->row);
  return std::unique_ptr<MoeBuffer>(new MoeBuffer(std::move(im)));
}

Layout MoeBuffer::Impl::layout(const int64_t* topk_idx, size_t tokens, int num_experts,
                               const char* op) const {
  return computeLayout(topo, cfg.topk, topk_idx, tokens, num_experts, ctx(op));
}

Layout MoeBuffer::layout(const int64_t* topk_idx, size_t tokens, int num_experts) const {
  return impl_->layout(topk_idx, tokens, num_experts, "moe layout");
}

void MoeBuffer::Impl::encodeRow(const void* x, const QuantizedTokens* xq, size_t t, const int64_t* topk_idx,
                                const float* w, float gscale, uint8_t* out) const {
  const size_t k = static_cast<size_t>(cfg.topk), H = cfg.hidden;
  RowHeader hdr{topo.rank, static_cast<int32_t>(t), gscale, 0};
  std::memcpy(out, &hdr, sizeof hdr);
  std::memcpy(out + off_topk, topk_idx + t * k, 8 * k);
  float* wo = reinterpret_cast<float*>(out + off_w);
  for (size_t j = 0; j < k; ++j) wo[j] = w ? w[t * k + j] : 1.0f;
  if (xq) {
    std::memcpy(out + off_scales, static_cast<const uint8_t*>(xq->scales) + t * scale_bytes, scale_bytes);
    std::memcpy(out + off_payload, static_cast<const uint8_t*>(xq->payload) + t * payload_bytes, payload_bytes);
    return;
  }
  const char* src = static_cast<const char*>(x) + t * H * es;
  if (!quantized()) {
    std::memcpy(out + off_payload, src, H * es);
  } else if (cfg.dtype == DataType::kFloat32) {
    encodeRowHost(payloadCodec(cfg.format), reinterpret_cast<const float*>(src), H, out + off_payload,
                  out + off_scales, gscale);
  } else {
    encodeRowHost(payloadCodec(cfg.format), reinterpret_cast<const BFloat16*>(src), H, out + off_payload,
                  out + off_scales, gscale);
  }
}

void MoeBuffer::Impl::decodeRow(const uint8_t* rec, void* out) const {
  const size_t H = cfg.hidden;
  if (!quantized()) {
    std::memcpy(out, rec + off_payload, H * es);
    return;
  }
  RowHeader hdr;
  std::memcpy(&hdr, rec, sizeof hdr);
  if (cfg.dtype == DataType::kFloat32)
    decodeRowHost(payloadCodec(cfg.format), rec + off_payload, rec + off_scales, H, static_cast<float*>(out),
                  hdr.global_scale);
  else
    decodeRowHost(payloadCodec(cfg.format), rec + off_payload, rec + off_scales, H,
                  static_cast<BFloat16*>(out), hdr.global_scale);
}

DispatchResult MoeBuffer::dispatch(const void* x, size_t tokens, const int64_t* topk_idx,
                                   const float* topk_weights, std::shared_ptr<const MoeHandle> cached,
                                   DispatchResult* recycle) {
  DispatchArgs a;
  a.tokens = tokens;
  a.x = x;
  a.topk_idx = topk_idx;
  a.topk_weights = topk_weights;
  a.cached = std::move(cached);
  a.recycle = recycle;
  return dispatch(a);
}

DispatchResult MoeBuffer::dispatch(const DispatchArgs& args) {
  Impl& im = *impl_;
  const MoeTopology& topo = im.topo;
  const char* op = "moe dispatch";
  const auto& cfg = im.cfg;
  const size_t k = static_cast<size_t>(cfg.topk), H = cfg.hidden, row = im.row;
  const size_t tokens = args.tokens;
  const void* x = args.x;
  const QuantizedTokens* xq = args.x_quantized;
  const int64_t* topk_idx = args.topk_idx;
  const float* topk_weights = args.topk_weights;
  const std::shared_ptr<const MoeHandle>& cached = args.cached;
  DispatchResult* recycle = args.recycle;
  if (tokens > cfg.max_tokens)
    throw InvalidArgument(im.ctx(op) + fmt::format("{} tokens exceed the buffer's max_tokens {}: create the "
                                                   "MoeBuffer with a larger max_tokens",
                                                   tokens, cfg.max_tokens));
  if (x && xq)
    throw InvalidUsage(im.ctx(op) + "both x and a pre-quantized x given: pass one of them");
  if (xq) checkQuantizedInput(cfg, im.fmt, *xq, tokens, im.ctx(op));
  if (tokens > 0 && ((!x && !xq) || !topk_idx)) throw InvalidArgument(im.ctx(op) + "x or topk_idx is null");
  const RecvForms forms = recvForms(cfg, args.output, im.ctx(op));  // which forms of the rows to return
  const bool want_x = forms.x, want_q = forms.q;
  if (cached && cached->owner != this)
    throw InvalidArgument(im.ctx(op) + "the cached handle comes from another MoeBuffer");
  if (cached && cached->tokens != tokens)
    throw InvalidArgument(
        im.ctx(op) + fmt::format("the cached handle was made for {} tokens, not {}", cached->tokens, tokens));

  DispatchResult res;
  if (recycle) {
    // Only its memory is reused (sizeFrom(), below); nothing else of it may leak into the result.
    DispatchResult keep;
    keep.x = std::move(recycle->x);
    keep.x_expert_major = std::move(recycle->x_expert_major);
    keep.q_payload = std::move(recycle->q_payload);
    keep.q_scales = std::move(recycle->q_scales);
    keep.q_payload_expert_major = std::move(recycle->q_payload_expert_major);
    keep.q_scales_expert_major = std::move(recycle->q_scales_expert_major);
    *recycle = std::move(keep);
  }
  // If the call throws, what it took from `recycle` goes back there (a caller's views of that
  // memory stay valid).
  struct GiveBack {
    DispatchResult* to;
    DispatchResult& res;
    bool finished = false;
    ~GiveBack() {
      if (!to || finished) return;
      for (auto [dst, src] : {std::pair{&to->x, &res.x}, std::pair{&to->x_expert_major, &res.x_expert_major},
                              std::pair{&to->q_payload, &res.q_payload}, std::pair{&to->q_scales, &res.q_scales},
                              std::pair{&to->q_payload_expert_major, &res.q_payload_expert_major},
                              std::pair{&to->q_scales_expert_major, &res.q_scales_expert_major}})
        if (dst->empty()) *dst = std::move(*src);
    }
  } give_back{recycle, res};
  // `dst` sized to `bytes`, in `from`'s memory when it holds that many (every byte is
  // overwritten afterwards, so stale contents may stay: resize() only zero-fills growth past
  // the recycled size). Memory that is too small stays in `from`, untouched: a caller whose
  // tensors view it (the Python binding) keeps it valid.
  auto sizeFrom = [](std::vector<uint8_t>& dst, std::vector<uint8_t>* from, size_t bytes) {
    if (from && from->capacity() >= bytes) dst = std::move(*from);
    dst.resize(bytes);
  };
  PhaseClock clk(res.metrics.phases);
  auto h = std::make_shared<MoeHandle>();
  h->owner = this;
  h->tokens = tokens;
  h->chunk = im.chunk;
  if (cached) {
    h->node_send = cached->node_send;
    h->stats = cached->stats;
  } else {
    h->stats = im.layout(topk_idx, tokens, cfg.num_experts, op);
    h->node_send = nodeSendLists(im.topo, h->stats);
    h->stats.is_token_in_rank.clear();
  }
  const Deadline dl = im.deadline();
  const uint32_t tag = im.opTag();
  clk.lap("layout");

  // nvfp4's per-tensor scale covers this rank's whole x.
  float gscale = 1.0f;
  if (xq && cfg.format == PayloadFormat::kNvfp4) {
    gscale = xq->global_scale;  // the scale the caller's codes were made with
  } else if (cfg.format == PayloadFormat::kNvfp4) {
    // One vectorized pass over the tensor (host_codec.h; the same amax as blockAmax per row).
    const BlockAmax a = cfg.dtype == DataType::kFloat32
                            ? tensorAmaxHost(static_cast<const float*>(x), tokens * H)
                            : tensorAmaxHost(static_cast<const BFloat16*>(x), tokens * H);
    gscale = nvfp4GlobalScale(a);
  }

  // Each token is encoded (quantized) once, when first needed: straight into the network send
  // buffer of the first remote node it goes to, else (own node only) into im.enc; later uses
  // (other nodes, the own node's forwarding) read it from there.
  im.enc.resize(tokens * row);
  std::vector<const uint8_t*> encoded_at(tokens, nullptr);
  auto encodedRow = [&](int32_t t) -> const uint8_t* {
    if (!encoded_at[t]) {
      uint8_t* p = im.enc.data() + static_cast<size_t>(t) * row;
      im.encodeRow(x, xq, t, topk_idx, topk_weights, gscale, p);
      encoded_at[t] = p;
    }
    return encoded_at[t];
  };
  auto encodeInto = [&](int32_t t, uint8_t* dst) {
    if (encoded_at[t]) {
      std::memcpy(dst, encoded_at[t], row);
    } else {
      im.encodeRow(x, xq, t, topk_idx, topk_weights, gscale, dst);
      encoded_at[t] = dst;
    }
  };

  // 1. network. To each remote node's forwarder a header message [rows, chunk rows, rows for
  // each local rank of that node] (tiny: sent eagerly, it arrives ahead of any bulk data), and
  // from each source this rank forwards for the same about this node; then the rows in
  // chunks of C on tags tag+1, tag+2, ..., chunk-major (chunk c of every node is encoded and
  // sent before chunk c+1). A receiver posts all chunk receives as soon as the header is in,
  // so no chunk's rendezvous waits for a receive posted late (its reply would queue behind the
  // reverse direction's bulk data on a congested link).
  const size_t C = im.chunk;
  const auto& sources = topo.fwd_sources;  // [stream]: 0 is this rank's own rows
  const size_t S = sources.size();
  const size_t how = 2 + static_cast<size_t>(topo.max_node);  // header words out (a node's size at most)
  const size_t hw = 2 + static_cast<size_t>(topo.L);          // header words in (about this node)
  std::vector<uint64_t> hdr_out(static_cast<size_t>(topo.N) * how, 0), hdr_in(S * hw, 0);
  std::vector<RequestPtr> sends, hdr_req(S);
  size_t rounds = 0;
  for (size_t st = 1; st < S; ++st) {
    hdr_req[st] = im.comm->irecv(hdr_in.data() + st * hw, hw * 8, sources[st], tag);
    im.net_recv[st].resize(cfg.max_tokens * row);
  }
  for (int m = 0; m < topo.N; ++m) {
    if (m == topo.me_node) continue;
    const auto& list = h->node_send[m];
    const auto& there = topo.node_ranks[m];
    uint64_t* ho = hdr_out.data() + m * how;
    ho[0] = list.size();
    ho[1] = C;
    for (size_t l = 0; l < there.size(); ++l)
      ho[2 + l] = static_cast<uint64_t>(h->stats.tokens_per_rank[there[l]]);
    sends.push_back(im.comm->isend(ho, (2 + there.size()) * 8, topo.forwarderOn(m, topo.rank), tag));
    im.net_send[m].resize(list.size() * row);
    rounds = std::max(rounds, dataChunks(list.size(), C));
    res.metrics.inter_node_bytes += list.size() * row;
  }
  clk.lap("post");
  for (size_t c = 0; c < rounds; ++c)
    for (int m = 0; m < topo.N; ++m) {
      const auto& list = h->node_send[m];
      if (m == topo.me_node || c >= dataChunks(list.size(), C)) continue;
      const size_t lo = c * C, hi = std::min(list.size(), lo + C);
      uint8_t* buf = im.net_send[m].data();
      for (size_t i = lo; i < hi; ++i) encodeInto(list[i], buf + i * row);
      clk.lap("encode");
      im.sendPieces(sends, buf + lo * row, (hi - lo) * row, topo.forwarderOn(m, topo.rank),
                    tag + 1 + static_cast<uint32_t>(c));
      pump(sends);
      clk.lap("post");
    }

  // 2. forward: F = own rows for this node, then each source's rows (block per source).
  // Every row goes once to each local rank holding one of its experts, written into that
  // rank's slot for this forwarder, with its index among the rows of its source for that
  // rank in RowHeader::reserved. Own rows go first (the network is busy meanwhile), then the
  // remote chunks as they arrive. The slot header tells the receiver how many rows each
  // source sends it and how many rows are in so far (one signal per update), so receivers
  // decode rows while later chunks are still on the wire.
  for (int j = 0; j < topo.L; ++j) {
    int d = topo.localRank(j);
    if (d != topo.rank && im.dispatches > 0) im.dbuf->waitSignal(d, kDispatchAck, dl);
  }
  clk.lap("wait ack");
  std::vector<char*> slot(topo.L);  // our slot in each local rank's buffer
  std::vector<size_t> pos(topo.L, 0);
  std::vector<uint32_t> nsig(topo.L, 0);
  std::vector<int32_t> blk(static_cast<size_t>(topo.L) * topo.R, 0);  // [local j][source rank]: rows so far
  for (int j = 0; j < topo.L; ++j) {
    slot[j] = im.dbuf->peer<char>(topo.localRank(j), static_cast<size_t>(topo.me_local) * im.dslot);
    std::memset(slot[j], 0, im.slot_hdr);
  }
  auto publish = [&](int lj, uint64_t flags) {
    // Release stores: a receiver that sees a value also sees the rows and counts before it.
    auto* sh = reinterpret_cast<uint64_t*>(slot[lj]);
    __atomic_store_n(&sh[0], static_cast<uint64_t>(pos[lj]), __ATOMIC_RELEASE);
    const uint64_t state = (__atomic_load_n(&sh[1], __ATOMIC_RELAXED) & ~uint64_t{0xFFFFFFFF}) | flags;
    __atomic_store_n(&sh[1], state | ++nsig[lj], __ATOMIC_RELEASE);
    const int d = topo.localRank(lj);
    if (d != topo.rank) im.dbuf->putSignal(d, kDispatchData);
  };
  h->fwd_to_local.assign(topo.L, {});
  std::vector<int64_t> mark(topo.L, -1);
  auto forward = [&](size_t f, const uint8_t* rec, int src) {
    const auto* idx = reinterpret_cast<const int64_t*>(rec + im.off_topk);
    for (size_t j = 0; j < k; ++j) {
      if (idx[j] < 0 || idx[j] >= cfg.num_experts) continue;
      int r = topo.rankOfExpert(idx[j]);
      if (topo.node_of[r] != topo.me_node) continue;
      int lj = topo.local_of[r];
      if (mark[lj] == static_cast<int64_t>(f)) continue;
      mark[lj] = static_cast<int64_t>(f);
      char* dst = slot[lj] + im.slot_hdr + pos[lj] * row;
      std::memcpy(dst, rec, row);
      const int32_t in_block = blk[static_cast<size_t>(lj) * topo.R + src]++;
      std::memcpy(dst + offsetof(RowHeader, reserved), &in_block, 4);
      ++pos[lj];
      h->fwd_to_local[lj].push_back(static_cast<int32_t>(f));
    }
  };
  h->fwd_start.assign(S, 0);
  h->fwd_count.assign(S, 0);
  h->fwd_chunk.assign(S, C);
  {
    const auto& own = h->node_send[topo.me_node];
    h->fwd_count[0] = own.size();
    for (size_t i = 0; i < own.size(); ++i) {
      encodedRow(own[i]);
      if (i % 8 == 7) pump(sends);
    }
    clk.lap("encode");
    for (size_t i = 0; i < own.size(); ++i) {
      forward(i, encodedRow(own[i]), topo.rank);
      if (i % 8 == 7) pump(sends);
    }
    clk.lap("forward");
  }

  // 3. receive (interleaved with 2.): rows from each local forwarder land at their final
  // position, (source rank, token) order: offset of the source + index in its block.
  struct FromForwarder {
    uint64_t signals = 0;  // signal counter seen (remote forwarders)
    uint64_t published = 0, decoded = 0, final_signals = 0, state = 0;
    bool counts = false, final = false, done = false;
  };
  std::vector<FromForwarder> ff(topo.L);
  for (int j = 0; j < topo.L; ++j) ff[j].signals = im.dsig_base[j];
  std::vector<int64_t> src_count(topo.R, -1), src_off(topo.R + 1, 0);
  std::vector<const uint8_t*> rec_of;  // [output row]: its record in our slots
  bool sized = false;
  size_t n = 0;
  auto mySlot = [&](int j) { return im.dbuf->local<char>(static_cast<size_t>(j) * im.dslot); };
  // Decodes at most `budget` rows per call: a forwarder returns to its network between
  // batches, so rows that arrived meanwhile reach its node's ranks without waiting for its
  // own decode (fp8's dequantize costs more than bf16's copy).
  auto receive = [&](size_t budget) -> bool {
    bool moved = false;
    for (int j = 0; j < topo.L; ++j) {
      FromForwarder& s = ff[j];
      if (s.done) continue;
      const int f = topo.localRank(j);
      if (f != topo.rank) {
        const uint64_t v = im.dbuf->signalValue(f, kDispatchData);
        if (v == s.signals) continue;
        s.signals = v;
      }
      auto* sh = reinterpret_cast<uint64_t*>(mySlot(j));
      const uint64_t state = __atomic_load_n(&sh[1], __ATOMIC_ACQUIRE);
      const uint64_t published = __atomic_load_n(&sh[0], __ATOMIC_ACQUIRE);
      if (f == topo.rank && published == s.published && state == s.state) continue;  // own slot: unchanged
      s.published = published;
      s.state = state;
      if ((state & kSlotCounts) && !s.counts) {
        s.counts = true;
        for (int src : topo.sources_via[j]) src_count[src] = static_cast<int64_t>(sh[2 + src]);
      }
      if (state & kSlotFinal) {
        s.final = true;
        s.final_signals = im.dsig_base[j] + (state & 0xFFFFFFFF);
      }
      if (s.published > im.fmax)
        throw InternalError(im.ctx(op) + fmt::format("rank {} forwarded {} rows (at most {} fit)", f,
                                                     s.published, im.fmax));
      moved = true;
    }
    if (!sized) {
      for (int j = 0; j < topo.L; ++j)
        if (!ff[j].counts) return moved;
      for (int s = 0; s < topo.R; ++s) src_off[s + 1] = src_off[s] + src_count[s];
      n = static_cast<size_t>(src_off[topo.R]);
      if (n > im.fmax * static_cast<size_t>(topo.L))
        throw InternalError(im.ctx(op) + fmt::format("{} rows announced (at most {} fit)", n, im.fmax * topo.L));
      h->recv_rows.assign(topo.L, {});
      for (int j = 0; j < topo.L; ++j) {
        size_t cnt = 0;
        for (int src : topo.sources_via[j]) cnt += static_cast<size_t>(src_count[src]);
        if (cached && cnt != cached->recv_rows[j].size())
          throw InvalidUsage(im.ctx(op) + fmt::format("rank {} forwards {} rows where the cached handle "
                                                      "expects {}",
                                                      topo.localRank(j), cnt,
                                                      cached->recv_rows[j].size()));
        h->recv_rows[j].assign(cnt, -1);
      }
      clk.lap("decode");
      // A fresh output's first touch faults its pages in (timed apart); a recycled one is resident.
      if (want_x) sizeFrom(res.x, recycle ? &recycle->x : nullptr, n * H * im.es);
      rec_of.assign(n, nullptr);
      if (want_q) {
        sizeFrom(res.q_payload, recycle ? &recycle->q_payload : nullptr, n * im.payload_bytes);
        sizeFrom(res.q_scales, recycle ? &recycle->q_scales : nullptr, n * im.scale_bytes);
        res.q_global_scale.resize(n);
      }
      clk.lap("alloc");
      sized = true;
    }
    for (int j = 0; j < topo.L; ++j) {
      FromForwarder& s = ff[j];
      if (s.done) continue;
      const char* base = mySlot(j) + im.slot_hdr;
      for (; s.decoded < s.published && budget > 0; ++s.decoded, --budget) {
        const uint8_t* rec = reinterpret_cast<const uint8_t*>(base + s.decoded * row);
        RowHeader hd;
        std::memcpy(&hd, rec, sizeof hd);
        if (hd.src_rank < 0 || hd.src_rank >= topo.R || topo.forwarderLocal(hd.src_rank) != j ||
            hd.reserved < 0 || hd.reserved >= src_count[hd.src_rank])
          throw InternalError(im.ctx(op) + fmt::format("rank {} forwarded a row of rank {} (index {}) that "
                                                       "was not announced",
                                                       topo.localRank(j), hd.src_rank, hd.reserved));
        const size_t i = static_cast<size_t>(src_off[hd.src_rank] + hd.reserved);
        if (s.decoded >= h->recv_rows[j].size() || rec_of[i])
          throw InternalError(im.ctx(op) + fmt::format("rank {} forwarded row {} of rank {} twice or too "
                                                       "many rows",
                                                       topo.localRank(j), hd.reserved, hd.src_rank));
        rec_of[i] = rec;
        h->recv_rows[j][s.decoded] = static_cast<int32_t>(i);
        if (want_x) im.decodeRow(rec, res.x.data() + i * H * im.es);
        if (want_q) {
          std::memcpy(res.q_payload.data() + i * im.payload_bytes, rec + im.off_payload, im.payload_bytes);
          std::memcpy(res.q_scales.data() + i * im.scale_bytes, rec + im.off_scales, im.scale_bytes);
          res.q_global_scale[i] = hd.global_scale;
        }
        moved = true;
        if (s.decoded % 8 == 7) pump(sends);
      }
      const bool all_signals = topo.localRank(j) == topo.rank || s.signals == s.final_signals;
      if (s.final && all_signals && s.decoded == s.published) {
        if (s.decoded != h->recv_rows[j].size())
          throw InternalError(im.ctx(op) + fmt::format("rank {} forwarded {} rows but announced {}",
                                                       topo.localRank(j), s.decoded,
                                                       h->recv_rows[j].size()));
        s.done = true;
      }
    }
    clk.lap("decode");
    return moved;
  };

  // Headers, then rows as they arrive; between them, decode what the forwarders published.
  // A row is forwarded as soon as the messages holding its bytes are in, not when its whole
  // chunk is: a chunk is several messages (net_msg), received in order into net_recv[stream].
  struct NetIn {
    std::vector<RequestPtr> pieces;  // every chunk's messages, in byte order
    std::vector<size_t> end;         // [piece]: bytes of net_recv[m] complete once it is in
    size_t next = 0;                 // pieces in so far (a prefix)
    size_t forwarded = 0;            // rows forwarded so far
  };
  std::vector<NetIn> net_in(S);
  std::vector<uint8_t> header_in(S, 0);
  size_t headers_left = S - 1;
  bool counts_out = false, final_out = false;
  auto pendingRecv = [&]() -> RequestPtr {
    for (size_t st = 1; st < S; ++st) {
      if (!header_in[st]) return hdr_req[st];
      for (size_t p = net_in[st].next; p < net_in[st].pieces.size(); ++p)
        if (!net_in[st].pieces[p]->done()) return net_in[st].pieces[p];
    }
    return nullptr;
  };
  // Any unfinished network request: waiting on it progresses the transports, which our sends
  // need too (a rendezvous reply, a socket that drained), so idle waits never stall a peer.
  auto pendingNet = [&]() -> RequestPtr {
    if (RequestPtr r = pendingRecv()) return r;
    for (const auto& r : sends)
      if (!r->done()) return r;
    return nullptr;
  };
  while (true) {
    bool moved = false;
    for (size_t st = 1; st < S && headers_left > 0; ++st) {
      if (header_in[st] || !hdr_req[st]->test()) continue;
      const int peer = sources[st];
      const uint64_t* hi = hdr_in.data() + st * hw;
      const uint64_t count = hi[0], cm = hi[1];
      if (count > cfg.max_tokens || cm == 0 || dataChunks(count, cm) > kMaxChunks)
        throw InternalError(im.ctx(op) + fmt::format("rank {} sent a bad header: {} rows in chunks of {} "
                                                     "(max_tokens {})",
                                                     peer, count, cm, cfg.max_tokens));
      if (cached && count != cached->fwd_count[st])
        throw InvalidUsage(im.ctx(op) +
                           fmt::format("rank {} sent {} rows where the cached handle expects {}: every "
                                       "rank must pass a handle of the same earlier dispatch",
                                       peer, count, cached->fwd_count[st]));
      h->fwd_count[st] = count;
      h->fwd_chunk[st] = cm;
      NetIn& in = net_in[st];
      for (size_t c = 0, nc = dataChunks(count, cm); c < nc; ++c) {
        const size_t lo = c * cm, hi_row = std::min<size_t>(count, lo + cm);
        const size_t bytes = (hi_row - lo) * row, step = im.pieceBytes(bytes);
        auto pieces =
            im.recvPieces(im.net_recv[st].data() + lo * row, bytes, peer, tag + 1 + static_cast<uint32_t>(c));
        for (size_t p = 0; p < pieces.size(); ++p) {  // piece p: the chunk's bytes [p * step, (p + 1) * step)
          in.end.push_back(lo * row + std::min(bytes, (p + 1) * step));
          in.pieces.push_back(std::move(pieces[p]));
        }
      }
      header_in[st] = 1;
      --headers_left;
      moved = true;
    }
    if (headers_left == 0 && !counts_out) {
      // F order: own block, then the sources' blocks in stream (rank) order.
      for (size_t st = 1; st < S; ++st) h->fwd_start[st] = h->fwd_start[st - 1] + h->fwd_count[st - 1];
      for (int lj = 0; lj < topo.L; ++lj) {
        auto* sh = reinterpret_cast<uint64_t*>(slot[lj]);
        sh[2 + topo.rank] = static_cast<uint64_t>(h->stats.tokens_per_rank[topo.localRank(lj)]);
        for (size_t st = 1; st < S; ++st) sh[2 + sources[st]] = hdr_in[st * hw + 2 + lj];
        publish(lj, kSlotCounts);
      }
      counts_out = true;
      moved = true;
      clk.lap("wait net");
    }
    if (counts_out && !final_out) {
      bool fwd_any = false;
      for (size_t st = 1; st < S; ++st) {
        NetIn& in = net_in[st];
        // test(), not done(): a piece another request's progress failed must throw here, not be
        // forwarded as rows.
        while (in.next < in.pieces.size() && in.pieces[in.next]->test()) ++in.next;
        const size_t rows_in = in.next == 0 ? 0 : in.end[in.next - 1] / row;
        if (rows_in == in.forwarded) continue;
        clk.lap("wait net");
        for (size_t i = in.forwarded; i < rows_in; ++i) {
          forward(h->fwd_start[st] + i, im.net_recv[st].data() + i * row, sources[st]);
          if (i % 8 == 7) pump(sends);
        }
        in.forwarded = rows_in;
        fwd_any = true;
      }
      if (fwd_any) {
        for (int lj = 0; lj < topo.L; ++lj) publish(lj, 0);
        clk.lap("forward");
        moved = true;
      }
      // Final only once every row is forwarded: a message that completed after the loop above
      // (progressed by another request's test) is in, but its rows are not yet forwarded.
      bool all_forwarded = headers_left == 0;
      for (size_t st = 1; st < S; ++st)
        if (net_in[st].forwarded < h->fwd_count[st]) all_forwarded = false;
      if (all_forwarded) {
        for (int lj = 0; lj < topo.L; ++lj) publish(lj, kSlotFinal);
        final_out = true;
        moved = true;
      }
    }
    // While rows may still come over the network, decode in batches between network checks.
    if (receive(final_out ? SIZE_MAX : kDecodeBatch)) moved = true;
    bool recv_done = true;
    for (const auto& s : ff) recv_done = recv_done && s.done;
    if (final_out && recv_done) break;
    if (moved) continue;
    if (dl.expired()) {
      std::string missing;
      for (size_t st = 1; st < S; ++st)
        if (!header_in[st] || net_in[st].forwarded < h->fwd_count[st])
          missing += fmt::format(" rows from rank {} ({}/{} rows);", sources[st], net_in[st].forwarded,
                                 header_in[st] ? std::to_string(h->fwd_count[st]) : "?");
      for (int j = 0; j < topo.L; ++j)
        if (!ff[j].done)
          missing += fmt::format(" rows forwarded by local rank {} ({} so far{});",
                                 topo.localRank(j), ff[j].decoded, ff[j].final ? ", final" : "");
      throw Timeout(im.ctx(op) + "the deadline passed while waiting for" + missing +
                        " check that every rank calls dispatch",
                    {});
    }
    // Nothing to do: sleep on the network (or briefly) until something may have moved.
    auto slotsMoved = [&] {
      for (int j = 0; j < topo.L; ++j) {
        const int f = topo.localRank(j);
        if (f != topo.rank && !ff[j].done && im.dbuf->signalValue(f, kDispatchData) != ff[j].signals) return true;
      }
      return false;
    };
    if (RequestPtr r = pendingNet(); r && r->engine()) {
      r->engine()->waitUntil([&] { return r->done() || slotsMoved(); }, Deadline::after(Millis(1)));
    } else {
      // Only local forwarders left (our own forwarding is done): sleep until the first one
      // that has more to send signals again.
      bool waited = false;
      for (int j = 0; j < topo.L && !waited; ++j) {
        const int f = topo.localRank(j);
        // Skip forwarders that sent their last signal (they may wait for others' counts).
        if (f == topo.rank || ff[j].done || (ff[j].final && ff[j].signals == ff[j].final_signals)) continue;
        im.dbuf->waitSignalValue(f, kDispatchData, ff[j].signals + 1, dl);
        waited = true;
      }
      if (!waited) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    clk.lap(final_out ? "wait local" : "wait net");
  }
  for (int j = 0; j < topo.L; ++j)
    if (topo.localRank(j) != topo.rank) im.dsig_base[j] = ff[j].final_signals;
  im.comm->waitAll(sends, dl);
  clk.lap("wait sends");
  for (int j = 0; j < topo.L; ++j)
    if (topo.localRank(j) != topo.rank) res.metrics.intra_node_bytes += pos[j] * row;

  h->num_recv = n;
  res.num_recv = n;
  res.src_rank.resize(n);
  res.src_token.resize(n);
  res.recv_per_rank.assign(topo.R, 0);
  res.topk_idx.resize(n * k);
  res.topk_weights.resize(n * k);
  ExpertAssigner assigner(im.topo, cfg.topk, cfg.expert_capacity);
  std::vector<int64_t> idx_scratch(k);
  std::vector<float> w_scratch(k);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* rec = rec_of[i];
    if (!rec) throw InternalError(im.ctx(op) + fmt::format("row {} of {} was announced but never arrived", i, n));
    RowHeader hd;
    std::memcpy(&hd, rec, sizeof hd);
    res.src_rank[i] = hd.src_rank;
    res.src_token[i] = hd.src_token;
    ++res.recv_per_rank[hd.src_rank];
    // Unaligned in the record (offset 16): copy before reading.
    std::vector<int64_t>& idx = idx_scratch;
    std::vector<float>& w = w_scratch;
    std::memcpy(idx.data(), rec + im.off_topk, 8 * k);
    std::memcpy(w.data(), rec + im.off_w, 4 * k);
    assigner.assign(idx.data(), w.data(), res.topk_idx.data() + i * k, res.topk_weights.data() + i * k);
  }
  res.tokens_per_expert = assigner.tokensPerExpert();
  res.metrics.dropped = assigner.dropped();
  clk.lap("decode");
  // Our slots are copied out: the forwarders may overwrite them (next dispatch).
  for (int j = 0; j < topo.L; ++j) {
    int f = topo.localRank(j);
    if (f != topo.rank) im.dbuf->putSignal(f, kDispatchAck);
  }
  ++im.dispatches;

  // Expert-major copy.
  {
    ExpertMajorIndex em = expertMajorIndex(res.topk_idx, n, cfg.topk, res.tokens_per_expert);
    res.expert_offsets = std::move(em.offsets);
    res.expert_rows = std::move(em.rows);
    res.expert_weights.resize(res.expert_rows.size());
    for (size_t p = 0; p < res.expert_rows.size(); ++p) res.expert_weights[p] = res.topk_weights[em.slots[p]];
    // Expert-major copies of each form returned: rows of `from` (`bytes` each) in expert order.
    auto expertMajor = [&](std::vector<uint8_t>& to, std::vector<uint8_t>* recycled, const std::vector<uint8_t>& from,
                           size_t bytes) {
      sizeFrom(to, recycled, res.expert_rows.size() * bytes);
      for (size_t p = 0; p < res.expert_rows.size(); ++p)
        std::memcpy(to.data() + p * bytes, from.data() + static_cast<size_t>(res.expert_rows[p]) * bytes, bytes);
    };
    if (cfg.expert_major_copy && want_x)
      expertMajor(res.x_expert_major, recycle ? &recycle->x_expert_major : nullptr, res.x, H * im.es);
    if (cfg.expert_major_copy && want_q) {
      expertMajor(res.q_payload_expert_major, recycle ? &recycle->q_payload_expert_major : nullptr, res.q_payload,
                  im.payload_bytes);
      expertMajor(res.q_scales_expert_major, recycle ? &recycle->q_scales_expert_major : nullptr, res.q_scales,
                  im.scale_bytes);
    }
  }
  clk.lap("expert major");
  finishDispatchMetrics(res.metrics, im.topo, h->stats, im.row, res.tokens_per_expert);
  res.handle = std::move(h);
  give_back.finished = true;
  return res;
}

CombineResult MoeBuffer::combine(const void* y, DataType y_type, const MoeHandle& h, const float* weights) {
  Impl& im = *impl_;
  const MoeTopology& topo = im.topo;
  const char* op = "moe combine";
  const size_t H = im.cfg.hidden;
  if (h.owner != this) throw InvalidArgument(im.ctx(op) + "the handle comes from another MoeBuffer");
  if (y_type != DataType::kFloat32 && y_type != DataType::kBFloat16)
    throw InvalidArgument(im.ctx(op) + "y must be bfloat16 or float32");
  if (h.num_recv > 0 && !y) throw InvalidArgument(im.ctx(op) + "y is null");
  const size_t yes = elementSize(y_type);
  const Deadline dl = im.deadline();
  const uint32_t tag = im.opTag();
  CombineResult res;
  PhaseClock clk(res.metrics.phases);

  // 1. each output row goes back to the local forwarder it came from, as f32.
  for (int j = 0; j < topo.L; ++j) {
    int f = topo.localRank(j);
    if (f != topo.rank && im.combines > 0) im.cbuf->waitSignal(f, kCombineAck, dl);
    clk.lap("wait ack");
    float* slot = im.cbuf->peer<float>(f, static_cast<size_t>(topo.me_local) * im.cslot);
    const auto& rows = h.recv_rows[j];
    for (size_t p = 0; p < rows.size(); ++p) {
      const char* src = static_cast<const char*>(y) + static_cast<size_t>(rows[p]) * H * yes;
      float w = weights ? weights[rows[p]] : 1.0f;
      float* dst = slot + p * H;
      // Row kernels of host_codec.h: the plain loop's results, vectorized (moe.cc is -O2).
      if (y_type == DataType::kFloat32)
        scaleRowHost(dst, reinterpret_cast<const float*>(src), w, H);
      else
        scaleRowHost(dst, reinterpret_cast<const BFloat16*>(src), w, H);
    }
    if (f != topo.rank) {
      im.cbuf->putSignal(f, kCombineData);
      res.metrics.intra_node_bytes += rows.size() * H * sizeof(float);
    }
    clk.lap("write");
  }

  // Source side: the partial sums of each remote node come back in chunks of our chunk size.
  // Partials cross the network as f32, or bf16 with combine_wire = kBFloat16 (half the bytes,
  // one rounding of each node's partial sum; the source still sums in f32).
  const bool wire16 = im.cfg.combine_wire == DataType::kBFloat16;
  const size_t ws = wire16 ? 2 : 4;
  auto& back = im.comb_back;
  back.resize(topo.N);
  std::vector<std::vector<RequestPtr>> recvs(topo.N);                     // [node]: every message
  std::vector<std::vector<std::vector<RequestPtr>>> recv_chunks(topo.N);  // [node][chunk]: its messages
  for (int m = 0; m < topo.N; ++m) {
    const size_t count = h.node_send[m].size();
    if (m == topo.me_node || count == 0) continue;
    back[m].resize(count * H * ws);
    for (size_t lo = 0, c = 0; lo < count; lo += h.chunk, ++c) {
      const size_t rows = std::min(h.chunk, count - lo);
      recv_chunks[m].push_back(im.recvPieces(back[m].data() + lo * H * ws, rows * H * ws,
                                             topo.forwarderOn(m, topo.rank),
                                             tag + static_cast<uint32_t>(c)));
      recvs[m].insert(recvs[m].end(), recv_chunks[m].back().begin(), recv_chunks[m].back().end());
    }
  }
  clk.lap("post");

  // 2. as forwarder: wait for the node's partials, sum them per F row (in local-rank order, so
  // the result does not depend on the chunk size), and send each remote node's chunk as soon as
  // it is summed: chunk k crosses the network while chunk k+1 is being summed. Streams as in
  // dispatch: [0] the own rows, then one per source this rank forwards for.
  const auto& sources = topo.fwd_sources;
  const size_t S = sources.size();
  for (int j = 0; j < topo.L; ++j) {
    int d = topo.localRank(j);
    // One kCombineData signal per call from every local rank (a counter, never consumed).
    if (d != topo.rank) im.waitCounter(*im.cbuf, d, kCombineData, im.combines + 1, recvs, dl, op);
  }
  clk.lap("wait local");
  size_t nf = 0;
  for (size_t c : h.fwd_count) nf += c;
  std::vector<size_t> first(nf + 1, 0);  // contributions of F row i: contrib[first[i], first[i+1])
  for (const auto& list : h.fwd_to_local)
    for (int32_t f : list) ++first[f + 1];
  for (size_t i = 0; i < nf; ++i) first[i + 1] += first[i];
  std::vector<const float*> contrib(first[nf]);
  {
    std::vector<size_t> fill(first.begin(), first.end() - 1);
    for (int j = 0; j < topo.L; ++j) {
      const float* s = im.cbuf->local<float>(static_cast<size_t>(j) * im.cslot);
      const auto& list = h.fwd_to_local[j];
      for (size_t p = 0; p < list.size(); ++p) contrib[fill[list[p]]++] = s + p * H;
    }
  }
  auto& acc = im.comb_acc;
  acc.assign(nf * H, 0.0f);
  auto& acc16 = im.comb_acc16;
  acc16.resize(wire16 ? nf * H * 2 : 0);
  auto reduce = [&](size_t i) {
    float* a = acc.data() + i * H;
    for (size_t q = first[i]; q < first[i + 1]; ++q) addRowHost(a, contrib[q], H);
  };
  std::vector<RequestPtr> sends;
  size_t rounds = 0;
  for (size_t st = 1; st < S; ++st)
    if (h.fwd_count[st] > 0) rounds = std::max(rounds, dispatchChunks(h.fwd_count[st], h.fwd_chunk[st]));
  for (size_t c = 0; c < rounds; ++c)
    for (size_t st = 1; st < S; ++st) {
      const size_t count = h.fwd_count[st], cm = h.fwd_chunk[st], lo = c * cm;
      if (lo >= count) continue;
      const size_t hi = std::min(count, lo + cm);
      for (size_t i = lo; i < hi; ++i) reduce(h.fwd_start[st] + i);
      const void* src = acc.data() + (h.fwd_start[st] + lo) * H;
      if (wire16) {
        auto* b = reinterpret_cast<BFloat16*>(acc16.data()) + (h.fwd_start[st] + lo) * H;
        roundRowHost(b, acc.data() + (h.fwd_start[st] + lo) * H, (hi - lo) * H);
        src = b;
      }
      clk.lap("reduce");
      im.sendPieces(sends, static_cast<const uint8_t*>(src), (hi - lo) * H * ws, sources[st],
                    tag + static_cast<uint32_t>(c));
      res.metrics.inter_node_bytes += (hi - lo) * H * ws;
      pump(sends);
      clk.lap("post");
    }
  for (size_t i = 0; i < h.fwd_count[0]; ++i) {
    reduce(h.fwd_start[0] + i);
    if (i % 8 == 7) pump(sends);
  }
  clk.lap("reduce");
  for (int j = 0; j < topo.L; ++j) {
    int d = topo.localRank(j);
    if (d != topo.rank) im.cbuf->putSignal(d, kCombineAck);
  }
  ++im.combines;

  // 3. as source: sum the nodes' partials per token in node order (deterministic), each chunk
  // as it arrives.
  res.out.assign(h.tokens * H, 0.0f);
  for (int m = 0; m < topo.N; ++m) {
    const auto& list = h.node_send[m];
    const bool own = m == topo.me_node;
    for (size_t i = 0; i < list.size(); ++i) {
      if (!own && i % h.chunk == 0) {
        clk.lap("sum");
        im.comm->waitAll(recv_chunks[m][i / h.chunk], dl);
        clk.lap("wait net");
      }
      float* o = res.out.data() + static_cast<size_t>(list[i]) * H;
      if (own || !wire16) {
        const float* s = own ? acc.data() + (h.fwd_start[0] + i) * H
                             : reinterpret_cast<const float*>(back[m].data()) + i * H;
        addRowHost(o, s, H);
      } else {
        addRowHost(o, reinterpret_cast<const BFloat16*>(back[m].data()) + i * H, H);
      }
    }
  }
  clk.lap("sum");
  im.comm->waitAll(sends, dl);
  clk.lap("wait sends");
  return res;
}

CombineResult MoeBuffer::combineExpertMajor(const void* y, DataType y_type, const DispatchResult& d,
                                            const float* weights) {
  const size_t H = impl_->cfg.hidden;
  if (y_type != DataType::kFloat32 && y_type != DataType::kBFloat16)
    throw InvalidArgument(impl_->ctx("moe combine") + "y must be bfloat16 or float32");
  if (!d.handle) throw InvalidArgument(impl_->ctx("moe combine") + "the dispatch result has no handle");
  const size_t yes = elementSize(y_type);
  std::vector<float> rows(d.num_recv * H, 0.0f);
  std::vector<float> scaled(H);  // y * w rounded to f32, then added: o += y * w without FMA
  for (size_t r = 0; r < d.expert_rows.size(); ++r) {
    const char* src = static_cast<const char*>(y) + r * H * yes;
    float w = weights ? weights[r] : 1.0f;
    float* o = rows.data() + static_cast<size_t>(d.expert_rows[r]) * H;
    if (y_type == DataType::kFloat32)
      scaleRowHost(scaled.data(), reinterpret_cast<const float*>(src), w, H);
    else
      scaleRowHost(scaled.data(), reinterpret_cast<const BFloat16*>(src), w, H);
    addRowHost(o, scaled.data(), H);
  }
  return combine(rows.data(), DataType::kFloat32, *d.handle);
}

}  // namespace crossbar::moe
