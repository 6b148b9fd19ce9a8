#include "telemetry/telemetry.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <utility>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"
#include "comm/store.h"

namespace crossbar::telemetry {

int64_t nowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

uint64_t hostRssBytes() {
  // statm is one short line; pread on a cached fd keeps the sample cheap. The fd names
  // the process that opened it, so a forked child reopens its own.
  static thread_local int fd = -1;
  static thread_local pid_t owner = 0;
  if (pid_t pid = ::getpid(); pid != owner) {
    if (fd >= 0) ::close(fd);
    fd = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
    owner = pid;
  }
  if (fd < 0) return 0;
  char buf[128];
  ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return 0;
  buf[n] = 0;
  unsigned long long size = 0, resident = 0;
  if (sscanf(buf, "%llu %llu", &size, &resident) != 2) return 0;
  static const long page = sysconf(_SC_PAGESIZE);
  return resident * uint64_t(page);
}

// Single-producer (the owning thread) / single-consumer (step(), under the mutex) ring.
struct Recorder::Ring {
  explicit Ring(size_t capacity) : mask(capacity - 1), slots(capacity) {}
  const size_t mask;
  std::vector<Record> slots;
  alignas(64) std::atomic<uint64_t> head{0};  // written by the producer
  alignas(64) std::atomic<uint64_t> tail{0};  // written by the consumer
  std::atomic<uint64_t> dropped{0};

  bool push(const Record& r) {
    uint64_t h = head.load(std::memory_order_relaxed);
    if (h - tail.load(std::memory_order_acquire) > mask) {
      dropped.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    slots[h & mask] = r;
    head.store(h + 1, std::memory_order_release);
    return true;
  }
  void drain(std::vector<Record>& out) {
    uint64_t t = tail.load(std::memory_order_relaxed);
    uint64_t h = head.load(std::memory_order_acquire);
    for (; t != h; ++t) out.push_back(slots[t & mask]);
    tail.store(t, std::memory_order_release);
  }
};

static void copyName(char* dst, size_t cap, std::string_view src) {
  size_t n = std::min(cap - 1, src.size());
  std::memcpy(dst, src.data(), n);
  dst[n] = 0;
}

static size_t roundPow2(size_t n) {
  size_t p = 16;
  while (p < n) p <<= 1;
  return p;
}

static std::string jsonEscape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;  // names never need control chars
    out += c;
  }
  return out;
}

std::string StepSummary::toJson() const {
  std::string line = fmt::format(
      "{{\"rank\":{},\"world\":{},\"step\":{},\"start_ns\":{},\"end_ns\":{},\"step_ns\":{},\"comm_ns\":{},"
      "\"wait_ns\":{},\"ops\":{},\"bytes\":{},\"dropped\":{},\"rss_max\":{},\"device_mem_max\":{},\"phases\":"
      "{{",
      rank, world_size, step, start_ns, end_ns, end_ns - start_ns, comm_ns, wait_ns, ops, bytes, dropped,
      rss_max, device_mem_max);
  for (size_t i = 0; i < phases.size(); ++i)
    line += fmt::format("{}\"{}\":{}", i ? "," : "", jsonEscape(phases[i].first), phases[i].second);
  line += "},\"waited_on\":{";
  for (size_t i = 0; i < waited_on.size(); ++i)
    line += fmt::format("{}\"{}\":{}", i ? "," : "", waited_on[i].first, waited_on[i].second);
  line += "}}";
  return line;
}

Recorder& Recorder::instance() {
  // Leaked on purpose: records may arrive from threads that outlive static destruction.
  static Recorder* recorder = new Recorder();
  return *recorder;
}

Recorder::Recorder() {
  Config c;
  c.enabled = env::getBool("CROSSBAR_TELEMETRY");
  c.dir = env::getString("CROSSBAR_TELEMETRY_DIR");
  c.ring_capacity = static_cast<size_t>(std::max<int64_t>(16, env::getInt("CROSSBAR_TELEMETRY_RING")));
  // Launchers export the rank before the communicator exists; setRank() refines it.
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"})
    if (const char* v = std::getenv(name)) {
      c.rank = std::atoi(v);
      break;
    }
  for (const char* name : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const char* v = std::getenv(name)) {
      c.world_size = std::max(1, std::atoi(v));
      break;
    }
  configure(std::move(c));
}

Recorder::~Recorder() {
  if (fd_ >= 0) ::close(fd_);
}

void Recorder::configure(Config config) {
  std::lock_guard<std::mutex> lock(mutex_);
  enabled_.store(false, std::memory_order_relaxed);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  config.ring_capacity = roundPow2(config.ring_capacity);
  config_ = std::move(config);
  rings_.clear();
  generation_.fetch_add(1, std::memory_order_release);
  history_.clear();
  last_records_.clear();
  step_ = 0;
  step_start_ns_ = nowNs();
  rss_max_.store(hostRssBytes(), std::memory_order_relaxed);
  device_max_.store(0, std::memory_order_relaxed);
  extra_dropped_.store(0, std::memory_order_relaxed);
  if (config_.enabled && !config_.dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(config_.dir, ec);
    std::string path = fmt::format("{}/rank{}.jsonl", config_.dir, config_.rank);
    // A fresh run starts a fresh file: stale steps would join with the new ones.
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0)
      throw SystemError(
          fmt::format("telemetry: cannot open {} for rank {}: {}; set CROSSBAR_TELEMETRY_DIR "
                      "to a writable directory",
                      path, config_.rank, std::strerror(errno)));
  }
  enabled_.store(config_.enabled, std::memory_order_release);
}

void Recorder::setRank(int rank, int world_size) {
  Config c;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (config_.rank == rank && config_.world_size == world_size) return;
    c = config_;
  }
  c.rank = rank;
  c.world_size = world_size;
  configure(std::move(c));
}

Config Recorder::config() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return config_;
}

void Recorder::attachStore(std::shared_ptr<Store> store) {
  std::lock_guard<std::mutex> lock(mutex_);
  store_ = std::move(store);
}

Recorder::Ring* Recorder::threadRing() {
  struct Local {
    std::shared_ptr<Ring> ring;
    uint64_t generation = 0;
  };
  static thread_local Local local;
  uint64_t gen = generation_.load(std::memory_order_acquire);
  if (local.generation != gen) [[unlikely]] {
    std::lock_guard<std::mutex> lock(mutex_);
    local.ring = std::make_shared<Ring>(config_.ring_capacity);
    local.generation = generation_.load(std::memory_order_relaxed);
    rings_.push_back(local.ring);
  }
  return local.ring.get();
}

uint64_t Recorder::recordOp(std::string_view coll, uint64_t bytes, std::string_view algo, int64_t enqueue_ns,
                            int64_t start_ns, int64_t end_ns, int64_t wait_ns, int last_peer) {
  return recordOp(coll, bytes, algo, -1, enqueue_ns, start_ns, end_ns, wait_ns, last_peer);
}

uint64_t Recorder::recordOp(std::string_view coll, uint64_t bytes, std::string_view algo, int64_t op_seq,
                            int64_t enqueue_ns, int64_t start_ns, int64_t end_ns, int64_t wait_ns, int last_peer) {
  if (!enabled()) return 0;
  Record r;
  r.op_seq = op_seq;
  r.kind = Kind::kOp;
  r.seq = seq_.fetch_add(1, std::memory_order_relaxed);
  r.bytes = bytes;
  r.enqueue_ns = enqueue_ns;
  r.start_ns = start_ns;
  r.end_ns = end_ns;
  r.wait_ns = wait_ns;
  r.last_peer = last_peer;
  copyName(r.name, sizeof(r.name), coll);
  copyName(r.algo, sizeof(r.algo), algo);
  threadRing()->push(r);
  return r.seq;
}

void Recorder::recordPhase(std::string_view name, int64_t start_ns, int64_t end_ns) {
  if (!enabled()) return;
  Record r;
  r.kind = Kind::kPhase;
  r.start_ns = start_ns;
  r.end_ns = end_ns;
  copyName(r.name, sizeof(r.name), name);
  threadRing()->push(r);
}

static void atomicMax(std::atomic<uint64_t>& a, uint64_t v) {
  uint64_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

void Recorder::noteDeviceMemory(uint64_t bytes) {
  if (enabled()) atomicMax(device_max_, bytes);
}

void Recorder::sampleMemory() {
  if (!enabled()) return;
  atomicMax(rss_max_, hostRssBytes());
  if (config_.device_memory) atomicMax(device_max_, config_.device_memory());
}

void Recorder::addFlushHook(const void* owner, std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  flush_hooks_.emplace_back(owner, std::move(hook));
}

void Recorder::removeFlushHook(const void* owner) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  std::erase_if(flush_hooks_, [&](const auto& h) { return h.first == owner; });
}

StepSummary Recorder::step() {
  StepSummary s;
  if (!enabled()) return s;
  {
    // Before mutex_: a hook records through recordOp, which may register a ring.
    std::lock_guard<std::mutex> lock(hooks_mutex_);
    for (auto& h : flush_hooks_) h.second();
  }
  sampleMemory();
  int64_t now = nowNs();
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Record> records;
  uint64_t dropped = 0;
  for (auto& ring : rings_) {
    ring->drain(records);
    dropped += ring->dropped.exchange(0, std::memory_order_relaxed);
  }
  dropped += extra_dropped_.exchange(0, std::memory_order_relaxed);
  s.rank = config_.rank;
  s.world_size = config_.world_size;
  s.step = step_;
  s.start_ns = step_start_ns_;
  s.end_ns = now;
  s.dropped = dropped;
  std::map<std::string, int64_t> phases;
  std::map<int, int64_t> waited_on;
  for (const auto& r : records) {
    if (r.kind == Kind::kOp) {
      s.ops++;
      s.bytes += r.bytes;
      s.comm_ns += r.end_ns - r.start_ns;
      s.wait_ns += r.wait_ns;
      if (r.last_peer >= 0) waited_on[r.last_peer] += r.wait_ns;
    } else {
      phases[r.name] += r.end_ns - r.start_ns;
    }
  }
  s.phases.assign(phases.begin(), phases.end());
  s.waited_on.assign(waited_on.begin(), waited_on.end());
  s.rss_max = rss_max_.exchange(hostRssBytes(), std::memory_order_relaxed);
  s.device_mem_max = device_max_.exchange(0, std::memory_order_relaxed);
  std::string line = s.toJson();
  if (fd_ >= 0) {
    std::string out = line + "\n";
    // One write per line: O_APPEND keeps lines whole; a crash leaves at most a torn last line.
    if (::write(fd_, out.data(), out.size()) != static_cast<ssize_t>(out.size()))
      CB_WARN("telemetry", "short write of step {} to rank{}.jsonl: {}", step_, config_.rank,
              std::strerror(errno));
  }
  if (store_) {
    try {
      store_->set(fmt::format("telemetry/{}/{}", config_.rank, step_), toBytes(line));
    } catch (const std::exception& e) {
      CB_WARN("telemetry", "publishing step {} to the store failed: {}", step_, e.what());
    }
  }
  last_records_ = std::move(records);
  history_.push_back(s);
  if (history_.size() > 1024) history_.erase(history_.begin());
  step_++;
  step_start_ns_ = now;
  return s;
}

std::vector<StepSummary> Recorder::history() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_;
}

std::vector<Record> Recorder::lastStepRecords() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_records_;
}

namespace {
thread_local OpWaits* tl_op_waits = nullptr;
}

OpWaits* currentOpWaits() {
  return tl_op_waits;
}

OpScope::OpScope(std::string_view coll, uint64_t bytes, std::string_view algo)
    : active_(Recorder::instance().enabled()), coll_(coll), algo_(algo), bytes_(bytes) {
  if (!active_) return;
  enqueue_ns_ = start_ns_ = nowNs();
  outer_ = std::exchange(tl_op_waits, &waits_);
}

OpScope::OpScope(std::string_view coll, uint64_t bytes, std::string_view algo, int64_t enqueue_ns,
                 int64_t op_seq, int self)
    : active_(Recorder::instance().enabled()), coll_(coll), algo_(algo), bytes_(bytes), op_seq_(op_seq),
      self_(self) {
  if (!active_) return;
  start_ns_ = nowNs();
  enqueue_ns_ = enqueue_ns > 0 ? enqueue_ns : start_ns_;
  outer_ = std::exchange(tl_op_waits, &waits_);
}

OpScope::~OpScope() {
  if (!active_) return;
  tl_op_waits = outer_;
  if (!explicit_wait_) {
    wait_ns_ = waits_.total_ns;
    last_peer_ = waits_.count ? waits_.longest_peer : self_;
  }
  Recorder::instance().recordOp(coll_, bytes_, algo_, op_seq_, enqueue_ns_, start_ns_, nowNs(), wait_ns_,
                                last_peer_);
}

Phase::Phase(std::string_view name) : active_(Recorder::instance().enabled()), name_(name) {
  if (active_) start_ns_ = nowNs();
}

Phase::~Phase() {
  if (!active_) return;
  auto& rec = Recorder::instance();
  rec.recordPhase(name_, start_ns_, nowNs());
  rec.sampleMemory();
}

}  // namespace crossbar::telemetry
