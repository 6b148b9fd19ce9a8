// moe_netns_bench: two-level MoE dispatch/combine (collectives/moe) against a flat
// per-(token, expert) all-to-all (Megatron's alltoall dispatcher: one row per routed expert),
// with bf16 / fp8 / mxfp8 payloads, over virtual nodes that are real network namespaces.
//
// Every virtual node is a network namespace joined to a switch namespace (a bridge) by a
// veth pair; both directions of each node's link are rate-limited with `tc tbf` (default:
// a third of this machine's single-core memcpy bandwidth, i.e. of the intra-node path).
// Ranks of one node share memory (/dev/shm is not namespaced); across nodes the
// communicator's UCX transport is forced onto TCP over the veth links. Needs root and
// iproute2; exits 77 (skip) when namespaces cannot be created.
//
//   moe_netns_bench [--nodes 2] [--ranks-per-node 2] [--last-node-ranks K] [--tokens 512] [--hidden 7168]
//                   [--experts 256] [--topk 8] [--max-nodes M] [--formats native,fp8]
//                   [--rate auto|<tc rate, e.g. 2gbit>] [--queue-ms 200] [--iters 5] [--rounds 1]
//                   [--warmup 1] [--combine-wire bf16|f32] [--no-netns] [--phases] [--fresh-output] [--no-flat]
//                   [--fp8-io dequantized|quantized|both]
//
// Every run first checks that both paths deliver the same tokens (bit for bit) and the same
// combine sums (f32 tolerance); a mismatch exits 1. Times: the median over iterations of
// the slowest rank (--rounds n: the formats take turns n times, medians over all of them).
#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/float_types.h"
#include "collectives/moe/moe.h"
#include "collectives/moe/routing.h"
#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/local_launch.h"
#include "perf/bench_flags.h"

namespace crossbar::moe {
namespace {

constexpr int kSkip = 77;
constexpr int kAutoMaxNodes = -1000;

struct Options {
  int nodes = 2, ranks_per_node = 2, experts = 256, topk = 8, iters = 5, warmup = 1;
  // Ranks on the last node (0: ranks_per_node): fewer makes nodes of different sizes, as a
  // fault-tolerant job has after losing a rank.
  int last_node_ranks = 0;
  // Rounds over the formats: each round runs every format for `iters` timed iterations (the
  // warmup only in the first); medians are over all rounds' iterations.
  int rounds = 1;
  // Node-limited routing: a token's experts lie on at most this many nodes. Default: half the
  // nodes (DeepSeek-V3: 4 of 8), at least 1; 0 or less: no limit.
  int max_nodes = kAutoMaxNodes;
  size_t tokens = 512, hidden = 7168;
  std::string rate = "auto";
  int queue_ms = 200;  // tbf latency: the longest a packet may queue at a link
  DataType combine_wire = DataType::kBFloat16;  // two-level combine's partials on the network
  bool netns = true;
  bool phases = false;  // print where the two-level time goes (MoeMetrics::phases)
  // Two-level dispatch into a fresh result every call instead of recycling the previous
  // iteration's (MoeBuffer::dispatch's `recycle`): shows the page-fault cost of a new x.
  bool fresh_output = false;
  // Time only the two-level path (quick A/B of dispatch/combine changes); the flat path is
  // still run once per format for the correctness check.
  bool no_flat = false;
  std::vector<PayloadFormat> formats{PayloadFormat::kNative, PayloadFormat::kFp8};
  // How fp8 / mxfp8 dispatch takes and returns tokens: dequantized (bf16 x in, encoded in
  // dispatch; decoded back to bf16 x at the receiver) and/or quantized (DeepEP's fp8 path: x
  // quantized once before timing, sent as is; the receiver gets codes + scales, no decode).
  bool io_dequantized = true, io_quantized = false;
};

// ---------------------------------------------------------------- network namespaces

std::string shell(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) {
    *status = -1;
    return "popen failed";
  }
  char buf[512];
  while (fgets(buf, sizeof buf, p)) out += buf;
  *status = pclose(p);
  return out;
}

// Nodes n0..n(N-1) and a switch namespace, named after this process so concurrent runs do
// not collide; namespaces left by a killed run (its pid gone) are removed on the next start.
class NetnsTopology {
 public:
  NetnsTopology(int nodes, const std::string& rate, int queue_ms)
      : prefix_(fmt::format("cbxmoe{}", getpid())) {
    sweepStale();
    run("ip netns add " + sw());
    created_.push_back(sw());
    run(fmt::format("ip -n {} link add br0 type bridge", sw()));
    run(fmt::format("ip -n {} link set br0 up", sw()));
    run(fmt::format("ip -n {} link set lo up", sw()));
    for (int m = 0; m < nodes; ++m) {
      const std::string ns = node(m), a = fmt::format("cbx{}a{}", getpid() % 100000, m),
                        b = fmt::format("cbx{}b{}", getpid() % 100000, m);
      run("ip netns add " + ns);
      created_.push_back(ns);
      run(fmt::format("ip link add {} type veth peer name {}", a, b));
      run(fmt::format("ip link set {} netns {}", a, ns));
      run(fmt::format("ip link set {} netns {}", b, sw()));
      run(fmt::format("ip -n {} link set {} name cbx0", ns, a));
      run(fmt::format("ip -n {} addr add 10.77.0.{}/24 dev cbx0", ns, m + 1));
      run(fmt::format("ip -n {} link set lo up", ns));
      run(fmt::format("ip -n {} link set cbx0 up", ns));
      run(fmt::format("ip -n {} link set {} master br0", sw(), b));
      run(fmt::format("ip -n {} link set {} up", sw(), b));
      // Both directions of the node's link: its egress, and the switch port towards it.
      const std::string tbf =
          fmt::format("tbf rate {} burst {} latency {}ms", rate, burstFor(rate), queue_ms);
      run(fmt::format("ip netns exec {} tc qdisc add dev cbx0 root {}", ns, tbf));
      run(fmt::format("ip netns exec {} tc qdisc add dev {} root {}", sw(), b, tbf));
    }
  }
  ~NetnsTopology() {
    for (auto it = created_.rbegin(); it != created_.rend(); ++it) {
      int st;
      shell("ip netns del " + *it, &st);
    }
  }
  NetnsTopology(const NetnsTopology&) = delete;
  NetnsTopology& operator=(const NetnsTopology&) = delete;

  std::string node(int m) const { return fmt::format("{}n{}", prefix_, m); }

  // Moves the calling process into node m's namespace (sockets opened earlier, such as the
  // store connection, stay where they were).
  void enter(int m) const {
    const std::string path = "/var/run/netns/" + node(m);
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throwSystemError(-1, "open " + path, errno);
    int rc = setns(fd, CLONE_NEWNET);
    int err = errno;
    close(fd);
    if (rc != 0) throwSystemError(-1, "setns " + path, err);
    // UCX lists devices from /sys/class/net: give this process a sysfs of the new namespace,
    // as `ip netns exec` does (own mount namespace; /dev/shm stays the shared one).
    if (unshare(CLONE_NEWNS) != 0) throwSystemError(-1, "unshare(CLONE_NEWNS)", errno);
    if (mount("", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0)
      throwSystemError(-1, "mount / slave", errno);
    umount2("/sys", MNT_DETACH);
    if (mount(node(m).c_str(), "/sys", "sysfs", 0, nullptr) != 0) throwSystemError(-1, "mount sysfs", errno);
  }

 private:
  std::string sw() const { return prefix_ + "sw"; }
  void run(const std::string& cmd) {
    int st;
    std::string out = shell(cmd, &st);
    if (st != 0)
      throw SystemError(
          fmt::format("moe_netns_bench: '{}' failed: {}(run as root with iproute2 installed)", cmd, out));
  }
  // 10 ms worth of tokens (at least 256 KiB, so one GSO packet always fits).
  static std::string burstFor(const std::string& rate) {
    double bits = std::strtod(rate.c_str(), nullptr);
    std::string unit = rate.substr(rate.find_first_not_of("0123456789."));
    if (unit.rfind("kbit", 0) == 0) bits *= 1e3;
    if (unit.rfind("mbit", 0) == 0) bits *= 1e6;
    if (unit.rfind("gbit", 0) == 0) bits *= 1e9;
    return fmt::format("{}", std::max<uint64_t>(256 * 1024, static_cast<uint64_t>(bits / 8 / 100)));
  }
  static void sweepStale() {
    int st;
    std::string list = shell("ip netns list", &st);
    size_t p = 0;
    while ((p = list.find("cbxmoe", p)) != std::string::npos) {
      size_t e = list.find_first_of(" \n", p);
      std::string name = list.substr(p, e - p);
      p = e;
      long pid = std::strtol(name.c_str() + 6, nullptr, 10);
      if (pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
        shell("ip netns del " + name, &st);
    }
  }
  std::string prefix_;
  std::vector<std::string> created_;
};

// Why namespaces cannot be made here (empty: they can).
std::string netnsUnavailable() {
  if (geteuid() != 0) return "not root";
  int st;
  std::string probe = fmt::format("cbxmoeprobe{}", getpid());
  std::string out = shell("ip netns add " + probe, &st);
  if (st != 0) return "'ip netns add' failed: " + out;
  // What the topology needs besides: veth pairs, and tc's tbf qdisc (a kernel module).
  std::string why;
  out = shell(fmt::format("ip -n {} link add cbxprobea type veth peer name cbxprobeb", probe), &st);
  if (st != 0) why = "cannot create veth pairs: " + out;
  if (why.empty()) {
    out = shell(fmt::format("ip netns exec {} tc qdisc add dev cbxprobea root tbf rate 1gbit burst 262144 "
                            "latency 200ms",
                            probe),
                &st);
    if (st != 0) why = "tc tbf is unavailable: " + out;
  }
  shell("ip netns del " + probe, &st);
  return why;
}

// Single-core memcpy bandwidth (bytes/s): the intra-node path's ceiling here.
double memcpyBandwidth() {
  std::vector<char> a(64 << 20, 1), b(64 << 20, 2);
  std::memcpy(b.data(), a.data(), a.size());
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 4; ++i) std::memcpy((i % 2 ? a : b).data(), (i % 2 ? b : a).data(), a.size());
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 4.0 * static_cast<double>(a.size()) / s;
}

// ---------------------------------------------------------------- flat all-to-all baseline

// One row per (token, expert) to the expert's rank, wire rows encoded like MoeBuffer's (each
// token quantized once at the source); combine returns one row per (token, expert), weighted
// and summed in f32 at the source.
class FlatAllToAll {
 public:
  struct Received {
    std::vector<int32_t> src_rank, src_token, expert;  // per received pair, grouped by source rank
    std::vector<float> weight;
    std::vector<uint8_t> rows;  // payload + scales per pair
    std::vector<size_t> from;   // [rank + 1]: pair range of each source
  };

  FlatAllToAll(std::shared_ptr<Communicator> comm, const MoeConfig& cfg) : comm_(std::move(comm)), cfg_(cfg) {
    R_ = comm_->size();
    me_ = comm_->rank();
    if (cfg.format != PayloadFormat::kNative) {
      scale_ = scaleBytes(payloadCodec(cfg.format), cfg.hidden);
      payload_ = payloadBytes(payloadCodec(cfg.format), cfg.hidden);
    } else {
      payload_ = cfg.hidden * 2;
    }
    row_ = 16 + ((scale_ + 15) & ~size_t{15}) + payload_;
  }
  size_t rowBytes() const { return row_; }
  uint64_t networkBytes() const { return net_bytes_; }

  Received dispatch(const BFloat16* x, size_t tokens, const int64_t* idx, const float* w) {
    const int k = cfg_.topk, epr = cfg_.num_experts / R_;
    const uint32_t tag = nextTag();
    const size_t H = cfg_.hidden;
    std::vector<std::vector<std::pair<int32_t, int>>> to(R_);  // (token, slot j)
    for (size_t t = 0; t < tokens; ++t)
      for (int j = 0; j < k; ++j)
        if (idx[t * k + j] >= 0) to[idx[t * k + j] / epr].emplace_back(static_cast<int32_t>(t), j);
    std::vector<uint8_t> enc(tokens * (row_ - 16));
    std::vector<uint8_t> done(tokens, 0);
    send_.assign(R_, {});
    net_bytes_ = 0;
    for (int r = 0; r < R_; ++r) {
      auto& buf = send_[r];
      buf.resize(to[r].size() * row_);
      for (size_t p = 0; p < to[r].size(); ++p) {
        auto [t, j] = to[r][p];
        uint8_t* e = enc.data() + static_cast<size_t>(t) * (row_ - 16);
        if (!done[t]) {
          if (cfg_.format == PayloadFormat::kNative)
            std::memcpy(e + (row_ - 16 - payload_), x + t * H, payload_);
          else
            quantizeRow(payloadCodec(cfg_.format), x + t * H, H, e + (row_ - 16 - payload_), e, 1.0f);
          done[t] = 1;
        }
        uint8_t* out = buf.data() + p * row_;
        int32_t hdr[4] = {t, static_cast<int32_t>(idx[t * k + j]), 0, 0};
        float wt = w ? w[t * k + j] : 1.0f;
        std::memcpy(&hdr[2], &wt, 4);
        std::memcpy(out, hdr, 16);
        std::memcpy(out + 16, e, row_ - 16);
      }
      if (comm_->nodeOf(r) != comm_->nodeOf(me_)) net_bytes_ += buf.size();
    }
    // Counts, then rows.
    std::vector<uint64_t> send_n(R_), recv_n(R_);
    std::vector<RequestPtr> reqs;
    for (int r = 0; r < R_; ++r) {
      send_n[r] = to[r].size();
      if (r == me_) continue;
      reqs.push_back(comm_->irecv(&recv_n[r], 8, r, tag));
      reqs.push_back(comm_->isend(&send_n[r], 8, r, tag));
    }
    comm_->waitAll(reqs, comm_->defaultDeadline());
    recv_n[me_] = send_n[me_];
    Received rec;
    rec.from.assign(R_ + 1, 0);
    for (int r = 0; r < R_; ++r) rec.from[r + 1] = rec.from[r] + recv_n[r];
    rec.rows.resize(rec.from[R_] * row_);
    reqs.clear();
    for (int r = 0; r < R_; ++r) {
      uint8_t* dst = rec.rows.data() + rec.from[r] * row_;
      if (r == me_) {
        std::memcpy(dst, send_[r].data(), send_[r].size());
        continue;
      }
      if (recv_n[r]) reqs.push_back(comm_->irecv(dst, recv_n[r] * row_, r, tag + 1));
      if (send_n[r]) reqs.push_back(comm_->isend(send_[r].data(), send_[r].size(), r, tag + 1));
    }
    comm_->waitAll(reqs, comm_->defaultDeadline());
    const size_t n = rec.from[R_];
    rec.src_rank.resize(n);
    rec.src_token.resize(n);
    rec.expert.resize(n);
    rec.weight.resize(n);
    for (int r = 0; r < R_; ++r)
      for (size_t i = rec.from[r]; i < rec.from[r + 1]; ++i) {
        int32_t hdr[4];
        std::memcpy(hdr, rec.rows.data() + i * row_, 16);
        rec.src_rank[i] = r;
        rec.src_token[i] = hdr[0];
        rec.expert[i] = hdr[1];
        std::memcpy(&rec.weight[i], &hdr[2], 4);
      }
    last_ = {to.begin(), to.end()};
    tokens_ = tokens;
    return rec;
  }

  void decode(const Received& rec, size_t i, BFloat16* out) const {
    const uint8_t* e = rec.rows.data() + i * row_ + 16;
    if (cfg_.format == PayloadFormat::kNative)
      std::memcpy(out, e + (row_ - 16 - payload_), payload_);
    else
      dequantizeRow(payloadCodec(cfg_.format), e + (row_ - 16 - payload_), e, cfg_.hidden, out, 1.0f);
  }

  // y: one row per received pair (rec's order) of y_type. Returns [tokens x hidden] f32 sums
  // of weight x y over the token's experts.
  std::vector<float> combine(const Received& rec, const void* y, DataType y_type, const float* w_src) {
    const uint32_t tag = nextTag();
    const size_t H = cfg_.hidden, es = elementSize(y_type);
    std::vector<std::vector<uint8_t>> back(R_);
    std::vector<RequestPtr> reqs;
    for (int r = 0; r < R_; ++r) {
      if (r == me_ || last_[r].empty()) continue;
      back[r].resize(last_[r].size() * H * es);
      reqs.push_back(comm_->irecv(back[r].data(), back[r].size(), r, tag));
    }
    net_bytes_ = 0;
    for (int r = 0; r < R_; ++r) {
      const size_t cnt = rec.from[r + 1] - rec.from[r];
      const auto* src = static_cast<const uint8_t*>(y) + rec.from[r] * H * es;
      if (r == me_) {
        back[r].assign(src, src + cnt * H * es);
      } else if (cnt) {
        reqs.push_back(comm_->isend(src, cnt * H * es, r, tag));
        if (comm_->nodeOf(r) != comm_->nodeOf(me_)) net_bytes_ += cnt * H * es;
      }
    }
    comm_->waitAll(reqs, comm_->defaultDeadline());
    std::vector<float> out(tokens_ * H, 0.0f);
    const int k = cfg_.topk;
    for (int r = 0; r < R_; ++r)
      for (size_t p = 0; p < last_[r].size(); ++p) {
        auto [t, j] = last_[r][p];
        const float wt = w_src ? w_src[t * k + j] : 1.0f;
        const uint8_t* row = back[r].data() + p * H * es;
        float* o = out.data() + static_cast<size_t>(t) * H;
        for (size_t c = 0; c < H; ++c) {
          float v;
          if (y_type == DataType::kFloat32)
            std::memcpy(&v, row + 4 * c, 4);
          else
            v = reinterpret_cast<const BFloat16*>(row)[c].toFloat();
          o[c] += wt * v;
        }
      }
    return out;
  }

 private:
  // Above the MoeBuffer tags (0x4D000000 + 2^27).
  uint32_t nextTag() { return 0x60000000u + static_cast<uint32_t>(ops_++ % 0x100000) * 4; }
  std::shared_ptr<Communicator> comm_;
  MoeConfig cfg_;
  int R_ = 1, me_ = 0;
  size_t row_ = 0, payload_ = 0, scale_ = 0, tokens_ = 0;
  uint64_t ops_ = 0, net_bytes_ = 0;
  std::vector<std::vector<uint8_t>> send_;
  std::vector<std::vector<std::pair<int32_t, int>>> last_;
};

// ---------------------------------------------------------------- the benchmark

// Phases of MoeBuffer's dispatch / combine (MoeMetrics::phases), in call order.
const std::vector<const char*> kDispatchPhases{"layout",  "encode",   "post",       "wait ack",
                                               "forward", "wait net", "wait sends", "wait local",
                                               "order",   "alloc",    "decode",     "expert major"};
const std::vector<const char*> kCombinePhases{"wait ack", "write",    "post", "wait local",
                                              "reduce",   "wait net", "sum",  "wait sends"};

// This process's CPU time (user, system) in seconds, context switches (voluntary,
// involuntary) and minor page faults: all of a rank's threads, its share of the kernel's TCP
// work included.
std::array<double, 5> cpuUsage() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6;
  };
  return {sec(u.ru_utime), sec(u.ru_stime), static_cast<double>(u.ru_nvcsw), static_cast<double>(u.ru_nivcsw),
          static_cast<double>(u.ru_minflt)};
}

void addPhases(const MoeMetrics& m, const std::vector<const char*>& names, std::vector<double>& acc) {
  acc.resize(names.size(), 0.0);
  for (const auto& [name, s] : m.phases)
    for (size_t i = 0; i < names.size(); ++i)
      if (std::strcmp(names[i], name) == 0) acc[i] += s;
}

double expertScale(int64_t e) {
  return 1.0 + static_cast<double>(e % 5) / 8.0;
}

// Both paths must deliver the same tokens and sums. Returns an error text (empty: same).
std::string check(const MoeConfig& cfg, MoeBuffer& buf, FlatAllToAll& flat, const std::vector<BFloat16>& x,
                  const Routing& routing, int me) {
  const size_t H = cfg.hidden, T = routing.tokens;
  const int k = cfg.topk;
  DispatchResult d = buf.dispatch(x.data(), T, routing.topk_idx.data(), routing.topk_weights.data());
  auto rec = flat.dispatch(x.data(), T, routing.topk_idx.data(), routing.topk_weights.data());
  // Flat pairs, deduplicated per (source, token), in order: the two-level rows.
  std::vector<size_t> first_pair;
  for (size_t i = 0; i < rec.src_rank.size(); ++i)
    if (i == 0 || rec.src_rank[i] != rec.src_rank[i - 1] || rec.src_token[i] != rec.src_token[i - 1]) {
      // Pairs of one (source, token) are adjacent only if the source ordered them by token;
      // it does (tokens ascending, then slot).
      first_pair.push_back(i);
    }
  if (first_pair.size() != d.num_recv)
    return fmt::format("rank {}: two-level received {} tokens, flat {}", me, d.num_recv, first_pair.size());
  std::vector<BFloat16> row(H);
  for (size_t i = 0; i < d.num_recv; ++i) {
    size_t p = first_pair[i];
    if (d.src_rank[i] != rec.src_rank[p] || d.src_token[i] != rec.src_token[p])
      return fmt::format("rank {}: row {} is ({}, {}) two-level, ({}, {}) flat", me, i, d.src_rank[i],
                         d.src_token[i], rec.src_rank[p], rec.src_token[p]);
    flat.decode(rec, p, row.data());
    if (std::memcmp(row.data(), d.x.data() + i * H * 2, H * 2) != 0)
      return fmt::format("rank {}: token ({}, {}) differs between the paths", me, d.src_rank[i],
                         d.src_token[i]);
  }
  // Expert e's output: x * scale(e). Two-level: each rank sums its experts' weighted outputs
  // per row; flat: one output per pair, weighted at the source.
  std::vector<float> y2(d.num_recv * H, 0.0f), yf(rec.src_rank.size() * H);
  for (size_t i = 0; i < d.num_recv; ++i)
    for (int j = 0; j < k; ++j) {
      int64_t e = d.topk_idx[i * k + j];
      if (e < 0) continue;
      const double s = expertScale(e + static_cast<int64_t>(me) * buf.numLocalExperts());
      for (size_t c = 0; c < H; ++c) {
        BFloat16 b;
        std::memcpy(&b, d.x.data() + (i * H + c) * 2, 2);
        y2[i * H + c] += d.topk_weights[i * k + j] * static_cast<float>(s * b.toFloat());
      }
    }
  for (size_t p = 0; p < rec.src_rank.size(); ++p) {
    flat.decode(rec, p, row.data());
    const double s = expertScale(rec.expert[p]);
    for (size_t c = 0; c < H; ++c) yf[p * H + c] = static_cast<float>(s * row[c].toFloat());
  }
  auto two = buf.combine(y2.data(), DataType::kFloat32, *d.handle).out;
  auto fl = flat.combine(rec, yf.data(), DataType::kFloat32, routing.topk_weights.data());
  for (size_t i = 0; i < two.size(); ++i)
    if (std::fabs(two[i] - fl[i]) > 1e-4f * (1.0f + std::fabs(fl[i])))
      return fmt::format("rank {}: combine of token {} channel {}: two-level {} flat {}", me, i / H, i % H,
                         two[i], fl[i]);
  return "";
}

int runRank(const Options& o, std::shared_ptr<Communicator> comm, const std::string& link) {
  using Clock = std::chrono::steady_clock;
  Collectives coll(comm);
  const int R = comm->size(), me = comm->rank();
  auto maxOf = [&](double v) {
    coll.allreduce(&v, &v, 1, DataType::kFloat64, ReduceOp::kMax)->wait();
    return v;
  };
  auto sumOf = [&](double v) {
    coll.allreduce(&v, &v, 1, DataType::kFloat64, ReduceOp::kSum)->wait();
    return v;
  };
  auto print = [&](const std::string& s) {
    if (me == 0) std::fputs(s.c_str(), stdout), std::fflush(stdout);
  };
  const int E = o.experts;
  print(
      fmt::format("# moe_netns_bench: {} nodes x {} ranks{}, {}; {} experts, top-{}, max nodes/token {}, "
                  "{} tokens/rank, hidden {}, two-level combine partials {}, row-major output (no "
                  "expert-major copy, like flat), {} two-level output buffers\n",
                  comm->numNodes(), o.ranks_per_node,
                  o.last_node_ranks != o.ranks_per_node ? fmt::format(" (the last {})", o.last_node_ranks) : "",
                  link, E, o.topk,
                  o.max_nodes > 0 ? std::to_string(o.max_nodes) : std::string("no limit"), o.tokens, o.hidden,
                  o.combine_wire == DataType::kFloat32 ? "f32" : "bf16",
                  o.fresh_output ? "fresh" : "recycled"));
  print(fmt::format("# fp8/mxfp8 io: {}\n",
                    o.io_quantized && o.io_dequantized
                        ? "both: dequantized (bf16 x in and out, codec in dispatch) and quantized rows "
                          "'fp8/q' (DeepEP-style: x quantized once before timing, codes + scales out)"
                        : o.io_quantized ? "quantized (DeepEP-style: x quantized once before timing, codes + "
                                           "scales in and out, no codec in dispatch)"
                                         : "dequantized (bf16 x in and out: encode and decode in dispatch)"));
  print(fmt::format("# {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>10} {:>10}\n", "format",
                    "2l disp", "2l comb", "2l total", "flat disp", "flat comb", "flat total", "speedup",
                    "2l net MB", "flat MB"));
  print("# (times in ms: median over iterations of the slowest rank; net MB: inter-node bytes per rank, "
        "dispatch + combine)\n");
  RoutingOptions ro;
  ro.num_experts = E;
  ro.topk = o.topk;
  ro.num_groups = comm->numNodes();
  ro.max_groups_per_token = o.max_nodes > 0 ? o.max_nodes : -1;
  ro.seed = 11;
  Routing routing = generateRouting(o.tokens, me, ro);
  std::vector<BFloat16> x(o.tokens * o.hidden);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = BFloat16::fromFloat(static_cast<float>(static_cast<int>((i * 37 + me * 11) % 97) - 48) / 16.0f);
  // Keyed by (format, quantized io).
  std::map<std::pair<PayloadFormat, bool>, double> disp_of, total_of, flat_total_of;
  int failures = 0;
  std::vector<std::pair<PayloadFormat, bool>> runs;
  for (PayloadFormat f : o.formats) {
    if (f == PayloadFormat::kNative || o.io_dequantized) runs.emplace_back(f, false);
    if (f != PayloadFormat::kNative && o.io_quantized) runs.emplace_back(f, true);
  }
  // Every format's buffers and results, kept for all rounds (--rounds: the formats take
  // turns, so a load burst on this shared machine hits each format alike).
  struct Run {
    PayloadFormat f = PayloadFormat::kNative;
    bool qio = false;
    std::string fname;
    std::unique_ptr<FlatAllToAll> flat;
    std::unique_ptr<MoeBuffer> buf;
    // Quantized io: x quantized once, as DeepEP's test does before timing.
    std::vector<uint8_t> xq_payload, xq_scales;
    QuantizedTokens xq;
    std::vector<BFloat16> y_q;  // quantized io: the experts' bf16 outputs (decoded, not timed)
    // Per timed iteration, the slowest rank's time of each of the four operations; the table
    // shows their median over iterations (a busy machine's stalls hit single iterations).
    std::vector<std::array<double, 4>> per_iter;
    double net2 = 0, netf = 0;
    std::vector<double> disp_phases, comb_phases;
    std::array<double, 5> disp_cpu{};  // this rank's dispatch: user s, system s, switches, page faults
    double disp_wall = 0;              // this rank's dispatch wall time, s (timed iterations)
    DispatchResult spare;              // the previous iteration's dispatch result, recycled
  };
  std::vector<std::unique_ptr<Run>> live;
  for (auto [f, qio] : runs) {
    auto run = std::make_unique<Run>();
    Run& r = *run;
    r.f = f;
    r.qio = qio;
    const std::string fname =
        std::string(f == PayloadFormat::kNative ? "bf16" : payloadFormatName(f)) + (qio ? "/q" : "");
    MoeConfig cfg;
    cfg.max_tokens = o.tokens;
    cfg.hidden = o.hidden;
    cfg.topk = o.topk;
    cfg.num_experts = E;
    cfg.format = f;
    r.fname = fname;
    r.flat = std::make_unique<FlatAllToAll>(comm, cfg);
    FlatAllToAll& flat = *r.flat;
    std::string err;
    {
      auto exact = MoeBuffer::create(comm, cfg);  // f32 partials: comparable to 1e-4
      err = check(cfg, *exact, flat, x, routing, me);
    }
    // --no-flat: the flat path only checked the results; its buffers (a row per (token,
    // expert) pair) would otherwise stay resident for every format at once.
    if (o.no_flat) r.flat.reset();
    cfg.combine_wire = o.combine_wire;
    cfg.expert_major_copy = false;  // the flat path returns rows by source too
    r.buf = MoeBuffer::create(comm, cfg);
    // Quantized io: x quantized once here, as DeepEP's test does before timing.
    std::vector<uint8_t>& xq_payload = r.xq_payload;
    std::vector<uint8_t>& xq_scales = r.xq_scales;
    QuantizedTokens& xq = r.xq;
    if (qio) {
      const PayloadCodec codec = payloadCodec(f);
      xq.format = f;
      xq.payload_row_bytes = payloadBytes(codec, o.hidden);
      xq.scale_row_bytes = scaleBytes(codec, o.hidden);
      xq_payload.resize(o.tokens * xq.payload_row_bytes);
      xq_scales.resize(o.tokens * xq.scale_row_bytes + 4);
      std::vector<float> sc(xq.scale_row_bytes / 4 + 1);
      for (size_t t = 0; t < o.tokens; ++t) {
        quantizeRow(codec, x.data() + t * o.hidden, o.hidden, xq_payload.data() + t * xq.payload_row_bytes,
                    sc.data());
        std::memcpy(xq_scales.data() + t * xq.scale_row_bytes, sc.data(), xq.scale_row_bytes);
      }
      xq.payload = xq_payload.data();
      xq.scales = xq_scales.data();
    }
    if (!err.empty())
      std::fprintf(stderr, "moe_netns_bench: MISMATCH (%s): %s\n", payloadFormatName(f), err.c_str());
    if (maxOf(err.empty() ? 0.0 : 1.0) > 0) {
      ++failures;
      continue;
    }
    live.push_back(std::move(run));
  }
  // One iteration of one format: two-level dispatch + combine, then (unless --no-flat) flat.
  auto iterate = [&](Run& r, bool timed) {
    const PayloadFormat f = r.f;
    const bool qio = r.qio;
    MoeBuffer* buf = r.buf.get();
    QuantizedTokens& xq = r.xq;
    auto& y_q = r.y_q;
    auto& per_iter = r.per_iter;
    double& net2 = r.net2;
    double& netf = r.netf;
    auto& disp_phases = r.disp_phases;
    auto& comb_phases = r.comb_phases;
    auto& disp_cpu = r.disp_cpu;
    DispatchResult& spare = r.spare;
    comm->barrier();
    const auto cpu0 = cpuUsage();
    auto t0 = Clock::now();
    MoeBuffer::DispatchArgs args;
    args.tokens = o.tokens;
    args.x = qio ? nullptr : x.data();
    args.x_quantized = qio ? &xq : nullptr;
    args.topk_idx = routing.topk_idx.data();
    args.topk_weights = routing.topk_weights.data();
    args.recycle = o.fresh_output ? nullptr : &spare;
    args.output = qio ? RecvOutput::kQuantized : RecvOutput::kConfig;
    DispatchResult d = buf->dispatch(args);
    auto t1 = Clock::now();
    const auto cpu1 = cpuUsage();
    if (timed) {
      for (int q = 0; q < 5; ++q) disp_cpu[q] += cpu1[q] - cpu0[q];
      r.disp_wall += std::chrono::duration<double>(t1 - t0).count();
    }
    const void* y2 = d.x.data();
    if (qio) {
      // The experts' work (not timed): their bf16 outputs, here the dequantized rows.
      y_q.resize(d.num_recv * o.hidden);
      for (size_t i = 0; i < d.num_recv; ++i)
        dequantizeRow(payloadCodec(f), d.q_payload.data() + i * xq.payload_row_bytes,
                      d.q_scales.data() + i * xq.scale_row_bytes, o.hidden, y_q.data() + i * o.hidden, 1.0f);
      y2 = y_q.data();
    }
    comm->barrier();
    auto t2 = Clock::now();
    CombineResult c = buf->combine(y2, DataType::kBFloat16, *d.handle);
    auto t3 = Clock::now();
    comm->barrier();
    auto t4 = Clock::now();
    if (o.no_flat) {
      if (timed) {
        auto sec = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
        std::array<double, 4> it_t{sec(t0, t1), sec(t2, t3), 0.0, 0.0};
        coll.allreduce(it_t.data(), it_t.data(), 4, DataType::kFloat64, ReduceOp::kMax)->wait();
        per_iter.push_back(it_t);
        addPhases(d.metrics, kDispatchPhases, disp_phases);
        addPhases(c.metrics, kCombinePhases, comb_phases);
        net2 = static_cast<double>(d.metrics.inter_node_bytes + c.metrics.inter_node_bytes);
      }
      spare = std::move(d);
      return;
    }
    FlatAllToAll& flat = *r.flat;
    auto rec = flat.dispatch(x.data(), o.tokens, routing.topk_idx.data(), routing.topk_weights.data());
    auto t5 = Clock::now();
    const uint64_t flat_disp_bytes = flat.networkBytes();
    comm->barrier();
    auto t6 = Clock::now();
    // Expert outputs: the received rows themselves, bf16 (what the experts would return).
    std::vector<BFloat16> y(rec.src_rank.size() * o.hidden);
    for (size_t p = 0; p < rec.src_rank.size(); ++p) flat.decode(rec, p, y.data() + p * o.hidden);
    auto t6b = Clock::now();
    flat.combine(rec, y.data(), DataType::kBFloat16, routing.topk_weights.data());
    auto t7 = Clock::now();
    if (!timed) {
      spare = std::move(d);
      return;
    }
    auto sec = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
    std::array<double, 4> it_t{sec(t0, t1), sec(t2, t3),
                               sec(t4, t5) + sec(t6, t6b),  // decoding belongs to the flat dispatch
                               sec(t6b, t7)};
    coll.allreduce(it_t.data(), it_t.data(), 4, DataType::kFloat64, ReduceOp::kMax)->wait();
    per_iter.push_back(it_t);
    addPhases(d.metrics, kDispatchPhases, disp_phases);
    addPhases(c.metrics, kCombinePhases, comb_phases);
    net2 = static_cast<double>(d.metrics.inter_node_bytes + c.metrics.inter_node_bytes);
    netf = static_cast<double>(flat_disp_bytes + flat.networkBytes());
    spare = std::move(d);
  };
  for (int round = 0; round < o.rounds; ++round)
    for (auto& run : live)
      for (int it = 0; it < (round == 0 ? o.warmup : 0) + o.iters; ++it)
        iterate(*run, round > 0 || it >= o.warmup);
  const int timed_iters = o.iters * o.rounds;
  for (auto& run : live) {
    Run& r = *run;
    const PayloadFormat f = r.f;
    const bool qio = r.qio;
    const std::string& fname = r.fname;
    auto& per_iter = r.per_iter;
    double net2 = r.net2, netf = r.netf;
    auto& disp_phases = r.disp_phases;
    auto& comb_phases = r.comb_phases;
    auto& disp_cpu = r.disp_cpu;
    double t[4];
    for (int q = 0; q < 4; ++q) {
      std::vector<double> v;
      for (const auto& a : per_iter) v.push_back(a[q]);
      std::sort(v.begin(), v.end());
      t[q] = (v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2) * 1e3;
    }
    if (o.phases) {
      // Slowest rank's mean per phase: where the two-level time goes.
      auto line = [&](const char* what, const std::vector<const char*>& names, std::vector<double>& acc) {
        std::string s = fmt::format("#   {} 2l {}:", fname, what);
        acc.resize(names.size(), 0.0);
        for (size_t i = 0; i < names.size(); ++i) {
          const double v = maxOf(acc[i] / timed_iters) * 1e3;
          if (v >= 0.05) s += fmt::format(" {} {:.1f}", names[i], v);
        }
        print(s + " (ms, slowest rank per phase)\n");
      };
      line("dispatch", kDispatchPhases, disp_phases);
      // Whether the dispatch is CPU-bound: the ranks' CPU time against cores x wall time.
      std::array<double, 5> all{};
      for (int q = 0; q < 5; ++q) all[q] = sumOf(disp_cpu[q] / timed_iters);
      print(fmt::format("#   {} 2l dispatch cpu, all ranks per call: user {:.1f} sys {:.1f} ms, {:.0f} voluntary "
                        "{:.0f} involuntary switches, {:.0f} page faults\n",
                        fname, all[0] * 1e3, all[1] * 1e3, all[2], all[3], all[4]));
      // Per rank (mean per call): which rank is the slowest, and whether it waited or computed.
      std::vector<double> pr(2 * static_cast<size_t>(R), 0.0);
      pr[me] = r.disp_wall / timed_iters * 1e3;
      pr[R + me] = (disp_cpu[0] + disp_cpu[1]) / timed_iters * 1e3;
      coll.allreduce(pr.data(), pr.data(), pr.size(), DataType::kFloat64, ReduceOp::kSum)->wait();
      std::string ranks = fmt::format("#   {} 2l dispatch per rank, wall / cpu ms:", fname);
      for (int q = 0; q < R; ++q) ranks += fmt::format(" {:.1f}/{:.1f}", pr[q], pr[R + q]);
      print(ranks + "\n");
      line("combine", kCombinePhases, comb_phases);
    }
    net2 = sumOf(net2) / R / 1e6;
    netf = sumOf(netf) / R / 1e6;
    const double two = t[0] + t[1], fl = t[2] + t[3];
    disp_of[{f, qio}] = t[0];
    total_of[{f, qio}] = two;
    flat_total_of[{f, qio}] = fl;
    print(
        fmt::format("  {:>7} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>7.2f}x {:>10.2f} "
                    "{:>10.2f}\n",
                    fname, t[0], t[1], two, t[2], t[3],
                    fl, fl / two, net2, netf));
  }
  const std::pair bf16{PayloadFormat::kNative, false};
  if (total_of.count(bf16) && !o.no_flat)
    print(fmt::format("# two-level vs flat, bf16 dispatch+combine: {:.2f}x (target >= 2x)\n",
                      flat_total_of[bf16] / total_of[bf16]));
  for (bool qio : {false, true})
    if (disp_of.count(bf16) && disp_of.count({PayloadFormat::kFp8, qio}))
      print(fmt::format("# fp8 vs bf16 two-level dispatch ({} io): {:.2f}x (target >= 1.7x)\n",
                        qio ? "quantized" : "dequantized", disp_of[bf16] / disp_of[{PayloadFormat::kFp8, qio}]));
  return failures ? 1 : 0;
}

}  // namespace
}  // namespace crossbar::moe

int main(int argc, char** argv) {
  using namespace crossbar;
  using namespace crossbar::moe;
  Options o;
  try {
    perf::BenchFlags f(argc, argv);
    while (f.next()) {
      if (f.is("--nodes"))
        o.nodes = static_cast<int>(f.integer(1, 64));
      else if (f.is("--ranks-per-node"))
        o.ranks_per_node = static_cast<int>(f.integer(1, 256));
      else if (f.is("--last-node-ranks"))
        o.last_node_ranks = static_cast<int>(f.integer(1, 256));
      else if (f.is("--tokens"))
        o.tokens = static_cast<size_t>(f.integer(0));
      else if (f.is("--hidden"))
        o.hidden = static_cast<size_t>(f.integer(1));
      else if (f.is("--experts"))
        o.experts = static_cast<int>(f.integer(1, INT_MAX));
      else if (f.is("--topk"))
        o.topk = static_cast<int>(f.integer(1, 1024));
      else if (f.is("--max-nodes"))
        o.max_nodes = static_cast<int>(f.integer(INT_MIN + 1, INT_MAX));
      else if (f.is("--iters"))
        o.iters = static_cast<int>(f.integer(1, INT_MAX));
      else if (f.is("--warmup"))
        o.warmup = static_cast<int>(f.integer(0, INT_MAX));
      else if (f.is("--rounds"))
        o.rounds = static_cast<int>(f.integer(1, INT_MAX));
      else if (f.is("--rate"))
        o.rate = f.text();
      else if (f.is("--queue-ms"))
        o.queue_ms = static_cast<int>(f.integer(1, INT_MAX));
      else if (f.is("--combine-wire"))
        o.combine_wire = f.choice({"bf16", "f32"}) == "f32" ? DataType::kFloat32 : DataType::kBFloat16;
      else if (f.is("--no-netns"))
        o.netns = false;
      else if (f.is("--phases"))
        o.phases = true;
      else if (f.is("--fresh-output"))
        o.fresh_output = true;
      else if (f.is("--fp8-io")) {
        const std::string m = f.choice({"dequantized", "quantized", "both"});
        o.io_dequantized = m != "quantized";
        o.io_quantized = m != "dequantized";
      } else if (f.is("--no-flat"))
        o.no_flat = true;
      else if (f.is("--formats")) {
        o.formats.clear();
        for (auto& s : f.list()) {
          if (s == "bf16" || s == "native")
            o.formats.push_back(PayloadFormat::kNative);
          else if (s == "fp8")
            o.formats.push_back(PayloadFormat::kFp8);
          else if (s == "mxfp8")
            o.formats.push_back(PayloadFormat::kMxfp8);
          else
            throw InvalidArgument("--formats: " + s + " (bf16, fp8, mxfp8)");
        }
      } else {
        return f.usage(
            "[--nodes N] [--ranks-per-node L] [--last-node-ranks K] [--tokens T] [--hidden H] [--experts E] "
            "[--topk k] [--max-nodes M] [--formats bf16,fp8,mxfp8] [--rate auto|2gbit] [--queue-ms ms] "
            "[--iters n] [--rounds n] [--warmup n] [--combine-wire bf16|f32] [--no-netns] [--phases] "
            "[--fresh-output] [--no-flat] [--fp8-io dequantized|quantized|both]");
      }
    }
    if (o.last_node_ranks == 0) o.last_node_ranks = o.ranks_per_node;
    if (o.nodes < 1 || o.ranks_per_node < 1 || o.last_node_ranks < 1 || o.last_node_ranks > o.ranks_per_node)
      throw InvalidArgument("--nodes and --ranks-per-node must be positive, --last-node-ranks in [1, --ranks-per-node]");
    const int size = (o.nodes - 1) * o.ranks_per_node + o.last_node_ranks;
    if (o.experts % size != 0 || o.experts % o.nodes != 0)
      throw InvalidArgument(fmt::format("--experts ({}) must be a multiple of the rank count ({}) and of --nodes "
                                        "(e.g. 168 for nodes of 4 and 3)",
                                        o.experts, size));
    if (o.max_nodes == kAutoMaxNodes) o.max_nodes = std::max(1, o.nodes / 2);
    std::unique_ptr<NetnsTopology> topo;
    std::string link = "no namespaces (UCX's own transports across virtual nodes)";
    if (o.netns) {
      std::string why = netnsUnavailable();
      if (!why.empty()) {
        std::printf("moe_netns_bench: SKIP: cannot create network namespaces (%s)\n", why.c_str());
        return kSkip;
      }
      double bw = memcpyBandwidth();
      if (o.rate == "auto") o.rate = fmt::format("{}mbit", static_cast<uint64_t>(bw / 3 * 8 / 1e6));
      topo = std::make_unique<NetnsTopology>(o.nodes, o.rate, o.queue_ms);
      link = fmt::format("namespaces, inter-node links tc tbf {} each way (memcpy {:.1f} GB/s)", o.rate,
                         bw / 1e9);
    }
    auto exits = launchLocalRanks(size, [&](int rank, int sz, std::shared_ptr<Store> store) {
      CommOptions copts;
      copts.ranks_per_node = o.ranks_per_node;
      if (topo) {
        topo->enter(rank / o.ranks_per_node);
        setenv("CROSSBAR_UCX_TLS", "tcp", 1);
        setenv("UCX_NET_DEVICES", "cbx0", 1);
      }
      return runRank(o, Communicator::create(std::move(store), rank, sz, copts), link);
    });
    return combinedExitCode(exits);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 1;
  }
}
