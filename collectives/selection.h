// Algorithm selection: one visible table (collective x size range x ranks x nodes ->
// algorithm), read top to bottom; the first row that matches and whose algorithm
// applies wins, else any registered algorithm of the collective that applies.
// Overrides, strongest first: CollOptions::algorithm, CROSSBAR_ALGO, the table.
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
};

const std::vector<SelectionRule>& selectionTable();

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
  std::string reason;  // "table: 64K <= bytes", "CollOptions.algorithm", ...
};

// Chooses the algorithm for one call. `forced` is CollOptions::algorithm.
Selection selectAlgorithm(const CollArgs& args, const Communicator& comm, const std::string& forced,
                          const AlgoOverride& env_override);

}  // namespace crossbar
