// Where a perf run's buffers live and how its collectives are issued, completed and
// timed: host memory (crossbar's CPU collectives) or CUDA memory (the stream-ordered
// CUDA collectives). The driver (driver.cc) is written once over this interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "perf/driver.h"

namespace crossbar {
class Communicator;
}

namespace crossbar::perf {

class RunBackend {
 public:
  virtual ~RunBackend() = default;

  virtual const char* memoryName() const = 0;  // "host" / "cuda"
  // What follows "device " in this rank's "#  Rank" line (nccl-tests: "%2d [%04x:%02x:%02x] name").
  virtual std::string deviceDescription() const = 0;
  virtual int deviceIndex() const = 0;  // -1: no device (host memory)

  // Buffers: `bytes` zeroed bytes, at least 4 KiB aligned.
  virtual char* allocate(size_t bytes) = 0;
  virtual void release(char* buffer) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;
  virtual void upload(void* dst, const void* host, size_t bytes) = 0;    // host -> buffer
  virtual void download(void* host, const void* src, size_t bytes) = 0;  // buffer -> host
  // True when buffers are host memory the driver may read and write directly.
  virtual bool hostAccessible() const = 0;

  // Starts one collective (in issue order), without waiting for it.
  virtual void start(const CollTest& t, const RunArgs& a) = 0;
  // Waits for everything started (bounded by the collective deadline).
  virtual void complete() = 0;

  // Per-iteration timeline (-I): mark() records the current issue position; after
  // complete(), markTimes() gives, per mark, the time in seconds (from an arbitrary common
  // origin) at which everything started before it had completed, and forgets the marks.
  virtual void mark() = 0;
  virtual std::vector<double> markTimes() = 0;
  virtual const char* timingName() const = 0;  // "host clock" / "CUDA event"

  // -M: memory in use by this process on the buffers' side (host RSS, device used bytes).
  virtual int64_t memoryInUse() const = 0;
  virtual const char* memoryReportLabel() const = 0;  // "Host memory usage" / "GPU memory usage"
};

// Host memory; collectives through `coll` (kept by the caller).
// `symmetric_inputs` (-R 2): buffers from a symmetric heap over `comm`, which `coll` runs
// on, so one-node collectives read inputs in place.
std::unique_ptr<RunBackend> makeHostBackend(std::shared_ptr<Communicator> comm, Collectives& coll,
                                            bool symmetric_inputs);

// CUDA memory on this node's GPU (local rank modulo the visible devices), the CUDA
// collectives on one stream per rank (-y 1: the legacy default stream). Throws
// InvalidUsage with the reason when CUDA is unavailable (no GPU, no driver, or a build
// without CUDA).
std::unique_ptr<RunBackend> makeCudaBackend(std::shared_ptr<Communicator> comm, const Options& o);

// "" when --mem cuda can run here, else why not ("no CUDA device is visible: ..."). Probed
// in a short-lived child process, so the caller's CUDA state stays uninitialized (ranks
// fork after this).
std::string cudaUnavailableReason();

// Resident set size of this process (bytes), for the host -M report.
int64_t residentBytes();

}  // namespace crossbar::perf
