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
// UCX_WARN_UNUSED_ENV_VARS (then theirs wins); TCP sends in 64 KiB segments unless
// UCX_TCP_TX_SEG_SIZE is set (given to ucp_config_modify as TX_SEG_SIZE: UCX 1.13
// rejects the TCP_-prefixed name there); RESOLVE_REMOTE_EP_ID=on, RCACHE_ENABLE=n and
// MEMTYPE_CACHE=n (ucx_context.cc says why).
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
// handshake; users of worker() must keep it clear. Bits 48-62 carry the sender's
// *wire id* (wireTag()), the low 48 bits the transport tag. A context's wire ids are
// wireBase() + rank, in an aligned block of wireBlock() ids.
//
// Kept workers (fault tolerance): a Fabric holds the UCP context, worker and endpoints
// of one process across the epochs of a FaultTolerantComm (comm/ft.h). A context made
// on a fabric reuses the endpoints to the peers it was already connected to (no new
// UCX wireup: a peer dying in the middle of a wireup can abort this process inside
// UCX, docs/fault-tolerance.md) and wires up only peers it has no endpoint to
// (joiners). Every epoch gets wire ids no earlier epoch on any member's worker used
// (Context::create agrees on the base), so a late message of an old epoch, which sits
// in the kept worker's unexpected queue, can never match a receive of a newer epoch.
//
// Connecting (CROSSBAR_UCX_CONNECT): a fresh endpoint is made either from the peer's
// worker address (ucp_ep_create with REMOTE_ADDRESS; both sides create one and UCX
// wires them up with a REQUEST/REPLY exchange over tcp) or client-server: the worker
// listens (one ucp_listener per worker, made on first need, on listenAddress()), the
// lower rank of the pair connects to the higher one's listener sending its worker's
// client id, and the higher one accepts the connection request carrying the id its
// peer published. With UCX 1.13 a peer SIGKILLed in the middle of an address wireup can
// abort this process inside UCX (wireup_ep.c:241); in the client-server path the
// server builds its lanes from the client's request and no wireup message waits on a
// dying connection (docs/fault-tolerance.md, "Joiners killed in their wireup"). auto:
// client-server on a kept fabric (fault tolerance; joiners get the highest ranks, so
// members connect and joiners listen), worker addresses elsewhere. A pair connects
// client-server only when both records carry a listener (a rank whose listener could
// not be made falls back to addresses, with one INFO line); both sides decide from the
// same two records.
#pragma once

#include <ucp/api/ucp.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/transport.h"

namespace crossbar {
class Store;
}

namespace crossbar::ucx {

constexpr uint64_t kHandshakeTagBit = uint64_t{1} << 63;
constexpr int kMaxRanks = 1 << 15;
constexpr uint32_t kWireIds = 1u << 15;  // bits 48-62 of a UCP tag

namespace detail {
struct Worker;
struct Endpoint;
}  // namespace detail

// The UCX state one process keeps across the epochs of a fault-tolerant communicator
// (see "Kept workers" above). Cheap to make: UCX is initialized by the first context
// built on it. Not thread-safe: contexts are built on it one at a time.
class Fabric {
 public:
  Fabric();
  ~Fabric();
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;
  // First wire id no context on this fabric has used (Context::create takes the
  // maximum over the members).
  uint32_t wireNext() const { return wire_next_; }
  void setWireNext(uint32_t next) { wire_next_ = next; }
  // Drops the worker and its endpoints (contexts still using them keep them alive):
  // the next context starts a fresh worker. For when the wire ids run out.
  void reset();
  // Number of endpoints open on the kept worker (tests).
  size_t openEndpoints() const;

 private:
  friend class UcxContext;
  std::shared_ptr<detail::Worker> worker_;
  uint32_t wire_next_ = 0;
};

// Wire ids a context of `size` ranks takes: an aligned block of the next power of two.
uint32_t wireBlock(int size);
// Collective over the `size` ranks of a context built on `fabric` (Context::create): the
// first id of a block no member's worker has used yet. Each rank offers its fabric's next
// unused id through `store` ("ucxwire/<rank>"); all take the aligned block above the
// largest offer and advance their fabric past it. When the ids run out every fabric drops
// its worker (the next context starts a fresh one) and the block starts at 0.
uint32_t agreeWireBase(Fabric& fabric, Store& store, int rank, int size, Deadline deadline);

struct PeerInfo {
  std::string host;
  int pid = 0;
};

namespace detail {

// A context's address record, published under "<prefix>/<rank>": host, pid, the
// identity of its worker ("host:pid:nonce"), the identities of the workers it holds
// live endpoints to (kept workers), its listener ("ip:port"; empty: worker-address
// wireup only), the client id its worker sends when it connects client-server, and
// its worker address.
struct Record {
  PeerInfo info;
  std::string identity;
  std::vector<std::string> live;
  std::string listen;
  uint64_t client_id = 0;
  std::vector<uint8_t> address;
};
std::vector<uint8_t> encodeRecord(const Record& record);
// Throws InternalError naming `rank` (the reader) and `peer` on a malformed record.
Record decodeRecord(const std::vector<uint8_t>& bytes, int rank, int peer);
// True when the pair connects client-server (the lower rank as client): both listen.
bool clientServer(const Record& a, const Record& b);
// Whether a context listens: CROSSBAR_UCX_CONNECT (auto: only on a kept fabric).
bool wantListener(bool kept);
// The IPv4 address a worker listens on and publishes, and why that one:
// CROSSBAR_UCX_LISTEN_ADDR (an address or an interface name), else the first device of
// UCX_NET_DEVICES that has one, else the interface of the default route, else the
// address the host name resolves to, else 127.0.0.1. Throws InvalidArgument naming
// `rank` when CROSSBAR_UCX_LISTEN_ADDR names nothing usable.
std::string listenAddress(int rank, std::string* source = nullptr);

}  // namespace detail

class UcxContext {
 public:
  // Collective over setup.peers (each constructs its side) before setup.deadline:
  // publishes this worker's address, host and pid under "<prefix>/<rank>", creates
  // an endpoint to every peer (UCP_ERR_HANDLING_MODE_PEER) and exchanges a 0-byte
  // handshake with each so the connections are known to work. Throws Timeout
  // naming the peers that never showed up, PeerFailure naming those that failed.
  // With setup.ucx_fabric, uses (and keeps) that fabric's worker and endpoints.
  UcxContext(const TransportSetup& setup, const std::string& prefix);
  // Closes the endpoints (flush, bounded; force for failed peers), then the worker;
  // on a fabric, destroys only this context's rkeys and leaves both to the fabric.
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::vector<int>& peers() const { return peers_; }
  bool isPeer(int rank) const;

  ucp_context_h context() const;
  ucp_worker_h worker() const;
  // The endpoint to `peer`; nullptr if `peer` is not connected or was closed.
  ucp_ep_h ep(int peer) const;
  std::recursive_mutex& mutex();
  // True when the worker and endpoints outlive this context (built on a Fabric).
  bool kept() const { return kept_; }
  // Peers whose endpoint this context reused from an earlier one (no wireup).
  const std::vector<int>& reusedPeers() const { return reused_; }
  // Peers this context connected to client-server (the rest of the fresh ones: by
  // worker address).
  const std::vector<int>& clientServerPeers() const { return client_server_; }

  // UCP tag bits 48-62 of messages from `rank` (its wire id), and the tag/mask pair
  // that matches any of this context's ranks.
  uint64_t wireTag(int rank) const { return uint64_t(wire_base_ + static_cast<uint32_t>(rank)) << 48; }
  uint32_t wireBase() const { return wire_base_; }
  uint32_t wireBlock() const { return wire_block_; }
  uint64_t anySourceMask() const;
  // The rank whose wire id a received UCP tag carries (-1: not one of this context's).
  int rankOfTag(uint64_t ucp_tag) const;

  const PeerInfo& peerInfo(int peer) const { return infos_.at(peer); }
  // "rank 3 (host node7, pid 1234)"
  std::string describePeer(int peer) const;
  // Set once UCX reported an error on the endpoint to `peer` (UCS_OK otherwise).
  ucs_status_t peerStatus(int peer) const;

  // Called (with mutex() held, from inside progress()) when an endpoint fails.
  // Returns an id for removeErrorListener().
  using ErrorListener = std::function<void(int peer, ucs_status_t status)>;
  int addErrorListener(ErrorListener listener);
  void removeErrorListener(int id);

  // ucp_worker_progress until idle (bounded); returns true if anything moved.
  bool progress();
  // ucp_worker_arm: true when the caller may block on efd().
  bool arm();
  int efd() const;

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
  // On a kept worker it closes only endpoints with RMA keys of this context (RMA may
  // still run on them); the transport force-closes those with its own pending
  // operations, and the rest stay for the next epoch.
  void forceCloseAll();
  // Force-closes the endpoint to one peer.
  void forceClose(int peer);

 private:
  static void onEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void connect(const TransportSetup& setup, const std::string& prefix);
  void handshake(Deadline deadline);
  void createEndpoint(detail::Endpoint& e, int peer, const detail::Record& r, bool client_server);
  bool accept(int peer);
  void detach(bool failed);
  detail::Endpoint* slot(int peer) const;

  int rank_;
  int size_;
  std::vector<int> peers_;
  bool kept_ = false;
  std::shared_ptr<detail::Worker> w_;
  std::vector<PeerInfo> infos_;
  std::vector<detail::Endpoint*> slots_;  // by rank; null for non-peers; owned by w_
  std::vector<int> fresh_;                // peers wired up by this context
  std::vector<int> reused_;               // peers whose endpoint was kept
  std::vector<int> client_server_;        // fresh peers connected client-server
  std::vector<uint64_t> client_ids_;      // by rank: the id a client-server peer connects with
  std::vector<std::string> listens_;      // by rank: its listener, for messages
  uint32_t wire_base_ = 0, wire_block_ = 1;
  std::vector<std::pair<int, ErrorListener>> listeners_;
  int next_listener_ = 0;

  friend struct detail::Worker;
};

// The UcxContext behind a transport made by makeUcxTransport(), or nullptr.
std::shared_ptr<UcxContext> ucxContextOf(Transport& transport);

// Human-readable UCX status: "Connection reset by remote peer (UCS_ERR_CONNECTION_RESET)".
std::string statusText(ucs_status_t status);

}  // namespace crossbar::ucx
