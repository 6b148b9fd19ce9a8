// crossbar-info: what this build contains and what it sees on this machine: version and
// build options, hardware topology (hwloc), transports, every CROSSBAR_* variable, and
// the collective algorithm table. `--json` gives the same as one JSON object.
#include <fmt/format.h>
#if __has_include("collectives/selection.h")
#include "collectives/selection.h"
#endif
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/topology.h"
#include "crossbar_build_info.h"

namespace {

using namespace crossbar;

std::string jsonString(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20)
          out += fmt::format("\\u{:04x}", c);
        else
          out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// --- transports ----------------------------------------------------------------------------

struct TransportStatus {
  std::string name;
  bool available = false;
  std::string detail;
};

std::vector<TransportStatus> transports() {
  std::vector<TransportStatus> out;
  // shm needs memfd segments that other local ranks map.
  int fd = memfd_create("crossbar-info-probe", MFD_CLOEXEC);
  if (fd >= 0) {
    close(fd);
    out.push_back({"shm", true, "memfd shared memory between ranks of one node"});
  } else {
    out.push_back({"shm", false, fmt::format("memfd_create failed: {}", std::strerror(errno))});
  }
  out.push_back({"ucx", true, fmt::format("UCX {} (between nodes)", ucp_get_version_string())});
  out.push_back(
      {"nccl", CROSSBAR_CUDA_ENABLED != 0,
       CROSSBAR_CUDA_ENABLED ? "CUDA build (GPU memory)" : "not built (CROSSBAR_WITH_CUDA=OFF or no CUDA)"});
  return out;
}

// --- environment variables -----------------------------------------------------------------

struct VariableState {
  const env::Variable* variable;
  bool set = false;
  std::string value;  // as set in the environment
  std::string error;  // why the value is invalid, if it is
};

std::vector<VariableState> variables() {
  std::vector<VariableState> out;
  for (const auto& v : env::all()) {
    VariableState s;
    s.variable = &v;
    s.set = env::isSet(v.name);
    if (s.set) {
      s.value = env::raw(v.name);
      try {  // parse it as crossbar will, so typos show up here first
        switch (v.type) {
          case env::Type::kBool:
            env::getBool(v.name);
            break;
          case env::Type::kInt:
            env::getInt(v.name);
            break;
          case env::Type::kSize:
            env::getSize(v.name);
            break;
          case env::Type::kMillis:
            env::getMillis(v.name);
            break;
          case env::Type::kEnum:
            env::getEnum(v.name);
            break;
          case env::Type::kString:
            break;
        }
      } catch (const std::exception& e) {
        s.error = e.what();
      }
    }
    // Never print the store's shared job secret.
    if (s.set && v.name == "CROSSBAR_SECRET") s.value = "(set, hidden)";
    out.push_back(std::move(s));
  }
  return out;
}

std::string typeText(const env::Variable& v) {
  if (v.type != env::Type::kEnum) return env::typeName(v.type);
  std::string choices;
  for (auto c : v.choices) choices += (choices.empty() ? "" : "|") + std::string(c);
  return choices;
}

// --- algorithm table -------------------------------------------------------------------------

// Hook for the collectives layer: once it exists, print its selection table here
// (collective x size range x ranks x topology -> algorithm, and CROSSBAR_ALGO overrides).
void printAlgorithmTable(bool json, std::string& out) {
#if __has_include("collectives/selection.h")
  std::string table = describeAlgorithmTable();
  if (json) {
    out += jsonString(table);
  } else {
    out += "\ncollective algorithm table (first matching row wins; CROSSBAR_ALGO overrides):\n";
    out += table;
    if (!table.empty() && table.back() != '\n') out += "\n";
  }
#else
  out += json ? "null" : "algorithm table: (collectives layer not built)\n";
#endif
}

// --- output ----------------------------------------------------------------------------------

std::string text(bool brief) {
  std::string out;
  out += fmt::format("crossbar {}\n", CROSSBAR_VERSION);
  out += fmt::format("  build type: {}\n  CUDA: {}\n  compiler: {}\n\n",
                     std::string_view(CROSSBAR_BUILD_TYPE).empty() ? "(none)" : CROSSBAR_BUILD_TYPE,
                     CROSSBAR_CUDA_ENABLED ? "enabled" : "disabled", CROSSBAR_COMPILER);

  out += "topology:\n";
  try {
    const std::string machine = describeMachine().describe();
    for (std::string_view rest = machine; !rest.empty();) {
      size_t nl = rest.find('\n');
      out += "  " + std::string(rest.substr(0, nl)) + "\n";
      rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    }
    RankInfo self = describeThisProcess();
    out += fmt::format("  this process: cpus {}, NUMA node {}, machine id {}\n", self.cpuset,
                       self.numa_node < 0 ? "?" : std::to_string(self.numa_node), self.machine_id);
  } catch (const std::exception& e) {
    out += fmt::format("  unavailable: {}\n", e.what());
  }
  out += "\ntransports:\n";
  for (const auto& t : transports())
    out += fmt::format("  {:<5} {:<13} {}\n", t.name, t.available ? "available" : "unavailable", t.detail);

  if (brief) {
    out += "\n(crossbar-info without --brief also lists every CROSSBAR_* variable and the algorithm table)\n";
    return out;
  }
  out += "\nenvironment variables:\n";
  auto vars = variables();
  size_t wn = 4, wt = 4, wd = 7, wc = 7;
  for (const auto& s : vars) {
    wn = std::max(wn, s.variable->name.size());
    wt = std::max(wt, typeText(*s.variable).size());
    wd = std::max(wd, s.variable->default_value.size());
    wc = std::max(wc, s.set ? s.value.size() : 1);
  }
  wc = std::min<size_t>(wc, 32);
  out += fmt::format("  {:<{}}  {:<{}}  {:<{}}  {:<{}}  {}\n", "NAME", wn, "TYPE", wt, "DEFAULT", wd,
                     "CURRENT", wc, "DESCRIPTION");
  for (const auto& s : vars) {
    const auto& v = *s.variable;
    std::string def = v.default_value.empty() ? "\"\"" : std::string(v.default_value);
    out += fmt::format("  {:<{}}  {:<{}}  {:<{}}  {:<{}}  {}\n", v.name, wn, typeText(v), wt, def, wd,
                       s.set ? s.value : "-", wc, v.description);
    if (!s.error.empty()) out += fmt::format("  {:<{}}  ^ INVALID: {}\n", "", wn, s.error);
  }
  out += "\n";
  printAlgorithmTable(false, out);
  return out;
}

std::string json() {
  std::string out = "{\n";
  out += fmt::format("  \"version\": {},\n", jsonString(CROSSBAR_VERSION));
  out += fmt::format("  \"build\": {{\"type\": {}, \"cuda\": {}, \"compiler\": {}}},\n",
                     jsonString(CROSSBAR_BUILD_TYPE), CROSSBAR_CUDA_ENABLED ? "true" : "false",
                     jsonString(CROSSBAR_COMPILER));
  out += "  \"topology\": ";
  try {
    MachineInfo m = describeMachine();
    RankInfo self = describeThisProcess();
    out += fmt::format("{{\"host\": {}, \"packages\": {}, \"numa_nodes\": {}, \"cores\": {}, \"pus\": {}, ",
                       jsonString(m.host), m.packages, m.numa_nodes, m.cores, m.pus);
    out += "\"devices\": [";
    for (size_t i = 0; i < m.devices.size(); ++i) {
      const auto& d = m.devices[i];
      out += fmt::format("{}{{\"kind\": {}, \"bus_id\": {}, \"name\": {}, \"numa_node\": {}}}", i ? ", " : "",
                         jsonString(d.kind), jsonString(d.bus_id), jsonString(d.name), d.numa_node);
    }
    out += "], \"numa_distances\": [";
    for (size_t i = 0; i < m.numa_distances.size(); ++i)
      out += fmt::format("{}[{}]", i ? ", " : "", fmt::join(m.numa_distances[i], ", "));
    out += fmt::format("], \"process\": {{\"cpuset\": {}, \"numa_node\": {}, \"machine_id\": {}}}}},\n",
                       jsonString(self.cpuset), self.numa_node, jsonString(self.machine_id));
  } catch (const std::exception& e) {
    out += fmt::format("{{\"error\": {}}},\n", jsonString(e.what()));
  }
  out += "  \"transports\": [";
  auto ts = transports();
  for (size_t i = 0; i < ts.size(); ++i)
    out += fmt::format("{}{{\"name\": {}, \"available\": {}, \"detail\": {}}}", i ? ", " : "",
                       jsonString(ts[i].name), ts[i].available ? "true" : "false", jsonString(ts[i].detail));
  out += "],\n  \"environment\": [\n";
  auto vars = variables();
  for (size_t i = 0; i < vars.size(); ++i) {
    const auto& s = vars[i];
    const auto& v = *s.variable;
    std::string choices;
    for (auto c : v.choices) choices += (choices.empty() ? "" : ", ") + jsonString(c);
    out += fmt::format(
        "    {{\"name\": {}, \"type\": {}, \"default\": {}, \"choices\": [{}], \"value\": {}, \"valid\": {}, "
        "\"error\": {}, \"description\": {}}}{}\n",
        jsonString(v.name), jsonString(env::typeName(v.type)), jsonString(v.default_value), choices,
        s.set ? jsonString(s.value) : "null", s.error.empty() ? "true" : "false",
        s.error.empty() ? "null" : jsonString(s.error), jsonString(v.description),
        i + 1 < vars.size() ? "," : "");
  }
  out += "  ],\n  \"algorithms\": ";
  printAlgorithmTable(true, out);
  out += "\n}\n";
  return out;
}

void usage(FILE* out) {
  std::fprintf(out,
               "usage: crossbar-info [--json] [--brief]\n"
               "\n"
               "Prints crossbar's version and build options, this machine's topology, the\n"
               "transports, every CROSSBAR_* environment variable (type, default, current value)\n"
               "and the collective algorithm table.\n"
               "  --json   one JSON object instead of text\n"
               "  --brief  version, build, topology and transports only\n"
               "  --help   show this help\n");
}

}  // namespace

int main(int argc, char** argv) {
  bool as_json = false, brief = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--json") {
      as_json = true;
    } else if (arg == "--brief") {
      brief = true;
    } else if (arg == "--help" || arg == "-h") {
      usage(stdout);
      return 0;
    } else {
      std::fprintf(stderr, "crossbar-info: unknown argument '%s'\n\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  try {
    std::string out = as_json ? json() : text(brief);
    std::fwrite(out.data(), 1, out.size(), stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "crossbar-info: %s\n", e.what());
    return 1;
  }
  return 0;
}
