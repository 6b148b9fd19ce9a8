// The common driver: launching (self, mpirun, srun, torchrun), buffers, warm-up, timing
// loop, cross-rank time aggregation, data check, table and footer, exit status.
#include "perf/driver.h"

#include <fmt/format.h>
#include <strings.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>

#include "collectives/algorithms.h"
#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/local_launch.h"
#include "comm/topology.h"
#include "crossbar_build_info.h"
#include "perf/backend.h"

namespace crossbar::perf {
namespace {

using Clock = std::chrono::steady_clock;

bool launcherPresent() {
  auto has = [](const char* v) { return std::getenv(v) != nullptr; };
  return (has("RANK") && has("WORLD_SIZE")) || has("OMPI_COMM_WORLD_SIZE") ||
         (has("SLURM_PROCID") && has("SLURM_NTASKS") && has("SLURM_STEP_ID"));
}

std::string jsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out;
}

// nccl-tests' -J document, written the way its util.cu writes it (no spaces, "%lf"
// numbers, booleans as "true"/"false" strings), so tools reading its files read ours.
class JsonDoc {
 public:
  void key(const std::string& k) {
    comma();
    out_ += "\"" + jsonEscape(k) + "\":";
    after_key_ = true;
  }
  void str(const std::string& v) { value("\"" + jsonEscape(v) + "\""); }
  void boolean(bool v) { str(v ? "true" : "false"); }
  void integer(long long v) { value(std::to_string(v)); }
  void number(double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%lf", v);
    value(v != v ? std::string("\"nan\"") : std::string(buf));
  }
  void null() { value("null"); }
  void startObject() { open('{'); }
  void endObject() { close('}'); }
  void startList() { open('['); }
  void endList() { close(']'); }
  const std::string& text() const { return out_; }

 private:
  void comma() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (!first_.empty()) {
      if (!first_.back()) out_ += ',';
      first_.back() = false;
    }
  }
  void value(const std::string& v) {
    comma();
    out_ += v;
  }
  void open(char c) {
    comma();
    out_ += c;
    first_.push_back(true);
  }
  void close(char c) {
    first_.pop_back();
    out_ += c;
  }
  std::string out_;
  std::vector<bool> first_;
  bool after_key_ = false;
};

std::string localTimeString() {
  char buf[64];
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

// Opens path exclusively, or path.0, path.1, ... when it exists (nccl-tests' -J rule).
FILE* openExclusive(const std::string& path, std::string* used) {
  std::string tryPath = path;
  for (int i = 0; i < 1000; ++i) {
    FILE* f = std::fopen(tryPath.c_str(), "wx");
    if (f) {
      *used = tryPath;
      return f;
    }
    if (errno != EEXIST) return nullptr;
    tryPath = path + "." + std::to_string(i);
  }
  return nullptr;
}

bool secretVariable(const std::string& name) {
  for (const char* word : {"SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL"})
    if (name.find(word) != std::string::npos) return true;
  return false;
}

// One rank's identity, gathered to rank 0 for the "#  Rank" lines and the JSON devices.
struct RankInfo {
  int32_t rank = 0;
  int32_t pid = 0;
  int32_t device = -1;
  char host[64] = {};
  char device_text[160] = {};
};

struct PlacementResult {
  double usec = 0, algbw = 0, busbw = 0;
  long long wrong = -1;  // -1: not checked
  bool per_iter = false;
  IterStats stats;
  std::vector<double> iter_seconds;           // max over ranks per iteration
  std::vector<std::vector<double>> per_rank;  // each rank's own, for the JSON
};

class Runner {
 public:
  Runner(const CollTest& t, const Options& o, std::shared_ptr<Communicator> comm, std::string program,
         const std::vector<std::string>& args, int64_t rss_before_comm)
      : t_(t),
        o_(o),
        comm_(std::move(comm)),
        coll_(comm_),
        program_(std::move(program)),
        args_(args),
        rss_before_comm_(rss_before_comm) {
    rank_ = comm_->rank();
    n_ = comm_->size();
    if (o_.timeout_s > 0) copts_.timeout = Millis(int64_t{o_.timeout_s} * 1000);
    internal_.timeout = copts_.timeout;
    copts_.algorithm = o_.algo;
  }
  ~Runner() {
    if (backend_) {
      if (send_) backend_->release(send_);
      if (recv_) backend_->release(recv_);
    }
  }

  int run();

 private:
  void print(const std::string& s) {
    if (rank_ == 0) {
      std::fputs(s.c_str(), stdout);
      std::fflush(stdout);
    }
  }
  void printHeader(size_t max_bytes);
  void runTest(DataType type, std::optional<ReduceOp> op, int root);
  // One size, one placement: timing, then check.
  PlacementResult benchTime(DataType type, std::optional<ReduceOp> op, int root, size_t size, bool in_place);
  void pointers(const ByteCounts& bc, size_t es, size_t shift, bool in_place, const void** send, void** recv);
  void start(DataType type, std::optional<ReduceOp> op, int root, const ByteCounts& bc, size_t es,
             bool in_place, int iter);
  double reduceTime(double seconds);
  long long sumOverRanks(long long v);
  int64_t maxOverRanks(int64_t v);
  void barrier() { coll_.barrier(internal_)->wait(); }
  void jsonRecord(size_t bytes, size_t count, DataType type, const std::string& op, int root,
                  const PlacementResult* out_of_place, const PlacementResult* in_place);
  void jsonPlacement(const char* key, const PlacementResult& r);
  void jsonLine(const std::string& placement, bool in_place, size_t bytes, size_t count, DataType type,
                const std::string& op, int root, const PlacementResult& r);

  const CollTest& t_;
  const Options& o_;
  std::shared_ptr<Communicator> comm_;
  Collectives coll_;
  std::string program_;
  std::vector<std::string> args_;
  int64_t rss_before_comm_ = 0;
  std::unique_ptr<RunBackend> backend_;
  CollOptions copts_;     // the measured collective's
  CollOptions internal_;  // the driver's own (time and #wrong reductions): no forced algorithm
  int rank_ = 0, n_ = 1;
  char* send_ = nullptr;
  char* recv_ = nullptr;
  size_t buffer_bytes_ = 0;
  std::vector<char> host_view_;  // staging for buffers the host cannot touch
  size_t max_bytes_ = 0;
  size_t unalign_bytes_ = 0;  // -u: elements * element size of the current type
  int errors_ = 0;
  double bw_sum_ = 0;
  int bw_count_ = 0;
  uint64_t rep_ = 0;
  FILE* json_lines_ = nullptr;
  std::unique_ptr<JsonDoc> doc_;  // -J (rank 0)
  FILE* doc_file_ = nullptr;
};

double Runner::reduceTime(double seconds) {
  double v = seconds;
  ReduceOp op = ReduceOp::kSum;
  if (o_.average == 0) {
    v = rank_ == 0 ? seconds : 0.0;
  } else if (o_.average == 2) {
    op = ReduceOp::kMin;
  } else if (o_.average == 3) {
    op = ReduceOp::kMax;
  }
  coll_.allreduce(&v, &v, 1, DataType::kFloat64, op, internal_)->wait();
  return o_.average == 1 ? v / n_ : v;
}

long long Runner::sumOverRanks(long long v) {
  int64_t x = v;
  coll_.allreduce(&x, &x, 1, DataType::kInt64, ReduceOp::kSum, internal_)->wait();
  return x;
}

int64_t Runner::maxOverRanks(int64_t v) {
  coll_.allreduce(&v, &v, 1, DataType::kInt64, ReduceOp::kMax, internal_)->wait();
  return v;
}

void Runner::printHeader(size_t max_bytes) {
  std::string h;
  h += fmt::format("# Collective test starting: {}\n", program_);
  h += fmt::format(
      "# nThread {} nGpus {} minBytes {} maxBytes {} step: {}({}) warmup iters: {} iters: {} agg iters: {} "
      "validation: {} graph: {} unalign: {}\n",
      o_.nthreads, o_.ngpus, o_.min_bytes, max_bytes, o_.step_factor > 1 ? o_.step_factor : o_.step_bytes,
      o_.step_factor > 1 ? "factor" : "bytes", o_.warmup_iters, o_.iters, o_.agg_iters, o_.check,
      o_.cudagraph, o_.unalign);
  if (o_.blocking == 1) h += "# Blocking Enabled: wait and barrier after each inner iteration (-m) \n";
  if (o_.blocking == 2) h += "# Blocking Enabled: wait after each inner iteration (-m), no barrier \n";
  if (o_.blocking == 3)
    h += "# Blocking Enabled: wait and barrier after each outer iteration (-n); time excludes barrier \n";
  if (o_.per_iter_timing) {
    h += fmt::format("# Per-Iteration Report: {} timing; i_* uses max over process rows",
                     backend_->timingName());
    if (o_.per_iter_skip) h += fmt::format("; summary skips first {} iterations", o_.per_iter_skip);
    h += " \n";
  }
  h += fmt::format("# crossbar {}: memory {}, {} ranks on {} node(s), algorithm {}\n", CROSSBAR_VERSION,
                   backend_->memoryName(), n_, comm_->numNodes(),
                   o_.algo.empty() ? "auto (selection table)" : o_.algo);
  if (o_.cudagraph) h += "# Option -G (CUDA graph) has no effect in crossbar. Ignoring\n";
  const bool cuda = !std::strcmp(backend_->memoryName(), "cuda");
  if (cuda && o_.local_register == 2) {
    h += "# Buffers from the CUDA collectives' symmetric heap (-R 2): used in place, no staging copy\n";
  } else if (o_.local_register == 2) {
    h += "# Buffers from a symmetric heap over the communicator (-R 2): the one-node symmetric-memory "
         "algorithms read inputs in place\n";
  } else if (o_.local_register) {
    h += "# Option -R 1 (buffer registration) has no effect here (-R 2: symmetric buffers). Ignoring\n";
  }
  if (o_.cta_policy >= 0) h += "# Option -x (CTA policy) has no effect in crossbar. Ignoring\n";
  if (o_.stream_null && !cuda) h += "# Option -y (null stream) has no effect on host memory. Ignoring\n";
  if (o_.parallel_init) h += "# Option -p (parallel init) has no effect: one rank per process. Ignoring\n";
  h += "#\n# Using devices\n";
  print(h);

  // Every rank's line, gathered to rank 0 in rank order.
  RankInfo mine;
  mine.rank = rank_;
  mine.pid = static_cast<int32_t>(getpid());
  mine.device = backend_->deviceIndex();
  std::snprintf(mine.host, sizeof mine.host, "%s", hostName().c_str());
  std::snprintf(mine.device_text, sizeof mine.device_text, "%s", backend_->deviceDescription().c_str());
  std::vector<RankInfo> all(n_);
  coll_.allgather(&mine, all.data(), sizeof(RankInfo), DataType::kUInt8, internal_)->wait();
  std::string lines;
  for (const RankInfo& r : all)
    lines += fmt::format("#  Rank {:2} Group {:2} Pid {:6} on {:>10} device {}\n", r.rank, 0, r.pid, r.host,
                         r.device_text);
  // Processes sharing a GPU take turns on it (time slices) unless the MPS daemon runs: a
  // kernel that waits for another rank's kernel then waits out a slice, so small-message
  // times measure the scheduler (seen on one H200: 0.3-4.5 ms for every size below 128 KiB).
  if (cuda) {
    int sharing = 0;
    for (size_t i = 0; i < all.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (all[i].device == all[j].device && !std::strcmp(all[i].host, all[j].host)) {
          ++sharing;
          break;
        }
    if (sharing > 0)
      lines += fmt::format(
          "#  Note: {} rank(s) share a GPU with another rank on the same host; without MPS the GPU time-slices\n"
          "#  between processes, so small-message times measure its scheduler, not the collective.\n",
          sharing);
  }
  print(lines);

  if (doc_) {
    JsonDoc& d = *doc_;
    d.key("config");
    d.startObject();
    d.key("nthreads"), d.integer(o_.nthreads);
    d.key("ngpus"), d.integer(o_.ngpus);
    d.key("minimum_bytes"), d.integer(static_cast<long long>(o_.min_bytes));
    d.key("maximum_bytes"), d.integer(static_cast<long long>(max_bytes));
    if (o_.step_factor > 1) {
      d.key("step_factor"), d.integer(static_cast<long long>(o_.step_factor));
    } else {
      d.key("step_bytes"), d.integer(static_cast<long long>(o_.step_bytes));
    }
    d.key("warmup_iters"), d.integer(o_.warmup_iters);
    d.key("iterations"), d.integer(o_.iters);
    d.key("aggregated_iterations"), d.integer(o_.agg_iters);
    d.key("validation"), d.integer(o_.check);
    d.key("graph"), d.integer(o_.cudagraph);
    d.key("blocking_collectives"), d.boolean(o_.blocking != 0);
    d.key("per_iter_timing"), d.boolean(o_.per_iter_timing != 0);
    d.key("per_iter_skip"), d.integer(o_.per_iter_skip);
    d.key("parallel_init"), d.boolean(o_.parallel_init != 0);
    d.key("devices");
    d.startList();
    for (const RankInfo& r : all) {
      // device_hex / device_info split as nccl-tests parses "device %d [%s] %s".
      std::string text = r.device_text, hex, info = text;
      size_t lb = text.find('['), rb = text.find(']');
      if (lb != std::string::npos && rb != std::string::npos && rb > lb) {
        hex = text.substr(lb + 1, rb - lb - 1);
        info = rb + 2 <= text.size() ? text.substr(rb + 2) : "";
      }
      d.startObject();
      d.key("rank"), d.integer(r.rank);
      d.key("group"), d.integer(0);
      d.key("pid"), d.integer(r.pid);
      d.key("hostname"), d.str(r.host);
      d.key("device"), d.integer(r.device);
      d.key("device_hex"), d.str(hex);
      d.key("device_info"), d.str(info);
      d.endObject();
    }
    d.endList();
    d.key("crossbar");
    d.startObject();
    d.key("version"), d.str(CROSSBAR_VERSION);
    d.key("memory"), d.str(backend_->memoryName());
    d.key("nranks"), d.integer(n_);
    d.key("algorithm"), d.str(o_.algo.empty() ? "auto" : o_.algo);
    d.endObject();
    d.endObject();
  }
}

void Runner::pointers(const ByteCounts& bc, size_t es, size_t shift, bool in_place, const void** send,
                      void** recv) {
  char* r = recv_ + unalign_bytes_ + shift;
  if (in_place) {
    *send = r + bc.send_inplace_offset * es * rank_;
    *recv = r + bc.recv_inplace_offset * es * rank_;
  } else {
    *send = send_ + unalign_bytes_ + shift;
    *recv = r;
  }
}

void Runner::start(DataType type, std::optional<ReduceOp> op, int root, const ByteCounts& bc, size_t es,
                   bool in_place, int iter) {
  // Rotate through the buffer so consecutive iterations touch different memory, as
  // nccl-tests does (no all-in-cache best case).
  const size_t total = std::max(bc.send_count, bc.recv_count) * es;
  const size_t steps = total ? std::max<size_t>(1, max_bytes_ / total) : 1;
  const size_t shift = total * (static_cast<size_t>(iter) % steps);
  RunArgs a;
  a.coll = &coll_;
  pointers(bc, es, shift, in_place, &a.send, &a.recv);
  a.count = bc.param_count;
  a.type = type;
  a.op = op.value_or(ReduceOp::kSum);
  a.root = root < 0 ? 0 : root;
  a.options = copts_;
  if (a.op == ReduceOp::kPreMulSum) a.options.premul_scalar = premulScalar();
  backend_->start(t_, a);
  if (o_.blocking) backend_->complete();  // -z 1/2/3: wait for each collective
  if (o_.blocking == 1) barrier();
}

PlacementResult Runner::benchTime(DataType type, std::optional<ReduceOp> op, int root, size_t size,
                                  bool in_place) {
  const size_t es = elementSize(type);
  const ByteCounts bc = t_.byteCounts(size / es, n_);
  const size_t span = std::max(bc.send_count, bc.recv_count) * es;
  DataSpec spec;
  spec.type = type;
  spec.op = t_.reduction ? op : std::nullopt;
  spec.nranks = n_;
  spec.premul_scalar = premulScalar();

  auto init = [&](uint64_t seed) {
    spec.seed = seed;
    const void* s;
    void* r;
    pointers(bc, es, 0, in_place, &s, &r);
    backend_->zero(recv_ + unalign_bytes_, span);
    if (backend_->hostAccessible()) {
      fillInput(spec, rank_, 0, bc.send_count, const_cast<void*>(s));
    } else {
      host_view_.assign(bc.send_count * es, 0);
      fillInput(spec, rank_, 0, bc.send_count, host_view_.data());
      backend_->upload(const_cast<void*>(s), host_view_.data(), bc.send_count * es);
    }
  };
  if (o_.check) init(99);

  // One synchronizing run, then the timed loop (nccl-tests' BenchTime).
  start(type, op, root, bc, es, in_place, 0);
  backend_->complete();
  barrier();

  const bool per_iter = o_.per_iter_timing != 0;
  const bool paired = per_iter && o_.blocking == 3;  // marks around each iteration, barriers excluded
  double coll_only = 0;
  const auto t0 = Clock::now();
  for (int iter = 0; iter < o_.iters; ++iter) {
    const auto ti = o_.blocking == 3 ? Clock::now() : Clock::time_point{};  // a clock read per op costs small calls
    if (per_iter) backend_->mark();
    for (int a = 0; a < o_.agg_iters; ++a) start(type, op, root, bc, es, in_place, iter * o_.agg_iters + a);
    if (o_.blocking == 3) {
      backend_->complete();
      if (paired) backend_->mark();
      coll_only += std::chrono::duration<double>(Clock::now() - ti).count();
      barrier();
    }
  }
  if (per_iter && !paired) backend_->mark();
  const double ops = static_cast<double>(o_.iters) * o_.agg_iters;
  const double issued =
      (o_.blocking == 3 ? coll_only : std::chrono::duration<double>(Clock::now() - t0).count()) / ops;
  backend_->complete();
  double seconds =
      (o_.blocking == 3 ? coll_only : std::chrono::duration<double>(Clock::now() - t0).count()) / ops;
  // -C reports the issue time (nccl-tests' cputime), otherwise the completion time.
  seconds = reduceTime(o_.report_cputime ? issued : seconds);

  PlacementResult res;
  if (per_iter) {
    const std::vector<double> marks = backend_->markTimes();
    std::vector<double> mine(o_.iters, 0.0);
    for (int i = 0; i < o_.iters; ++i) {
      const size_t a = paired ? 2 * i : i, b = a + 1;
      if (b < marks.size()) mine[i] = std::max(0.0, marks[b] - marks[a]) / o_.agg_iters;
    }
    std::vector<double> all(static_cast<size_t>(n_) * o_.iters);
    coll_.allgather(mine.data(), all.data(), mine.size(), DataType::kFloat64, internal_)->wait();
    res.per_iter = true;
    res.iter_seconds.assign(o_.iters, 0.0);
    for (int r = 0; r < n_; ++r) {
      res.per_rank.emplace_back(all.begin() + static_cast<long>(r) * o_.iters,
                                all.begin() + static_cast<long>(r + 1) * o_.iters);
      for (int i = 0; i < o_.iters; ++i)
        res.iter_seconds[i] = std::max(res.iter_seconds[i], res.per_rank.back()[i]);
    }
    res.stats = computeIterStats(
        std::vector<double>(res.iter_seconds.begin() + o_.per_iter_skip, res.iter_seconds.end()));
  }

  computeBandwidth(t_, bc.param_count, es, seconds, n_, &res.algbw, &res.busbw);
  barrier();

  ++rep_;
  for (int c = 0; c < o_.check; ++c) {
    init(rep_ * 1000 + c);
    start(type, op, root, bc, es, in_place, 0);
    backend_->complete();
    const void* s;
    void* r;
    pointers(bc, es, 0, in_place, &s, &r);
    char* result = static_cast<char*>(r);
    const size_t result_bytes = bc.recv_count * es;
    if (!backend_->hostAccessible()) {
      host_view_.assign(std::max<size_t>(result_bytes, 1), 0);
      backend_->download(host_view_.data(), result, result_bytes);
      result = host_view_.data();
    }
    const int victim = t_.root_only_result ? root : n_ - 1;
    if (o_.inject_error && rank_ == victim && bc.recv_count > 0 && bc.param_count > 0) result[0] ^= 0x5A;
    long long wrong = static_cast<long long>(t_.check(spec, rank_, root, bc.param_count, result));
    res.wrong = sumOverRanks(wrong);
    if (res.wrong) break;
  }
  if (res.wrong > 0) ++errors_;
  bw_sum_ += res.busbw;
  ++bw_count_;
  res.usec = seconds * 1e6;
  return res;
}

void Runner::jsonPlacement(const char* key, const PlacementResult& r) {
  JsonDoc& d = *doc_;
  d.key(key);
  d.startObject();
  d.key(o_.report_cputime ? "cpu_time" : "time"), d.number(r.usec);
  d.key("alg_bw"), d.number(r.algbw);
  d.key("bus_bw"), d.number(r.busbw);
  d.key("nwrong");
  if (r.wrong >= 0) {
    d.number(static_cast<double>(r.wrong));
  } else {
    d.null();
  }
  d.endObject();
  if (!r.per_iter) return;
  d.key(std::string(key) + "_per_iter");
  d.startObject();
  d.key("skipped_iterations"), d.integer(o_.per_iter_skip);
  d.key("min_us"), d.number(r.stats.min * 1e6);
  d.key("max_us"), d.number(r.stats.max * 1e6);
  d.key("avg_us"), d.number(r.stats.avg * 1e6);
  d.key("p50_us"), d.number(r.stats.p50 * 1e6);
  d.key("p95_us"), d.number(r.stats.p95 * 1e6);
  d.key("p99_us"), d.number(r.stats.p99 * 1e6);
  d.key("stdev_us"), d.number(r.stats.stdev * 1e6);
  d.key("cv_pct"), d.number(r.stats.cvPercent());
  d.key("times_us");
  d.startList();
  for (double s : r.iter_seconds) d.number(s * 1e6);
  d.endList();
  if (r.per_rank.size() > 1) {
    d.key("per_process_max_times_us");
    d.startList();
    for (const auto& row : r.per_rank) {
      d.startList();
      for (double s : row) d.number(s * 1e6);
      d.endList();
    }
    d.endList();
  }
  d.endObject();
}

void Runner::jsonRecord(size_t bytes, size_t count, DataType type, const std::string& op, int root,
                        const PlacementResult* out_of_place, const PlacementResult* in_place) {
  JsonDoc& d = *doc_;
  d.startObject();
  d.key("size"), d.integer(static_cast<long long>(bytes));
  d.key("count"), d.integer(static_cast<long long>(count));
  d.key("type"), d.str(dataTypeName(type));
  d.key("redop"), d.str(op);
  d.key("root"), d.str(fmt::format("{:6}", root));
  if (out_of_place) {
    jsonPlacement("out_of_place", *out_of_place);
  } else {
    d.key("out_of_place"), d.null();
  }
  if (in_place) {
    jsonPlacement("in_place", *in_place);
  } else {
    d.key("in_place"), d.null();
  }
  d.key("actual_iterations"), d.integer(o_.iters);
  d.key("experiment_name"), d.str("");
  d.endObject();
}

void Runner::jsonLine(const std::string& placement, bool in_place, size_t bytes, size_t count, DataType type,
                      const std::string& op, int root, const PlacementResult& r) {
  if (!json_lines_) return;
  std::string rec = fmt::format(
      "{{\"collective\": \"{}\", \"bytes\": {}, \"count\": {}, \"type\": \"{}\", \"op\": \"{}\", \"root\": "
      "{}, "
      "\"placement\": \"{}\", \"in_place\": {}, \"time_us\": {:.3f}, \"algbw\": {:.6f}, \"busbw\": {:.6f}, "
      "\"wrong\": {}, \"nranks\": {}, \"algo\": \"{}\", \"mem\": \"{}\"",
      t_.name, bytes, count, dataTypeName(type), op, root, placement, in_place ? "true" : "false", r.usec,
      r.algbw, r.busbw, r.wrong < 0 ? std::string("null") : std::to_string(r.wrong), n_,
      jsonEscape(o_.algo.empty() ? "auto" : o_.algo), backend_->memoryName());
  if (r.per_iter)
    rec += fmt::format(
        ", \"iter_min_us\": {:.3f}, \"iter_max_us\": {:.3f}, \"iter_p99_us\": {:.3f}, "
        "\"iter_cv_pct\": {:.3f}",
        r.stats.min * 1e6, r.stats.max * 1e6, r.stats.p99 * 1e6, r.stats.cvPercent());
  std::fprintf(json_lines_, "%s}\n", rec.c_str());
  std::fflush(json_lines_);
}

void Runner::runTest(DataType type, std::optional<ReduceOp> op, int root) {
  const size_t es = elementSize(type);
  unalign_bytes_ = static_cast<size_t>(o_.unalign) * es;
  // Warm-up at every size from min to max by factors of 2 (out of place), as nccl-tests.
  for (size_t size = o_.min_bytes; size <= max_bytes_; size = std::max<size_t>(size * 2, size + 1)) {
    const ByteCounts bc = t_.byteCounts(size / es, n_);
    for (int i = 0; i < o_.warmup_iters; ++i) start(type, op, root, bc, es, false, i);
    backend_->complete();
  }
  const std::string op_name = opDisplayName(t_.reduction ? op : std::nullopt);
  const int shown_root = t_.rooted ? root : -1;
  long repeat = o_.run_cycles;
  do {
    for (size_t size = o_.min_bytes; size <= max_bytes_;) {
      const ByteCounts bc = t_.byteCounts(size / es, n_);
      const size_t bytes = std::max(bc.send_count, bc.recv_count) * es;
      std::string row = rowPrefix(bytes, bc.param_count, dataTypeName(type), op_name, shown_root);
      std::string skipped = fmt::format("  {:>7}  {:>6}  {:>6}  {:>6}", "N/A", "N/A", "N/A", "N/A");
      if (o_.per_iter_timing)
        skipped += fmt::format("  {:>7}  {:>7}  {:>7}  {:>7}", "N/A", "N/A", "N/A", "N/A");
      std::optional<PlacementResult> out, in;
      if (o_.in_place != 1) {
        out = benchTime(type, op, root, size, false);
        row += rowColumns(out->usec, out->algbw, out->busbw, o_.check ? out->wrong : -1);
        if (out->per_iter) row += perIterColumns(out->stats);
        jsonLine("out-of-place", false, bytes, bc.param_count, type, op_name, shown_root, *out);
      } else {
        row += skipped;
      }
      if (o_.in_place != 2) {
        in = benchTime(type, op, root, size, true);
        row += rowColumns(in->usec, in->algbw, in->busbw, o_.check ? in->wrong : -1);
        if (in->per_iter) row += perIterColumns(in->stats);
        jsonLine("in-place", true, bytes, bc.param_count, type, op_name, shown_root, *in);
      } else {
        row += skipped;
      }
      if (o_.report_timestamps) row += timestampColumn();
      print(row + "\n");
      if (doc_)
        jsonRecord(bytes, bc.param_count, type, op_name, shown_root, out ? &*out : nullptr,
                   in ? &*in : nullptr);
      size_t next = o_.step_factor > 1 ? size * o_.step_factor : size + o_.step_bytes;
      if (next <= size) next = size + 1;  // -b 0 -f 2 must still advance
      size = next;
    }
  } while (--repeat);
}

int Runner::run() {
  if (rank_ == 0 && !o_.output_file.empty()) {
    // nccl-tests infers the format from the suffix; only .json is written.
    const size_t dot = o_.output_file.rfind('.'), slash = o_.output_file.rfind('/');
    const bool json = dot != std::string::npos && (slash == std::string::npos || dot > slash) &&
                      strcasecmp(o_.output_file.c_str() + dot + 1, "json") == 0;
    if (json) {
      std::string used;
      doc_file_ = openExclusive(o_.output_file, &used);
      if (!doc_file_) {
        print(fmt::format("# skipping json output; {} not accessible\n", o_.output_file));
      } else {
        print(fmt::format("# Writing JSON output to {}\n", used));
        doc_ = std::make_unique<JsonDoc>();
        doc_->startObject();
        doc_->key("version"), doc_->integer(3);
        doc_->key("start_time"), doc_->str(localTimeString());
        doc_->key("args");
        doc_->startList();
        for (const std::string& a : args_) doc_->str(a);
        doc_->endList();
        doc_->key("env");
        doc_->startList();
        for (char** e = environ; e && *e; ++e) {
          std::string kv = *e;
          const std::string name = kv.substr(0, kv.find('='));
          doc_->str(secretVariable(name) ? name + "=(hidden)" : kv);
        }
        doc_->endList();
        doc_->key("nccl_version"), doc_->integer(0);  // crossbar's own collectives, not NCCL's
      }
    } else {
      print(fmt::format("# -J {}: only a .json suffix is supported; no output file is written\n",
                        o_.output_file));
    }
  }

  backend_ = o_.mem == "cuda" ? makeCudaBackend(comm_, o_) : makeHostBackend(comm_, coll_, o_.local_register == 2);
  const int64_t mem_after_init = backend_->memoryInUse();

  max_bytes_ = o_.max_bytes;
  if (!std::strcmp(backend_->memoryName(), "host")) {
    // Leave room for every local rank's send and receive buffers.
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) {
      const double mem = static_cast<double>(pages) * page * 0.8 / std::max(1, comm_->localSize());
      if (2.0 * max_bytes_ > mem) {
        max_bytes_ = static_cast<size_t>(mem / 2) & ~size_t{4095};
        print(fmt::format("#\n# Reducing maxBytes to {} due to memory limitation\n", max_bytes_));
      }
    }
  }
  printHeader(max_bytes_);
  buffer_bytes_ = max_bytes_ + 8 * static_cast<size_t>(o_.unalign);  // -u padding, as nccl-tests
  send_ = backend_->allocate(buffer_bytes_);
  recv_ = backend_->allocate(buffer_bytes_);
  const int64_t mem_after_buffers = backend_->memoryInUse();
  if (rank_ == 0 && !o_.json_lines.empty()) {
    json_lines_ = std::fopen(o_.json_lines.c_str(), "w");
    if (!json_lines_)
      throw InvalidArgument(
          fmt::format("perf: cannot open --json file {}: {}", o_.json_lines, std::strerror(errno)));
  }
  print("#\n" + tableHeader(o_.report_cputime != 0, o_.report_timestamps != 0, o_.per_iter_timing != 0));
  if (doc_) {
    doc_->key("results");
    doc_->startList();
  }

  const std::string unsupported = t_.unsupported(n_);
  if (!unsupported.empty()) {
    print(unsupported + "\n");
  } else {
    if (t_.rooted && !o_.all_roots && o_.root >= n_)
      throw InvalidArgument(fmt::format("perf: root {} is out of range for {} ranks (-r 0..{} or -r all)",
                                        o_.root, n_, n_ - 1));
    std::vector<int> roots;
    if (!t_.rooted) {
      roots.push_back(-1);
    } else if (o_.all_roots) {
      for (int r = 0; r < n_; ++r) roots.push_back(r);
    } else {
      roots.push_back(o_.root);
    }
    std::vector<std::optional<ReduceOp>> ops;
    if (t_.reduction) {
      for (ReduceOp op : o_.ops) ops.push_back(op);
    } else {
      ops.push_back(std::nullopt);
    }
    for (DataType type : o_.types) {
      for (const auto& op : ops) {
        if (op && !isSupported(type, *op)) {
          continue;  // "all" means every supported pair (explicit pairs are refused up front)
        }
        for (int root : roots) runTest(type, op, root);
      }
    }
  }

  if (json_lines_) std::fclose(json_lines_);
  const int64_t mem_after_tests = backend_->memoryInUse();
  const double avg_bw = bw_count_ ? bw_sum_ / bw_count_ : 0.0;
  const char* min_env = std::getenv("NCCL_TESTS_MIN_BW");
  const double min_bw = min_env ? std::atof(min_env) : -1.0;
  const bool bw_failed = min_bw >= 0 && avg_bw < min_bw * 0.9;
  print(fmt::format("# Out of bounds values : {} {}\n", errors_, errors_ ? "FAILED" : "OK"));
  char line[128];
  std::snprintf(line, sizeof line, "# Avg bus bandwidth    : %g %s\n", avg_bw,
                min_bw < 0 ? "" : (bw_failed ? "FAILED" : "OK"));
  print(line);
  print("#\n");
  print(fmt::format("# Collective test concluded: {}\n", program_));
  if (o_.memory_report) {
    // nccl-tests' three amounts, max over ranks: communicator setup, the test buffers,
    // and what the collectives kept allocated while running.
    const int64_t init = maxOverRanks(mem_after_init - rss_before_comm_);
    const int64_t user = maxOverRanks(mem_after_buffers - mem_after_init);
    const int64_t collective = maxOverRanks(mem_after_tests - mem_after_buffers);
    print(fmt::format("# {:<20} : Initialization {} | User-Allocated {} | Collective {} | Total  {}\n",
                      backend_->memoryReportLabel(), memoryString(init), memoryString(user),
                      memoryString(collective), memoryString(init + user + collective)));
  }
  print("#\n\n");

  if (doc_) {
    JsonDoc& d = *doc_;
    d.endList();
    d.key("out_of_bounds");
    d.startObject();
    d.key("count"), d.integer(errors_);
    d.key("okay"), d.boolean(errors_ == 0);
    d.endObject();
    d.key("average_bus_bandwidth");
    d.startObject();
    d.key("bandwidth"), d.number(avg_bw);
    d.key("okay");
    if (min_bw < 0) {
      d.str("unchecked");
    } else {
      d.boolean(!bw_failed);
    }
    d.endObject();
    d.key("errors");
    d.startList();
    d.endList();
    d.key("end_time"), d.str(localTimeString());
    d.endObject();
    std::fputs(d.text().c_str(), doc_file_);
    std::fclose(doc_file_);
    doc_file_ = nullptr;
  }
  return (errors_ || bw_failed) ? 1 : 0;
}

int runRank(const CollTest& t, const Options& o, std::shared_ptr<Communicator> comm,
            const std::string& program, const std::vector<std::string>& args, int64_t rss_before_comm) {
  int rc = 0;
  {
    Runner runner(t, o, comm, program, args, rss_before_comm);
    rc = runner.run();
  }
  comm->destroy();
  return rc;
}

}  // namespace

int perfMain(const std::string& coll_name, int argc, char** argv) {
  setlinebuf(stdout);
  const std::string program = coll_name + "_perf";
  const CollTest* t = findCollTest(coll_name);
  if (!t) {
    std::fprintf(stderr, "%s: unknown collective %s\n", program.c_str(), coll_name.c_str());
    return 2;
  }
  const std::vector<std::string> args(argv, argv + argc);
  Options o;
  try {
    o = parseOptions(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\nRun '%s --help' for the options.\n", program.c_str(), e.message.c_str(),
                 program.c_str());
    return 2;
  }
  if (o.help) {
    std::fputs(usage(program).c_str(), stdout);
    return 0;
  }
  for (const std::string& note : o.notes) std::fprintf(stderr, "%s\n", note.c_str());
  if (o.mem == "cuda") {
    // Probed before any rank starts, so a machine without a GPU gets one clear message.
    const std::string reason = cudaUnavailableReason();
    if (!reason.empty()) {
      std::fprintf(stderr, "%s: --mem cuda: %s; use --mem host\n", program.c_str(), reason.c_str());
      return 2;
    }
  }
  if (o.nthreads != 1 || o.ngpus != 1) {
    std::fprintf(stderr,
                 "%s: -t/-g must be 1: crossbar runs one rank per process; use --nranks N or a launcher "
                 "(mpirun -np N)\n",
                 program.c_str());
    return 2;
  }
  if (t->reduction && !o.all_ops && !o.all_types) {
    for (DataType type : o.types)
      for (ReduceOp op : o.ops)
        if (!isSupported(type, op)) {
          std::fprintf(stderr, "%s: -o %s is not supported for -d %s (floating-point types only)\n",
                       program.c_str(), opDisplayName(op).c_str(), dataTypeName(type));
          return 2;
        }
  }
  if (!o.algo.empty()) {
    std::string coll = coll_name.rfind("all_", 0) == 0 ? "all" + coll_name.substr(4) : coll_name;
    CollType ct;
    if (!parseCollType(coll, &ct) ||
        (ct != CollType::kAllreduce && ct != CollType::kAllgather && ct != CollType::kReduceScatter &&
         ct != CollType::kAlltoall && ct != CollType::kBroadcast && ct != CollType::kReduce &&
         ct != CollType::kGather && ct != CollType::kScatter)) {
      std::fprintf(stderr, "%s: --algo does not apply: %s is built from point-to-point operations\n",
                   program.c_str(), coll_name.c_str());
      return 2;
    }
    if (!findAlgorithm(ct, o.algo)) {
      std::string names;
      for (const Algorithm& a : algorithms())
        if (a.coll == ct) names += (names.empty() ? "" : ", ") + a.name;
      std::fprintf(stderr, "%s: --algo %s is not an algorithm of %s; choices: %s\n", program.c_str(),
                   o.algo.c_str(), collTypeName(ct), names.c_str());
      return 2;
    }
  }
  CommOptions copts;
  if (o.ranks_per_node > 0) {
    setenv("CROSSBAR_RANKS_PER_NODE", std::to_string(o.ranks_per_node).c_str(), 1);
    copts.ranks_per_node = o.ranks_per_node;
  }
  try {
    if (o.nranks > 0 || !launcherPresent()) {
      const int n = o.nranks > 0 ? o.nranks : 1;
      auto exits = launchLocalRanks(n, [&](int rank, int size, std::shared_ptr<Store> store) {
        const int64_t rss = residentBytes();
        auto comm = Communicator::create(std::move(store), rank, size, copts);
        // CROSSBAR_BIND, as under a launcher.
        bindThisProcess(comm->machineLocalRank(), comm->machineLocalSize());
        return runRank(*t, o, comm, program, args, rss);
      });
      return combinedExitCode(exits);
    }
    const int64_t rss = residentBytes();
    return runRank(*t, o, Communicator::fromEnvironment(copts), program, args, rss);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(), e.what());
    return 1;
  }
}

}  // namespace crossbar::perf
