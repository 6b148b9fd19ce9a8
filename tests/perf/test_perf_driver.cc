// Unit tests of the perf driver: nccl-tests' options and defaults, the table layout,
// bandwidth factors and byte counts per collective, and the verifiable data.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <regex>
#include <string>
#include <vector>

#include "collectives/reduce.h"
#include "comm/errors.h"
#include "perf/bench_flags.h"
#include "perf/driver.h"

namespace crossbar::perf {
namespace {

Options parse(std::vector<std::string> args) {
  args.insert(args.begin(), "all_reduce_perf");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return parseOptions(static_cast<int>(argv.size()), argv.data());
}

std::string parseError(std::vector<std::string> args) {
  try {
    parse(std::move(args));
  } catch (const UsageError& e) {
    return e.message;
  }
  return "";
}

TEST(PerfOptions, DefaultsMatchNcclTests) {
  Options o = parse({});
  EXPECT_EQ(o.min_bytes, 32u << 20);
  EXPECT_EQ(o.max_bytes, 32u << 20);
  EXPECT_EQ(o.step_bytes, 1u << 20);
  EXPECT_EQ(o.step_factor, 1u);
  EXPECT_EQ(o.iters, 20);
  EXPECT_EQ(o.warmup_iters, 1);
  EXPECT_EQ(o.agg_iters, 1);
  EXPECT_EQ(o.run_cycles, 1);
  EXPECT_EQ(o.check, 1);
  EXPECT_EQ(o.average, 1);
  EXPECT_EQ(o.root, 0);
  ASSERT_EQ(o.ops.size(), 1u);
  EXPECT_EQ(o.ops[0], ReduceOp::kSum);
  ASSERT_EQ(o.types.size(), 1u);
  EXPECT_EQ(o.types[0], DataType::kFloat32);
  EXPECT_EQ(o.mem, "host");
  EXPECT_EQ(o.blocking, 0);
  EXPECT_EQ(o.report_timestamps, 0);
  EXPECT_EQ(o.per_iter_timing, 0);
  EXPECT_EQ(o.per_iter_skip, 0);
  EXPECT_EQ(o.memory_report, 0);
  EXPECT_EQ(o.unalign, 0);
  EXPECT_EQ(o.device_impl, 0);
  EXPECT_EQ(o.device_cta_count, 16);
  EXPECT_EQ(o.cta_policy, -1);
  EXPECT_EQ(o.in_place, 0);
}

// Every short option nccl-tests 2.19 accepts
// ("t:g:b:e:i:f:n:m:w:N:p:I:K:c:o:d:r:z:y:T:hG:C:a:R:x:D:V:J:S:M:u:") is accepted here with its long name, so
// command lines written for nccl-tests run.
TEST(PerfOptions, EveryNcclTestsOptionIsAccepted) {
  const std::vector<std::pair<std::string, std::string>> all = {{"t", "nthreads"},
                                                                {"g", "ngpus"},
                                                                {"b", "minbytes"},
                                                                {"e", "maxbytes"},
                                                                {"i", "stepbytes"},
                                                                {"f", "stepfactor"},
                                                                {"n", "iters"},
                                                                {"m", "agg_iters"},
                                                                {"w", "warmup_iters"},
                                                                {"N", "run_cycles"},
                                                                {"p", "parallel_init"},
                                                                {"I", "per_iter_timing"},
                                                                {"K", "per_iter_skip"},
                                                                {"c", "check"},
                                                                {"o", "op"},
                                                                {"d", "datatype"},
                                                                {"r", "root"},
                                                                {"z", "blocking"},
                                                                {"y", "stream_null"},
                                                                {"T", "timeout"},
                                                                {"G", "cudagraph"},
                                                                {"C", "report_cputime"},
                                                                {"a", "average"},
                                                                {"R", "local_register"},
                                                                {"x", "cta_policy"},
                                                                {"D", "device_implementation"},
                                                                {"V", "device_cta_count"},
                                                                {"J", "output_file"},
                                                                {"S", "report_timestamps"},
                                                                {"M", "memory"},
                                                                {"u", "unalign"}};
  auto valueFor = [](const std::string& s) -> std::string {
    if (s == "o") return "sum";
    if (s == "d") return "float";
    if (s == "J") return "x.json";
    if (s == "V") return "16";
    if (s == "D") return "0";
    if (s == "b" || s == "e") return "32M";
    return "1";
  };
  for (const auto& [s, l] : all) {
    EXPECT_EQ(parseError({"-" + s, valueFor(s)}), "") << "-" << s;
    EXPECT_EQ(parseError({"--" + l, valueFor(s)}), "") << "--" << l;
    EXPECT_EQ(parseError({"--" + l + "=" + valueFor(s)}), "") << "--" << l << "=";
  }
  EXPECT_EQ(parseError({"-h"}), "");
}

TEST(PerfOptions, ReportTimestamps) {
  EXPECT_EQ(parse({"-S", "1"}).report_timestamps, 1);
  EXPECT_EQ(parse({"--report_timestamps=1"}).report_timestamps, 1);
  EXPECT_EQ(parse({"-S0"}).report_timestamps, 0);
  EXPECT_NE(parseError({"-S", "2"}).find("-S/--report_timestamps"), std::string::npos);
  EXPECT_NE(parseError({"-S"}).find("needs a value"), std::string::npos);
}

TEST(PerfOptions, BlockingModes) {
  for (int z = 0; z <= 3; ++z) EXPECT_EQ(parse({"-z", std::to_string(z)}).blocking, z);
  EXPECT_NE(parseError({"-z", "4"}).find("-z/--blocking"), std::string::npos);
}

// nccl-tests switches inconsistent settings off with a note and runs on; -D > 0 is an error.
TEST(PerfOptions, InconsistentSettingsAreDisabledWithANote) {
  Options o = parse({"-I", "2"});
  EXPECT_EQ(o.per_iter_timing, 0);
  ASSERT_EQ(o.notes.size(), 1u);
  EXPECT_EQ(o.notes[0], "per-iteration timing (-I) only supports 0=off or 1=on. Disabling.");
  o = parse({"-K", "2"});
  EXPECT_EQ(o.per_iter_skip, 0);
  ASSERT_EQ(o.notes.size(), 1u);
  EXPECT_EQ(o.notes[0], "per-iteration skip (-K) requires per-iteration timing (-I 1). Disabling.");
  o = parse({"-I", "1", "-n", "5", "-K", "5"});
  EXPECT_EQ(o.per_iter_skip, 0);
  EXPECT_EQ(o.notes.at(0), "per-iteration skip (-K) must be between 0 and 4. Disabling.");
  o = parse({"-I", "1", "-n", "5", "-K", "4"});
  EXPECT_EQ(o.per_iter_skip, 4);
  EXPECT_TRUE(o.notes.empty());
  o = parse({"-I", "1", "-G", "1"});
  EXPECT_EQ(o.per_iter_timing, 0);
  EXPECT_NE(o.notes.at(0).find("incompatible with CUDA graph mode"), std::string::npos);
  o = parse({"-z", "3", "-G", "1"});
  EXPECT_EQ(o.blocking, 0);
  o = parse({"-V", "500"});
  EXPECT_EQ(o.device_cta_count, 16);
  EXPECT_NE(o.notes.at(0).find("Using default value 16"), std::string::npos);
  EXPECT_NE(parseError({"-D", "1"}).find("requires enabling symmetric memory registration (-R 2)"),
            std::string::npos);
  EXPECT_NE(parseError({"-D", "1", "-R", "2"}).find("no NCCL device-API implementations"), std::string::npos);
}

TEST(PerfOptions, PlacementIsALongOption) {
  EXPECT_EQ(parse({"--placement", "both"}).in_place, 0);
  EXPECT_EQ(parse({"--placement=in"}).in_place, 1);
  EXPECT_EQ(parse({"--placement", "out"}).in_place, 2);
  EXPECT_NE(parseError({"--placement", "x"}).find("expected both, in or out"), std::string::npos);
  // -I is nccl-tests' per-iteration timing, not a placement.
  EXPECT_EQ(parse({"-I", "1"}).in_place, 0);
}

TEST(PerfOptions, ShortLongAndAttachedForms) {
  Options o = parse({"-b",
                     "8",
                     "-e64M",
                     "--stepfactor",
                     "4",
                     "--iters=5",
                     "-w",
                     "0",
                     "-m",
                     "2",
                     "-N",
                     "3",
                     "-c",
                     "0",
                     "-o",
                     "max",
                     "-d",
                     "half",
                     "-r",
                     "1",
                     "-z",
                     "1",
                     "-T",
                     "30",
                     "-a",
                     "3",
                     "-G",
                     "2",
                     "-R",
                     "1",
                     "-x",
                     "1",
                     "-S",
                     "1",
                     "-M",
                     "1",
                     "-u",
                     "3",
                     "-D",
                     "0",
                     "-V",
                     "8",
                     "--placement",
                     "in",
                     "-J",
                     "out.json",
                     "--mem",
                     "host",
                     "--algo",
                     "ring",
                     "--ranks-per-node",
                     "2",
                     "--json",
                     "x.jsonl",
                     "--nranks",
                     "4"});
  EXPECT_EQ(o.min_bytes, 8u);
  EXPECT_EQ(o.max_bytes, 64u << 20);
  EXPECT_EQ(o.step_factor, 4u);
  EXPECT_EQ(o.iters, 5);
  EXPECT_EQ(o.warmup_iters, 0);
  EXPECT_EQ(o.agg_iters, 2);
  EXPECT_EQ(o.run_cycles, 3);
  EXPECT_EQ(o.check, 0);
  EXPECT_EQ(o.ops, std::vector<ReduceOp>{ReduceOp::kMax});
  EXPECT_EQ(o.types, std::vector<DataType>{DataType::kFloat16});
  EXPECT_EQ(o.root, 1);
  EXPECT_EQ(o.blocking, 1);
  EXPECT_EQ(o.timeout_s, 30);
  EXPECT_EQ(o.average, 3);
  EXPECT_EQ(o.cudagraph, 2);
  EXPECT_EQ(o.local_register, 1);
  EXPECT_EQ(o.cta_policy, 1);
  EXPECT_EQ(o.report_timestamps, 1);
  EXPECT_EQ(o.memory_report, 1);
  EXPECT_EQ(o.unalign, 3);
  EXPECT_EQ(o.device_impl, 0);
  EXPECT_EQ(o.device_cta_count, 8);
  EXPECT_EQ(o.in_place, 1);
  EXPECT_TRUE(o.notes.empty());
  EXPECT_EQ(o.output_file, "out.json");
  EXPECT_EQ(o.algo, "ring");
  EXPECT_EQ(o.ranks_per_node, 2);
  EXPECT_EQ(o.json_lines, "x.jsonl");
  EXPECT_EQ(o.nranks, 4);
  Options l =
      parse({"--minbytes",   "1K",  "--maxbytes", "2G", "--warmup_iters", "3",      "--agg_iters", "4",
             "--run_cycles", "0",   "--check",    "2",  "--op",           "mulsum", "--datatype",  "bfloat16",
             "--root",       "all", "--blocking", "0",  "--average",      "0",      "--timeout",   "5"});
  EXPECT_EQ(l.min_bytes, 1024u);
  EXPECT_EQ(l.max_bytes, size_t{2} << 30);
  EXPECT_EQ(l.warmup_iters, 3);
  EXPECT_EQ(l.agg_iters, 4);
  EXPECT_EQ(l.run_cycles, 0);
  EXPECT_EQ(l.ops, std::vector<ReduceOp>{ReduceOp::kPreMulSum});
  EXPECT_EQ(l.types, std::vector<DataType>{DataType::kBFloat16});
  EXPECT_TRUE(l.all_roots);
}

TEST(PerfOptions, AllOpsAndTypes) {
  Options o = parse({"-o", "all", "-d", "all"});
  EXPECT_EQ(o.ops.size(), 6u);
  EXPECT_EQ(o.types.size(), 12u);
  EXPECT_EQ(o.types.front(), DataType::kInt8);  // nccl-tests order
  EXPECT_TRUE(o.all_ops && o.all_types);
}

TEST(PerfOptions, SizeSuffixes) {
  EXPECT_EQ(parseSizeArg("8"), 8u);
  EXPECT_EQ(parseSizeArg("64K"), 65536u);
  EXPECT_EQ(parseSizeArg("64k"), 65536u);
  EXPECT_EQ(parseSizeArg("1M"), 1u << 20);
  EXPECT_EQ(parseSizeArg("1.5K"), 1536u);
  EXPECT_EQ(parseSizeArg("4G"), size_t{4} << 30);
  EXPECT_FALSE(parseSizeArg("12Q"));
  EXPECT_FALSE(parseSizeArg("-1"));
  EXPECT_FALSE(parseSizeArg(""));
  EXPECT_FALSE(parseSizeArg("K"));
}

TEST(PerfOptions, ClearErrors) {
  EXPECT_EQ(parseError({"--bogus"}), "unknown option '--bogus'");
  EXPECT_EQ(parseError({"-q", "1"}), "unknown option '-q'");
  EXPECT_NE(parseError({"-b", "12Q"}).find("invalid size '12Q' for -b/--minbytes"), std::string::npos);
  EXPECT_NE(parseError({"-n"}).find("-n/--iters needs a value"), std::string::npos);
  EXPECT_NE(parseError({"-n", "x"}).find("invalid value 'x' for -n/--iters"), std::string::npos);
  EXPECT_NE(parseError({"-a", "7"}).find("-a/--average"), std::string::npos);
  EXPECT_NE(parseError({"-o", "xor"}).find("invalid value 'xor' for -o/--op"), std::string::npos);
  EXPECT_NE(parseError({"-d", "float128"}).find("-d/--datatype"), std::string::npos);
  EXPECT_NE(parseError({"--mem", "gpu"}).find("expected host or cuda"), std::string::npos);
  EXPECT_NE(parseError({"-b", "1M", "-e", "1K"}).find("invalid sizes for 'minbytes' and 'maxbytes'"),
            std::string::npos);
  EXPECT_NE(parseError({"stray"}).find("unexpected argument 'stray'"), std::string::npos);
  EXPECT_NE(parseError({"--help=1"}).find("takes no value"), std::string::npos);
}

// BenchFlags (the MoE benchmarks' options): typed values, and errors that name the flag.
struct Argv {
  std::vector<std::string> words;
  std::vector<char*> ptrs;
  explicit Argv(std::vector<std::string> w) : words(std::move(w)) {
    words.insert(words.begin(), "bench");
    for (auto& a : words) ptrs.push_back(a.data());
  }
  BenchFlags flags() { return BenchFlags(static_cast<int>(ptrs.size()), ptrs.data()); }
};

std::string benchFlagError(std::vector<std::string> args) {
  Argv a(std::move(args));
  BenchFlags f = a.flags();
  try {
    while (f.next()) {
      if (f.is("--n"))
        f.integer(1, 8);
      else if (f.is("--z"))
        f.real();
      else if (f.is("--mode"))
        f.choice({"a", "b"});
      else if (f.is("--list"))
        f.integers(1);
    }
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(BenchFlags, ValuesAndSwitches) {
  Argv a({"--n", "3", "--on", "--z", "0.5", "--mode", "b", "--list", "128,,512", "--name", "x,y"});
  BenchFlags f = a.flags();
  long long n = 0;
  double z = 0;
  bool on = false;
  std::string mode, name;
  std::vector<size_t> list;
  while (f.next()) {
    if (f.is("--n"))
      n = f.integer(1, 8);
    else if (f.is("--on"))
      on = true;
    else if (f.is("--z"))
      z = f.real();
    else if (f.is("--mode"))
      mode = f.choice({"a", "b"});
    else if (f.is("--list"))
      list = f.integers(1);
    else if (f.is("--name"))
      name = f.text();
    else
      FAIL() << "unexpected " << f.flag();
  }
  EXPECT_EQ(n, 3);
  EXPECT_TRUE(on);
  EXPECT_EQ(z, 0.5);
  EXPECT_EQ(mode, "b");
  EXPECT_EQ(list, (std::vector<size_t>{128, 512}));
  EXPECT_EQ(name, "x,y");
}

TEST(BenchFlags, ClearErrors) {
  EXPECT_NE(benchFlagError({"--n", "x"}).find("invalid value 'x' for --n: expected an integer"),
            std::string::npos);
  EXPECT_NE(benchFlagError({"--n", "9"}).find("expected from 1 to 8"), std::string::npos);
  EXPECT_NE(benchFlagError({"--n", "3k"}).find("expected an integer"), std::string::npos);
  EXPECT_NE(benchFlagError({"--n"}).find("--n needs a value"), std::string::npos);
  EXPECT_NE(benchFlagError({"--z", "fast"}).find("for --z: expected a number"), std::string::npos);
  EXPECT_NE(benchFlagError({"--mode", "c"}).find("expected one of a, b"), std::string::npos);
  EXPECT_NE(benchFlagError({"--list", "4,0"}).find("invalid value '0' for --list: expected at least 1"),
            std::string::npos);
  EXPECT_NE(benchFlagError({"--list", ","}).find("expected a comma-separated list"), std::string::npos);
  EXPECT_EQ(benchFlagError({"--n", "8", "--z", "-1e3"}), "");
}

std::vector<std::string> lines(const std::string& h) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < h.size()) {
    size_t nl = h.find('\n', pos);
    out.push_back(h.substr(pos, nl - pos));
    pos = nl + 1;
  }
  return out;
}

// The strings nccl-tests 2.19.6 prints (util.cu writeResultHeader), byte for byte.
TEST(PerfTable, HeaderMatchesNcclTestsLayout) {
  std::vector<std::string> l = lines(tableHeader(false));
  ASSERT_EQ(l.size(), 3u);
  EXPECT_EQ(
      l[0],
      "#                                                              out-of-place                       "
      "in-place          ");
  EXPECT_EQ(
      l[1],
      "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw"
      "   busbw  #wrong ");
  EXPECT_EQ(
      l[2],
      "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)"
      "  (GB/s)         ");
  EXPECT_NE(tableHeader(true).find("cputime"), std::string::npos);
}

TEST(PerfTable, TimestampHeader) {
  std::vector<std::string> l = lines(tableHeader(false, true));
  ASSERT_EQ(l.size(), 3u);
  EXPECT_TRUE(l[1].ends_with("  #wrong           timestamp")) << l[1];
  EXPECT_TRUE(l[2].ends_with("           %Y-%m-%d %H:%M:%S")) << l[2];
  std::string ts = timestampColumn();
  EXPECT_EQ(ts.size(), 21u);
  EXPECT_TRUE(std::regex_match(ts, std::regex(R"(  \d{4}-\d\d-\d\d \d\d:\d\d:\d\d)"))) << ts;
}

TEST(PerfTable, PerIterationHeader) {
  std::vector<std::string> l = lines(tableHeader(false, false, true));
  ASSERT_EQ(l.size(), 3u);
  EXPECT_NE(l[0].find("out-of-place (+ per-iteration)"), std::string::npos);
  EXPECT_NE(l[0].find("in-place (+ per-iteration)"), std::string::npos);
  EXPECT_EQ(l[1],
            "#       size         count      type   redop    root     time   algbw   busbw  #wrong    i_min  "
            "  i_max"
            "    i_p99    i_cv%     time   algbw   busbw  #wrong    i_min    i_max    i_p99    i_cv% ");
  IterStats s = computeIterStats({4e-6, 1e-6, 3e-6, 2e-6});
  EXPECT_DOUBLE_EQ(s.min, 1e-6);
  EXPECT_DOUBLE_EQ(s.max, 4e-6);
  EXPECT_DOUBLE_EQ(s.p50, 3e-6);  // sorted[n / 2]
  EXPECT_DOUBLE_EQ(s.p99, 4e-6);  // nearest rank: may equal max with < 100 samples
  EXPECT_DOUBLE_EQ(s.avg, 2.5e-6);
  EXPECT_NEAR(s.cvPercent(), std::sqrt(1.25) / 2.5 * 100, 1e-9);
  EXPECT_EQ(perIterColumns(s), "     1.00     4.00     4.00    44.72");
  std::vector<double> hundred;
  for (int i = 1; i <= 100; ++i) hundred.push_back(i);
  EXPECT_DOUBLE_EQ(computeIterStats(hundred).p99, 99);
  EXPECT_DOUBLE_EQ(computeIterStats(hundred).p95, 95);
}

TEST(PerfTable, RowParsesWithNcclTestsRegex) {
  std::string row = rowPrefix(1048576, 262144, "float", "sum", -1) + rowColumns(123.456, 8.5, 12.75, 0) +
                    rowColumns(12345.6, 0.01, 0.02, -1);
  // nccl-tests: "%12li  %12li  %8s  %6s  %6s", then per placement "  %7s  %6s  %6s  %6g"
  // (getFloatStr widths 7, 6, 6), "    N/A" without a check.
  EXPECT_EQ(
      row,
      "     1048576        262144     float     sum      -1   123.46    8.50   12.75       0  12345.6    0.01"
      "    0.02    N/A");
  std::regex re(
      R"(^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s*$)");
  std::smatch m;
  ASSERT_TRUE(std::regex_match(row, m, re));
  EXPECT_EQ(m[1], "1048576");
  EXPECT_EQ(m[4], "sum");
  EXPECT_EQ(m[8], "12.75");
  EXPECT_EQ(m[13], "N/A");
}

// nccl-tests' getFloatStr: the most decimals (2, 1, 0) that fit the width, else an exponent.
TEST(PerfTable, NumbersFitTheirColumns) {
  EXPECT_EQ(formatTime(5.123), "   5.12");
  EXPECT_EQ(formatTime(150.25), " 150.25");
  EXPECT_EQ(formatTime(12345.6), "12345.6");
  EXPECT_EQ(formatTime(123456.7), " 123457");
  EXPECT_EQ(formatTime(12345678.0), "1.2e+07");
  EXPECT_EQ(formatFloat(123.456, 6), "123.46");
  EXPECT_EQ(formatFloat(1234.56, 6), "1234.6");
  EXPECT_EQ(formatFloat(123456.0, 6), "123456");
  EXPECT_EQ(formatFloat(1234567.0, 6), " 1e+06");
  EXPECT_EQ(memoryString(512), "512 B");
  EXPECT_EQ(memoryString(1536), "1.50 KB");
  EXPECT_EQ(memoryString(int64_t{50} << 20), "50.0 MB");
  EXPECT_EQ(memoryString(int64_t{3} << 30), "3.00 GB");
  EXPECT_EQ(opDisplayName(ReduceOp::kPreMulSum), "mulsum");
  EXPECT_EQ(opDisplayName(std::nullopt), "none");
}

double busFactor(const char* name, int n) {
  const CollTest* t = findCollTest(name);
  EXPECT_NE(t, nullptr) << name;
  return t ? t->busFactor(n) : 0;
}

TEST(PerfColls, BusBandwidthFactors) {
  for (int n : {2, 3, 8}) {
    const double ring = static_cast<double>(n - 1) / n;
    EXPECT_DOUBLE_EQ(busFactor("all_reduce", n), 2.0 * (n - 1) / n);
    EXPECT_DOUBLE_EQ(busFactor("all_gather", n), ring);
    EXPECT_DOUBLE_EQ(busFactor("reduce_scatter", n), ring);
    EXPECT_DOUBLE_EQ(busFactor("alltoall", n), ring);
    EXPECT_DOUBLE_EQ(busFactor("gather", n), ring);
    EXPECT_DOUBLE_EQ(busFactor("scatter", n), ring);
    EXPECT_DOUBLE_EQ(busFactor("broadcast", n), 1.0);
    EXPECT_DOUBLE_EQ(busFactor("reduce", n), 1.0);
    EXPECT_DOUBLE_EQ(busFactor("sendrecv", n), 1.0);
    EXPECT_DOUBLE_EQ(busFactor("hypercube", n), 1.0);
  }
  EXPECT_EQ(allCollTests().size(), 10u);
}

TEST(PerfColls, BandwidthFromTime) {
  double alg = 0, bus = 0;
  // allreduce of 1e9 bytes in 1 s on 4 ranks: algbw 1, busbw 1.5.
  computeBandwidth(*findCollTest("all_reduce"), 250000000, 4, 1.0, 4, &alg, &bus);
  EXPECT_DOUBLE_EQ(alg, 1.0);
  EXPECT_DOUBLE_EQ(bus, 1.5);
  // allgather: algbw counts the whole gathered buffer (count per rank x ranks).
  computeBandwidth(*findCollTest("all_gather"), 1000, 4, 1e-6, 4, &alg, &bus);
  EXPECT_DOUBLE_EQ(alg, 16.0);
  EXPECT_DOUBLE_EQ(bus, 12.0);
  // hypercube: every rank receives n-1 blocks.
  computeBandwidth(*findCollTest("hypercube"), 1000, 4, 1e-6, 4, &alg, &bus);
  EXPECT_DOUBLE_EQ(alg, 12.0);
}

TEST(PerfColls, ByteCounts) {
  // 1 MiB of floats on 4 ranks.
  const size_t count = 262144;
  ByteCounts ar = findCollTest("all_reduce")->byteCounts(count, 4);
  EXPECT_EQ(ar.param_count, count);
  EXPECT_EQ(ar.recv_count, count);
  ByteCounts ag = findCollTest("all_gather")->byteCounts(count, 4);
  EXPECT_EQ(ag.param_count, count / 4);
  EXPECT_EQ(ag.recv_count, count);
  EXPECT_EQ(ag.send_inplace_offset, count / 4);
  ByteCounts rs = findCollTest("reduce_scatter")->byteCounts(count, 4);
  EXPECT_EQ(rs.send_count, count);
  EXPECT_EQ(rs.recv_inplace_offset, count / 4);
  // Per-rank blocks align to 4 elements: 10 elements on 3 ranks -> 0.
  EXPECT_EQ(findCollTest("all_gather")->byteCounts(10, 3).param_count, 0u);
  EXPECT_EQ(findCollTest("all_gather")->byteCounts(24, 3).param_count, 8u);
  ByteCounts a2a = findCollTest("alltoall")->byteCounts(10, 3);
  EXPECT_EQ(a2a.param_count, 3u);
  EXPECT_EQ(a2a.send_count, 9u);
  EXPECT_FALSE(findCollTest("hypercube")->unsupported(3).empty());
  EXPECT_TRUE(findCollTest("hypercube")->unsupported(4).empty());
}

// Reduces every rank's input in a given rank order, in the accumulator type but rounding
// to the storage type after every step (what a ring does), so any order dependence shows.
template <class T, ReduceOp Op>
std::vector<T> reduceInOrder(const DataSpec& s, const std::vector<int>& order, size_t count) {
  using R = Reducer<T, Op>;
  std::vector<std::vector<T>> in(s.nranks, std::vector<T>(count));
  for (int r = 0; r < s.nranks; ++r) fillInput(s, r, 0, count, in[r].data());
  std::vector<T> out(count);
  const AccumT<T> scalar = static_cast<AccumT<T>>(s.premul_scalar);
  for (size_t i = 0; i < count; ++i) {
    T acc = storeAcc<T>(R::pre(loadAcc(in[order[0]][i]), scalar));
    for (size_t k = 1; k < order.size(); ++k)
      acc = storeAcc<T>(R::combine(loadAcc(acc), R::pre(loadAcc(in[order[k]][i]), scalar)));
    out[i] = storeAcc<T>(R::post(loadAcc(acc), s.nranks));
  }
  return out;
}

template <class T, ReduceOp Op>
void expectExactInAnyOrder(DataType type, int nranks) {
  DataSpec s;
  s.type = type;
  s.op = Op;
  s.nranks = nranks;
  s.seed = 1234;
  s.premul_scalar = premulScalar();
  std::vector<int> forward(nranks), backward(nranks), shuffled(nranks);
  for (int r = 0; r < nranks; ++r) {
    forward[r] = r;
    backward[r] = nranks - 1 - r;
    shuffled[r] = (r * 5 + 3) % nranks;
  }
  if (nranks % 5 == 0) shuffled = backward;  // 5 must be coprime to n for a permutation
  const size_t count = 4096;
  for (const auto& order : {forward, backward, shuffled}) {
    std::vector<T> got = reduceInOrder<T, Op>(s, order, count);
    EXPECT_EQ(countWrong(s, 0, 0, count, got.data()), 0u)
        << dataTypeName(type) << " " << reduceOpName(Op) << " nranks " << nranks;
  }
  // Planted corruption is caught.
  std::vector<T> got = reduceInOrder<T, Op>(s, forward, count);
  reinterpret_cast<unsigned char*>(got.data())[sizeof(T) * 17] ^= 0x5A;
  EXPECT_EQ(countWrong(s, 0, 0, count, got.data()), 1u) << dataTypeName(type) << " " << reduceOpName(Op);
}

template <ReduceOp Op>
void allTypes(int nranks) {
  expectExactInAnyOrder<float, Op>(DataType::kFloat32, nranks);
  expectExactInAnyOrder<double, Op>(DataType::kFloat64, nranks);
  expectExactInAnyOrder<Float16, Op>(DataType::kFloat16, nranks);
  expectExactInAnyOrder<BFloat16, Op>(DataType::kBFloat16, nranks);
  expectExactInAnyOrder<Float8E4M3, Op>(DataType::kFloat8E4M3, nranks);
  expectExactInAnyOrder<Float8E5M2, Op>(DataType::kFloat8E5M2, nranks);
  if constexpr (Op != ReduceOp::kPreMulSum) {
    expectExactInAnyOrder<int8_t, Op>(DataType::kInt8, nranks);
    expectExactInAnyOrder<uint32_t, Op>(DataType::kUInt32, nranks);
    expectExactInAnyOrder<int64_t, Op>(DataType::kInt64, nranks);
  }
}

TEST(PerfVerifiable, ReductionsExactInAnyOrder) {
  for (int n : {1, 2, 3, 7, 16, 33}) {
    allTypes<ReduceOp::kSum>(n);
    allTypes<ReduceOp::kProd>(n);
    allTypes<ReduceOp::kMin>(n);
    allTypes<ReduceOp::kMax>(n);
    allTypes<ReduceOp::kAvg>(n);
    allTypes<ReduceOp::kPreMulSum>(n);
  }
}

TEST(PerfVerifiable, DataMovementIsRankAndIndexSpecific) {
  DataSpec s;
  s.type = DataType::kFloat32;
  s.nranks = 4;
  s.seed = 7;
  std::vector<float> a(1024), b(1024);
  fillInput(s, 1, 100, a.size(), a.data());
  EXPECT_EQ(countWrong(s, 1, 100, a.size(), a.data()), 0u);
  EXPECT_EQ(countWrong(s, 2, 100, a.size(), a.data()), a.size());      // another rank's data: all wrong
  EXPECT_GT(countWrong(s, 1, 101, a.size(), a.data()), a.size() - 4);  // shifted by one element
  fillInput(s, 1, 0, b.size(), b.data());
  // Element i depends on (seed, rank, i) only, not on where a fill starts.
  EXPECT_EQ(std::memcmp(a.data(), b.data() + 100, (b.size() - 100) * sizeof(float)), 0);
}

TEST(PerfVerifiable, ReductionInputsAreNotTrivial) {
  // Sum inputs vary by index (a misplaced block would be caught).
  DataSpec s;
  s.type = DataType::kFloat8E5M2;
  s.op = ReduceOp::kSum;
  s.nranks = 16;
  s.seed = 3;
  std::vector<Float8E5M2> x(256);
  fillInput(s, 0, 0, x.size(), x.data());
  std::vector<float> sums(x.size(), 0.f);
  for (int r = 0; r < s.nranks; ++r) {
    fillInput(s, r, 0, x.size(), x.data());
    for (size_t i = 0; i < x.size(); ++i) sums[i] += x[i].toFloat();
  }
  int distinct = 0;
  for (size_t i = 1; i < sums.size(); ++i) distinct += sums[i] != sums[i - 1];
  EXPECT_GT(distinct, 100);
}

}  // namespace
}  // namespace crossbar::perf
