// UcxContext: one UCP context + one worker + one endpoint per peer, connected
// collectively through the store. The UCX transport (tagged p2p) is built on it,
// and the symmetric-memory layer reuses the same worker and endpoints for RMA
// (ucp_mem_map, ucp_rkey_pack / ucp_ep_rkey_unpack, ucp_put_nbx / ucp_get_nbx):
// get the context of a UCX transport with ucxContextOf().
//
// Threading: the worker is created UCS_THREAD_MODE_SERIALIZED; every call into
// it (progress, posting, cancel, rkey unpack, ...) must hold mutex().
//
// Configuration (ucp_config_modify on crossbar's context only, never setenv):
// CROSSBAR_UCX_TLS overrides UCX_TLS; KEEPALIVE_INTERVAL=1s and
// WARN_UNUSED_ENV_VARS=n unless the user set UCX_KEEPALIVE_INTERVAL /
// UCX_WARN_UNUSED_ENV_VARS (then theirs wins).
//
// Observed with UCX 1.13 (Debian 12):
// * UCP_ERR_HANDLING_MODE_PEER excludes posix/sysv shared memory (their
//   *_ERROR_HANDLING defaults to n) and cma, so between processes of one host
//   UCX picks tcp over loopback even with default UCX_TLS; crossbar's shm
//   transport covers intra-node traffic. Forcing UCX_POSIX_ERROR_HANDLING=y
//   selects posix shm, but then a SIGKILLed peer went unnoticed for 20+ s
//   despite keepalive, so crossbar leaves it off.
// * Over tcp a killed peer is reported within milliseconds (the kernel closes
//   its sockets; UCX reports UCS_ERR_ENDPOINT_TIMEOUT), also with no traffic in
//   flight, as long as the worker is progressed (the ProgressEngine wakes at
//   least every 100 ms). A host that vanishes without closing sockets is caught
//   by keepalive / TCP keepalive (UCX_TCP_KEEPIDLE, default 10 s).
// * Wireup must finish during setup (RESOLVE_REMOTE_EP_ID=on, ucx_context.cc): a
//   REQUEST arriving later (UCX's default resolves at the first rendezvous send)
//   queues a REPLY that, if still queued when the endpoint or worker is closed,
//   trips an assertion and aborts the process (test_ft_ucx_teardown).
// * A peer that closes its endpoints normally also shows as an endpoint error
//   here; messages it sent before closing stay receivable (they sit in UCX's
//   unexpected queue).
//
// Tags: bit 63 of the UCP tag is reserved for the context's own connection
// handshake; users of worker() must keep it clear (the transport encodes
// (source rank << 48) | tag with ranks below 2^15).
#pragma once

#include <ucp/api/ucp.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/transport.h"

namespace crossbar::ucx {

constexpr uint64_t kHandshakeTagBit = uint64_t{1} << 63;
constexpr int kMaxRanks = 1 << 15;

struct PeerInfo {
  std::string host;
  int pid = 0;
};

class UcxContext {
 public:
  // Collective over setup.peers (each constructs its side) before setup.deadline:
  // publishes this worker's address, host and pid under "<prefix>/<rank>", creates
  // an endpoint to every peer (UCP_ERR_HANDLING_MODE_PEER) and exchanges a 0-byte
  // handshake with each so the connections are known to work. Throws Timeout
  // naming the peers that never showed up, PeerFailure naming those that failed.
  UcxContext(const TransportSetup& setup, const std::string& prefix);
  // Closes the endpoints (flush, bounded; force for failed peers), then the worker.
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::vector<int>& peers() const { return peers_; }
  bool isPeer(int rank) const;

  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  // The endpoint to `peer`; nullptr if `peer` is not connected or was closed.
  ucp_ep_h ep(int peer) const;
  std::recursive_mutex& mutex() { return mutex_; }

  const PeerInfo& peerInfo(int peer) const { return infos_.at(peer); }
  // "rank 3 (host node7, pid 1234)"
  std::string describePeer(int peer) const;
  // Set once UCX reported an error on the endpoint to `peer` (UCS_OK otherwise).
  ucs_status_t peerStatus(int peer) const { return slots_.at(peer).status; }

  // Called (with mutex() held, from inside progress()) when an endpoint fails.
  // Returns an id for removeErrorListener().
  using ErrorListener = std::function<void(int peer, ucs_status_t status)>;
  int addErrorListener(ErrorListener listener);
  void removeErrorListener(int id);

  // ucp_worker_progress until idle (bounded); returns true if anything moved.
  bool progress();
  // ucp_worker_arm: true when the caller may block on efd().
  bool arm();
  int efd() const { return efd_; }

  // Remote keys for RMA on `peer`'s endpoint. UCX requires an rkey to be destroyed
  // before the endpoint it was unpacked on, and an endpoint is closed (and freed) by
  // whichever thread progresses when its peer fails or the context aborts. So the
  // context owns the rkeys: closing an endpoint destroys those still held first.
  // Callers (symmem) hold mutex() and check ep(peer) != nullptr before every use of
  // the endpoint or its rkeys; never keep a ucp_ep_h across an unlock.
  // unpackRkey throws PeerFailure if the endpoint is gone, UcxError if UCX refuses.
  ucp_rkey_h unpackRkey(int peer, const void* packed, const std::string& op);
  // Destroys `rkey` unless closing the endpoint already did.
  void destroyRkey(int peer, ucp_rkey_h rkey);

  // Force-closes every endpoint (purging their outstanding operations, which
  // complete with an error). For abort: the context no longer talks to anyone.
  void forceCloseAll();
  // Force-closes the endpoint to one peer.
  void forceClose(int peer);

 private:
  struct Slot {
    UcxContext* self = nullptr;
    int rank = -1;
    ucp_ep_h ep = nullptr;
    ucs_status_t status = UCS_OK;
    bool closed = false;
    std::vector<ucp_rkey_h> rkeys;  // unpacked on ep; destroyed before it closes
  };
  static void onEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void connect(const TransportSetup& setup, const std::string& prefix);
  void handshake(Deadline deadline);
  void closeEndpoint(Slot& slot, bool force);
  void closeAllBounded();
  void teardown();

  int rank_;
  int size_;
  std::vector<int> peers_;
  std::recursive_mutex mutex_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::vector<PeerInfo> infos_;
  std::vector<Slot> slots_;            // indexed by rank; never resized after construction
  std::vector<void*> close_requests_;  // outstanding ucp_ep_close_nbx requests
  std::vector<std::pair<int, ErrorListener>> listeners_;
  int next_listener_ = 0;
};

// The UcxContext behind a transport made by makeUcxTransport(), or nullptr.
std::shared_ptr<UcxContext> ucxContextOf(Transport& transport);

// Human-readable UCX status: "Connection reset by remote peer (UCS_ERR_CONNECTION_RESET)".
std::string statusText(ucs_status_t status);

}  // namespace crossbar::ucx
