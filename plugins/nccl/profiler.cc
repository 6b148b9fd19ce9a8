// libnccl-profiler-crossbar.so: an NCCL profiler (v5) that feeds crossbar telemetry.
//
// A collective (ncclProfileColl) becomes one telemetry op record. NCCL stops the Coll
// event when the host has enqueued it; the data moves later, in kernel channels
// (KernelCh) and proxy operations (ProxyOp, with ProxySteps). So the record is emitted
// when the Coll event and all its children have stopped: enqueue = Coll start, start =
// first child start, end = last child stop, wait = the longest per-channel time proxy
// steps spent waiting for the peer (SendPeerWait/RecvWait). Without children (kernel-only
// profiling off) the Coll start/stop span is used.
//
// NCCL calls these from the user thread and the proxy thread at once: counters are atomic,
// and each event object is freed by whoever drops its last reference.
#include <algorithm>
#include <cstdio>
#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>

#include "plugins/nccl/nccl_profiler_v5.h"
#include "plugins/nccl/plugin_stats.h"
#include "telemetry/telemetry.h"

namespace {

using crossbar::telemetry::nowNs;
using crossbar::telemetry::Recorder;

struct Context {
  int rank = 0, nranks = 1;
};

std::atomic<bool> kernel_events{false};  // KernelCh events were asked for

struct Counters {
  std::atomic<uint64_t> inits{0}, coll_api{0}, colls{0}, colls_recorded{0}, kernel_channels{0}, proxy_ops{0}, proxy_steps{0};
  std::atomic<uint64_t> last_bytes{0};
  std::mutex last_mutex;
  std::string last_func;
} counters;

struct Event {
  uint64_t type = 0;
  Event* parent = nullptr;
  std::atomic<int> refs{1};  // own stop + one per live child
};

void atomicMin(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load(std::memory_order_relaxed);
  while (v < cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}
void atomicMax(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

struct Coll : Event {
  std::string func, algo;
  uint64_t bytes = 0;
  int64_t enqueue_ns = 0, host_end_ns = 0;
  std::atomic<int64_t> first_start{INT64_MAX}, last_end{0}, max_wait{0};
  std::atomic<bool> finished{false};
};

// Finished collectives are freed late: NCCL may still start a child event (a proxy op
// posted before the kernel ended) naming a collective whose expected children are done.
// What is still here when the plugin is unloaded (dlclose, exit) is freed then.
struct Graveyard {
  static constexpr size_t kSize = 4096;
  std::mutex mutex;
  std::deque<Coll*> colls;
  void bury(Coll* c) {
    std::lock_guard<std::mutex> lock(mutex);
    colls.push_back(c);
    if (colls.size() > kSize) {
      delete colls.front();
      colls.pop_front();
    }
  }
  ~Graveyard() {
    for (Coll* c : colls) delete c;
  }
} graveyard;

// KernelCh / ProxyOp: a per-channel child of a Coll (or P2p, which we do not record).
struct Channel : Event {
  int64_t start_ns = 0;
  std::atomic<int64_t> wait_ns{0};
};

struct Step : Event {
  int64_t wait_since = 0;  // entered a peer-wait state at; 0: not waiting
};

size_t typeSize(const char* dt) {
  if (!dt) return 1;
  std::string t(dt);
  if (t.find("64") != std::string::npos || t == "ncclDouble") return 8;
  if (t.find("32") != std::string::npos || t == "ncclFloat" || t == "ncclInt") return 4;
  if (t.find("16") != std::string::npos || t == "ncclHalf") return 2;
  return 1;
}

void release(Event* e);

void finishColl(Coll* c) {
  c->finished.store(true, std::memory_order_release);
  int64_t start = c->first_start.load();
  int64_t end = c->last_end.load();
  if (start == INT64_MAX) start = c->enqueue_ns, end = c->host_end_ns;
  Recorder::instance().recordOp(c->func, c->bytes, c->algo, c->enqueue_ns, start, end, c->max_wait.load());
  counters.colls_recorded++;
  counters.last_bytes = c->bytes;
  std::lock_guard<std::mutex> lock(counters.last_mutex);
  counters.last_func = c->func;
}

void release(Event* e) {
  while (e && e->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    Event* parent = e->parent;
    if (e->type == ncclProfileColl) finishColl(static_cast<Coll*>(e));
    // A channel's wait is final once its steps are gone too.
    if (e->type == ncclProfileKernelCh || e->type == ncclProfileProxyOp)
      atomicMax(static_cast<Coll*>(parent)->max_wait, static_cast<Channel*>(e)->wait_ns.load());
    if (e->type == ncclProfileColl)
      graveyard.bury(static_cast<Coll*>(e));
    else if (e->type == ncclProfileProxyStep)
      delete static_cast<Step*>(e);
    else if (e->type == ncclProfileKernelCh || e->type == ncclProfileProxyOp)
      delete static_cast<Channel*>(e);
    else
      delete e;
    e = parent;
  }
}

ncclResult_t profInit(void** context, uint64_t /*commId*/, int* eActivationMask, const char* /*commName*/,
                      int /*nNodes*/, int nranks, int rank, ncclDebugLogger_t /*logfn*/) {
  auto* ctx = new Context;
  counters.inits++;
  ctx->rank = rank;
  ctx->nranks = nranks;
  Recorder& rec = Recorder::instance();
  // The first (world-sized) communicator names the process's rank in telemetry.
  if (rec.enabled() && nranks > 1) rec.setRank(rank, nranks);
  kernel_events.store(rec.enabled(), std::memory_order_relaxed);
  // CollApi events are only counted (plugin_stats.h): NCCL emits them per user call, even
  // where no Coll follows (one-rank communicators copy locally).
  *eActivationMask = rec.enabled() ? (ncclProfileCollApi | ncclProfileColl | ncclProfileKernelCh |
                                      ncclProfileProxyOp | ncclProfileProxyStep)
                                   : 0;
  *context = ctx;
  return ncclSuccess;
}

ncclResult_t profStartEvent(void* /*context*/, void** eHandle, ncclProfilerEventDescr_v5_t* d) {
  *eHandle = nullptr;
  if (!d) return ncclSuccess;
  int64_t now = nowNs();
  switch (d->type) {
    case ncclProfileCollApi:
      counters.coll_api++;
      return ncclSuccess;
    case ncclProfileColl: {
      counters.colls++;
      auto* c = new Coll;
      c->type = ncclProfileColl;
      c->func = d->coll.func ? d->coll.func : "coll";
      std::string algo = d->coll.algo ? d->coll.algo : "";
      if (d->coll.proto) algo += std::string("/") + d->coll.proto;
      c->algo = algo;
      c->bytes = uint64_t(d->coll.count) * typeSize(d->coll.datatype);
      c->enqueue_ns = now;
      // The record waits for its kernel channels (one KernelCh event per channel); the
      // host stop alone would end it at enqueue.
      if (kernel_events.load(std::memory_order_relaxed)) c->refs.fetch_add(d->coll.nChannels);
      *eHandle = c;
      return ncclSuccess;
    }
    case ncclProfileKernelCh:
    case ncclProfileProxyOp: {
      auto* parent = static_cast<Event*>(d->parentObj);
      if (!parent || parent->type != ncclProfileColl) return ncclSuccess;  // p2p: not recorded
      // Too late to count toward a record already emitted.
      if (static_cast<Coll*>(parent)->finished.load(std::memory_order_acquire)) return ncclSuccess;
      (d->type == ncclProfileKernelCh ? counters.kernel_channels : counters.proxy_ops)++;
      auto* ch = new Channel;
      ch->type = d->type;
      ch->parent = parent;
      ch->start_ns = now;
      // KernelCh references were counted when the collective started.
      if (d->type == ncclProfileProxyOp) parent->refs.fetch_add(1, std::memory_order_relaxed);
      atomicMin(static_cast<Coll*>(parent)->first_start, now);
      *eHandle = ch;
      return ncclSuccess;
    }
    case ncclProfileProxyStep: {
      auto* parent = static_cast<Event*>(d->parentObj);
      if (!parent || parent->type != ncclProfileProxyOp) return ncclSuccess;
      counters.proxy_steps++;
      auto* s = new Step;
      s->type = ncclProfileProxyStep;
      s->parent = parent;
      parent->refs.fetch_add(1, std::memory_order_relaxed);
      *eHandle = s;
      return ncclSuccess;
    }
    default:
      return ncclSuccess;
  }
}

ncclResult_t profStopEvent(void* eHandle) {
  auto* e = static_cast<Event*>(eHandle);
  if (!e) return ncclSuccess;
  int64_t now = nowNs();
  if (e->type == ncclProfileColl) {
    static_cast<Coll*>(e)->host_end_ns = now;
  } else if (e->type == ncclProfileKernelCh || e->type == ncclProfileProxyOp) {
    auto* ch = static_cast<Channel*>(e);
    auto* coll = static_cast<Coll*>(ch->parent);
    atomicMax(coll->last_end, now);
  } else if (e->type == ncclProfileProxyStep) {
    auto* s = static_cast<Step*>(e);
    if (s->wait_since) static_cast<Channel*>(s->parent)->wait_ns.fetch_add(now - s->wait_since);
    s->wait_since = 0;
  }
  release(e);
  return ncclSuccess;
}

ncclResult_t profRecordEventState(void* eHandle, ncclProfilerEventState_v5_t state,
                                  ncclProfilerEventStateArgs_v5_t* /*args*/) {
  auto* e = static_cast<Event*>(eHandle);
  if (!e || e->type != ncclProfileProxyStep) return ncclSuccess;
  auto* s = static_cast<Step*>(e);
  int64_t now = nowNs();
  bool waiting = state == ncclProfilerProxyStepSendPeerWait_v4 || state == ncclProfilerProxyStepRecvWait;
  // Leaving a wait state adds its span to the channel's wait.
  if (s->wait_since && !waiting) {
    static_cast<Channel*>(s->parent)->wait_ns.fetch_add(now - s->wait_since);
    s->wait_since = 0;
  } else if (waiting && !s->wait_since) {
    s->wait_since = now;
  }
  return ncclSuccess;
}

ncclResult_t profFinalize(void* context) {
  delete static_cast<Context*>(context);
  return ncclSuccess;
}

}  // namespace

extern "C" {
__attribute__((visibility("default"))) ncclProfiler_v5_t ncclProfiler_v5 = {
    "crossbar", profInit, profStartEvent, profStopEvent, profRecordEventState, profFinalize};

__attribute__((visibility("default"))) int crossbar_profiler_stats(CrossbarProfilerStats* out) {
  out->inits = counters.inits.load();
  out->coll_api = counters.coll_api.load();
  out->colls = counters.colls.load();
  out->colls_recorded = counters.colls_recorded.load();
  out->kernel_channels = counters.kernel_channels.load();
  out->proxy_ops = counters.proxy_ops.load();
  out->proxy_steps = counters.proxy_steps.load();
  out->last_bytes = counters.last_bytes.load();
  std::lock_guard<std::mutex> lock(counters.last_mutex);
  std::snprintf(out->last_func, sizeof(out->last_func), "%s", counters.last_func.c_str());
  return 0;
}
}
