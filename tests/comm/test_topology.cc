// Topology: node grouping (machine id, CROSSBAR_NODE_ID, ranks per node), RankInfo's text
// format, hwloc detection and CPU binding.
#include <gtest/gtest.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <set>

#include "comm/errors.h"
#include "comm/topology.h"
#include "harness/multiprocess.h"

namespace crossbar {
namespace {

std::vector<RankInfo> makeRanks(const std::vector<std::string>& machines, std::vector<int> overrides = {}) {
  std::vector<RankInfo> ranks;
  for (size_t r = 0; r < machines.size(); ++r) {
    RankInfo info;
    info.host = "host-" + machines[r];
    info.machine_id = "boot-" + machines[r];
    info.node_override = r < overrides.size() ? overrides[r] : -1;
    info.pid = 1000 + static_cast<int>(r);
    ranks.push_back(info);
  }
  return ranks;
}

TEST(Topology, GroupsByMachineInOrderOfFirstRank) {
  // Interleaved placement: node ids follow the first rank of each machine.
  Topology t = Topology::build(makeRanks({"b", "a", "b", "a", "c"}), 0);
  EXPECT_EQ(t.size(), 5);
  EXPECT_EQ(t.numNodes(), 3);
  EXPECT_EQ(t.node(0), 0);
  EXPECT_EQ(t.node(1), 1);
  EXPECT_EQ(t.node(2), 0);
  EXPECT_EQ(t.node(3), 1);
  EXPECT_EQ(t.node(4), 2);
  EXPECT_EQ(t.localRank(0), 0);
  EXPECT_EQ(t.localRank(2), 1);
  EXPECT_EQ(t.localRank(3), 1);
  EXPECT_EQ(t.localSize(0), 2);
  EXPECT_EQ(t.localSize(4), 1);
  EXPECT_EQ(t.nodeRanks(1), (std::vector<int>{1, 3}));
  EXPECT_TRUE(t.sameNode(0, 2));
  EXPECT_FALSE(t.sameNode(0, 1));
  EXPECT_TRUE(t.sameMachine(1, 3));
  EXPECT_EQ(t.host(4), "host-c");
  EXPECT_EQ(t.info(3).pid, 1003);
}

TEST(Topology, VirtualNodesOfTwo) {
  Topology t = Topology::build(makeRanks(std::vector<std::string>(8, "m")), 2);
  EXPECT_EQ(t.numNodes(), 4);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(t.node(r), r / 2) << r;
    EXPECT_EQ(t.localRank(r), r % 2) << r;
    EXPECT_EQ(t.localSize(r), 2) << r;
  }
  EXPECT_EQ(t.nodeRanks(3), (std::vector<int>{6, 7}));
  // Virtual nodes split one machine: shared memory still works across them.
  EXPECT_FALSE(t.sameNode(1, 2));
  EXPECT_TRUE(t.sameMachine(1, 2));
}

TEST(Topology, VirtualNodesOfFour) {
  Topology t = Topology::build(makeRanks(std::vector<std::string>(8, "m")), 4);
  EXPECT_EQ(t.numNodes(), 2);
  EXPECT_EQ(t.nodeRanks(0), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(t.nodeRanks(1), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(t.localRank(5), 1);
  EXPECT_EQ(t.localSize(7), 4);
}

TEST(Topology, VirtualNodesSplitRealNodesAndLastMayBeSmaller) {
  // Two machines of 4 ranks each, virtual nodes of 2: never spans a machine.
  Topology t = Topology::build(makeRanks({"a", "a", "a", "a", "b", "b", "b", "b"}), 2);
  EXPECT_EQ(t.numNodes(), 4);
  Topology u = Topology::build(makeRanks(std::vector<std::string>(6, "m")), 4);
  EXPECT_EQ(u.numNodes(), 2);
  EXPECT_EQ(u.localSize(5), 2);
  EXPECT_EQ(u.localRank(5), 1);
}

TEST(Topology, RanksPerNodeWinsOverNodeOverride) {
  Topology t = Topology::build(makeRanks({"m", "m", "m", "m"}, {1, 0, 1, 0}), 2);
  EXPECT_EQ(t.node(0), 0);
  EXPECT_EQ(t.node(1), 0);
  EXPECT_EQ(t.node(2), 1);
}

TEST(Topology, NodeOverrideRenumberedInOrderOfFirstRank) {
  Topology t = Topology::build(makeRanks({"m", "m", "m", "m", "m"}, {7, 3, 7, 3, 5}), 0);
  EXPECT_EQ(t.numNodes(), 3);
  EXPECT_EQ(t.node(0), 0);  // override 7
  EXPECT_EQ(t.node(1), 1);  // override 3
  EXPECT_EQ(t.node(2), 0);
  EXPECT_EQ(t.node(3), 1);
  EXPECT_EQ(t.node(4), 2);  // override 5
  EXPECT_EQ(t.localRank(2), 1);
  EXPECT_EQ(t.localRank(3), 1);
  EXPECT_EQ(t.localSize(4), 1);
}

TEST(Topology, NodeOverrideOnlyWhereGiven) {
  // Ranks 0-1 override to node 0; ranks 2-3 have none and group by machine.
  Topology t = Topology::build(makeRanks({"m", "m", "m", "m"}, {0, 0, -1, -1}), 0);
  EXPECT_EQ(t.numNodes(), 2);
  EXPECT_EQ(t.nodeRanks(0), (std::vector<int>{0, 1}));
  EXPECT_EQ(t.nodeRanks(1), (std::vector<int>{2, 3}));
}

TEST(Topology, NodeMayNotSpanMachines) {
  try {
    Topology::build(makeRanks({"a", "b"}, {0, 0}), 0);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("CROSSBAR_NODE_ID=0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("host-b"), std::string::npos) << msg;
    EXPECT_NE(msg.find("different machines"), std::string::npos) << msg;
  }
  EXPECT_THROW(Topology::build(makeRanks({"a", "b", "b", "b"}), 2), InvalidArgument);
}

TEST(Topology, RejectsBadArguments) {
  EXPECT_THROW(Topology::build({}, 0), InvalidArgument);
  EXPECT_THROW(Topology::build(makeRanks({"a"}), -1), InvalidArgument);
}

TEST(Topology, DescribeNamesNodesAndRanks) {
  Topology t = Topology::build(makeRanks({"a", "a", "b"}), 0);
  std::string text = t.describe();
  EXPECT_NE(text.find("3 rank(s) on 2 node(s)"), std::string::npos) << text;
  EXPECT_NE(text.find("node 1 (host host-b)"), std::string::npos) << text;
}

TEST(RankInfo, SerializeRoundTrip) {
  RankInfo in;
  in.host = "node 7=%weird\nname\xff";
  in.machine_id = "0c20f7ab-7df3-4b7f-995b-0d5d3d1a608a/node7";
  in.node_override = 3;
  in.numa_node = 1;
  in.cpuset = "0-3,8-11";
  in.pid = 424242;
  RankInfo out = RankInfo::deserialize(in.serialize());
  EXPECT_EQ(out.host, in.host);
  EXPECT_EQ(out.machine_id, in.machine_id);
  EXPECT_EQ(out.node_override, 3);
  EXPECT_EQ(out.numa_node, 1);
  EXPECT_EQ(out.cpuset, in.cpuset);
  EXPECT_EQ(out.pid, 424242);

  RankInfo empty = RankInfo::deserialize(RankInfo{}.serialize());
  EXPECT_EQ(empty.host, "");
  EXPECT_EQ(empty.node_override, -1);
}

TEST(RankInfo, DeserializeIgnoresUnknownFieldsAndRejectsBadInput) {
  std::string text = RankInfo{}.serialize() + "future_field=1\n";
  EXPECT_NO_THROW(RankInfo::deserialize(text));
  EXPECT_THROW(RankInfo::deserialize(""), InvalidArgument);
  EXPECT_THROW(RankInfo::deserialize("garbage\nhost=a\n"), InvalidArgument);
  std::string no_pid = RankInfo{}.serialize();
  no_pid = no_pid.substr(0, no_pid.find("pid="));
  EXPECT_THROW(RankInfo::deserialize(no_pid), InvalidArgument);
  std::string bad_int = RankInfo{}.serialize();
  bad_int.replace(bad_int.find("numa_node=-1"), 12, "numa_node=xy");
  EXPECT_THROW(RankInfo::deserialize(bad_int), InvalidArgument);
  std::string bad_escape = RankInfo{}.serialize();
  bad_escape.replace(bad_escape.find("host="), 5, "host=%4");
  EXPECT_THROW(RankInfo::deserialize(bad_escape), InvalidArgument);
}

TEST(RankInfo, DescribeThisProcess) {
  unsetenv("CROSSBAR_NODE_ID");
  RankInfo info = describeThisProcess();
  EXPECT_EQ(info.host, hostName());
  EXPECT_FALSE(info.machine_id.empty());
  EXPECT_NE(info.machine_id.find(info.host), std::string::npos);
  EXPECT_EQ(info.node_override, -1);
  EXPECT_EQ(info.pid, getpid());
  EXPECT_FALSE(info.cpuset.empty());
  EXPECT_GE(info.numa_node, -1);
  // Same process, same answer (ranks of one machine agree on machine_id).
  EXPECT_EQ(describeThisProcess().machine_id, info.machine_id);

  setenv("CROSSBAR_NODE_ID", "5", 1);
  EXPECT_EQ(describeThisProcess().node_override, 5);
  setenv("CROSSBAR_NODE_ID", "five", 1);
  EXPECT_THROW(describeThisProcess(), InvalidArgument);
  unsetenv("CROSSBAR_NODE_ID");
}

TEST(MachineInfo, Sanity) {
  MachineInfo m = describeMachine();
  EXPECT_EQ(m.host, hostName());
  EXPECT_GE(m.packages, 1);
  EXPECT_GE(m.numa_nodes, 1);
  EXPECT_GE(m.cores, m.packages);
  EXPECT_GE(m.pus, m.cores);
  if (!m.numa_distances.empty()) {
    ASSERT_EQ(m.numa_distances.size(), static_cast<size_t>(m.numa_nodes));
    for (size_t i = 0; i < m.numa_distances.size(); ++i) {
      ASSERT_EQ(m.numa_distances[i].size(), m.numa_distances.size());
      for (int d : m.numa_distances[i]) EXPECT_GE(d, m.numa_distances[i][i]);  // local is nearest
    }
  }
  for (const auto& d : m.devices) {
    EXPECT_TRUE(d.kind == "gpu" || d.kind == "nic") << d.kind;
    EXPECT_FALSE(d.name.empty());
    EXPECT_GE(d.numa_node, -1);
    if (d.kind == "gpu") {
      EXPECT_EQ(d.bus_id.size(), 12u) << d.bus_id;
    }
  }
  std::string text = m.describe();
  EXPECT_NE(text.find(m.host), std::string::npos) << text;
  EXPECT_NE(text.find("NUMA node"), std::string::npos) << text;
}

TEST(Topology, ExchangedThroughTheStoreByForkedRanks) {
  // Each rank describes itself, publishes it, and builds the same topology from all.
  testing::runRanks(4, [](testing::RankEnv& env) {
    setenv("CROSSBAR_NODE_ID", std::to_string(env.rank / 2).c_str(), 1);
    RankInfo self = describeThisProcess();
    EXPECT_EQ(self.node_override, env.rank / 2);
    env.store->set("info/" + std::to_string(env.rank), self.serialize());
    std::vector<RankInfo> all;
    for (int r = 0; r < env.size; ++r)
      all.push_back(RankInfo::deserialize(toString(env.store->get("info/" + std::to_string(r)))));
    Topology t = Topology::build(all, 0);
    EXPECT_EQ(t.numNodes(), 2);
    EXPECT_EQ(t.node(env.rank), env.rank / 2);
    EXPECT_EQ(t.localRank(env.rank), env.rank % 2);
    EXPECT_EQ(t.info(env.rank).pid, getpid());
    for (int r = 0; r < env.size; ++r) EXPECT_TRUE(t.sameMachine(env.rank, r));
    // Without overrides the ranks of one machine form one node.
    for (auto& info : all) info.node_override = -1;
    EXPECT_EQ(Topology::build(all, 0).numNodes(), 1);
  });
}

// Runs `body` in a forked child (binding must not leak into the test process) and returns
// its exit code.
int inChild(const std::function<int()>& body) {
  pid_t pid = fork();
  if (pid == 0) {
    int code = 99;
    try {
      code = body();
    } catch (const std::exception& e) {
      fprintf(stderr, "child: %s\n", e.what());
    }
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

cpu_set_t affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  sched_getaffinity(0, sizeof(set), &set);
  return set;
}

TEST(Bind, NoneLeavesAffinityAlone) {
  EXPECT_EQ(inChild([] {
              setenv("CROSSBAR_BIND", "none", 1);
              cpu_set_t before = affinity();
              bindThisProcess(0, 4);
              cpu_set_t after = affinity();
              return CPU_EQUAL(&before, &after) ? 0 : 1;
            }),
            0);
}

TEST(Bind, CoreGivesLocalRanksDisjointCores) {
  cpu_set_t mine = affinity();
  int allowed = CPU_COUNT(&mine);
  // Two local ranks in two children; each reports its CPUs through the exit code bitmask.
  auto cpusOf = [](int local_rank) {
    return inChild([local_rank] {
      setenv("CROSSBAR_BIND", "core", 1);
      bindThisProcess(local_rank, 2);
      cpu_set_t set = affinity();
      int mask = 0;
      for (int c = 0; c < 7; ++c)
        if (CPU_ISSET(c, &set)) mask |= 1 << c;
      return CPU_COUNT(&set) >= 1 ? mask : 0;
    });
  };
  int a = cpusOf(0), b = cpusOf(1);
  EXPECT_NE(a, 0);
  EXPECT_NE(b, 0);
  if (allowed >= 2 && allowed <= 7) {
    EXPECT_EQ(a & b, 0) << "local ranks 0 and 1 share a core";
  }
}

TEST(Bind, NumaBindsToANumaNode) {
  EXPECT_EQ(inChild([] {
              setenv("CROSSBAR_BIND", "numa", 1);
              bindThisProcess(0, 1);
              RankInfo info = describeThisProcess();
              return info.numa_node >= 0 ? 0 : 1;
            }),
            0);
}

TEST(Bind, RejectsBadArguments) {
  setenv("CROSSBAR_BIND", "core", 1);
  EXPECT_THROW(bindThisProcess(2, 2), InvalidArgument);
  EXPECT_THROW(bindThisProcess(0, 0), InvalidArgument);
  setenv("CROSSBAR_BIND", "sockets", 1);
  EXPECT_THROW(bindThisProcess(0, 1), InvalidArgument);
  unsetenv("CROSSBAR_BIND");
}

}  // namespace
}  // namespace crossbar
