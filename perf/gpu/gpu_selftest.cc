// Standalone GPU self-test (no gtest): runs the checks of tests/symmem_cuda/gpu_checks
// and prints one PASS/FAIL/SKIP line each. Used by perf/gpu_check.sh.
//   gpu_selftest [--list] [--only a,b] [--timeout SECONDS]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#include "gpu_checks.h"

using namespace crossbar::gpucheck;

int main(int argc, char** argv) {
  std::string only;
  int timeout_s = 120;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--list")) {
      for (const Check& c : allChecks())
        std::printf("%-20s %d proc  %s\n", c.name, c.processes, c.description);
      return 0;
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];
    } else if (!std::strcmp(argv[i], "--timeout") && i + 1 < argc) {
      timeout_s = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--list] [--only name,name] [--timeout seconds]\n", argv[0]);
      return 2;
    }
  }
  const std::string& why = gpuUnavailableReason();
  if (!why.empty()) std::printf("note: %s (every check will SKIP)\n", why.c_str());
  int pass = 0, fail = 0, skip = 0;
  for (const Check& c : allChecks()) {
    if (!only.empty()) {
      std::stringstream ss(only);
      std::string item;
      bool wanted = false;
      while (std::getline(ss, item, ',')) wanted |= item == c.name;
      if (!wanted) continue;
    }
    std::printf("RUN  %s: %s\n", c.name, c.description);
    std::fflush(stdout);
    Result r = runCheck(c, timeout_s);
    std::printf("%s %s (%.2f s)%s%s\n", statusName(r.status), c.name, r.seconds,
                r.message.empty() ? "" : ": ", r.message.c_str());
    std::fflush(stdout);
    (r.status == Status::kPass ? pass : r.status == Status::kFail ? fail : skip)++;
  }
  std::printf("selftest: %d passed, %d failed, %d skipped\n", pass, fail, skip);
  return fail ? 1 : 0;
}
