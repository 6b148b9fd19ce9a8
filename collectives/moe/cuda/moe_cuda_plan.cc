#include "collectives/moe/cuda/moe_cuda_plan.h"

#include <fmt/format.h>

#include <cstring>

#include "comm/errors.h"

namespace crossbar::moe {

CudaMoePlan exchangeCudaMoePlan(Communicator& comm, const MoeTopology& t, const MoeConfig& cfg,
                                size_t row_bytes, const int64_t* topk_idx, size_t tokens, uint32_t tag,
                                Deadline dl) {
  const char* op = "moe dispatch (cuda plan)";
  const std::string ctx = errorContext(t.rank, op);
  const size_t k = static_cast<size_t>(cfg.topk), w = 1 + k;  // int64 words per row of metadata
  CudaMoePlan p;
  p.tokens = tokens;
  p.stats = computeLayout(t, cfg.topk, topk_idx, tokens, cfg.num_experts, ctx);
  p.node_send = nodeSendLists(t, p.stats);
  p.stats.is_token_in_rank.clear();

  // 1. to each remote node's forwarder for this rank: [token, ids...] of the tokens bound for
  // that node; from each source this rank forwards for, the same about this node.
  const auto& sources = t.fwd_sources;
  const size_t S = sources.size();
  std::vector<std::vector<int64_t>> out1(t.N), in1(S);
  std::vector<RequestPtr> reqs, recvs1(S);
  for (size_t st = 1; st < S; ++st) {
    in1[st].resize(cfg.max_tokens * w);
    recvs1[st] = comm.irecv(in1[st].data(), in1[st].size() * 8, sources[st], tag);
    reqs.push_back(recvs1[st]);
  }
  for (int m = 0; m < t.N; ++m) {
    if (m == t.me_node) continue;
    for (int32_t tok : p.node_send[m]) {
      out1[m].push_back(tok);
      out1[m].insert(out1[m].end(), topk_idx + tok * k, topk_idx + (tok + 1) * k);
    }
    reqs.push_back(comm.isend(out1[m].data(), out1[m].size() * 8, t.forwarderOn(m, t.rank), tag));
    p.inter_node_bytes += p.node_send[m].size() * row_bytes;
  }
  comm.waitAll(reqs, dl);
  reqs.clear();

  // F: own block first, then the sources' blocks in stream order; per row (source rank,
  // token, ids).
  p.fwd_start.assign(S, 0);
  p.fwd_count.assign(S, 0);
  std::vector<int64_t> f_src, f_ids;  // [F]: src_rank << 32 | token; [F x k]
  auto addBlock = [&](size_t st, int src, const int64_t* rows, size_t count) {
    p.fwd_start[st] = f_src.size();
    p.fwd_count[st] = count;
    for (size_t i = 0; i < count; ++i) {
      const int64_t* r = rows + i * w;
      f_src.push_back((static_cast<int64_t>(src) << 32) | static_cast<uint32_t>(r[0]));
      f_ids.insert(f_ids.end(), r + 1, r + w);
    }
  };
  {
    std::vector<int64_t> own;
    for (int32_t tok : p.node_send[t.me_node]) {
      own.push_back(tok);
      own.insert(own.end(), topk_idx + tok * k, topk_idx + (tok + 1) * k);
    }
    addBlock(0, t.rank, own.data(), p.node_send[t.me_node].size());
  }
  for (size_t st = 1; st < S; ++st) {
    const size_t bytes = recvs1[st]->status().bytes;
    const int src = sources[st];
    if (bytes % (w * 8) != 0 || bytes / (w * 8) > cfg.max_tokens)
      throw InternalError(ctx + fmt::format("rank {} sent {} bytes of routing metadata (not rows of {} words, "
                                            "at most {})",
                                            src, bytes, w, cfg.max_tokens));
    addBlock(st, src, in1[st].data(), bytes / (w * 8));
  }
  p.fwd_to_local = localTargets(t, cfg.topk, cfg.num_experts, f_ids.data(), f_src.size());

  // 2. to each local rank: (source rank << 32 | token, ids...) of the rows written to it.
  std::vector<std::vector<int64_t>> out2(t.L), in2(t.L);
  std::vector<RequestPtr> recvs2(t.L);
  const size_t fmax = static_cast<size_t>(t.max_sources) * cfg.max_tokens;
  for (int j = 0; j < t.L; ++j) {
    for (int32_t f : p.fwd_to_local[j]) {
      out2[j].push_back(f_src[f]);
      out2[j].insert(out2[j].end(), f_ids.begin() + f * k, f_ids.begin() + (f + 1) * k);
    }
    const int peer = t.localRank(j);
    if (peer == t.rank) {
      in2[j] = out2[j];
      continue;
    }
    p.intra_node_bytes += p.fwd_to_local[j].size() * row_bytes;
    in2[j].resize(fmax * w);
    recvs2[j] = comm.irecv(in2[j].data(), in2[j].size() * 8, peer, tag + 1);
    reqs.push_back(recvs2[j]);
    reqs.push_back(comm.isend(out2[j].data(), out2[j].size() * 8, peer, tag + 1));
  }
  comm.waitAll(reqs, dl);

  // Receiver: rows of source s land at src_off[s] + their index among s's rows (each source's
  // rows come through one forwarder, in token order).
  std::vector<size_t> count(t.L);
  std::vector<int> per_src(t.R, 0);
  for (int j = 0; j < t.L; ++j) {
    const size_t bytes = recvs2[j] ? recvs2[j]->status().bytes : in2[j].size() * 8;
    if (bytes % (w * 8) != 0)
      throw InternalError(ctx + fmt::format("rank {} sent {} bytes of forwarding metadata", t.localRank(j), bytes));
    count[j] = bytes / (w * 8);
    for (size_t q = 0; q < count[j]; ++q) {
      const int s = static_cast<int>(in2[j][q * w] >> 32);
      if (s < 0 || s >= t.R || t.forwarderLocal(s) != j)
        throw InternalError(ctx + fmt::format("rank {} forwards a row of rank {}, which is not its to forward",
                                              t.localRank(j), s));
      ++per_src[s];
    }
  }
  std::vector<size_t> src_off(t.R + 1, 0);
  for (int s = 0; s < t.R; ++s) src_off[s + 1] = src_off[s] + static_cast<size_t>(per_src[s]);
  p.num_recv = src_off[t.R];
  p.recv_per_rank = per_src;
  p.src_rank.assign(p.num_recv, -1);
  p.src_token.assign(p.num_recv, -1);
  std::vector<int64_t> ids(p.num_recv * k, -1);
  std::vector<size_t> fill(src_off.begin(), src_off.end() - 1);
  p.recv_rows.assign(t.L, {});
  for (int j = 0; j < t.L; ++j)
    for (size_t q = 0; q < count[j]; ++q) {
      const int64_t* r = in2[j].data() + q * w;
      const int s = static_cast<int>(r[0] >> 32);
      const size_t i = fill[s]++;
      p.src_rank[i] = s;
      p.src_token[i] = static_cast<int32_t>(r[0] & 0xFFFFFFFF);
      std::memcpy(ids.data() + i * k, r + 1, 8 * k);
      p.recv_rows[j].push_back(static_cast<int32_t>(i));
    }
  ExpertAssigner assigner(t, cfg.topk, cfg.expert_capacity);
  p.topk_idx.resize(p.num_recv * k);
  for (size_t i = 0; i < p.num_recv; ++i) assigner.assign(ids.data() + i * k, nullptr, p.topk_idx.data() + i * k, nullptr);
  p.tokens_per_expert = assigner.tokensPerExpert();
  p.dropped = assigner.dropped();
  p.expert_major = expertMajorIndex(p.topk_idx, p.num_recv, cfg.topk, p.tokens_per_expert);
  return p;
}

CudaMoeForwardPhases cudaMoeForwardPhases(const CudaMoePlan& p, size_t own_rows) {
  CudaMoeForwardPhases x;
  x.own_rows = own_rows;
  for (int ph = 0; ph < 2; ++ph) {
    x.src[ph].resize(p.fwd_to_local.size());
    x.pos[ph].resize(p.fwd_to_local.size());
  }
  for (size_t j = 0; j < p.fwd_to_local.size(); ++j)
    for (size_t q = 0; q < p.fwd_to_local[j].size(); ++q) {
      const int32_t f = p.fwd_to_local[j][q];
      const int ph = static_cast<size_t>(f) < own_rows ? 0 : 1;
      x.src[ph][j].push_back(f);
      x.pos[ph][j].push_back(static_cast<int32_t>(q));
    }
  return x;
}

CudaMoeSumIndex cudaMoeSumIndex(const CudaMoePlan& p, size_t slot_floats, size_t hidden) {
  CudaMoeSumIndex x;
  for (size_t c : p.fwd_count) x.nf += c;
  x.c_first.assign(x.nf + 1, 0);
  for (const auto& list : p.fwd_to_local)
    for (int32_t f : list) ++x.c_first[f + 1];
  for (size_t i = 0; i < x.nf; ++i) x.c_first[i + 1] += x.c_first[i];
  x.c_offs.resize(x.c_first[x.nf]);
  {
    std::vector<int32_t> fill(x.c_first.begin(), x.c_first.end() - 1);
    for (size_t j = 0; j < p.fwd_to_local.size(); ++j)
      for (size_t q = 0; q < p.fwd_to_local[j].size(); ++q)
        x.c_offs[fill[p.fwd_to_local[j][q]]++] = static_cast<int64_t>(j * slot_floats + q * hidden);
  }
  x.t_first.assign(p.tokens + 1, 0);
  for (const auto& list : p.node_send)
    for (int32_t t : list) ++x.t_first[t + 1];
  for (size_t t = 0; t < p.tokens; ++t) x.t_first[t + 1] += x.t_first[t];
  x.t_src.resize(x.t_first[p.tokens]);
  {
    std::vector<int32_t> fill(x.t_first.begin(), x.t_first.end() - 1);
    for (size_t m = 0; m < p.node_send.size(); ++m)
      for (size_t i = 0; i < p.node_send[m].size(); ++i)
        x.t_src[fill[p.node_send[m][i]]++] = (static_cast<int64_t>(m) << 32) | static_cast<int64_t>(i);
  }
  const auto& rows = p.expert_major.rows;
  x.em_first.assign(p.num_recv + 1, 0);
  x.em_idx.resize(rows.size());
  for (int32_t r : rows) ++x.em_first[r + 1];
  for (size_t i = 0; i < p.num_recv; ++i) x.em_first[i + 1] += x.em_first[i];
  {
    std::vector<int32_t> fill(x.em_first.begin(), x.em_first.end() - 1);
    for (size_t q = 0; q < rows.size(); ++q) x.em_idx[fill[rows[q]]++] = static_cast<int32_t>(q);
  }
  return x;
}

}  // namespace crossbar::moe
