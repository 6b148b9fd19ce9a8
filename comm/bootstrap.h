// Bootstrap: rank, size and the store's address from whatever launched the job:
// torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), OpenMPI's
// mpirun (OMPI_COMM_WORLD_*), Slurm's srun (SLURM_PROCID, ...), or explicit values.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/store.h"

namespace crossbar {

struct BootstrapInfo {
  std::string launcher;      // "torchrun", "mpirun", "srun", "explicit"
  int rank = -1;
  int size = -1;
  int local_rank = -1;       // -1 when the launcher does not say
  int local_size = -1;
  std::string store_host;    // where the TCP store is (rank 0 serves it unless external)
  uint16_t store_port = 0;
  bool store_is_external = false;  // CROSSBAR_STORE_ADDR given: nobody serves it
};

// From an environment map (testable) or the process environment. Throws
// InvalidArgument naming the missing or malformed variables and the launchers tried.
BootstrapInfo detectBootstrap(const std::map<std::string, std::string>& environment);
BootstrapInfo detectBootstrap();

// Expands a Slurm host list: "node[01-03,07],login" -> node01 node02 node03 node07 login
// (zero padding kept; several bracket groups in one name multiply). InvalidArgument if malformed.
std::vector<std::string> expandHostlist(const std::string& hostlist);

// Connects to (or, on rank 0 when not external, serves) the TCP store.
std::shared_ptr<Store> connectStore(const BootstrapInfo& info);

}  // namespace crossbar
