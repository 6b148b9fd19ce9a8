// The common driver: launching (self, mpirun, srun, torchrun), buffers, warm-up, timing
// loop, cross-rank time aggregation, data check, table and footer, exit status.
#include "perf/driver.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "collectives/algorithms.h"
#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/local_launch.h"
#include "comm/topology.h"
#include "crossbar_build_info.h"

namespace crossbar::perf {
namespace {

using Clock = std::chrono::steady_clock;

// Page-aligned, pre-touched host buffer (first-touch faults stay out of the timing).
struct HostBuffer {
  char* data = nullptr;
  size_t bytes = 0;
  explicit HostBuffer(size_t n) : bytes(std::max<size_t>(n, 4096)) {
    bytes = (bytes + 4095) & ~size_t{4095};
    data = static_cast<char*>(std::aligned_alloc(4096, bytes));
    if (!data) throw SystemError(fmt::format("perf: cannot allocate {} bytes of host memory", bytes));
    std::memset(data, 0, bytes);
  }
  ~HostBuffer() { std::free(data); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
};

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

struct Result {
  std::string record;  // JSON object
  double busbw = 0;
  bool wrong = false;
};

class Runner {
 public:
  Runner(const CollTest& t, const Options& o, std::shared_ptr<Communicator> comm, std::string program)
      : t_(t), o_(o), comm_(std::move(comm)), coll_(comm_), program_(std::move(program)) {
    rank_ = comm_->rank();
    n_ = comm_->size();
    if (o_.timeout_s > 0) copts_.timeout = Millis(int64_t{o_.timeout_s} * 1000);
    internal_.timeout = copts_.timeout;
    copts_.algorithm = o_.algo;
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
  bool runTest(DataType type, std::optional<ReduceOp> op, int root);
  // One size, one placement: timing, then check. Returns the row's columns.
  std::string benchTime(DataType type, std::optional<ReduceOp> op, int root, size_t size, bool in_place);
  void pointers(const ByteCounts& bc, size_t es, size_t shift, bool in_place, const void** send, void** recv);
  WorkPtr start(DataType type, std::optional<ReduceOp> op, int root, const ByteCounts& bc, size_t es,
                bool in_place, int iter);
  double reduceTime(double seconds);
  long long sumOverRanks(long long v);

  const CollTest& t_;
  const Options& o_;
  std::shared_ptr<Communicator> comm_;
  Collectives coll_;
  std::string program_;
  CollOptions copts_;     // the measured collective's
  CollOptions internal_;  // the driver's own (time and #wrong reductions): no forced algorithm
  int rank_ = 0, n_ = 1;
  std::unique_ptr<HostBuffer> send_, recv_;
  size_t max_bytes_ = 0;
  int errors_ = 0;
  double bw_sum_ = 0;
  int bw_count_ = 0;
  uint64_t rep_ = 0;
  std::vector<std::string> records_;
  FILE* json_lines_ = nullptr;
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

void Runner::printHeader(size_t max_bytes) {
  std::string h;
  h += fmt::format("# Collective test starting: {}\n", program_);
  h += fmt::format(
      "# nThread {} nGpus {} minBytes {} maxBytes {} step: {}({}) warmup iters: {} iters: {} agg iters: {} "
      "validation: {} graph: {}\n",
      o_.nthreads, o_.ngpus, o_.min_bytes, max_bytes, o_.step_factor > 1 ? o_.step_factor : o_.step_bytes,
      o_.step_factor > 1 ? "factor" : "bytes", o_.warmup_iters, o_.iters, o_.agg_iters, o_.check,
      o_.cudagraph);
  if (o_.blocking) h += "# Blocking Enabled: wait for completion and barrier after each collective \n";
  h += fmt::format("# crossbar {}: memory host, {} ranks on {} node(s), algorithm {}\n", CROSSBAR_VERSION, n_,
                   comm_->numNodes(), o_.algo.empty() ? "auto (selection table)" : o_.algo);
  if (o_.cudagraph) h += "# Option -G (CUDA graph) has no effect on host memory. Ignoring\n";
  if (o_.local_register) h += "# Option -R (buffer registration) has no effect on host memory. Ignoring\n";
  if (o_.cta_policy >= 0) h += "# Option -x (CTA policy) has no effect on host memory. Ignoring\n";
  h += "#\n# Using devices\n";
  print(h);

  // Every rank's line, gathered to rank 0 in rank order.
  constexpr size_t kLine = 256;
  char line[kLine] = {};
  std::snprintf(line, kLine,
                "#  Rank %2d Group %2d Pid %6d on %10s device cpu [node %d] host memory, local rank %d/%d\n",
                rank_, 0, static_cast<int>(getpid()), hostName().c_str(), comm_->node(), comm_->localRank(),
                comm_->localSize());
  std::vector<char> all(kLine * n_);
  coll_.allgather(line, all.data(), kLine, DataType::kUInt8, internal_)->wait();
  std::string lines;
  for (int r = 0; r < n_; ++r)
    lines += std::string(all.data() + r * kLine, strnlen(all.data() + r * kLine, kLine));
  print(lines);
}

void Runner::pointers(const ByteCounts& bc, size_t es, size_t shift, bool in_place, const void** send,
                      void** recv) {
  char* r = recv_->data + shift;
  if (in_place) {
    *send = r + bc.send_inplace_offset * es * rank_;
    *recv = r + bc.recv_inplace_offset * es * rank_;
  } else {
    *send = send_->data + shift;
    *recv = r;
  }
}

WorkPtr Runner::start(DataType type, std::optional<ReduceOp> op, int root, const ByteCounts& bc, size_t es,
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
  WorkPtr w = t_.run(a);
  if (o_.blocking) {
    w->wait();
    coll_.barrier(internal_)->wait();
  }
  return w;
}

std::string Runner::benchTime(DataType type, std::optional<ReduceOp> op, int root, size_t size,
                              bool in_place) {
  const size_t es = elementSize(type);
  const ByteCounts bc = t_.byteCounts(size / es, n_);
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
    std::memset(recv_->data, 0, std::max(bc.send_count, bc.recv_count) * es);
    fillInput(spec, rank_, 0, bc.send_count, const_cast<void*>(s));
  };
  if (o_.check) init(99);

  // One synchronizing run, then the timed loop.
  start(type, op, root, bc, es, in_place, 0)->wait();
  comm_->barrier();
  // Like nccl-tests: issue every iteration, then wait; -C reports the issue time.
  std::vector<WorkPtr> works;
  works.reserve(static_cast<size_t>(o_.iters) * o_.agg_iters);
  const auto t0 = Clock::now();
  for (int iter = 0; iter < o_.iters * o_.agg_iters; ++iter)
    works.push_back(start(type, op, root, bc, es, in_place, iter));
  const double issued = std::chrono::duration<double>(Clock::now() - t0).count();
  for (auto& w : works) w->wait();
  const double total = std::chrono::duration<double>(Clock::now() - t0).count();
  works.clear();
  double seconds = (o_.report_cputime ? issued : total) / (static_cast<double>(o_.iters) * o_.agg_iters);
  seconds = reduceTime(seconds);

  double algbw = 0, busbw = 0;
  computeBandwidth(t_, bc.param_count, es, seconds, n_, &algbw, &busbw);
  comm_->barrier();

  long long wrong = -1;
  ++rep_;
  for (int c = 0; c < o_.check; ++c) {
    init(rep_ * 1000 + c);
    start(type, op, root, bc, es, in_place, 0)->wait();
    const void* s;
    void* r;
    pointers(bc, es, 0, in_place, &s, &r);
    char* result = static_cast<char*>(r);
    const int victim = t_.root_only_result ? root : n_ - 1;
    if (o_.inject_error && rank_ == victim && bc.recv_count > 0 && bc.param_count > 0) result[0] ^= 0x5A;
    long long mine = static_cast<long long>(t_.check(spec, rank_, root, bc.param_count, result));
    wrong = sumOverRanks(mine);
    if (wrong) break;
  }
  if (wrong > 0) ++errors_;
  bw_sum_ += busbw;
  ++bw_count_;

  const double usec = seconds * 1e6;
  if (rank_ == 0) {
    std::string rec = fmt::format(
        "{{\"collective\": \"{}\", \"bytes\": {}, \"count\": {}, \"type\": \"{}\", \"op\": \"{}\", \"root\": "
        "{}, "
        "\"placement\": \"{}\", \"in_place\": {}, \"time_us\": {:.3f}, \"algbw\": {:.6f}, \"busbw\": {:.6f}, "
        "\"wrong\": {}, \"nranks\": {}, \"algo\": \"{}\", \"mem\": \"host\"}}",
        t_.name, std::max(bc.send_count, bc.recv_count) * es, bc.param_count, dataTypeName(type),
        opDisplayName(spec.op), root, in_place ? "in-place" : "out-of-place", in_place ? "true" : "false",
        usec, algbw, busbw, wrong < 0 ? std::string("null") : std::to_string(wrong), n_,
        jsonEscape(o_.algo.empty() ? "auto" : o_.algo));
    records_.push_back(rec);
    if (json_lines_) {
      std::fprintf(json_lines_, "%s\n", rec.c_str());
      std::fflush(json_lines_);
    }
  }
  return rowColumns(usec, algbw, busbw, wrong);
}

bool Runner::runTest(DataType type, std::optional<ReduceOp> op, int root) {
  const size_t es = elementSize(type);
  // Warm-up at the largest and the smallest size (out of place).
  for (size_t size : {max_bytes_, o_.min_bytes}) {
    const ByteCounts bc = t_.byteCounts(size / es, n_);
    std::vector<WorkPtr> works;
    for (int i = 0; i < o_.warmup_iters; ++i) works.push_back(start(type, op, root, bc, es, false, i));
    for (auto& w : works) w->wait();
  }
  long repeat = o_.run_cycles;
  do {
    for (size_t size = o_.min_bytes; size <= max_bytes_;) {
      const ByteCounts bc = t_.byteCounts(size / es, n_);
      std::string row =
          rowPrefix(std::max(bc.send_count, bc.recv_count) * es, bc.param_count, dataTypeName(type),
                    opDisplayName(t_.reduction ? op : std::nullopt), t_.rooted ? root : -1);
      const std::string skipped = fmt::format("  {:>7}  {:>6}  {:>6}  {:>5}", "N/A", "N/A", "N/A", "N/A");
      row += o_.in_place == 1 ? skipped : benchTime(type, op, root, size, false);
      row += o_.in_place == 2 ? skipped : benchTime(type, op, root, size, true);
      print(row + "\n");
      size_t next = o_.step_factor > 1 ? size * o_.step_factor : size + o_.step_bytes;
      if (next <= size) next = size + 1;  // -b 0 -f 2 must still advance
      size = next;
    }
  } while (--repeat);
  return true;
}

int Runner::run() {
  max_bytes_ = o_.max_bytes;
  // Leave room for every local rank's send and receive buffers.
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    const double mem = static_cast<double>(pages) * page * 0.8 / std::max(1, comm_->localSize());
    if (2.0 * max_bytes_ > mem) {
      max_bytes_ = static_cast<size_t>(mem / 2) & ~size_t{4095};
      print(fmt::format("#\n# Reducing maxBytes to {} due to memory limitation\n", max_bytes_));
    }
  }
  printHeader(max_bytes_);
  send_ = std::make_unique<HostBuffer>(max_bytes_);
  recv_ = std::make_unique<HostBuffer>(max_bytes_);
  if (rank_ == 0 && !o_.json_lines.empty()) {
    json_lines_ = std::fopen(o_.json_lines.c_str(), "w");
    if (!json_lines_)
      throw InvalidArgument(
          fmt::format("perf: cannot open --json file {}: {}", o_.json_lines, std::strerror(errno)));
  }
  print("#\n" + tableHeader(o_.report_cputime != 0));

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
  print(fmt::format("# Collective test concluded: {}\n\n", program_));

  if (rank_ == 0 && !o_.output_file.empty()) {
    FILE* f = std::fopen(o_.output_file.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "%s: cannot write -J file %s: %s\n", program_.c_str(), o_.output_file.c_str(),
                   std::strerror(errno));
    } else {
      std::fprintf(f, "{\n  \"program\": \"%s\",\n  \"nranks\": %d,\n  \"results\": [\n", program_.c_str(),
                   n_);
      for (size_t i = 0; i < records_.size(); ++i)
        std::fprintf(f, "    %s%s\n", records_[i].c_str(), i + 1 < records_.size() ? "," : "");
      std::fprintf(f, "  ],\n  \"out_of_bounds\": %d,\n  \"avg_busbw\": %g\n}\n", errors_, avg_bw);
      std::fclose(f);
    }
  }
  return (errors_ || bw_failed) ? 1 : 0;
}

int runRank(const CollTest& t, const Options& o, std::shared_ptr<Communicator> comm,
            const std::string& program) {
  int rc = 0;
  {
    Runner runner(t, o, comm, program);
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
  if (o.mem == "cuda") {
    std::fprintf(
        stderr,
        CROSSBAR_CUDA_ENABLED
            ? "%s: --mem cuda is not available yet in the perf binaries; use --mem host\n"
            : "%s: --mem cuda: this crossbar was built without CUDA (CROSSBAR_WITH_CUDA=OFF or no toolkit); "
              "use --mem host\n",
        program.c_str());
    return 2;
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
        auto comm = Communicator::create(std::move(store), rank, size, copts);
        bindThisProcess(comm->localRank(), comm->localSize());  // CROSSBAR_BIND, as under a launcher
        return runRank(*t, o, comm, program);
      });
      return combinedExitCode(exits);
    }
    return runRank(*t, o, Communicator::fromEnvironment(copts), program);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(), e.what());
    return 1;
  }
}

}  // namespace crossbar::perf
