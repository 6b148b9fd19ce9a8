// CUDA executor of the two-level MoE all-to-all (moe_cuda.h). The routing is planned on the
// host (moe_plan.h, cuda/moe_cuda_plan.h); everything that touches activations is enqueued on
// the caller's stream: codec / copy / sum kernels (moe_codec.h, moe_kernels.h), NCCL p2p
// across nodes (CudaCollectives, one send per remote node), kernel writes into the local
// ranks' CUDA symmetric buffers with stream-memory-operation signals within the node.
#include "collectives/moe/cuda/moe_cuda.h"

#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "collectives/cuda/cuda_collectives.h"
#include "collectives/moe/cuda/moe_codec.h"
#include "collectives/moe/cuda/moe_cuda_plan.h"
#include "collectives/moe/cuda/moe_kernels.h"
#include "collectives/moe/moe_plan.h"
#include "comm/errors.h"
#include "comm/log.h"
#include "symmem/cuda/cuda_segment_allocator.h"
#include "symmem/cuda/cuda_symmetric.h"
#include "symmem/cuda/device_handle.h"
#include "symmem/cuda/driver_api.h"
#include "symmem/symmetric_heap.h"

namespace crossbar::moe {
namespace sys = ::crossbar::cuda;  // symmem/cuda (moe::cuda holds this layer's kernels)
namespace {

enum Channel { kDispatchData = 0, kDispatchAck = 1, kCombineData = 2, kCombineAck = 3, kNumChannels = 4 };
// Tags of the plan exchange on the buffer's own (dup'ed) communicator: two per dispatch.
constexpr uint32_t kPlanTagBase = 0x4D430000u;
constexpr uint32_t kPlanTagCalls = 0x8000;
// The codec kernels take at most this many rows per launch.
constexpr size_t kRowsPerLaunch = 65535;

constexpr size_t align16(size_t v) {
  return (v + 15) & ~size_t{15};
}

DeviceStorage deviceAlloc(size_t bytes, int device, const char* what) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  sys::checkCuda(cudaMalloc(&p, bytes), fmt::format("moe: cudaMalloc of {} ({} bytes)", what, bytes), device,
                  "reduce max_tokens / hidden or free device memory");
  return DeviceStorage(p, [](void* q) { cudaFree(q); });
}

// fn(offset, count) over [0, n) in pieces the codec kernels accept.
template <class F>
void inPieces(size_t n, F&& fn) {
  for (size_t off = 0; off < n; off += kRowsPerLaunch) fn(off, std::min(kRowsPerLaunch, n - off));
}

}  // namespace

struct CudaMoeHandle {
  const void* owner = nullptr;
  CudaMoePlan plan;
  std::vector<uint8_t> host_blob;  // the index arrays below, as uploaded
  DeviceStorage mem;
  std::vector<const int32_t*> node_send, fwd_to_local, recv_rows;  // device, per node / local rank
  const int32_t *src_rank = nullptr, *src_token = nullptr, *expert_rows = nullptr, *expert_slots = nullptr;
  const int64_t* topk_idx = nullptr;
  // Combine: contributions of F row i are local-buffer float offsets c_offs[c_first[i] ..
  // c_first[i+1]) (local-rank order); token t's partials are t_src[t_first[t] .. t_first[t+1])
  // (node << 32 | index in that node's list, node order).
  const int32_t *c_first = nullptr, *t_first = nullptr;
  const int64_t *c_offs = nullptr, *t_src = nullptr;
  // combineExpertMajor: expert-major rows of received row i are em_idx[em_first[i] .. em_first[i+1]).
  const int32_t *em_first = nullptr, *em_idx = nullptr;
  size_t nf = 0;
  // Several nodes: the forwarding split into the rows sent before / after the network phase
  // (cudaMoeForwardPhases); fwd_src / fwd_pos [phase][local j] are device copies of phases.
  CudaMoeForwardPhases phases;
  std::vector<const int32_t*> fwd_src[2], fwd_pos[2];
};

size_t handleNumRecv(const CudaMoeHandle& h) {
  return h.plan.num_recv;
}

size_t handleTokens(const CudaMoeHandle& h) {
  return h.plan.tokens;
}

DeviceStorage handleStorage(const CudaMoeHandle& h) {
  return h.mem;
}

struct CudaMoeBuffer::Impl {
  std::shared_ptr<Communicator> comm;  // a dup: the plan exchange has its own tag space
  MoeConfig cfg;
  MoeTopology topo;
  RowFormat fmt;
  int device = -1;
  size_t fmax = 0, dslot = 0, cslot = 0, wire_es = 4;
  symm::SymmetricHeap heap;
  std::shared_ptr<symm::SymmetricBuffer> dbuf, cbuf;  // [local forwarder j] slots
  DeviceStorage enc, fbuf, nsend, acc, acc16, back, scalars;
  float *d_gscale = nullptr, *d_amax = nullptr;
  float h_gscale = 1.0f;  // source of a pre-quantized x's global scale copy (stays valid: a member)
  int* d_nonfinite = nullptr;
  std::unique_ptr<CudaCollectives> coll;  // NCCL across nodes (N > 1)
  cudaEvent_t event = nullptr;
  cudaEvent_t last_call = nullptr;  // recorded at the end of every call (the destructor waits for it)
  // Several nodes: the network phase's stream, forked from the caller's stream (fork) and
  // joined back (join) within each call.
  cudaStream_t net_stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  DeviceAllocator allocate;
  uint64_t dispatches = 0, combines = 0, calls = 0;
  std::string last_op = "none";

  std::string ctx(const char* op) const { return errorContext(topo.rank, op); }
  Deadline deadline() const {
    return cfg.timeout.count() > 0 ? Deadline::after(cfg.timeout) : comm->defaultDeadline();
  }
  bool quantized() const { return cfg.format != PayloadFormat::kNative; }
  uint8_t* bytes(const DeviceStorage& s) const { return static_cast<uint8_t*>(s.get()); }

  void waitStream(cudaStream_t s, Deadline dl, const std::string& what) const {
    sys::checkCuda(cudaEventRecord(event, s), what + ": cudaEventRecord", device);
    while (true) {
      const cudaError_t e = cudaEventQuery(event);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady)
        sys::checkCuda(e, what + ": cudaEventQuery", device,
                        "a kernel or copy on the stream failed; the CUDA context is unusable");
      if (dl.expired())
        throw Timeout(ctx(what.c_str()) + "the stream did not get there within the deadline; check that every "
                                          "rank makes the same MoE calls (a rank's stream waits for its peers' "
                                          "signals)",
                      {});
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::shared_ptr<const CudaMoeHandle> makeHandle(CudaMoePlan plan, const void* owner, cudaStream_t s);

  // Per-call device memory for work on `s` (Options::allocate, or cudaMalloc).
  DeviceStorage allocOut(size_t bytes, cudaStream_t s, const char* what) const {
    if (bytes == 0) return nullptr;
    if (!allocate) return deviceAlloc(bytes, device, what);
    DeviceStorage p = allocate(bytes, s);
    if (!p)
      throw CudaError(ctx("moe") + fmt::format("the buffer's allocator returned no memory for {} ({} bytes)", what,
                                               bytes),
                      {});
    return p;
  }
  // The network stream starts after the work queued on `s` so far ...
  void forkNet(cudaStream_t s, const char* op) const {
    sys::checkCuda(cudaEventRecord(fork, s), std::string(op) + ": cudaEventRecord (fork)", device);
    sys::checkCuda(cudaStreamWaitEvent(net_stream, fork, 0), std::string(op) + ": cudaStreamWaitEvent (fork)",
                    device);
  }
  // ... and `s` continues past this point once the network stream's work is done.
  void joinNet(cudaStream_t s, const char* op) const {
    sys::checkCuda(cudaEventRecord(join, net_stream), std::string(op) + ": cudaEventRecord (join)", device);
    sys::checkCuda(cudaStreamWaitEvent(s, join, 0), std::string(op) + ": cudaStreamWaitEvent (join)", device);
  }
};

std::shared_ptr<const CudaMoeHandle> CudaMoeBuffer::Impl::makeHandle(CudaMoePlan plan, const void* owner,
                                                                     cudaStream_t s) {
  auto h = std::make_shared<CudaMoeHandle>();
  h->owner = owner;
  h->plan = std::move(plan);
  const CudaMoePlan& p = h->plan;
  const size_t H = cfg.hidden;
  // Host-side index arrays, each 16-aligned in one blob (one upload).
  std::vector<std::pair<size_t, size_t>> parts;  // (offset, bytes)
  size_t total = 0;
  auto reserve = [&](size_t n) {
    parts.emplace_back(total, n);
    total = align16(total + n);
    return parts.size() - 1;
  };
  auto put = [&](size_t part, const void* src) {
    if (parts[part].second) std::memcpy(h->host_blob.data() + parts[part].first, src, parts[part].second);
  };
  std::vector<size_t> ns(topo.N), fl(topo.L), rr(topo.L);
  for (int m = 0; m < topo.N; ++m) ns[m] = reserve(p.node_send[m].size() * 4);
  for (int j = 0; j < topo.L; ++j) fl[j] = reserve(p.fwd_to_local[j].size() * 4);
  for (int j = 0; j < topo.L; ++j) rr[j] = reserve(p.recv_rows[j].size() * 4);
  const size_t p_src = reserve(p.num_recv * 4), p_tok = reserve(p.num_recv * 4);
  const size_t p_idx = reserve(p.topk_idx.size() * 8);
  const size_t p_er = reserve(p.expert_major.rows.size() * 4), p_es = reserve(p.expert_major.slots.size() * 4);

  // Combine indices (shared with the CPU test of the plan).
  CudaMoeSumIndex sx = cudaMoeSumIndex(p, cslot / sizeof(float), H);
  h->nf = sx.nf;
  const auto& c_first = sx.c_first;
  const auto& c_offs = sx.c_offs;
  const auto& t_first = sx.t_first;
  const auto& t_src = sx.t_src;
  const auto& em_first = sx.em_first;
  const auto& em_idx = sx.em_idx;
  const size_t p_ef = reserve(em_first.size() * 4), p_ei = reserve(em_idx.size() * 4);
  const size_t p_cf = reserve(c_first.size() * 4), p_co = reserve(c_offs.size() * 8);
  const size_t p_tf = reserve(t_first.size() * 4), p_ts = reserve(t_src.size() * 8);
  std::vector<size_t> ph_src[2], ph_pos[2];
  if (topo.N > 1) {
    h->phases = cudaMoeForwardPhases(p, p.fwd_count[0]);
    for (int ph = 0; ph < 2; ++ph)
      for (int j = 0; j < topo.L; ++j) {
        ph_src[ph].push_back(reserve(h->phases.src[ph][j].size() * 4));
        ph_pos[ph].push_back(reserve(h->phases.pos[ph][j].size() * 4));
      }
  }

  h->host_blob.assign(total, 0);
  for (int m = 0; m < topo.N; ++m) put(ns[m], p.node_send[m].data());
  for (int j = 0; j < topo.L; ++j) put(fl[j], p.fwd_to_local[j].data());
  for (int j = 0; j < topo.L; ++j) put(rr[j], p.recv_rows[j].data());
  put(p_src, p.src_rank.data());
  put(p_tok, p.src_token.data());
  put(p_idx, p.topk_idx.data());
  put(p_er, p.expert_major.rows.data());
  put(p_es, p.expert_major.slots.data());
  put(p_ef, em_first.data());
  put(p_ei, em_idx.data());
  put(p_cf, c_first.data());
  put(p_co, c_offs.data());
  put(p_tf, t_first.data());
  put(p_ts, t_src.data());
  for (int ph = 0; ph < 2; ++ph)
    for (size_t j = 0; j < ph_src[ph].size(); ++j) {
      put(ph_src[ph][j], h->phases.src[ph][j].data());
      put(ph_pos[ph][j], h->phases.pos[ph][j].data());
    }
  h->mem = allocOut(total, s, "routing indices");
  if (total)
    sys::checkCuda(cudaMemcpyAsync(h->mem.get(), h->host_blob.data(), total, cudaMemcpyHostToDevice, s),
                    "moe dispatch: upload of the routing indices", device);
  auto at = [&](size_t part) -> const void* {
    return parts[part].second ? static_cast<const uint8_t*>(h->mem.get()) + parts[part].first : nullptr;
  };
  auto i32 = [&](size_t part) { return static_cast<const int32_t*>(at(part)); };
  auto i64 = [&](size_t part) { return static_cast<const int64_t*>(at(part)); };
  for (int m = 0; m < topo.N; ++m) h->node_send.push_back(i32(ns[m]));
  for (int j = 0; j < topo.L; ++j) h->fwd_to_local.push_back(i32(fl[j]));
  for (int j = 0; j < topo.L; ++j) h->recv_rows.push_back(i32(rr[j]));
  h->src_rank = i32(p_src);
  h->src_token = i32(p_tok);
  h->topk_idx = i64(p_idx);
  h->expert_rows = i32(p_er);
  h->expert_slots = i32(p_es);
  h->em_first = i32(p_ef);
  h->em_idx = i32(p_ei);
  h->c_first = i32(p_cf);
  h->c_offs = i64(p_co);
  h->t_first = i32(p_tf);
  h->t_src = i64(p_ts);
  for (int ph = 0; ph < 2; ++ph)
    for (size_t j = 0; j < ph_src[ph].size(); ++j) {
      h->fwd_src[ph].push_back(i32(ph_src[ph][j]));
      h->fwd_pos[ph].push_back(i32(ph_pos[ph][j]));
    }
  return h;
}

CudaMoeBuffer::CudaMoeBuffer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaMoeBuffer::~CudaMoeBuffer() {
  if (!impl_ || !impl_->event) return;
  // The heap and scratch go away with this object: let the queued work finish (bounded).
  const Deadline dl = impl_->deadline();
  while (cudaEventQuery(impl_->last_call) == cudaErrorNotReady) {
    if (dl.expired()) {
      CB_WARN("moe", "{}the last {} did not finish before the deadline; freeing its buffers anyway",
              impl_->ctx("moe destroy (cuda)"), impl_->last_op);
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  cudaGetLastError();
  cudaEventDestroy(impl_->event);
  cudaEventDestroy(impl_->last_call);
  if (impl_->fork) cudaEventDestroy(impl_->fork);
  if (impl_->join) cudaEventDestroy(impl_->join);
  if (impl_->net_stream) cudaStreamDestroy(impl_->net_stream);
}
const MoeConfig& CudaMoeBuffer::config() const {
  return impl_->cfg;
}
int CudaMoeBuffer::numLocalExperts() const {
  return impl_->topo.epr;
}
size_t CudaMoeBuffer::rowBytes() const {
  return impl_->fmt.row;
}
int CudaMoeBuffer::device() const {
  return impl_->device;
}

std::unique_ptr<CudaMoeBuffer> CudaMoeBuffer::create(std::shared_ptr<Communicator> comm, const MoeConfig& cfg,
                                                     Options options) {
  const char* op = "moe create (cuda)";
  if (!comm) throw InvalidArgument("CudaMoeBuffer::create: null communicator");
  auto im = std::make_unique<Impl>();
  im->cfg = cfg;
  im->topo = makeTopology(*comm, cfg, op);
  im->fmt = makeRowFormat(cfg);
  if (im->topo.max_node > sys::kMaxLocalRanks)
    throw Unsupported(im->ctx(op) +
                      fmt::format("{} ranks per node: the CUDA MoE path maps at most {} local GPUs",
                                  im->topo.max_node, sys::kMaxLocalRanks));
  int dev = options.device;
  if (dev < 0 && cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    throw Unsupported(im->ctx(op) + "no CUDA device (cudaGetDevice failed): " + sys::driverUnavailableReason());
  }
  sys::ensureContext(dev, op);
  im->device = dev;
  im->allocate = std::move(options.allocate);
  im->comm = comm->dup();
  const size_t H = cfg.hidden, N = static_cast<size_t>(im->topo.N);
  const size_t row = im->fmt.row;
  im->fmax = static_cast<size_t>(im->topo.max_sources) * cfg.max_tokens;
  im->dslot = im->fmax * row;
  im->cslot = im->fmax * H * sizeof(float);
  im->wire_es = cfg.combine_wire == DataType::kBFloat16 ? 2 : 4;

  symm::HeapOptions ho;
  ho.channels = kNumChannels;
  ho.name = "moe-cuda";
  ho.remote_access = false;  // off-node traffic goes through NCCL
  ho.allocator = sys::makeCudaSegmentAllocator(dev);
  im->heap = symm::SymmetricHeap::create(im->comm, ho);
  // A slot per forwarder of the largest node: the same size on every rank.
  im->dbuf = im->heap.allocate(static_cast<size_t>(im->topo.max_node) * im->dslot);
  im->cbuf = im->heap.allocate(static_cast<size_t>(im->topo.max_node) * im->cslot);

  im->enc = deviceAlloc(cfg.max_tokens * row, dev, "encoded tokens");
  im->fbuf = deviceAlloc(im->fmax * row, dev, "forwarded rows");
  im->acc = deviceAlloc(im->fmax * H * 4, dev, "combine sums");
  if (im->wire_es == 2) im->acc16 = deviceAlloc(im->fmax * H * 2, dev, "combine sums (bf16)");
  if (N > 1) {
    im->nsend = deviceAlloc(N * cfg.max_tokens * row, dev, "network send rows");
    im->back = deviceAlloc(N * cfg.max_tokens * H * im->wire_es, dev, "returning partial sums");
    CudaCollectivesOptions co;
    co.device = dev;
    co.symmetric_heap = false;  // NCCL p2p only; the MoE buffers are this object's heap
    co.timeout = cfg.timeout;
    im->coll = std::make_unique<CudaCollectives>(im->comm, co);
    // NCCL is created lazily by its first operation, collectively: do it here, where every
    // rank takes part (a dispatch may give a rank nothing to send or receive).
    im->coll->barrier(nullptr)->wait(im->deadline());
    sys::checkCuda(cudaStreamCreateWithFlags(&im->net_stream, cudaStreamNonBlocking), "moe: cudaStreamCreate", dev);
    sys::checkCuda(cudaEventCreateWithFlags(&im->fork, cudaEventDisableTiming), "moe: cudaEventCreate", dev);
    sys::checkCuda(cudaEventCreateWithFlags(&im->join, cudaEventDisableTiming), "moe: cudaEventCreate", dev);
  }
  im->scalars = deviceAlloc(16, dev, "scales");
  im->d_gscale = static_cast<float*>(im->scalars.get());
  im->d_amax = im->d_gscale + 1;
  im->d_nonfinite = reinterpret_cast<int*>(im->d_gscale + 2);
  sys::checkCuda(cudaEventCreateWithFlags(&im->event, cudaEventDisableTiming), "moe: cudaEventCreate", dev);
  sys::checkCuda(cudaEventCreateWithFlags(&im->last_call, cudaEventDisableTiming), "moe: cudaEventCreate", dev);
  CB_INFO("moe",
          "CUDA MoE buffer on device {}: {} experts, top-{}, hidden {}, {} ({}), {} nodes, {} ranks on this "
          "one, row {} B",
          dev, cfg.num_experts, cfg.topk, cfg.hidden, payloadFormatName(cfg.format),
          cfg.dtype == DataType::kFloat32 ? "f32" : "bf16", N, im->topo.L, row);
  return std::unique_ptr<CudaMoeBuffer>(new CudaMoeBuffer(std::move(im)));
}

Layout CudaMoeBuffer::layout(const int64_t* topk_idx, size_t tokens, int num_experts) const {
  return computeLayout(impl_->topo, impl_->cfg.topk, topk_idx, tokens, num_experts, impl_->ctx("moe layout"));
}

void CudaMoeBuffer::synchronize(cudaStream_t stream, Deadline deadline) const {
  sys::checkCuda(cudaSetDevice(impl_->device), "moe synchronize: cudaSetDevice", impl_->device);
  impl_->waitStream(stream, deadline, "moe synchronize (after " + impl_->last_op + ")");
}

CudaDispatchResult CudaMoeBuffer::dispatch(const void* x, size_t tokens, const int64_t* topk_idx,
                                           const float* topk_weights, cudaStream_t stream,
                                           std::shared_ptr<const CudaMoeHandle> cached) {
  MoeBuffer::DispatchArgs a;
  a.tokens = tokens;
  a.x = x;
  a.topk_idx = topk_idx;
  a.topk_weights = topk_weights;
  return dispatch(a, stream, std::move(cached));
}

CudaDispatchResult CudaMoeBuffer::dispatch(const MoeBuffer::DispatchArgs& args, cudaStream_t stream,
                                           std::shared_ptr<const CudaMoeHandle> cached) {
  Impl& im = *impl_;
  const char* op = "moe dispatch (cuda)";
  const MoeConfig& cfg = im.cfg;
  const MoeTopology& t = im.topo;
  const RowFormat& f = im.fmt;
  const size_t k = static_cast<size_t>(cfg.topk), H = cfg.hidden, row = f.row, xrow = H * f.es;
  const size_t tokens = args.tokens;
  const void* x = args.x;
  const QuantizedTokens* xq = args.x_quantized;
  const int64_t* topk_idx = args.topk_idx;
  const float* topk_weights = args.topk_weights;
  if (args.cached)
    throw InvalidUsage(im.ctx(op) + "args.cached holds a host MoeBuffer handle: pass the CUDA handle as `cached`");
  if (tokens > cfg.max_tokens)
    throw InvalidArgument(im.ctx(op) + fmt::format("{} tokens exceed the buffer's max_tokens {}: create the "
                                                   "buffer with a larger max_tokens",
                                                   tokens, cfg.max_tokens));
  if (x && xq) throw InvalidUsage(im.ctx(op) + "both x and a pre-quantized x given: pass one of them");
  if (xq) checkQuantizedInput(cfg, f, *xq, tokens, im.ctx(op));
  if (tokens > 0 && ((!x && !xq) || !topk_idx)) throw InvalidArgument(im.ctx(op) + "x or topk_idx is null");
  const RecvForms forms = recvForms(cfg, args.output, im.ctx(op));
  if (cached && cached->owner != this)
    throw InvalidArgument(im.ctx(op) + "the cached handle comes from another CudaMoeBuffer");
  if (cached && cached->plan.tokens != tokens)
    throw InvalidArgument(im.ctx(op) + fmt::format("the cached handle was made for {} tokens, not {}",
                                                   cached->plan.tokens, tokens));
  sys::checkCuda(cudaSetDevice(im.device), std::string(op) + ": cudaSetDevice", im.device);
  im.last_op = "dispatch";
  const Deadline dl = im.deadline();
  CudaDispatchResult res;
  std::shared_ptr<const CudaMoeHandle> h = cached;
  if (!h) {
    // The plan needs the routing on the host: the one blocking step (see moe_cuda.h).
    auto t0 = std::chrono::steady_clock::now();
    std::vector<int64_t> host_idx(tokens * k);
    if (tokens)
      sys::checkCuda(cudaMemcpyAsync(host_idx.data(), topk_idx, tokens * k * 8, cudaMemcpyDefault, stream),
                      std::string(op) + ": copy of topk_idx to the host", im.device);
    im.waitStream(stream, dl, "moe dispatch (cuda): topk_idx to the host");
    auto t1 = std::chrono::steady_clock::now();
    const uint32_t tag = kPlanTagBase + static_cast<uint32_t>(im.calls++ % kPlanTagCalls) * 2;
    CudaMoePlan plan = exchangeCudaMoePlan(*im.comm, t, cfg, row, host_idx.data(), tokens, tag, dl);
    auto t2 = std::chrono::steady_clock::now();
    h = im.makeHandle(std::move(plan), this, stream);
    res.metrics.phases.emplace_back("wait topk_idx", std::chrono::duration<double>(t1 - t0).count());
    res.metrics.phases.emplace_back("plan exchange", std::chrono::duration<double>(t2 - t1).count());
  }
  const CudaMoePlan& p = h->plan;
  const auto enqueue_start = std::chrono::steady_clock::now();
  uint8_t* enc = im.bytes(im.enc);
  uint8_t* fbuf = im.bytes(im.fbuf);

  // 1. encode every token once: header + routing, then the payload (quantized or copied).
  if (xq) {
    // The caller's global scale (nvfp4; 1 otherwise) into the device scalar the headers read.
    im.h_gscale = cfg.format == PayloadFormat::kNvfp4 ? xq->global_scale : 1.0f;
    sys::checkCuda(cudaMemcpyAsync(im.d_gscale, &im.h_gscale, 4, cudaMemcpyHostToDevice, stream),
                   std::string(op) + ": copy of the global scale", im.device);
  } else {
    cuda::tensorAmax(cfg.dtype, x, cfg.format == PayloadFormat::kNvfp4 ? tokens : 0, H, im.d_amax,
                     im.d_nonfinite, stream);
    cuda::setGlobalScale(im.d_amax, im.d_nonfinite, cfg.format == PayloadFormat::kNvfp4, im.d_gscale, stream);
  }
  cuda::packHeaders(enc, row, f.off_topk, f.off_w, t.rank, im.d_gscale, topk_idx, topk_weights, cfg.topk, tokens,
                    stream);
  if (xq) {
    // Pre-quantized: the caller's codes and scales go into the records as they are.
    cuda::copyRows(xq->payload, f.payload_bytes, nullptr, enc + f.off_payload, row, nullptr, f.payload_bytes,
                   tokens, stream);
    cuda::copyRows(xq->scales, f.scale_bytes, nullptr, enc + f.off_scales, row, nullptr, f.scale_bytes, tokens,
                   stream);
  } else if (im.quantized()) {
    const cuda::RowLayout l{H, row, row};
    inPieces(tokens, [&](size_t off, size_t n) {
      cuda::quantizeRows(payloadCodec(cfg.format), cfg.dtype, static_cast<const uint8_t*>(x) + off * xrow, nullptr,
                         n, l, enc + off * row + f.off_payload, enc + off * row + f.off_scales,
                         static_cast<const float*>(im.d_gscale), stream);
    });
  } else {
    cuda::copyRows(x, xrow, nullptr, enc + f.off_payload, row, nullptr, xrow, tokens, stream);
  }

  // 2. the other nodes' rows go over NCCL on the network stream (joined back in step 4) ...
  if (t.N > 1) {
    im.forkNet(stream, op);
    for (int m = 0; m < t.N; ++m)
      if (m != t.me_node)
        cuda::copyRows(enc, row, h->node_send[m], im.bytes(im.nsend) + m * cfg.max_tokens * row, row, nullptr, row,
                       p.node_send[m].size(), im.net_stream);
    im.coll->groupStart();
    for (int m = 0; m < t.N; ++m)
      if (m != t.me_node && !p.node_send[m].empty())
        im.coll->send(im.bytes(im.nsend) + m * cfg.max_tokens * row, p.node_send[m].size() * row,
                      DataType::kUInt8, t.forwarderOn(m, t.rank), 0, im.net_stream);
    for (size_t st = 1; st < t.fwd_sources.size(); ++st)
      if (p.fwd_count[st] > 0)
        im.coll->recv(fbuf + p.fwd_start[st] * row, p.fwd_count[st] * row, DataType::kUInt8,
                      t.fwd_sources[st], 0, im.net_stream);
    im.coll->groupEnd();
  }
  // 3. ... while the own node's rows, the first block of F, are forwarded on `stream`.
  cuda::copyRows(enc, row, h->node_send[t.me_node], fbuf, row, nullptr, row, p.node_send[t.me_node].size(), stream);

  // 4. forward: each F row once into every local destination's slot for this forwarder; with
  // several nodes the own rows first (phase 0), the network's rows after the join (phase 1).
  for (int j = 0; j < t.L; ++j)
    if (t.localRank(j) != t.rank && im.dispatches > 0)
      sys::streamWaitSignal(*im.dbuf, t.localRank(j), kDispatchAck, stream);
  auto slotOf = [&](int j) { return im.dbuf->peer<char>(t.localRank(j), static_cast<size_t>(t.me_local) * im.dslot); };
  if (t.N > 1) {
    for (int ph = 0; ph < 2; ++ph) {
      if (ph == 1) im.joinNet(stream, op);
      for (int j = 0; j < t.L; ++j)
        cuda::copyRows(fbuf, row, h->fwd_src[ph][j], slotOf(j), row, h->fwd_pos[ph][j], row,
                       h->phases.src[ph][j].size(), stream);
    }
  } else {
    for (int j = 0; j < t.L; ++j)
      cuda::copyRows(fbuf, row, h->fwd_to_local[j], slotOf(j), row, nullptr, row, p.fwd_to_local[j].size(), stream);
  }
  for (int j = 0; j < t.L; ++j)
    if (t.localRank(j) != t.rank) sys::streamPutSignal(*im.dbuf, t.localRank(j), kDispatchData, stream);
  for (int j = 0; j < t.L; ++j)
    if (t.localRank(j) != t.rank) sys::streamWaitSignal(*im.dbuf, t.localRank(j), kDispatchData, stream);

  // 5. receive: decode every forwarder's slot into (source rank, token) order.
  const size_t n = p.num_recv;
  res.num_recv = n;
  DeviceStorage w_out = im.allocOut(n * k * 4, stream, "received weights");
  res.topk_weights = static_cast<float*>(w_out.get());
  res.storage = {w_out, h->mem};
  const bool want_x = forms.x, want_q = forms.q;
  if (want_x) {
    DeviceStorage x_out = im.allocOut(n * xrow, stream, "received tokens");
    res.x = x_out.get();
    res.storage.push_back(x_out);
  }
  if (want_q) {
    DeviceStorage qp = im.allocOut(n * f.payload_bytes, stream, "received payload");
    DeviceStorage qs = im.allocOut(n * f.scale_bytes, stream, "received scales");
    DeviceStorage qg = im.allocOut(n * 4, stream, "received global scales");
    res.q_payload = static_cast<uint8_t*>(qp.get());
    res.q_scales = static_cast<uint8_t*>(qs.get());
    res.q_global_scale = static_cast<float*>(qg.get());
    res.storage.insert(res.storage.end(), {qp, qs, qg});
  }
  for (int j = 0; j < t.L; ++j) {
    const uint8_t* slot = im.dbuf->local<uint8_t>(static_cast<size_t>(j) * im.dslot);
    const int32_t* rows = h->recv_rows[j];
    const size_t nj = p.recv_rows[j].size();
    if (!want_x) {
      // Quantized output only: no decode.
    } else if (im.quantized()) {
      cuda::RowLayout l{H, row, row};
      l.global_scale_stride = row;
      inPieces(nj, [&](size_t off, size_t cnt) {
        const uint8_t* r = slot + off * row;
        cuda::dequantizeRows(payloadCodec(cfg.format), cfg.dtype, r + f.off_payload, r + f.off_scales,
                             reinterpret_cast<const float*>(r + offsetof(RowHeader, global_scale)), cnt, l, res.x,
                             rows + off, stream);
      });
    } else {
      cuda::copyRows(slot + f.off_payload, row, nullptr, res.x, xrow, rows, xrow, nj, stream);
    }
    cuda::receiveWeights(slot, row, f.off_w, rows, nj, cfg.topk, h->topk_idx, res.topk_weights, res.q_global_scale,
                         stream);
    if (want_q) {
      cuda::copyRows(slot + f.off_payload, row, nullptr, res.q_payload, f.payload_bytes, rows, f.payload_bytes, nj,
                     stream);
      cuda::copyRows(slot + f.off_scales, row, nullptr, res.q_scales, f.scale_bytes, rows, f.scale_bytes, nj, stream);
    }
  }
  // Our slots are read: the forwarders may overwrite them (next dispatch).
  for (int j = 0; j < t.L; ++j)
    if (t.localRank(j) != t.rank) sys::streamPutSignal(*im.dbuf, t.localRank(j), kDispatchAck, stream);
  ++im.dispatches;

  // 6. expert-major view.
  const size_t ne = p.expert_major.rows.size();
  DeviceStorage ew = im.allocOut(ne * 4, stream, "expert-major weights");
  res.expert_weights = static_cast<float*>(ew.get());
  res.storage.push_back(ew);
  cuda::gatherFloats(res.topk_weights, h->expert_slots, res.expert_weights, ne, stream);
  if (cfg.expert_major_copy && want_x) {
    DeviceStorage xe = im.allocOut(ne * xrow, stream, "expert-major tokens");
    res.x_expert_major = xe.get();
    res.storage.push_back(xe);
    cuda::copyRows(res.x, xrow, h->expert_rows, res.x_expert_major, xrow, nullptr, xrow, ne, stream);
  }
  if (cfg.expert_major_copy && want_q) {
    DeviceStorage pe = im.allocOut(ne * f.payload_bytes, stream, "expert-major payload");
    DeviceStorage se = im.allocOut(ne * f.scale_bytes, stream, "expert-major scales");
    res.q_payload_expert_major = static_cast<uint8_t*>(pe.get());
    res.q_scales_expert_major = static_cast<uint8_t*>(se.get());
    res.storage.insert(res.storage.end(), {pe, se});
    cuda::copyRows(res.q_payload, f.payload_bytes, h->expert_rows, res.q_payload_expert_major, f.payload_bytes,
                   nullptr, f.payload_bytes, ne, stream);
    cuda::copyRows(res.q_scales, f.scale_bytes, h->expert_rows, res.q_scales_expert_major, f.scale_bytes, nullptr,
                   f.scale_bytes, ne, stream);
  }

  res.src_rank = h->src_rank;
  res.src_token = h->src_token;
  res.topk_idx = h->topk_idx;
  res.expert_rows = h->expert_rows;
  res.recv_per_rank = p.recv_per_rank;
  res.tokens_per_expert = p.tokens_per_expert;
  res.expert_offsets = p.expert_major.offsets;
  res.metrics.inter_node_bytes = p.inter_node_bytes;
  res.metrics.intra_node_bytes = p.intra_node_bytes;
  res.metrics.dropped = p.dropped;
  finishDispatchMetrics(res.metrics, t, p.stats, row, p.tokens_per_expert);
  res.metrics.phases.emplace_back(
      "enqueue", std::chrono::duration<double>(std::chrono::steady_clock::now() - enqueue_start).count());
  res.handle = std::move(h);
  sys::checkCuda(cudaEventRecord(im.last_call, stream), std::string(op) + ": cudaEventRecord", im.device);
  return res;
}

CudaCombineResult CudaMoeBuffer::combine(const void* y, DataType y_type, const CudaMoeHandle& h,
                                         cudaStream_t stream, const float* weights) {
  Impl& im = *impl_;
  const char* op = "moe combine (cuda)";
  const MoeTopology& t = im.topo;
  const CudaMoePlan& p = h.plan;
  const size_t H = im.cfg.hidden, ws = im.wire_es;
  if (h.owner != this) throw InvalidArgument(im.ctx(op) + "the handle comes from another CudaMoeBuffer");
  if (y_type != DataType::kFloat32 && y_type != DataType::kBFloat16)
    throw InvalidArgument(im.ctx(op) + "y must be bfloat16 or float32");
  if (p.num_recv > 0 && !y) throw InvalidArgument(im.ctx(op) + "y is null");
  sys::checkCuda(cudaSetDevice(im.device), std::string(op) + ": cudaSetDevice", im.device);
  im.last_op = "combine";
  const auto start = std::chrono::steady_clock::now();
  CudaCombineResult res;

  // 1. every output row back to the forwarder it came from, as f32 (times its weight).
  for (int j = 0; j < t.L; ++j) {
    const int d = t.localRank(j);
    if (d != t.rank && im.combines > 0) sys::streamWaitSignal(*im.cbuf, d, kCombineAck, stream);
    float* slot = im.cbuf->peer<float>(d, static_cast<size_t>(t.me_local) * im.cslot);
    cuda::scaleRowsToF32(y, y_type, weights, h.recv_rows[j], p.recv_rows[j].size(), H, slot, stream);
    if (d != t.rank) {
      sys::streamPutSignal(*im.cbuf, d, kCombineData, stream);
      res.metrics.intra_node_bytes += p.recv_rows[j].size() * H * sizeof(float);
    }
  }
  // 2. as forwarder: sum the node's contributions per F row (local-rank order).
  for (int j = 0; j < t.L; ++j)
    if (t.localRank(j) != t.rank) sys::streamWaitSignal(*im.cbuf, t.localRank(j), kCombineData, stream);
  // The other nodes' rows (F rows >= own) first: their sums go out (step 3) while the own
  // node's rows are summed. Every row's sum is the same kernel arithmetic either way.
  float* acc = static_cast<float*>(im.acc.get());
  auto* acc16 = static_cast<uint16_t*>(im.acc16.get());
  const size_t own = p.fwd_count[0];
  cuda::sumRows(im.cbuf->local<float>(), h.c_offs, h.c_first + own, h.nf - own, H, acc + own * H,
                acc16 ? acc16 + own * H : nullptr, 0, stream);
  // 3. partial sums cross the network once per node (f32, or bf16 with combine_wire), on the
  // network stream (joined back before step 4).
  const uint8_t* wire = ws == 2 ? static_cast<const uint8_t*>(im.acc16.get()) : static_cast<const uint8_t*>(im.acc.get());
  if (t.N > 1) {
    im.forkNet(stream, op);
    im.coll->groupStart();
    for (size_t st = 1; st < t.fwd_sources.size(); ++st)
      if (p.fwd_count[st] > 0) {
        im.coll->send(wire + p.fwd_start[st] * H * ws, p.fwd_count[st] * H * ws, DataType::kUInt8,
                      t.fwd_sources[st], 0, im.net_stream);
        res.metrics.inter_node_bytes += p.fwd_count[st] * H * ws;
      }
    for (int m = 0; m < t.N; ++m)
      if (m != t.me_node && !p.node_send[m].empty())
        im.coll->recv(im.bytes(im.back) + m * im.cfg.max_tokens * H * ws, p.node_send[m].size() * H * ws,
                      DataType::kUInt8, t.forwarderOn(m, t.rank), 0, im.net_stream);
    im.coll->groupEnd();
  }
  cuda::sumRows(im.cbuf->local<float>(), h.c_offs, h.c_first, own, H, acc, nullptr, own, stream);
  for (int j = 0; j < t.L; ++j)
    if (t.localRank(j) != t.rank) sys::streamPutSignal(*im.cbuf, t.localRank(j), kCombineAck, stream);
  ++im.combines;
  if (t.N > 1) im.joinNet(stream, op);
  // 4. as source: the nodes' partials per token, in node order.
  DeviceStorage out = im.allocOut(p.tokens * H * 4, stream, "combined tokens");
  res.out = static_cast<float*>(out.get());
  res.storage = out;
  cuda::sumPartials(h.t_src, h.t_first, p.tokens, H, t.me_node, acc, p.fwd_start[0], im.back.get(), ws == 2,
                    im.cfg.max_tokens, res.out, stream);
  res.metrics.phases.emplace_back("enqueue",
                                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  sys::checkCuda(cudaEventRecord(im.last_call, stream), std::string(op) + ": cudaEventRecord", im.device);
  return res;
}

CudaCombineResult CudaMoeBuffer::combineExpertMajor(const void* y, DataType y_type, const CudaDispatchResult& d,
                                                    cudaStream_t stream, const float* weights) {
  Impl& im = *impl_;
  const char* op = "moe combine (cuda, expert-major)";
  if (!d.handle) throw InvalidArgument(im.ctx(op) + "the dispatch result has no handle");
  if (y_type != DataType::kFloat32 && y_type != DataType::kBFloat16)
    throw InvalidArgument(im.ctx(op) + "y must be bfloat16 or float32");
  const CudaMoeHandle& h = *d.handle;
  if (h.owner != this) throw InvalidArgument(im.ctx(op) + "the handle comes from another CudaMoeBuffer");
  if (!h.plan.expert_major.rows.empty() && !y) throw InvalidArgument(im.ctx(op) + "y is null");
  sys::checkCuda(cudaSetDevice(im.device), std::string(op) + ": cudaSetDevice", im.device);
  // Rows of one token summed here (expert-major order, f32), then the usual combine.
  DeviceStorage rows = im.allocOut(h.plan.num_recv * im.cfg.hidden * 4, stream, "expert-major sums");
  cuda::sumScaledRows(y, y_type, weights, h.em_first, h.em_idx, h.plan.num_recv, im.cfg.hidden,
                      static_cast<float*>(rows.get()), stream);
  CudaCombineResult res = combine(rows.get(), DataType::kFloat32, h, stream);
  // Work still queued reads `rows`. A caller's allocator frees stream-ordered (DeviceAllocator):
  // `rows` may go now. cudaFree would synchronize the device: the result owns it then.
  if (!im.allocate) {
    DeviceStorage out = res.storage;
    res.storage = DeviceStorage(out.get(), [out, rows](void*) {});
  }
  return res;
}

}  // namespace crossbar::moe
