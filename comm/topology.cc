#include "comm/topology.h"

#include <fmt/format.h>
#include <hwloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"

namespace crossbar {

namespace {

// --- hwloc helpers -----------------------------------------------------------------------

struct TopologyDeleter {
  void operator()(hwloc_topology_t t) const { hwloc_topology_destroy(t); }
};
using HwlocTopology = std::unique_ptr<hwloc_topology, TopologyDeleter>;

struct BitmapDeleter {
  void operator()(hwloc_bitmap_t b) const { hwloc_bitmap_free(b); }
};
using Bitmap = std::unique_ptr<hwloc_bitmap_s, BitmapDeleter>;

Bitmap newBitmap() {
  Bitmap b(hwloc_bitmap_alloc());
  if (!b) throw SystemError(errorContext(-1, "hwloc_bitmap_alloc") + "out of memory");
  return b;
}

HwlocTopology loadTopology(bool with_io) {
  hwloc_topology_t t = nullptr;
  if (hwloc_topology_init(&t) != 0) throwSystemError(-1, "hwloc_topology_init", errno);
  HwlocTopology topo(t);
  if (with_io) {
    // PCI devices and OS devices (GPUs, NICs); bridges only where they matter.
    hwloc_topology_set_io_types_filter(t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  }
  if (hwloc_topology_load(t) != 0) throwSystemError(-1, "hwloc_topology_load", errno);
  return topo;
}

// The CPU-only topology, loaded once per process: it is read-only after loading, and
// hwloc allows concurrent queries on a loaded topology.
hwloc_topology_t cpuTopology() {
  static HwlocTopology topo = loadTopology(false);
  return topo.get();
}

std::string bitmapList(hwloc_const_bitmap_t set) {
  char* text = nullptr;
  if (hwloc_bitmap_list_asprintf(&text, set) < 0 || !text) return "";
  std::string out(text);
  free(text);
  return out;
}

// OS index of the only NUMA node in `nodeset`, or -1 when there are none or several.
int singleNumaNode(hwloc_const_nodeset_t nodeset) {
  if (hwloc_bitmap_weight(nodeset) != 1) return -1;
  return hwloc_bitmap_first(nodeset);
}

// The NUMA node local to an I/O object: its first non-I/O ancestor's nodeset.
int ioNumaNode(hwloc_topology_t topo, hwloc_obj_t obj) {
  hwloc_obj_t ancestor = hwloc_get_non_io_ancestor_obj(topo, obj);
  if (!ancestor || !ancestor->nodeset) return -1;
  return singleNumaNode(ancestor->nodeset);
}

std::string busId(hwloc_obj_t pci) {
  const auto& a = pci->attr->pcidev;
  return fmt::format("{:04x}:{:02x}:{:02x}.{:x}", a.domain, a.bus, a.dev, a.func);
}

std::string readBootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

// --- RankInfo text format ----------------------------------------------------------------
// "crossbar-rankinfo 1\nkey=value\n...": values are percent-escaped so any byte survives;
// unknown keys are ignored so newer ranks can add fields.

constexpr const char* kRankInfoMagic = "crossbar-rankinfo 1";

std::string escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '%' || c == '=' || c < 0x21 || c > 0x7e)
      out += fmt::format("%{:02X}", c);
    else
      out += static_cast<char>(c);
  }
  return out;
}

std::string unescape(const std::string& s, const std::string& key) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    if (i + 2 >= s.size())
      throw InvalidArgument(fmt::format("RankInfo: truncated escape in field '{}'", key));
    int value = 0;
    for (int k = 1; k <= 2; ++k) {
      char c = s[i + k];
      int digit = (c >= '0' && c <= '9')   ? c - '0'
                  : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                  : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                                           : -1;
      if (digit < 0) throw InvalidArgument(fmt::format("RankInfo: bad escape in field '{}'", key));
      value = value * 16 + digit;
    }
    out += static_cast<char>(value);
    i += 2;
  }
  return out;
}

}  // namespace

// --- RankInfo ------------------------------------------------------------------------------

std::string RankInfo::serialize() const {
  std::string out = std::string(kRankInfoMagic) + "\n";
  out += "host=" + escape(host) + "\n";
  out += "machine_id=" + escape(machine_id) + "\n";
  out += fmt::format("node_override={}\n", node_override);
  out += fmt::format("numa_node={}\n", numa_node);
  out += "cpuset=" + escape(cpuset) + "\n";
  out += fmt::format("pid={}\n", pid);
  return out;
}

RankInfo RankInfo::deserialize(const std::string& text) {
  size_t pos = text.find('\n');
  std::string first = text.substr(0, pos);
  if (first != kRankInfoMagic)
    throw InvalidArgument(fmt::format(
        "RankInfo: expected a '{}' header, got '{}' (ranks built from different crossbar versions?)",
        kRankInfoMagic, first.substr(0, 64)));
  std::map<std::string, std::string> fields;
  while (pos != std::string::npos && pos + 1 < text.size()) {
    size_t next = text.find('\n', pos + 1);
    std::string line = text.substr(pos + 1, next == std::string::npos ? std::string::npos : next - pos - 1);
    pos = next;
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == std::string::npos) throw InvalidArgument(fmt::format("RankInfo: malformed line '{}'", line));
    std::string key = line.substr(0, eq);
    fields[key] = unescape(line.substr(eq + 1), key);
  }
  auto need = [&](const char* key) -> const std::string& {
    auto it = fields.find(key);
    if (it == fields.end()) throw InvalidArgument(fmt::format("RankInfo: missing field '{}'", key));
    return it->second;
  };
  auto needInt = [&](const char* key) {
    return static_cast<int>(env::parseInt(need(key), fmt::format("RankInfo field {}", key)));
  };
  RankInfo info;
  info.host = need("host");
  info.machine_id = need("machine_id");
  info.node_override = needInt("node_override");
  info.numa_node = needInt("numa_node");
  info.cpuset = need("cpuset");
  info.pid = needInt("pid");
  return info;
}

RankInfo describeThisProcess() {
  RankInfo info;
  info.host = hostName();
  // boot_id alone is shared by containers on one kernel that may not share /dev/shm;
  // the host name tells such containers apart.
  info.machine_id = readBootId() + "/" + info.host;
  info.node_override = static_cast<int>(env::getInt("CROSSBAR_NODE_ID"));
  if (info.node_override < -1)
    throw InvalidArgument(
        fmt::format("CROSSBAR_NODE_ID={}: expected a node id >= 0 (or -1 for none)", info.node_override));
  info.pid = static_cast<int>(getpid());

  hwloc_topology_t topo = cpuTopology();
  Bitmap cpus = newBitmap();
  if (hwloc_get_cpubind(topo, cpus.get(), HWLOC_CPUBIND_PROCESS) != 0 &&
      hwloc_get_cpubind(topo, cpus.get(), HWLOC_CPUBIND_THREAD) != 0) {
    hwloc_bitmap_copy(cpus.get(), hwloc_topology_get_allowed_cpuset(topo));
  }
  info.cpuset = bitmapList(cpus.get());
  Bitmap nodes = newBitmap();
  hwloc_cpuset_to_nodeset(topo, cpus.get(), nodes.get());
  info.numa_node = singleNumaNode(nodes.get());
  if (info.numa_node < 0) {
    // Allowed on several NUMA nodes: report where we run now.
    Bitmap last = newBitmap();
    if (hwloc_get_last_cpu_location(topo, last.get(), HWLOC_CPUBIND_THREAD) == 0) {
      hwloc_cpuset_to_nodeset(topo, last.get(), nodes.get());
      info.numa_node = hwloc_bitmap_iszero(nodes.get()) ? -1 : hwloc_bitmap_first(nodes.get());
    }
  }
  return info;
}

// --- MachineInfo ---------------------------------------------------------------------------

MachineInfo describeMachine() {
  HwlocTopology holder = loadTopology(true);
  hwloc_topology_t topo = holder.get();
  MachineInfo m;
  m.host = hostName();
  m.packages = std::max(0, hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE));
  m.numa_nodes = std::max(0, hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE));
  m.cores = std::max(0, hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE));
  m.pus = std::max(0, hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU));

  for (hwloc_obj_t obj = hwloc_get_next_pcidev(topo, nullptr); obj; obj = hwloc_get_next_pcidev(topo, obj)) {
    const auto& a = obj->attr->pcidev;
    if (a.vendor_id != 0x10de || (a.class_id >> 8) != 0x03) continue;  // NVIDIA display controller
    PciDevice d;
    d.bus_id = busId(obj);
    d.kind = "gpu";
    const char* model = hwloc_obj_get_info_by_name(obj, "PCIDevice");
    d.name = model ? model : (obj->name ? obj->name : fmt::format("NVIDIA {:04x}", a.device_id));
    d.numa_node = ioNumaNode(topo, obj);
    m.devices.push_back(std::move(d));
  }

  // NICs: one entry per PCI function, naming all its interfaces ("mlx5_0,ib0").
  std::map<std::string, size_t> nic_by_bus;
  for (hwloc_obj_t obj = hwloc_get_next_osdev(topo, nullptr); obj; obj = hwloc_get_next_osdev(topo, obj)) {
    auto type = obj->attr->osdev.type;
    if (type != HWLOC_OBJ_OSDEV_NETWORK && type != HWLOC_OBJ_OSDEV_OPENFABRICS) continue;
    hwloc_obj_t pci = obj->parent;
    while (pci && pci->type != HWLOC_OBJ_PCI_DEVICE && hwloc_obj_type_is_io(pci->type)) pci = pci->parent;
    std::string bus = (pci && pci->type == HWLOC_OBJ_PCI_DEVICE) ? busId(pci) : "";
    std::string name = obj->name ? obj->name : "?";
    if (!bus.empty()) {
      auto it = nic_by_bus.find(bus);
      if (it != nic_by_bus.end()) {
        m.devices[it->second].name += "," + name;
        continue;
      }
      nic_by_bus[bus] = m.devices.size();
    }
    PciDevice d;
    d.bus_id = bus;
    d.kind = "nic";
    d.name = name;
    d.numa_node = ioNumaNode(topo, obj);
    m.devices.push_back(std::move(d));
  }

  // NUMA distances, indexed by NUMA logical index (the first matrix hwloc has).
  unsigned nr = 1;
  hwloc_distances_s* dist = nullptr;
  if (m.numa_nodes > 0 && hwloc_distances_get_by_type(topo, HWLOC_OBJ_NUMANODE, &nr, &dist, 0, 0) == 0 &&
      nr >= 1 && dist) {
    unsigned n = dist->nbobjs;
    if (n == static_cast<unsigned>(m.numa_nodes)) {
      m.numa_distances.assign(n, std::vector<int>(n, 0));
      for (unsigned i = 0; i < n; ++i)
        for (unsigned j = 0; j < n; ++j)
          m.numa_distances[dist->objs[i]->logical_index][dist->objs[j]->logical_index] =
              static_cast<int>(dist->values[i * n + j]);
    }
    hwloc_distances_release(topo, dist);
  }
  return m;
}

std::string MachineInfo::describe() const {
  std::string out = fmt::format("host {}: {} package(s), {} NUMA node(s), {} core(s), {} PU(s)\n", host,
                                packages, numa_nodes, cores, pus);
  int gpus = 0, nics = 0;
  for (const auto& d : devices) (d.kind == "gpu" ? gpus : nics)++;
  out += fmt::format("  GPUs: {}\n", gpus ? std::to_string(gpus) : "none");
  for (const auto& d : devices)
    if (d.kind == "gpu")
      out += fmt::format("    {}  {}  NUMA {}\n", d.bus_id, d.name,
                         d.numa_node < 0 ? "?" : std::to_string(d.numa_node));
  out += fmt::format("  NICs: {}\n", nics ? std::to_string(nics) : "none");
  for (const auto& d : devices)
    if (d.kind == "nic")
      out += fmt::format("    {:12}  {}  NUMA {}\n", d.bus_id.empty() ? "(virtual)" : d.bus_id, d.name,
                         d.numa_node < 0 ? "?" : std::to_string(d.numa_node));
  if (!numa_distances.empty()) {
    out += "  NUMA distances:\n";
    out += "       ";
    for (size_t j = 0; j < numa_distances.size(); ++j) out += fmt::format("{:>5}", j);
    out += "\n";
    for (size_t i = 0; i < numa_distances.size(); ++i) {
      out += fmt::format("    {:>3}", i);
      for (int v : numa_distances[i]) out += fmt::format("{:>5}", v);
      out += "\n";
    }
  }
  return out;
}

// --- Topology ------------------------------------------------------------------------------

Topology Topology::build(std::vector<RankInfo> ranks, int ranks_per_node) {
  if (ranks.empty()) throw InvalidArgument("Topology::build: no ranks");
  if (ranks_per_node < 0)
    throw InvalidArgument(
        fmt::format("CROSSBAR_RANKS_PER_NODE={}: expected 0 (off) or a positive count", ranks_per_node));
  Topology t;
  const int n = static_cast<int>(ranks.size());
  t.ranks_ = std::move(ranks);
  t.node_.assign(n, -1);
  t.local_rank_.assign(n, -1);

  // A key per rank names its node; node ids follow the order of each node's first rank.
  std::map<std::string, int> node_of_key;
  for (int r = 0; r < n; ++r) {
    const RankInfo& info = t.ranks_[r];
    std::string key;
    if (ranks_per_node > 0)
      key = fmt::format("v{}", r / ranks_per_node);
    else if (info.node_override >= 0)
      key = fmt::format("o{}", info.node_override);
    else
      key = "m" + info.machine_id;
    auto [it, inserted] = node_of_key.emplace(key, static_cast<int>(node_of_key.size()));
    t.node_[r] = it->second;
    if (inserted) t.node_ranks_.emplace_back();
    t.local_rank_[r] = static_cast<int>(t.node_ranks_[it->second].size());
    t.node_ranks_[it->second].push_back(r);
  }
  t.num_nodes_ = static_cast<int>(t.node_ranks_.size());

  // Ranks of one node share memory, so a node may not span machines.
  for (const auto& members : t.node_ranks_) {
    int first = members.front();
    for (int r : members) {
      if (t.ranks_[r].machine_id == t.ranks_[first].machine_id) continue;
      std::string why = ranks_per_node > 0 ? fmt::format("CROSSBAR_RANKS_PER_NODE={}", ranks_per_node)
                                           : fmt::format("CROSSBAR_NODE_ID={}", t.ranks_[r].node_override);
      throw InvalidArgument(fmt::format(
          "Topology: {} puts {} and {} in node {}, but they run on different machines; a node must be within "
          "one machine. Fix the override so that virtual nodes split machines, never join them.",
          why, formatPeers({first}, {t.ranks_[first].host}), formatPeers({r}, {t.ranks_[r].host}),
          t.node_[r]));
    }
  }
  return t;
}

std::string Topology::describe() const {
  std::string out = fmt::format("{} rank(s) on {} node(s)\n", size(), numNodes());
  for (int node = 0; node < numNodes(); ++node) {
    const auto& members = node_ranks_[node];
    std::set<std::string> hosts;
    for (int r : members) hosts.insert(ranks_[r].host);
    std::string host_list;
    for (const auto& h : hosts) host_list += (host_list.empty() ? "" : ",") + h;
    out += fmt::format("  node {} (host {}): {} rank(s):", node, host_list, members.size());
    for (int r : members) {
      const RankInfo& i = ranks_[r];
      out += fmt::format(" {}[numa {} cpus {}]", r, i.numa_node < 0 ? "?" : std::to_string(i.numa_node),
                         i.cpuset.empty() ? "?" : i.cpuset);
    }
    out += "\n";
  }
  return out;
}

// --- binding -------------------------------------------------------------------------------

bool everyRankHasACore(int local_ranks) {
  static const unsigned cores = std::thread::hardware_concurrency();  // 0: unknown
  return cores == 0 || static_cast<unsigned>(local_ranks) <= cores;
}

void bindThisProcess(int local_rank, int local_size) {
  std::string mode = env::getEnum("CROSSBAR_BIND");
  if (mode == "none") return;
  if (local_size <= 0 || local_rank < 0 || local_rank >= local_size)
    throw InvalidArgument(fmt::format("{}local rank {} of {} is out of range",
                                      errorContext(-1, "bindThisProcess"), local_rank, local_size));
  hwloc_topology_t topo = cpuTopology();
  Bitmap target = newBitmap();
  std::string what;
  if (mode == "numa") {
    // Only NUMA nodes with cores (memory-only nodes, e.g. HBM or CXL, cannot run us).
    std::vector<hwloc_obj_t> nodes;
    hwloc_obj_t obj = nullptr;
    while ((obj = hwloc_get_next_obj_by_type(topo, HWLOC_OBJ_NUMANODE, obj)))
      if (obj->cpuset && !hwloc_bitmap_iszero(obj->cpuset)) nodes.push_back(obj);
    if (nodes.empty()) {
      CB_WARN("topology", "CROSSBAR_BIND=numa: hwloc reports no NUMA node with cores; not binding");
      return;
    }
    // Contiguous blocks of local ranks per NUMA node (local rank i usually drives GPU i).
    hwloc_obj_t node = nodes[static_cast<size_t>(local_rank) * nodes.size() / local_size];
    hwloc_bitmap_copy(target.get(), node->cpuset);
    what = fmt::format("NUMA node {}", node->os_index);
  } else {  // core
    int cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    if (cores <= 0) {
      CB_WARN("topology", "CROSSBAR_BIND=core: hwloc reports no cores; not binding");
      return;
    }
    if (local_size > cores)
      CB_WARN("topology", "CROSSBAR_BIND=core: {} local ranks share {} cores", local_size, cores);
    // Spread ranks evenly over the cores (and so over packages and NUMA nodes).
    int index = static_cast<int>(static_cast<int64_t>(local_rank) * cores / local_size);
    hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, index);
    hwloc_bitmap_copy(target.get(), core->cpuset);
    what = fmt::format("core {}", core->logical_index);
  }
  if (hwloc_set_cpubind(topo, target.get(), HWLOC_CPUBIND_PROCESS) != 0) {
    int err = errno;
    throwSystemError(-1,
                     fmt::format("CROSSBAR_BIND={}: binding local rank {} to {} (cpus {})", mode, local_rank,
                                 what, bitmapList(target.get())),
                     err, "set CROSSBAR_BIND=none to run unbound");
  }
  CB_INFO("topology", "bound local rank {}/{} to {} (cpus {})", local_rank, local_size, what,
          bitmapList(target.get()));
}

}  // namespace crossbar
