#include "comm/bootstrap.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdint>
#include <deque>
#include <optional>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"
#include "comm/tcp_store.h"

extern char** environ;

namespace crossbar {

namespace {

using EnvMap = std::map<std::string, std::string>;

constexpr const char* kLaunchersTried =
    "Launchers tried, in order: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
    "MASTER_PORT); OpenMPI mpirun (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK, "
    "OMPI_COMM_WORLD_LOCAL_SIZE); Slurm srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, "
    "SLURM_STEP_TASKS_PER_NODE/SLURM_NTASKS_PER_NODE/SLURM_TASKS_PER_NODE, SLURM_JOB_ID, "
    "SLURM_STEP_NODELIST/SLURM_JOB_NODELIST). The store address comes from CROSSBAR_STORE_ADDR (host:port), "
    "else MASTER_ADDR and MASTER_PORT, else the launcher.";

[[noreturn]] void fail(const std::string& launcher, const std::string& what) {
  throw InvalidArgument(
      fmt::format("{}{}: {}. {}", errorContext(-1, "bootstrap"), launcher, what, kLaunchersTried));
}

// A variable's value, treating set-but-empty as unset (as the registry does).
std::optional<std::string> lookupVar(const EnvMap& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

bool has(const EnvMap& env, const std::string& name) {
  return lookupVar(env, name).has_value();
}

int64_t parseIntVar(const std::string& launcher, const std::string& name, const std::string& value) {
  try {
    return env::parseInt(value, name);
  } catch (const InvalidArgument& e) {
    fail(launcher, e.what());
  }
}

std::optional<int> optionalInt(const EnvMap& env, const std::string& launcher, const std::string& name) {
  auto v = lookupVar(env, name);
  if (!v) return std::nullopt;
  int64_t value = parseIntVar(launcher, name, *v);
  if (value < 0 || value > INT32_MAX) fail(launcher, fmt::format("{}={} is out of range", name, *v));
  return static_cast<int>(value);
}

int requiredInt(const EnvMap& env, const std::string& launcher, const std::string& name,
                const std::string& present) {
  auto v = optionalInt(env, launcher, name);
  if (!v) fail(launcher, fmt::format("{} is set but {} is missing; set {}", present, name, name));
  return *v;
}

uint16_t parsePort(const std::string& launcher, const std::string& name, const std::string& text) {
  int64_t port = -1;
  try {
    port = env::parseInt(text, name);
  } catch (const InvalidArgument&) {
  }
  if (port < 1 || port > 65535)
    fail(launcher, fmt::format("{}={}: expected a TCP port number in 1-65535", name, text));
  return static_cast<uint16_t>(port);
}

// "host:port" or "[ipv6]:port".
std::pair<std::string, uint16_t> parseHostPort(const std::string& launcher, const std::string& name,
                                               const std::string& text) {
  std::string host, port;
  if (!text.empty() && text[0] == '[') {
    size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':')
      fail(launcher, fmt::format("{}={}: expected [ipv6-address]:port", name, text));
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0 || text.find(':') != colon)
      fail(launcher, fmt::format("{}={}: expected host:port (for example node1:29500)", name, text));
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (host.empty()) fail(launcher, fmt::format("{}={}: the host part is empty", name, text));
  int64_t value = -1;
  try {
    value = env::parseInt(port, name);
  } catch (const InvalidArgument&) {
  }
  if (value < 1 || value > 65535)
    fail(launcher, fmt::format("{}={}: the port must be a number in 1-65535", name, text));
  return {host, static_cast<uint16_t>(value)};
}

// FNV-1a: stable across builds and machines, unlike std::hash.
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// A port in [20000, 32768) derived from a job id every rank sees alike. The range
// stays below Linux's ephemeral ports (32768-60999), which any outgoing TCP
// connection on the host (stores, UCX) may be holding.
uint16_t derivedPort(const std::string& job_key) {
  return static_cast<uint16_t>(20000 + fnv1a(job_key) % 12768);
}

// Slurm's "2(x3),1" tasks-per-node syntax -> {2, 2, 2, 1}.
std::vector<int> expandTasksPerNode(const std::string& launcher, const std::string& name,
                                    const std::string& text) {
  std::vector<int> counts;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int64_t count = 0, repeat = 1;
    size_t paren = item.find('(');
    if (paren != std::string::npos) {
      if (item.size() < paren + 4 || item.compare(paren, 2, "(x") != 0 || item.back() != ')')
        fail(launcher, fmt::format("{}={}: malformed item '{}' (expected N or N(xM))", name, text, item));
      repeat = parseIntVar(launcher, name, item.substr(paren + 2, item.size() - paren - 3));
      item = item.substr(0, paren);
    }
    count = parseIntVar(launcher, name, item);
    if (count <= 0 || repeat <= 0 || repeat > 1'000'000)
      fail(launcher, fmt::format("{}={}: counts must be positive", name, text));
    counts.insert(counts.end(), static_cast<size_t>(repeat), static_cast<int>(count));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return counts;
}

// Fills store_host/store_port from CROSSBAR_STORE_ADDR or MASTER_ADDR/MASTER_PORT. Returns
// false when neither is given (the launcher then derives an address).
bool explicitStoreAddress(const EnvMap& env, BootstrapInfo& info) {
  env::lookup("CROSSBAR_STORE_ADDR");  // declared in the registry
  if (auto addr = lookupVar(env, "CROSSBAR_STORE_ADDR")) {
    std::tie(info.store_host, info.store_port) = parseHostPort(info.launcher, "CROSSBAR_STORE_ADDR", *addr);
    info.store_is_external = true;
    return true;
  }
  auto master_addr = lookupVar(env, "MASTER_ADDR");
  auto master_port = lookupVar(env, "MASTER_PORT");
  if (!master_addr && !master_port) return false;
  if (!master_addr)
    fail(info.launcher, "MASTER_PORT is set but MASTER_ADDR is missing; set MASTER_ADDR to rank 0's host");
  if (!master_port)
    fail(info.launcher, "MASTER_ADDR is set but MASTER_PORT is missing; set MASTER_PORT (e.g. 29500)");
  info.store_host = *master_addr;
  info.store_port = parsePort(info.launcher, "MASTER_PORT", *master_port);
  // torchrun's agent already serves its own (torch-protocol) store on MASTER_PORT.
  auto agent = lookupVar(env, "TORCHELASTIC_USE_AGENT_STORE");
  if (agent && (*agent == "True" || *agent == "true" || *agent == "1")) {
    if (info.store_port == 65535)
      fail(info.launcher,
           "MASTER_PORT=65535 is torchrun's agent store and crossbar uses MASTER_PORT+1; set "
           "CROSSBAR_STORE_ADDR");
    ++info.store_port;
  }
  return true;
}

void checkRanks(const BootstrapInfo& info, const std::string& rank_var, const std::string& size_var,
                const std::string& local_rank_var, const std::string& local_size_var) {
  if (info.size < 1) fail(info.launcher, fmt::format("{}={}: expected at least 1", size_var, info.size));
  if (info.rank >= info.size)
    fail(info.launcher, fmt::format("{}={} is not below {}={}", rank_var, info.rank, size_var, info.size));
  if (info.local_size == 0 || info.local_size > info.size)
    fail(info.launcher,
         fmt::format("{}={} must be in 1..{}={}", local_size_var, info.local_size, size_var, info.size));
  if (info.local_rank >= 0 && info.local_size > 0 && info.local_rank >= info.local_size)
    fail(info.launcher, fmt::format("{}={} is not below {}={}", local_rank_var, info.local_rank,
                                    local_size_var, info.local_size));
  if (info.local_rank > info.rank)
    fail(info.launcher,
         fmt::format("{}={} is above {}={}", local_rank_var, info.local_rank, rank_var, info.rank));
}

BootstrapInfo fromTorchrun(const EnvMap& env) {
  BootstrapInfo info;
  info.launcher = "torchrun";
  const std::string present = has(env, "RANK") ? "RANK" : "WORLD_SIZE";
  info.rank = requiredInt(env, info.launcher, "RANK", present);
  info.size = requiredInt(env, info.launcher, "WORLD_SIZE", present);
  info.local_rank = optionalInt(env, info.launcher, "LOCAL_RANK").value_or(-1);
  info.local_size = optionalInt(env, info.launcher, "LOCAL_WORLD_SIZE").value_or(-1);
  checkRanks(info, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  if (!explicitStoreAddress(env, info))
    fail(info.launcher,
         "RANK and WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT are missing; set both to "
         "rank 0's host and a free port, or set CROSSBAR_STORE_ADDR=host:port of a running store");
  return info;
}

BootstrapInfo fromMpirun(const EnvMap& env) {
  BootstrapInfo info;
  info.launcher = "mpirun";
  const std::string present =
      has(env, "OMPI_COMM_WORLD_RANK") ? "OMPI_COMM_WORLD_RANK" : "OMPI_COMM_WORLD_SIZE";
  info.rank = requiredInt(env, info.launcher, "OMPI_COMM_WORLD_RANK", present);
  info.size = requiredInt(env, info.launcher, "OMPI_COMM_WORLD_SIZE", present);
  info.local_rank = optionalInt(env, info.launcher, "OMPI_COMM_WORLD_LOCAL_RANK").value_or(-1);
  info.local_size = optionalInt(env, info.launcher, "OMPI_COMM_WORLD_LOCAL_SIZE").value_or(-1);
  checkRanks(info, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE");
  if (explicitStoreAddress(env, info)) return info;
  // mpirun tells no rank where rank 0 runs, so a derived address works on one host only.
  if (info.size > 1 && info.local_size != info.size)
    fail(info.launcher,
         fmt::format(
             "the job spans several hosts (OMPI_COMM_WORLD_LOCAL_SIZE={}, OMPI_COMM_WORLD_SIZE={}) and "
             "mpirun does not say where rank 0 runs; pass its address with mpirun -x "
             "MASTER_ADDR=<rank 0 host> -x MASTER_PORT=<free port>, or -x CROSSBAR_STORE_ADDR=host:port of a "
             "running crossbar-store",
             info.local_size < 0 ? std::string("unset") : std::to_string(info.local_size), info.size));
  for (const char* name : {"OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"}) {
    if (auto job = lookupVar(env, name)) {
      info.store_host = "127.0.0.1";
      info.store_port = derivedPort(std::string(name) + "=" + *job);
      return info;
    }
  }
  fail(info.launcher,
       "no job id to derive the store port from (OMPI_MCA_orte_ess_jobid, PMIX_NAMESPACE and "
       "OMPI_MCA_ess_base_jobid are all unset); set MASTER_ADDR and MASTER_PORT (mpirun -x)");
}

BootstrapInfo fromSrun(const EnvMap& env) {
  BootstrapInfo info;
  info.launcher = "srun";
  const std::string present = has(env, "SLURM_PROCID") ? "SLURM_PROCID" : "SLURM_NTASKS";
  info.rank = requiredInt(env, info.launcher, "SLURM_PROCID", present);
  auto ntasks = optionalInt(env, info.launcher, "SLURM_NTASKS");
  if (!ntasks) ntasks = optionalInt(env, info.launcher, "SLURM_NPROCS");  // older Slurm
  if (!ntasks)
    fail(info.launcher, fmt::format("{} is set but SLURM_NTASKS is missing; launch with srun -n N", present));
  info.size = *ntasks;
  info.local_rank = optionalInt(env, info.launcher, "SLURM_LOCALID").value_or(-1);
  // The step's layout is the precise one; the job's may differ when srun asks for fewer tasks.
  for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    auto text = lookupVar(env, name);
    if (!text) continue;
    std::vector<int> counts = expandTasksPerNode(info.launcher, name, *text);
    auto node_id = optionalInt(env, info.launcher, "SLURM_NODEID");
    if (counts.size() == 1 || std::equal(counts.begin() + 1, counts.end(), counts.begin())) {
      info.local_size = counts[0];
    } else if (node_id) {
      if (*node_id >= static_cast<int>(counts.size()))
        fail(info.launcher,
             fmt::format("SLURM_NODEID={} but {}={} lists {} nodes", *node_id, name, *text, counts.size()));
      info.local_size = counts[*node_id];
    }
    break;
  }
  checkRanks(info, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE");
  if (explicitStoreAddress(env, info)) return info;

  auto job = lookupVar(env, "SLURM_JOB_ID");
  if (!job) job = lookupVar(env, "SLURM_JOBID");
  if (!job)
    fail(info.launcher,
         "SLURM_JOB_ID is missing, so no store port can be derived; set MASTER_ADDR and "
         "MASTER_PORT, or CROSSBAR_STORE_ADDR");
  // Task 0 runs on the step's first node (srun's block distribution), so rank 0's store is
  // there; the launch node may be a login node that runs no task.
  std::string host;
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    if (auto list = lookupVar(env, name)) {
      std::vector<std::string> hosts;
      try {
        hosts = expandHostlist(*list);
      } catch (const InvalidArgument& e) {
        fail(info.launcher, fmt::format("{}: {}", name, e.what()));
      }
      if (!hosts.empty()) host = hosts.front();
      break;
    }
  }
  if (host.empty()) host = lookupVar(env, "SLURM_LAUNCH_NODE_IPADDR").value_or("");
  if (host.empty())
    fail(info.launcher,
         "cannot tell where rank 0 runs: SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST "
         "and SLURM_LAUNCH_NODE_IPADDR are all unset; set MASTER_ADDR and MASTER_PORT");
  info.store_host = host;
  // Several steps of one job may run at once: the step id keeps their stores apart.
  info.store_port = derivedPort("slurm=" + *job + "." + lookupVar(env, "SLURM_STEP_ID").value_or(""));
  return info;
}

bool isLoopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

}  // namespace

constexpr size_t kMaxHostlistNames = 1'000'000;

std::vector<std::string> expandHostlist(const std::string& hostlist) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument(fmt::format("host list '{}': {}", hostlist, why));
  };
  // Split at top-level commas (commas inside brackets separate ranges).
  std::vector<std::string> names;
  int depth = 0;
  std::string current;
  for (char c : hostlist) {
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) throw bad("unbalanced ']'");
    if (c == ',' && depth == 0) {
      names.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  if (depth != 0) throw bad("unbalanced '['");
  names.push_back(current);

  std::vector<std::string> out;
  for (const std::string& name : names) {
    if (name.empty()) continue;
    // Expand the first bracket group, then each result's remaining groups.
    // A deque: popping the front of a vector made a 1M-name range quadratic.
    std::deque<std::string> pending{name};
    while (!pending.empty()) {
      std::string item = std::move(pending.front());
      pending.pop_front();
      size_t open = item.find('[');
      if (open == std::string::npos) {
        out.push_back(item);
        continue;
      }
      size_t close = item.find(']', open);
      std::string prefix = item.substr(0, open), suffix = item.substr(close + 1);
      std::string ranges = item.substr(open + 1, close - open - 1);
      if (ranges.empty()) throw bad("empty brackets");
      std::vector<std::string> expanded;
      size_t pos = 0;
      while (true) {
        size_t comma = ranges.find(',', pos);
        std::string range = ranges.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        size_t dash = range.find('-');
        std::string lo = range.substr(0, dash), hi = dash == std::string::npos ? lo : range.substr(dash + 1);
        auto digits = [](const std::string& s) {
          return !s.empty() && s.size() <= 18 && s.find_first_not_of("0123456789") == std::string::npos;
        };
        if (!digits(lo) || !digits(hi)) throw bad(fmt::format("'{}' is not a number or a range a-b", range));
        int64_t a = std::stoll(lo), b = std::stoll(hi);
        if (b < a) throw bad(fmt::format("range '{}' runs backwards", range));
        if (b - a > 1'000'000) throw bad(fmt::format("range '{}' is too large", range));
        size_t width = lo.size();  // zero padding follows the lower bound ("01-10")
        // Several bracket groups multiply; bound the total, not just each range.
        if (out.size() + pending.size() + expanded.size() + static_cast<size_t>(b - a) >= kMaxHostlistNames)
          throw bad(fmt::format("expands to more than {} host names", kMaxHostlistNames));
        for (int64_t v = a; v <= b; ++v)
          expanded.push_back(prefix + fmt::format("{:0{}}", v, width) + suffix);
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
      pending.insert(pending.begin(), expanded.begin(), expanded.end());
    }
  }
  return out;
}

BootstrapInfo detectBootstrap(const std::map<std::string, std::string>& environment) {
  if (has(environment, "RANK") || has(environment, "WORLD_SIZE")) return fromTorchrun(environment);
  if (has(environment, "OMPI_COMM_WORLD_RANK") || has(environment, "OMPI_COMM_WORLD_SIZE"))
    return fromMpirun(environment);
  if (has(environment, "SLURM_PROCID")) return fromSrun(environment);
  fail("no launcher detected",
       "none of RANK, OMPI_COMM_WORLD_RANK or SLURM_PROCID is set. Launch with torchrun, mpirun or srun, or "
       "set "
       "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself");
}

BootstrapInfo detectBootstrap() {
  std::map<std::string, std::string> environment;
  for (char** e = environ; e && *e; ++e) {
    std::string entry(*e);
    size_t eq = entry.find('=');
    if (eq != std::string::npos) environment.emplace(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return detectBootstrap(environment);
}

std::shared_ptr<Store> connectStore(const BootstrapInfo& info) {
  if (info.rank < 0 || info.size < 1 || info.store_host.empty() || info.store_port == 0)
    throw InvalidArgument(fmt::format(
        "{}incomplete BootstrapInfo (rank {}, size {}, store {}:{}); fill it with "
        "detectBootstrap()",
        errorContext(info.rank, "connectStore"), info.rank, info.size, info.store_host, info.store_port));
  const bool serve = info.rank == 0 && !info.store_is_external;
  TcpStoreOptions options;
  options.port = info.store_port;
  options.is_server = serve;
  // Serve on every interface so other hosts reach us, unless the address is loopback anyway.
  options.host = serve && !isLoopback(info.store_host) ? "0.0.0.0" : info.store_host;
  options.connect_timeout = Millis(env::getMillis("CROSSBAR_CONNECT_TIMEOUT"));
  const std::string where = fmt::format("{}:{}", info.store_host, info.store_port);
  const std::string operation = serve ? fmt::format("serving the store on port {}", info.store_port)
                                      : "connecting to the store at " + where;
  CB_INFO("bootstrap", "{} (launcher {}, rank {}/{})", operation, info.launcher, info.rank, info.size);
  try {
    return std::make_shared<TcpStore>(options);
  } catch (const SystemError& e) {
    throw SystemError(fmt::format(
        "{}{} [launcher {}]. {}", errorContext(info.rank, operation), e.what(), info.launcher,
        serve ? "Is another job using this port? Set MASTER_PORT (or CROSSBAR_STORE_ADDR) to a free port."
              : "Check that rank 0 runs and that this host reaches it, or set CROSSBAR_STORE_ADDR."));
  } catch (const Timeout& e) {
    throw Timeout(
        fmt::format("{}{} [launcher {}]. Did rank 0 start? Is {} reachable from this host? "
                    "CROSSBAR_CONNECT_TIMEOUT sets how long to retry.",
                    errorContext(info.rank, operation), e.what(), info.launcher, where));
  }
}

}  // namespace crossbar
