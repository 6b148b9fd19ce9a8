// Collectives: argument validation, algorithm selection and the ordered Work queue.
//
// Execution model. Each Collectives owns a FIFO of operations and one worker thread.
// Exactly one operation executes at a time (the `executing` flag), always the queue's
// head, so operations run in issue order on every rank -- what makes the per-operation
// tags agree across ranks. A thread that waits on a Work may itself execute the head
// when nothing is executing (instead of waking the worker and sleeping): a blocking
// call then costs no thread hand-off, and ordering still holds because only the head
// is ever claimed. The worker therefore leaves the head to waiting threads: it claims
// it only when no thread waits (`helpers`) and the head has been runnable for a short
// grace period, so that an issue-then-wait call, and a thread waiting through a batch
// of operations, run them inline (no futex wake-up and context switch per operation,
// which dominates small operations with more ranks than cores). Operations nobody
// waits for start when the worker next looks: it is woken by an issue only after it
// went to sleep for good (nothing issued for kWorkerRest); while calls keep coming it
// looks every CROSSBAR_COLL_START_POLL_US instead. A wake-up per issue, the other way,
// preempts a rank when ranks fill the cores: an issue-then-wait 64 KiB allreduce took
// twice as long (docs/performance.md, session 18). Selection (and the lazy creation
// of hierarchical sub-communicators, a collective split) happens in the issuing
// thread, so those run in issue order too.
//
// Eager calls (eager.h) are also tried by the issuing thread itself, right after they
// are queued, when nothing executes (progressEager): EagerChannel::tryRun publishes the
// call and finishes it if the peers' headers arrive within a short spin. It never
// sleeps, so a nonblocking call stays nonblocking (a late peer leaves the call queued,
// published). In step with its peers a small call thus finishes inside the call that
// issued it, without the worker or a wake-up. One left queued is finished by this
// rank's next call, test() or wait(), or else by the worker like any other call (a
// published call needs nothing more from this rank for its peers to finish it, but
// its own output is written only when it is finished here).
//
// A failed operation leaves its peers' traffic in an unknown state, so the error is
// sticky: every later operation of this Collectives fails at once with the same error
// type, naming the first failure, instead of each waiting out its deadline.
#include "collectives/collectives.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "collectives/algorithms.h"
#include "collectives/cuda/route.h"
#include "collectives/eager.h"
#include "collectives/selection.h"
#include "collectives/signature.h"
#include "collectives/symm_staging.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"
#include "comm/store.h"
#include "comm/thread_name.h"
#include "telemetry/telemetry.h"

namespace crossbar {

namespace {

// Tags of collective traffic: above the communicator's own internal tags, 20 bits of
// operation sequence number and 6 bits for an algorithm's sub-phases.
constexpr uint32_t kCollTagBase = kInternalTagBase | 0x08000000u;
constexpr uint32_t kSeqBits = 20, kSubBits = 6;
// How long a runnable head is left to waiting threads before the worker claims it, and
// how often the worker looks again while others execute or wait.
constexpr auto kHandOffGrace = std::chrono::microseconds(50);
constexpr auto kWorkerPoll = std::chrono::microseconds(500);
// How long the worker keeps looking for calls nobody waits for after the last issue,
// before it sleeps until an issue wakes it.
constexpr auto kWorkerRest = std::chrono::milliseconds(50);
uint32_t opTag(uint64_t seq) {
  return kCollTagBase | (static_cast<uint32_t>(seq & ((1u << kSeqBits) - 1)) << kSubBits);
}

// The same error type as `e`, with `prefix` in front of its message.
std::exception_ptr withPrefix(const std::exception_ptr& e, const std::string& prefix) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    std::string msg = prefix + err.what();
    switch (err.code()) {
      case ErrorCode::kInvalidArgument:
        return std::make_exception_ptr(InvalidArgument(msg, err.peers()));
      case ErrorCode::kInvalidUsage:
        return std::make_exception_ptr(InvalidUsage(msg, err.peers()));
      case ErrorCode::kTimeout:
        return std::make_exception_ptr(Timeout(msg, err.peers()));
      case ErrorCode::kPeerFailure:
        return std::make_exception_ptr(PeerFailure(msg, err.peers()));
      case ErrorCode::kAborted:
        return std::make_exception_ptr(Aborted(msg, err.peers()));
      case ErrorCode::kUnsupported:
        return std::make_exception_ptr(Unsupported(msg, err.peers()));
      case ErrorCode::kSystemError:
        return std::make_exception_ptr(SystemError(msg, err.peers()));
      case ErrorCode::kCudaError:
        return std::make_exception_ptr(CudaError(msg, err.peers()));
      case ErrorCode::kNcclError:
        return std::make_exception_ptr(NcclError(msg, err.peers()));
      case ErrorCode::kUcxError:
        return std::make_exception_ptr(UcxError(msg, err.peers()));
      case ErrorCode::kInternal:
        return std::make_exception_ptr(InternalError(msg, err.peers()));
    }
    return std::make_exception_ptr(InternalError(msg, err.peers()));
  } catch (const std::exception& err) {
    return std::make_exception_ptr(InternalError(prefix + err.what()));
  } catch (...) {
    return std::make_exception_ptr(InternalError(prefix + "unknown exception"));
  }
}

// One planned operation: validated, its algorithm selected and numbered by the issuing
// thread (so every rank agrees), executed later by whichever thread runs it.
struct Planned {
  CollArgs args;
  const Algorithm* algo = nullptr;
  uint32_t tag = 0;
  uint64_t seq = 0;  // collectives only (signature.h checks it across ranks)
  bool eager = false;  // isEagerAlgorithm(algo), known once
  std::string describe() const { return fmt::format("{} ({})", args.describe(), algo->name); }
};

// What every operation's execution needs, fixed after construction.
struct Shared {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Scratch> scratch;
  std::shared_ptr<SymmCache> symm;
  std::shared_ptr<CallChecker> checker;
  std::shared_ptr<EagerChannel> eager;
  size_t chunk_bytes = 0;
};

struct Queue;

// One queued operation (or group) and its handle: the plan lives in the Work itself (no
// separate closure or plan vector per call).
class WorkImpl final : public Work {
 public:
  explicit WorkImpl(std::shared_ptr<Queue> q) : q_(std::move(q)) {}
  bool test() override;
  bool hasFinished() override { return finished.load(std::memory_order_acquire); }
  void wait(Deadline deadline) override;
  std::exception_ptr error() const override;
  // Described on first use (formatting costs more than a small call); a group's is set
  // by groupEnd() before it is queued.
  const std::string& description() const override {
    std::call_once(desc_once_, [&] {
      if (!is_group) desc_ = op.describe();
    });
    return desc_;
  }
  // Work::wait(): allows for every operation that was ahead of this one at issue.
  void waitDefault() override;

  std::shared_ptr<Queue> q_;
  // Fixed before the Work is queued; read by the thread that executes it.
  Planned op;                  // a single operation
  std::vector<Planned> group;  // groupStart()/groupEnd(): every grouped operation
  bool is_group = false;
  HierComms* hier = nullptr;  // the Collectives' (outlives every execution), when planned
  int64_t issued_ns = 0;      // telemetry
  // Guarded by Queue::m.
  Millis timeout{0};
  Clock::time_point enqueued{};  // set whenever it is left queued
  uint32_t ahead = 0;            // operations queued or executing ahead of it when issued
  bool eager_published = false;  // EagerChannel::tryRun published this rank's slot already
  bool done = false;
  // `done`, readable without the lock: stored (release) after `err`, so a reader that
  // sees it (acquire) may read `err` (a finished Work's error never changes).
  std::atomic<bool> finished{false};
  bool started = false;
  std::exception_ptr err;
  mutable std::string desc_;
  mutable std::once_flag desc_once_;
};

bool isP2p(CollType c);
bool isEmpty(const CollArgs& a);

// Runs one Work's operation(s) to completion; throws its error.
void execute(const Shared& sh, WorkImpl& w, Deadline deadline) {
  // Telemetry: issue time from the Work, start/end/waits around the run (PeerWait in the algorithms).
  const auto& comm = sh.comm;
  RunContext x;
  x.scratch = sh.scratch.get();
  x.symm = sh.symm.get();
  x.comm = comm.get();
  x.deadline = deadline;
  x.chunk_bytes = sh.chunk_bytes;
  x.hier = w.hier;
  if (!w.is_group && !isP2p(w.op.args.coll)) {
    const Planned& op = w.op;
    telemetry::OpScope record(collTypeName(op.args.coll), op.args.selectionBytes(comm->size()), op.algo->name,
                              w.issued_ns, static_cast<int64_t>(op.seq), comm->rank());
    // The eager path checks the call in its own slots (eager.h).
    if (op.eager) return sh.eager->run(op.args, op.seq, deadline, w.eager_published);
    // An algorithm that runs the check's second half itself (before its first read of
    // peer data) gets it through x.verify_calls; whatever is left runs at the end.
    std::function<void()> verify;
    if (op.algo->verifies_calls && !isEmpty(op.args) && sh.checker->post(comm, op.args, op.seq, deadline)) {
      verify = [&] { sh.checker->verifyPosted(comm, deadline); };
      x.verify_calls = &verify;
    } else {
      sh.checker->check(comm, op.args, op.seq, deadline);
    }
    if (isEmpty(op.args)) return;
    x.tag = op.tag;
    op.algo->run(op.args, x);
    runPendingCallCheck(&verify);  // the algorithm never waited for peer data
    return;
  }
  // A group (or a lone send/recv): post every point-to-point first so they overlap
  // with each other and with the group's collectives, then wait for all.
  const Planned* ops = w.is_group ? w.group.data() : &w.op;
  const size_t nops = w.is_group ? w.group.size() : 1;
  const bool lone = !w.is_group;
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < nops; ++i) total_bytes += ops[i].args.selectionBytes(comm->size());
  telemetry::OpScope record(lone ? collTypeName(ops[0].args.coll) : "group", total_bytes,
                            lone ? ops[0].algo->name : std::string_view("group"), w.issued_ns, -1, comm->rank());
  std::vector<RequestPtr> reqs;
  std::vector<size_t> expect;
  for (size_t i = 0; i < nops; ++i) {
    const CollArgs& a = ops[i].args;
    const size_t bytes = a.count * elementSize(a.type);
    if (a.coll == CollType::kSend) {
      reqs.push_back(comm->isend(a.send, bytes, a.peer, a.tag));
      expect.push_back(SIZE_MAX);
    } else if (a.coll == CollType::kRecv) {
      reqs.push_back(comm->irecv(a.recv, bytes, a.peer, a.tag));
      expect.push_back(bytes);
    }
  }
  for (size_t i = 0; i < nops; ++i) {
    const Planned& op = ops[i];
    if (isP2p(op.args.coll)) continue;
    if (op.eager) {
      sh.eager->run(op.args, op.seq, deadline);
      continue;
    }
    sh.checker->check(comm, op.args, op.seq, deadline);
    if (isEmpty(op.args)) continue;
    x.tag = op.tag;
    op.algo->run(op.args, x);
  }
  {
    telemetry::PeerWait waiting(lone ? ops[0].args.peer : -1);
    comm->waitAll(reqs, deadline);
  }
  size_t k = 0;
  for (size_t i = 0; i < nops; ++i) {
    const Planned& op = ops[i];
    if (!isP2p(op.args.coll)) continue;
    if (expect[k] != SIZE_MAX && reqs[k]->status().bytes != expect[k])
      throw InvalidUsage(
          fmt::format("{}rank {} sent {} bytes, expected {}; do the counts match?",
                      errorContext(comm->rank(), "recv"), op.args.peer, reqs[k]->status().bytes, expect[k]),
          {op.args.peer});
    ++k;
  }
}

struct Queue {
  std::mutex m;
  std::condition_variable cv;         // waiters: an operation finished
  std::condition_variable worker_cv;  // the worker: the queue became non-empty, or stop
  std::deque<std::shared_ptr<WorkImpl>> items;
  bool executing = false;
  bool stop = false;
  bool worker_idle = false;      // the worker sleeps without a timeout (queue was empty)
  bool worker_looking = false;   // the worker sleeps until its next look (start_poll)
  bool deferred_start = false;   // Collectives::setDeferredStart: push() leaves the worker asleep
  // CROSSBAR_COLL_START_POLL_US: how often the worker looks for calls nobody waits for
  // while calls keep coming; zero: every issue wakes it (when asleep).
  Clock::duration start_poll{};
  uint64_t pushes = 0;           // calls queued so far: the worker tells a busy queue from an idle one
  int helpers = 0;               // threads blocked in wait() that will run the head
  Clock::time_point last_end{};  // when the last queued operation finished
  std::exception_ptr sticky;
  std::string sticky_op;
  // Readable without `m` by the issuing thread (under the issue lock, so nothing can be
  // queued meanwhile): Works queued and not finished, and whether `sticky` is set.
  std::atomic<uint32_t> pending{0};
  std::atomic<bool> failed{false};
  int rank = -1;
  std::shared_ptr<const Shared> shared;  // set before the worker starts
  // For state(): what executes, since when, on which thread.
  const WorkImpl* running = nullptr;
  Clock::time_point running_since{};
  bool running_on_worker = false;
  std::thread::id worker_id;

  bool canRunHead() const { return !executing && !items.empty(); }
  // When the worker may claim the runnable head (waiting threads go first).
  Clock::time_point workerClaimsAt() const {
    return std::max(items.front()->enqueued, last_end) + kHandOffGrace;
  }
  // The worker sleeps without a timeout only on an empty queue: wake it once for new work.
  // `now`: also when it only looks now and then (start_poll): for a test() or a wait()
  // that will not run the head itself, whose caller is waiting for it (once per look).
  void wakeWorker(bool now = false) {
    if ((worker_idle || (now && worker_looking)) && !items.empty()) {
      worker_idle = worker_looking = false;
      worker_cv.notify_one();
    }
  }

  // After an issue left a call queued: wakes the worker if it sleeps for good (not for a
  // Collectives::setDeferredStart owner, whose own thread waits for every call in time).
  void wakeWorkerForIssue() {
    if (!deferred_start) wakeWorker();
  }

  // Queues `w` behind everything issued before it; called with m held. `stamp` false:
  // the caller sets w.enqueued and wakes the worker itself if `w` is still queued after
  // trying to run it (progressEager).
  void push(const std::shared_ptr<WorkImpl>& w, Millis timeout, bool stamp) {
    w->timeout = timeout;
    w->ahead = static_cast<uint32_t>(items.size() + (executing ? 1 : 0));
    items.push_back(w);
    ++pushes;
    pending.fetch_add(1, std::memory_order_relaxed);
    if (stamp) {
      w->enqueued = Clock::now();
      wakeWorkerForIssue();
    }
  }

  // The first error is sticky (m held).
  void noteError(WorkImpl& w, const std::exception_ptr& err) {
    if (err && !sticky) {
      sticky = err;
      sticky_op = w.description();
      failed.store(true, std::memory_order_release);
    }
  }

  // Records the end of `w` (m held): its error (sticky for every later operation),
  // done, and wakes its waiters.
  void finish(WorkImpl& w, std::exception_ptr err) {
    w.group.clear();
    w.err = err;
    w.done = true;
    w.finished.store(true, std::memory_order_release);
    noteError(w, err);
    pending.fetch_sub(1, std::memory_order_release);
    executing = false;
    running = nullptr;
    cv.notify_all();
  }

  void noteRunning(const WorkImpl* w) {
    running = w;
    running_since = Clock::now();
    running_on_worker = std::this_thread::get_id() == worker_id;
  }

  std::string state() const;

  // Publishes the eager slots of `first` (when not null) and of the eager calls queued
  // right behind it, as far as their slots are free (m held, by the thread that is
  // the executor: the eager channel is not thread-safe). Their inputs are final once
  // issued, so they need not wait for the calls ahead: peers that run meanwhile find
  // a run of calls ready instead of one per turn (with more ranks than cores each rank
  // runs in turns, and a turn then completes up to kEagerSlots calls, not one).
  // Stream order holds: a call whose input overlaps the output of a call ahead of it
  // that has not finished (the next allreduce of the same tensor) waits its turn.
  void publishAhead(WorkImpl* first) {
    if (sticky) return;  // nothing after a failure runs
    const int p = shared->comm->size();
    std::vector<ByteRange> ahead;  // outputs of the unfinished calls ahead
    auto publish = [&](WorkImpl& w) {
      if (w.is_group || !w.op.eager) return false;
      if (!w.eager_published) {
        const ByteRange in = eagerInput(w.op.args, p);
        for (const ByteRange& out : ahead)
          if (in.overlaps(out)) return false;
        if (!shared->eager->tryPublish(w.op.args, w.op.seq)) return false;
        w.eager_published = true;
      }
      ahead.push_back(eagerOutput(w.op.args, p));
      return true;
    };
    if (first && !publish(*first)) return;
    for (auto& w : items)
      if (!publish(*w)) return;
  }

  // Executes the head; called and returns with `lk` held.
  void runHead(std::unique_lock<std::mutex>& lk) {
    std::shared_ptr<WorkImpl> w = std::move(items.front());
    items.pop_front();
    executing = true;
    w->started = true;
    noteRunning(w.get());
    std::exception_ptr first = sticky;
    std::string first_op = first ? sticky_op : std::string();
    if (!telemetry::Recorder::instance().enabled()) publishAhead(w.get());
    lk.unlock();
    std::exception_ptr err;
    if (first) {
      err =
          withPrefix(first, fmt::format("{}not run: an earlier operation ({}) failed, so the peers' state is "
                                        "unknown; abort the communicator and create a new one. First error: ",
                                        errorContext(rank, w->description()), first_op));
    } else {
      try {
        execute(*shared, *w, Deadline::after(w->timeout));
      } catch (...) {
        err = withPrefix(std::current_exception(), fmt::format("{}: ", w->description()));
      }
    }
    lk.lock();
    finish(*w, err);
    last_end = Clock::now();
  }

  // Progress by the calling thread (called with `lk` held; right after queueing `mine`,
  // or from test()): while nothing else executes, runs eager heads with
  // EagerChannel::tryRun (never a sleep), up to and including `mine`. With `spin_mine`,
  // each try spins for its peers (at most kIssueSpin, and only when ranks <= cores),
  // and the first one not finished ends the round; without, each try is a quick look. A small call whose peers are there finishes inside the call that
  // issued it: no hand-off to the worker, no wake-up. The first head that is not eager
  // or not finished stays the head, for the worker or a waiting thread (which finish a
  // published one with run()).
  void progressEager(std::unique_lock<std::mutex>& lk, const WorkImpl* mine, bool spin_mine) {
    while (!executing && !items.empty() && !sticky) {
      if (items.front()->is_group || !items.front()->op.eager) return;
      std::shared_ptr<WorkImpl> w = std::move(items.front());
      items.pop_front();
      executing = true;
      w->started = true;
      noteRunning(w.get());
      lk.unlock();
      std::exception_ptr err;
      bool finished = true;
      // The issuing thread spins (bounded) on the first head not finished yet, mine or
      // an earlier one whose peers are late: returning at once would leave this call
      // queued unpublished behind it, and the ranks would stay out of step (every
      // later call queued on this rank, its slot published only when its turn comes).
      const bool spin = spin_mine;
      try {
        finished = shared->eager->tryRun(w->op.args, w->op.seq, &w->eager_published, spin);
      } catch (...) {
        err = withPrefix(std::current_exception(), fmt::format("{}: ", w->description()));
      }
      lk.lock();
      if (!finished) {
        items.push_front(std::move(w));
        publishAhead(nullptr);
        executing = false;
        running = nullptr;
        cv.notify_all();  // a waiting thread may run it now
        return;
      }
      finish(*w, err);
      if (w.get() == mine) return;
    }
  }

  // The worker thread's loop: runs heads nobody else runs, until stopped and drained.
  void workerLoop() {
    std::unique_lock<std::mutex> lk(m);
    worker_id = std::this_thread::get_id();
    uint64_t pushes_seen = pushes;
    Clock::time_point last_push_seen = Clock::now();
    while (true) {
      if (canRunHead()) {
        if (stop || (helpers == 0 && Clock::now() >= workerClaimsAt())) {
          runHead(lk);
          continue;
        }
        worker_cv.wait_until(lk, helpers == 0 ? workerClaimsAt() : Clock::now() + kWorkerPoll);
        continue;
      }
      if (stop && items.empty()) return;
      if (items.empty() && start_poll > Clock::duration::zero() && !deferred_start) {
        // Calls came since the last look: keep looking without being woken per call.
        const Clock::time_point now = Clock::now();
        if (pushes != pushes_seen) {
          pushes_seen = pushes;
          last_push_seen = now;
        }
        if (now - last_push_seen < kWorkerRest) {
          worker_looking = true;
          worker_cv.wait_for(lk, start_poll);
          worker_looking = false;
          continue;
        }
      }
      if (items.empty()) {
        worker_idle = true;
        worker_cv.wait(lk);
        worker_idle = false;
      } else {
        worker_cv.wait_for(lk, kWorkerPoll);  // another thread executes; the rest may be ours
      }
    }
  }
};

// A line for hang reports (m held): what executes, on which thread and since when, what
// is queued, and what the worker does.
std::string Queue::state() const {
  const Clock::time_point now = Clock::now();
  auto ago = [&](Clock::time_point t) {
    return fmt::format("{:.3f} s ago", std::chrono::duration<double>(now - t).count());
  };
  std::string s =
      fmt::format("rank {} {}: {} unfinished; ", rank, shared ? shared->comm->name() : "(destroyed)",
                  pending.load(std::memory_order_relaxed));
  if (running)
    s += fmt::format("executing {} on {} since {}", running->description(),
                     running_on_worker ? "the worker" : "a calling thread", ago(running_since));
  else
    s += "nothing executing";
  s += fmt::format("; {} queued", items.size());
  const size_t shown = std::min<size_t>(items.size(), 4);
  for (size_t i = 0; i < shown; ++i) {
    const WorkImpl& w = *items[i];
    s += fmt::format("{}{}{} ({})", i ? ", " : ": ", w.description(), w.eager_published ? " [published]" : "",
                     w.enqueued == Clock::time_point{} ? "being issued" : "left queued " + ago(w.enqueued));
  }
  if (shown < items.size()) s += fmt::format(", ... {} more", items.size() - shown);
  const char* worker = running && running_on_worker ? "executing"
                       : worker_idle                ? "asleep until an issue wakes it"
                       : worker_looking             ? "looking now and then"
                       : canRunHead()               ? "waiting to claim the head"
                                                    : "waiting while another thread executes";
  s += fmt::format("; worker {}; {} waiting thread(s) will run the head; start poll {} us{}", worker, helpers,
                   std::chrono::duration_cast<std::chrono::microseconds>(start_poll).count(),
                   deferred_start ? " (deferred start)" : "");
  if (last_end != Clock::time_point{}) s += fmt::format("; last call finished {}", ago(last_end));
  if (sticky) s += fmt::format("; failed at {}", sticky_op);
  return s;
}

bool WorkImpl::test() {
  if (finished.load(std::memory_order_acquire)) {
    if (err) std::rethrow_exception(err);
    return true;
  }
  std::unique_lock<std::mutex> lk(q_->m);
  if (!done && q_->shared && !telemetry::Recorder::instance().enabled()) {
    q_->progressEager(lk, this, false);  // a quick look: test() never waits
    if (!done) q_->wakeWorker(true);
  }
  if (done && err) std::rethrow_exception(err);
  return done;
}

std::exception_ptr WorkImpl::error() const {
  std::lock_guard<std::mutex> lk(q_->m);
  return err;
}

void WorkImpl::waitDefault() {
  if (finished.load(std::memory_order_acquire)) {
    if (err) std::rethrow_exception(err);
    return;
  }
  Millis allow{0};
  {
    std::lock_guard<std::mutex> lk(q_->m);
    if (done) {
      if (err) std::rethrow_exception(err);
      return;
    }
    allow = timeout * static_cast<int64_t>(ahead + 1) + Millis(5000) -
            std::chrono::duration_cast<Millis>(Clock::now() - enqueued);
  }
  wait(Deadline::after(allow));
}

void WorkImpl::wait(Deadline deadline) {
  if (finished.load(std::memory_order_acquire)) {
    if (err) std::rethrow_exception(err);
    return;
  }
  std::unique_lock<std::mutex> lk(q_->m);
  while (!done) {
    const Clock::time_point now = Clock::now();  // one clock read per round (small calls feel each)
    // Help: execute the head inline when its own deadline ends before ours (so the
    // wait cannot overrun the caller's deadline by running it).
    if (q_->canRunHead() && now + q_->items.front()->timeout <= deadline.at()) {
      q_->runHead(lk);
      continue;
    }
    if (now >= deadline.at()) {
      throw Timeout(fmt::format(
          "{}{} did not finish before the wait's deadline ({}); it may be waiting for a "
          "slow or hung peer, or for earlier operations. Wait longer or raise the timeout. Queue: {}",
          errorContext(q_->rank, "wait"), description(),
          started ? "it is running" : "it is still queued behind earlier operations", q_->state()));
    }
    // While the head is one this wait may run, the worker leaves it to this thread.
    const bool helper = q_->items.empty() || now + q_->items.front()->timeout <= deadline.at();
    if (!helper) q_->wakeWorker(true);  // the head is the worker's (it may have been left asleep)
    if (helper) ++q_->helpers;
    q_->cv.wait_for(lk, std::min<Millis>(deadline.remaining(), Millis(100)));
    if (helper) --q_->helpers;
  }
  if (err) std::rethrow_exception(err);
}

bool overlaps(const void* a, size_t alen, const void* b, size_t blen) {
  if (!a || !b || !alen || !blen) return false;
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + blen && y < x + alen;
}

bool isP2p(CollType c) {
  return c == CollType::kSend || c == CollType::kRecv;
}

// Whether the call moves no data at all (every rank agrees, as counts must match).
bool isEmpty(const CollArgs& a) {
  switch (a.coll) {
    case CollType::kBarrier:
    case CollType::kSend:
    case CollType::kRecv:
    case CollType::kAlltoallv:
      return false;
    default:
      return a.count == 0;
  }
}

void validate(const CollArgs& a, const Communicator& c) {
  const int p = c.size(), r = c.rank();
  const char* name = collTypeName(a.coll);
  auto fail = [&](const std::string& what) { throw InvalidArgument(errorContext(r, name) + what); };
  if (static_cast<int>(a.type) < 0 || static_cast<int>(a.type) >= kNumDataTypes)
    fail(fmt::format("unknown data type {}", static_cast<int>(a.type)));
  if (hasReduceOp(a.coll)) {
    if (static_cast<int>(a.op) < 0 || static_cast<int>(a.op) >= kNumReduceOps)
      fail(fmt::format("unknown reduce op {}", static_cast<int>(a.op)));
    if (!isSupported(a.type, a.op))
      fail(fmt::format(
          "reduce op {} is not defined for {} (premulsum needs a floating-point type); use sum and "
          "scale",
          reduceOpName(a.op), dataTypeName(a.type)));
  }
  if (hasRoot(a.coll) && (a.root < 0 || a.root >= p))
    fail(fmt::format("root {} is out of range for a communicator of {} ranks", a.root, p));
  const size_t es = elementSize(a.type);
  size_t blk = 0, all = 0;  // overflow checked by multiplication (two divisions cost more than a small call's validation)
  if (__builtin_mul_overflow(a.count, es, &blk) || __builtin_mul_overflow(blk, static_cast<size_t>(p), &all))
    fail(fmt::format("count {} x {} ranks overflows the address space", a.count, p));
  auto need = [&](const void* ptr, size_t bytes, const char* which) {
    if (!ptr && bytes) fail(fmt::format("{} buffer is null but must hold {} bytes", which, bytes));
    // Reductions read and write typed elements: a misaligned address is undefined
    // behaviour on the host and a fault on the device. Data movement copies bytes.
    if (ptr && hasReduceOp(a.coll) && reinterpret_cast<uintptr_t>(ptr) % es != 0)
      fail(
          fmt::format("{} buffer {} is not aligned to the {}-byte elements of {}; reductions need aligned "
                      "buffers (copy into an aligned one)",
                      which, ptr, es, dataTypeName(a.type)));
  };
  auto disjointOr = [&](const void* s, size_t slen, const void* d, size_t dlen, const void* inplace,
                        const char* rule) {
    if (s == inplace) return;
    if (overlaps(s, slen, d, dlen))
      fail(fmt::format("send and receive buffers overlap; they must be disjoint or in place ({})", rule));
  };
  switch (a.coll) {
    case CollType::kAllreduce:
      need(a.send, blk, "send");
      need(a.recv, blk, "receive");
      disjointOr(a.send, blk, a.recv, blk, a.recv, "send == recv");
      break;
    case CollType::kAllgather:
      need(a.send, blk, "send");
      need(a.recv, all, "receive");
      disjointOr(a.send, blk, a.recv, all, a.recv ? static_cast<const char*>(a.recv) + r * blk : nullptr,
                 "send == recv + rank * count");
      break;
    case CollType::kReduceScatter:
      need(a.send, all, "send");
      need(a.recv, blk, "receive");
      disjointOr(a.recv, blk, a.send, all, a.send ? static_cast<const char*>(a.send) + r * blk : nullptr,
                 "recv == send + rank * count");
      break;
    case CollType::kBroadcast:
      need(a.recv, blk, "broadcast");
      break;
    case CollType::kReduce:
      need(a.send, blk, "send");
      if (r == a.root) {
        need(a.recv, blk, "receive (root)");
        disjointOr(a.send, blk, a.recv, blk, a.recv, "send == recv");
      }
      break;
    case CollType::kAlltoall:
      need(a.send, all, "send");
      need(a.recv, all, "receive");
      disjointOr(a.send, all, a.recv, all, a.recv, "send == recv");
      break;
    case CollType::kAlltoallv: {
      const std::vector<size_t>* v[4] = {&a.send_counts, &a.send_displs, &a.recv_counts, &a.recv_displs};
      const char* vn[4] = {"send_counts", "send_displs", "recv_counts", "recv_displs"};
      for (int i = 0; i < 4; ++i)
        if (v[i]->size() != static_cast<size_t>(p))
          fail(fmt::format("{} has {} entries, expected one per rank ({})", vn[i], v[i]->size(), p));
      size_t send_extent = 0, recv_extent = 0;
      const size_t emax = std::numeric_limits<size_t>::max() / es;
      for (int i = 0; i < p; ++i) {
        // Counts first: emax - count wraps for a count above emax (a negative count
        // from a caller that converted a signed value).
        if (a.send_counts[i] > emax || a.recv_counts[i] > emax ||
            a.send_displs[i] > emax - a.send_counts[i] || a.recv_displs[i] > emax - a.recv_counts[i])
          fail(fmt::format("displacement + count for rank {} overflows (negative or huge value?)", i));
        send_extent = std::max(send_extent, a.send_displs[i] + a.send_counts[i]);
        recv_extent = std::max(recv_extent, a.recv_displs[i] + a.recv_counts[i]);
      }
      if (a.send_counts[r] != a.recv_counts[r])
        fail(fmt::format(
            "send_counts[{0}] = {1} but recv_counts[{0}] = {2}; a rank's block to itself must match", r,
            a.send_counts[r], a.recv_counts[r]));
      need(a.send, send_extent * es, "send");
      need(a.recv, recv_extent * es, "receive");
      // Receive blocks must not overlap each other (they arrive in any order).
      std::vector<int> order(p);
      for (int i = 0; i < p; ++i) order[i] = i;
      std::sort(order.begin(), order.end(),
                [&](int x, int y) { return a.recv_displs[x] < a.recv_displs[y]; });
      size_t end = 0;
      int end_rank = -1;
      for (int i : order) {
        if (a.recv_counts[i] == 0) continue;
        if (end_rank >= 0 && a.recv_displs[i] < end)
          fail(fmt::format("receive blocks of ranks {} and {} overlap (recv_displs {} < end {} of the other)",
                           end_rank, i, a.recv_displs[i], end));
        if (a.recv_displs[i] + a.recv_counts[i] > end) {
          end = a.recv_displs[i] + a.recv_counts[i];
          end_rank = i;
        }
      }
      if (a.send != a.recv && overlaps(a.send, send_extent * es, a.recv, recv_extent * es))
        fail("send and receive buffers overlap; they must be disjoint or identical (in place)");
      if (a.send == a.recv && (a.send_counts != a.recv_counts || a.send_displs != a.recv_displs))
        fail("in place (send == recv) needs identical send and receive counts and displacements");
      break;
    }
    case CollType::kGather:
      need(a.send, blk, "send");
      if (r == a.root) {
        need(a.recv, all, "receive (root)");
        disjointOr(a.send, blk, a.recv, all, a.recv ? static_cast<const char*>(a.recv) + r * blk : nullptr,
                   "send == recv + root * count");
      }
      break;
    case CollType::kScatter:
      need(a.recv, blk, "receive");
      if (r == a.root) {
        need(a.send, all, "send (root)");
        disjointOr(a.recv, blk, a.send, all, a.send ? static_cast<const char*>(a.send) + r * blk : nullptr,
                   "recv == send + root * count");
      }
      break;
    case CollType::kSend:
    case CollType::kRecv:
      if (a.peer < 0 || a.peer >= p)
        fail(fmt::format("peer {} is out of range for a communicator of {} ranks", a.peer, p));
      if (a.peer == r) fail(fmt::format("peer {} is this rank; copy locally instead", a.peer));
      if (a.tag >= kInternalTagBase)
        fail(fmt::format("tag {:#x} is reserved for crossbar (tags must be below {:#x})", a.tag,
                         kInternalTagBase));
      need(a.coll == CollType::kSend ? a.send : a.recv, blk, a.coll == CollType::kSend ? "send" : "receive");
      break;
    case CollType::kBarrier:
      break;
  }
}

}  // namespace

void validateCollArgs(const CollArgs& a, const Communicator& c) {
  validate(a, c);
}

void Work::waitDefault() {
  wait(Deadline::after(defaultTimeout()));
}

struct Collectives::Impl {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Queue> q = std::make_shared<Queue>();
  std::thread worker;
  std::mutex issue_m;  // serializes issuing: sequence numbers, group state, sub-communicators
  uint64_t seq = 0;
  AlgoOverride env_override;
  size_t chunk_bytes = 512 * 1024;
  std::shared_ptr<HierComms> hier;
  std::shared_ptr<Scratch> scratch = std::make_shared<Scratch>();
  std::shared_ptr<SymmCache> symm = std::make_shared<SymmCache>();
  std::shared_ptr<CallChecker> checker;
  std::shared_ptr<EagerChannel> eager;  // eager.h: small calls, one node
  int group_depth = 0;
  std::vector<Planned> group;
  std::shared_ptr<WorkImpl> group_work;
  std::shared_ptr<CudaRoute> cuda_route;  // device memory: collectives/cuda/route.h
  const Algorithm* eager_pick[kNumCollTypes] = {};  // plan(): the table's eager pick per collective
  // Validates, selects and numbers `a` into `out` (moved in once: no copies per call).
  // `cached_eager`: the caller validated `a` and found cachedEager() true.
  void plan(CollArgs&& a, const CollOptions& o, Planned& out, bool cached_eager = false);
  // Whether the table already sent this collective to eager and `a` fits it (plan()
  // then picks eager without a table scan).
  bool cachedEager(const CollArgs& a, const CollOptions& o) const;
  WorkPtr submit(CollArgs&& a, const CollOptions& o);
  WorkPtr runAlone(std::shared_ptr<WorkImpl> w, Millis timeout, std::unique_lock<std::mutex>& issue);
  Millis timeoutOf(const CollOptions& o) const { return o.timeout.count() > 0 ? o.timeout : comm->timeout(); }
};

// The eager rows lead the table for their collectives and eager applies by size and
// topology alone, so once the table picked eager for a collective, any call of it that
// fits takes eager too (without CollOptions.algorithm or CROSSBAR_ALGO for it, and
// without INFO logging, which wants the table's reason): no table scan.
static bool eagerCacheable(const CollOptions& o, const AlgoOverride& env_override, int c) {
  return o.algorithm.empty() && env_override.per_coll[c].empty() && !log::enabled(log::Level::kInfo);
}

bool Collectives::Impl::cachedEager(const CollArgs& a, const CollOptions& o) const {
  const int c = static_cast<int>(a.coll);
  return eager_pick[c] && eagerCacheable(o, env_override, c) && eagerFits(a, *comm);
}

void Collectives::Impl::plan(CollArgs&& a, const CollOptions& o, Planned& pl, bool cached_eager) {
  if (!cached_eager) validate(a, *comm);
  Selection s;
  const int c = static_cast<int>(a.coll);
  bool eager = cached_eager || cachedEager(a, o);
  if (eager) {
    s.algorithm = eager_pick[c];
  } else {
    s = selectAlgorithm(a, *comm, o.algorithm, env_override);
    eager = isEagerAlgorithm(s.algorithm);
    if (eagerCacheable(o, env_override, c) && eager) eager_pick[c] = s.algorithm;
  }
  if (s.algorithm->needs_hier && !hier) {
    // Collective (split); every rank selects the same algorithm for the same call.
    auto h = std::make_shared<HierComms>();
    h->intra = comm->split(comm->node(), comm->rank());
    h->inter = comm->split(comm->localRank(), comm->node());
    hier = std::move(h);
  }
  pl.args = std::move(a);
  pl.algo = s.algorithm;
  pl.eager = eager;
  // Only collectives take a sequence number: point-to-point calls use the user's tag
  // and need not pair up per call, so counting them would put ranks out of step.
  if (!isP2p(pl.args.coll)) {
    pl.seq = seq;
    pl.tag = opTag(seq++);
  }
  CB_INFO("coll", "{}: #{} {} [{}]", comm->name(), pl.seq, pl.describe(), s.reason);
}

WorkPtr Collectives::Impl::submit(CollArgs&& a, const CollOptions& o) {
  std::unique_lock<std::mutex> issue(issue_m);
  if (WorkPtr w = routeToCuda(cuda_route, comm, a, o, group_depth > 0)) return w;
  if (group_depth > 0) {
    Planned pl;
    plan(std::move(a), o, pl);
    group_work->timeout = std::max(group_work->timeout, timeoutOf(o));
    group.push_back(std::move(pl));
    return group_work;
  }
  const bool recording = telemetry::Recorder::instance().enabled();
  // Eager calls are tried right here (telemetry records operations from execute()).
  // One that will run alone (nothing queued) and whose collective the table already
  // sent to eager is published before it is planned: the slot's line travels to the
  // peers while the rest is set up, instead of after it. The Work is allocated first:
  // its reference counts are locked instructions, and a locked instruction after the
  // publish would wait until this core owns the slot's line (the peer read it last).
  const bool alone = !recording && q->pending.load(std::memory_order_acquire) == 0 &&
                     !q->failed.load(std::memory_order_acquire);
  const bool cached_eager = alone && cachedEager(a, o);
  if (cached_eager) validate(a, *comm);
  auto w = std::make_shared<WorkImpl>(q);
  const bool published = cached_eager && eager->tryPublish(a, seq);  // seq: the number plan() gives it
  plan(std::move(a), o, w->op, cached_eager);
  w->eager_published = published;
  w->hier = hier.get();
  if (recording) w->issued_ns = telemetry::nowNs();
  const bool try_now = !recording && w->op.eager;
  if (try_now && alone) return runAlone(std::move(w), timeoutOf(o), issue);
  std::unique_lock<std::mutex> lk(q->m);
  q->push(w, timeoutOf(o), !try_now);
  issue.unlock();  // queued: later calls go behind it
  if (try_now) {
    q->progressEager(lk, w.get(), true);
    if (!w->done) {
      w->enqueued = Clock::now();
      q->wakeWorkerForIssue();  // left queued: as in runAlone
    }
  }
  return w;
}

// Nothing is queued or executing, and this thread holds the issue lock, so nothing can
// be queued meanwhile: the call runs here without touching the queue (no queue lock,
// no push and pop). Only a call that does not finish (a peer not there yet) or fails
// goes through the queue's bookkeeping.
WorkPtr Collectives::Impl::runAlone(std::shared_ptr<WorkImpl> w, Millis timeout,
                                    std::unique_lock<std::mutex>& issue) {
  w->timeout = timeout;
  w->started = true;
  std::exception_ptr err;
  bool finished = true;
  try {
    finished = eager->tryRun(w->op.args, w->op.seq, &w->eager_published, true);
  } catch (...) {
    err = withPrefix(std::current_exception(), fmt::format("{}: ", w->description()));
  }
  if (finished && !err) {
    w->done = true;  // not yet shared with any other thread
    w->finished.store(true, std::memory_order_release);
    return w;
  }
  std::unique_lock<std::mutex> lk(q->m);
  if (finished) {  // failed: sticky for every later call
    w->err = err;
    w->done = true;
    w->finished.store(true, std::memory_order_release);
    q->noteError(*w, err);
    return w;
  }
  q->push(w, timeout, false);  // published, or waiting for a free slot: the queue finishes it
  issue.unlock();
  w->enqueued = Clock::now();
  // Left queued (published or not): this rank's next call, test() or wait() finishes it,
  // or else the worker at its next look. A worker that sleeps without a timeout (start
  // poll 0, or no calls for kWorkerRest) is woken for it: a call that nobody waits for
  // but only polls hasFinished() for must still finish.
  q->wakeWorkerForIssue();
  return w;
}

Collectives::Collectives(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)), impl_(new Impl) {
  if (!comm_) throw InvalidArgument("Collectives: the communicator is null");
  impl_->comm = comm_;
  impl_->q->rank = comm_->rank();
  impl_->q->start_poll =
      std::chrono::microseconds(std::max<int64_t>(env::getInt("CROSSBAR_COLL_START_POLL_US"), 0));
  impl_->env_override = parseAlgoOverride(env::getString("CROSSBAR_ALGO"));
  impl_->chunk_bytes = std::max<uint64_t>(env::getSize("CROSSBAR_COLL_CHUNK_SIZE"), 64);
  impl_->checker = std::make_shared<CallChecker>(callCheckModeFromEnv());
  impl_->eager = std::make_shared<EagerChannel>(comm_, impl_->checker);
  // The eager slots are created right after the call-check slots on either path, and a
  // waiting check looks for a peer's call in them (eager.h).
  std::weak_ptr<EagerChannel> eager = impl_->eager;
  impl_->checker->setLocalHooks(
      [eager] {
        if (auto e = eager.lock()) e->create();
      },
      [eager](int peer, uint64_t seq, CallSignature* out) {
        auto e = eager.lock();
        return e && e->peek(peer, seq, out);
      });
  impl_->q->shared = std::make_shared<const Shared>(
      Shared{impl_->comm, impl_->scratch, impl_->symm, impl_->checker, impl_->eager, impl_->chunk_bytes});
  impl_->worker = std::thread([q = impl_->q] {
    nameThisThread("cb-coll-worker");
    q->workerLoop();
  });
}

Collectives::~Collectives() {
  if (impl_->group_depth > 0)
    CB_WARN("coll",
            "Collectives destroyed inside groupStart()/groupEnd(); the open group's {} operations never ran",
            impl_->group.size());
  {
    // Drain: queued operations still run (each is bounded by its deadline).
    std::unique_lock<std::mutex> lk(impl_->q->m);
    impl_->q->stop = true;
    impl_->q->worker_cv.notify_all();
  }
  impl_->worker.join();
  // Works may outlive this object: they keep the queue, not the communicator.
  std::lock_guard<std::mutex> lk(impl_->q->m);
  impl_->q->shared.reset();
}

WorkPtr Collectives::allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                               const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kAllreduce, send, recv, count, type);
  a.op = op;
  a.premul_scalar = o.premul_scalar;
  return impl_->submit(std::move(a), o);
}

WorkPtr Collectives::allgather(const void* send, void* recv, size_t count, DataType type,
                               const CollOptions& o) {
  return impl_->submit(CollArgs::of(CollType::kAllgather, send, recv, count, type), o);
}

WorkPtr Collectives::reduceScatter(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                                   const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kReduceScatter, send, recv, count, type);
  a.op = op;
  a.premul_scalar = o.premul_scalar;
  return impl_->submit(std::move(a), o);
}

WorkPtr Collectives::broadcast(void* buffer, size_t count, DataType type, int root, const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kBroadcast, buffer, buffer, count, type);
  a.root = root;
  return impl_->submit(std::move(a), o);
}

WorkPtr Collectives::reduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op, int root,
                            const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kReduce, send, recv, count, type);
  a.op = op;
  a.root = root;
  a.premul_scalar = o.premul_scalar;
  return impl_->submit(std::move(a), o);
}

WorkPtr Collectives::alltoall(const void* send, void* recv, size_t count, DataType type,
                              const CollOptions& o) {
  return impl_->submit(CollArgs::of(CollType::kAlltoall, send, recv, count, type), o);
}

WorkPtr Collectives::alltoallv(const void* send, const std::vector<size_t>& send_counts,
                               const std::vector<size_t>& send_displs, void* recv,
                               const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                               DataType type, const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kAlltoallv, send, recv, 0, type);
  a.send_counts = send_counts;
  a.send_displs = send_displs;
  a.recv_counts = recv_counts;
  a.recv_displs = recv_displs;
  return impl_->submit(std::move(a), o);
}

WorkPtr Collectives::gather(const void* send, void* recv, size_t count, int root, DataType type,
                            const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kGather, send, recv, count, type);
  a.root = root;
  return impl_->submit(std::move(a), o);
}

WorkPtr Collectives::scatter(const void* send, void* recv, size_t count, int root, DataType type,
                             const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kScatter, send, recv, count, type);
  a.root = root;
  return impl_->submit(std::move(a), o);
}

WorkPtr Collectives::barrier(const CollOptions& o) {
  return impl_->submit(CollArgs::of(CollType::kBarrier, nullptr, nullptr, 0, DataType::kUInt8), o);
}

WorkPtr Collectives::send(const void* data, size_t count, DataType type, int peer, uint32_t tag,
                          const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kSend, data, nullptr, count, type);
  a.peer = peer;
  a.tag = tag;
  return impl_->submit(std::move(a), o);
}

WorkPtr Collectives::recv(void* data, size_t count, DataType type, int peer, uint32_t tag,
                          const CollOptions& o) {
  CollArgs a = CollArgs::of(CollType::kRecv, nullptr, data, count, type);
  a.peer = peer;
  a.tag = tag;
  return impl_->submit(std::move(a), o);
}

std::string Collectives::state() const {
  std::lock_guard<std::mutex> lk(impl_->q->m);
  return impl_->q->state();
}

void Collectives::setDeferredStart(bool on) {
  std::lock_guard<std::mutex> lk(impl_->q->m);
  impl_->q->deferred_start = on;
}

void Collectives::groupStart() {
  std::lock_guard<std::mutex> lk(impl_->issue_m);
  if (impl_->group_depth++ == 0) {
    impl_->group.clear();
    impl_->group_work = std::make_shared<WorkImpl>(impl_->q);
    impl_->group_work->is_group = true;
    impl_->group_work->desc_ = "group";
    impl_->group_work->timeout = Millis(0);
  }
}

WorkPtr Collectives::groupEnd() {
  std::lock_guard<std::mutex> lk(impl_->issue_m);
  if (impl_->group_depth == 0)
    throw InvalidUsage(errorContext(comm_->rank(), "groupEnd") +
                       "groupEnd() without a matching groupStart()");
  std::shared_ptr<WorkImpl> w = impl_->group_work;
  if (--impl_->group_depth > 0) return w;
  std::string desc = fmt::format("group of {} operations", impl_->group.size());
  for (size_t i = 0; i < impl_->group.size() && i < 4; ++i) desc += (i ? ", " : ": ") + impl_->group[i].describe();
  if (impl_->group.size() > 4) desc += ", ...";
  w->desc_ = desc;
  Millis timeout = w->timeout.count() > 0 ? w->timeout : comm_->timeout();
  if (telemetry::Recorder::instance().enabled()) w->issued_ns = telemetry::nowNs();
  w->hier = impl_->hier.get();
  {
    std::lock_guard<std::mutex> lk(impl_->q->m);
    w->group = std::move(impl_->group);
    impl_->q->push(w, timeout, true);
  }
  impl_->group.clear();
  impl_->group_work.reset();
  return w;
}

}  // namespace crossbar
