// Algorithm selection: one visible table (collective x size range x ranks x nodes x
// memory -> algorithm), read top to bottom; the first row of the call's memory kind
// that matches and whose algorithm applies wins, else any algorithm of that memory
// kind and collective that applies. Host-memory algorithms are the registry of
// algorithms.h; CUDA-memory ones are described by cudaAlgorithms() (names, summaries,
// when they apply) and run by collectives/cuda.
// Overrides, strongest first: CollOptions::algorithm, CROSSBAR_ALGO, the table.
// CROSSBAR_ALGO names may be host or CUDA algorithms ("allreduce=oneshot" applies to
// both memories, "nccl" only to CUDA); a name the call's memory kind lacks is ignored.
#pragma once

#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "collectives/algorithms.h"

namespace crossbar {

enum class NodeScope { kAny, kSingle, kMulti };

struct SelectionRule {
  CollType coll;
  size_t min_bytes = 0;                                   // inclusive
  size_t max_bytes = std::numeric_limits<size_t>::max();  // exclusive
  int min_ranks = 1;
  int max_ranks = std::numeric_limits<int>::max();
  NodeScope nodes = NodeScope::kAny;
  std::string algorithm;
  MemoryKind memory = MemoryKind::kHost;
};

const std::vector<SelectionRule>& selectionTable();

// The CUDA-memory algorithms (collectives/cuda runs them; `run` is empty here), so the
// table, CROSSBAR_ALGO and crossbar-info know them in every build.
const std::deque<Algorithm>& cudaAlgorithms();
// The algorithm `name` of `coll` for memory kind `memory`; nullptr if none.
const Algorithm* findAlgorithm(CollType coll, const std::string& name, MemoryKind memory);

// The table, the registered algorithms and the active CROSSBAR_ALGO, as text.
std::string describeAlgorithmTable();

// Parsed CROSSBAR_ALGO: per collective, the forced name ("" = none). Throws
// InvalidArgument for unknown collectives or algorithm names.
struct AlgoOverride {
  std::string per_coll[kNumCollTypes];
};
AlgoOverride parseAlgoOverride(const std::string& text);

struct Selection {
  const Algorithm* algorithm = nullptr;
  std::string reason;  // "table: 64K <= bytes", "CollOptions.algorithm", ... (table picks: only with INFO logging on; a forced choice that fell back: always)
};

// Argument checks shared by the host and CUDA front ends (collectives.cc): counts,
// roots, peers, tags, null and overlapping buffers. Throws InvalidArgument.
void validateCollArgs(const CollArgs& args, const Communicator& comm);

// Chooses the algorithm for one call on `memory`. `forced` is CollOptions::algorithm.
Selection selectAlgorithm(const CollArgs& args, const Communicator& comm, const std::string& forced,
                          const AlgoOverride& env_override, MemoryKind memory = MemoryKind::kHost);

}  // namespace crossbar
