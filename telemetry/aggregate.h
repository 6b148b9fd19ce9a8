// Joins the ranks' per-step summaries (rank<r>.jsonl files, or lines from a Store)
// into a cross-rank report. Only steps every rank has completed are reported: the
// last step of a job that stopped mid-step (or a torn last line) is left out.
// crossbar-report implements the same rules in Python; keep them in step.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "telemetry/telemetry.h"

namespace crossbar::telemetry {

struct AggregateOptions {
  uint64_t creep_bytes_per_step = 1 << 20;  // CROSSBAR_TELEMETRY_CREEP_BYTES
  int64_t stall_ns = 20'000'000;            // CROSSBAR_TELEMETRY_STALL_MS
  size_t creep_window = 32;                 // last steps in the linear fit
  size_t warmup_steps = 2;                  // left out of the creep fit (allocator warm-up)
  static AggregateOptions fromEnv();
};

struct StepReport {
  uint64_t step = 0;
  int worst_rank = -1;  // longest step time
  int64_t worst_ns = 0;
  int64_t median_ns = 0;  // median rank's step time
  int64_t stddev_ns = 0;  // across ranks
  // Straggler: the rank that kept the others waiting, i.e. the most busy time (outside
  // communication: step_ns - max(comm_ns, wait_ns), since waits happen inside the
  // collectives); its margin is that busy time minus the median rank's.
  int straggler = -1;
  int64_t straggler_margin_ns = 0;
  int64_t comm_median_ns = 0, comm_max_ns = 0;
  int64_t wait_median_ns = 0, wait_max_ns = 0;
  std::vector<int> stalls;   // ranks whose data-loading phase stalled
  int64_t stall_max_ns = 0;  // longest stalled data phase
  uint64_t rss_max = 0;      // host memory high-water over ranks
  int rss_max_rank = -1;
  uint64_t device_mem_max = 0;  // device (CUDA) memory high-water over ranks
  int device_mem_max_rank = -1;
  // Last arrival as the collectives saw it: the peer the other ranks' ops waited on
  // longest (summed over their ops' "waited_on"), and that wait.
  int last_arrival = -1;
  int64_t last_arrival_wait_ns = 0;
};

struct CreepReport {
  int rank = 0;
  double slope_bytes_per_step = 0;  // linear fit of the per-step RSS high-water
  bool flagged = false;
  double device_slope_bytes_per_step = 0;  // same for the device-memory high-water
  bool device_flagged = false;
};

struct Report {
  int world_size = 0;
  std::vector<StepReport> steps;     // complete steps only, in order
  std::vector<uint64_t> incomplete;  // steps some rank has not finished
  std::vector<CreepReport> creep;    // per rank
  double step_time_mean_ns = 0;      // of the worst-rank step time over steps
  double step_time_stddev_ns = 0;
  std::string toJson() const;
};

// Parses one JSON line written by Recorder::step(); nullopt for torn or foreign lines.
std::optional<StepSummary> parseStepLine(std::string_view line);

// Reads every rank<r>.jsonl in `dir`.
std::vector<StepSummary> loadDir(const std::string& dir);

Report aggregate(const std::vector<StepSummary>& summaries, const AggregateOptions& options = {});

// Live aggregation on rank 0: reads telemetry/<r>/<step> for every rank from `store`
// (published by Recorder::attachStore) and waits for them until `timeout_ms`.
std::vector<StepSummary> collectFromStore(Store& store, int world_size, uint64_t step, int64_t timeout_ms);

}  // namespace crossbar::telemetry
