// Bootstrap: rank, size and store address from torchrun, mpirun and srun variables,
// their precedence, Slurm host lists, and the errors for missing or malformed values.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "comm/bootstrap.h"
#include "comm/errors.h"

namespace crossbar {
namespace {

using EnvMap = std::map<std::string, std::string>;

EnvMap torchrun() {
  return {{"RANK", "3"},
          {"WORLD_SIZE", "8"},
          {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "4"},
          {"MASTER_ADDR", "node1"},
          {"MASTER_PORT", "29500"}};
}

EnvMap mpirun() {
  return {{"OMPI_COMM_WORLD_RANK", "2"},
          {"OMPI_COMM_WORLD_SIZE", "4"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
          {"PMIX_NAMESPACE", "prterun-host-1234@1"}};
}

EnvMap srun() {
  return {{"SLURM_PROCID", "5"},
          {"SLURM_NTASKS", "8"},
          {"SLURM_LOCALID", "1"},
          {"SLURM_TASKS_PER_NODE", "4(x2)"},
          {"SLURM_NODEID", "1"},
          {"SLURM_JOB_ID", "123456"},
          {"SLURM_JOB_NODELIST", "node[01-04,07]"}};
}

EnvMap with(EnvMap base, const EnvMap& changes) {
  for (const auto& [k, v] : changes) {
    if (v == "<unset>")
      base.erase(k);
    else
      base[k] = v;
  }
  return base;
}

// Expects InvalidArgument whose message contains every one of `parts`.
void expectError(const EnvMap& env, std::vector<std::string> parts) {
  try {
    BootstrapInfo info = detectBootstrap(env);
    ADD_FAILURE() << "expected InvalidArgument, got launcher " << info.launcher << " rank " << info.rank;
  } catch (const InvalidArgument& e) {
    std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

TEST(Bootstrap, Torchrun) {
  BootstrapInfo info = detectBootstrap(torchrun());
  EXPECT_EQ(info.launcher, "torchrun");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_size, 4);
  EXPECT_EQ(info.store_host, "node1");
  EXPECT_EQ(info.store_port, 29500);
  EXPECT_FALSE(info.store_is_external);
}

TEST(Bootstrap, TorchrunLocalValuesOptional) {
  BootstrapInfo info =
      detectBootstrap(with(torchrun(), {{"LOCAL_RANK", "<unset>"}, {"LOCAL_WORLD_SIZE", ""}}));
  EXPECT_EQ(info.local_rank, -1);
  EXPECT_EQ(info.local_size, -1);
}

TEST(Bootstrap, TorchrunAgentStoreMovesToNextPort) {
  // torchrun's agent serves its own store on MASTER_PORT.
  BootstrapInfo info = detectBootstrap(with(torchrun(), {{"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  EXPECT_EQ(info.store_port, 29501);
  EXPECT_EQ(detectBootstrap(with(torchrun(), {{"TORCHELASTIC_USE_AGENT_STORE", "False"}})).store_port, 29500);
}

TEST(Bootstrap, TorchrunErrors) {
  expectError(with(torchrun(), {{"WORLD_SIZE", "<unset>"}}),
              {"torchrun", "WORLD_SIZE is missing", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"});
  expectError(with(torchrun(), {{"RANK", "<unset>"}}), {"RANK is missing"});
  expectError(with(torchrun(), {{"RANK", "abc"}}), {"RANK=abc", "decimal integer"});
  expectError(with(torchrun(), {{"RANK", "-1"}}), {"RANK=-1"});
  expectError(with(torchrun(), {{"RANK", "8"}}), {"RANK=8", "WORLD_SIZE=8"});
  expectError(with(torchrun(), {{"WORLD_SIZE", "0"}}), {"WORLD_SIZE=0"});
  expectError(with(torchrun(), {{"LOCAL_RANK", "4"}}), {"LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"});
  expectError(with(torchrun(), {{"LOCAL_WORLD_SIZE", "9"}}), {"LOCAL_WORLD_SIZE=9"});
  expectError(with(torchrun(), {{"MASTER_ADDR", "<unset>"}, {"MASTER_PORT", "<unset>"}}),
              {"MASTER_ADDR", "MASTER_PORT", "CROSSBAR_STORE_ADDR"});
  expectError(with(torchrun(), {{"MASTER_PORT", "<unset>"}}), {"MASTER_PORT is missing"});
  expectError(with(torchrun(), {{"MASTER_ADDR", "<unset>"}}), {"MASTER_ADDR is missing"});
  expectError(with(torchrun(), {{"MASTER_PORT", "70000"}}), {"MASTER_PORT=70000", "1-65535"});
  expectError(with(torchrun(), {{"MASTER_PORT", "http"}}), {"MASTER_PORT=http"});
}

TEST(Bootstrap, StoreAddrWinsAndIsExternal) {
  BootstrapInfo info = detectBootstrap(with(torchrun(), {{"CROSSBAR_STORE_ADDR", "store-host:4000"}}));
  EXPECT_EQ(info.store_host, "store-host");
  EXPECT_EQ(info.store_port, 4000);
  EXPECT_TRUE(info.store_is_external);
  // Enough on its own for torchrun, and works for every launcher.
  info = detectBootstrap(
      with(torchrun(),
           {{"MASTER_ADDR", "<unset>"}, {"MASTER_PORT", "<unset>"}, {"CROSSBAR_STORE_ADDR", "[::1]:4001"}}));
  EXPECT_EQ(info.store_host, "::1");
  EXPECT_EQ(info.store_port, 4001);
  info = detectBootstrap(with(srun(), {{"CROSSBAR_STORE_ADDR", "10.1.2.3:4002"}}));
  EXPECT_EQ(info.launcher, "srun");
  EXPECT_EQ(info.store_host, "10.1.2.3");
  EXPECT_TRUE(info.store_is_external);
}

TEST(Bootstrap, StoreAddrMalformed) {
  for (std::string bad : {"store-host", ":4000", "host:", "host:0", "host:x", "a:b:c", "[::1]4000", "[::1"})
    expectError(with(torchrun(), {{"CROSSBAR_STORE_ADDR", bad}}), {"CROSSBAR_STORE_ADDR=" + bad});
}

TEST(Bootstrap, Mpirun) {
  BootstrapInfo info = detectBootstrap(mpirun());
  EXPECT_EQ(info.launcher, "mpirun");
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.size, 4);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_size, 4);
  EXPECT_EQ(info.store_host, "127.0.0.1");
  EXPECT_GE(info.store_port, 20000);
  EXPECT_LT(info.store_port, 32768);
  EXPECT_FALSE(info.store_is_external);
  // Every rank of the job derives the same port; another job (almost surely) another.
  BootstrapInfo rank0 =
      detectBootstrap(with(mpirun(), {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}));
  EXPECT_EQ(rank0.store_port, info.store_port);
  BootstrapInfo other = detectBootstrap(with(mpirun(), {{"PMIX_NAMESPACE", "prterun-host-9999@1"}}));
  EXPECT_NE(other.store_port, info.store_port);
  // Older OpenMPI job ids work too.
  EXPECT_NO_THROW(detectBootstrap(
      with(mpirun(), {{"PMIX_NAMESPACE", "<unset>"}, {"OMPI_MCA_orte_ess_jobid", "3812163585"}})));
  EXPECT_NO_THROW(detectBootstrap(
      with(mpirun(), {{"PMIX_NAMESPACE", "<unset>"}, {"OMPI_MCA_ess_base_jobid", "3812163585"}})));
}

TEST(Bootstrap, MpirunAcrossHostsNeedsAnAddress) {
  EnvMap two_hosts = with(mpirun(), {{"OMPI_COMM_WORLD_SIZE", "8"}});
  expectError(two_hosts, {"mpirun", "several hosts", "MASTER_ADDR", "CROSSBAR_STORE_ADDR"});
  BootstrapInfo info = detectBootstrap(with(two_hosts, {{"MASTER_ADDR", "hostA"}, {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(info.store_host, "hostA");
  EXPECT_EQ(info.store_port, 1234);
  EXPECT_EQ(info.size, 8);
}

TEST(Bootstrap, MpirunErrors) {
  expectError(with(mpirun(), {{"PMIX_NAMESPACE", "<unset>"}}), {"job id", "MASTER_PORT"});
  expectError(with(mpirun(), {{"OMPI_COMM_WORLD_SIZE", "<unset>"}}), {"OMPI_COMM_WORLD_SIZE is missing"});
  expectError(with(mpirun(), {{"OMPI_COMM_WORLD_RANK", "two"}}), {"OMPI_COMM_WORLD_RANK=two"});
}

TEST(Bootstrap, Srun) {
  BootstrapInfo info = detectBootstrap(srun());
  EXPECT_EQ(info.launcher, "srun");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_size, 4);
  EXPECT_EQ(info.store_host, "node01");  // first host of the node list: task 0 runs there
  EXPECT_GE(info.store_port, 20000);
  EXPECT_LT(info.store_port, 32768);
  EXPECT_FALSE(info.store_is_external);
  // Same job, same port on every rank; another step, another port.
  EXPECT_EQ(
      detectBootstrap(with(srun(), {{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "0"}}))
          .store_port,
      info.store_port);
  EXPECT_NE(detectBootstrap(with(srun(), {{"SLURM_STEP_ID", "3"}})).store_port, info.store_port);
}

TEST(Bootstrap, SrunTasksPerNode) {
  // Uneven layout "3(x2),2": the node id picks the count.
  EnvMap uneven =
      with(srun(), {{"SLURM_TASKS_PER_NODE", "3(x2),2"}, {"SLURM_PROCID", "7"}, {"SLURM_NODEID", "2"}});
  EXPECT_EQ(detectBootstrap(uneven).local_size, 2);
  EXPECT_EQ(detectBootstrap(with(uneven, {{"SLURM_NODEID", "0"}, {"SLURM_PROCID", "1"}})).local_size, 3);
  // Uneven and no node id: unknown.
  EXPECT_EQ(detectBootstrap(with(uneven, {{"SLURM_NODEID", "<unset>"}})).local_size, -1);
  // The step's layout wins over the job's, which wins over SLURM_TASKS_PER_NODE.
  EXPECT_EQ(detectBootstrap(with(srun(), {{"SLURM_NTASKS_PER_NODE", "2"}})).local_size, 2);
  EXPECT_EQ(
      detectBootstrap(with(srun(), {{"SLURM_NTASKS_PER_NODE", "8"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x4)"}}))
          .local_size,
      2);
  expectError(with(srun(), {{"SLURM_TASKS_PER_NODE", "4(y2)"}}), {"SLURM_TASKS_PER_NODE=4(y2)"});
  expectError(with(srun(), {{"SLURM_TASKS_PER_NODE", "3(x2),2"}, {"SLURM_NODEID", "5"}}), {"SLURM_NODEID=5"});
}

TEST(Bootstrap, SrunStoreHost) {
  // Step node list first (the job may hold more nodes than the step uses).
  EXPECT_EQ(detectBootstrap(with(srun(), {{"SLURM_STEP_NODELIST", "gpu[12-13]"}})).store_host, "gpu12");
  EXPECT_EQ(detectBootstrap(with(srun(), {{"SLURM_JOB_NODELIST", "<unset>"}, {"SLURM_NODELIST", "a,b"}}))
                .store_host,
            "a");
  EXPECT_EQ(detectBootstrap(
                with(srun(), {{"SLURM_JOB_NODELIST", "<unset>"}, {"SLURM_LAUNCH_NODE_IPADDR", "10.0.0.5"}}))
                .store_host,
            "10.0.0.5");
  // MASTER_ADDR/MASTER_PORT win over the derived address.
  BootstrapInfo info = detectBootstrap(with(srun(), {{"MASTER_ADDR", "head"}, {"MASTER_PORT", "29400"}}));
  EXPECT_EQ(info.store_host, "head");
  EXPECT_EQ(info.store_port, 29400);
}

TEST(Bootstrap, SrunErrors) {
  expectError(with(srun(), {{"SLURM_NTASKS", "<unset>"}}), {"srun", "SLURM_NTASKS is missing"});
  expectError(with(srun(), {{"SLURM_JOB_ID", "<unset>"}}), {"SLURM_JOB_ID is missing"});
  expectError(with(srun(), {{"SLURM_JOB_NODELIST", "<unset>"}}), {"SLURM_LAUNCH_NODE_IPADDR", "MASTER_ADDR"});
  expectError(with(srun(), {{"SLURM_JOB_NODELIST", "node[01-"}}), {"SLURM_JOB_NODELIST", "node[01-"});
  expectError(with(srun(), {{"SLURM_PROCID", "9"}}), {"SLURM_PROCID=9", "SLURM_NTASKS=8"});
  EXPECT_EQ(detectBootstrap(with(srun(), {{"SLURM_NTASKS", "<unset>"}, {"SLURM_NPROCS", "8"}})).size, 8);
}

TEST(Bootstrap, Precedence) {
  // torchrun inside an srun or mpirun allocation: torchrun's variables describe the ranks.
  EnvMap all = torchrun();
  for (const auto& kv : mpirun()) all.insert(kv);
  for (const auto& kv : srun()) all.insert(kv);
  EXPECT_EQ(detectBootstrap(all).launcher, "torchrun");
  EXPECT_EQ(detectBootstrap(all).rank, 3);
  // mpirun inside a Slurm allocation.
  EnvMap mpi_in_slurm = mpirun();
  for (const auto& kv : srun()) mpi_in_slurm.insert(kv);
  EXPECT_EQ(detectBootstrap(mpi_in_slurm).launcher, "mpirun");
  EXPECT_EQ(detectBootstrap(mpi_in_slurm).rank, 2);
}

TEST(Bootstrap, NothingDetected) {
  expectError({}, {"no launcher detected", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "MASTER_ADDR"});
  expectError({{"PATH", "/usr/bin"}, {"RANK", ""}}, {"no launcher detected"});
}

TEST(Bootstrap, FromProcessEnvironment) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29999", 1);
  BootstrapInfo info = detectBootstrap();
  EXPECT_EQ(info.launcher, "torchrun");
  EXPECT_EQ(info.size, 1);
  EXPECT_EQ(info.store_port, 29999);
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(v);
}

TEST(Hostlist, Expand) {
  EXPECT_EQ(expandHostlist("node[01-04,07]"),
            (std::vector<std::string>{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expandHostlist("login,gpu[1-2]"), (std::vector<std::string>{"login", "gpu1", "gpu2"}));
  EXPECT_EQ(expandHostlist("n[8-11]"), (std::vector<std::string>{"n8", "n9", "n10", "n11"}));
  EXPECT_EQ(expandHostlist("n[098-100]"), (std::vector<std::string>{"n098", "n099", "n100"}));
  EXPECT_EQ(expandHostlist("r[1-2]-n[1-2].x"),
            (std::vector<std::string>{"r1-n1.x", "r1-n2.x", "r2-n1.x", "r2-n2.x"}));
  EXPECT_EQ(expandHostlist("single"), (std::vector<std::string>{"single"}));
  EXPECT_TRUE(expandHostlist("").empty());
  for (std::string bad : {"n[1-", "n]", "n[]", "n[a-b]", "n[3-1]", "n[1-2-3]", "n[1,,2]"})
    EXPECT_THROW(expandHostlist(bad), InvalidArgument) << bad;
}

// A port that was free a moment ago.
uint16_t freePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(ConnectStore, RankZeroServesOthersConnect) {
  uint16_t port = freePort();
  BootstrapInfo info = detectBootstrap({{"RANK", "0"},
                                        {"WORLD_SIZE", "2"},
                                        {"MASTER_ADDR", "127.0.0.1"},
                                        {"MASTER_PORT", std::to_string(port)}});
  std::shared_ptr<Store> server = connectStore(info);
  info.rank = 1;
  std::shared_ptr<Store> client = connectStore(info);
  client->set("hello", "world");
  EXPECT_EQ(toString(server->get("hello", Deadline::after(Millis(10'000)))), "world");
  EXPECT_EQ(client->add("n", 2), 2);
  EXPECT_EQ(server->add("n", 3), 5);
}

TEST(ConnectStore, ExternalStoreIsNotServed) {
  // Nobody serves: even rank 0 only tries to connect, and gives up at the connect deadline.
  setenv("CROSSBAR_CONNECT_TIMEOUT", "300ms", 1);
  uint16_t port = freePort();
  BootstrapInfo info = detectBootstrap(
      {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"CROSSBAR_STORE_ADDR", "127.0.0.1:" + std::to_string(port)}});
  EXPECT_TRUE(info.store_is_external);
  try {
    connectStore(info);
    ADD_FAILURE() << "expected an error: nobody serves the store";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(std::to_string(port)), std::string::npos) << msg;
  }
  unsetenv("CROSSBAR_CONNECT_TIMEOUT");
}

TEST(ConnectStore, RejectsIncompleteInfo) {
  EXPECT_THROW(connectStore(BootstrapInfo{}), InvalidArgument);
}

}  // namespace
}  // namespace crossbar
