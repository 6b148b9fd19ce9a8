// Host path of the two-level MoE all-to-all (see moe.h). Phases of a dispatch:
//   1. network: the tokens bound for node m go, once each, to the rank of node m with this
//      rank's local index (one message per node: a count, then wire rows);
//   2. forward: every rank holds its "forwarded set" F (its own tokens for its node, then
//      those each remote node sent it) and writes each row once per destination rank of its
//      node into that rank's symmetric buffer (slot = the writer's local index);
//   3. receive: rows are decoded in (source rank, token) order.
// Combine runs the same paths backwards with f32 partial sums.
#include "collectives/moe/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>

#include "collectives/float_types.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"
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
  // F, the rows this rank forwards: node m's are F[fwd_start[m], + fwd_count[m]), sent to us
  // in chunks of fwd_chunk[m] rows (the own node's block first).
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
enum Channel { kDispatchData = 0, kDispatchAck = 1, kCombineData = 2, kCombineAck = 3, kNumChannels = 4 };

// There is no progress thread: the CPU drives pending network requests between rows.
void pump(const std::vector<RequestPtr>& reqs) {
  for (const auto& r : reqs)
    if (!r->done()) {
      r->test();
      return;
    }
}

struct RowHeader {
  int32_t src_rank;
  int32_t src_token;
  float global_scale;
  int32_t reserved;
};
static_assert(sizeof(RowHeader) == 16);

float loadAsFloat(const void* row, DataType t, size_t h) {
  return t == DataType::kFloat32 ? static_cast<const float*>(row)[h]
                                 : static_cast<const BFloat16*>(row)[h].toFloat();
}

}  // namespace

struct MoeBuffer::Impl {
  std::shared_ptr<Communicator> comm;
  MoeConfig cfg;
  int rank = 0, R = 1, N = 1, L = 1, me_node = 0, me_local = 0, epr = 1;
  std::vector<std::vector<int>> node_ranks;  // [node index][local index] -> rank
  std::vector<int> node_of;                  // rank -> node index
  std::vector<int> local_of;                 // rank -> local index in its node
  size_t es = 2;                             // element size of cfg.dtype
  size_t off_topk = 0, off_w = 0, off_scales = 0, off_payload = 0, scale_bytes = 0, payload_bytes = 0;
  size_t row = 0, fmax = 0, dslot = 0, cslot = 0;
  size_t chunk = 1;          // rows per network chunk
  std::vector<uint8_t> enc;  // this call's encoded tokens
  symm::SymmetricHeap heap;
  std::shared_ptr<symm::SymmetricBuffer> dbuf, cbuf;
  uint64_t dispatches = 0, combines = 0, ops = 0;
  std::vector<std::vector<uint8_t>> net_send, net_recv;  // [node]

  std::string ctx(const char* op) const { return errorContext(rank, op); }
  Deadline deadline() const {
    return cfg.timeout.count() > 0 ? Deadline::after(cfg.timeout) : comm->defaultDeadline();
  }
  uint32_t opTag() { return kTagBase + (static_cast<uint32_t>(ops++ % kTagCalls) << 16); }
  int rankOfExpert(int64_t e) const { return static_cast<int>(e / epr); }
  bool quantized() const { return cfg.format != PayloadFormat::kNative; }

  Layout layout(const int64_t* topk_idx, size_t tokens, int num_experts, const char* op) const;
  void encodeRow(const void* x, size_t t, const int64_t* topk_idx, const float* w, float gscale,
                 uint8_t* out) const;
  void decodeRow(const uint8_t* rec, void* out) const;
};

MoeBuffer::MoeBuffer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeBuffer::~MoeBuffer() = default;
const MoeConfig& MoeBuffer::config() const {
  return impl_->cfg;
}
int MoeBuffer::numLocalExperts() const {
  return impl_->epr;
}
size_t MoeBuffer::rowBytes() const {
  return impl_->row;
}

std::unique_ptr<MoeBuffer> MoeBuffer::create(std::shared_ptr<Communicator> comm, const MoeConfig& cfg) {
  if (!comm) throw InvalidArgument("MoeBuffer::create: null communicator");
  auto im = std::make_unique<Impl>();
  im->comm = comm;
  im->cfg = cfg;
  im->rank = comm->rank();
  im->R = comm->size();
  const char* op = "moe create";
  if (cfg.num_experts <= 0 || cfg.num_experts % im->R != 0)
    throw InvalidArgument(im->ctx(op) + fmt::format("{} experts cannot be spread evenly over {} ranks: use a "
                                                    "multiple of the communicator size",
                                                    cfg.num_experts, im->R));
  if (cfg.hidden == 0 || cfg.topk <= 0 || cfg.max_tokens == 0)
    throw InvalidArgument(im->ctx(op) +
                          fmt::format("hidden ({}), topk ({}) and max_tokens ({}) must be positive",
                                      cfg.hidden, cfg.topk, cfg.max_tokens));
  if (cfg.dtype != DataType::kBFloat16 && cfg.dtype != DataType::kFloat32)
    throw InvalidArgument(im->ctx(op) + "tokens must be bfloat16 or float32");
  if (cfg.max_tokens > (size_t{1} << 30)) throw InvalidArgument(im->ctx(op) + "max_tokens is too large");
  if (cfg.combine_wire != DataType::kFloat32 && cfg.combine_wire != DataType::kBFloat16)
    throw InvalidArgument(im->ctx(op) + "combine_wire must be float32 or bfloat16");
  im->epr = cfg.num_experts / im->R;

  // Nodes in order of their first rank; every node must have the same number of ranks
  // (the forwarder of local index l must exist on every node).
  std::map<int, int> index_of_node;
  im->node_of.resize(im->R);
  for (int r = 0; r < im->R; ++r) {
    auto [it, added] = index_of_node.try_emplace(comm->nodeOf(r), static_cast<int>(im->node_ranks.size()));
    if (added) im->node_ranks.emplace_back();
    im->local_of.push_back(static_cast<int>(im->node_ranks[it->second].size()));
    im->node_ranks[it->second].push_back(r);
    im->node_of[r] = it->second;
  }
  im->N = static_cast<int>(im->node_ranks.size());
  im->L = static_cast<int>(im->node_ranks[0].size());
  for (const auto& n : im->node_ranks)
    if (static_cast<int>(n.size()) != im->L)
      throw Unsupported(im->ctx(op) +
                        "nodes with different numbers of ranks: the hierarchical all-to-all pairs "
                        "ranks of equal local index across nodes");
  im->me_node = im->node_of[im->rank];
  const auto& mine = im->node_ranks[im->me_node];
  im->me_local = static_cast<int>(std::find(mine.begin(), mine.end(), im->rank) - mine.begin());

  im->es = elementSize(cfg.dtype);
  const size_t k = static_cast<size_t>(cfg.topk);
  im->off_topk = sizeof(RowHeader);
  im->off_w = im->off_topk + 8 * k;
  im->off_scales = align16(im->off_w + 4 * k);
  if (im->quantized()) {
    im->scale_bytes = scaleBytes(payloadCodec(cfg.format), cfg.hidden);
    im->payload_bytes = payloadBytes(payloadCodec(cfg.format), cfg.hidden);
  } else {
    im->payload_bytes = cfg.hidden * im->es;
  }
  im->off_payload = align16(im->off_scales + im->scale_bytes);
  im->row = align16(im->off_payload + im->payload_bytes);
  im->fmax = static_cast<size_t>(im->N) * cfg.max_tokens;
  {
    const int64_t ct = cfg.chunk_tokens != -1 ? cfg.chunk_tokens : env::getInt("CROSSBAR_MOE_CHUNK_TOKENS");
    if (ct < 0)
      throw InvalidArgument(im->ctx(op) + fmt::format("chunk of {} tokens: use 0 (no pipelining) or more "
                                                      "(CROSSBAR_MOE_CHUNK_TOKENS / MoeConfig::chunk_tokens)",
                                                      ct));
    im->chunk = ct == 0 ? cfg.max_tokens : std::min<size_t>(static_cast<size_t>(ct), cfg.max_tokens);
    im->chunk = std::max(im->chunk, (cfg.max_tokens + kMaxChunks - 1) / kMaxChunks);
  }
  im->dslot = 16 + im->fmax * im->row;
  im->cslot = im->fmax * cfg.hidden * sizeof(float);

  symm::HeapOptions ho;
  ho.channels = kNumChannels;
  ho.name = "moe";
  ho.remote_access = false;  // off-node traffic goes through the communicator's p2p
  im->heap = symm::SymmetricHeap::create(comm, ho);
  im->dbuf = im->heap.allocate(static_cast<size_t>(im->L) * im->dslot);
  im->cbuf = im->heap.allocate(static_cast<size_t>(im->L) * im->cslot);
  im->net_send.resize(im->N);
  im->net_recv.resize(im->N);
  CB_INFO("moe", "MoE buffer: {} experts, top-{}, hidden {}, {} ({}), {} nodes x {} ranks, row {} B",
          cfg.num_experts, cfg.topk, cfg.hidden, payloadFormatName(cfg.format),
          cfg.dtype == DataType::kFloat32 ? "f32" : "bf16", im->N, im->L, im->row);
  return std::unique_ptr<MoeBuffer>(new MoeBuffer(std::move(im)));
}

Layout MoeBuffer::Impl::layout(const int64_t* topk_idx, size_t tokens, int num_experts,
                               const char* op) const {
  if (num_experts <= 0 || num_experts % R != 0)
    throw InvalidArgument(ctx(op) +
                          fmt::format("{} experts cannot be spread evenly over {} ranks", num_experts, R));
  if (tokens > 0 && !topk_idx) throw InvalidArgument(ctx(op) + "topk_idx is null");
  const int per_rank = num_experts / R;
  const int k = cfg.topk;
  Layout l;
  l.tokens = tokens;
  l.tokens_per_rank.assign(R, 0);
  l.tokens_per_node.assign(N, 0);
  l.tokens_per_expert.assign(num_experts, 0);
  l.is_token_in_rank.assign(tokens * R, 0);
  std::vector<int> node_seen(N, -1);
  for (size_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < k; ++j) {
      int64_t e = topk_idx[t * k + j];
      if (e == -1) continue;
      if (e < -1 || e >= num_experts)
        throw InvalidArgument(
            ctx(op) +
            fmt::format("topk_idx[{}, {}] = {} is not an expert id in [0, {}) or -1", t, j, e, num_experts));
      ++l.tokens_per_expert[e];
      ++l.token_expert_pairs;
      int r = static_cast<int>(e / per_rank);
      if (node_of[r] != me_node) ++l.remote_token_expert_pairs;
      uint8_t& in = l.is_token_in_rank[t * R + r];
      if (in) continue;
      in = 1;
      ++l.tokens_per_rank[r];
      ++l.token_rank_pairs;
      int n = node_of[r];
      if (node_seen[n] != static_cast<int>(t)) {
        node_seen[n] = static_cast<int>(t);
        ++l.tokens_per_node[n];
        ++l.token_node_pairs;
        if (n != me_node) ++l.remote_token_node_pairs;
      }
    }
  }
  return l;
}

Layout MoeBuffer::layout(const int64_t* topk_idx, size_t tokens, int num_experts) const {
  return impl_->layout(topk_idx, tokens, num_experts, "moe layout");
}

void MoeBuffer::Impl::encodeRow(const void* x, size_t t, const int64_t* topk_idx, const float* w,
                                float gscale, uint8_t* out) const {
  const size_t k = static_cast<size_t>(cfg.topk), H = cfg.hidden;
  RowHeader hdr{rank, static_cast<int32_t>(t), gscale, 0};
  std::memcpy(out, &hdr, sizeof hdr);
  std::memcpy(out + off_topk, topk_idx + t * k, 8 * k);
  float* wo = reinterpret_cast<float*>(out + off_w);
  for (size_t j = 0; j < k; ++j) wo[j] = w ? w[t * k + j] : 1.0f;
  const char* src = static_cast<const char*>(x) + t * H * es;
  if (!quantized()) {
    std::memcpy(out + off_payload, src, H * es);
  } else if (cfg.dtype == DataType::kFloat32) {
    quantizeRow(payloadCodec(cfg.format), reinterpret_cast<const float*>(src), H, out + off_payload,
                out + off_scales, gscale);
  } else {
    quantizeRow(payloadCodec(cfg.format), reinterpret_cast<const BFloat16*>(src), H, out + off_payload,
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
    dequantizeRow(payloadCodec(cfg.format), rec + off_payload, rec + off_scales, H, static_cast<float*>(out),
                  hdr.global_scale);
  else
    dequantizeRow(payloadCodec(cfg.format), rec + off_payload, rec + off_scales, H,
                  static_cast<BFloat16*>(out), hdr.global_scale);
}

DispatchResult MoeBuffer::dispatch(const void* x, size_t tokens, const int64_t* topk_idx,
                                   const float* topk_weights, std::shared_ptr<const MoeHandle> cached) {
  Impl& im = *impl_;
  const char* op = "moe dispatch";
  const auto& cfg = im.cfg;
  const size_t k = static_cast<size_t>(cfg.topk), H = cfg.hidden, row = im.row;
  if (tokens > cfg.max_tokens)
    throw InvalidArgument(im.ctx(op) + fmt::format("{} tokens exceed the buffer's max_tokens {}: create the "
                                                   "MoeBuffer with a larger max_tokens",
                                                   tokens, cfg.max_tokens));
  if (tokens > 0 && (!x || !topk_idx)) throw InvalidArgument(im.ctx(op) + "x or topk_idx is null");
  if (cached && cached->owner != this)
    throw InvalidArgument(im.ctx(op) + "the cached handle comes from another MoeBuffer");
  if (cached && cached->tokens != tokens)
    throw InvalidArgument(
        im.ctx(op) + fmt::format("the cached handle was made for {} tokens, not {}", cached->tokens, tokens));

  auto h = std::make_shared<MoeHandle>();
  h->owner = this;
  h->tokens = tokens;
  h->chunk = im.chunk;
  if (cached) {
    h->node_send = cached->node_send;
    h->stats = cached->stats;
  } else {
    h->stats = im.layout(topk_idx, tokens, cfg.num_experts, op);
    h->node_send.assign(im.N, {});
    for (size_t t = 0; t < tokens; ++t)
      for (int n = 0; n < im.N; ++n)
        for (int r : im.node_ranks[n])
          if (h->stats.is_token_in_rank[t * im.R + r]) {
            h->node_send[n].push_back(static_cast<int32_t>(t));
            break;
          }
    h->stats.is_token_in_rank.clear();
  }
  const Deadline dl = im.deadline();
  const uint32_t tag = im.opTag();
  DispatchResult res;

  // nvfp4's per-tensor scale covers this rank's whole x.
  float gscale = 1.0f;
  if (cfg.format == PayloadFormat::kNvfp4) {
    BlockAmax a;
    for (size_t t = 0; t < tokens; ++t) {
      const char* r = static_cast<const char*>(x) + t * H * im.es;
      a = mergeAmax(a, cfg.dtype == DataType::kFloat32
                           ? blockAmax(reinterpret_cast<const float*>(r), static_cast<int>(H))
                           : blockAmax(reinterpret_cast<const BFloat16*>(r), static_cast<int>(H)));
    }
    gscale = nvfp4GlobalScale(a);
  }

  // Each token is encoded (quantized) once, when first needed; the own node's rows are read from here.
  im.enc.resize(tokens * row);
  std::vector<uint8_t> encoded(tokens, 0);
  auto encodedRow = [&](int32_t t) -> const uint8_t* {
    uint8_t* p = im.enc.data() + static_cast<size_t>(t) * row;
    if (!encoded[t]) {
      im.encodeRow(x, t, topk_idx, topk_weights, gscale, p);
      encoded[t] = 1;
    }
    return p;
  };

  // 1. network, chunk-major: chunk c of every remote node is encoded and sent before chunk c+1.
  // A node's message is [count, chunk rows][rows]; chunk 0 carries the 16-byte header, so the
  // receiver learns how many more chunks (tags tag+1, tag+2, ...) to expect.
  const size_t C = im.chunk;
  std::vector<RequestPtr> sends;
  std::vector<RequestPtr> first(im.N);
  const size_t cap = 16 + cfg.max_tokens * row;
  size_t rounds = 0;
  for (int m = 0; m < im.N; ++m) {
    if (m == im.me_node) continue;
    im.net_recv[m].resize(cap);
    first[m] = im.comm->irecv(im.net_recv[m].data(), cap, im.node_ranks[m][im.me_local], tag);
    const auto& list = h->node_send[m];
    im.net_send[m].resize(16 + list.size() * row);
    const uint64_t header[2] = {list.size(), C};
    std::memcpy(im.net_send[m].data(), header, 16);
    rounds = std::max(rounds, dispatchChunks(list.size(), C));
    res.metrics.inter_node_bytes += list.size() * row;
  }
  for (size_t c = 0; c < rounds; ++c)
    for (int m = 0; m < im.N; ++m) {
      const auto& list = h->node_send[m];
      if (m == im.me_node || c >= dispatchChunks(list.size(), C)) continue;
      const size_t lo = c * C, hi = std::min(list.size(), lo + C);
      uint8_t* buf = im.net_send[m].data();
      for (size_t i = lo; i < hi; ++i) std::memcpy(buf + 16 + i * row, encodedRow(list[i]), row);
      const size_t begin = c == 0 ? 0 : 16 + lo * row, end = 16 + hi * row;
      sends.push_back(im.comm->isend(buf + begin, end - begin, im.node_ranks[m][im.me_local],
                                     tag + static_cast<uint32_t>(c)));
      pump(sends);
    }

  // 2. forward: F = own rows for this node, then each remote node's rows (block per node).
  // Every row goes once to each local rank holding one of its experts, written into that
  // rank's slot for this forwarder. Own rows go first (the network is busy meanwhile), then
  // the remote chunks as they arrive, so chunk k fans out while chunk k+1 is on the wire.
  for (int j = 0; j < im.L; ++j) {
    int d = im.node_ranks[im.me_node][j];
    if (d != im.rank && im.dispatches > 0) im.dbuf->waitSignal(d, kDispatchAck, dl);
  }
  std::vector<char*> slot(im.L);
  std::vector<size_t> pos(im.L, 0);
  for (int j = 0; j < im.L; ++j)
    slot[j] =
        im.dbuf->peer<char>(im.node_ranks[im.me_node][j], static_cast<size_t>(im.me_local) * im.dslot) + 16;
  h->fwd_to_local.assign(im.L, {});
  std::vector<int64_t> mark(im.L, -1);
  auto forward = [&](size_t f, const uint8_t* rec) {
    const auto* idx = reinterpret_cast<const int64_t*>(rec + im.off_topk);
    for (size_t j = 0; j < k; ++j) {
      if (idx[j] < 0 || idx[j] >= cfg.num_experts) continue;
      int r = im.rankOfExpert(idx[j]);
      if (im.node_of[r] != im.me_node) continue;
      int lj = im.local_of[r];
      if (mark[lj] == static_cast<int64_t>(f)) continue;
      mark[lj] = static_cast<int64_t>(f);
      std::memcpy(slot[lj] + pos[lj] * row, rec, row);
      ++pos[lj];
      h->fwd_to_local[lj].push_back(static_cast<int32_t>(f));
    }
  };
  h->fwd_start.assign(im.N, 0);
  h->fwd_count.assign(im.N, 0);
  h->fwd_chunk.assign(im.N, C);
  {
    const auto& own = h->node_send[im.me_node];
    h->fwd_count[im.me_node] = own.size();
    for (size_t i = 0; i < own.size(); ++i) {
      forward(i, encodedRow(own[i]));
      if (i % 8 == 7) pump(sends);
    }
  }
  // Chunk 0 of every remote node gives its row count and chunk size; then the rest is posted.
  size_t next_f = h->fwd_count[im.me_node];
  std::vector<std::vector<RequestPtr>> chunks(im.N);
  rounds = 0;
  for (int m = 0; m < im.N; ++m) {
    if (m == im.me_node) continue;
    const int peer = im.node_ranks[m][im.me_local];
    first[m]->wait(dl);
    uint64_t header[2];
    std::memcpy(header, im.net_recv[m].data(), 16);
    const uint64_t count = header[0], cm = header[1];
    if (count > cfg.max_tokens || cm == 0 || dispatchChunks(count, cm) > kMaxChunks)
      throw InternalError(im.ctx(op) + fmt::format("rank {} sent a bad header: {} rows in chunks of {} "
                                                   "(max_tokens {})",
                                                   peer, count, cm, cfg.max_tokens));
    if (cached && count != cached->fwd_count[m])
      throw InvalidUsage(im.ctx(op) +
                         fmt::format("rank {} sent {} rows where the cached handle expects {}: every "
                                     "rank must pass a handle of the same earlier dispatch",
                                     peer, count, cached->fwd_count[m]));
    h->fwd_start[m] = next_f;
    h->fwd_count[m] = count;
    h->fwd_chunk[m] = cm;
    next_f += count;
    const size_t n = dispatchChunks(count, cm);
    rounds = std::max(rounds, n);
    chunks[m].push_back(first[m]);
    for (size_t c = 1; c < n; ++c) {
      const size_t lo = c * cm, hi = std::min<size_t>(count, lo + cm);
      chunks[m].push_back(im.comm->irecv(im.net_recv[m].data() + 16 + lo * row, (hi - lo) * row, peer,
                                         tag + static_cast<uint32_t>(c)));
    }
  }
  for (size_t c = 0; c < rounds; ++c)
    for (int m = 0; m < im.N; ++m) {
      if (m == im.me_node || c >= chunks[m].size()) continue;
      chunks[m][c]->wait(dl);
      const size_t cm = h->fwd_chunk[m], lo = c * cm, hi = std::min(h->fwd_count[m], lo + cm);
      for (size_t i = lo; i < hi; ++i) {
        forward(h->fwd_start[m] + i, im.net_recv[m].data() + 16 + i * row);
        if (i % 8 == 7) pump(sends);
      }
    }
  im.comm->waitAll(sends, dl);
  for (int j = 0; j < im.L; ++j) {
    int d = im.node_ranks[im.me_node][j];
    const uint64_t count = pos[j];
    std::memcpy(slot[j] - 16, &count, 8);
    if (d != im.rank) {
      im.dbuf->putSignal(d, kDispatchData);
      res.metrics.intra_node_bytes += count * row;
    }
  }

  // 3. receive: rows from each local forwarder, ordered by (source rank, token).
  std::vector<const uint8_t*> slot_rows;
  std::vector<std::pair<int, int>> slot_of;  // (forwarder j, position)
  h->recv_rows.assign(im.L, {});
  for (int j = 0; j < im.L; ++j) {
    int f = im.node_ranks[im.me_node][j];
    if (f != im.rank) im.dbuf->waitSignal(f, kDispatchData, dl);
    const char* s = im.dbuf->local<char>(static_cast<size_t>(j) * im.dslot);
    uint64_t count;
    std::memcpy(&count, s, 8);
    if (count > im.fmax)
      throw InternalError(im.ctx(op) +
                          fmt::format("rank {} forwarded {} rows (at most {} fit)", f, count, im.fmax));
    if (cached && count != cached->recv_rows[j].size())
      throw InvalidUsage(im.ctx(op) +
                         fmt::format("rank {} forwarded {} rows where the cached handle expects {}", f, count,
                                     cached->recv_rows[j].size()));
    for (uint64_t p = 0; p < count; ++p) {
      slot_rows.push_back(reinterpret_cast<const uint8_t*>(s + 16 + p * row));
      slot_of.emplace_back(j, static_cast<int>(p));
    }
  }
  const size_t n = slot_rows.size();
  std::vector<size_t> order(n);  // order[i]: index into slot_rows of output row i
  if (cached) {
    size_t s = 0;
    for (int j = 0; j < im.L; ++j)
      for (int32_t row : cached->recv_rows[j]) order[row] = s++;
    h->recv_rows = cached->recv_rows;
  } else {
    std::iota(order.begin(), order.end(), 0);
    auto key = [&](size_t s) {
      RowHeader hd;
      std::memcpy(&hd, slot_rows[s], sizeof hd);
      return std::make_pair(hd.src_rank, hd.src_token);
    };
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
    std::vector<size_t> count_of(im.L, 0);
    for (size_t s = 0; s < n; ++s) ++count_of[slot_of[s].first];
    for (int j = 0; j < im.L; ++j) h->recv_rows[j].assign(count_of[j], -1);
    for (size_t i = 0; i < n; ++i) h->recv_rows[slot_of[order[i]].first][slot_of[order[i]].second] = i;
  }
  h->num_recv = n;
  res.num_recv = n;
  res.x.resize(n * H * im.es);
  res.src_rank.resize(n);
  res.src_token.resize(n);
  res.recv_per_rank.assign(im.R, 0);
  res.topk_idx.resize(n * k);
  res.topk_weights.resize(n * k);
  res.tokens_per_expert.assign(im.epr, 0);
  if (cfg.return_quantized && im.quantized()) {
    res.q_payload.resize(n * im.payload_bytes);
    res.q_scales.resize(n * im.scale_bytes);
    res.q_global_scale.resize(n);
  }
  const int64_t first_expert = static_cast<int64_t>(im.rank) * im.epr;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* rec = slot_rows[order[i]];
    RowHeader hd;
    std::memcpy(&hd, rec, sizeof hd);
    res.src_rank[i] = hd.src_rank;
    res.src_token[i] = hd.src_token;
    if (hd.src_rank < 0 || hd.src_rank >= im.R)
      throw InternalError(im.ctx(op) + fmt::format("received a row from rank {}", hd.src_rank));
    ++res.recv_per_rank[hd.src_rank];
    const auto* idx = reinterpret_cast<const int64_t*>(rec + im.off_topk);
    const auto* w = reinterpret_cast<const float*>(rec + im.off_w);
    for (size_t j = 0; j < k; ++j) {
      int64_t e = idx[j] - first_expert;
      bool local = idx[j] >= 0 && e >= 0 && e < im.epr;
      if (local && cfg.expert_capacity >= 0 && res.tokens_per_expert[e] >= cfg.expert_capacity) {
        local = false;
        ++res.metrics.dropped;
      }
      res.topk_idx[i * k + j] = local ? e : -1;
      res.topk_weights[i * k + j] = local ? w[j] : 0.0f;
      if (local) ++res.tokens_per_expert[e];
    }
    im.decodeRow(rec, res.x.data() + i * H * im.es);
    if (!res.q_payload.empty()) {
      std::memcpy(res.q_payload.data() + i * im.payload_bytes, rec + im.off_payload, im.payload_bytes);
      std::memcpy(res.q_scales.data() + i * im.scale_bytes, rec + im.off_scales, im.scale_bytes);
      res.q_global_scale[i] = hd.global_scale;
    }
  }
  // Our slots are copied out: the forwarders may overwrite them (next dispatch).
  for (int j = 0; j < im.L; ++j) {
    int f = im.node_ranks[im.me_node][j];
    if (f != im.rank) im.dbuf->putSignal(f, kDispatchAck);
  }
  ++im.dispatches;

  // Expert-major copy.
  res.expert_offsets.assign(im.epr + 1, 0);
  for (int e = 0; e < im.epr; ++e)
    res.expert_offsets[e + 1] = res.expert_offsets[e] + res.tokens_per_expert[e];
  res.expert_rows.resize(res.expert_offsets[im.epr]);
  res.expert_weights.resize(res.expert_rows.size());
  res.x_expert_major.resize(res.expert_rows.size() * H * im.es);
  std::vector<int> fill(res.expert_offsets.begin(), res.expert_offsets.end() - 1);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < k; ++j) {
      int64_t e = res.topk_idx[i * k + j];
      if (e < 0) continue;
      int pos = fill[e]++;
      res.expert_rows[pos] = static_cast<int32_t>(i);
      res.expert_weights[pos] = res.topk_weights[i * k + j];
      std::memcpy(res.x_expert_major.data() + pos * H * im.es, res.x.data() + i * H * im.es, H * im.es);
    }

  const auto& st = h->stats;
  {
    // A flat all-to-all sends one row per (token, expert) whose expert is not on this rank.
    size_t own = 0;
    for (int e = 0; e < im.epr && !st.tokens_per_expert.empty(); ++e)
      own += st.tokens_per_expert[first_expert + e];
    res.metrics.flat_bytes = (st.token_expert_pairs - own) * im.row;
  }
  uint64_t moved = res.metrics.inter_node_bytes + res.metrics.intra_node_bytes;
  res.metrics.dedup_factor = moved ? static_cast<double>(res.metrics.flat_bytes) / moved : 1.0;
  res.metrics.network_dedup = st.remote_token_node_pairs ? static_cast<double>(st.remote_token_expert_pairs) /
                                                               st.remote_token_node_pairs
                                                         : 1.0;
  int mx = 0;
  long sum = 0;
  for (int c : res.tokens_per_expert) {
    mx = std::max(mx, c);
    sum += c;
  }
  res.metrics.expert_imbalance = sum ? static_cast<double>(mx) * im.epr / sum : 1.0;
  res.handle = std::move(h);
  return res;
}

CombineResult MoeBuffer::combine(const void* y, DataType y_type, const MoeHandle& h, const float* weights) {
  Impl& im = *impl_;
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

  // 1. each output row goes back to the local forwarder it came from, as f32.
  for (int j = 0; j < im.L; ++j) {
    int f = im.node_ranks[im.me_node][j];
    if (f != im.rank && im.combines > 0) im.cbuf->waitSignal(f, kCombineAck, dl);
    float* slot = im.cbuf->peer<float>(f, static_cast<size_t>(im.me_local) * im.cslot);
    const auto& rows = h.recv_rows[j];
    for (size_t p = 0; p < rows.size(); ++p) {
      const char* src = static_cast<const char*>(y) + static_cast<size_t>(rows[p]) * H * yes;
      float w = weights ? weights[rows[p]] : 1.0f;
      for (size_t c = 0; c < H; ++c) slot[p * H + c] = loadAsFloat(src, y_type, c) * w;
    }
    if (f != im.rank) {
      im.cbuf->putSignal(f, kCombineData);
      res.metrics.intra_node_bytes += rows.size() * H * sizeof(float);
    }
  }

  // Source side: the partial sums of each remote node come back in chunks of our chunk size.
  // Partials cross the network as f32, or bf16 with combine_wire = kBFloat16 (half the bytes,
  // one rounding of each node's partial sum; the source still sums in f32).
  const bool wire16 = im.cfg.combine_wire == DataType::kBFloat16;
  const size_t ws = wire16 ? 2 : 4;
  std::vector<std::vector<uint8_t>> back(im.N);
  std::vector<std::vector<RequestPtr>> recvs(im.N);
  for (int m = 0; m < im.N; ++m) {
    const size_t count = h.node_send[m].size();
    if (m == im.me_node || count == 0) continue;
    back[m].resize(count * H * ws);
    for (size_t lo = 0, c = 0; lo < count; lo += h.chunk, ++c) {
      const size_t rows = std::min(h.chunk, count - lo);
      recvs[m].push_back(im.comm->irecv(back[m].data() + lo * H * ws, rows * H * ws,
                                        im.node_ranks[m][im.me_local], tag + static_cast<uint32_t>(c)));
    }
  }

  // 2. as forwarder: wait for the node's partials, sum them per F row (in local-rank order, so
  // the result does not depend on the chunk size), and send each remote node's chunk as soon as
  // it is summed: chunk k crosses the network while chunk k+1 is being summed.
  for (int j = 0; j < im.L; ++j) {
    int d = im.node_ranks[im.me_node][j];
    if (d != im.rank) im.cbuf->waitSignal(d, kCombineData, dl);
  }
  size_t nf = 0;
  for (size_t c : h.fwd_count) nf += c;
  std::vector<size_t> first(nf + 1, 0);  // contributions of F row i: contrib[first[i], first[i+1])
  for (const auto& list : h.fwd_to_local)
    for (int32_t f : list) ++first[f + 1];
  for (size_t i = 0; i < nf; ++i) first[i + 1] += first[i];
  std::vector<const float*> contrib(first[nf]);
  {
    std::vector<size_t> fill(first.begin(), first.end() - 1);
    for (int j = 0; j < im.L; ++j) {
      const float* s = im.cbuf->local<float>(static_cast<size_t>(j) * im.cslot);
      const auto& list = h.fwd_to_local[j];
      for (size_t p = 0; p < list.size(); ++p) contrib[fill[list[p]]++] = s + p * H;
    }
  }
  std::vector<float> acc(nf * H, 0.0f);
  std::vector<uint8_t> acc16(wire16 ? nf * H * 2 : 0);
  auto reduce = [&](size_t i) {
    float* a = acc.data() + i * H;
    for (size_t q = first[i]; q < first[i + 1]; ++q)
      for (size_t c = 0; c < H; ++c) a[c] += contrib[q][c];
  };
  std::vector<RequestPtr> sends;
  size_t rounds = 0;
  for (int m = 0; m < im.N; ++m)
    if (m != im.me_node && h.fwd_count[m] > 0)
      rounds = std::max(rounds, dispatchChunks(h.fwd_count[m], h.fwd_chunk[m]));
  for (size_t c = 0; c < rounds; ++c)
    for (int m = 0; m < im.N; ++m) {
      const size_t count = h.fwd_count[m], cm = h.fwd_chunk[m], lo = c * cm;
      if (m == im.me_node || lo >= count) continue;
      const size_t hi = std::min(count, lo + cm);
      for (size_t i = lo; i < hi; ++i) reduce(h.fwd_start[m] + i);
      const void* src = acc.data() + (h.fwd_start[m] + lo) * H;
      if (wire16) {
        auto* b = reinterpret_cast<BFloat16*>(acc16.data()) + (h.fwd_start[m] + lo) * H;
        for (size_t e = 0; e < (hi - lo) * H; ++e)
          b[e] = BFloat16::fromFloat(acc[(h.fwd_start[m] + lo) * H + e]);
        src = b;
      }
      sends.push_back(im.comm->isend(src, (hi - lo) * H * ws, im.node_ranks[m][im.me_local],
                                     tag + static_cast<uint32_t>(c)));
      res.metrics.inter_node_bytes += (hi - lo) * H * ws;
      pump(sends);
    }
  for (size_t i = 0; i < h.fwd_count[im.me_node]; ++i) {
    reduce(h.fwd_start[im.me_node] + i);
    if (i % 8 == 7) pump(sends);
  }
  for (int j = 0; j < im.L; ++j) {
    int d = im.node_ranks[im.me_node][j];
    if (d != im.rank) im.cbuf->putSignal(d, kCombineAck);
  }
  ++im.combines;

  // 3. as source: sum the nodes' partials per token in node order (deterministic), each chunk
  // as it arrives.
  res.out.assign(h.tokens * H, 0.0f);
  for (int m = 0; m < im.N; ++m) {
    const auto& list = h.node_send[m];
    const bool own = m == im.me_node;
    for (size_t i = 0; i < list.size(); ++i) {
      if (!own && i % h.chunk == 0) recvs[m][i / h.chunk]->wait(dl);
      float* o = res.out.data() + static_cast<size_t>(list[i]) * H;
      if (own || !wire16) {
        const float* s = own ? acc.data() + (h.fwd_start[m] + i) * H
                             : reinterpret_cast<const float*>(back[m].data()) + i * H;
        for (size_t c = 0; c < H; ++c) o[c] += s[c];
      } else {
        const auto* s = reinterpret_cast<const BFloat16*>(back[m].data()) + i * H;
        for (size_t c = 0; c < H; ++c) o[c] += s[c].toFloat();
      }
    }
  }
  im.comm->waitAll(sends, dl);
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
  for (size_t r = 0; r < d.expert_rows.size(); ++r) {
    const char* src = static_cast<const char*>(y) + r * H * yes;
    float w = weights ? weights[r] : 1.0f;
    float* o = rows.data() + static_cast<size_t>(d.expert_rows[r]) * H;
    for (size_t c = 0; c < H; ++c) o[c] += loadAsFloat(src, y_type, c) * w;
  }
  return combine(rows.data(), DataType::kFloat32, *d.handle);
}

}  // namespace crossbar::moe
