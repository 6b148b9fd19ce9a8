// Step-aligned, rank-aware telemetry.
//
// Every thread that records gets its own single-producer ring buffer; the hot path
// (recordOp, OpScope, Phase) takes no lock and allocates nothing. step() (called by
// the training loop once per step, on one thread) drains every ring, summarizes the
// step and appends one JSON line to CROSSBAR_TELEMETRY_DIR/rank<r>.jsonl. The
// aggregator (aggregate.h, and crossbar-report) joins the ranks' files afterwards.
//
// The collectives layer opens an OpScope per operation; the algorithms mark where they
// block on a peer with PeerWait, which the op's record sums into its wait time and its
// last-arriving peer.
//
//   auto& rec = telemetry::Recorder::instance();   // configured from CROSSBAR_TELEMETRY*
//   for (...) {
//     { telemetry::Phase p("data_loading"); batch = next(); }
//     { telemetry::Phase p("forward"); ... }
//     { telemetry::OpScope op("allreduce", bytes, "ring"); comm.allreduce(...); }
//     rec.step();
//   }
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace crossbar {
class Store;
}

namespace crossbar::telemetry {

// Monotonic clock shared by every process on the host (CLOCK_MONOTONIC), in ns.
int64_t nowNs();
// Host resident set size in bytes, from /proc/self/statm (0 when unavailable).
uint64_t hostRssBytes();

enum class Kind : uint8_t { kOp = 0, kPhase = 1 };

// One fixed-size record; names are truncated copies so a record owns no memory.
struct Record {
  Kind kind = Kind::kOp;
  int32_t last_peer = -1;  // op: the peer that arrived last (-1: unknown)
  uint64_t seq = 0;        // op: per-process sequence number
  int64_t op_seq = -1;     // op: the issuer's own sequence number (collectives: same on every rank)
  uint64_t bytes = 0;
  int64_t enqueue_ns = 0;  // op: when the call was made
  int64_t start_ns = 0;    // op: when data started moving / phase: begin
  int64_t end_ns = 0;
  int64_t wait_ns = 0;  // op: time spent waiting for the last peer
  char name[24] = {};   // op: collective / phase: phase name
  char algo[24] = {};
};

struct Config {
  bool enabled = false;
  int rank = 0;
  int world_size = 1;
  std::string dir;              // empty: keep summaries in memory only
  size_t ring_capacity = 8192;  // records per thread, rounded up to a power of two
  // Extra memory gauge (e.g. CUDA bytes in use) sampled with the host RSS; null: none.
  std::function<uint64_t()> device_memory;
};

// Per-step summary of one rank: what step() writes as one JSON line.
struct StepSummary {
  int rank = 0;
  int world_size = 1;
  uint64_t step = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  int64_t comm_ns = 0;  // sum of op durations (start..end)
  int64_t wait_ns = 0;  // sum of op waits
  uint64_t ops = 0;
  uint64_t bytes = 0;
  uint64_t dropped = 0;  // records lost to full rings during the step
  uint64_t rss_max = 0;  // host RSS high-water during the step
  uint64_t device_mem_max = 0;
  std::vector<std::pair<std::string, int64_t>> phases;  // name -> total ns within the step
  // Peer -> wait time of the ops that named it their last arrival (this rank included,
  // with 0 wait, for ops where nobody kept it waiting).
  std::vector<std::pair<int, int64_t>> waited_on;
  std::string toJson() const;
};

class Recorder {
 public:
  // The process-wide recorder, configured from the environment on first use.
  static Recorder& instance();

  // Reconfigures (tests, embedders that know their rank). Drops anything unflushed.
  void configure(Config config);
  // Rank and world size from a communicator-like source; keeps other settings.
  void setRank(int rank, int world_size);
  // Also publish each step's JSON line to `store` (key telemetry/<rank>/<step>) for
  // live aggregation on rank 0.
  void attachStore(std::shared_ptr<Store> store);

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  Config config() const;
  int rank() const { return config_.rank; }

  // Hot path: one record into the calling thread's ring. Returns the op's sequence number.
  uint64_t recordOp(std::string_view coll, uint64_t bytes, std::string_view algo, int64_t enqueue_ns,
                    int64_t start_ns, int64_t end_ns, int64_t wait_ns = 0, int last_peer = -1);
  void recordPhase(std::string_view name, int64_t start_ns, int64_t end_ns);
  // Same, with the issuer's sequence number (the collectives' per-communicator one).
  uint64_t recordOp(std::string_view coll, uint64_t bytes, std::string_view algo, int64_t op_seq,
                    int64_t enqueue_ns, int64_t start_ns, int64_t end_ns, int64_t wait_ns, int last_peer);
  // Samples host RSS (and the device gauge) into the current step's high-water mark.
  void sampleMemory();
  // A device-memory high-water measured by the caller (e.g. torch.cuda.max_memory_allocated)
  // for the current step.
  void noteDeviceMemory(uint64_t bytes);

  // Producers whose records are known only later (the CUDA collectives read their
  // events once the GPU ran them) register a hook that step() calls first, outside
  // the recorder's lock, to push what has finished. Keyed by `owner`; removal waits
  // for a running call of the hook.
  void addFlushHook(const void* owner, std::function<void()> hook);
  void removeFlushHook(const void* owner);
  // Records a producer lost without pushing them (counted in the step's `dropped`).
  void countDropped(uint64_t n) { extra_dropped_.fetch_add(n, std::memory_order_relaxed); }

  // Marks the end of the current step: runs the flush hooks, drains the rings, writes
  // the summary line.
  StepSummary step();
  uint64_t currentStep() const { return step_; }
  // Summaries of completed steps kept in memory (the last 1024).
  std::vector<StepSummary> history() const;
  // Records of the last completed step (for tests and tools).
  std::vector<Record> lastStepRecords() const;

  ~Recorder();

 private:
  Recorder();
  struct Ring;
  Ring* threadRing();

  std::atomic<bool> enabled_{false};
  Config config_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> rss_max_{0};
  std::atomic<uint64_t> device_max_{0};
  std::atomic<uint64_t> extra_dropped_{0};
  std::mutex hooks_mutex_;  // flush hooks; taken before (never inside) mutex_
  std::vector<std::pair<const void*, std::function<void()>>> flush_hooks_;
  std::atomic<uint64_t> generation_{1};  // bumps on configure(): threads re-register rings
  mutable std::mutex mutex_;             // rings list, file, history: never on the hot path
  std::vector<std::shared_ptr<Ring>> rings_;
  uint64_t step_ = 0;
  int64_t step_start_ns_ = 0;
  int fd_ = -1;
  std::shared_ptr<Store> store_;
  std::vector<StepSummary> history_;
  std::vector<Record> last_records_;
};

// What PeerWait scopes inside the running operation add up to.
struct OpWaits {
  int64_t total_ns = 0;    // time blocked on peers
  int64_t longest_ns = 0;  // the longest single wait
  int longest_peer = -1;   // ... and the peer it waited for
  int count = 0;
  void add(int64_t ns, int peer) {
    total_ns += ns;
    count++;
    if (ns >= longest_ns) longest_ns = ns, longest_peer = peer;
  }
};

// The wait accounting of the operation this thread is running (an OpScope), or null:
// PeerWait costs one thread-local load when no operation is being recorded.
OpWaits* currentOpWaits();

// RAII op record: enqueue/start at construction, end at destruction. Waits marked by
// PeerWait on this thread while the scope is open become the op's wait time; the peer
// of the longest one is the op's last arrival (this rank itself when it never blocked:
// every peer was there before it). setWait() overrides both.
class OpScope {
 public:
  OpScope(std::string_view coll, uint64_t bytes, std::string_view algo = {});
  // The collectives' form: `enqueue_ns` when the call was issued (start: now), `op_seq`
  // the issuer's sequence number, `self` this rank (named when nobody kept it waiting).
  OpScope(std::string_view coll, uint64_t bytes, std::string_view algo, int64_t enqueue_ns, int64_t op_seq,
          int self);
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;
  // Data started moving (default: construction time).
  void started() { start_ns_ = nowNs(); }
  void setWait(int64_t wait_ns, int last_peer = -1) {
    explicit_wait_ = true;
    wait_ns_ = wait_ns;
    last_peer_ = last_peer;
  }

 private:
  bool active_;
  bool explicit_wait_ = false;
  std::string_view coll_, algo_;
  uint64_t bytes_;
  int64_t enqueue_ns_ = 0, start_ns_ = 0, wait_ns_ = 0, op_seq_ = -1;
  int last_peer_ = -1, self_ = -1;
  OpWaits waits_;
  OpWaits* outer_ = nullptr;  // the enclosing scope's (restored at the end)
};

// Marks a blocking wait on `peer` inside a recorded operation (algorithms put one
// around the first wait for a peer's data or signal). `blocking` false (the data was
// already there) records nothing. The peer may be named later (setPeer), e.g. from the
// completed request's source.
class PeerWait {
 public:
  explicit PeerWait(int peer, bool blocking = true)
      : waits_(blocking ? currentOpWaits() : nullptr), peer_(peer) {
    if (waits_) start_ns_ = nowNs();
  }
  ~PeerWait() {
    if (waits_) waits_->add(nowNs() - start_ns_, peer_);
  }
  PeerWait(const PeerWait&) = delete;
  PeerWait& operator=(const PeerWait&) = delete;
  void setPeer(int peer) { peer_ = peer; }

 private:
  OpWaits* waits_;
  int peer_;
  int64_t start_ns_ = 0;
};

// RAII named phase ("data_loading", "forward", "backward", "optimizer"); samples memory
// at its end. The name must outlive the scope (string literals do).
class Phase {
 public:
  explicit Phase(std::string_view name);
  ~Phase();
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  bool active_;
  std::string_view name_;
  int64_t start_ns_ = 0;
};

}  // namespace crossbar::telemetry
