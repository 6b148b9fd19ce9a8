// GPU tests of the CUDA collectives (skip without a device). Ranks are forked
// processes sharing GPU 0 (harness/multiprocess.h); each creates its CUDA context
// after the fork, the gtest process never initializes CUDA. Every result is compared
// with a float64 reference computed on the host from the (rounded) inputs, with a
// relative bound per type: the kernels accumulate in f32 (f64 for double) and round
// once, so the error is at most half an ulp of the output type (plus f32 summation
// error, zero here: inputs are small multiples of 1/4, exact in f32).
// Budget: the whole binary runs in well under 90 s on one H200.
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/collectives.h"
#include "collectives/cuda/cuda_collectives.h"
#include "collectives/reduce.h"
#include "collectives/signature.h"
#include "comm/errors.h"
#include "gpu_checks.h"
#include "harness/multiprocess.h"
#include "telemetry/telemetry.h"

namespace crossbar {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;

#define CUDA_OK(call)                                                                                     \
  do {                                                                                                    \
    cudaError_t e_ = (call);                                                                              \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorName(e_) << " " << cudaGetErrorString(e_); \
  } while (0)

Deadline kWait() {
  return Deadline::after(Millis(15'000));  // one operation; a hang shows as a Timeout naming it
}

// ---- values: encode/decode every type through the shared conversions ----------------------

double decodeOne(DataType t, const uint8_t* p) {
  return visitDataType(t, [&](auto tag) -> double {
    using T = typename decltype(tag)::type;
    T v;
    std::memcpy(&v, p, sizeof v);
    if constexpr (IsNarrowFloat<T>::value)
      return v.toFloat();
    else
      return static_cast<double>(v);
  });
}

void encodeOne(DataType t, double x, uint8_t* p) {
  visitDataType(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T v;
    if constexpr (IsNarrowFloat<T>::value)
      v = T::fromFloat(static_cast<float>(x));
    else
      v = static_cast<T>(x);
    std::memcpy(p, &v, sizeof v);
  });
}

// Input of `rank` at element i (salt separates calls): multiples of 1/4 in [-2, 2] for
// floats (exact in fp8 e4m3), small integers otherwise.
double inputValue(DataType t, int rank, size_t i, int salt) {
  const long k =
      static_cast<long>((i * 7 + static_cast<size_t>(rank) * 13 + static_cast<size_t>(salt) * 5) % 17) - 8;
  return isFloating(t) ? k * 0.25 : static_cast<double>(k * 3 + rank);
}

std::vector<uint8_t> encodeInput(DataType t, int rank, size_t n, int salt, size_t offset_elems = 0) {
  const size_t es = elementSize(t);
  std::vector<uint8_t> b(n * es);
  for (size_t i = 0; i < n; ++i) encodeOne(t, inputValue(t, rank, i + offset_elems, salt), b.data() + i * es);
  return b;
}

// Relative bound: half an ulp of the output type (f32: a few ulps of slack).
double tolerance(DataType t) {
  switch (t) {
    case DataType::kFloat16:
      return 1.0 / 2048;
    case DataType::kBFloat16:
      return 1.0 / 256;
    case DataType::kFloat8E4M3:
      return 1.0 / 16;
    case DataType::kFloat8E5M2:
      return 1.0 / 8;
    case DataType::kFloat32:
      return 1e-6;
    default:
      return 0;
  }
}

double reference(DataType t, ReduceOp op, int nranks, size_t i, int salt, size_t offset_elems = 0) {
  double acc = 0;
  for (int r = 0; r < nranks; ++r) {
    // What the rank actually stored (rounded to the type).
    uint8_t b[8];
    encodeOne(t, inputValue(t, r, i + offset_elems, salt), b);
    const double v = decodeOne(t, b);
    if (r == 0)
      acc = v;
    else if (op == ReduceOp::kMax)
      acc = std::max(acc, v);
    else
      acc += v;
  }
  if (op == ReduceOp::kAvg) acc = isFloating(t) ? acc / nranks : std::trunc(acc / nranks);
  return acc;
}

// Compares `n` elements of device memory `dev` with `expect(i)`; one failure per call.
template <class F>
void expectDevice(const void* dev, DataType t, size_t n, F expect, const std::string& what) {
  const size_t es = elementSize(t);
  std::vector<uint8_t> host(n * es);
  if (n) CUDA_OK(cudaMemcpy(host.data(), dev, n * es, cudaMemcpyDeviceToHost));
  const double tol = tolerance(t);
  for (size_t i = 0; i < n; ++i) {
    const double got = decodeOne(t, host.data() + i * es), want = expect(i);
    if (std::fabs(got - want) > tol * std::fabs(want) + 1e-12) {
      ADD_FAILURE() << what << ": element " << i << " of " << n << " is " << got << ", expected " << want
                    << " (" << dataTypeName(t) << ", tolerance " << tol << " relative)";
      return;
    }
  }
}

// Setup copies run on the legacy default stream, which does not order with the
// collectives' non-blocking streams: each finishes (device sync) before use. Poisoned
// so an output that is never written cannot pass.
struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) {
    if (cudaMalloc(&p, std::max<size_t>(bytes, 256)) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    cudaMemset(p, 0xEE, std::max<size_t>(bytes, 256));
    cudaDeviceSynchronize();
  }
  ~DevBuf() { cudaFree(p); }
  char* c() const { return static_cast<char*>(p); }
};

void upload(void* dev, const std::vector<uint8_t>& b) {
  if (b.empty()) return;
  ASSERT_EQ(cudaMemcpy(dev, b.data(), b.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // pageable H2D may return before the DMA lands
}

// A hung rank is killed well before the binary's budget runs out.
RunOptions bounded() {
  RunOptions o;
  o.timeout = Millis(50'000);
  return o;
}

class CudaCollGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpucheck::gpuUnavailableReason().empty()) GTEST_SKIP() << gpucheck::gpuUnavailableReason();
  }
};

const DataType kTypes[] = {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16, DataType::kFloat8E4M3,
                           DataType::kInt32};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg};
const size_t kCounts[] = {0, 1, 1001};

// Allreduce (one-shot, two-shot), reduce_scatter and reduce: every type x op x size,
// in place and out of place (`full`), or a subset (f32, bf16, fp8; sum, avg; odd size)
// to keep the 4-rank run short on a time-sliced GPU.
void reductions(RankEnv& env, bool full) {
  CUDA_OK(cudaSetDevice(0));
  auto comm = env.communicator();
  const int n = comm->size(), me = comm->rank();
  CudaCollectives cc(comm);
  ASSERT_EQ(cc.heapUnavailableReason(), "");
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int salt = 0;
  auto skip = [&](DataType t, ReduceOp op, size_t count) {
    if (full) return false;
    return t == DataType::kFloat16 || t == DataType::kInt32 || op == ReduceOp::kMax || count == 1;
  };
  for (DataType t : kTypes)
    for (ReduceOp op : kOps)
      for (size_t count : kCounts)
        for (bool inplace : {false, true}) {
          if (skip(t, op, count)) continue;
          const size_t es = elementSize(t), blk = count * es;
          // allreduce, both kernels
          for (const char* algo : {"oneshot", "twoshot"}) {
            ++salt;
            DevBuf in(blk), out(blk);
            upload(in.p, encodeInput(t, me, count, salt));
            CollOptions o;
            o.algorithm = algo;
            void* dst = inplace ? in.p : out.p;
            WorkPtr w = cc.allreduce(in.p, dst, count, t, op, s, o);
            EXPECT_NE(w->description().find(algo), std::string::npos) << w->description();
            w->wait(kWait());
            expectDevice(
                dst, t, count, [&](size_t i) { return reference(t, op, n, i, salt); },
                fmt::format("allreduce {} {} {} n={} inplace={}", algo, dataTypeName(t), reduceOpName(op),
                            count, inplace));
          }
          // reduce_scatter: rank r's block of the reduction of everyone's full buffers
          {
            ++salt;
            DevBuf in(blk * n), out(blk);
            upload(in.p, encodeInput(t, me, count * n, salt));
            void* dst = inplace ? in.c() + me * blk : out.p;
            cc.reduceScatter(in.p, dst, count, t, op, s)->wait(kWait());
            expectDevice(
                dst, t, count, [&](size_t i) { return reference(t, op, n, i, salt, me * count); },
                fmt::format("reduce_scatter {} {} n={} inplace={}", dataTypeName(t), reduceOpName(op), count,
                            inplace));
          }
          // reduce to the last rank
          {
            ++salt;
            const int root = n - 1;
            DevBuf in(blk), out(blk);
            upload(in.p, encodeInput(t, me, count, salt));
            void* dst = inplace ? in.p : out.p;
            cc.reduce(in.p, dst, count, t, op, root, s)->wait(kWait());
            if (me == root)
              expectDevice(
                  dst, t, count, [&](size_t i) { return reference(t, op, n, i, salt); },
                  fmt::format("reduce {} {} n={} inplace={}", dataTypeName(t), reduceOpName(op), count,
                              inplace));
          }
        }
  // A few MiB: the staging grows (collectively) and the kernels cover many blocks.
  for (DataType t : {DataType::kFloat32, DataType::kBFloat16})
    for (const char* algo : {"oneshot", "twoshot"}) {
      const size_t count = (3u << 20) / elementSize(t) + 3;  // 3 MiB and an odd tail
      ++salt;
      DevBuf in(count * elementSize(t)), out(count * elementSize(t));
      upload(in.p, encodeInput(t, me, count, salt));
      CollOptions o;
      o.algorithm = algo;
      cc.allreduce(in.p, out.p, count, t, ReduceOp::kSum, s, o)->wait(kWait());
      expectDevice(
          out.p, t, count, [&](size_t i) { return reference(t, ReduceOp::kSum, n, i, salt); },
          fmt::format("allreduce {} {} {} MiB", algo, dataTypeName(t), 3));
    }
  CUDA_OK(cudaStreamDestroy(s));
}

// Copy-engine collectives: allgather, alltoall, alltoallv, broadcast, gather, scatter.
void copies(RankEnv& env) {
  CUDA_OK(cudaSetDevice(0));
  auto comm = env.communicator();
  const int n = comm->size(), me = comm->rank();
  CudaCollectives cc(comm);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const DataType t = DataType::kInt32;  // exact: block r of rank q is inputValue(t, q, i, salt)
  int salt = 100;
  for (size_t count : {size_t{0}, size_t{1}, size_t{1001}, size_t{(1u << 20) / 4 + 1}})
    for (bool inplace : {false, true}) {
      const size_t blk = count * 4;
      const std::string tag = fmt::format("n={} inplace={}", count, inplace);
      {  // allgather
        ++salt;
        DevBuf in(blk), out(blk * n);
        void* src = inplace ? out.c() + me * blk : in.p;
        upload(src, encodeInput(t, me, count, salt));
        cc.allgather(src, out.p, count, t, s)->wait(kWait());
        expectDevice(
            out.p, t, count * n,
            [&](size_t i) {
              return inputValue(t, int(i / std::max<size_t>(count, 1)), i % std::max<size_t>(count, 1), salt);
            },
            "allgather " + tag);
      }
      {  // alltoall: block r of rank q's send = values of (q, offset r*count)
        ++salt;
        DevBuf in(blk * n), out(blk * n);
        upload(in.p, encodeInput(t, me, count * n, salt));
        void* dst = inplace ? in.p : out.p;
        cc.alltoall(in.p, dst, count, t, s)->wait(kWait());
        expectDevice(
            dst, t, count * n,
            [&](size_t i) {
              const size_t c = std::max<size_t>(count, 1);
              return inputValue(t, int(i / c), me * count + i % c, salt);
            },
            "alltoall " + tag);
      }
      {  // broadcast from rank 1 % n
        ++salt;
        const int root = 1 % n;
        DevBuf buf(blk);
        upload(buf.p, encodeInput(t, me == root ? root : me + 50, count, salt));
        cc.broadcast(buf.p, count, t, root, s)->wait(kWait());
        expectDevice(
            buf.p, t, count, [&](size_t i) { return inputValue(t, root, i, salt); }, "broadcast " + tag);
      }
      {  // gather to rank 0, scatter from rank n-1
        ++salt;
        DevBuf in(blk), out(blk * n);
        void* src = inplace && me == 0 ? out.p : in.p;
        upload(src, encodeInput(t, me, count, salt));
        cc.gather(src, out.p, count, 0, t, s)->wait(kWait());
        if (me == 0)
          expectDevice(
              out.p, t, count * n,
              [&](size_t i) {
                const size_t c = std::max<size_t>(count, 1);
                return inputValue(t, int(i / c), i % c, salt);
              },
              "gather " + tag);
        ++salt;
        const int root = n - 1;
        DevBuf sin(blk * n), sout(blk);
        if (me == root) upload(sin.p, encodeInput(t, root, count * n, salt));
        void* dst = inplace && me == root ? sin.c() + root * blk : sout.p;
        cc.scatter(sin.p, dst, count, root, t, s)->wait(kWait());
        expectDevice(
            dst, t, count, [&](size_t i) { return inputValue(t, root, me * count + i, salt); },
            "scatter " + tag);
      }
    }
  {  // alltoallv: rank q sends (q + r) % 3 + r elements to rank r, packed in rank order
    ++salt;
    std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
    size_t st = 0, rt = 0;
    for (int r = 0; r < n; ++r) {
      sc[r] = (me + r) % 3 + r;
      sd[r] = st;
      st += sc[r];
      rc[r] = (r + me) % 3 + me;
      rd[r] = rt + 1;  // a gap before each block
      rt += rc[r] + 1;
    }
    DevBuf in(st * 4), out((rt + 1) * 4);
    upload(in.p, encodeInput(t, me, st, salt));
    cc.alltoallv(in.p, sc, sd, out.p, rc, rd, t, s)->wait(kWait());
    for (int r = 0; r < n; ++r) {
      size_t their_displ = 0;  // rank r's displacement of its block to me
      for (int q = 0; q < me; ++q) their_displ += (r + q) % 3 + q;
      expectDevice(
          out.c() + rd[r] * 4, t, rc[r], [&](size_t i) { return inputValue(t, r, their_displ + i, salt); },
          fmt::format("alltoallv block from {}", r));
    }
  }
  cc.barrier(s)->wait(kWait());
  CUDA_OK(cudaStreamDestroy(s));
}

// Many operations back to back on one stream, no host wait in between; then symmetric
// buffers used in place, and the host Collectives routing device pointers.
void pipelineAndSymmetric(RankEnv& env) {
  CUDA_OK(cudaSetDevice(0));
  auto comm = env.communicator();
  const int n = comm->size(), me = comm->rank();
  CudaCollectives cc(comm);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const DataType t = DataType::kFloat32;
  const int kOps = 48;
  const size_t count = 4099;
  std::vector<std::unique_ptr<DevBuf>> ins, outs;
  for (int k = 0; k < kOps; ++k) {  // all setup first: no device sync between the operations
    ins.push_back(std::make_unique<DevBuf>(count * 4 * n));
    outs.push_back(std::make_unique<DevBuf>(count * 4 * n));
    upload(ins.back()->p, encodeInput(t, me, count * n, 1000 + k));
  }
  WorkPtr last;
  for (int k = 0; k < kOps; ++k) {
    CollOptions o;
    switch (k % 4) {
      case 0:
        o.algorithm = "oneshot";
        last = cc.allreduce(ins[k]->p, outs[k]->p, count, t, ReduceOp::kSum, s, o);
        break;
      case 1:
        o.algorithm = "twoshot";
        last = cc.allreduce(ins[k]->p, outs[k]->p, count, t, ReduceOp::kSum, s, o);
        break;
      case 2:
        last = cc.allgather(ins[k]->p, outs[k]->p, count, t, s);
        break;
      default:
        last = cc.reduceScatter(ins[k]->p, outs[k]->p, count, t, ReduceOp::kSum, s);
        break;
    }
  }
  last->wait(kWait());
  for (int k = 0; k < kOps; ++k) {
    const int salt = 1000 + k;
    const std::string what = fmt::format("back-to-back op {}", k);
    if (k % 4 < 2)
      expectDevice(
          outs[k]->p, t, count, [&](size_t i) { return reference(t, ReduceOp::kSum, n, i, salt); }, what);
    else if (k % 4 == 2)
      expectDevice(
          outs[k]->p, t, count * n, [&](size_t i) { return inputValue(t, int(i / count), i % count, salt); },
          what);
    else
      expectDevice(
          outs[k]->p, t, count,
          [&](size_t i) { return reference(t, ReduceOp::kSum, n, i, salt, me * count); }, what);
  }
  // Symmetric buffers: inputs used in place (no staging copy), in-place outputs too.
  auto sym = cc.allocateSymmetric(count * 4 * n);
  for (const char* algo : {"oneshot", "twoshot"}) {
    const int salt = 2000;
    upload(sym->localPtr(), encodeInput(t, me, count, salt));
    CollOptions o;
    o.algorithm = algo;
    cc.allreduce(sym->localPtr(), sym->localPtr(), count, t, ReduceOp::kSum, s, o)->wait(kWait());
    expectDevice(
        sym->localPtr(), t, count, [&](size_t i) { return reference(t, ReduceOp::kSum, n, i, salt); },
        fmt::format("symmetric in-place allreduce {}", algo));
  }
  {
    const int salt = 2001;
    upload(sym->localPtr(), encodeInput(t, me, count * n, salt));
    cc.alltoall(sym->localPtr(), sym->localPtr(), count, t, s)->wait(kWait());
    expectDevice(
        sym->localPtr(), t, count * n,
        [&](size_t i) { return inputValue(t, int(i / count), me * count + i % count, salt); },
        "symmetric in-place alltoall");
    DevBuf out(count * 4 * n);
    upload(sym->localPtr(), encodeInput(t, me, count, salt));
    cc.allgather(sym->localPtr(), out.p, count, t, s)->wait(kWait());
    expectDevice(
        out.p, t, count * n, [&](size_t i) { return inputValue(t, int(i / count), i % count, salt); },
        "allgather from a symmetric buffer");
  }
  // The host front end routes device pointers to the CUDA path (on the caller's stream).
  {
    Collectives host(comm);
    DevBuf in(count * 4), out(count * 4);
    upload(in.p, encodeInput(t, me, count, 3000));
    CollOptions o;
    o.cuda_stream = s;
    WorkPtr w = host.allreduce(in.p, out.p, count, t, ReduceOp::kSum, o);
    EXPECT_NE(w->description().find("cuda"), std::string::npos) << w->description();
    w->wait(kWait());
    expectDevice(
        out.p, t, count, [&](size_t i) { return reference(t, ReduceOp::kSum, n, i, 3000); },
        "host Collectives with device pointers");
  }
  sym.reset();
  CUDA_OK(cudaStreamDestroy(s));
}

TEST_F(CudaCollGpu, ReductionsTwoRanks) {
  runRanks(
      2, [](RankEnv& env) { reductions(env, true); }, bounded());
}
TEST_F(CudaCollGpu, ReductionsFourRanks) {
  runRanks(
      4, [](RankEnv& env) { reductions(env, false); }, bounded());
}
TEST_F(CudaCollGpu, CopyEngineTwoRanks) {
  runRanks(2, copies, bounded());
}
TEST_F(CudaCollGpu, CopyEngineFourRanks) {
  runRanks(4, copies, bounded());
}
TEST_F(CudaCollGpu, PipelineAndSymmetricFourRanks) {
  runRanks(4, pipelineAndSymmetric, bounded());
}

// Mismatched calls (CROSSBAR_CHECK_CALLS=cheap, the default): the host compares every
// collective's signature before anything is enqueued, so a rank that calls something
// else gets InvalidUsage on every rank, naming it, instead of a stream waiting forever on
// signals (or kernels reading the wrong extents). Nothing reaches the caller's stream,
// and the CudaCollectives stays usable. Rank 1 is the odd one out.
void mismatchedCalls(RankEnv& env) {
  CUDA_OK(cudaSetDevice(0));
  auto comm = env.communicator();
  const int n = comm->size(), me = comm->rank(), odd = 1;
  CudaCollectives cc(comm);
  ASSERT_EQ(cc.heapUnavailableReason(), "");
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const DataType t = DataType::kFloat32;
  const size_t count = 1024;
  DevBuf in(count * 4 * n), out(count * 4 * n);
  upload(in.p, encodeInput(t, me, count * n, 11));
  auto refused = [&](const char* name, const std::function<WorkPtr()>& issue, const std::string& needle,
                     std::vector<int> peers) {
    SCOPED_TRACE(fmt::format("rank {}: {}", me, name));
    const auto t0 = std::chrono::steady_clock::now();
    try {
      WorkPtr w = issue();
      w->wait(kWait());
      ADD_FAILURE() << "no error";
    } catch (const InvalidUsage& e) {
      const std::string text = e.what();
      EXPECT_EQ(e.peers(), peers) << text;
      EXPECT_NE(text.find(needle), std::string::npos) << text;
      EXPECT_NE(text.find("Nothing of this call was enqueued on any rank"), std::string::npos) << text;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "wrong error: " << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10)) << "detected, not timed out";
    EXPECT_EQ(cudaStreamQuery(s), cudaSuccess) << "nothing may reach the caller's stream";
  };
  const auto sum = ReduceOp::kSum;
  refused(
      "count", [&] { return cc.allreduce(in.p, out.p, me == odd ? 100 : 64, t, sum, s); },
      "rank 1 called allreduce of 100 x float sum (collective #0) (count 100 vs 64)", {odd});
  refused(
      "op",
      [&] { return cc.reduceScatter(in.p, out.p, 8, t, me == odd ? ReduceOp::kMax : sum, s); },
      "op max vs sum", {odd});
  refused(
      "root", [&] { return cc.broadcast(in.p, 8, t, me == odd ? 1 : 0, s); }, "root 1 vs 0", {odd});
  refused(
      "order", [&] { return me == odd ? cc.barrier(s) : cc.allgather(in.p, out.p, 8, t, s); },
      "collective barrier vs allgather", {odd});
  // alltoallv: rank 0 sends 3 elements to rank 1, which expects 2 (the heap algorithm's
  // own exchange would see it on rank 1 only; the check stops every rank).
  {
    std::vector<size_t> sc(n, 2), rc(n, 2), displ(n);
    for (int r = 0; r < n; ++r) displ[r] = 4 * r;
    if (me == 0) sc[odd] = 3;
    refused(
        "alltoallv", [&] { return cc.alltoallv(in.p, sc, displ, out.p, rc, displ, t, s); },
        "rank 0 sends 3 elements to rank 1, which expects 2", {0, odd});
  }
  // Still usable: a matching allreduce is right.
  cc.allreduce(in.p, out.p, count, t, sum, s)->wait(kWait());
  expectDevice(
      out.p, t, count, [&](size_t i) { return reference(t, sum, n, i, 11); }, "allreduce after the mismatches");
  // The host front end's device-pointer route is checked the same way.
  {
    Collectives host(comm);
    CollOptions o;
    o.cuda_stream = s;
    refused(
        "routed", [&] { return host.allgather(in.p, out.p, me == odd ? 3 : 4, t, o); }, "count 3 vs 4", {odd});
    host.allreduce(in.p, out.p, count, t, sum, o)->wait(kWait());
    expectDevice(
        out.p, t, count, [&](size_t i) { return reference(t, sum, n, i, 11); }, "routed allreduce after it");
  }
  CUDA_OK(cudaStreamDestroy(s));
}

TEST_F(CudaCollGpu, MismatchedCallsRaiseBeforeEnqueueTwoRanks) {
  runRanks(2, mismatchedCalls, bounded());
}
TEST_F(CudaCollGpu, MismatchedCallsRaiseBeforeEnqueueFourRanks) {
  runRanks(4, mismatchedCalls, bounded());
}

// Telemetry: with the recorder on, every CudaCollectives call (a group: one record)
// yields a record whose start/end come from CUDA events on the internal stream, read
// back without blocking (at Work completion, or by Recorder::step() for work the caller
// synchronized itself). Off, nothing is recorded. A rank that issues an allreduce 300 ms
// late shows as >= 100 ms of GPU wait (the stream waiting on its signal) on the others.
void telemetryRecords(RankEnv& env) {
  CUDA_OK(cudaSetDevice(0));
  auto comm = env.communicator();
  const int n = comm->size(), me = comm->rank();
  auto& rec = telemetry::Recorder::instance();
  telemetry::Config tc;
  tc.rank = me;
  tc.world_size = n;
  tc.enabled = false;
  rec.configure(tc);
  CudaCollectives cc(comm);
  ASSERT_EQ(cc.heapUnavailableReason(), "");
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t count = 1 << 16;
  DevBuf in(count * 4 * n), out(count * 4 * n);
  cc.allreduce(in.p, out.p, count, DataType::kFloat32, ReduceOp::kSum, s)->wait(kWait());  // off

  tc.enabled = true;
  rec.configure(tc);
  const int64_t t0 = telemetry::nowNs();
  CollOptions oneshot;
  oneshot.algorithm = "oneshot";
  cc.allreduce(in.p, out.p, count, DataType::kFloat32, ReduceOp::kSum, s, oneshot)->wait(kWait());
  cc.groupStart();
  cc.allreduce(in.p, out.p, count, DataType::kFloat32, ReduceOp::kSum, s);
  cc.allgather(in.p, out.p, count, DataType::kFloat32, s);
  cc.groupEnd()->wait(kWait());
  cc.barrier(s)->wait(kWait());
  if (me == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  cc.allreduce(in.p, out.p, count, DataType::kFloat32, ReduceOp::kSum, s, oneshot)->wait(kWait());
  cc.allgather(in.p, out.p, count, DataType::kFloat32, s);
  CUDA_OK(cudaStreamSynchronize(s));  // not through the Work: only step()'s flush hook finds it
  const int64_t t1 = telemetry::nowNs();
  telemetry::StepSummary sum = rec.step();
  std::vector<telemetry::Record> r = rec.lastStepRecords();
  std::sort(r.begin(), r.end(), [](const auto& a, const auto& b) { return a.seq < b.seq; });
  EXPECT_EQ(sum.dropped, 0u);
  ASSERT_EQ(r.size(), 5u) << "one record per call, the group as one, none while off";
  const char* names[] = {"allreduce", "group", "barrier", "allreduce", "allgather"};
  CollArgs ar;
  ar.coll = CollType::kAllreduce;
  ar.count = count;
  ar.type = DataType::kFloat32;
  for (size_t i = 0; i < r.size(); ++i) {
    SCOPED_TRACE(fmt::format("rank {} record {} ({})", me, i, r[i].name));
    EXPECT_STREQ(r[i].name, names[i]);
    EXPECT_NE(r[i].algo[0], 0);
    EXPECT_LE(t0, r[i].enqueue_ns);
    EXPECT_LE(r[i].enqueue_ns, r[i].start_ns);
    EXPECT_LE(r[i].start_ns, r[i].end_ns);
    EXPECT_LE(r[i].end_ns, t1 + 5'000'000) << "GPU end after the host saw it complete";
    EXPECT_LT(r[i].end_ns - r[i].start_ns, 10'000'000'000LL);
    EXPECT_GE(r[i].wait_ns, 0);
    EXPECT_LE(r[i].wait_ns, r[i].end_ns - r[i].start_ns);
    EXPECT_EQ(r[i].last_peer, -1);  // not known on the GPU path
  }
  EXPECT_STREQ(r[0].algo, "oneshot");
  EXPECT_EQ(r[0].bytes, ar.selectionBytes(n));
  EXPECT_GT(r[0].end_ns - r[0].start_ns, 0);
  EXPECT_EQ(r[1].op_seq, -1);  // a group, as the host collectives
  EXPECT_LT(r[0].op_seq, r[2].op_seq);
  EXPECT_LT(r[2].op_seq, r[3].op_seq);
  EXPECT_LT(r[3].op_seq, r[4].op_seq);
  // Rank 1 came 300 ms late. With the call check on (the default) its peers' hosts wait
  // for it in the check, before the call enqueues anything: the lateness shows between
  // enqueue and start. Off, the call is enqueued at once and the stream waits.
  if (me != 1 && callCheckModeFromEnv() != CallCheckMode::kOff)
    EXPECT_GE(r[3].start_ns - r[3].enqueue_ns, 100'000'000) << "the call check waited for rank 1";
  else if (me != 1)
    EXPECT_GE(r[3].wait_ns, 100'000'000) << "the stream waited for rank 1's signal";
  else
    EXPECT_LT(r[3].wait_ns, 150'000'000) << "rank 1 came last: its peers were there";
  EXPECT_EQ(sum.ops, 5u);
  rec.configure(telemetry::Config{});
  CUDA_OK(cudaStreamDestroy(s));
}

TEST_F(CudaCollGpu, TelemetryRecordsTwoRanks) {
  runRanks(2, telemetryRecords, bounded());
}
TEST_F(CudaCollGpu, TelemetryRecordsTwoRanksCheckOff) {
  RunOptions o = bounded();
  o.env["CROSSBAR_CHECK_CALLS"] = "off";
  runRanks(2, telemetryRecords, o);
}

// NCCL with one rank (NCCL allows one rank per GPU): every collective forced to NCCL,
// a symmetric buffer registered as a window, and the heap switched off entirely.
TEST_F(CudaCollGpu, NcclSingleRank) {
  runRanks(
      1,
      [](RankEnv& env) {
        CUDA_OK(cudaSetDevice(0));
        auto comm = env.communicator();
        CudaCollectivesOptions opt;
        opt.symmetric_heap = false;  // selection falls back to NCCL for every call
        CudaCollectives cc(comm, opt);
        EXPECT_NE(cc.heapUnavailableReason(), "");
        cudaStream_t s;
        CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        const size_t count = 1001;
        for (DataType t :
             {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat8E4M3, DataType::kInt32}) {
          DevBuf in(count * 4), out(count * 4);
          upload(in.p, encodeInput(t, 0, count, 7));
          WorkPtr w = cc.allreduce(in.p, out.p, count, t, ReduceOp::kSum, s);
          EXPECT_NE(w->description().find("nccl"), std::string::npos) << w->description();
          w->wait(kWait());
          expectDevice(
              out.p, t, count, [&](size_t i) { return reference(t, ReduceOp::kSum, 1, i, 7); },
              std::string("nccl allreduce ") + dataTypeName(t));
          cc.allgather(in.p, out.p, count, t, s)->wait(kWait());
          expectDevice(
              out.p, t, count, [&](size_t i) { return inputValue(t, 0, i, 7); },
              std::string("nccl allgather ") + dataTypeName(t));
        }
        EXPECT_TRUE(cc.ncclCreated());
        const DataType t = DataType::kFloat32;
        DevBuf in(count * 4), out(count * 4);
        upload(in.p, encodeInput(t, 0, count, 8));
        CollOptions pm;
        pm.premul_scalar = 2.0;
        cc.allreduce(in.p, out.p, count, t, ReduceOp::kPreMulSum, s, pm)->wait(kWait());
        expectDevice(
            out.p, t, count, [&](size_t i) { return 2.0 * inputValue(t, 0, i, 8); }, "nccl premulsum");
        cc.alltoallv(in.p, {5}, {2}, out.p, {5}, {0}, t, s)->wait(kWait());
        expectDevice(
            out.p, t, 5, [&](size_t i) { return inputValue(t, 0, i + 2, 8); }, "nccl alltoallv");
        cc.broadcast(in.p, count, t, 0, s)->wait(kWait());
        cc.reduceScatter(in.p, out.p, count, t, ReduceOp::kMax, s)->wait(kWait());
        expectDevice(
            out.p, t, count, [&](size_t i) { return inputValue(t, 0, i, 8); }, "nccl reduce_scatter");
        cc.barrier(s)->wait(kWait());
        CUDA_OK(cudaStreamDestroy(s));

        // With the heap on: a symmetric buffer becomes an NCCL window (CTA policy zero).
        CudaCollectives cc2(comm);
        cudaStream_t s2;
        CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
        CollOptions o;
        o.algorithm = "nccl";
        cc2.barrier(s2, o)->wait(kWait());  // creates NCCL
        auto sym = cc2.allocateSymmetric(count * 4);
        upload(sym->localPtr(), encodeInput(t, 0, count, 9));
        cc2.allreduce(sym->localPtr(), sym->localPtr(), count, t, ReduceOp::kSum, s2, o)->wait(kWait());
        expectDevice(
            sym->localPtr(), t, count, [&](size_t i) { return inputValue(t, 0, i, 9); },
            "nccl allreduce on a window");
        sym.reset();
        CUDA_OK(cudaStreamDestroy(s2));
      },
      bounded());
}

// NCCL refuses two ranks on one GPU: the error must say so (if a future NCCL accepts
// it, the result must simply be right).
TEST_F(CudaCollGpu, NcclTwoRanksOnOneGpuFailsClearly) {
  runRanks(
      2,
      [](RankEnv& env) {
        CUDA_OK(cudaSetDevice(0));
        CommOptions co;
        co.timeout = Millis(10'000);
        auto comm = env.communicator(co);
        CudaCollectives cc(comm);
        cudaStream_t s;
        CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        DevBuf in(64), out(64);
        upload(in.p, encodeInput(DataType::kFloat32, comm->rank(), 16, 1));
        CollOptions o;
        o.algorithm = "nccl";
        try {
          cc.allreduce(in.p, out.p, 16, DataType::kFloat32, ReduceOp::kSum, s, o)->wait(kWait());
          expectDevice(
              out.p, DataType::kFloat32, 16,
              [&](size_t i) { return reference(DataType::kFloat32, ReduceOp::kSum, 2, i, 1); },
              "nccl 2 ranks");
        } catch (const NcclError& e) {
          EXPECT_NE(std::string(e.what()).find("one rank per GPU"), std::string::npos) << e.what();
          // The heap algorithms keep working after NCCL failed to come up.
          cc.allreduce(in.p, out.p, 16, DataType::kFloat32, ReduceOp::kSum, s)->wait(kWait());
          expectDevice(
              out.p, DataType::kFloat32, 16,
              [&](size_t i) { return reference(DataType::kFloat32, ReduceOp::kSum, 2, i, 1); },
              "heap allreduce after NCCL failed");
        }
        CUDA_OK(cudaStreamDestroy(s));
      },
      bounded());
}

}  // namespace
}  // namespace crossbar
