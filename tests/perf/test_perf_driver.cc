// Unit tests of the perf driver: nccl-tests' options and defaults, the table layout,
// bandwidth factors and byte counts per collective, and the verifiable data.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <regex>
#include <string>
#include <vector>

#include "collectives/reduce.h"
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
                     "-I",
                     "1",
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
  EXPECT_EQ(o.in_place, 1);
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

TEST(PerfTable, HeaderMatchesNcclTestsLayout) {
  std::string h = tableHeader(false);
  std::vector<std::string> lines;
  size_t pos = 0;
  while (pos < h.size()) {
    size_t nl = h.find('\n', pos);
    lines.push_back(h.substr(pos, nl - pos));
    pos = nl + 1;
  }
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0].substr(0, 2), "# ");
  EXPECT_NE(lines[0].find("out-of-place"), std::string::npos);
  EXPECT_NE(lines[0].find("in-place"), std::string::npos);
  EXPECT_EQ(
      lines[1],
      "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw"
      "   busbw #wrong");
  EXPECT_EQ(
      lines[2],
      "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)"
      "  (GB/s)       ");
  EXPECT_NE(tableHeader(true).find("cputime"), std::string::npos);
}

TEST(PerfTable, RowParsesWithNcclTestsRegex) {
  std::string row = rowPrefix(1048576, 262144, "float", "sum", -1) + rowColumns(123.456, 8.5, 12.75, 0) +
                    rowColumns(12345.6, 0.01, 0.02, -1);
  // The column layout nccl-tests prints: %12li  %12li  %8s  %6s  %6s, then per placement
  // "  %7s  %6.2f  %6.2f  %5g".
  EXPECT_EQ(
      row,
      "     1048576        262144     float     sum      -1    123.5    8.50   12.75      0    12346    0.01"
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

TEST(PerfTable, TimeFormatByMagnitude) {
  EXPECT_EQ(formatTime(5.123), "   5.12");
  EXPECT_EQ(formatTime(150.25), "  150.2");
  EXPECT_EQ(formatTime(12345.6), "  12346");
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
