// moe_dispatch_perf: nccl-tests-style table of MoE dispatch and combine (collectives/moe)
// by tokens per rank, hidden size and payload format. Self-launching:
//   moe_dispatch_perf --nranks 8 --ranks-per-node 4 [--tokens 128,512] [--hidden 2048,7168]
//                     [--formats native,fp8,mxfp8,nvfp4] [--experts 256] [--topk 8]
//                     [--max-nodes M] [--zipf s] [--iters 20] [--warmup 5] [--mem host|cuda]
//                     [--fp8-io dequantized|quantized]
// --fp8-io quantized (host memory): quantized formats run DeepEP-style: x is quantized once
// before timing and passed as codes + scales (QuantizedTokens), dispatch returns only the
// received codes + scales (RecvOutput::kQuantized); combine's bf16 input is decoded from them
// outside the timed region. Default: dequantized (bf16 x in, encode and decode in dispatch).
// --mem cuda: CudaMoeBuffer on device memory (one node: every rank on GPU local_rank % GPUs;
// several nodes need one GPU per rank for NCCL). Times are dispatch + combine with a stream
// synchronization each; "cached" is a dispatch with the cached handle (no host planning).
// Network bandwidth counts distinct (token, node) pairs off the sender's node x hidden x
// bytes per element (DeepEP's convention; scales excluded); time is the slowest rank's mean.
#include <fmt/format.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/float_types.h"
#include "collectives/moe/moe.h"
#include "collectives/moe/moe_plan.h"
#include "collectives/moe/routing.h"
#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/local_launch.h"
#include "perf/bench_flags.h"
#if defined(CROSSBAR_HAVE_MOE_CUDA)
#include <cuda_runtime_api.h>

#include "collectives/moe/cuda/moe_cuda.h"
#endif

namespace crossbar::moe {
namespace {

struct Options {
  int nranks = 2, ranks_per_node = 0, experts = 0, topk = 8, max_nodes = -1, iters = 20, warmup = 5;
  double zipf = 0.0;
  bool mem_cuda = false;
  bool quantized_io = false;  // --fp8-io quantized
  std::vector<size_t> tokens{128, 512}, hidden{2048, 7168};
  std::vector<PayloadFormat> formats{PayloadFormat::kNative, PayloadFormat::kFp8, PayloadFormat::kMxfp8,
                                     PayloadFormat::kNvfp4};
};

PayloadFormat parseFormat(const std::string& s) {
  for (auto f : {PayloadFormat::kNative, PayloadFormat::kFp8, PayloadFormat::kMxfp8, PayloadFormat::kNvfp4})
    if (s == payloadFormatName(f)) return f;
  throw InvalidArgument("unknown format '" + s + "' (native, fp8, mxfp8, nvfp4)");
}

// Bytes per element on the wire, without scales.
double elementBytes(PayloadFormat f) {
  return f == PayloadFormat::kNative ? 2.0 : f == PayloadFormat::kNvfp4 ? 0.5 : 1.0;
}

double maxOverRanks(Collectives& coll, double v) {
  coll.allreduce(&v, &v, 1, DataType::kFloat64, ReduceOp::kMax)->wait();
  return v;
}
double sumOverRanks(Collectives& coll, double v) {
  coll.allreduce(&v, &v, 1, DataType::kFloat64, ReduceOp::kSum)->wait();
  return v;
}

#if defined(CROSSBAR_HAVE_MOE_CUDA)
void cudaCheck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CudaError(fmt::format("moe_dispatch_perf: {}: {}", what, cudaGetErrorString(e)));
}

// One row of the table on CUDA memory: mean dispatch (planned), cached dispatch and combine
// time, each followed by a stream synchronization.
void timeCuda(const Options& o, std::shared_ptr<Communicator> comm, const MoeConfig& cfg, const Routing& routing,
              const std::vector<BFloat16>& x, double& disp, double& cached, double& comb, double& imbal) {
  using Clock = std::chrono::steady_clock;
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0)
    throw Unsupported("--mem cuda: no CUDA device here (cudaGetDeviceCount found none)");
  const int dev = comm->numNodes() > 1 ? comm->rank() % ndev : comm->localRank() % ndev;
  cudaCheck(cudaSetDevice(dev), "cudaSetDevice");
  auto buf = CudaMoeBuffer::create(comm, cfg, CudaMoeBuffer::Options{dev});
  cudaStream_t s;
  cudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  void *dx, *didx, *dw;
  cudaCheck(cudaMalloc(&dx, x.size() * 2 + 16), "cudaMalloc");
  cudaCheck(cudaMalloc(&didx, routing.topk_idx.size() * 8 + 16), "cudaMalloc");
  cudaCheck(cudaMalloc(&dw, routing.topk_weights.size() * 4 + 16), "cudaMalloc");
  cudaCheck(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice), "upload");
  cudaCheck(cudaMemcpy(didx, routing.topk_idx.data(), routing.topk_idx.size() * 8, cudaMemcpyHostToDevice), "upload");
  cudaCheck(cudaMemcpy(dw, routing.topk_weights.data(), routing.topk_weights.size() * 4, cudaMemcpyHostToDevice),
            "upload");
  const size_t T = cfg.max_tokens;
  disp = cached = comb = 0;
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    comm->barrier();
    auto t0 = Clock::now();
    CudaDispatchResult d =
        buf->dispatch(dx, T, static_cast<const int64_t*>(didx), static_cast<const float*>(dw), s);
    buf->synchronize(s, comm->defaultDeadline());
    auto t1 = Clock::now();
    CudaDispatchResult dc =
        buf->dispatch(dx, T, static_cast<const int64_t*>(didx), static_cast<const float*>(dw), s, d.handle);
    buf->synchronize(s, comm->defaultDeadline());
    auto t2 = Clock::now();
    CudaCombineResult c = buf->combine(dc.x, DataType::kBFloat16, *d.handle, s);
    buf->synchronize(s, comm->defaultDeadline());
    auto t3 = Clock::now();
    if (it >= o.warmup) {
      disp += std::chrono::duration<double>(t1 - t0).count();
      cached += std::chrono::duration<double>(t2 - t1).count();
      comb += std::chrono::duration<double>(t3 - t2).count();
    }
    imbal = d.metrics.expert_imbalance;
  }
  disp /= o.iters;
  cached /= o.iters;
  comb /= o.iters;
  buf.reset();
  cudaFree(dx);
  cudaFree(didx);
  cudaFree(dw);
  cudaStreamDestroy(s);
}
#endif

int runRank(const Options& o, std::shared_ptr<Communicator> comm) {
  using Clock = std::chrono::steady_clock;
  Collectives coll(comm);
  const int R = comm->size(), me = comm->rank();
  const int E = o.experts > 0 ? o.experts : std::max(R, 256 / R * R);
  auto print = [&](const std::string& s) {
    if (me == 0) std::fputs(s.c_str(), stdout), std::fflush(stdout);
  };
  std::string nodes;  // "2 nodes x 4", or the sizes of nodes that differ ("2 nodes of 4, 3")
  {
    const auto all = comm->nodes();
    std::string sizes;
    bool even = true;
    for (const auto& n : all) {
      sizes += fmt::format("{}{}", sizes.empty() ? "" : ", ", n.size());
      even = even && n.size() == all.front().size();
    }
    nodes = even ? fmt::format("{} nodes x {}", all.size(), all.front().size())
                 : fmt::format("{} nodes of {}", all.size(), sizes);
  }
  print(fmt::format("# moe_dispatch_perf: {} ranks, {}, {} experts, top-{}, max nodes/token {}, zipf {}\n", R,
                    nodes, E, o.topk, o.max_nodes, o.zipf));
  print(fmt::format("# memory: {}\n", o.mem_cuda ? "cuda (CudaMoeBuffer; cached = dispatch with the cached handle)"
                                                  : "host (MoeBuffer)"));
  print(fmt::format("# quantized formats' io: {}\n",
                    o.quantized_io ? "quantized (DeepEP-style: x quantized once before timing, codes + scales in "
                                     "and out, no codec in dispatch)"
                                   : "dequantized (bf16 x in and out: encode and decode in dispatch)"));
  print(fmt::format("# {:>7} {:>7} {:>7} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8}{}\n", "tokens", "hidden",
                    "format", "disp(us)", "net GB/s", "comb(us)", "net GB/s", "dedup", "imbal",
                    o.mem_cuda ? fmt::format(" {:>11}", "cached(us)") : ""));
  for (size_t H : o.hidden)
    for (PayloadFormat f : o.formats)
      for (size_t T : o.tokens) {
        MoeConfig cfg;
        cfg.max_tokens = T;
        cfg.hidden = H;
        cfg.topk = o.topk;
        cfg.num_experts = E;
        cfg.format = f;
        RoutingOptions ro;
        ro.num_experts = E;
        ro.topk = o.topk;
        ro.num_groups = comm->numNodes();
        ro.max_groups_per_token = o.max_nodes;
        ro.zipf_s = o.zipf;
        auto routing = generateRouting(T, me, ro);
        std::vector<BFloat16> x(T * H);
        for (size_t i = 0; i < x.size(); ++i)
          x[i] = BFloat16::fromFloat(static_cast<float>((i * 37 + me) % 97) / 97.0f);
        double disp = 0, comb = 0, cached = 0, imbal = 1;
        Layout lay;
        if (o.mem_cuda) {
#if defined(CROSSBAR_HAVE_MOE_CUDA)
          timeCuda(o, comm, cfg, routing, x, disp, cached, comb, imbal);
          lay = computeLayout(makeTopology(*comm, cfg, "moe_dispatch_perf"), cfg.topk, routing.topk_idx.data(), T, E,
                              "moe_dispatch_perf: ");
#endif
        } else {
          auto buf = MoeBuffer::create(comm, cfg);
          lay = buf->layout(routing.topk_idx.data(), T, E);
          const bool qio = o.quantized_io && f != PayloadFormat::kNative;
          // Quantized io: x quantized once, before timing (as DeepEP's test does).
          std::vector<uint8_t> xq_payload, xq_scales;
          std::vector<BFloat16> y;
          QuantizedTokens xq;
          if (qio) {
            const PayloadCodec c = payloadCodec(f);
            xq.format = f;
            xq.payload_row_bytes = payloadBytes(c, H);
            xq.scale_row_bytes = scaleBytes(c, H);
            if (f == PayloadFormat::kNvfp4)
              xq.global_scale = nvfp4GlobalScale(blockAmax(x.data(), static_cast<int>(x.size())));
            xq_payload.resize(T * xq.payload_row_bytes);
            xq_scales.resize(T * xq.scale_row_bytes);
            std::vector<float> sc(xq.scale_row_bytes / 4 + 1);
            for (size_t t = 0; t < T; ++t) {
              quantizeRow(c, x.data() + t * H, H, xq_payload.data() + t * xq.payload_row_bytes, sc.data(),
                          xq.global_scale);
              std::memcpy(xq_scales.data() + t * xq.scale_row_bytes, sc.data(), xq.scale_row_bytes);
            }
            xq.payload = xq_payload.data();
            xq.scales = xq_scales.data();
          }
          DispatchResult d;
          for (int it = 0; it < o.warmup + o.iters; ++it) {
            comm->barrier();
            MoeBuffer::DispatchArgs a;
            a.tokens = T;
            a.x = qio ? nullptr : x.data();
            a.x_quantized = qio ? &xq : nullptr;
            a.topk_idx = routing.topk_idx.data();
            a.topk_weights = routing.topk_weights.data();
            a.output = qio ? RecvOutput::kQuantized : RecvOutput::kConfig;
            auto t0 = Clock::now();
            d = buf->dispatch(a);
            auto t1 = Clock::now();
            const void* yp = d.x.data();
            if (qio) {  // the experts' bf16 outputs (not timed)
              y.resize(d.num_recv * H);
              for (size_t i = 0; i < d.num_recv; ++i)
                dequantizeRow(payloadCodec(f), d.q_payload.data() + i * xq.payload_row_bytes,
                              d.q_scales.data() + i * xq.scale_row_bytes, H, y.data() + i * H, d.q_global_scale[i]);
              yp = y.data();
              t1 = Clock::now();
            }
            buf->combine(yp, DataType::kBFloat16, *d.handle);
            auto t2 = Clock::now();
            if (it >= o.warmup) {
              disp += std::chrono::duration<double>(t1 - t0).count();
              comb += std::chrono::duration<double>(t2 - t1).count();
            }
          }
          disp /= o.iters;
          comb /= o.iters;
          imbal = d.metrics.expert_imbalance;
        }
        disp = maxOverRanks(coll, disp);
        comb = maxOverRanks(coll, comb);
        cached = maxOverRanks(coll, cached);
        const double net = sumOverRanks(coll, lay.remote_token_node_pairs * H * elementBytes(f)) / R;
        const double comb_net =
            sumOverRanks(coll, lay.remote_token_node_pairs * H * 4.0) / R;  // f32 partials
        const double dedup = sumOverRanks(coll, static_cast<double>(lay.token_expert_pairs)) /
                             std::max(1.0, sumOverRanks(coll, static_cast<double>(lay.token_rank_pairs)));
        imbal = maxOverRanks(coll, imbal);
        print(fmt::format("  {:>7} {:>7} {:>7} {:>10.1f} {:>9.3f} {:>10.1f} {:>9.3f} {:>8.2f} {:>8.2f}{}\n", T,
                          H, payloadFormatName(f), disp * 1e6, net / disp / 1e9, comb * 1e6,
                          comb_net / comb / 1e9, dedup, imbal,
                          o.mem_cuda ? fmt::format(" {:>11.1f}", cached * 1e6) : ""));
      }
  return 0;
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
      if (f.is("--nranks"))
        o.nranks = static_cast<int>(f.integer(1, 4096));
      else if (f.is("--ranks-per-node"))
        o.ranks_per_node = static_cast<int>(f.integer(1, 4096));
      else if (f.is("--experts"))
        o.experts = static_cast<int>(f.integer(1, INT_MAX));
      else if (f.is("--topk"))
        o.topk = static_cast<int>(f.integer(1, 1024));
      else if (f.is("--max-nodes"))
        o.max_nodes = static_cast<int>(f.integer(INT_MIN, INT_MAX));
      else if (f.is("--zipf"))
        o.zipf = f.real();
      else if (f.is("--iters"))
        o.iters = static_cast<int>(f.integer(1, INT_MAX));
      else if (f.is("--warmup"))
        o.warmup = static_cast<int>(f.integer(0, INT_MAX));
      else if (f.is("--fp8-io"))
        o.quantized_io = f.choice({"dequantized", "quantized"}) == "quantized";
      else if (f.is("--mem"))
        o.mem_cuda = f.choice({"host", "cuda"}) == "cuda";
      else if (f.is("--tokens"))
        o.tokens = f.integers(0);
      else if (f.is("--hidden"))
        o.hidden = f.integers(1);
      else if (f.is("--formats")) {
        o.formats.clear();
        for (auto& s : f.list()) o.formats.push_back(parseFormat(s));
      } else {
        return f.usage(
            "[--nranks N] [--ranks-per-node K] [--tokens a,b] [--hidden a,b] "
            "[--formats native,fp8,mxfp8,nvfp4] [--experts E] [--topk k] [--max-nodes M] [--zipf s] "
            "[--iters n] [--warmup n] [--mem host|cuda] [--fp8-io dequantized|quantized]");
      }
    }
    if (o.mem_cuda && o.quantized_io) {
      std::fprintf(stderr, "%s: --fp8-io quantized runs on host memory only (CudaMoeBuffer takes bf16 x)\n",
                   argv[0]);
      return 2;
    }
#if !defined(CROSSBAR_HAVE_MOE_CUDA)
    if (o.mem_cuda) {
      std::fprintf(stderr, "%s: --mem cuda: this build has no CUDA MoE path (configure with CUDA)\n", argv[0]);
      return 2;
    }
#endif
    CommOptions copts;
    if (o.ranks_per_node > 0) {
      setenv("CROSSBAR_RANKS_PER_NODE", std::to_string(o.ranks_per_node).c_str(), 1);
      copts.ranks_per_node = o.ranks_per_node;
    }
    auto exits = launchLocalRanks(o.nranks, [&](int rank, int size, std::shared_ptr<Store> store) {
      return runRank(o, Communicator::create(std::move(store), rank, size, copts));
    });
    return combinedExitCode(exits);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 1;
  }
}
