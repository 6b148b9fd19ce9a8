// Host-memory backend of the perf driver: page-aligned, pre-touched buffers and
// crossbar's CPU collectives; per-iteration times from the host clock at completion.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "perf/backend.h"
#include "symmem/symmetric_heap.h"

namespace crossbar::perf {

int64_t residentBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long long total = 0, resident = 0;
  const int got = std::fscanf(f, "%lld %lld", &total, &resident);
  std::fclose(f);
  return got == 2 ? resident * sysconf(_SC_PAGESIZE) : 0;
}

namespace {

using Clock = std::chrono::steady_clock;

class HostBackend : public RunBackend {
 public:
  HostBackend(std::shared_ptr<Communicator> comm, Collectives& coll, bool symmetric)
      : comm_(std::move(comm)), coll_(coll), symmetric_inputs_(symmetric) {}

  const char* memoryName() const override { return "host"; }
  std::string deviceDescription() const override {
    const Communicator& c = coll_.comm();
    return fmt::format("cpu [node {}] host memory, local rank {}/{}", c.node(), c.localRank(), c.localSize());
  }
  int deviceIndex() const override { return -1; }

  char* allocate(size_t bytes) override {
    bytes = (std::max<size_t>(bytes, 4096) + 4095) & ~size_t{4095};
    if (symmetric_inputs_) {
      // -R 2: a buffer of a symmetric heap over the collectives' communicator, so the
      // one-node algorithms read inputs in place (zero copy-in; docs/symmem.md). The
      // driver allocates the same sizes in the same order on every rank (collective).
      if (!heap_) {
        symm::HeapOptions ho;
        ho.name = "perf";
        ho.remote_access = false;
        heap_ = std::make_unique<symm::SymmetricHeap>(symm::SymmetricHeap::create(comm_, ho));
      }
      auto buffer = heap_->allocate(bytes);  // zero-filled: its pages are touched already
      auto* p = static_cast<char*>(buffer->localPtr());
      symmetric_[p] = std::move(buffer);
      return p;
    }
    auto* p = static_cast<char*>(std::aligned_alloc(4096, bytes));
    if (!p)
      throw SystemError(fmt::format("perf: rank {} cannot allocate {} bytes of host memory; lower -e",
                                    coll_.comm().rank(), bytes));
    std::memset(p, 0, bytes);  // first-touch page faults stay out of the timing
    return p;
  }
  void release(char* p) override {
    if (symmetric_.erase(p)) return;
    std::free(p);
  }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  void upload(void* dst, const void* host, size_t bytes) override {
    if (dst != host) std::memcpy(dst, host, bytes);
  }
  void download(void* host, const void* src, size_t bytes) override {
    if (host != src) std::memcpy(host, src, bytes);
  }
  bool hostAccessible() const override { return true; }

  // Like a stream with a bounded launch queue: at most kInFlight calls are held, the
  // oldest is waited for (normally long finished) once another is issued. Holding
  // every handle of a -n 100000 run would measure the allocator walking fresh memory,
  // not the collectives. Releasing the oldest after the issue keeps freeing its handle
  // out of the time between two calls (the peers wait for the next call's data, not for
  // the harness).
  void start(const CollTest& t, const RunArgs& a) override {
    works_.push_back(t.run(a));
    ++issued_;
    if (works_.size() > kInFlight) completeOldest();
  }

  void complete() override {
    while (!works_.empty()) completeOldest();
  }

  void mark() override {
    const Clock::time_point now = Clock::now();
    marks_.push_back({issued_, now, false, now});
    ++pending_marks_;
    resolve(now);
  }

  std::vector<double> markTimes() override {
    std::vector<double> t;
    for (const Mark& m : marks_) t.push_back(std::chrono::duration<double>(m.done - origin_).count());
    marks_.clear();
    pending_marks_ = 0;
    return t;
  }
  const char* timingName() const override { return "host clock"; }

  int64_t memoryInUse() const override { return residentBytes(); }
  const char* memoryReportLabel() const override { return "Host memory usage"; }

 private:
  struct Mark {
    uint64_t position;  // collectives started before the mark
    Clock::time_point marked;
    bool resolved = false;
    Clock::time_point done = {};
  };
  // A mark's time: when everything before it had completed, not before it was taken.
  void resolve(Clock::time_point now) {
    for (Mark& m : marks_) {
      if (!m.resolved && m.position <= completed_) {
        m.resolved = true;
        --pending_marks_;
        m.done = std::max(m.marked, now);
      }
    }
  }

  void completeOldest() {
    works_.front()->wait();
    works_.pop_front();
    ++completed_;
    if (pending_marks_) resolve(Clock::now());
  }

  static constexpr size_t kInFlight = 64;
  std::shared_ptr<Communicator> comm_;
  Collectives& coll_;
  const bool symmetric_inputs_;
  std::unique_ptr<symm::SymmetricHeap> heap_;
  std::map<char*, std::shared_ptr<symm::SymmetricBuffer>> symmetric_;
  std::deque<WorkPtr> works_;
  uint64_t issued_ = 0, completed_ = 0;
  size_t pending_marks_ = 0;  // marks not yet resolved (no clock read per call without them)
  std::vector<Mark> marks_;
  const Clock::time_point origin_ = Clock::now();
};

}  // namespace

std::unique_ptr<RunBackend> makeHostBackend(std::shared_ptr<Communicator> comm, Collectives& coll,
                                            bool symmetric_inputs) {
  return std::make_unique<HostBackend>(std::move(comm), coll, symmetric_inputs);
}

}  // namespace crossbar::perf
