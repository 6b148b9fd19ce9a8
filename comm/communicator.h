// Communicator: a group of ranks that exchange tagged point-to-point messages.
// Created collectively from (store, rank, size, options). Communicators made by
// split()/dup() share their parent's transports (a per-communicator id in the tag
// keeps their traffic apart); each has an epoch number that fault tolerance bumps.
#pragma once

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/deadline.h"
#include "comm/request.h"
#include "comm/store.h"
#include "comm/topology.h"

namespace crossbar {

class Context;
class ProgressEngine;
namespace ucx {
class Fabric;
}
class Transport;

struct CommOptions {
  Millis timeout{0};      // 0: CROSSBAR_TIMEOUT
  std::string name;       // shows up in logs and errors; default "world"
  int ranks_per_node = -1;  // -1: CROSSBAR_RANKS_PER_NODE
  uint64_t epoch = 0;       // set by fault tolerance (comm/ft.h) for rebuilt communicators
  // Set by fault tolerance: the UCX worker and endpoints kept across its epochs
  // (comm/ucx_context.h, "Kept workers"). Null: this communicator has its own.
  std::shared_ptr<ucx::Fabric> ucx_fabric;
};

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  // Collective over all `size` ranks sharing `store`.
  static std::shared_ptr<Communicator> create(std::shared_ptr<Store> store, int rank, int size,
                                              CommOptions options = {});
  // From the launcher's environment (torchrun, mpirun, srun): see bootstrap.h.
  static std::shared_ptr<Communicator> fromEnvironment(CommOptions options = {});
  ~Communicator();

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(members_.size()); }
  int localRank() const;
  int localSize() const;
  // This rank's index among this communicator's ranks on its physical machine, and their
  // count: the processes that share this machine's cores. Equal to localRank/localSize
  // but with virtual nodes (CROSSBAR_RANKS_PER_NODE, CROSSBAR_NODE_ID), which split one
  // machine into several nodes.
  int machineLocalRank() const { return machine_local_rank_; }
  int machineLocalSize() const { return machine_local_size_; }
  int node() const;
  int numNodes() const { return num_nodes_; }  // computed once at construction
  // Ranks of this communicator on the same node as `rank`, in rank order.
  std::vector<int> nodePeers(int rank) const;
  // The ranks of every node: nodes in order of their first rank, ranks in rank order
  // (nodes may differ in size: an uneven launch, a shrunk fault-tolerant communicator).
  std::vector<std::vector<int>> nodes() const;
  int nodeOf(int rank) const;
  const std::string& host(int rank) const;
  uint64_t epoch() const { return epoch_; }
  const std::string& name() const { return name_; }
  Millis timeout() const { return timeout_; }
  Deadline defaultDeadline() const { return Deadline::after(timeout_); }

  // Point to point. Tags are 32-bit user tags. irecv/recv with peer == kAnySource take
  // the first message with the tag from any rank (see comm/any_source.h for the
  // matching rules); status().source then says who sent it (a communicator rank).
  RequestPtr isend(const void* data, size_t bytes, int peer, uint32_t tag);
  RequestPtr irecv(void* data, size_t capacity, int peer, uint32_t tag);
  void send(const void* data, size_t bytes, int peer, uint32_t tag);
  Status recv(void* data, size_t capacity, int peer, uint32_t tag);
  // Waits for all; the first failure is thrown after the rest finished or timed out.
  void waitAll(const std::vector<RequestPtr>& requests, Deadline deadline);

  void barrier();
  void barrier(Deadline deadline);

  // Collective clean shutdown: a barrier (bounded by the timeout, failures ignored)
  // so no peer is still sending to us, then release this handle's resources.
  void destroy();

  // Collective: ranks with the same color form a new communicator, ordered by
  // (key, old rank). color < 0 returns nullptr (not a member).
  std::shared_ptr<Communicator> split(int color, int key);
  std::shared_ptr<Communicator> dup();
  // Members only: the ranks in `ranks` (this communicator's ranks, no duplicates) form a
  // new communicator sharing these transports; the new rank is the position in `ranks`.
  // Only members call it, all with the same list; the n-th call with a list on each
  // member makes the same communicator (calls for different lists may come in any
  // order). Returns nullptr, without communicating, when this rank is not in `ranks`.
  // `name` defaults to "<parent>.[ranks]".
  std::shared_ptr<Communicator> splitMembers(const std::vector<int>& ranks, const std::string& name = {});

  // Fails every pending operation with Aborted; thread-safe, idempotent, nonblocking.
  // On the communicator create() made, this aborts the context: its transports and every
  // communicator split from it. On a split (split/dup/splitMembers) only this
  // communicator and the splits made from it: their pending and later operations fail,
  // the shared transports and the other communicators stay usable. Receives no message
  // matched yet are withdrawn (Request::cancel: their buffers are free at once, and a
  // later message with their tag is left for the next matching receive); a send, or a
  // receive whose message was already arriving, may still read (write) its buffer until
  // it finishes: keep such buffers alive while the transport holds the request.
  void abort(const std::string& reason = "abort() called");
  // Same, but pending and later operations fail with `error` (e.g. PeerFailure naming
  // the failed ranks) instead of Aborted.
  void abort(const std::string& reason, std::exception_ptr error);
  bool aborted() const;

  // Lower layers' access.
  int worldRank(int rank) const { return members_[rank]; }
  Context& context() const { return *context_; }
  // For layers that must notice an abort without keeping the context alive.
  std::weak_ptr<Context> contextHandle() const { return context_; }
  ProgressEngine& engine() const;
  Store& store() const;                   // namespaced for this communicator
  std::shared_ptr<Store> storePtr() const;
  const Topology& topology() const;       // indexed by world rank
  std::string describe() const;           // "world: rank 3/8, node 1/2, local 1/4"

 private:
  Communicator() = default;
  uint64_t fullTag(uint32_t tag) const { return (static_cast<uint64_t>(id_) << 32) | tag; }
  RequestPtr irecvAnySource(void* data, size_t capacity, uint32_t tag);
  int countNodes() const;
  std::shared_ptr<Communicator> makeChild(std::vector<int> members, int new_rank, uint32_t id,
                                          const std::string& name);
  // Throws (prefix + why) when the context or this communicator was aborted.
  void throwIfAborted(const std::string& prefix) const;
  [[noreturn]] void throwAborted(const char* op) const;  // once aborted(): the abort's error
  RequestPtr track(RequestPtr request);  // a split's pending operations, for its abort

  // A split's own abort state (null on the communicator that made the context, whose
  // abort is the context's): its pending requests and the splits made from it.
  struct SplitAbort;
  std::shared_ptr<SplitAbort> split_abort_;

  std::shared_ptr<Context> context_;
  std::vector<int> members_;  // communicator rank -> context (world) rank
  int rank_ = 0;
  uint32_t id_ = 0;           // tag namespace of this communicator (< 2^16)
  uint64_t epoch_ = 0;
  uint64_t split_count_ = 0;  // collective calls to split/dup so far (agree across ranks)
  std::map<std::vector<int>, uint64_t> member_split_count_;  // splitMembers calls per list
  std::string name_;
  Millis timeout_{0};
  std::vector<int> local_peers_;  // communicator ranks on my node, in rank order
  int num_nodes_ = 1;             // distinct nodes among members_ (countNodes())
  int local_rank_ = 0;
  // machineLocalRank/Size, counted once at construction (waits ask for them).
  int machine_local_rank_ = 0, machine_local_size_ = 1;
  void countMachinePeers();
  std::shared_ptr<Store> store_;
};

// Reserved user tags for crossbar's own internal messages (barrier, collectives).
constexpr uint32_t kInternalTagBase = 0xF0000000u;

}  // namespace crossbar
