// crossbar as a torch.distributed backend: a c10d::Backend over crossbar's Collectives
// (collective ops on CPU tensors, in issue order), Communicator (point to point, truly
// nonblocking like gloo's) and, in CUDA builds, CudaCollectives for CUDA tensors
// (stream-ordered on torch's current stream, like ProcessGroupNCCL).
//
// This header stays free of CUDA headers (module.cc and the bind_*.cc files include it);
// CUDA types appear as opaque pointers, used only in backend.cc.
//
// Built against several torch versions: methods that not every supported version
// declares are written without `override` (they override where the base has them and
// are plain members elsewhere), and types that are version-specific are guarded.
#pragma once

#include <torch/version.h>

// CROSSBAR_TORCH_CUDA: CUDA tensors run on CudaCollectives. CMake sets it (0 or 1: a CUDA
// build against a torch with libc10_cuda); builds without CMake (perf/gpu/build_torch_ext.sh)
// get it from the prebuilt libraries' CUDA collectives and torch's CUDA headers, and must
// then link libc10_cuda.
#ifndef CROSSBAR_TORCH_CUDA
#if defined(CROSSBAR_HAVE_CUDA_COLLECTIVES) && __has_include(<c10/cuda/CUDAStream.h>) && \
    __has_include(<cuda_runtime_api.h>)
#define CROSSBAR_TORCH_CUDA 1
#else
#define CROSSBAR_TORCH_CUDA 0
#endif
#endif

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "collectives/collectives.h"
#include "comm/communicator.h"
#include "comm/store.h"
#include "torch_backend/p2p_announce.h"

#define CROSSBAR_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace crossbar {
class CudaCollectives;
}

namespace crossbar::torch_backend {

// crossbar::Store over torch's c10d::Store (what init_process_group hands a backend),
// so the Communicator rendezvous through torch's TCPStore/FileStore/PrefixStore.
class TorchStoreAdapter : public crossbar::Store {
 public:
  explicit TorchStoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Deadline deadline) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Deadline deadline) override;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;
  using crossbar::Store::get;
  using crossbar::Store::set;
  using crossbar::Store::wait;

 private:
  // Parked requests (get, wait) run on a clone of the store (for a TCPStore: its own
  // connection), one per thread parked at once, up to kMaxWaiters: torch's TCPStore client
  // runs one request at a time, so a thread's parked wait would hold up the set that
  // another thread of this process owes a peer (threads splitting communicators at once
  // waited on each other across processes that way; crossbar's own TcpStore pools too).
  // Beyond the limit, or when the store cannot be cloned, the store itself.
  static constexpr int kMaxWaiters = 8;
  struct Waiter;
  c10::intrusive_ptr<c10d::Store> leaseWaiter();
  void returnWaiter(c10::intrusive_ptr<c10d::Store> s);

  c10::intrusive_ptr<c10d::Store> store_;
  std::mutex pool_m_;
  std::vector<c10::intrusive_ptr<c10d::Store>> idle_;  // clones not in use
  int clones_ = 0;                                     // clones made (idle or leased)
  bool cannot_clone_ = false;
};

// Wakes the backend's completion or point-to-point thread (CrossbarBackend::completionLoop,
// p2pLoop). Shared with the works it watches, since a work (and its getFuture()) may
// outlive its backend.
struct CompletionBell {
  std::mutex m;
  std::condition_variable cv;
  std::atomic<bool> rung{false};  // (read without `m` by a thread that polls it while busy)
  bool asleep = false;            // the thread waits without a timeout: only a ring wakes it
  void ring() {
    {
      std::lock_guard<std::mutex> lk(m);
      rung = true;
    }
    cv.notify_one();
  }
  void ringIfAsleep() {
    {
      std::lock_guard<std::mutex> lk(m);
      if (!asleep) return;
      rung = true;
    }
    cv.notify_one();
  }
};

// A torch Work over a crossbar Work (collectives) or Requests (point to point). Completes
// asynchronously: the backend's completion threads (or a wait()) finish it, which runs
// the post-processing (copies back into non-contiguous or listed outputs) and marks the
// future, so DDP communication hooks chain on getFuture().
class CrossbarWork : public c10d::Work {
 public:
  // `devices`: the CUDA device of a CUDA work (its future then synchronizes with streams).
  CrossbarWork(int rank, c10d::OpType type, const char* profiling_title, std::vector<at::Tensor> outputs,
               Millis timeout, std::vector<c10::Device> devices = {});
  ~CrossbarWork() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override { return source_rank_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  // CUDA: the current stream waits for the operation (the host does not block).
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void abort() override;
  // A queued host work's future is completed by the completion or point-to-point thread,
  // which this wakes (it leaves a work alone for a while otherwise: see completionLoop).
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::chrono::milliseconds getTimeout() const { return timeout_; }

  // --- for the backend ---
  // True when the underlying operation finished; *err gets its failure.
  bool underlyingDone(std::exception_ptr* err);
  // Blocks until the underlying operation finished or `deadline`; false on deadline.
  bool waitUnderlying(Deadline deadline, std::exception_ptr* err);
  // Runs post-processing once, records the result and marks the future.
  void complete(std::exception_ptr err);
  // Withdraws its (and its parts') receives no message matched yet (Request::cancel),
  // failing them with `err`: their buffers are free, later messages go to later receives.
  void cancelReceives(const std::exception_ptr& err);

  WorkPtr coll;                       // collectives
  std::vector<RequestPtr> requests;   // point to point
  std::function<void()> post;         // after success: copy results into the user's tensors
  std::vector<at::Tensor> keepalive;  // staging buffers the operation reads or writes
  std::vector<c10::intrusive_ptr<CrossbarWork>> children;  // a coalesced group's parts
  int source_rank_ = -1;
  Deadline deadline = Deadline::never();  // point to point: when the completion thread gives up
  // Host works queued for the completion or p2p thread: when, and its bell for getFuture().
  Clock::time_point queued_at{};
  std::shared_ptr<CompletionBell> bell;
  std::atomic<bool> future_wanted{false};
  bool completedFlag() const {
    std::lock_guard<std::mutex> lk(mutex_);
    return completed_;
  }

  // CUDA works: the operation is enqueued on the caller's current stream of `cuda_device`
  // and `cuda_end` (a cudaEvent_t) recorded there after it; the future completes at once
  // (CUDA-aware: consumers' streams wait for the event), the completion thread only
  // watches for errors and timeouts.
  std::shared_ptr<void> cuda_end;
  int cuda_device = -1;
  bool isCuda() const { return cuda_end != nullptr || cuda_device >= 0; }

  // CUDA point to point through host memory (CrossbarBackend::stagedSend/stagedRecv):
  // driven by the point-to-point thread like host works. `start` posts the host send
  // once the device-to-host copy (`start_after`, a cudaEvent_t) passed; `enqueue` puts
  // the receive's stream part (wait for the data, host-to-device copy) on the stream at
  // launch; `on_finish` runs at completion, success or not (releases that stream wait).
  bool staged = false;
  std::shared_ptr<void> start_after;
  std::function<RequestPtr()> start;
  std::function<void()> enqueue;
  std::function<void()> on_finish;
  // Posts the staged send once its copy passed: true when nothing is left to start
  // (*err: the failure to post it).
  bool startIfReady(std::exception_ptr* err);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  Millis timeout_;
  bool finalizing_ = false;
};

class CrossbarBackend : public c10d::Backend {
 public:
  struct Options : c10d::Backend::Options {
    explicit Options(std::chrono::milliseconds timeout = kBackendDefaultTimeout)
        : c10d::Backend::Options("crossbar", timeout) {}
    // Not `override`: Options::clone() is new in recent torch versions.
    c10::intrusive_ptr<c10d::Backend::Options> clone() const { return c10::make_intrusive<Options>(*this); }
    int ranks_per_node = -1;  // -1: CROSSBAR_RANKS_PER_NODE (topology override for testing)
    std::string name;         // communicator name in logs and errors; default: the group name
  };

  CrossbarBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  c10::intrusive_ptr<Options> options = c10::make_intrusive<Options>());
  // Over an existing communicator (a split of another backend's, sharing its transports).
  CrossbarBackend(std::shared_ptr<Communicator> comm, c10::intrusive_ptr<Options> options);
  ~CrossbarBackend() override;

  const std::string getBackendName() const override { return "crossbar"; }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() { return options_; }
  Communicator& communicator() const { return *comm_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  // CUDA tensors: the sender is learned on the host first (blocking until one sent), see
  // p2p_announce.h; then received through NCCL on the current stream.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // torch.distributed.monitored_barrier (blocking; gloo's protocol, see monitored_barrier.cc).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks = false) override;

  // Not `override`: these are not declared by every supported torch version.
  bool supportsCoalescing() const { return true; }
  bool supportsSplitting() const { return true; }
  // torch.distributed.split_group: collective over every rank of this group (torch calls
  // it on all of them; non-members pass a group they are not in and get nullptr). The
  // child is a crossbar Communicator::split of this one (shares its transports); the
  // store torch passes is not needed.
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<c10d::Backend::Options>& opts);
  // new_group on its members only (use_local_synchronization, or a default group not
  // bound to a device, where torch does not call non-members): Communicator::splitMembers
  // of this group's communicator; `ranks` are this group's ranks (position = new rank).
  // nullptr where this rank is not in `ranks`.
  c10::intrusive_ptr<c10d::Backend> splitMembers(const std::vector<int>& ranks, std::chrono::milliseconds timeout,
                                                 const std::string& name);
  // torch.distributed.shrink_group (torch >= 2.10; not `override` for older versions).
  // Only a crossbar.ft group's backends can shrink: survivors must agree on who is left
  // first, which its handler does (the fault-tolerant agreement) before handing back the
  // next epoch's backend, built over the shrunk Communicator.
  using ShrinkHandler =
      std::function<c10::intrusive_ptr<c10d::Backend>(const std::vector<int64_t>& ranks_to_exclude)>;
  void setShrinkHandler(ShrinkHandler handler);
  bool supportsShrinking() const;
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags = 0,
                                           const c10::intrusive_ptr<c10d::Backend::Options>& opts_override = nullptr);
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  // Collectives issued on this group so far (every rank counts the same calls; point to
  // point is not counted). torch's TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper compares it across
  // ranks before each collective to detect mismatched calls.
  uint64_t getSequenceNumberForGroup() override { return coll_seq_.load(); }
  void setTimeout(std::chrono::milliseconds timeout);
  // The default group: aborts its communicator (every group over it ends). A split
  // (new_group, split_group): only this group's pending work fails; the others go on.
  void abort();
  void shutdown();
  // How CUDA point to point runs: "" (no CUDA call yet), "nccl" or "host-staged".
  std::string cudaP2pPath() const;
#if CROSSBAR_TORCH_AT_LEAST(2, 6)
  c10d::ErrorType getError();
#endif

 private:
  struct CollCall;
  struct Ops;  // where one call's operations go (host Collectives or CudaCollectives + stream)
  // `on`: the tensor whose device decides where the call runs (undefined: the host).
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
                                        Millis timeout, const at::Tensor& on,
                                        const std::function<void(CrossbarWork&, Ops&)>& issue, bool p2p = false);
  c10::intrusive_ptr<c10d::Work> recvFrom(std::vector<at::Tensor>& tensors, int src, int tag, bool announced);
  // CUDA tensors when NCCL cannot serve this group (cuda_p2p_staged_): pinned host copies
  // on the current stream around the host send/recv (see backend.cc).
  void stagedSend(CrossbarWork& w, const at::Tensor& src, int dst, uint32_t tag, void* stream);
  void stagedRecv(CrossbarWork& w, const at::Tensor& dst, int src, uint32_t tag, std::function<void()> stream_post);
  void launchStaged(const c10::intrusive_ptr<CrossbarWork>& work, void* stream);
  bool groupSharesAGpu(int device);
  Millis timeoutOf(std::chrono::milliseconds requested) const;
  void ensureUsable(const char* op) const;
  void startThreads();
  CudaCollectives& ensureCuda(int device, const char* op);
  c10::intrusive_ptr<c10d::Work> submitCuda(c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
                                            Millis timeout, const at::Tensor& on,
                                            const std::function<void(CrossbarWork&, Ops&)>& issue, bool p2p);
  void enqueuedOnCuda(const c10::intrusive_ptr<CrossbarWork>& work, void* stream);
  void cudaLoop();
  void completionLoop();
  void p2pLoop();
  void stopThreads();
  bool finishedAtIssue(CrossbarWork& work);
  void awaitBell(CompletionBell& bell, Clock::time_point busy_at,
                 const std::function<bool()>& nothing_queued);
  bool takeNow(const CrossbarWork& w, Clock::time_point now) const;

  c10::intrusive_ptr<Options> options_;
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<Collectives> coll_;
  std::atomic<int64_t> timeout_ms_;

  // Completion: collective Works finish in issue order, so one thread waits on the
  // oldest; point-to-point Requests finish in any order, so another polls them all.
  // A bell (host) or condition variable (CUDA) per thread, so a submit wakes only the thread
  // it feeds, and the host threads only when they sleep (completionLoop, p2pLoop).
  std::mutex m_;
  std::shared_ptr<CompletionBell> coll_bell_ = std::make_shared<CompletionBell>();
  std::shared_ptr<CompletionBell> p2p_bell_ = std::make_shared<CompletionBell>();
  std::condition_variable cuda_cv_;
  std::deque<c10::intrusive_ptr<CrossbarWork>> coll_pending_;
  std::deque<c10::intrusive_ptr<CrossbarWork>> p2p_incoming_;
  bool stop_ = false;
  std::thread coll_thread_, p2p_thread_;

  // CUDA tensors: one CudaCollectives (created by the first CUDA call, collectively) on
  // one device; its works are watched in issue order by cuda_thread_.
  std::shared_ptr<CudaCollectives> cuda_;
  int cuda_device_ = -1;
  std::deque<c10::intrusive_ptr<CrossbarWork>> cuda_pending_;
  std::thread cuda_thread_;
  std::unique_ptr<P2pAnnouncer> announcer_;  // CUDA sends' announcements (any-source receives)
  bool cuda_group_open_ = false;  // a CudaCollectives group is open for the coalescing block
  // Two ranks of this group share a GPU, which NCCL refuses ("Duplicate GPU detected"):
  // CUDA point to point stages through host memory instead (decided at the first CUDA
  // call, alike on every rank).
  bool cuda_p2p_staged_ = false;
  std::atomic<bool> p2p_new_{false};

  // Coalescing (batch_isend_irecv, _coalescing_manager).
  bool coalescing_ = false;
  c10::intrusive_ptr<CrossbarWork> coalesced_;
  int coalesced_kind_ = 0;  // 0: nothing yet, 1: CPU tensors, 2: CUDA tensors (not mixed)

  std::exception_ptr first_error_;  // for getError()
  // Failed (timed out, aborted) point-to-point works whose buffers a transport may still
  // use; handed to a process-wide list at shutdown, released when the transport lets go.
  std::vector<c10::intrusive_ptr<CrossbarWork>> orphans_;
  bool shut_down_ = false;
  // Over a split: the transports are shared with the parent and its other splits;
  // abort() ends this group only (Communicator::abort of a split), see abort().
  bool shares_transports_ = false;
  std::atomic<size_t> p2p_active_{0};  // point-to-point works the p2p thread holds
  mutable std::mutex shrink_mu_;
  ShrinkHandler shrink_handler_;
  std::atomic<uint64_t> coll_seq_{0};  // getSequenceNumberForGroup
  uint64_t monitored_barrier_calls_ = 0;  // on this group so far (see monitored_barrier.cc)
};

}  // namespace crossbar::torch_backend
