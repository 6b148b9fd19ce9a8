// ucx_wireup_trial: does a UCX survivor process abort when a peer is SIGKILLed in the
// middle of endpoint wireup?  Compares worker-address endpoints (crossbar's way)
// with UCX client-server (listener / sockaddr) connection establishment.
//
// One trial = 1 survivor (index 0) + N joiners (1..N), forked, on loopback.
// One joiner (the victim) SIGKILLs itself during connection establishment.
// The survivor must notice the failure and finish the handshake (+ a second
// message round) with the live joiners, then tear down cleanly.
//
// Modes:
//   A   both sides ucp_ep_create() with the peer's worker address (crossbar today)
//   B1  survivor listens; joiners connect as clients (sockaddr, CLIENT_SERVER)
//   B2  joiners listen; the survivor connects to each as client
//
// Kill model (the victim): with probability --hook-frac, "hook": right after its
// endpoint is created and both handshake messages are posted, before any progress
// (B1/B2: for the server side, right after ep create from the conn_request).
// Otherwise "delay": a thread of the victim waits until every process has
// published (address / port / ready), sleeps U[0, --max-delay-us] microseconds,
// then SIGKILLs the process.  The victim never exits on its own.
//
// Build: see Makefile.   Run: ./ucx_wireup_trial A 300   (see usage()).
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <sys/stat.h>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int kMaxProcs = 9;
constexpr size_t kAddrMax = 16384;
constexpr uint64_t kHs = 1ull << 63;  // handshake tag bit
constexpr uint64_t kR2 = 1ull << 62;  // second round tag bit

enum Mode { kA, kB1, kB2 };

struct Shared {
  std::atomic<int> ready[kMaxProcs];
  uint32_t addr_len[kMaxProcs];
  uint16_t port[kMaxProcs];
  uint8_t addr[kMaxProcs][kAddrMax];
  std::atomic<int> survivor_done;
  std::atomic<int> victim_dead;     // set by the parent after waitpid
  std::atomic<int64_t> kill_ns;     // CLOCK_MONOTONIC, written by the victim just before SIGKILL
  std::atomic<int64_t> detect_ns;   // survivor: first failure seen for the victim
  std::atomic<int> detect_how;      // 1 ep error cb, 2 request failed
  std::atomic<int> victim_phase;    // how far the victim got
  std::atomic<int> survivor_phase;
  std::atomic<int> accepted;        // B1: conn requests the survivor accepted
  std::atomic<int> conn_requests;
  std::atomic<int64_t> all_ready_ns;   // first time a process saw every process published
  std::atomic<int64_t> hs_done_ns[kMaxProcs];  // joiner: its handshake completed   // survivor (B1) / victim (B2): conn requests seen
};

Shared* g_sh = nullptr;
Mode g_mode = kA;
int g_n = 3;          // joiners
int g_victim = 1;
int g_self = 0;
bool g_hook = false;
int g_delay_us = 0;
double g_timeout_s = 10;

int64_t nowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void die(const char* what, ucs_status_t st) {
  fprintf(stderr, "[%d] %s: %s\n", g_self, what, ucs_status_string(st));
  _exit(4);
}

void killSelf() {
  g_sh->kill_ns.store(nowNs());
  ::kill(getpid(), SIGKILL);
}

bool allReady() {
  for (int i = 0; i <= g_n; ++i)
    if (!g_sh->ready[i].load()) return false;
  int64_t expect = 0;
  g_sh->all_ready_ns.compare_exchange_strong(expect, nowNs());
  return true;
}

void* killThread(void*) {
  while (!allReady()) usleep(20);
  // microsecond-granular sleep (nanosleep, not rounded to ms)
  timespec ts{g_delay_us / 1000000, (g_delay_us % 1000000) * 1000L};
  nanosleep(&ts, nullptr);
  killSelf();
  return nullptr;
}

struct Op {
  void* req = nullptr;
  bool posted = false, done = false;
  ucs_status_t status = UCS_OK;
  uint64_t payload = 0;
};

void opDone(void*, ucs_status_t status, void* user) {
  auto* op = static_cast<Op*>(user);
  op->done = true;
  op->status = status;
}
void opRecvDone(void* r, ucs_status_t status, const ucp_tag_recv_info_t*, void* user) {
  opDone(r, status, user);
}

struct Conn {
  int peer = -1;  // process index; -1 = unknown (B1 survivor: accepted ep)
  ucp_ep_h ep = nullptr;
  ucs_status_t status = UCS_OK;
  bool closed = false;
  int64_t err_ns = 0;
};

struct Proc {
  ucp_context_h ctx = nullptr;
  ucp_worker_h w = nullptr;
  ucp_listener_h listener = nullptr;
  int efd = -1;
  std::vector<Conn*> conns;
  std::vector<ucp_conn_request_h> pending_cr;
  std::vector<void*> close_reqs;
  std::vector<Op*> ops;
};
Proc P;

void epError(void* arg, ucp_ep_h, ucs_status_t st) {
  auto* c = static_cast<Conn*>(arg);
  if (c->status != UCS_OK) return;
  c->status = st;
  c->err_ns = nowNs();
}

void onConnRequest(ucp_conn_request_h cr, void*) {
  P.pending_cr.push_back(cr);
  if (g_self == 0) g_sh->conn_requests.fetch_add(1);
}

void setOpt(ucp_config_t* cfg, const char* name, const char* value) {
  std::string env = std::string("UCX_") + name;
  if (getenv(env.c_str())) return;
  ucs_status_t st = ucp_config_modify(cfg, name, value);
  if (st != UCS_OK) fprintf(stderr, "[%d] cannot set %s=%s: %s\n", g_self, name, value, ucs_status_string(st));
}

// Same configuration as crossbar's comm/ucx_context.cc (values, not code).
void initUcx() {
  ucp_config_t* cfg = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &cfg);
  if (st != UCS_OK) die("ucp_config_read", st);
  setOpt(cfg, "WARN_UNUSED_ENV_VARS", "n");
  setOpt(cfg, "KEEPALIVE_INTERVAL", "1s");
  setOpt(cfg, "RCACHE_ENABLE", "n");
  setOpt(cfg, "MEMTYPE_CACHE", "n");
  setOpt(cfg, "RESOLVE_REMOTE_EP_ID", "on");
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  p.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  p.mt_workers_shared = 0;
  st = ucp_init(&p, cfg, &P.ctx);
  ucp_config_release(cfg);
  if (st != UCS_OK) die("ucp_init", st);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  st = ucp_worker_create(P.ctx, &wp, &P.w);
  if (st != UCS_OK) die("ucp_worker_create", st);
  st = ucp_worker_get_efd(P.w, &P.efd);
  if (st != UCS_OK) die("ucp_worker_get_efd", st);
}

void publishAddress() {
  ucp_address_t* a = nullptr;
  size_t len = 0;
  ucs_status_t st = ucp_worker_get_address(P.w, &a, &len);
  if (st != UCS_OK) die("ucp_worker_get_address", st);
  if (len > kAddrMax) die("address too long", UCS_ERR_NO_MEMORY);
  memcpy(g_sh->addr[g_self], a, len);
  g_sh->addr_len[g_self] = static_cast<uint32_t>(len);
  ucp_worker_release_address(P.w, a);
  g_sh->ready[g_self].store(1);
}

void startListener() {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = 0;
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
  lp.sockaddr.addrlen = sizeof(sa);
  lp.conn_handler.cb = onConnRequest;
  lp.conn_handler.arg = nullptr;
  ucs_status_t st = ucp_listener_create(P.w, &lp, &P.listener);
  if (st != UCS_OK) die("ucp_listener_create", st);
  ucp_listener_attr_t la{};
  la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  st = ucp_listener_query(P.listener, &la);
  if (st != UCS_OK) die("ucp_listener_query", st);
  g_sh->port[g_self] = ntohs(reinterpret_cast<sockaddr_in*>(&la.sockaddr)->sin_port);
  g_sh->ready[g_self].store(1);
}

Conn* newConn(int peer) {
  auto* c = new Conn;
  c->peer = peer;
  P.conns.push_back(c);
  return c;
}

void createEp(Conn* c, const ucp_ep_params_t& base) {
  ucp_ep_params_t ep = base;
  ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = epError;
  ep.err_handler.arg = c;
  ucs_status_t st = ucp_ep_create(P.w, &ep, &c->ep);
  if (st != UCS_OK) {
    c->ep = nullptr;
    c->closed = true;
    c->status = st;
    c->err_ns = nowNs();
  }
}

void connectByAddress(Conn* c) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  ep.address = reinterpret_cast<const ucp_address_t*>(g_sh->addr[c->peer]);
  createEp(c, ep);
}

void connectBySockaddr(Conn* c) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = htons(g_sh->port[c->peer]);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_FLAGS;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
  ep.sockaddr.addrlen = sizeof(sa);
  createEp(c, ep);
}

void acceptConn(Conn* c, ucp_conn_request_h cr) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
  ep.conn_request = cr;
  createEp(c, ep);
}

Op* postRecv(uint64_t tag) {
  auto* op = new Op;
  P.ops.push_back(op);
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv = opRecvDone;
  rp.user_data = op;
  void* r = ucp_tag_recv_nbx(P.w, &op->payload, sizeof(op->payload), tag, ~uint64_t{0}, &rp);
  op->posted = true;
  if (UCS_PTR_IS_PTR(r)) op->req = r;
  else { op->done = true; op->status = UCS_PTR_STATUS(r); }
  return op;
}

Op* postSend(Conn* c, uint64_t tag, size_t len) {
  auto* op = new Op;
  P.ops.push_back(op);
  op->payload = 42;
  if (!c->ep) { op->done = true; op->status = UCS_ERR_CONNECTION_RESET; return op; }
  ucp_request_param_t sp{};
  sp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  sp.cb.send = opDone;
  sp.user_data = op;
  void* r = ucp_tag_send_nbx(c->ep, len ? &op->payload : nullptr, len, tag, &sp);
  op->posted = true;
  if (UCS_PTR_IS_PTR(r)) op->req = r;
  else { op->done = true; op->status = UCS_PTR_STATUS(r); }
  return op;
}

void closeConn(Conn* c, bool force) {
  if (!c->ep) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* r = ucp_ep_close_nbx(c->ep, &p);
  c->ep = nullptr;
  c->closed = true;
  if (UCS_PTR_IS_PTR(r)) P.close_reqs.push_back(r);
}

// Like crossbar's Worker::progress + the wait of its handshake loop.
void progressOnce(int poll_ms) {
  bool moved = false;
  for (int i = 0; i < 64 && ucp_worker_progress(P.w) != 0; ++i) moved = true;
  for (Conn* c : P.conns)
    if (c->status != UCS_OK && c->ep) closeConn(c, true);  // not from inside the callback
  P.close_reqs.erase(std::remove_if(P.close_reqs.begin(), P.close_reqs.end(), [](void* r) {
                       if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
                       ucp_request_free(r);
                       return true;
                     }), P.close_reqs.end());
  if (moved || poll_ms == 0) return;
  if (ucp_worker_arm(P.w) == UCS_OK) {
    pollfd pfd{P.efd, POLLIN, 0};
    ::poll(&pfd, 1, poll_ms);
  }
}

void releaseOp(Op* op) {
  if (op->req) {
    if (ucp_request_check_status(op->req) == UCS_INPROGRESS) ucp_request_cancel(P.w, op->req);
    ucp_request_free(op->req);
    op->req = nullptr;
  }
}

void teardown() {
  for (Op* op : P.ops) releaseOp(op);
  for (Conn* c : P.conns) closeConn(c, c->status != UCS_OK);
  int64_t until = nowNs() + 2000000000LL;
  while (!P.close_reqs.empty() && nowNs() < until) progressOnce(10);
  for (void* r : P.close_reqs) ucp_request_free(r);
  P.close_reqs.clear();
  if (P.listener) ucp_listener_destroy(P.listener);
  ucp_worker_destroy(P.w);
  ucp_cleanup(P.ctx);
}

bool expired(int64_t deadline) { return nowNs() > deadline; }

// ---------------------------------------------------------------- survivor
void noteDetect(int how) {
  int64_t expect = 0;
  if (g_sh->detect_ns.compare_exchange_strong(expect, nowNs())) g_sh->detect_how.store(how);
}

int runSurvivor() {
  g_sh->survivor_phase.store(1);
  initUcx();
  const int64_t deadline = nowNs() + int64_t(g_timeout_s * 0.9e9);
  if (g_mode == kB1) startListener();
  else if (g_mode == kA) publishAddress();
  else g_sh->ready[0].store(1);
  g_sh->survivor_phase.store(2);
  // Per-joiner state (A, B2: one conn per joiner).  B1: conns appear as accepted.
  std::vector<Conn*> conn(g_n + 1, nullptr);
  std::vector<Op*> hs_recv(g_n + 1), hs_send(g_n + 1), r2_recv(g_n + 1), r2_send(g_n + 1);
  for (int j = 1; j <= g_n; ++j) hs_recv[j] = postRecv(kHs | j);
  if (g_mode != kB1) {
    while (!allReady()) {
      if (expired(deadline)) return 5;
      usleep(50);
    }
    for (int j = 1; j <= g_n; ++j) {
      conn[j] = newConn(j);
      if (g_mode == kA) connectByAddress(conn[j]);
      else connectBySockaddr(conn[j]);
      hs_send[j] = postSend(conn[j], kHs | 0, 0);
    }
  }
  g_sh->survivor_phase.store(3);
  std::vector<std::pair<Conn*, Op*>> b1_sends;  // B1: handshake sends per accepted conn
  std::vector<std::pair<Conn*, Op*>> b1_r2;
  bool r2_started = false;
  int64_t victim_dead_seen = 0;
  auto failedJ = [&](int j) -> bool {  // A/B2: any failure for joiner j
    if (!conn[j]) return false;
    if (conn[j]->status != UCS_OK) return true;
    for (Op* op : {hs_recv[j], hs_send[j], r2_recv[j], r2_send[j]})
      if (op && op->done && op->status != UCS_OK) return true;
    return false;
  };
  while (true) {
    // B1: accept connection requests
    while (!P.pending_cr.empty()) {
      ucp_conn_request_h cr = P.pending_cr.back();
      P.pending_cr.pop_back();
      Conn* c = newConn(-1);
      acceptConn(c, cr);
      g_sh->accepted.fetch_add(1);
      b1_sends.push_back({c, postSend(c, kHs | 0, 0)});
      if (r2_started) b1_r2.push_back({c, postSend(c, kR2 | 0, 8)});
    }
    bool all_done = true;
    bool any_fail = false;
    int live_fail = 0;
    if (g_mode != kB1) {
      for (int j = 1; j <= g_n; ++j) {
        bool f = failedJ(j);
        if (f) {
          if (j == g_victim) any_fail = true;
          else live_fail++;
          for (Op* op : {hs_recv[j], hs_send[j], r2_recv[j], r2_send[j]})
            if (op) releaseOp(op);  // crossbar cancels what is outstanding
          continue;
        }
        bool hs = hs_recv[j]->done && hs_send[j]->done;
        if (hs && !r2_recv[j]) {  // second round on a wired endpoint
          r2_recv[j] = postRecv(kR2 | j);
          r2_send[j] = postSend(conn[j], kR2 | 0, 8);
        }
        bool r2 = r2_recv[j] && r2_recv[j]->done && r2_send[j]->done;
        if (!r2 && j != g_victim) all_done = false;
      }
    } else {
      // B1: which accepted conn is whose is not known; live joiners never fail
      // before survivor_done, so any failure is the victim's.
      for (auto& [c, op] : b1_sends)
        if (c->status != UCS_OK || (op->done && op->status != UCS_OK)) any_fail = true;
      for (auto& [c, op] : b1_r2)
        if (c->status != UCS_OK || (op->done && op->status != UCS_OK)) any_fail = true;
      for (int j = 1; j <= g_n; ++j) {
        if (hs_recv[j]->done && hs_recv[j]->status != UCS_OK) {
          if (j == g_victim) any_fail = true; else live_fail++;
        }
        if (j == g_victim) continue;
        if (!hs_recv[j]->done) all_done = false;
      }
      if (all_done && !r2_started) {
        r2_started = true;
        for (int j = 1; j <= g_n; ++j)
          if (j != g_victim) r2_recv[j] = postRecv(kR2 | j);
        for (auto& [c, op] : b1_sends)
          if (c->status == UCS_OK) b1_r2.push_back({c, postSend(c, kR2 | 0, 8)});
      }
      if (!r2_started) all_done = false;
      else
        for (int j = 1; j <= g_n; ++j)
          if (j != g_victim && !(r2_recv[j] && r2_recv[j]->done)) all_done = false;
    }
    if (any_fail) noteDetect(1);
    if (live_fail) { fprintf(stderr, "[0] a live joiner failed\n"); return 2; }
    if (g_sh->victim_dead.load() && !victim_dead_seen) victim_dead_seen = nowNs();
    if (all_done) {
      g_sh->survivor_phase.store(4);
      if (any_fail) break;
      // wait for the victim's death to be noticed (or 3 s after it died: "undetected")
      const bool victim_has_ep = g_mode != kB1 || g_sh->accepted.load() == g_n;
      if (victim_dead_seen && nowNs() - victim_dead_seen > (victim_has_ep ? 3000000000LL : 500000000LL)) break;
    }
    if (expired(deadline)) { fprintf(stderr, "[0] survivor deadline\n"); return 6; }
    progressOnce(any_fail && all_done ? 0 : 5);
  }
  g_sh->survivor_phase.store(5);
  // a little more progress with the victim's endpoint closed (purges happen here)
  for (int i = 0; i < 20; ++i) progressOnce(1);
  g_sh->survivor_done.store(1);
  g_sh->survivor_phase.store(6);
  teardown();
  g_sh->survivor_phase.store(7);
  return g_sh->detect_ns.load() ? 0 : 3;
}

// ---------------------------------------------------------------- joiner
int runJoiner() {
  const bool victim = g_self == g_victim;
  pthread_t th;
  if (victim && !g_hook) pthread_create(&th, nullptr, killThread, nullptr);
  auto phase = [&](int p) { if (victim) g_sh->victim_phase.store(p); };
  phase(1);
  initUcx();
  const int64_t deadline = nowNs() + int64_t(g_timeout_s * 1.2e9);
  if (g_mode == kA) publishAddress();
  else if (g_mode == kB2) startListener();
  else g_sh->ready[g_self].store(1);
  phase(2);
  while (!g_sh->ready[0].load()) {
    if (expired(deadline)) return 5;
    usleep(50);
  }
  phase(3);
  Conn* c = nullptr;
  Op* hs_recv = postRecv(kHs | 0);
  Op* hs_send = nullptr;
  if (g_mode == kA || g_mode == kB1) {
    c = newConn(0);
    if (g_mode == kA) connectByAddress(c);
    else connectBySockaddr(c);
    hs_send = postSend(c, kHs | g_self, 0);
    phase(4);
    if (victim && g_hook) killSelf();
  }
  Op *r2_recv = nullptr, *r2_send = nullptr;
  while (true) {
    if (g_mode == kB2 && !c && !P.pending_cr.empty()) {
      c = newConn(0);
      acceptConn(c, P.pending_cr.back());
      P.pending_cr.pop_back();
      hs_send = postSend(c, kHs | g_self, 0);
      phase(4);
      if (victim && g_hook) killSelf();
    }
    if (hs_send && hs_recv->done && hs_send->done && !r2_recv) {
      phase(5);
      g_sh->hs_done_ns[g_self].store(nowNs());
      r2_recv = postRecv(kR2 | 0);
      r2_send = postSend(c, kR2 | g_self, 8);
    }
    if (r2_recv && r2_recv->done && r2_send->done) phase(6);
    if (!g_sh->all_ready_ns.load()) allReady();
    if (g_sh->survivor_done.load() && !victim) break;
    if (expired(deadline)) return victim ? 0 : 5;
    progressOnce(5);
  }
  teardown();
  return 0;
}

// ---------------------------------------------------------------- parent
struct Stats {
  int trials = 0, ok = 0, aborts = 0, other_sig = 0, hangs = 0, nonzero = 0;
  int joiner_bad = 0, undetected = 0, never_connected = 0;
  std::map<std::string, int> assertion;
  std::map<std::string, std::vector<double>> detect_ms;  // by kill bucket
  std::map<std::string, std::array<int, 3>> bucket;       // trials, aborts, hangs
  std::vector<double> wireup_ms;  // live joiners: all published -> own handshake done
};

std::string firstAssertion(const std::string& path) {
  FILE* f = fopen(path.c_str(), "r");
  if (!f) return "?";
  char line[1024];
  std::string found;
  while (fgets(line, sizeof(line), f)) {
    std::string s(line);
    if (s.find("Assertion") != std::string::npos || s.find("Fatal") != std::string::npos ||
        s.find("fatal") != std::string::npos) {
      // strip host:pid prefix and the timestamp
      size_t at = s.find(".c:");
      if (at == std::string::npos) at = s.find(".cc:");
      size_t start = at == std::string::npos ? 0 : s.rfind(' ', at) + 1;
      found = s.substr(start);
      while (!found.empty() && (found.back() == '\n' || found.back() == ' ')) found.pop_back();
      break;
    }
  }
  fclose(f);
  return found.empty() ? "(no assertion text)" : found;
}

void usage() {
  fprintf(stderr,
          "usage: wiretrial MODE TRIALS [-n joiners=3] [-k hook_frac=0.2] [-d max_delay_us=5000]\n"
          "                 [-s seed] [-t timeout_s=10] [-v] [-l logdir=./logs]\n"
          "  MODE: A (worker addresses) | B1 (survivor listens) | B2 (joiners listen)\n");
  exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) usage();
  std::string mode = argv[1];
  if (mode == "A") g_mode = kA;
  else if (mode == "B1") g_mode = kB1;
  else if (mode == "B2") g_mode = kB2;
  else usage();
  int trials = atoi(argv[2]);
  double hook_frac = 0.2;
  int max_delay = 5000;
  unsigned seed = static_cast<unsigned>(nowNs());
  bool verbose = false;
  std::string logdir = "logs";
  for (int i = 3; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* { if (i + 1 >= argc) usage(); return argv[++i]; };
    if (a == "-n") g_n = atoi(next());
    else if (a == "-k") hook_frac = atof(next());
    else if (a == "-d") max_delay = atoi(next());
    else if (a == "-s") seed = static_cast<unsigned>(atol(next()));
    else if (a == "-t") g_timeout_s = atof(next());
    else if (a == "-v") verbose = true;
    else if (a == "-l") logdir = next();
    else usage();
  }
  if (g_n < 1 || g_n >= kMaxProcs) usage();
  mkdir(logdir.c_str(), 0755);
  g_sh = static_cast<Shared*>(mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE,
                                   MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  std::mt19937 rng(seed);
  Stats S;
  unsigned ver_major, ver_minor, ver_release;
  ucp_get_version(&ver_major, &ver_minor, &ver_release);
  printf("wiretrial mode %s, UCX %u.%u.%u, %d joiners, %d trials, hook %.2f, delay U[0,%d] us, seed %u\n",
         mode.c_str(), ver_major, ver_minor, ver_release, g_n, trials, hook_frac, max_delay, seed);
  fflush(stdout);
  for (int t = 0; t < trials; ++t) {
    memset(static_cast<void*>(g_sh), 0, sizeof(Shared));
    g_victim = 1 + static_cast<int>(rng() % g_n);
    g_hook = std::uniform_real_distribution<double>(0, 1)(rng) < hook_frac;
    g_delay_us = static_cast<int>(rng() % (max_delay + 1));
    std::string bucket = g_hook ? "hook"
                                 : std::to_string(g_delay_us / 1000) + "-" + std::to_string(g_delay_us / 1000 + 1) + "ms";
    std::vector<pid_t> pids(g_n + 1);
    std::vector<std::string> errs(g_n + 1);
    for (int i = 0; i <= g_n; ++i) {
      errs[i] = logdir + "/t" + std::to_string(t) + "_p" + std::to_string(i) + ".err";
      pid_t pid = fork();
      if (pid == 0) {
        int fd = open(errs[i].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);  // UCX logs to stdout by default
        dup2(fd, 2);
        close(fd);
        g_self = i;
        int rc = i == 0 ? runSurvivor() : runJoiner();
        _exit(rc);
      }
      pids[i] = pid;
    }
    const int64_t start = nowNs();
    const int64_t deadline = start + int64_t(g_timeout_s * 1e9);
    std::vector<int> status(g_n + 1, -1);
    std::vector<bool> exited(g_n + 1, false);
    int64_t survivor_exit = 0;
    bool hang = false;
    while (true) {
      for (int i = 0; i <= g_n; ++i) {
        if (exited[i]) continue;
        int st;
        if (waitpid(pids[i], &st, WNOHANG) == pids[i]) {
          exited[i] = true;
          status[i] = st;
          if (i == g_victim) g_sh->victim_dead.store(1);
          if (i == 0) survivor_exit = nowNs();
        }
      }
      bool all = std::all_of(exited.begin(), exited.end(), [](bool e) { return e; });
      if (all) break;
      int64_t now = nowNs();
      if (!exited[0] && now > deadline && !hang) {
        hang = true;
        // where the survivor is stuck (before it is killed)
        std::string cmd = "gdb -q -batch -p " + std::to_string(pids[0]) +
                          " -ex 'thread apply all bt' >> " + errs[0] + ".bt 2>&1";
        if (system(cmd.c_str()) != 0) {}
      }
      if (hang || (exited[0] && now - survivor_exit > 3000000000LL)) {
        for (int i = 0; i <= g_n; ++i)
          if (!exited[i]) kill(pids[i], SIGKILL);
      }
      usleep(500);
    }
    ++S.trials;
    auto& b = S.bucket[bucket];
    b[0]++;
    std::string verdict;
    int s0 = status[0];
    if (hang) {
      ++S.hangs;
      b[2]++;
      verdict = "HANG(phase " + std::to_string(g_sh->survivor_phase.load()) + ")";
    } else if (WIFSIGNALED(s0) && WTERMSIG(s0) == SIGABRT) {
      ++S.aborts;
      b[1]++;
      std::string a = firstAssertion(errs[0]);
      S.assertion[a]++;
      verdict = "ABORT(phase " + std::to_string(g_sh->survivor_phase.load()) + "): " + a;
    } else if (WIFSIGNALED(s0)) {
      ++S.other_sig;
      b[1]++;
      std::string a = firstAssertion(errs[0]);
      S.assertion["signal " + std::to_string(WTERMSIG(s0)) + ": " + a]++;
      verdict = "SIGNAL " + std::to_string(WTERMSIG(s0));
    } else if (WEXITSTATUS(s0) == 3 && g_mode == kB1 && g_sh->accepted.load() < g_n) {
      ++S.never_connected;
      ++S.ok;
      verdict = "ok-never-connected";
    } else if (WEXITSTATUS(s0) == 3) {
      ++S.undetected;
      verdict = "undetected";
    } else if (WEXITSTATUS(s0) != 0) {
      ++S.nonzero;
      verdict = "exit " + std::to_string(WEXITSTATUS(s0));
    } else {
      ++S.ok;
      verdict = "ok";
    }
    for (int i = 1; i <= g_n; ++i)
      if (i != g_victim && g_sh->hs_done_ns[i].load() && g_sh->all_ready_ns.load())
        S.wireup_ms.push_back((g_sh->hs_done_ns[i].load() - g_sh->all_ready_ns.load()) / 1e6);
    if (g_sh->detect_ns.load() && g_sh->kill_ns.load())
      S.detect_ms[bucket].push_back((g_sh->detect_ns.load() - g_sh->kill_ns.load()) / 1e6);
    // live joiners: anything but a clean exit 0 (or our SIGKILL after the survivor) is noted
    std::string jnote;
    for (int i = 1; i <= g_n; ++i) {
      if (i == g_victim) {
        if (!(WIFSIGNALED(status[i]) && WTERMSIG(status[i]) == SIGKILL)) jnote += " victim-not-killed";
        continue;
      }
      if (WIFSIGNALED(status[i]) && WTERMSIG(status[i]) == SIGABRT) {
        ++S.joiner_bad;
        jnote += " joiner" + std::to_string(i) + "-ABORT:" + firstAssertion(errs[i]);
      } else if (verdict.rfind("ok", 0) == 0 && !(WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0)) {
        ++S.joiner_bad;
        jnote += " joiner" + std::to_string(i) + "-status" + std::to_string(status[i]);
      }
    }
    bool keep = verdict.rfind("ok", 0) != 0 || !jnote.empty();
    if (verbose || keep)
      printf("trial %d victim %d %s%s victim_phase %d accepted %d detect %.2f ms: %s%s\n", t, g_victim,
             g_hook ? "hook" : "delay ", g_hook ? "" : (std::to_string(g_delay_us) + "us").c_str(),
             g_sh->victim_phase.load(), g_sh->accepted.load(),
             g_sh->detect_ns.load() && g_sh->kill_ns.load()
                 ? (g_sh->detect_ns.load() - g_sh->kill_ns.load()) / 1e6 : -1.0,
             verdict.c_str(), jnote.c_str());
    fflush(stdout);
    if (!keep)
      for (auto& e : errs) unlink(e.c_str());
  }
  printf("SUMMARY mode %s UCX %u.%u.%u: trials %d ok %d survivor_aborts %d other_signals %d hangs %d "
         "undetected %d other_exit %d live_joiner_problems %d (B1 victim never reached the listener: %d)\n",
         mode.c_str(), ver_major, ver_minor, ver_release, S.trials, S.ok, S.aborts, S.other_sig, S.hangs,
         S.undetected, S.nonzero, S.joiner_bad, S.never_connected);
  {
    auto& d = S.wireup_ms;
    std::sort(d.begin(), d.end());
    auto q = [&](double f) { return d.empty() ? -1.0 : d[std::min(d.size() - 1, size_t(f * d.size()))]; };
    printf("  live joiner wireup (all published -> handshake done) ms: n=%zu p10 %.2f p50 %.2f p90 %.2f max %.2f\n",
           d.size(), q(0.1), q(0.5), q(0.9), d.empty() ? -1.0 : d.back());
  }
  for (auto& [a, n] : S.assertion) printf("  abort x%d: %s\n", n, a.c_str());
  for (auto& [k, v] : S.bucket) {
    auto d = S.detect_ms[k];
    std::sort(d.begin(), d.end());
    auto q = [&](double f) { return d.empty() ? -1.0 : d[std::min(d.size() - 1, size_t(f * d.size()))]; };
    printf("  %-6s trials %4d aborts %3d hangs %3d detect_ms n=%zu p50 %.1f p90 %.1f max %.1f\n", k.c_str(),
           v[0], v[1], v[2], d.size(), q(0.5), q(0.9), d.empty() ? -1.0 : d.back());
  }
  return 0;
}
