// Topology: where each rank runs. Built from hwloc on each rank, exchanged through
// the store. Overrides (CROSSBAR_NODE_ID, CROSSBAR_RANKS_PER_NODE) split one machine
// into virtual nodes so multi-node code is testable on one machine.
#pragma once

#include <string>
#include <vector>

namespace crossbar {

struct PciDevice {
  std::string bus_id;    // "0000:3b:00.0"
  std::string kind;      // "gpu" or "nic"
  std::string name;      // vendor/model or interface name
  int numa_node = -1;
};

// What one process learns about itself (hwloc + environment).
struct RankInfo {
  std::string host;          // host name
  std::string machine_id;    // identifies the physical machine (boot id); shm works iff equal
  int node_override = -1;    // from CROSSBAR_NODE_ID
  int numa_node = -1;        // NUMA node of the cores this process runs on
  std::string cpuset;        // "0-3" style list of allowed cores
  int pid = 0;

  std::string serialize() const;
  static RankInfo deserialize(const std::string& text);
};

// Detects this process's RankInfo.
RankInfo describeThisProcess();

// Machine-level facts for crossbar-info: packages, NUMA nodes, cores, PCI GPUs and NICs
// with their NUMA distances.
struct MachineInfo {
  std::string host;
  int packages = 0, numa_nodes = 0, cores = 0, pus = 0;
  std::vector<PciDevice> devices;
  std::vector<std::vector<int>> numa_distances;  // may be empty
  std::string describe() const;                  // multi-line human text
};
MachineInfo describeMachine();

class Topology {
 public:
  // From every rank's info (index = rank). ranks_per_node > 0 groups consecutive ranks
  // into virtual nodes; else node_override, else machine_id decides the node.
  static Topology build(std::vector<RankInfo> ranks, int ranks_per_node);

  int size() const { return static_cast<int>(ranks_.size()); }
  int node(int rank) const { return node_[rank]; }
  int numNodes() const { return num_nodes_; }
  int localRank(int rank) const { return local_rank_[rank]; }
  int localSize(int rank) const { return static_cast<int>(node_ranks_[node_[rank]].size()); }
  const std::vector<int>& nodeRanks(int node) const { return node_ranks_[node]; }
  bool sameNode(int a, int b) const { return node_[a] == node_[b]; }
  // Same physical machine: shared memory is possible (virtual nodes may share one).
  bool sameMachine(int a, int b) const { return ranks_[a].machine_id == ranks_[b].machine_id; }
  const RankInfo& info(int rank) const { return ranks_[rank]; }
  const std::string& host(int rank) const { return ranks_[rank].host; }
  std::string describe() const;

 private:
  std::vector<RankInfo> ranks_;
  std::vector<int> node_, local_rank_;
  std::vector<std::vector<int>> node_ranks_;
  int num_nodes_ = 0;
};

// Whether `local_ranks` processes of one machine each have an online core of their own
// (pass Communicator::machineLocalSize, not the node's size: virtual nodes share the
// machine's cores): waits spin only then (else they yield the core a peer may need). The core count is
// read once per process; glibc reads it from /sys on every call, which cost 10% of a
// 2-rank 64 KiB alltoall when a wait asked for it each time.
bool everyRankHasACore(int local_ranks);

// Bind the calling process per CROSSBAR_BIND (none|numa|core). No-op for none. Pass the
// rank's index and count on its machine (Communicator::machineLocalRank/Size): ranks of
// different virtual nodes on one machine must not get the same core.
void bindThisProcess(int local_rank, int local_size);

}  // namespace crossbar
