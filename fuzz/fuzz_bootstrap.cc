// detectBootstrap over random launcher environments: lines "NAME=value" build the map
// (torchrun, mpirun, srun and CROSSBAR_* variables); any result must be self-consistent.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>

#include "comm/bootstrap.h"
#include "comm/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::map<std::string, std::string> env;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  try {
    const crossbar::BootstrapInfo info = crossbar::detectBootstrap(env);
    if (info.size <= 0 || info.rank < 0 || info.rank >= info.size) std::abort();
  } catch (const crossbar::InvalidArgument&) {
  }
  try {
    crossbar::expandHostlist(env.count("SLURM_JOB_NODELIST") ? env["SLURM_JOB_NODELIST"]
                                                             : text.substr(0, 256));
  } catch (const crossbar::InvalidArgument&) {
  }
  return 0;
}
