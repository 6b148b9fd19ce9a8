// RankInfo::deserialize: what every rank reads from the store about its peers. A valid
// result must survive a serialize/deserialize round trip unchanged.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "comm/errors.h"
#include "comm/topology.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  crossbar::RankInfo info;
  try {
    info = crossbar::RankInfo::deserialize(text);
  } catch (const crossbar::InvalidArgument&) {
    return 0;
  }
  const crossbar::RankInfo again = crossbar::RankInfo::deserialize(info.serialize());
  if (again.host != info.host || again.machine_id != info.machine_id || again.cpuset != info.cpuset ||
      again.pid != info.pid || again.numa_node != info.numa_node || again.node_override != info.node_override)
    std::abort();
  return 0;
}
