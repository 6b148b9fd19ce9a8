// GPU checks of symmem/cuda, shared by the gtest binary (test_symmem_cuda_gpu) and
// the standalone runner perf/gpu/gpu_selftest (no gtest; used by perf/gpu_check.sh).
//
// Every check runs in forked child processes, so the calling process never
// initializes CUDA (a CUDA context does not survive fork()). Multi-process checks
// get a socketpair for exchanging handle bytes and fds (SCM_RIGHTS).
#pragma once

#include <string>
#include <vector>

namespace crossbar::gpucheck {

enum class Status { kPass, kFail, kSkip };

struct Result {
  Status status = Status::kFail;
  std::string message;  // failure text or skip reason
  double seconds = 0;
};

struct Check {
  const char* name;
  const char* description;
  int processes;                     // 1 or 2
  void (*body)(int rank, int sock);  // throws on failure; throws SkipCheck to skip
};

// Thrown by a check body to skip (e.g. multicast unsupported).
struct SkipCheck {
  std::string reason;
};

const std::vector<Check>& allChecks();
const Check* findCheck(const std::string& name);

// "" when a forked child can use a CUDA device, else why not (cached).
const std::string& gpuUnavailableReason();

// Runs the check in fresh child processes, killing them after `timeout_s`.
Result runCheck(const Check& check, int timeout_s = 120);

const char* statusName(Status s);

}  // namespace crossbar::gpucheck
