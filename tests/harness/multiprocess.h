// Runs N ranks as forked processes over the real transports, with a fresh TCP
// store (served by the parent) per call, and collects each rank's failures.
//
//   runRanks(4, [](RankEnv& env) {
//     auto comm = env.communicator();
//     EXPECT_EQ(comm->size(), 4);
//   });
//
// Failures of gtest assertions and exceptions inside a rank are reported in the
// parent with the rank number. A rank that exceeds `timeout` is killed and reported.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/store.h"

namespace crossbar::testing {

struct RankEnv {
  int rank = 0;
  int size = 0;
  std::shared_ptr<Store> store;   // fresh per runRanks() call
  std::string store_addr;         // host:port of that store
  // Creates (once) the world communicator over `store`.
  std::shared_ptr<Communicator> communicator(CommOptions options = {});
  std::shared_ptr<Communicator> comm;
};

struct RunOptions {
  Millis timeout{120'000};                   // whole run; ranks still alive are killed
  std::map<std::string, std::string> env;    // set in every rank before `body`
  // When set, expected exit: a rank may die (e.g. killed on purpose) without failing.
  bool allow_rank_death = false;
};

// Options that split the ranks into virtual nodes of `ranks_per_node` (CROSSBAR_RANKS_PER_NODE).
inline RunOptions withRanksPerNode(int ranks_per_node) {
  RunOptions opts;
  opts.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(ranks_per_node);
  return opts;
}

struct RankResult {
  int rank = 0;
  bool ok = false;
  int exit_code = 0;   // or -signal
  std::string failure;  // collected failure text
};

// Runs `body` in `size` forked processes. Adds gtest failures for failing ranks
// (unless the caller inspects results itself with expect_ok=false).
std::vector<RankResult> runRanks(int size, const std::function<void(RankEnv&)>& body,
                                 RunOptions options = {}, bool expect_ok = true);

}  // namespace crossbar::testing
