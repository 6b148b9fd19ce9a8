#include "comm/ucx_context.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <list>
#include <random>
#include <sstream>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/interrupt.h"
#include "comm/log.h"
#include "comm/store.h"

namespace crossbar::ucx {
namespace {

// Endpoint closes on destruction wait at most this long: a flush to a live peer
// takes microseconds; a dead one that UCX has not noticed must not hang us.
constexpr Millis kCloseTimeout{2000};
// Keepalive lets UCX notice a dead peer even while no traffic flows to it (UCX's
// default is 20 s); it only runs inside worker progress.
constexpr const char* kKeepaliveInterval = "1s";

[[noreturn]] void throwUcx(int rank, std::string_view operation, ucs_status_t status) {
  throw UcxError(
      fmt::format("{}{}. Check the UCX installation and UCX_* / CROSSBAR_UCX_TLS settings "
                  "(ucx_info -d lists the usable transports)",
                  errorContext(rank, operation), statusText(status)));
}

// Sets a UCX option for crossbar's context only, unless the user set it in the
// environment themselves (then theirs wins, as ucp_config_read already read it).
// `user_variable`: the user's name for it where that is not UCX_<name>.
void setDefault(ucp_config_t* config, const char* name, const std::string& value,
                const std::string& user_variable = {}) {
  const std::string variable = user_variable.empty() ? fmt::format("UCX_{}", name) : user_variable;
  if (const char* user = std::getenv(variable.c_str()); user && *user) return;
  ucs_status_t st = ucp_config_modify(config, name, value.c_str());
  if (st != UCS_OK) CB_WARN("ucx", "cannot set UCX option {}={}: {}", name, value, statusText(st));
}

// The value of a UCX option in `config` (its user's setting or default); "" if unknown.
std::string configValue(const ucp_config_t* config, const std::string& name) {
  char* text = nullptr;
  size_t length = 0;
  FILE* f = open_memstream(&text, &length);
  if (!f) return {};
  ucp_config_print(config, f, nullptr, UCS_CONFIG_PRINT_CONFIG);
  std::fclose(f);
  std::istringstream lines(std::string(text, length));
  std::free(text);
  const std::string key = fmt::format("UCX_{}=", name);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind(key, 0) == 0) return line.substr(key.size());
  return {};
}

struct HandshakeOp {
  bool done = false;
  ucs_status_t status = UCS_OK;
};

void handshakeSent(void*, ucs_status_t status, void* user_data) {
  auto* op = static_cast<HandshakeOp*>(user_data);
  op->done = true;
  op->status = status;
}

void handshakeReceived(void*, ucs_status_t status, const ucp_tag_recv_info_t*, void* user_data) {
  handshakeSent(nullptr, status, user_data);
}

// The first IPv4 address of interface `name` ("" if it has none).
std::string ipv4Of(const std::string& name) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return {};
  std::string found;
  for (ifaddrs* i = list; i && found.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || name != i->ifa_name) continue;
    char text[INET_ADDRSTRLEN] = {};
    if (inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text)))
      found = text;
  }
  freeifaddrs(list);
  return found;
}

// "eth0 192.0.2.2, lo 127.0.0.1": for messages.
std::string ipv4Interfaces() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "none found";
  std::string out;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", i->ifa_name, text);
  }
  freeifaddrs(list);
  return out.empty() ? "none found" : out;
}

bool isIpv4(const std::string& text) {
  in_addr a{};
  return inet_pton(AF_INET, text.c_str(), &a) == 1;
}

// The interface of the IPv4 default route ("" if none): /proc/net/route.
std::string defaultRouteInterface() {
  std::ifstream route("/proc/net/route");
  std::string line;
  std::getline(route, line);  // header
  while (std::getline(route, line)) {
    std::istringstream fields(line);
    std::string iface, destination, gateway;
    unsigned flags = 0;
    if (!(fields >> iface >> destination >> gateway >> std::hex >> flags)) continue;
    if (destination == "00000000" && (flags & 1u) /* RTF_UP */) return iface;
  }
  return {};
}

// "a.b.c.d:port" -> sockaddr_in; false if malformed.
bool parseListen(const std::string& listen, sockaddr_in* out) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return false;
  *out = sockaddr_in{};
  out->sin_family = AF_INET;
  const std::string ip = listen.substr(0, colon);
  const int port = std::atoi(listen.c_str() + colon + 1);
  if (port <= 0 || port > 65535 || inet_pton(AF_INET, ip.c_str(), &out->sin_addr) != 1) return false;
  out->sin_port = htons(static_cast<uint16_t>(port));
  return true;
}

}  // namespace

namespace detail {

std::vector<uint8_t> encodeRecord(const Record& r) {
  Bytes out;
  auto put32 = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  auto putStr = [&](const std::string& text) {
    put32(static_cast<uint32_t>(text.size()));
    out.insert(out.end(), text.begin(), text.end());
  };
  putStr(r.info.host);
  put32(static_cast<uint32_t>(r.info.pid));
  putStr(r.identity);
  put32(static_cast<uint32_t>(r.live.size()));
  for (const auto& id : r.live) putStr(id);
  putStr(r.listen);
  put32(static_cast<uint32_t>(r.client_id));
  put32(static_cast<uint32_t>(r.client_id >> 32));
  out.insert(out.end(), r.address.begin(), r.address.end());
  return out;
}

Record decodeRecord(const std::vector<uint8_t>& in, int rank, int peer) {
  size_t at = 0;
  auto bad = [&] {
    return InternalError(
        fmt::format("{}malformed UCX address record from rank {} ({} bytes). Every rank must "
                    "run the same crossbar build",
                    errorContext(rank, "ucx connect"), peer, in.size()));
  };
  auto get32 = [&] {
    if (in.size() < at + 4) throw bad();
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{in[at + i]} << (8 * i);
    at += 4;
    return v;
  };
  auto getStr = [&] {
    uint32_t n = get32();
    if (in.size() < at + n) throw bad();
    std::string text(in.begin() + at, in.begin() + at + n);
    at += n;
    return text;
  };
  Record r;
  r.info.host = getStr();
  r.info.pid = static_cast<int>(get32());
  r.identity = getStr();
  uint32_t live = get32();
  if (live > in.size()) throw bad();
  for (uint32_t i = 0; i < live; ++i) r.live.push_back(getStr());
  r.listen = getStr();
  sockaddr_in check{};
  if (!r.listen.empty() && !parseListen(r.listen, &check)) throw bad();
  r.client_id = get32();
  r.client_id |= uint64_t{get32()} << 32;
  r.address.assign(in.begin() + at, in.end());
  return r;
}

bool clientServer(const Record& a, const Record& b) {
  return !a.listen.empty() && !b.listen.empty();
}

bool wantListener(bool kept) {
  const std::string mode = env::getEnum("CROSSBAR_UCX_CONNECT");
  if (mode == "listener") return true;
  if (mode == "address") return false;
  return kept;
}

std::string listenAddress(int rank, std::string* source) {
  auto found = [&](std::string ip, std::string why) {
    if (source) *source = std::move(why);
    return ip;
  };
  if (env::isSet("CROSSBAR_UCX_LISTEN_ADDR")) {
    const std::string value = env::getString("CROSSBAR_UCX_LISTEN_ADDR");
    if (isIpv4(value)) return found(value, "CROSSBAR_UCX_LISTEN_ADDR");
    if (std::string ip = ipv4Of(value); !ip.empty())
      return found(ip, fmt::format("CROSSBAR_UCX_LISTEN_ADDR interface {}", value));
    throw InvalidArgument(
        fmt::format("{}CROSSBAR_UCX_LISTEN_ADDR={} is neither an IPv4 address nor an interface "
                    "with one (IPv4 interfaces here: {})",
                    errorContext(rank, "ucx listen"), value, ipv4Interfaces()));
  }
  // The devices UCX may use: its listener should be on one of them (network namespaces,
  // multi-rail hosts). "mlx5_0:1" names a port; IB devices have no IPv4 and are skipped.
  if (const char* devices = std::getenv("UCX_NET_DEVICES"); devices && *devices) {
    std::istringstream list(devices);
    std::string device;
    while (std::getline(list, device, ',')) {
      device = device.substr(0, device.find(':'));
      if (device.empty() || device == "all") continue;
      if (std::string ip = ipv4Of(device); !ip.empty())
        return found(ip, fmt::format("UCX_NET_DEVICES device {}", device));
    }
  }
  if (std::string iface = defaultRouteInterface(); !iface.empty())
    if (std::string ip = ipv4Of(iface); !ip.empty())
      return found(ip, fmt::format("default route via {}", iface));
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* list = nullptr;
  if (getaddrinfo(hostName().c_str(), nullptr, &hints, &list) == 0) {
    std::string ip;
    for (addrinfo* a = list; a && ip.empty(); a = a->ai_next) {
      char text[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr, text, sizeof(text));
      if (std::string_view(text).substr(0, 4) != "127.") ip = text;
    }
    freeaddrinfo(list);
    if (!ip.empty()) return found(ip, fmt::format("host name {}", hostName()));
  }
  return found("127.0.0.1", "loopback: no other IPv4 address found");
}

}  // namespace detail

std::string statusText(ucs_status_t status) {
  // ucs_status_string gives the prose; the enum name is what people search for.
  const char* name = nullptr;
  switch (status) {
    case UCS_ERR_CONNECTION_RESET:
      name = "UCS_ERR_CONNECTION_RESET";
      break;
    case UCS_ERR_ENDPOINT_TIMEOUT:
      name = "UCS_ERR_ENDPOINT_TIMEOUT";
      break;
    case UCS_ERR_UNREACHABLE:
      name = "UCS_ERR_UNREACHABLE";
      break;
    case UCS_ERR_IO_ERROR:
      name = "UCS_ERR_IO_ERROR";
      break;
    case UCS_ERR_CANCELED:
      name = "UCS_ERR_CANCELED";
      break;
    case UCS_ERR_MESSAGE_TRUNCATED:
      name = "UCS_ERR_MESSAGE_TRUNCATED";
      break;
    case UCS_ERR_NO_DEVICE:
      name = "UCS_ERR_NO_DEVICE";
      break;
    case UCS_ERR_NO_MEMORY:
      name = "UCS_ERR_NO_MEMORY";
      break;
    case UCS_ERR_REJECTED:
      name = "UCS_ERR_REJECTED";
      break;
    case UCS_ERR_TIMED_OUT:
      name = "UCS_ERR_TIMED_OUT";
      break;
    default:
      break;
  }
  if (name) return fmt::format("{} ({})", ucs_status_string(status), name);
  return fmt::format("{} (ucs_status {})", ucs_status_string(status), static_cast<int>(status));
}

namespace detail {

// One endpoint of a worker. Contexts point at it (slots); it lives in Worker::eps
// until it is closed and no context uses it.
struct Endpoint {
  Worker* worker = nullptr;
  std::string identity;  // of the peer's worker: "host:pid:nonce"
  ucp_ep_h ep = nullptr;
  ucs_status_t status = UCS_OK;
  bool closed = false;
  UcxContext* owner = nullptr;  // the newest context using it: its listeners hear errors
  int rank = -1;                // the peer's rank in owner
  int users = 0;                // contexts pointing at it
  // Unpacked on ep, by context; destroyed before ep is closed (UCX requires it).
  std::vector<std::pair<const UcxContext*, ucp_rkey_h>> rkeys;
  bool live() const { return ep && status == UCS_OK && !closed; }
};

// The UCP context and worker with its endpoints: one per UcxContext, or one per Fabric
// shared by the contexts of successive epochs.
struct Worker {
  std::recursive_mutex mutex;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int efd = -1;
  int rank = -1;         // for messages: the rank of the context that created it
  std::string identity;  // "host:pid:nonce", unique per worker
  std::string tls;
  std::list<Endpoint> eps;
  std::vector<void*> close_requests;  // outstanding ucp_ep_close_nbx requests
  // Client-server connections (see "Connecting" in ucx_context.h).
  uint64_t client_id = 0;  // sent when this worker connects as client: its identity's nonce
  ucp_listener_h listener = nullptr;
  std::string listen;         // "ip:port" of the listener
  bool listen_tried = false;  // a listener that failed is not tried again
  std::string no_listener;    // why this worker cannot listen ("": it may try)
  struct ConnRequest {
    ucp_conn_request_h request;
    uint64_t client_id;
    std::string from;  // the client's ip:port, for messages
  };
  std::vector<ConnRequest> conn_requests;  // arrived in progress(), not yet accepted

  ~Worker() {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    teardown();
  }
  void init(int rank);
  void teardown();
  bool progress();
  bool arm();
  void closeEndpoint(Endpoint& e, bool force);
  void closeAllBounded();
  bool startListener();
  static void onConnRequest(ucp_conn_request_h request, void* arg);
  // Takes the newest request carrying `id` off the queue, rejecting older ones with it.
  ucp_conn_request_h takeConnRequest(uint64_t id);
  bool hasConnRequest(uint64_t id) const;
  void rejectConnRequests(std::string_view why);
};

void Worker::init(int my_rank) {
  rank = my_rank;
  std::random_device rd;
  client_id = (uint64_t{rd()} << 32) | rd();
  identity = fmt::format("{}:{}:{:x}", hostName(), getpid(), client_id);
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) throwUcx(rank, "ucx setup: ucp_config_read", st);
  tls = env::getString("CROSSBAR_UCX_TLS");
  if (!tls.empty()) {
    // Explicit crossbar setting: overrides UCX_TLS for this context only.
    st = ucp_config_modify(config, "TLS", tls.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      throw InvalidArgument(fmt::format("{}CROSSBAR_UCX_TLS={} is not a valid UCX_TLS value: {}",
                                        errorContext(rank, "ucx setup"), tls, statusText(st)));
    }
  }
  // UCX warns about every UCX_* variable its context did not use; in a process
  // where other libraries (NCCL, MPI) also read UCX_* that is noise.
  setDefault(config, "WARN_UNUSED_ENV_VARS", "n");
  setDefault(config, "KEEPALIVE_INTERVAL", kKeepaliveInterval);
  // UCX 1.13 sometimes deadlocks inside ucp_init while installing its mmap hooks
  // (ucm_event_enter_exclusive waits on a rwlock forever; seen here in about 1 of
  // 15 forked ranks). Those hooks only serve the registration and memory-type
  // caches, which host memory over tcp/shm does not need: turn both off.
  setDefault(config, "RCACHE_ENABLE", "n");
  setDefault(config, "MEMTYPE_CACHE", "n");
  // Finish each endpoint's wireup inside the setup handshake (UCX 1.13 defaults to off:
  // the REQUEST/REPLY exchange then happens at the first rendezvous or RMA use, in the
  // middle of a run). A peer's late wireup REQUEST makes this worker queue a REPLY on
  // the plain tcp endpoint, behind data if its socket is full; when a failure then
  // closes that endpoint (or the worker is destroyed), UCX 1.13 purges the queued
  // REPLY into ucp_request_send_state_ff, whose assertion ("got REP message", removed
  // upstream in openucx/ucx#8175) aborts this survivor. Resolved at creation, every
  // REPLY is delivered before handshake() returns (see there) and none comes later.
  setDefault(config, "RESOLVE_REMOTE_EP_ID", "on");
  // TCP send segment 64 KiB (UCX 1.13: 8 KiB; the receive segment is already 64 KiB). The
  // segment bounds UCX's eager-short size over tcp (8185 -> 65529 B; rendezvous from 20553 ->
  // 90763 B, `ucx_info -e -u te`), so a 32 KiB message goes in one sendmsg without a rendezvous
  // round trip. Costs at most one more 56 KiB buffer per endpoint with a send in flight (64
  // peers: 4 MiB). Measured 2026-12-01, load 5-12, 4 ranks on 2 cores (docs/performance.md):
  // with CROSSBAR_MOE_NET_MESSAGE_BYTES=32768 (its default now) MoE dispatch CPU -25% (bf16
  // 40.1 -> 30.1 ms, fp8 25.7 -> 19.9 ms); UCX-only sendrecv/alltoall/all_reduce 32-128 KiB up
  // to 2x faster, <= 8 KiB and >= 512 KiB unchanged within noise.
  // ucp_config_modify hands unknown names to each transport's table without its prefix
  // (1.13 rejected "TCP_TX_SEG_SIZE": "invalid configuration"), so the user's variable is
  // checked by its full name; no other transport has a TX_SEG_SIZE.
  setDefault(config, "TX_SEG_SIZE", "64K", "UCX_TCP_TX_SEG_SIZE");
  // UCX 1.13 aborts inside ucp_listener_create (ucp_listener.c:253, "status != UCS_OK")
  // when no connection manager is enabled instead of failing. Without rdma devices only
  // the tcp one opens, so a listener is tried only where the list has tcp.
  if (std::string cms = configValue(config, "SOCKADDR_TLS_PRIORITY"); !cms.empty()) {
    std::istringstream list(cms);
    bool tcp = false;
    for (std::string name; std::getline(list, name, ',');) tcp = tcp || name == "tcp";
    if (!tcp)
      no_listener = fmt::format("UCX_SOCKADDR_TLS_PRIORITY={} enables no tcp connection manager", cms);
  }

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  params.name = "crossbar";
  st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (st != UCS_OK)
    throwUcx(rank,
             fmt::format("ucx setup: ucp_init (transports asked: {})", tls.empty() ? "UCX default" : tls),
             st);

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_CLIENT_ID;
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // mutex serializes every caller
  wparams.client_id = client_id;
  st = ucp_worker_create(context, &wparams, &worker);
  if (st != UCS_OK) {
    teardown();
    throwUcx(rank, "ucx setup: ucp_worker_create", st);
  }
  st = ucp_worker_get_efd(worker, &efd);
  if (st != UCS_OK) {
    teardown();
    throwUcx(rank, "ucx setup: ucp_worker_get_efd", st);
  }
}

void Worker::teardown() {
  if (worker) {
    if (listener) {
      rejectConnRequests("the worker is closing");
      ucp_listener_destroy(listener);  // before the worker, as UCX requires
      listener = nullptr;
      listen.clear();
    }
    closeAllBounded();
    ucp_worker_destroy(worker);
    worker = nullptr;
  }
  if (context) {
    ucp_cleanup(context);
    context = nullptr;
  }
}

bool Worker::progress() {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  if (!worker) return false;
  bool moved = false;
  for (int i = 0; i < 64 && ucp_worker_progress(worker) != 0; ++i) moved = true;
  // UCX wants a failed endpoint force-closed; not from inside its error callback.
  for (Endpoint& e : eps)
    if (e.status != UCS_OK && e.ep) closeEndpoint(e, true);
  std::erase_if(close_requests, [](void* req) {
    if (ucp_request_check_status(req) == UCS_INPROGRESS) return false;
    ucp_request_free(req);
    return true;
  });
  return moved;
}

bool Worker::arm() {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  if (!worker) return true;
  ucs_status_t st = ucp_worker_arm(worker);
  if (st == UCS_OK) return true;
  if (st != UCS_ERR_BUSY) CB_WARN("ucx", "ucp_worker_arm failed: {}", statusText(st));
  return false;
}

void Worker::closeEndpoint(Endpoint& e, bool force) {
  if (!e.ep) {
    e.closed = true;  // one still waiting for its client's request: never accepted now
    return;
  }
  // UCX: an rkey must go before the endpoint it was unpacked on (see unpackRkey).
  for (auto& [ctx, rkey] : e.rkeys) ucp_rkey_destroy(rkey);
  e.rkeys.clear();
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* req = ucp_ep_close_nbx(e.ep, &p);
  e.ep = nullptr;
  e.closed = true;
  if (UCS_PTR_IS_PTR(req)) {
    close_requests.push_back(req);
  } else if (UCS_PTR_STATUS(req) != UCS_OK) {
    CB_TRACE("ucx", "closing endpoint to {}: {}", e.identity, statusText(UCS_PTR_STATUS(req)));
  }
}

void Worker::closeAllBounded() {
  for (Endpoint& e : eps) closeEndpoint(e, e.status != UCS_OK);
  auto deadline = Deadline::after(kCloseTimeout);
  while (!close_requests.empty() && !deadline.expired()) {
    if (progress()) continue;
    if (close_requests.empty()) break;
    if (arm()) {
      pollfd pfd{efd, POLLIN, 0};
      ::poll(&pfd, 1, 10);
    }
  }
  if (!close_requests.empty()) {
    CB_INFO("ucx", "{} endpoint close(s) did not finish within {} ms; destroying the worker anyway",
            close_requests.size(), kCloseTimeout.count());
    for (void* req : close_requests) ucp_request_free(req);
    close_requests.clear();
  }
}

bool Worker::startListener() {
  if (listener) return true;
  if (listen_tried) return false;
  if (!no_listener.empty()) {
    listen_tried = true;
    CB_INFO("ucx", "not listening for UCX connections: {}; new endpoints are wired up by worker address",
            no_listener);
    return false;
  }
  std::string source;
  const std::string ip = listenAddress(rank, &source);  // throws on a bad CROSSBAR_UCX_LISTEN_ADDR
  listen_tried = true;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, ip.c_str(), &sa.sin_addr);
  sa.sin_port = 0;  // any free port; published in the record
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
  lp.sockaddr.addrlen = sizeof(sa);
  lp.conn_handler.cb = &Worker::onConnRequest;
  lp.conn_handler.arg = this;
  ucs_status_t st = ucp_listener_create(worker, &lp, &listener);
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (st == UCS_OK) {
    st = ucp_listener_query(listener, &attr);
    if (st != UCS_OK) {
      ucp_listener_destroy(listener);
      listener = nullptr;
    }
  }
  if (st != UCS_OK) {
    listener = nullptr;
    CB_INFO(
        "ucx",
        "cannot listen on {} ({}): {}; this worker's new endpoints are wired up by worker address instead of "
        "client-server (set CROSSBAR_UCX_LISTEN_ADDR to an address UCX's tcp connection manager can use, "
        "or CROSSBAR_UCX_CONNECT=address to silence this)",
        ip, source, statusText(st));
    return false;
  }
  listen = fmt::format("{}:{}", ip, ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port));
  CB_INFO("ucx", "listening for UCX connections on {} ({})", listen, source);
  return true;
}

void Worker::onConnRequest(ucp_conn_request_h request, void* arg) {
  // Inside ucp_worker_progress (mutex held): queue it; a context matches it by client id.
  auto* w = static_cast<Worker*>(arg);
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID | UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  ConnRequest cr{request, 0, "?"};
  if (ucp_conn_request_query(request, &attr) == UCS_OK) {
    cr.client_id = attr.client_id;
    if (attr.client_address.ss_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(&attr.client_address);
      char text[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
      cr.from = fmt::format("{}:{}", text, ntohs(in->sin_port));
    }
  }
  CB_TRACE("ucx", "connection request from {} (client id {:x})", cr.from, cr.client_id);
  w->conn_requests.push_back(cr);
}

ucp_conn_request_h Worker::takeConnRequest(uint64_t id) {
  ucp_conn_request_h newest = nullptr;
  for (auto it = conn_requests.rbegin(); it != conn_requests.rend(); ++it) {
    if (it->client_id != id) continue;
    if (!newest) {
      newest = it->request;
      continue;
    }
    // The same client connected before: an attempt of an earlier context's setup.
    CB_INFO("ucx", "rejecting an older connection request from {} (client id {:x})", it->from, id);
    ucp_listener_reject(listener, it->request);
  }
  std::erase_if(conn_requests, [id](const ConnRequest& cr) { return cr.client_id == id; });
  return newest;
}

bool Worker::hasConnRequest(uint64_t id) const {
  return std::any_of(conn_requests.begin(), conn_requests.end(),
                     [id](const ConnRequest& cr) { return cr.client_id == id; });
}

void Worker::rejectConnRequests(std::string_view why) {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  for (const ConnRequest& cr : conn_requests) {
    CB_INFO("ucx", "rejecting a connection request from {} (client id {:x}): {}", cr.from, cr.client_id, why);
    ucp_listener_reject(listener, cr.request);
  }
  conn_requests.clear();
}

}  // namespace detail

uint32_t wireBlock(int size) {
  uint32_t b = 1;
  while (b < static_cast<uint32_t>(size)) b <<= 1;
  return b;
}

uint32_t agreeWireBase(Fabric& fabric, Store& store, int rank, int size, Deadline deadline) {
  store.set(fmt::format("ucxwire/{}", rank), toBytes(std::to_string(fabric.wireNext())));
  uint32_t next = 0;
  for (int r = 0; r < size; ++r)
    next = std::max<uint32_t>(
        next, static_cast<uint32_t>(std::stoul(toString(store.get(fmt::format("ucxwire/{}", r), deadline)))));
  const uint32_t block = wireBlock(size);
  uint32_t base = (next + block - 1) / block * block;
  if (base + block > kWireIds) {
    CB_INFO("comm", "UCX wire ids exhausted after {} of {}: starting a fresh UCX worker", next, kWireIds);
    fabric.reset();
    base = 0;
  }
  fabric.setWireNext(base + block);
  return base;
}

Fabric::Fabric() = default;
Fabric::~Fabric() = default;  // the worker goes with its last user

void Fabric::reset() {
  worker_.reset();
  wire_next_ = 0;
}

size_t Fabric::openEndpoints() const {
  if (!worker_) return 0;
  std::lock_guard<std::recursive_mutex> lock(worker_->mutex);
  return static_cast<size_t>(std::count_if(worker_->eps.begin(), worker_->eps.end(),
                                           [](const detail::Endpoint& e) { return e.live(); }));
}

UcxContext::UcxContext(const TransportSetup& setup, const std::string& prefix)
    : rank_(setup.rank), size_(setup.size), peers_(setup.peers), kept_(setup.ucx_fabric != nullptr) {
  if (size_ > kMaxRanks)
    throw InvalidArgument(fmt::format("{}the UCX transport supports at most {} ranks, got {}",
                                      errorContext(rank_, "ucx setup"), kMaxRanks, size_));
  wire_base_ = setup.ucx_wire_base;
  wire_block_ = ucx::wireBlock(size_);
  if (wire_base_ % wire_block_ != 0 || wire_base_ + wire_block_ > kWireIds)
    throw InvalidArgument(fmt::format("{}UCX wire ids {}+{} are not an aligned block below {}",
                                      errorContext(rank_, "ucx setup"), wire_base_, wire_block_, kWireIds));
  infos_.resize(size_);
  slots_.assign(size_, nullptr);
  infos_[rank_] = PeerInfo{hostName(), static_cast<int>(getpid())};
  for (int p : peers_) {
    if (p < 0 || p >= size_ || p == rank_)
      throw InvalidArgument(fmt::format("{}peer {} is not a valid peer in a context of {} ranks",
                                        errorContext(rank_, "ucx setup"), p, size_));
  }
  if (kept_) {
    if (!setup.ucx_fabric->worker_) setup.ucx_fabric->worker_ = std::make_shared<detail::Worker>();
    w_ = setup.ucx_fabric->worker_;
  } else {
    w_ = std::make_shared<detail::Worker>();
  }
  try {
    {
      std::lock_guard<std::recursive_mutex> lock(w_->mutex);
      if (!w_->worker) w_->init(rank_);
    }
    connect(setup, prefix);
    handshake(setup.deadline);
    // Connection requests nobody claimed are no client of this setup's (those all
    // connected): a stale attempt, or a stranger.
    if (w_->listener) w_->rejectConnRequests("no peer of this context connects with that id");
  } catch (...) {
    if (w_->listener) w_->rejectConnRequests("this context's setup failed");
    detach(/*failed=*/true);
    throw;
  }
  if (log::enabled(log::Level::kTrace)) {
    // Which UCX transports carry each peer's traffic (lanes, protocols, thresholds).
    std::lock_guard<std::recursive_mutex> lock(w_->mutex);
    for (int p : peers_) {
      char* text = nullptr;
      size_t length = 0;
      if (!ep(p)) continue;
      if (FILE* f = open_memstream(&text, &length)) {
        ucp_ep_print_info(ep(p), f);
        std::fclose(f);
        CB_TRACE("ucx", "endpoint to {}:\n{}", describePeer(p), std::string(text, length));
        std::free(text);
      }
    }
  }
  CB_INFO(
      "ucx",
      "connected to {} peers ({} endpoints kept from the previous epoch, {} connected client-server; TLS {}; "
      "wire ids {}+{})",
      peers_.size(), reused_.size(), client_server_.size(), w_->tls.empty() ? "UCX default" : w_->tls,
      wire_base_, wire_block_);
}

UcxContext::~UcxContext() {
  detach(/*failed=*/false);
}

void UcxContext::detach(bool failed) {
  std::lock_guard<std::recursive_mutex> lock(w_->mutex);
  for (int p = 0; p < size_; ++p) {
    detail::Endpoint* e = slots_[p];
    if (!e) continue;
    std::erase_if(e->rkeys, [this](const auto& k) {
      if (k.first != this) return false;
      ucp_rkey_destroy(k.second);
      return true;
    });
    if (e->owner == this) e->owner = nullptr;
    --e->users;
    // A setup that failed leaves no half-wired endpoint behind; the kept ones stay.
    if (failed && kept_ && std::find(fresh_.begin(), fresh_.end(), p) != fresh_.end())
      w_->closeEndpoint(*e, true);
  }
  slots_.assign(size_, nullptr);
  if (!kept_) w_->teardown();  // closes every endpoint (bounded), then the worker
  std::erase_if(w_->eps, [](const detail::Endpoint& e) { return e.closed && e.users == 0; });
}

ucp_context_h UcxContext::context() const {
  return w_->context;
}
ucp_worker_h UcxContext::worker() const {
  return w_->worker;
}
std::recursive_mutex& UcxContext::mutex() {
  return w_->mutex;
}

detail::Endpoint* UcxContext::slot(int peer) const {
  if (peer < 0 || peer >= size_) return nullptr;
  return slots_[peer];
}

bool UcxContext::isPeer(int rank) const {
  return rank >= 0 && rank < size_ && std::find(peers_.begin(), peers_.end(), rank) != peers_.end();
}

ucp_ep_h UcxContext::ep(int peer) const {
  detail::Endpoint* e = slot(peer);
  return e ? e->ep : nullptr;
}

ucs_status_t UcxContext::peerStatus(int peer) const {
  detail::Endpoint* e = slot(peer);
  return e ? e->status : UCS_OK;
}

uint64_t UcxContext::anySourceMask() const {
  const uint64_t block_bits = uint64_t(~(wire_block_ - 1) & (kWireIds - 1)) << 48;
  return kMaxTransportTag | kHandshakeTagBit | block_bits;
}

int UcxContext::rankOfTag(uint64_t ucp_tag) const {
  const uint32_t wire = static_cast<uint32_t>((ucp_tag >> 48) & (kWireIds - 1));
  if (wire < wire_base_ || wire - wire_base_ >= static_cast<uint32_t>(size_)) return -1;
  return static_cast<int>(wire - wire_base_);
}

std::string UcxContext::describePeer(int peer) const {
  if (peer < 0 || peer >= size_) return fmt::format("rank {}", peer);
  const PeerInfo& info = infos_[peer];
  if (info.host.empty()) return fmt::format("rank {}", peer);
  return fmt::format("rank {} (host {}, pid {})", peer, info.host, info.pid);
}

void UcxContext::connect(const TransportSetup& setup, const std::string& prefix) {
  detail::Record mine;
  mine.info = infos_[rank_];
  client_ids_.assign(size_, 0);
  listens_.assign(size_, {});
  std::vector<detail::Endpoint*> published;  // endpoints this record offers to keep
  {
    std::lock_guard<std::recursive_mutex> lock(w_->mutex);
    ucp_address_t* address = nullptr;
    size_t length = 0;
    ucs_status_t st = ucp_worker_get_address(w_->worker, &address, &length);
    if (st != UCS_OK) throwUcx(rank_, "ucx setup: ucp_worker_get_address", st);
    auto* a = reinterpret_cast<const uint8_t*>(address);
    mine.address.assign(a, a + length);
    ucp_worker_release_address(w_->worker, address);
    mine.identity = w_->identity;
    if (kept_) {
      w_->progress();  // endpoint errors that came in between epochs
      for (detail::Endpoint& e : w_->eps) {
        if (!e.live()) continue;
        ++e.users;  // pinned until the claims below: another epoch's context may detach meanwhile
        published.push_back(&e);
        mine.live.push_back(e.identity);
      }
    }
    if (detail::wantListener(kept_) && !peers_.empty() && w_->startListener()) {
      mine.listen = w_->listen;
      // Requests that came before this record exist were meant for an earlier context.
      w_->progress();
      w_->rejectConnRequests("it came before this context published its listener");
    }
    mine.client_id = w_->client_id;
  }
  struct Unpin {
    detail::Worker& w;
    std::vector<detail::Endpoint*>& eps;
    ~Unpin() {
      std::lock_guard<std::recursive_mutex> lock(w.mutex);
      for (detail::Endpoint* e : eps) --e->users;
    }
  } unpin{*w_, published};
  setup.store->set(fmt::format("{}/{}", prefix, rank_), encodeRecord(mine));

  std::vector<std::string> keys;
  for (int p : peers_) keys.push_back(fmt::format("{}/{}", prefix, p));
  try {
    setup.store->wait(keys, setup.deadline);
  } catch (const Timeout&) {
    std::vector<int> missing;
    for (int p : peers_)
      if (!setup.store->check({fmt::format("{}/{}", prefix, p)})) missing.push_back(p);
    throw Timeout(fmt::format("{}{} never published a UCX address before the setup deadline. Check that "
                              "every rank creates the communicator, and raise CROSSBAR_CONNECT_TIMEOUT "
                              "if they are only slow to start",
                              errorContext(rank_, "ucx setup"), formatPeers(missing)),
                  missing);
  }

  std::vector<detail::Record> records;
  for (size_t i = 0; i < peers_.size(); ++i)
    records.push_back(detail::decodeRecord(setup.store->get(keys[i], setup.deadline), rank_, peers_[i]));

  std::lock_guard<std::recursive_mutex> lock(w_->mutex);
  auto claim = [&](detail::Endpoint* e, int p) {
    e->owner = this;
    e->rank = p;
    ++e->users;
    slots_[p] = e;
  };
  for (size_t i = 0; i < peers_.size(); ++i) {
    const int p = peers_[i];
    const detail::Record& r = records[i];
    infos_[p] = r.info;
    // Kept only when both sides offered it (both decide from the same two records):
    // otherwise both make a new one, and the side that still had one closes it.
    detail::Endpoint* old = nullptr;
    for (detail::Endpoint* e : published)
      if (e->identity == r.identity) old = e;
    const bool theirs = std::find(r.live.begin(), r.live.end(), w_->identity) != r.live.end();
    if (old && theirs) {
      claim(old, p);  // may have failed since: handshake() reports it
      reused_.push_back(p);
      continue;
    }
    if (old) w_->closeEndpoint(*old, true);
    detail::Endpoint& e = w_->eps.emplace_back();
    e.worker = w_.get();
    e.identity = r.identity;
    claim(&e, p);
    fresh_.push_back(p);
    const bool client_server = detail::clientServer(mine, r);
    if (client_server) {
      client_server_.push_back(p);
      client_ids_[p] = r.client_id;
      listens_[p] = r.listen;
      if (rank_ > p) continue;  // p connects to our listener; handshake() accepts it
    }
    createEndpoint(e, p, r, client_server);
  }
  if (kept_) {
    // Endpoints to processes not in this epoch (excluded, dead) that no context uses
    // (the pins above still count: one pinned and unclaimed has users == 1).
    for (detail::Endpoint& e : w_->eps) {
      const bool pinned = std::find(published.begin(), published.end(), &e) != published.end();
      if (e.ep && e.users == (pinned ? 1 : 0)) w_->closeEndpoint(e, true);
    }
  }
}

// The lower rank of a client-server pair (or either side of an address pair) makes its
// endpoint to `peer` here.
void UcxContext::createEndpoint(detail::Endpoint& e, int peer, const detail::Record& r, bool client_server) {
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep_params.err_handler.cb = &UcxContext::onEndpointError;
  ep_params.err_handler.arg = &e;
  sockaddr_in sa{};
  if (client_server) {
    parseListen(r.listen, &sa);  // checked by decodeRecord
    ep_params.field_mask |= UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_FLAGS;
    ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER | UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID;
    ep_params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    ep_params.sockaddr.addrlen = sizeof(sa);
  } else {
    ep_params.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(r.address.data());
  }
  ucs_status_t st = ucp_ep_create(w_->worker, &ep_params, &e.ep);
  if (st != UCS_OK) {
    e.ep = nullptr;
    e.closed = true;
    throw UcxError(fmt::format("{}cannot create a UCX endpoint to {}{}: {}. Check that the hosts can reach "
                               "each other over the transports in UCX_TLS / CROSSBAR_UCX_TLS{}",
                               errorContext(rank_, "ucx setup"), describePeer(peer),
                               client_server ? fmt::format(" (its listener {})", r.listen) : "",
                               statusText(st), client_server ? " (or set CROSSBAR_UCX_CONNECT=address)" : ""),
                   {peer});
  }
}

// The higher rank of a client-server pair: accepts `peer`'s connection request, if it
// came. True when the endpoint was made.
bool UcxContext::accept(int peer) {
  ucp_conn_request_h request = w_->takeConnRequest(client_ids_[peer]);
  if (!request) return false;
  detail::Endpoint& e = *slots_[peer];
  ucp_ep_params_t ep_params{};
  ep_params.field_mask =
      UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep_params.conn_request = request;
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep_params.err_handler.cb = &UcxContext::onEndpointError;
  ep_params.err_handler.arg = &e;
  ucs_status_t st = ucp_ep_create(w_->worker, &ep_params, &e.ep);
  if (st != UCS_OK) {
    e.ep = nullptr;
    e.closed = true;
    throw PeerFailure(fmt::format("{}cannot accept the UCX connection of {}: {}. The peer may have exited",
                                  errorContext(rank_, "ucx setup"), describePeer(peer), statusText(st)),
                      {peer});
  }
  return true;
}

void UcxContext::handshake(Deadline deadline) {
  // 0-byte message each way with every peer wired up now: proves both directions work
  // before setup returns, and finishes UCX's wireup while every peer is progressing.
  // Kept endpoints need none (no wireup; messages of this epoch carry new wire ids).
  // The server of a client-server pair sends once it accepted its client's request.
  std::deque<HandshakeOp> ops;  // stable addresses: requests point at them until release()
  std::vector<HandshakeOp*> recv_op(fresh_.size()), send_op(fresh_.size(), nullptr);
  std::vector<void*> requests;
  std::unique_lock<std::recursive_mutex> lock(w_->mutex);  // not held while sleeping
  auto release = [&] {
    if (!lock.owns_lock()) lock.lock();
    for (void* req : requests) {
      if (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_request_cancel(w_->worker, req);
      ucp_request_free(req);
    }
    requests.clear();
  };
  auto failed = [&](int p, ucs_status_t st) {
    const bool client = !listens_[p].empty() && rank_ < p;
    return PeerFailure(
        fmt::format("{}connecting to {}{} failed: {}. The peer may have exited or be "
                    "unreachable over UCX_TLS / CROSSBAR_UCX_TLS{}",
                    errorContext(rank_, "ucx setup"), describePeer(p),
                    client ? fmt::format(" (its listener {})", listens_[p]) : "", statusText(st),
                    client ? "; if that address is not reachable from here, set "
                             "CROSSBAR_UCX_LISTEN_ADDR on that rank (or CROSSBAR_UCX_CONNECT=address)"
                           : ""),
        {p});
  };
  auto post = [&](size_t i, bool send) {
    const int p = fresh_[i];
    HandshakeOp* op = &ops.emplace_back();
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.user_data = op;
    void* r = nullptr;
    if (send) {
      rp.cb.send = handshakeSent;
      r = ucp_tag_send_nbx(slots_[p]->ep, nullptr, 0, kHandshakeTagBit | wireTag(rank_), &rp);
      send_op[i] = op;
    } else {
      rp.cb.recv = handshakeReceived;
      r = ucp_tag_recv_nbx(w_->worker, nullptr, 0, kHandshakeTagBit | wireTag(p), ~uint64_t{0}, &rp);
      recv_op[i] = op;
    }
    if (UCS_PTR_IS_PTR(r))
      requests.push_back(r);
    else
      *op = HandshakeOp{true, UCS_PTR_STATUS(r)};
  };
  try {
    for (size_t i = 0; i < fresh_.size(); ++i) {
      post(i, /*send=*/false);
      if (slots_[fresh_[i]]->ep) post(i, /*send=*/true);
    }
    while (true) {
      // A kept endpoint whose peer failed since the previous epoch (or now).
      for (int p : reused_)
        if (slots_[p]->status != UCS_OK || !slots_[p]->ep)
          throw failed(p, slots_[p]->status != UCS_OK ? slots_[p]->status : UCS_ERR_CONNECTION_RESET);
      std::vector<int> pending;
      for (size_t i = 0; i < fresh_.size(); ++i) {
        const int p = fresh_[i];
        detail::Endpoint* e = slots_[p];
        if (!send_op[i]) {  // the server, waiting for p's connection request
          if (e->closed) throw failed(p, UCS_ERR_CANCELED);
          if (accept(p)) post(i, /*send=*/true);
        } else if (e->status != UCS_OK && !listens_[p].empty() && rank_ > p && !recv_op[i]->done &&
                   w_->hasConnRequest(client_ids_[p])) {
          // The accepted request was a stale one of p's (an earlier setup's attempt that
          // arrived late) and its current one is here: take that instead.
          CB_INFO("ucx", "the connection accepted from {} failed ({}) and a newer one came: using that",
                  describePeer(p), statusText(e->status));
          w_->closeEndpoint(*e, true);
          --e->users;
          if (e->owner == this) e->owner = nullptr;
          detail::Endpoint& renewed = w_->eps.emplace_back();
          renewed.worker = w_.get();
          renewed.identity = e->identity;
          renewed.owner = this;
          renewed.rank = p;
          renewed.users = 1;
          slots_[p] = e = &renewed;
          if (accept(p)) post(i, /*send=*/true);
        }
        const bool both = recv_op[i]->done && send_op[i] && send_op[i]->done;
        // A peer that finished its side may already have closed: that is no failure.
        ucs_status_t bad = both ? UCS_OK : e->status;
        for (HandshakeOp* op : {recv_op[i], send_op[i]})
          if (op && op->done && op->status != UCS_OK) bad = op->status;
        if (bad != UCS_OK) throw failed(p, bad);
        if (!both) pending.push_back(p);
      }
      // Also with nothing to wait for: the point where a member of a new FT epoch that
      // died is noticed, and where the test hook (CROSSBAR_FT_TEST_EXIT_AT) fires.
      interruptionPoint("ucx handshake");  // comm/interrupt.h
      if (pending.empty()) break;
      if (w_->progress()) continue;
      if (deadline.expired()) {
        std::vector<std::string> hosts;
        std::vector<int> unconnected;  // servers' clients that never connected
        for (int p : pending) {
          hosts.push_back(infos_[p].host);
          if (!slots_[p]->ep) unconnected.push_back(p);
        }
        throw Timeout(
            fmt::format("{}no UCX handshake from {} before the setup deadline{}. Those ranks "
                        "published an address but did not connect back: they may be hung, or "
                        "the network between the hosts may block UCX (check UCX_TLS)",
                        errorContext(rank_, "ucx setup"), formatPeers(pending, hosts),
                        unconnected.empty() ? std::string()
                                            : fmt::format(" ({} never connected to this rank's listener {})",
                                                          formatPeers(unconnected), w_->listen)),
            pending);
      }
      if (w_->arm()) {
        lock.unlock();
        pollfd pfd{w_->efd, POLLIN, 0};
        ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(deadline.remaining().count(), 50)));
        lock.lock();
      }
    }
  } catch (...) {
    release();
    throw;
  }
  release();
}

void UcxContext::onEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* e = static_cast<detail::Endpoint*>(arg);
  if (e->status != UCS_OK) return;
  e->status = status;
  UcxContext* owner = e->owner;
  if (!owner) {
    CB_INFO("ucx", "endpoint to {} (no epoch uses it) failed: {}", e->identity, statusText(status));
    return;
  }
  CB_INFO("ucx", "endpoint to {} failed: {}", owner->describePeer(e->rank), statusText(status));
  auto listeners = owner->listeners_;  // a listener may remove itself
  for (auto& [id, fn] : listeners) fn(e->rank, status);
}

int UcxContext::addErrorListener(ErrorListener listener) {
  std::lock_guard<std::recursive_mutex> lock(w_->mutex);
  listeners_.emplace_back(next_listener_, std::move(listener));
  return next_listener_++;
}

void UcxContext::removeErrorListener(int id) {
  std::lock_guard<std::recursive_mutex> lock(w_->mutex);
  std::erase_if(listeners_, [id](const auto& l) { return l.first == id; });
}

bool UcxContext::progress() {
  return w_->progress();
}

bool UcxContext::arm() {
  return w_->arm();
}

int UcxContext::efd() const {
  return w_->efd;
}

ucp_rkey_h UcxContext::unpackRkey(int peer, const void* packed, const std::string& op) {
  std::lock_guard<std::recursive_mutex> lock(w_->mutex);
  detail::Endpoint* e = slot(peer);
  ucp_ep_h endpoint = ep(peer);
  const ucs_status_t status = peerStatus(peer);
  if (!endpoint || status != UCS_OK)
    throw PeerFailure(
        fmt::format("{}no usable UCX endpoint to {} ({})", errorContext(rank_, op), describePeer(peer),
                    status != UCS_OK ? statusText(status) : "it was closed"),
        {peer});
  ucp_rkey_h rkey = nullptr;
  ucs_status_t st = ucp_ep_rkey_unpack(endpoint, packed, &rkey);
  if (st != UCS_OK)
    throw UcxError(fmt::format("{}ucp_ep_rkey_unpack for {}: {}", errorContext(rank_, op), describePeer(peer),
                               statusText(st)),
                   {peer});
  e->rkeys.emplace_back(this, rkey);
  return rkey;
}

void UcxContext::destroyRkey(int peer, ucp_rkey_h rkey) {
  std::lock_guard<std::recursive_mutex> lock(w_->mutex);
  detail::Endpoint* e = slot(peer);
  if (!e || !rkey) return;
  auto it = std::find_if(e->rkeys.begin(), e->rkeys.end(),
                         [&](const auto& k) { return k.first == this && k.second == rkey; });
  if (it == e->rkeys.end()) return;  // its endpoint was closed, which destroyed it
  ucp_rkey_h key = it->second;
  e->rkeys.erase(it);
  ucp_rkey_destroy(key);
}

void UcxContext::forceCloseAll() {
  std::lock_guard<std::recursive_mutex> lock(w_->mutex);
  for (int p = 0; p < size_; ++p) {
    detail::Endpoint* e = slots_[p];
    if (!e) continue;
    const bool rma =
        std::any_of(e->rkeys.begin(), e->rkeys.end(), [this](const auto& k) { return k.first == this; });
    if (!kept_ || rma) w_->closeEndpoint(*e, true);
  }
}

void UcxContext::forceClose(int peer) {
  std::lock_guard<std::recursive_mutex> lock(w_->mutex);
  if (detail::Endpoint* e = slot(peer)) w_->closeEndpoint(*e, true);
}

}  // namespace crossbar::ucx
