// Command line (nccl-tests' options, same meaning and defaults, plus crossbar's long
// options) and the table's text layout.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>

#include "perf/driver.h"

namespace crossbar::perf {
namespace {

[[noreturn]] void fail(const std::string& message) {
  throw UsageError{message};
}

std::string optionName(char short_name, const std::string& long_name) {
  std::string s;
  if (short_name) s = std::string("-") + short_name;
  if (!long_name.empty()) s += (s.empty() ? "--" : "/--") + long_name;
  return s;
}

long long parseInteger(const std::string& text, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 0);
  if (text.empty() || errno != 0 || end == nullptr || *end != '\0')
    fail("invalid value '" + text + "' for " + what + ": expected an integer");
  return v;
}

int parseIntIn(const std::string& text, const std::string& what, long long lo, long long hi) {
  long long v = parseInteger(text, what);
  if (v < lo || v > hi)
    fail("invalid value '" + text + "' for " + what + ": expected " + std::to_string(lo) +
         (hi == 2147483647 ? " or more" : " to " + std::to_string(hi)));
  return static_cast<int>(v);
}

size_t parseSizeOrFail(const std::string& text, const std::string& what) {
  auto v = parseSizeArg(text);
  if (!v)
    fail("invalid size '" + text + "' for " + what +
         ": expected bytes with an optional K, M or G suffix (e.g. 8, 64K, 1M)");
  return *v;
}

std::vector<std::string> splitList(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    out.push_back(s.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return out;
}

// nccl-tests order of "-o all" and "-d all".
const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax,
                            ReduceOp::kMin, ReduceOp::kAvg,  ReduceOp::kPreMulSum};
const DataType kAllTypes[] = {DataType::kInt8,     DataType::kUInt8,      DataType::kInt32,
                              DataType::kUInt32,   DataType::kInt64,      DataType::kUInt64,
                              DataType::kFloat16,  DataType::kFloat32,    DataType::kFloat64,
                              DataType::kBFloat16, DataType::kFloat8E4M3, DataType::kFloat8E5M2};

struct Spec {
  char short_name;  // 0: long only
  const char* long_name;
  bool takes_value;
  std::function<void(Options&, const std::string& value, const std::string& what)> apply;
};

const int kIntMax = 2147483647;

std::vector<Spec> specs() {
  auto intOpt = [](int Options::*field, long long lo, long long hi) {
    return [field, lo, hi](Options& o, const std::string& v, const std::string& w) {
      o.*field = parseIntIn(v, w, lo, hi);
    };
  };
  return {
      {'t', "nthreads", true, intOpt(&Options::nthreads, 1, kIntMax)},
      {'g', "ngpus", true, intOpt(&Options::ngpus, 1, kIntMax)},
      {'b', "minbytes", true,
       [](Options& o, const std::string& v, const std::string& w) { o.min_bytes = parseSizeOrFail(v, w); }},
      {'e', "maxbytes", true,
       [](Options& o, const std::string& v, const std::string& w) { o.max_bytes = parseSizeOrFail(v, w); }},
      {'i', "stepbytes", true,
       [](Options& o, const std::string& v, const std::string& w) { o.step_bytes = parseSizeOrFail(v, w); }},
      {'f', "stepfactor", true,
       [](Options& o, const std::string& v, const std::string& w) {
         o.step_factor = static_cast<size_t>(parseIntIn(v, w, 1, kIntMax));
       }},
      {'n', "iters", true, intOpt(&Options::iters, 1, kIntMax)},
      {'m', "agg_iters", true, intOpt(&Options::agg_iters, 1, kIntMax)},
      {'w', "warmup_iters", true, intOpt(&Options::warmup_iters, 0, kIntMax)},
      {'N', "run_cycles", true, intOpt(&Options::run_cycles, 0, kIntMax)},
      {'p', "parallel_init", true, intOpt(&Options::parallel_init, 0, 1)},
      {'c', "check", true, intOpt(&Options::check, 0, kIntMax)},
      {'o', "op", true,
       [](Options& o, const std::string& v, const std::string& w) {
         o.ops.clear();
         o.all_ops = v == "all";
         if (o.all_ops) {
           o.ops.assign(std::begin(kAllOps), std::end(kAllOps));
           return;
         }
         for (const std::string& name : splitList(v)) {
           auto op = name == "mulsum" ? std::optional<ReduceOp>(ReduceOp::kPreMulSum) : parseReduceOp(name);
           if (!op)
             fail("invalid value '" + name + "' for " + w +
                  ": expected sum, prod, min, max, avg, mulsum or all");
           o.ops.push_back(*op);
         }
       }},
      {'d', "datatype", true,
       [](Options& o, const std::string& v, const std::string& w) {
         o.types.clear();
         o.all_types = v == "all";
         if (o.all_types) {
           o.types.assign(std::begin(kAllTypes), std::end(kAllTypes));
           return;
         }
         for (const std::string& name : splitList(v)) {
           auto t = parseDataType(name);
           if (!t)
             fail("invalid value '" + name + "' for " + w +
                  ": expected int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16, "
                  "f8e4m3, "
                  "f8e5m2 or all");
           o.types.push_back(*t);
         }
       }},
      {'r', "root", true,
       [](Options& o, const std::string& v, const std::string& w) {
         o.all_roots = v == "all";
         if (!o.all_roots) o.root = parseIntIn(v, w, 0, kIntMax);
       }},
      {'z', "blocking", true, intOpt(&Options::blocking, 0, 3)},
      {'y', "stream_null", true, intOpt(&Options::stream_null, 0, 1)},
      {'T', "timeout", true, intOpt(&Options::timeout_s, 0, kIntMax)},
      {'G', "cudagraph", true, intOpt(&Options::cudagraph, 0, kIntMax)},
      {'C', "report_cputime", true, intOpt(&Options::report_cputime, 0, 1)},
      {'S', "report_timestamps", true, intOpt(&Options::report_timestamps, 0, 1)},
      {'J', "output_file", true,
       [](Options& o, const std::string& v, const std::string&) { o.output_file = v; }},
      {'a', "average", true, intOpt(&Options::average, 0, 3)},
      {'R', "local_register", true, intOpt(&Options::local_register, 0, 2)},
      {'x', "cta_policy", true, intOpt(&Options::cta_policy, 0, 2)},
      {'D', "device_implementation", true, intOpt(&Options::device_impl, 0, kIntMax)},
      // nccl-tests replaces an out-of-range -V by 16 with a note (see validate()).
      {'V', "device_cta_count", true,
       [](Options& o, const std::string& v, const std::string& w) {
         o.device_cta_count = static_cast<int>(parseInteger(v, w));
       }},
      {'M', "memory", true, intOpt(&Options::memory_report, 0, 1)},
      {'u', "unalign", true, intOpt(&Options::unalign, 0, 1 << 20)},
      // nccl-tests disables -I values other than 0/1 with a note (see validate()).
      {'I', "per_iter_timing", true,
       [](Options& o, const std::string& v, const std::string& w) {
         o.per_iter_timing = static_cast<int>(parseInteger(v, w));
       }},
      {'K', "per_iter_skip", true,
       [](Options& o, const std::string& v, const std::string& w) {
         o.per_iter_skip = static_cast<int>(parseInteger(v, w));
       }},
      {'h', "help", false, [](Options& o, const std::string&, const std::string&) { o.help = true; }},
      // crossbar's own, long only.
      {0, "mem", true,
       [](Options& o, const std::string& v, const std::string& w) {
         if (v != "host" && v != "cuda")
           fail("invalid value '" + v + "' for " + w + ": expected host or cuda");
         o.mem = v;
       }},
      {0, "placement", true,
       [](Options& o, const std::string& v, const std::string& w) {
         if (v == "both") {
           o.in_place = 0;
         } else if (v == "in") {
           o.in_place = 1;
         } else if (v == "out") {
           o.in_place = 2;
         } else {
           fail("invalid value '" + v + "' for " + w + ": expected both, in or out");
         }
       }},
      {0, "algo", true, [](Options& o, const std::string& v, const std::string&) { o.algo = v; }},
      {0, "ranks-per-node", true, intOpt(&Options::ranks_per_node, 1, kIntMax)},
      {0, "json", true, [](Options& o, const std::string& v, const std::string&) { o.json_lines = v; }},
      {0, "nranks", true, intOpt(&Options::nranks, 1, 4096)},
      {0, "inject-error", false,
       [](Options& o, const std::string&, const std::string&) { o.inject_error = true; }},
  };
}

// nccl-tests' checks after parsing, with its outcomes: -D > 0 without -R 2 is an error;
// inconsistent -V, -I, -K and -z 3 with -G are switched off with a note and the run goes on.
void validate(Options& o) {
  if (o.device_impl > 0 && o.local_register != 2)
    fail("device implementation (-D > 0) requires enabling symmetric memory registration (-R 2)");
  if (o.device_impl > 0)
    fail("-D/--device_implementation " + std::to_string(o.device_impl) +
         ": crossbar has no NCCL device-API implementations; use -D 0 (the default)");
  if (o.device_cta_count <= 0 || o.device_cta_count > 128) {
    o.notes.push_back("device_cta_count (-V) must be positive and less than 128, got " +
                      std::to_string(o.device_cta_count) + ". Using default value 16.");
    o.device_cta_count = 16;
  }
  if (o.per_iter_timing != 0 && o.per_iter_timing != 1) {
    o.notes.push_back("per-iteration timing (-I) only supports 0=off or 1=on. Disabling.");
    o.per_iter_timing = 0;
  }
  if (o.per_iter_timing && o.cudagraph >= 1) {
    o.notes.push_back("per-iteration timing (-I) is incompatible with CUDA graph mode (-G). Disabling.");
    o.per_iter_timing = 0;
  }
  if (o.blocking == 3 && o.cudagraph >= 1) {
    o.notes.push_back("blocking mode (-z 3) is incompatible with CUDA graph mode (-G). Disabling.");
    o.blocking = 0;
  }
  if (o.per_iter_skip < 0 || o.per_iter_skip >= o.iters) {
    if (o.per_iter_skip != 0)
      o.notes.push_back("per-iteration skip (-K) must be between 0 and " + std::to_string(o.iters - 1) +
                        ". Disabling.");
    o.per_iter_skip = 0;
  }
  if (o.per_iter_skip && !o.per_iter_timing) {
    o.notes.push_back("per-iteration skip (-K) requires per-iteration timing (-I 1). Disabling.");
    o.per_iter_skip = 0;
  }
}

}  // namespace

std::optional<size_t> parseSizeArg(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (errno != 0 || end == text.c_str() || !std::isfinite(v) || v < 0) return std::nullopt;
  std::string suffix(end);
  double unit = 1;
  if (suffix == "K" || suffix == "k") {
    unit = 1024.0;
  } else if (suffix == "M" || suffix == "m") {
    unit = 1024.0 * 1024;
  } else if (suffix == "G" || suffix == "g") {
    unit = 1024.0 * 1024 * 1024;
  } else if (!suffix.empty()) {
    return std::nullopt;
  }
  double bytes = v * unit;
  if (bytes > 1.8e19) return std::nullopt;
  return static_cast<size_t>(bytes);
}

Options parseOptions(int argc, char** argv) {
  Options o;
  const std::vector<Spec> all = specs();
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    const Spec* spec = nullptr;
    std::string value;
    bool have_value = false;
    if (arg.rfind("--", 0) == 0 && arg.size() > 2) {
      std::string name = arg.substr(2);
      size_t eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        have_value = true;
      }
      for (const Spec& s : all)
        if (name == s.long_name) spec = &s;
      if (!spec) fail("unknown option '" + arg + "'");
      if (have_value && !spec->takes_value) fail("option --" + name + " takes no value");
    } else if (arg.size() >= 2 && arg[0] == '-' && arg[1] != '-') {
      for (const Spec& s : all)
        if (s.short_name == arg[1]) spec = &s;
      if (!spec) fail("unknown option '" + arg.substr(0, 2) + "'");
      if (arg.size() > 2) {
        if (!spec->takes_value) fail("unknown option '" + arg + "'");
        value = arg.substr(2);  // -b8
        have_value = true;
      }
    } else {
      fail("unexpected argument '" + arg + "' (options start with - or --)");
    }
    const std::string what = optionName(spec->short_name, spec->long_name);
    if (spec->takes_value && !have_value) {
      if (i + 1 >= argc) fail("option " + what + " needs a value");
      value = argv[++i];
    }
    spec->apply(o, value, what);
  }
  if (o.min_bytes > o.max_bytes)
    fail("invalid sizes for 'minbytes' and 'maxbytes': " + std::to_string(o.min_bytes) + " > " +
         std::to_string(o.max_bytes));
  if (o.step_factor <= 1 && o.step_bytes == 0 && o.min_bytes < o.max_bytes)
    fail("-i/--stepbytes 0 would never reach maxbytes; give a positive step or a -f factor");
  validate(o);
  return o;
}

std::string usage(const std::string& program) {
  return "USAGE: " + program +
         " \n"
         "\t[-t,--nthreads <num threads>] (1 only: one rank per process)\n"
         "\t[-g,--ngpus <gpus per thread>] (1 only)\n"
         "\t[-b,--minbytes <min size in bytes>] (default 32M; K/M/G suffixes)\n"
         "\t[-e,--maxbytes <max size in bytes>] (default 32M)\n"
         "\t[-i,--stepbytes <increment size>] (default 1M)\n"
         "\t[-f,--stepfactor <increment factor>] (default: disabled)\n"
         "\t[-n,--iters <iteration count>] (default 20)\n"
         "\t[-m,--agg_iters <aggregated iteration count>] (default 1)\n"
         "\t[-w,--warmup_iters <warmup iteration count>] (default 1)\n"
         "\t[-N,--run_cycles <cycle count> run & print each cycle (default: 1; 0=infinite)]\n"
         "\t[-p,--parallel_init <0/1>] (no effect)\n"
         "\t[-c,--check <check iteration count>] (default 1)\n"
         "\t[-o,--op <sum/prod/min/max/avg/mulsum/all>] (default sum)\n"
         "\t[-d,--datatype <nccltype/all>] (default float)\n"
         "\t[-r,--root <root/all>] (default 0)\n"
         "\t[-z,--blocking <0/1/2/3> 1=barrier after each inner iter (-m), 2=no barrier, 3=wait and barrier "
         "after each outer iter (-n)]\n"
         "\t[-y,--stream_null <0/1>] (--mem cuda: the legacy default stream)\n"
         "\t[-T,--timeout <time in seconds>] (per collective; default: CROSSBAR_TIMEOUT)\n"
         "\t[-G,--cudagraph <num graph launches>] (no effect)\n"
         "\t[-C,--report_cputime <0/1>] (report the time to issue instead of to complete)\n"
         "\t[-S,--report_timestamps <0/1> report timestamps (default 0)]\n"
         "\t[-J,--output_file <file> write output to filepath, if accessible. Infer type from suffix (only "
         "json "
         "supported presently.)]\n"
         "\t[-a,--average <0/1/2/3> report average iteration time <0=RANK0/1=AVG/2=MIN/3=MAX>]\n"
         "\t[-R,--local_register <0/1/2> 2 = buffers from a symmetric heap (host: zero copy-in for the one-node "
         "symmetric-memory algorithms; cuda: the collectives' heap, used in place); 0/1: no effect]\n"
         "\t[-x,--cta_policy <0/1/2> (no effect)]\n"
         "\t[-D,--device_implementation <0> NCCL device API (crossbar has none: 0 only)]\n"
         "\t[-V,--device_cta_count <number> (default 16; no effect)]\n"
         "\t[-M,--memory <0/1> enable memory usage report (default: 0)]\n"
         "\t[-u,--unalign <index of first element> Misalign source and destination buffers (default: 0)]\n"
         "\t[-I,--per_iter_timing <0/1> per-iteration timing: i_min/i_max/i_p99/i_cv% columns (default: 0)]\n"
         "\t[-K,--per_iter_skip <count> exclude leading samples from -I summary stats (default: 0)]\n"
         "\t[-h,--help]\n"
         "crossbar options:\n"
         "\t[--nranks <N>] fork N local ranks with an embedded store (no launcher needed)\n"
         "\t[--mem <host|cuda>] buffer memory (default host; cuda: GPU local rank % visible GPUs, may be "
         "shared)\n"
         "\t[--placement <both|in|out>] run both placements (default), in-place only, or out-of-place only\n"
         "\t[--algo <name>] force a collective algorithm (see crossbar-info)\n"
         "\t[--ranks-per-node <K>] split the ranks into virtual nodes of K ranks\n"
         "\t[--json <file>] append one JSON record per size and placement (JSON lines)\n"
         "Launch: --nranks N, or under mpirun / srun / torchrun (rank 0 prints the table).\n"
         "Exit status: non-zero on wrong results or when NCCL_TESTS_MIN_BW is not reached.\n";
}

// ---- table layout ----------------------------------------------------------------------

std::string formatFloat(double value, int width) {
  char buf[64];
  for (const char* f : {"%*.2f", "%*.1f", "%*.0f"})
    if (std::snprintf(buf, sizeof buf, f, width, value) <= width) return buf;
  std::snprintf(buf, sizeof buf, width >= 7 ? "%*.1e" : "%*.0e", width, value);
  return buf;
}

std::string formatTime(double usec) {
  return formatFloat(usec, 7);
}

namespace {
constexpr const char* kTimestampFormat = "%Y-%m-%d %H:%M:%S";
}

std::string tableHeader(bool cputime, bool timestamps, bool per_iter) {
  const char* t = cputime ? "cputime" : "time";
  const char* ts_label = timestamps ? "timestamp" : "";
  const char* ts_format = timestamps ? kTimestampFormat : "";
  const int ts_pad = timestamps ? 19 : 0;
  char buf[2048];
  int len = 0;
  if (per_iter) {
    len +=
        std::snprintf(buf + len, sizeof buf - len,
                      "# %10s  %12s  %8s  %6s  %6s              out-of-place (+ per-iteration)              "
                      "                  in-place (+ per-iteration)\n",
                      "", "", "", "", "");
    len += std::snprintf(buf + len, sizeof buf - len,
                         "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s  %7s  %6s  %6s "
                         " %6s  %7s  %7s  %7s  "
                         "%7s %*s\n",
                         "size", "count", "type", "redop", "root", t, "algbw", "busbw", "#wrong", "i_min",
                         "i_max", "i_p99", "i_cv%", t, "algbw", "busbw", "#wrong", "i_min", "i_max", "i_p99",
                         "i_cv%", ts_pad, ts_label);
    std::snprintf(buf + len, sizeof buf - len,
                  "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s  %7s  %6s  %6s  %6s  "
                  "%7s  %7s  %7s  "
                  "%7s %*s\n",
                  "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)",
                  "(%)", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)", "(%)", ts_pad, ts_format);
    return buf;
  }
  len += std::snprintf(
      buf + len, sizeof buf - len,
      "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          \n", "", "",
      "", "", "");
  len += std::snprintf(buf + len, sizeof buf - len,
                       "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s\n", "size",
                       "count", "type", "redop", "root", t, "algbw", "busbw", "#wrong", t, "algbw", "busbw",
                       "#wrong", ts_pad, ts_label);
  std::snprintf(buf + len, sizeof buf - len,
                "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s\n", "(B)",
                "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "",
                ts_pad, ts_format);
  return buf;
}

std::string rowPrefix(size_t bytes, size_t count, const std::string& type, const std::string& op, int root) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%12zu  %12zu  %8s  %6s  %6d", bytes, count, type.c_str(), op.c_str(), root);
  return buf;
}

std::string rowColumns(double usec, double algbw, double busbw, long long wrong) {
  char buf[256];
  const std::string t = formatFloat(usec, 7), a = formatFloat(algbw, 6), b = formatFloat(busbw, 6);
  if (wrong >= 0) {
    std::snprintf(buf, sizeof buf, "  %7s  %6s  %6s  %6g", t.c_str(), a.c_str(), b.c_str(),
                  static_cast<double>(wrong));
  } else {
    std::snprintf(buf, sizeof buf, "  %7s  %6s  %6s    N/A", t.c_str(), a.c_str(), b.c_str());
  }
  return buf;
}

std::string timestampColumn() {
  char when[64];
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  std::strftime(when, sizeof when, kTimestampFormat, &tm);
  char buf[80];
  std::snprintf(buf, sizeof buf, "%21s", when);
  return buf;
}

IterStats computeIterStats(const std::vector<double>& seconds) {
  IterStats s;
  if (seconds.empty()) return s;
  std::vector<double> v = seconds;
  std::sort(v.begin(), v.end());
  const int n = static_cast<int>(v.size());
  // Nearest-rank percentile, as nccl-tests (p99 may equal max with < 100 samples).
  auto pct = [n](int p) { return std::min(n - 1, (n * p + 99) / 100 - 1); };
  s.min = v.front();
  s.max = v.back();
  s.p50 = v[n / 2];
  s.p95 = v[pct(95)];
  s.p99 = v[pct(99)];
  double sum = 0;
  for (double x : v) sum += x;
  s.avg = sum / n;
  double var = 0;
  for (double x : v) var += (x - s.avg) * (x - s.avg);
  s.stdev = std::sqrt(var / n);
  return s;
}

std::string perIterColumns(const IterStats& s) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "  %7s  %7s  %7s  %7s", formatFloat(s.min * 1e6, 7).c_str(),
                formatFloat(s.max * 1e6, 7).c_str(), formatFloat(s.p99 * 1e6, 7).c_str(),
                formatFloat(s.cvPercent(), 7).c_str());
  return buf;
}

std::string memoryString(int64_t bytes) {
  double amount = static_cast<double>(bytes);
  const char* unit = " B";
  const double kib = 1024.0;
  if (std::fabs(amount) >= kib * kib * kib) {
    unit = " GB";
    amount /= kib * kib * kib;
  } else if (std::fabs(amount) >= kib * kib) {
    unit = " MB";
    amount /= kib * kib;
  } else if (std::fabs(amount) >= kib) {
    unit = " KB";
    amount /= kib;
  }
  const int precision = std::fabs(amount) < 10.0 ? 2 : std::fabs(amount) < 100.0 ? 1 : 0;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f%s", precision, amount, unit);
  return buf;
}

std::string opDisplayName(std::optional<ReduceOp> op) {
  if (!op) return "none";
  if (*op == ReduceOp::kPreMulSum) return "mulsum";
  return reduceOpName(*op);
}

}  // namespace crossbar::perf
