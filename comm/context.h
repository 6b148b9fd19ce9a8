// Context: what the communicators of one job share -- the store namespace, the
// topology, the progress engine and the transports (routed per peer).
// Created by Communicator::create(); split()/dup() reuse it.
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/any_source.h"
#include "comm/progress.h"
#include "comm/store.h"
#include "comm/topology.h"
#include "comm/transport.h"

namespace crossbar {

class Context {
 public:
  // Collective over all `size` ranks; `ranks_per_node` < 0 reads CROSSBAR_RANKS_PER_NODE.
  // `ucx_fabric` (fault tolerance): the UCX worker and endpoints kept across epochs.
  static std::shared_ptr<Context> create(std::shared_ptr<Store> store, int rank, int size, int ranks_per_node,
                                         Deadline deadline,
                                         std::shared_ptr<ucx::Fabric> ucx_fabric = nullptr);
  ~Context();

  int rank() const { return rank_; }
  int size() const { return size_; }
  const Topology& topology() const { return topology_; }
  ProgressEngine& engine() { return engine_; }
  const std::shared_ptr<Store>& store() const { return store_; }
  // The transport that carries traffic to `peer` (never called with peer == rank()).
  Transport& transportTo(int peer) const { return *route_[peer]; }
  const char* transportName(int peer) const;
  // Receives from any peer, over every transport (Communicator::irecv with kAnySource).
  AnySourceMatcher& anySource() const { return *any_source_; }
  std::string transportsSummary() const;  // "shm(3 peers) ucx(4 peers)"

  void abort(const std::string& reason);
  // `error` (when set) is what pending and later operations fail with instead of Aborted.
  void abort(const std::string& reason, std::exception_ptr error);
  std::exception_ptr abortError() const { return aborted_.load() ? abort_error_ : nullptr; }
  bool aborted() const { return aborted_.load(); }
  const std::string& abortReason() const { return abort_reason_; }
  // For waits outside the transports (store, rendezvous): once aborted, throws the abort's
  // own error type and peers (PeerFailure, Timeout, else Aborted), the message prefixed
  // with `prefix`; returns when not aborted.
  void throwIfAborted(const std::string& prefix) const;

 private:
  Context() = default;
  int rank_ = 0, size_ = 0;
  Topology topology_;
  ProgressEngine engine_;
  std::shared_ptr<Store> store_;
  std::vector<std::unique_ptr<Transport>> transports_;
  std::vector<Transport*> route_;
  std::unique_ptr<AnySourceMatcher> any_source_;
  std::atomic<bool> aborted_{false};
  std::once_flag abort_once_;
  std::string abort_reason_;
  std::exception_ptr abort_error_;  // set only by abort(reason, error)
};

}  // namespace crossbar
