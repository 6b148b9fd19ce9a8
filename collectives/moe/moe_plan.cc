#include "collectives/moe/moe_plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "comm/errors.h"
#include "comm/log.h"

namespace crossbar::moe {
namespace {
constexpr size_t align16(size_t v) {
  return (v + 15) & ~size_t{15};
}
}  // namespace

MoeTopology makeTopology(const Communicator& comm, const MoeConfig& cfg, const char* op) {
  MoeTopology t;
  t.rank = comm.rank();
  t.R = comm.size();
  const std::string ctx = errorContext(t.rank, op);
  if (cfg.num_experts <= 0 || cfg.num_experts % t.R != 0)
    throw InvalidArgument(ctx + fmt::format("{} experts cannot be spread evenly over {} ranks: use a "
                                            "multiple of the communicator size",
                                            cfg.num_experts, t.R));
  if (cfg.hidden == 0 || cfg.topk <= 0 || cfg.max_tokens == 0)
    throw InvalidArgument(ctx + fmt::format("hidden ({}), topk ({}) and max_tokens ({}) must be positive",
                                            cfg.hidden, cfg.topk, cfg.max_tokens));
  if (cfg.dtype != DataType::kBFloat16 && cfg.dtype != DataType::kFloat32)
    throw InvalidArgument(ctx + "tokens must be bfloat16 or float32");
  if (cfg.max_tokens > (size_t{1} << 30)) throw InvalidArgument(ctx + "max_tokens is too large");
  if (cfg.combine_wire != DataType::kFloat32 && cfg.combine_wire != DataType::kBFloat16)
    throw InvalidArgument(ctx + "combine_wire must be float32 or bfloat16");
  t.epr = cfg.num_experts / t.R;

  t.node_ranks = comm.nodes();  // physical nodes, in order of their first rank
  t.N = static_cast<int>(t.node_ranks.size());
  t.node_of.resize(t.R);
  t.local_of.resize(t.R);
  for (int m = 0; m < t.N; ++m) {
    t.max_node = std::max(t.max_node, static_cast<int>(t.node_ranks[m].size()));
    for (size_t l = 0; l < t.node_ranks[m].size(); ++l) {
      t.node_of[t.node_ranks[m][l]] = m;
      t.local_of[t.node_ranks[m][l]] = static_cast<int>(l);
    }
  }
  t.me_node = t.node_of[t.rank];
  t.me_local = t.local_of[t.rank];
  t.L = static_cast<int>(t.node_ranks[t.me_node].size());
  const bool uneven = std::any_of(t.node_ranks.begin(), t.node_ranks.end(),
                                 [&](const auto& n) { return static_cast<int>(n.size()) != t.L; });
  // Who forwards for whom, from every rank's point of view (max_sources must agree everywhere).
  std::vector<int> sources(t.R, 1);  // [rank]: sources it forwards for, itself included
  for (int m = 0; m < t.N; ++m) {
    const auto& there = t.node_ranks[m];
    size_t extra = 0;  // sources of m so far whose local index m lacks: dealt round-robin
    for (int s = 0; s < t.R; ++s) {
      if (m == t.node_of[s]) continue;
      if (static_cast<size_t>(t.local_of[s]) >= there.size())
        t.extra_forwarder[static_cast<int64_t>(m) * t.R + s] = there[extra++ % there.size()];
      ++sources[t.forwarderOn(m, s)];
    }
  }
  t.max_sources = *std::max_element(sources.begin(), sources.end());
  t.fwd_sources.push_back(t.rank);
  t.sources_via.resize(t.L);
  for (int s = 0; s < t.R; ++s) {
    const int f = t.node_of[s] == t.me_node ? s : t.forwarderOn(t.me_node, s);
    t.sources_via[t.local_of[f]].push_back(s);
    if (f == t.rank && s != t.rank) t.fwd_sources.push_back(s);
  }
  if (uneven && t.rank == 0) {
    std::string sizes;
    for (const auto& n : t.node_ranks) sizes += fmt::format("{}{}", sizes.empty() ? "" : ", ", n.size());
    CB_INFO("moe",
            "{}nodes of {} ranks: a rank forwards the tokens of up to {} ranks of other nodes (a "
            "smaller node's ranks serve several of a larger one; tokens still cross the network once "
            "per destination node)",
            ctx, sizes, t.max_sources - 1);
  }
  return t;
}

RowFormat makeRowFormat(const MoeConfig& cfg) {
  RowFormat f;
  f.es = elementSize(cfg.dtype);
  const size_t k = static_cast<size_t>(cfg.topk);
  f.off_topk = sizeof(RowHeader);
  f.off_w = f.off_topk + 8 * k;
  f.off_scales = align16(f.off_w + 4 * k);
  if (cfg.format != PayloadFormat::kNative) {
    f.scale_bytes = scaleBytes(payloadCodec(cfg.format), cfg.hidden);
    f.payload_bytes = payloadBytes(payloadCodec(cfg.format), cfg.hidden);
  } else {
    f.payload_bytes = cfg.hidden * f.es;
  }
  f.off_payload = align16(f.off_scales + f.scale_bytes);
  f.row = align16(f.off_payload + f.payload_bytes);
  return f;
}

void checkQuantizedInput(const MoeConfig& cfg, const RowFormat& f, const QuantizedTokens& xq, size_t tokens,
                         const std::string& ctx) {
  if (cfg.format == PayloadFormat::kNative)
    throw InvalidUsage(ctx + fmt::format("pre-quantized x ({}) given to a buffer with the native payload "
                                         "format: pass x itself, or create the buffer with that format",
                                         payloadFormatName(xq.format)));
  if (xq.format != cfg.format)
    throw InvalidUsage(ctx + fmt::format("pre-quantized x is {} but the buffer's payload format is {}: "
                                         "quantize x with the buffer's format",
                                         payloadFormatName(xq.format), payloadFormatName(cfg.format)));
  if (xq.payload_row_bytes != f.payload_bytes || xq.scale_row_bytes != f.scale_bytes)
    throw InvalidUsage(
        ctx + fmt::format("pre-quantized {} x has {} payload and {} scale bytes per token; "
                          "hidden {} needs {} and {} (payload [tokens x {}], scales [tokens x {}])",
                          payloadFormatName(cfg.format), xq.payload_row_bytes, xq.scale_row_bytes, cfg.hidden,
                          f.payload_bytes, f.scale_bytes, f.payload_bytes, f.scale_bytes));
  if (tokens > 0 && (!xq.payload || !xq.scales))
    throw InvalidUsage(ctx + "pre-quantized x: the payload or scales pointer is null");
}

RecvForms recvForms(const MoeConfig& cfg, RecvOutput output, const std::string& ctx) {
  const bool quantized = cfg.format != PayloadFormat::kNative;
  RecvForms r;
  r.q = cfg.return_quantized && quantized;
  if (output == RecvOutput::kConfig) return r;
  if (!quantized && output != RecvOutput::kDequantized)
    throw InvalidUsage(ctx +
                       "a quantized output was asked of a buffer with the native payload format (it "
                       "has no quantized form): create the buffer with fp8, mxfp8 or nvfp4");
  r.x = output != RecvOutput::kQuantized;
  r.q = output != RecvOutput::kDequantized && quantized;
  return r;
}

Layout computeLayout(const MoeTopology& t, int topk, const int64_t* topk_idx, size_t tokens, int num_experts,
                     const std::string& ctx) {
  const int R = t.R, N = t.N;
  if (num_experts <= 0 || num_experts % R != 0)
    throw InvalidArgument(ctx +
                          fmt::format("{} experts cannot be spread evenly over {} ranks", num_experts, R));
  if (tokens > 0 && !topk_idx) throw InvalidArgument(ctx + "topk_idx is null");
  const int per_rank = num_experts / R;
  const int k = topk;
  Layout l;
  l.tokens = tokens;
  l.tokens_per_rank.assign(R, 0);
  l.tokens_per_node.assign(N, 0);
  l.tokens_per_expert.assign(num_experts, 0);
  l.is_token_in_rank.assign(tokens * R, 0);
  std::vector<int> node_seen(N, -1);
  for (size_t tok = 0; tok < tokens; ++tok) {
    for (int j = 0; j < k; ++j) {
      int64_t e = topk_idx[tok * k + j];
      if (e == -1) continue;
      if (e < -1 || e >= num_experts)
        throw InvalidArgument(ctx + fmt::format("topk_idx[{}, {}] = {} is not an expert id in [0, {}) or -1",
                                                tok, j, e, num_experts));
      ++l.tokens_per_expert[e];
      ++l.token_expert_pairs;
      int r = static_cast<int>(e / per_rank);
      if (t.node_of[r] != t.me_node) ++l.remote_token_expert_pairs;
      uint8_t& in = l.is_token_in_rank[tok * R + r];
      if (in) continue;
      in = 1;
      ++l.tokens_per_rank[r];
      ++l.token_rank_pairs;
      int n = t.node_of[r];
      if (node_seen[n] != static_cast<int>(tok)) {
        node_seen[n] = static_cast<int>(tok);
        ++l.tokens_per_node[n];
        ++l.token_node_pairs;
        if (n != t.me_node) ++l.remote_token_node_pairs;
      }
    }
  }
  return l;
}

std::vector<std::vector<int32_t>> nodeSendLists(const MoeTopology& t, const Layout& l) {
  std::vector<std::vector<int32_t>> out(t.N);
  for (size_t tok = 0; tok < l.tokens; ++tok)
    for (int n = 0; n < t.N; ++n)
      for (int r : t.node_ranks[n])
        if (l.is_token_in_rank[tok * t.R + r]) {
          out[n].push_back(static_cast<int32_t>(tok));
          break;
        }
  return out;
}

std::vector<std::vector<int32_t>> localTargets(const MoeTopology& t, int topk, int num_experts,
                                               const int64_t* topk_rows, size_t rows) {
  std::vector<std::vector<int32_t>> out(t.L);
  std::vector<int64_t> mark(t.L, -1);
  for (size_t f = 0; f < rows; ++f) {
    const int64_t* idx = topk_rows + f * static_cast<size_t>(topk);
    for (int j = 0; j < topk; ++j) {
      if (idx[j] < 0 || idx[j] >= num_experts) continue;
      const int r = t.rankOfExpert(idx[j]);
      if (t.node_of[r] != t.me_node) continue;
      const int lj = t.local_of[r];
      if (mark[lj] == static_cast<int64_t>(f)) continue;
      mark[lj] = static_cast<int64_t>(f);
      out[lj].push_back(static_cast<int32_t>(f));
    }
  }
  return out;
}

void ExpertAssigner::assign(const int64_t* idx, const float* w, int64_t* out_idx, float* out_w) {
  for (int j = 0; j < k_; ++j) {
    const int64_t e = idx[j] - first_;
    bool local = idx[j] >= 0 && e >= 0 && e < epr_;
    if (local && capacity_ >= 0 && tokens_per_expert_[e] >= capacity_) {
      local = false;
      ++dropped_;
    }
    out_idx[j] = local ? e : -1;
    if (out_w) out_w[j] = local && w ? w[j] : 0.0f;
    if (local) ++tokens_per_expert_[e];
  }
}

ExpertMajorIndex expertMajorIndex(const std::vector<int64_t>& topk_idx, size_t n, int topk,
                                  const std::vector<int>& tokens_per_expert) {
  const int epr = static_cast<int>(tokens_per_expert.size());
  const size_t k = static_cast<size_t>(topk);
  ExpertMajorIndex x;
  x.offsets.assign(epr + 1, 0);
  for (int e = 0; e < epr; ++e) x.offsets[e + 1] = x.offsets[e] + tokens_per_expert[e];
  x.rows.resize(x.offsets[epr]);
  x.slots.resize(x.rows.size());
  std::vector<int> fill(x.offsets.begin(), x.offsets.end() - 1);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < k; ++j) {
      const int64_t e = topk_idx[i * k + j];
      if (e < 0) continue;
      const int pos = fill[e]++;
      x.rows[pos] = static_cast<int32_t>(i);
      x.slots[pos] = static_cast<int32_t>(i * k + j);
    }
  return x;
}

void finishDispatchMetrics(MoeMetrics& m, const MoeTopology& t, const Layout& st, size_t row,
                           const std::vector<int>& tokens_per_expert) {
  const int64_t first_expert = static_cast<int64_t>(t.rank) * t.epr;
  // A flat all-to-all sends one row per (token, expert) whose expert is not on this rank.
  size_t own = 0;
  for (int e = 0; e < t.epr && !st.tokens_per_expert.empty(); ++e)
    own += st.tokens_per_expert[first_expert + e];
  m.flat_bytes = (st.token_expert_pairs - own) * row;
  const uint64_t moved = m.inter_node_bytes + m.intra_node_bytes;
  m.dedup_factor = moved ? static_cast<double>(m.flat_bytes) / moved : 1.0;
  m.network_dedup = st.remote_token_node_pairs
                        ? static_cast<double>(st.remote_token_expert_pairs) / st.remote_token_node_pairs
                        : 1.0;
  int mx = 0;
  long sum = 0;
  for (int c : tokens_per_expert) {
    mx = std::max(mx, c);
    sum += c;
  }
  m.expert_imbalance = sum ? static_cast<double>(mx) * t.epr / sum : 1.0;
}

}  // namespace crossbar::moe
