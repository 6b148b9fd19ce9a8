// Counters the crossbar NCCL plugins export next to their ABI symbol, so a test (or the
// GPU check, which dlopens the same path NCCL loaded) can tell that NCCL loaded the
// plugin and drove it. C layout; look the functions up with dlsym.
#pragma once

#include <stdint.h>

extern "C" {

struct CrossbarProfilerStats {
  uint64_t inits;            // communicators the profiler was initialized for
  uint64_t coll_api;         // ncclProfileCollApi events (user API calls; counted only)
  uint64_t colls;            // ncclProfileColl events started
  uint64_t colls_recorded;   // collectives turned into telemetry op records
  uint64_t kernel_channels;  // ncclProfileKernelCh events
  uint64_t proxy_ops;        // ncclProfileProxyOp events
  uint64_t proxy_steps;      // ncclProfileProxyStep events
  uint64_t last_bytes;       // of the last recorded collective
  char last_func[32];        // its NCCL name ("AllReduce")
};
// Fills `out`; returns 0.
typedef int (*crossbar_profiler_stats_fn)(CrossbarProfilerStats* out);
#define CROSSBAR_PROFILER_STATS_SYMBOL "crossbar_profiler_stats"

struct CrossbarTunerStats {
  uint64_t inits;          // communicators the tuner was initialized for
  uint64_t rules;          // table rows loaded (all communicators)
  uint64_t consulted;      // getCollInfo calls
  uint64_t applied;        // calls where a row set the cost table
};
typedef int (*crossbar_tuner_stats_fn)(CrossbarTunerStats* out);
#define CROSSBAR_TUNER_STATS_SYMBOL "crossbar_tuner_stats"
}
