// The common driver of the nccl-tests-compatible perf binaries (all_reduce_perf, ...).
// One driver, plus a small table per collective (byte counts from a size, data
// initialization and checking, bus-bandwidth factor, run), as nccl-tests does. Command
// line, header, table and footer read the same as nccl-tests', so scripts that parse
// nccl-tests output parse ours.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/dtype.h"

namespace crossbar::perf {

// ---- options ---------------------------------------------------------------------------
struct Options {
  // nccl-tests options, same defaults.
  int nthreads = 1;
  int ngpus = 1;
  size_t min_bytes = 32u << 20;
  size_t max_bytes = 32u << 20;
  size_t step_bytes = 1u << 20;
  size_t step_factor = 1;  // > 1: multiply sizes by it instead of adding step_bytes
  int iters = 20;
  int agg_iters = 1;
  int warmup_iters = 1;
  int run_cycles = 1;  // 0: forever
  int parallel_init = 0;
  int check = 1;  // data-check iterations per size (0: no check, #wrong prints N/A)
  std::vector<ReduceOp> ops{ReduceOp::kSum};
  bool all_ops = false;
  std::vector<DataType> types{DataType::kFloat32};
  bool all_types = false;
  int root = 0;
  bool all_roots = false;
  // -z: 0 none; 1 wait + barrier after each collective; 2 wait after each collective;
  // 3 wait after each, barrier after each outer iteration (-n), barrier time excluded.
  int blocking = 0;
  int stream_null = 0;
  int timeout_s = 0;
  int cudagraph = 0;
  int report_cputime = 0;
  int report_timestamps = 0;  // -S: a timestamp column after the in-place columns
  int average = 1;            // time reported: 0 rank 0, 1 mean, 2 min, 3 max over ranks
  int local_register = 0;
  int cta_policy = -1;
  int device_impl = 0;        // -D: NCCL device-API implementation (crossbar has none: 0 only)
  int device_cta_count = 16;  // -V
  int memory_report = 0;      // -M: memory usage line in the footer
  int unalign = 0;            // -u: buffers start this many elements past their alignment
  int per_iter_timing = 0;    // -I: per-iteration min/max/p99/cv% columns
  int per_iter_skip = 0;      // -K: leading iterations left out of the -I statistics
  std::string output_file;    // -J: nccl-tests' JSON document (only a .json suffix writes)
  // nccl-tests' "... Disabling." notes for inconsistent options (printed, then run on).
  std::vector<std::string> notes;

  // crossbar extensions (long options only).
  std::string mem = "host";
  int in_place = 0;  // --placement: 0 both columns, 1 in-place only, 2 out-of-place only
  std::string algo;
  int ranks_per_node = 0;
  std::string json_lines;     // --json: one JSON record per size and placement
  int nranks = 0;             // --nranks: fork this many local ranks (0: launcher or 1)
  bool inject_error = false;  // --inject-error: corrupt one result element (tests the checker)
  bool help = false;
};

// Thrown for a bad command line; the message names the option and what is accepted.
struct UsageError {
  std::string message;
};

// Parses argv (argv[0] is the program). Throws UsageError.
Options parseOptions(int argc, char** argv);
std::string usage(const std::string& program);

// nccl-tests' size syntax: a number with an optional K/M/G suffix (powers of 2).
std::optional<size_t> parseSizeArg(const std::string& text);

// ---- verifiable data -------------------------------------------------------------------
// Inputs are functions of (seed, rank, index) chosen so a reduction's result is exact in
// any order (small integers, powers of two), and is computed here in closed form by
// folding the ranks' inputs; data-movement collectives use arbitrary bit patterns.
struct DataSpec {
  DataType type = DataType::kFloat32;
  std::optional<ReduceOp> op;  // nullopt: data movement
  int nranks = 1;
  uint64_t seed = 0;
  double premul_scalar = 2.0;
};
// Writes rank `rank`'s input elements [first, first + count) to dst.
void fillInput(const DataSpec& s, int rank, size_t first, size_t count, void* dst);
// Element-wise comparison of `got` with the expected result: for a reduction the
// reduction over all ranks of elements [first, first + count); for data movement rank
// `src_rank`'s elements [first, ...). Returns the number of wrong elements.
size_t countWrong(const DataSpec& s, int src_rank, size_t first, size_t count, const void* got);
// The premul-sum scalar every rank passes (a power of two: exact).
double premulScalar();

// ---- per-collective table --------------------------------------------------------------
struct ByteCounts {
  size_t send_count = 0;           // elements in the send buffer
  size_t recv_count = 0;           // elements in the receive buffer
  size_t param_count = 0;          // the count passed to the collective (printed "count")
  size_t send_inplace_offset = 0;  // in place: send = recv + offset * rank (elements)
  size_t recv_inplace_offset = 0;  // in place: recv = send + offset * rank (elements)
};

struct Buffers {
  char* send = nullptr;
  char* recv = nullptr;
};

struct RunArgs {
  Collectives* coll = nullptr;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  // param_count
  DataType type = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  CollOptions options;
};

struct CollTest {
  const char* name;       // "all_reduce": the binary is name + "_perf"
  bool reduction;         // uses -o (else the op prints "none")
  bool rooted;            // uses -r (else the root prints -1)
  bool root_only_result;  // only the root's receive buffer holds a result (reduce, gather)
  ByteCounts (*byteCounts)(size_t count, int nranks);
  double (*busFactor)(int nranks);
  // algbw = bytes_moved / time with bytes_moved = algBytes(param_count * elsize, nranks).
  double (*algBytesFactor)(int nranks);
  WorkPtr (*run)(const RunArgs& a);
  // Wrong elements in this rank's result; every rank's input is fillInput(rank, 0..send_count).
  size_t (*check)(const DataSpec& s, int rank, int root, size_t param_count, const char* recv);
  // Requirements on the rank count (hypercube: power of 2); empty = fine.
  std::string (*unsupported)(int nranks);
};

const CollTest* findCollTest(const std::string& name);
const std::vector<const CollTest*>& allCollTests();

// algbw and busbw in GB/s (1e9 bytes) for one timing, as nccl-tests computes them.
void computeBandwidth(const CollTest& t, size_t param_count, size_t elem_size, double seconds, int nranks,
                      double* algbw, double* busbw);

// ---- output ----------------------------------------------------------------------------
// A number in `width` characters: "%.2f", else "%.1f", else "%.0f", else exponent, as
// nccl-tests' getFloatStr.
std::string formatFloat(double value, int width);
std::string formatTime(double usec);  // formatFloat(usec, 7)
// The three "#" lines above the rows (-C: cputime, -S: timestamp column, -I: per-iteration).
std::string tableHeader(bool cputime, bool timestamps = false, bool per_iter = false);
std::string rowPrefix(size_t bytes, size_t count, const std::string& type, const std::string& op, int root);
// One placement's columns; wrong < 0 prints N/A (no check).
std::string rowColumns(double usec, double algbw, double busbw, long long wrong);
// The timestamp column of -S ("%21s" of the local time, "%Y-%m-%d %H:%M:%S").
std::string timestampColumn();

// -I: statistics over per-iteration times (seconds), as nccl-tests computes them.
struct IterStats {
  double min = 0, max = 0, avg = 0, p50 = 0, p95 = 0, p99 = 0, stdev = 0;
  double cvPercent() const { return avg > 0 ? stdev / avg * 100.0 : 0.0; }
};
IterStats computeIterStats(const std::vector<double>& seconds);
std::string perIterColumns(const IterStats& s);  // "  i_min  i_max  i_p99  i_cv%"
// Human size of a memory amount, as nccl-tests' -M line ("1.50 GB", "12.0 MB", "512 B").
std::string memoryString(int64_t bytes);
std::string opDisplayName(std::optional<ReduceOp> op);  // nccl-tests spelling ("mulsum", "none")

// ---- driver ----------------------------------------------------------------------------
// main() of a perf binary. Returns the process exit code.
int perfMain(const std::string& coll_name, int argc, char** argv);

}  // namespace crossbar::perf
