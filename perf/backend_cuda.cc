// CUDA-memory backend of the perf driver (--mem cuda): device buffers (cudaMalloc, or
// the CUDA collectives' symmetric heap with -R 2), verifiable data generated on the host
// and copied, the stream-ordered CUDA collectives on one stream per rank, and CUDA
// events on that stream for per-iteration timing (-I), as nccl-tests times.
// Several ranks may share one GPU (device = local rank modulo the visible devices).
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <map>
#include <thread>

#include "collectives/cuda/cuda_collectives.h"
#include "comm/communicator.h"
#include "comm/errors.h"
#include "perf/backend.h"

namespace crossbar::perf {
namespace {

void check(cudaError_t e, const char* what, int rank) {
  if (e != cudaSuccess)
    throw CudaError(fmt::format("perf: rank {} on {}: {} failed: {} ({})", rank, hostName(), what,
                                cudaGetErrorString(e), cudaGetErrorName(e)));
}

class CudaBackend : public RunBackend {
 public:
  CudaBackend(std::shared_ptr<Communicator> comm, const Options& o) : rank_(comm->rank()), o_(o) {
    int count = 0;
    check(cudaGetDeviceCount(&count), "cudaGetDeviceCount", rank_);
    if (count <= 0) throw InvalidUsage(fmt::format("perf: rank {}: --mem cuda but no CUDA device", rank_));
    device_ = comm->localRank() % count;
    check(cudaSetDevice(device_), "cudaSetDevice", rank_);
    if (o.stream_null) {
      stream_ = cudaStreamLegacy;
    } else {
      check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate", rank_);
      own_stream_ = true;
    }
    // The CUDA collectives run over their own communicator (dup): the driver keeps the
    // host Collectives on `comm` for its time and #wrong reductions.
    CudaCollectivesOptions co;
    co.device = device_;
    if (o.timeout_s > 0) co.timeout = Millis(int64_t{o.timeout_s} * 1000);
    cc_ = std::make_unique<CudaCollectives>(comm->dup(), co);
    timeout_ = o.timeout_s > 0 ? Millis(int64_t{o.timeout_s} * 1000) : comm->timeout();
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties", rank_);
    description_ =
        fmt::format("{:2} [{:04x}:{:02x}:{:02x}] {}, local rank {}/{}", device_, prop.pciDomainID,
                    prop.pciBusID, prop.pciDeviceID, prop.name, comm->localRank(), comm->localSize());
  }

  ~CudaBackend() override {
    // Bounded: everything was completed by the driver; a failed run leaves its errors to the caller.
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (done_) cudaEventDestroy(done_);
    if (staging_) cudaFree(staging_);
    symmetric_.clear();
    cc_.reset();
    if (own_stream_) cudaStreamDestroy(stream_);
  }

  const char* memoryName() const override { return "cuda"; }
  std::string deviceDescription() const override { return description_; }
  int deviceIndex() const override { return device_; }

  char* allocate(size_t bytes) override {
    bytes = (std::max<size_t>(bytes, 4096) + 4095) & ~size_t{4095};
    char* p = nullptr;
    if (o_.local_register == 2) {
      // -R 2 (nccl-tests: symmetric registration): a buffer of the collectives' CUDA heap,
      // used in place (no staging copy) and registered as an NCCL window.
      auto buffer = cc_->allocateSymmetric(bytes);
      p = static_cast<char*>(buffer->localPtr());
      symmetric_[p] = std::move(buffer);
    } else {
      check(cudaMalloc(reinterpret_cast<void**>(&p), bytes), "cudaMalloc", rank_);
    }
    check(cudaMemset(p, 0, bytes), "cudaMemset", rank_);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", rank_);
    return p;
  }
  void release(char* p) override {
    if (symmetric_.erase(p)) return;
    cudaFree(p);
  }
  void zero(void* dst, size_t bytes) override {
    check(cudaMemsetAsync(dst, 0, bytes, stream_), "cudaMemsetAsync", rank_);
    syncStream("cudaMemsetAsync");
  }
  void upload(void* dst, const void* host, size_t bytes) override {
    check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync H2D", rank_);
    syncStream("the input upload");
  }
  void download(void* host, const void* src, size_t bytes) override {
    check(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync D2H", rank_);
    syncStream("the result download");
  }
  bool hostAccessible() const override { return false; }

  void start(const CollTest& t, const RunArgs& a) override { last_ = issue(t.name, a); }

  void complete() override {
    // Every operation runs in order on stream_: the last one's completion covers all.
    if (last_) last_->wait(Deadline::after(timeout_));
    last_.reset();
    syncStream("the collectives");  // and the driver's own copies around them
  }

  void mark() override {
    if (marks_ == events_.size()) {
      cudaEvent_t e;
      check(cudaEventCreate(&e), "cudaEventCreate", rank_);
      events_.push_back(e);
    }
    check(cudaEventRecord(events_[marks_++], stream_), "cudaEventRecord", rank_);
  }
  std::vector<double> markTimes() override {
    std::vector<double> t;
    for (size_t i = 0; i < marks_; ++i) {
      float ms = 0;
      check(cudaEventSynchronize(events_[i]), "cudaEventSynchronize", rank_);
      check(cudaEventElapsedTime(&ms, events_[0], events_[i]), "cudaEventElapsedTime", rank_);
      t.push_back(ms * 1e-3);
    }
    marks_ = 0;
    return t;
  }
  const char* timingName() const override { return "CUDA event"; }

  int64_t memoryInUse() const override {
    size_t free_bytes = 0, total = 0;
    if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) return 0;
    return static_cast<int64_t>(total - free_bytes);  // the whole device's (shared by its ranks)
  }
  const char* memoryReportLabel() const override { return "GPU memory usage"; }

 private:
  WorkPtr issue(const std::string& name, const RunArgs& a) {
    const size_t es = elementSize(a.type);
    CudaCollectives& c = *cc_;
    if (name == "all_reduce") return c.allreduce(a.send, a.recv, a.count, a.type, a.op, stream_, a.options);
    if (name == "all_gather") return c.allgather(a.send, a.recv, a.count, a.type, stream_, a.options);
    if (name == "reduce_scatter")
      return c.reduceScatter(a.send, a.recv, a.count, a.type, a.op, stream_, a.options);
    if (name == "alltoall") return c.alltoall(a.send, a.recv, a.count, a.type, stream_, a.options);
    if (name == "broadcast") {
      // One buffer: out of place, the root's data starts in send (as the host path).
      if (a.send != a.recv && c.comm().rank() == a.root)
        check(cudaMemcpyAsync(a.recv, a.send, a.count * es, cudaMemcpyDeviceToDevice, stream_),
              "cudaMemcpyAsync D2D", rank_);
      return c.broadcast(a.recv, a.count, a.type, a.root, stream_, a.options);
    }
    if (name == "reduce") return c.reduce(a.send, a.recv, a.count, a.type, a.op, a.root, stream_, a.options);
    if (name == "gather") return c.gather(a.send, a.recv, a.count, a.root, a.type, stream_, a.options);
    if (name == "scatter") return c.scatter(a.send, a.recv, a.count, a.root, a.type, stream_, a.options);
    if (name == "sendrecv") {
      const int r = c.comm().rank(), n = c.comm().size();
      if (n == 1) {
        if (a.send != a.recv)
          check(cudaMemcpyAsync(a.recv, a.send, a.count * es, cudaMemcpyDeviceToDevice, stream_),
                "cudaMemcpyAsync D2D", rank_);
        return c.barrier(stream_, a.options);
      }
      // NCCL point to point; in place needs a staging buffer (send and receive overlap).
      void* dst = a.recv;
      if (a.send == a.recv) dst = staging(a.count * es);
      c.groupStart();
      c.send(a.send, a.count, a.type, (r + 1) % n, kTag, stream_, a.options);
      c.recv(dst, a.count, a.type, (r + n - 1) % n, kTag, stream_, a.options);
      WorkPtr w = c.groupEnd();
      if (dst != a.recv)
        check(cudaMemcpyAsync(a.recv, dst, a.count * es, cudaMemcpyDeviceToDevice, stream_),
              "cudaMemcpyAsync D2D", rank_);
      return w;
    }
    if (name == "hypercube") {
      const int r = c.comm().rank(), n = c.comm().size();
      const size_t block = a.count * es;
      char* recv = static_cast<char*>(a.recv);
      if (recv + r * block != a.send)
        check(cudaMemcpyAsync(recv + r * block, a.send, block, cudaMemcpyDeviceToDevice, stream_),
              "cudaMemcpyAsync D2D", rank_);
      WorkPtr last;
      for (int mask = 1; mask < n; mask <<= 1) {
        const int mine = r & ~(mask - 1), theirs = mine ^ mask;
        c.groupStart();
        c.send(recv + mine * block, a.count * mask, a.type, r ^ mask, kTag + 1, stream_, a.options);
        c.recv(recv + theirs * block, a.count * mask, a.type, r ^ mask, kTag + 1, stream_, a.options);
        last = c.groupEnd();
      }
      return last ? last : c.barrier(stream_, a.options);
    }
    throw InvalidUsage(fmt::format("perf: {} has no --mem cuda implementation", name));
  }

  // Waits for everything queued on stream_, polling an event so the wait has a deadline.
  void syncStream(const char* what) {
    if (!done_) check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate", rank_);
    check(cudaEventRecord(done_, stream_), "cudaEventRecord", rank_);
    const Deadline deadline = Deadline::after(timeout_);
    for (int spins = 0;; ++spins) {
      const cudaError_t e = cudaEventQuery(done_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) check(e, "cudaEventQuery", rank_);
      if (deadline.expired())
        throw Timeout(
            fmt::format("perf: rank {} on {}: {} did not finish on the GPU within {} ms; a peer may "
                        "have failed (see its output) or the GPU is hung",
                        rank_, hostName(), what, timeout_.count()));
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void* staging(size_t bytes) {
    if (bytes > staging_bytes_) {
      if (staging_) cudaFree(staging_);
      staging_ = nullptr;
      check(cudaMalloc(&staging_, bytes), "cudaMalloc (sendrecv staging)", rank_);
      staging_bytes_ = bytes;
    }
    return staging_;
  }

  static constexpr uint32_t kTag = 0x7E57;
  int rank_ = 0;
  const Options& o_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  bool own_stream_ = false;
  std::unique_ptr<CudaCollectives> cc_;
  Millis timeout_{0};
  std::string description_;
  std::map<char*, std::shared_ptr<symm::SymmetricBuffer>> symmetric_;
  WorkPtr last_;
  std::vector<cudaEvent_t> events_;
  cudaEvent_t done_ = nullptr;
  size_t marks_ = 0;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
};

}  // namespace

std::unique_ptr<RunBackend> makeCudaBackend(std::shared_ptr<Communicator> comm, const Options& o) {
  return std::make_unique<CudaBackend>(std::move(comm), o);
}

std::string cudaUnavailableReason() {
  // In a child: initializing CUDA here would make it unusable in the ranks forked later.
  int fds[2];
  if (pipe(fds) != 0) return fmt::format("cannot probe CUDA (pipe: {})", std::strerror(errno));
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return fmt::format("cannot probe CUDA (fork: {})", std::strerror(errno));
  }
  if (pid == 0) {
    close(fds[0]);
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    std::string reason;
    if (e != cudaSuccess) {
      reason = fmt::format("no usable CUDA device (cudaGetDeviceCount: {}: {})", cudaGetErrorName(e),
                           cudaGetErrorString(e));
    } else if (count == 0) {
      reason = "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)";
    }
    const ssize_t n = write(fds[1], reason.data(), reason.size());
    (void)n;
    _exit(0);
  }
  close(fds[1]);
  std::string reason;
  char buf[512];
  pollfd p{fds[0], POLLIN, 0};
  bool timed_out = true;
  // The driver's first initialization can take seconds; 60 s bounds a wedged one.
  while (poll(&p, 1, 60000) > 0) {
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n <= 0) {
      timed_out = false;  // EOF: the child is exiting
      break;
    }
    reason.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  if (timed_out) {
    kill(pid, SIGKILL);
    reason = "the CUDA probe did not finish within 60 s (driver hung?)";
  }
  waitpid(pid, &status, 0);
  if (reason.empty() && !(WIFEXITED(status) && WEXITSTATUS(status) == 0))
    reason = "the CUDA probe process crashed (driver or runtime broken?)";
  return reason;
}

}  // namespace crossbar::perf
