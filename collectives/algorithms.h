// Algorithm registry of the collectives layer. An algorithm is a named function that
// runs one collective over a Communicator; each declares when it applies, so the
// selection table (selection.h) can fall back when it does not. Host algorithms over
// point-to-point live in host_algorithms.cc; later paths (symmetric memory, CUDA)
// register more entries with registerAlgorithm() and new table rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/dtype.h"
#include "comm/communicator.h"
#include "comm/deadline.h"

namespace crossbar {

// Byte views of the untyped buffers the algorithms move, and chunk counts.
inline char* cp(void* p) {
  return static_cast<char*>(p);
}
inline const char* ccp(const void* p) {
  return static_cast<const char*>(p);
}
inline size_t ceilDiv(size_t a, size_t b) {
  return (a + b - 1) / b;
}

enum class CollType {
  kAllreduce,
  kAllgather,
  kReduceScatter,
  kBroadcast,
  kReduce,
  kAlltoall,
  kAlltoallv,
  kGather,
  kScatter,
  kBarrier,
  kSend,
  kRecv,
};
inline constexpr int kNumCollTypes = 12;
const char* collTypeName(CollType c);  // "allreduce", "reduce_scatter", ...
// Whether a collective takes a reduce op / a root (the fields others ignore).
inline bool hasReduceOp(CollType c) {
  return c == CollType::kAllreduce || c == CollType::kReduceScatter || c == CollType::kReduce;
}
inline bool hasRoot(CollType c) {
  return c == CollType::kBroadcast || c == CollType::kReduce || c == CollType::kGather ||
         c == CollType::kScatter;
}
bool parseCollType(const std::string& name, CollType* out);

// Everything one call describes; pointers are the caller's buffers.
struct CollArgs {
  CollType coll = CollType::kAllreduce;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  // elements (per rank where the API says so)
  DataType type = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  double premul_scalar = 1.0;
  std::vector<size_t> send_counts, send_displs, recv_counts, recv_displs;  // alltoallv
  int peer = -1;                                                           // send/recv
  uint32_t tag = 0;                                                        // send/recv (user tag)

  // The fields every call has; the API functions fill in the rest.
  static CollArgs of(CollType c, const void* send, void* recv, size_t count, DataType type) {
    CollArgs a;
    a.coll = c;
    a.send = send;
    a.recv = recv;
    a.count = count;
    a.type = type;
    return a;
  }

  // The size the selection table keys on: nccl-tests' "size" (the largest buffer).
  size_t selectionBytes(int nranks) const;
  std::string describe() const;  // "allreduce 4096 x float sum"
};

// Lazily created sub-communicators for hierarchical algorithms.
struct HierComms {
  std::shared_ptr<Communicator> intra;  // ranks of my node, by rank
  std::shared_ptr<Communicator> inter;  // ranks with my local index, by node
};

class SymmCache;  // symm_staging.h

// Reusable temporaries of one Collectives (one operation executes at a time), so a
// call does not zero and page-fault fresh memory. get(slot, n) keeps the slot's
// contents only until the next get of the same slot.
class Scratch {
 public:
  char* get(int slot, size_t bytes) {
    if (slot >= static_cast<int>(bufs_.size())) {
      bufs_.resize(slot + 1);
      sizes_.resize(slot + 1, 0);
    }
    if (sizes_[slot] < bytes) {
      bufs_[slot].reset(new char[bytes]);
      sizes_[slot] = bytes;
    }
    return bufs_[slot].get();
  }

 private:
  std::vector<std::unique_ptr<char[]>> bufs_;
  std::vector<size_t> sizes_;
};

// What an algorithm runs with.
struct RunContext {
  Communicator* comm = nullptr;
  uint32_t tag = 0;  // base tag of this operation (sub-tags are added)
  Deadline deadline = Deadline::never();
  size_t chunk_bytes = 512 * 1024;
  const HierComms* hier = nullptr;  // set when the algorithm needs it
  Scratch* scratch = nullptr;
  SymmCache* symm = nullptr;  // symmetric staging (symm_algorithms.cc), created at first use
  // The second half of the call check (CallChecker::post / verifyPosted) when the
  // algorithm runs it itself (Algorithm::verifies_calls): called, once, right before the
  // first wait for a peer's data; empty once run (or when the check ran before).
  std::function<void()>* verify_calls = nullptr;
};

// Runs a pending call check (RunContext::verify_calls) if it has not run yet; once.
inline void runPendingCallCheck(std::function<void()>* check) {
  if (check && *check) {
    auto run = std::move(*check);
    *check = nullptr;
    run();
  }
}

struct Algorithm {
  CollType coll;
  std::string name;
  std::string summary;  // one line for the table printout
  // Empty string: applies; otherwise why not (for the log and errors).
  std::function<std::string(const CollArgs&, const Communicator&)> applies;
  std::function<void(const CollArgs&, RunContext&)> run;
  bool needs_hier = false;  // needs RunContext::hier
  // Reads peers' data only after a wait that runs RunContext::verify_calls first (the
  // one-node staged symmetric algorithms), so the call check's wait for the peers
  // overlaps this rank's first steps (its own copies) instead of preceding them.
  bool verifies_calls = false;
};

// Every registered algorithm (host ones included), in registration order. A deque:
// pointers from findAlgorithm() stay valid when more are registered.
const std::deque<Algorithm>& algorithms();
const Algorithm* findAlgorithm(CollType coll, const std::string& name);
void registerAlgorithm(Algorithm a);

// Defined in host_algorithms.cc / symm_algorithms.cc / hier_algorithms.cc; called once
// by algorithms().
void registerHostAlgorithms(std::deque<Algorithm>& out);
void registerSymmAlgorithms(std::deque<Algorithm>& out);
void registerHierAlgorithms(std::deque<Algorithm>& out);

// In-place allreduce of `buf` over point-to-point (recursive doubling below 64 KiB,
// else ring) with an already normalized op (no premul/avg); sub-tags sub..sub+1.
void p2pAllreduceInPlace(Communicator& c, const RunContext& x, void* buf, size_t n, DataType t, ReduceOp op,
                         uint32_t sub);

// Whether every node of `comm` has the same number of ranks (hierarchical needs it).
bool uniformNodes(const Communicator& comm);

}  // namespace crossbar
