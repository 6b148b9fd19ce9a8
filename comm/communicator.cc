#include "comm/communicator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <sstream>

#include "comm/bootstrap.h"
#include "comm/context.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/file_store.h"
#include "comm/log.h"
#include "comm/ucx_context.h"

namespace crossbar {

// ------------------------------------------------------------------------------------
// Context

std::shared_ptr<Context> Context::create(std::shared_ptr<Store> store, int rank, int size, int ranks_per_node,
                                         Deadline deadline, std::shared_ptr<ucx::Fabric> ucx_fabric) {
  if (size <= 0 || rank < 0 || rank >= size)
    throw InvalidArgument(fmt::format("{}rank {} / size {} is out of range; expected 0 <= rank < size",
                                      errorContext(rank, "create communicator"), rank, size));
  if (!store)
    throw InvalidArgument(errorContext(rank, "create communicator") + "store is null");
  auto ctx = std::shared_ptr<Context>(new Context());
  ctx->rank_ = rank;
  ctx->size_ = size;
  // The n-th context this rank creates over this store is the n-th on every rank.
  int64_t seq = store->add(fmt::format("crossbar/ctx_seq/{}", rank), 1);
  ctx->store_ = std::make_shared<PrefixStore>(fmt::format("crossbar/ctx{}", seq), store);

  // Exchange where everybody runs.
  RankInfo me = describeThisProcess();
  ctx->store_->set(fmt::format("rankinfo/{}", rank), me.serialize());
  std::vector<RankInfo> infos(size);
  for (int r = 0; r < size; ++r) {
    try {
      infos[r] = RankInfo::deserialize(toString(ctx->store_->get(fmt::format("rankinfo/{}", r), deadline)));
    } catch (const Timeout&) {
      // Name every rank that has not shown up, not only the first.
      std::vector<int> missing;
      for (int q = r; q < size; ++q)
        if (!ctx->store_->check({fmt::format("rankinfo/{}", q)})) missing.push_back(q);
      throw Timeout(fmt::format("{}{} never joined (world size {}). Check that every rank was started "
                                "and uses the same store",
                                errorContext(rank, "create communicator"), formatPeers(missing), size),
                    missing);
    }
  }
  if (ranks_per_node < 0) ranks_per_node = static_cast<int>(env::getInt("CROSSBAR_RANKS_PER_NODE"));
  ctx->topology_ = Topology::build(infos, ranks_per_node);
  // Waits spin only when every process of the job on this machine has a core.
  int on_machine = 0;
  for (int r = 0; r < size; ++r) on_machine += ctx->topology_.sameMachine(r, rank);
  ctx->engine_.setProcessesOnMachine(on_machine);

  // Route each peer: shared memory within a (virtual) node on one machine, UCX otherwise.
  std::string mode = env::getEnum("CROSSBAR_TRANSPORT");
  auto viaShm = [&](int a, int b) {
    return mode == "shm" ||
           (mode == "auto" && ctx->topology_.sameMachine(a, b) && ctx->topology_.sameNode(a, b));
  };
  std::vector<int> shm_peers, ucx_peers;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    bool use_shm = viaShm(rank, p);
    if (use_shm && !ctx->topology_.sameMachine(rank, p))
      throw InvalidUsage(fmt::format("{}CROSSBAR_TRANSPORT=shm but rank {} runs on another machine ({}); "
                                     "use CROSSBAR_TRANSPORT=auto",
                                     errorContext(rank, "create communicator"), p, ctx->topology_.host(p)));
    (use_shm ? shm_peers : ucx_peers).push_back(p);
  }
  ctx->route_.assign(size, nullptr);
  // Kept UCX workers (fault tolerance): this context's wire ids (UCP tag bits 48-62)
  // must be new to every member's worker, whose unexpected queue may still hold late
  // messages of earlier epochs (ucx::agreeWireBase). Agreed when any two ranks talk over
  // UCX: then rank 0 does with one of them (routing is an equivalence), so every rank gives
  // the same answer.
  uint32_t wire_base = 0;
  bool any_ucx = false;
  for (int r = 1; r < size; ++r) any_ucx |= !viaShm(0, r);
  if (ucx_fabric && any_ucx) wire_base = ucx::agreeWireBase(*ucx_fabric, *ctx->store_, rank, size, deadline);
  // No UCX peer in this epoch: release the kept worker and its descriptors (a later
  // epoch that needs UCX again starts a fresh one; its wire ids still come from the max).
  if (ucx_fabric && ucx_peers.empty()) ucx_fabric->reset();
  auto setup = [&](const char* name, const std::vector<int>& peers) {
    TransportSetup s;
    s.store = std::make_shared<PrefixStore>(name, ctx->store_);
    s.rank = rank;
    s.size = size;
    s.peers = peers;
    s.topology = &ctx->topology_;
    s.engine = &ctx->engine_;
    s.deadline = deadline;
    s.ucx_fabric = ucx_fabric;
    s.ucx_wire_base = wire_base;
    return s;
  };
  if (!shm_peers.empty()) {
    ctx->transports_.push_back(makeShmTransport(setup("shm", shm_peers)));
    for (int p : shm_peers) ctx->route_[p] = ctx->transports_.back().get();
  }
  if (!ucx_peers.empty()) {
    ctx->transports_.push_back(makeUcxTransport(setup("ucx", ucx_peers)));
    for (int p : ucx_peers) ctx->route_[p] = ctx->transports_.back().get();
  }
  std::vector<Transport*> all;
  for (auto& t : ctx->transports_) {
    ctx->engine_.add(t.get());
    all.push_back(t.get());
  }
  ctx->any_source_ = std::make_unique<AnySourceMatcher>(rank, ctx->engine_, std::move(all));
  CB_INFO("comm", "context of {} ranks ready: {}", size, ctx->transportsSummary());
  return ctx;
}

Context::~Context() {
  any_source_.reset();  // unhooks from the engine before the transports go
  for (auto& t : transports_) engine_.remove(t.get());
  transports_.clear();
}

const char* Context::transportName(int peer) const {
  if (peer == rank_) return "self";
  return route_[peer] ? route_[peer]->name() : "none";
}

std::string Context::transportsSummary() const {
  std::map<std::string, int> counts;
  for (int p = 0; p < size_; ++p)
    if (p != rank_) counts[transportName(p)]++;
  std::string out;
  for (auto& [name, n] : counts) out += fmt::format("{}{}({} peers)", out.empty() ? "" : " ", name, n);
  return out.empty() ? "no peers" : out;
}

void Context::abort(const std::string& reason) { abort(reason, nullptr); }

void Context::abort(const std::string& reason, std::exception_ptr given) {
  std::call_once(abort_once_, [&] {
    abort_reason_ = reason;
    abort_error_ = given;
    aborted_.store(true);
    auto error = given ? given
                       : std::make_exception_ptr(Aborted(
                             fmt::format("{}communicator aborted: {}", errorContext(rank_, "abort"), reason)));
    for (auto& t : transports_) t->abort(error);
    if (any_source_) any_source_->abort(error);
  });
}

void Context::throwIfAborted(const std::string& prefix) const {
  if (!aborted()) return;
  std::string reason = abort_reason_;
  std::vector<int> peers;
  ErrorCode code = ErrorCode::kAborted;
  if (auto e = abortError()) {
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      reason = err.what();
      peers = err.peers();
      code = err.code();
    } catch (const std::exception& err) {
      reason = err.what();
    }
  }
  if (code == ErrorCode::kPeerFailure) throw PeerFailure(prefix + reason, std::move(peers));
  if (code == ErrorCode::kTimeout) throw Timeout(prefix + reason, std::move(peers));
  throw Aborted(prefix + reason, std::move(peers));
}

// ------------------------------------------------------------------------------------
// Communicator

namespace {
Millis resolveTimeout(Millis requested) {
  return requested.count() > 0 ? requested : defaultTimeout();
}
constexpr uint32_t kBarrierTag = kInternalTagBase + 1;
constexpr uint32_t kMaxCommId = 0xFFFF;
}  // namespace

namespace {
// The abort's `error` as one request's failure: same type and peers, the message naming
// the request (its peer and tag) and whether it was withdrawn.
std::exception_ptr abortErrorFor(const std::exception_ptr& error, const Request& r, bool withdrawn) {
  const std::string note =
      withdrawn ? fmt::format(" [{}: withdrawn, the next message with its tag goes to the next matching receive]",
                              r.what())
                : fmt::format(" [{}]", r.what());
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kPeerFailure) return std::make_exception_ptr(PeerFailure(e.what() + note, e.peers()));
    if (e.code() == ErrorCode::kTimeout) return std::make_exception_ptr(Timeout(e.what() + note, e.peers()));
    return std::make_exception_ptr(Aborted(e.what() + note, e.peers()));
  } catch (const std::exception& e) {
    return std::make_exception_ptr(Aborted(e.what() + note));
  }
}
}  // namespace

// A split shares the context's transports, so its abort cannot stop them: it withdraws
// the receives it posted that no message matched yet (Request::cancel: their buffers are
// free, later messages with their tags are not taken by them), fails the rest of the
// requests it issued (tracked here while pending) and refuses new ones. Splits made from
// it are aborted with it (their state hangs off this one).
struct Communicator::SplitAbort {
  std::atomic<bool> aborted{false};
  std::mutex mutex;
  std::string reason;
  std::exception_ptr error;
  std::vector<std::weak_ptr<Request>> pending;
  size_t prune_at = 64;
  std::vector<std::weak_ptr<SplitAbort>> children;

  // A new split of `parent` (null: a split of the context's own communicator).
  static std::shared_ptr<SplitAbort> childOf(const std::shared_ptr<SplitAbort>& parent) {
    auto state = std::make_shared<SplitAbort>();
    if (!parent) return state;
    std::lock_guard<std::mutex> lock(parent->mutex);
    if (parent->aborted.load()) {  // made from an aborted split: born aborted
      state->reason = parent->reason;
      state->error = parent->error;
      state->aborted.store(true);
    } else {
      std::erase_if(parent->children, [](const auto& c) { return c.expired(); });
      parent->children.push_back(state);
    }
    return state;
  }

  void track(const RequestPtr& r) {
    std::unique_lock<std::mutex> lock(mutex);
    if (aborted.load()) {  // issued while the abort ran
      lock.unlock();
      if (!r->cancel(abortErrorFor(error, *r, true)) && !r->done()) r->fail(abortErrorFor(error, *r, false));
      return;
    }
    pending.push_back(r);
    if (pending.size() >= prune_at) {
      std::erase_if(pending, [](const auto& w) {
        auto q = w.lock();
        return !q || q->done();
      });
      prune_at = std::max<size_t>(64, 2 * pending.size());
    }
  }

  void abort(const std::string& why, std::exception_ptr err) {
    std::vector<std::weak_ptr<Request>> to_fail;
    std::vector<std::weak_ptr<SplitAbort>> kids;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (aborted.load()) return;
      reason = why;
      error = err;
      aborted.store(true);
      to_fail.swap(pending);
      kids.swap(children);
    }
    for (auto& w : to_fail) {
      auto r = w.lock();
      if (!r) continue;
      // (Also a finished one: it failed some other way, e.g. a timeout, but may be posted still.)
      if (!r->cancel(abortErrorFor(err, *r, true)) && !r->done()) r->fail(abortErrorFor(err, *r, false));
    }
    for (auto& w : kids)
      if (auto k = w.lock()) k->abort(why, err);
  }
};

std::shared_ptr<Communicator> Communicator::create(std::shared_ptr<Store> store, int rank, int size,
                                                   CommOptions options) {
  log::setRank(rank);
  auto comm = std::shared_ptr<Communicator>(new Communicator());
  comm->timeout_ = resolveTimeout(options.timeout);
  auto connect_deadline = Deadline::after(std::max(comm->timeout_, Millis(env::getMillis("CROSSBAR_CONNECT_TIMEOUT"))));
  comm->context_ = Context::create(std::move(store), rank, size, options.ranks_per_node, connect_deadline,
                                   options.ucx_fabric);
  comm->members_.resize(size);
  for (int r = 0; r < size; ++r) comm->members_[r] = r;
  comm->rank_ = rank;
  comm->id_ = 0;
  comm->epoch_ = options.epoch;
  comm->name_ = options.name.empty() ? "world" : options.name;
  comm->store_ = std::make_shared<PrefixStore>("comm0", comm->context_->store());
  comm->local_peers_ = comm->nodePeers(rank);
  comm->num_nodes_ = comm->countNodes();
  comm->local_rank_ = static_cast<int>(
      std::find(comm->local_peers_.begin(), comm->local_peers_.end(), rank) - comm->local_peers_.begin());
  comm->countMachinePeers();
  CB_INFO("comm", "{}", comm->describe());
  return comm;
}

std::shared_ptr<Communicator> Communicator::fromEnvironment(CommOptions options) {
  BootstrapInfo info = detectBootstrap();
  auto store = connectStore(info);
  auto comm = create(std::move(store), info.rank, info.size, options);
  bindThisProcess(comm->machineLocalRank(), comm->machineLocalSize());
  return comm;
}

Communicator::~Communicator() = default;

int Communicator::localRank() const { return local_rank_; }
int Communicator::localSize() const { return static_cast<int>(local_peers_.size()); }
void Communicator::countMachinePeers() {
  const int me = members_.at(rank_);
  machine_local_rank_ = machine_local_size_ = 0;
  for (int r = 0; r < size(); ++r) {
    if (!topology().sameMachine(members_[r], me)) continue;
    if (r < rank_) ++machine_local_rank_;
    ++machine_local_size_;
  }
}
int Communicator::node() const { return nodeOf(rank_); }
int Communicator::nodeOf(int rank) const { return topology().node(members_.at(rank)); }
int Communicator::countNodes() const {
  std::vector<int> nodes;
  for (int w : members_) nodes.push_back(topology().node(w));
  std::sort(nodes.begin(), nodes.end());
  return static_cast<int>(std::unique(nodes.begin(), nodes.end()) - nodes.begin());
}
std::vector<int> Communicator::nodePeers(int rank) const {
  std::vector<int> out;
  int node = nodeOf(rank);
  for (int r = 0; r < size(); ++r)
    if (nodeOf(r) == node) out.push_back(r);
  return out;
}
std::vector<std::vector<int>> Communicator::nodes() const {
  std::vector<std::vector<int>> out;
  std::vector<int> node_ids;  // node id of out[i]
  for (int r = 0; r < size(); ++r) {
    const int id = nodeOf(r);
    const size_t i = std::find(node_ids.begin(), node_ids.end(), id) - node_ids.begin();
    if (i == node_ids.size()) {
      node_ids.push_back(id);
      out.emplace_back();
    }
    out[i].push_back(r);
  }
  return out;
}
const std::string& Communicator::host(int rank) const { return topology().host(members_.at(rank)); }
ProgressEngine& Communicator::engine() const { return context_->engine(); }
Store& Communicator::store() const { return *store_; }
std::shared_ptr<Store> Communicator::storePtr() const { return store_; }
const Topology& Communicator::topology() const { return context_->topology(); }

std::string Communicator::describe() const {
  return fmt::format("{}: rank {}/{}, node {}/{}, local rank {}/{}, epoch {}, {}", name_, rank_, size(), node(),
                     numNodes(), localRank(), localSize(), epoch_, context_->transportsSummary());
}

RequestPtr Communicator::isend(const void* data, size_t bytes, int peer, uint32_t tag) {
  if (peer < 0 || peer >= size())
    throw InvalidArgument(fmt::format("{}peer {} is out of range for a communicator of size {}",
                                      errorContext(rank_, "send"), peer, size()));
  if (!data && bytes)
    throw InvalidArgument(fmt::format("{}null buffer for {} bytes to rank {}", errorContext(rank_, "send"), bytes, peer));
  if (aborted()) throwAborted("send");
  if (peer == rank_)
    throw InvalidUsage(fmt::format("{}sending to self (rank {}) is not supported; copy locally instead",
                                   errorContext(rank_, "send"), peer));
  return track(context_->transportTo(members_[peer]).isend(members_[peer], fullTag(tag), data, bytes));
}

RequestPtr Communicator::irecv(void* data, size_t capacity, int peer, uint32_t tag) {
  if (peer == kAnySource) return irecvAnySource(data, capacity, tag);
  if (peer < 0 || peer >= size())
    throw InvalidArgument(fmt::format("{}peer {} is out of range for a communicator of size {}",
                                      errorContext(rank_, "recv"), peer, size()));
  if (!data && capacity)
    throw InvalidArgument(fmt::format("{}null buffer for {} bytes from rank {}", errorContext(rank_, "recv"), capacity, peer));
  if (aborted()) throwAborted("recv");
  if (peer == rank_)
    throw InvalidUsage(fmt::format("{}receiving from self (rank {}) is not supported; copy locally instead",
                                   errorContext(rank_, "recv"), peer));
  return track(context_->transportTo(members_[peer]).irecv(members_[peer], fullTag(tag), data, capacity));
}

RequestPtr Communicator::irecvAnySource(void* data, size_t capacity, uint32_t tag) {
  if (!data && capacity)
    throw InvalidArgument(
        fmt::format("{}null buffer for {} bytes", errorContext(rank_, "recv from any rank"), capacity));
  if (size() < 2)
    throw InvalidUsage(fmt::format("{}communicator {} has no other rank to receive from",
                                   errorContext(rank_, "recv from any rank"), name_));
  if (aborted()) throwAborted("recv from any rank");
  return track(context_->anySource().post(
      fullTag(tag), tag, data, capacity, members_,
      fmt::format("recv of up to {} bytes tag {} from any rank of {} (size {})", capacity, tag, name_, size())));
}

void Communicator::send(const void* data, size_t bytes, int peer, uint32_t tag) {
  isend(data, bytes, peer, tag)->wait(defaultDeadline());
}

Status Communicator::recv(void* data, size_t capacity, int peer, uint32_t tag) {
  auto req = irecv(data, capacity, peer, tag);
  try {
    req->wait(defaultDeadline());
  } catch (const Timeout&) {
    // Withdrawn, the caller's buffer is free and a late message goes to a later receive
    // (one already arriving cannot be withdrawn: it finishes into the buffer). Another
    // thread's progress may have finished it since the wait gave up: then its message is
    // in the buffer and is returned (or its failure thrown), not dropped with a Timeout.
    if (req->cancel() || !req->done()) throw;
    req->rethrowIfFailed();
  }
  Status st = req->status();
  // Report ranks of this communicator, not of the context (any-source: already so).
  if (peer != kAnySource) st.source = peer;
  st.tag = tag;
  return st;
}

void Communicator::waitAll(const std::vector<RequestPtr>& requests, Deadline deadline) {
  bool all = engine().waitUntil(
      [&] {
        for (auto& r : requests)
          if (!r->done()) return false;
        return true;
      },
      deadline);
  // Failures first (they explain timeouts of dependent requests), then timeouts.
  for (auto& r : requests) r->rethrowIfFailed();
  if (!all) {
    std::string pending;
    for (auto& r : requests)
      if (!r->done()) pending += (pending.empty() ? "" : "; ") + r->what();
    throw Timeout(fmt::format("{}timed out after {} ms waiting for: {}", errorContext(rank_, "wait"),
                              timeout_.count(), pending));
  }
}

void Communicator::barrier() { barrier(defaultDeadline()); }

void Communicator::barrier(Deadline deadline) {
  // Dissemination barrier: log2(n) rounds of zero-byte messages.
  const int n = size();
  for (int k = 1; k < n; k <<= 1) {
    int to = (rank_ + k) % n, from = (rank_ - k + n) % n;
    auto r = irecv(nullptr, 0, from, kBarrierTag);
    auto s = isend(nullptr, 0, to, kBarrierTag);
    try {
      waitAll({s, r}, deadline);
    } catch (const Timeout&) {
      throw Timeout(fmt::format("{}rank {} (host {}) did not arrive at the barrier within the deadline "
                                "(round {}); it may be hung, slow, or not calling barrier()",
                                errorContext(rank_, name_ + " barrier"), from, host(from), k),
                    {from});
    }
  }
}

void Communicator::destroy() {
  if (!context_) return;
  if (!aborted()) {
    try {
      barrier(Deadline::after(std::min(timeout_, Millis(10'000))));
    } catch (const std::exception& e) {
      CB_WARN("comm", "destroy(): final barrier failed, tearing down anyway: {}", e.what());
    }
  }
  context_.reset();
  store_.reset();
}

void Communicator::abort(const std::string& reason) { abort(reason, nullptr); }

void Communicator::abort(const std::string& reason, std::exception_ptr error) {
  if (!split_abort_) {
    context_->abort(reason, std::move(error));
    return;
  }
  if (split_abort_->aborted.load() || context_->aborted()) return;
  if (!error)
    error = std::make_exception_ptr(Aborted(fmt::format("{}communicator {} was aborted: {}",
                                                        errorContext(rank_, "abort"), name_, reason)));
  CB_INFO("comm", "{} aborted ({}): its pending operations fail; the transports it shares stay up", name_, reason);
  split_abort_->abort(reason, std::move(error));
}

bool Communicator::aborted() const {
  return context_->aborted() || (split_abort_ && split_abort_->aborted.load());
}

void Communicator::throwIfAborted(const std::string& prefix) const {
  context_->throwIfAborted(prefix);
  if (!split_abort_ || !split_abort_->aborted.load()) return;
  std::exception_ptr error;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(split_abort_->mutex);
    error = split_abort_->error;
    reason = split_abort_->reason;
  }
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kPeerFailure) throw PeerFailure(prefix + e.what(), e.peers());
    if (e.code() == ErrorCode::kTimeout) throw Timeout(prefix + e.what(), e.peers());
    throw Aborted(prefix + e.what(), e.peers());
  } catch (const std::exception& e) {
    throw Aborted(prefix + e.what());
  }
}

void Communicator::throwAborted(const char* op) const {
  if (context_->aborted()) {
    if (auto error = context_->abortError()) std::rethrow_exception(error);
    throw Aborted(fmt::format("{}communicator {} was aborted: {}", errorContext(rank_, op), name_,
                              context_->abortReason()));
  }
  std::lock_guard<std::mutex> lock(split_abort_->mutex);
  std::rethrow_exception(split_abort_->error);
}

RequestPtr Communicator::track(RequestPtr request) {
  if (split_abort_ && !request->done()) split_abort_->track(request);
  return request;
}

std::shared_ptr<Communicator> Communicator::split(int color, int key) {
  const std::string op = name_ + " split";
  const uint64_t seq = split_count_++;
  const Deadline deadline = defaultDeadline();
  store_->set(fmt::format("split/{}/{}", seq, rank_), fmt::format("{} {}", color, key));
  struct Entry { int color, key, rank; };
  std::vector<Entry> entries;
  for (int r = 0; r < size(); ++r) {
    // In slices, so an abort (a peer died before reaching split) ends the wait at once
    // instead of at the deadline.
    std::string text;
    while (text.empty()) {
      throwIfAborted(errorContext(rank_, op) +
                     fmt::format("the communicator was aborted while waiting for rank {}'s split(): ", r));
      try {
        text = toString(store_->get(fmt::format("split/{}/{}", seq, r), deadline.min(Deadline::after(Millis(100)))));
      } catch (const Timeout&) {
        if (deadline.expired())
          throw Timeout(fmt::format("{}rank {} (host {}) did not call split() within the deadline",
                                    errorContext(rank_, op), r, host(r)),
                        {r});
      }
    }
    std::istringstream in(text);
    Entry e{0, 0, r};
    in >> e.color >> e.key;
    entries.push_back(e);
  }
  if (color < 0) return nullptr;
  std::vector<Entry> group;
  for (auto& e : entries)
    if (e.color == color) group.push_back(e);
  std::stable_sort(group.begin(), group.end(),
                   [](const Entry& a, const Entry& b) { return a.key != b.key ? a.key < b.key : a.rank < b.rank; });
  std::vector<int> members;
  int new_rank = -1;
  for (auto& e : group) {
    if (e.rank == rank_) new_rank = static_cast<int>(members.size());
    members.push_back(members_[e.rank]);
  }
  // The group's first member allocates a fresh communicator id for everyone.
  const std::string id_key = fmt::format("split/{}/color{}", seq, color);
  if (new_rank == 0) {
    int64_t id = context_->store()->add("next_comm_id", 1);
    if (id > kMaxCommId)
      throw Unsupported(fmt::format("{}more than {} communicators were created in this job", errorContext(rank_, op),
                                    kMaxCommId));
    store_->set(id_key, std::to_string(id));
  }
  uint32_t id = static_cast<uint32_t>(std::stoul(toString(store_->get(id_key, deadline))));
  return makeChild(std::move(members), new_rank, id, fmt::format("{}.{}", name_, seq));
}

std::shared_ptr<Communicator> Communicator::dup() { return split(0, rank_); }

std::shared_ptr<Communicator> Communicator::splitMembers(const std::vector<int>& ranks, const std::string& given_name) {
  const std::string op = name_ + " members-only split";
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  if (ranks.empty() || sorted.front() < 0 || sorted.back() >= size() ||
      std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    throw InvalidArgument(fmt::format("{}ranks [{}] must be distinct ranks of {} (size {})", errorContext(rank_, op),
                                      fmt::join(ranks, ","), name_, size()));
  auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) return nullptr;
  const int new_rank = static_cast<int>(me - ranks.begin());
  // Members agree on the key without non-members: it names the list and how many
  // splits of this list this member made before (the parent's store is per parent).
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the ranks, in order
  for (int r : ranks) hash = (hash ^ static_cast<uint32_t>(r)) * 1099511628211ull;
  const uint64_t seq = member_split_count_[ranks]++;
  const std::string id_key = fmt::format("msplit/{}/{:016x}/{}", ranks.size(), hash, seq);
  std::vector<int> members;
  for (int r : ranks) members.push_back(members_[r]);
  const std::string list = ranks.size() <= 8 ? fmt::format("{}", fmt::join(ranks, ","))
                                              : fmt::format("{},{},...({} ranks)", ranks[0], ranks[1], ranks.size());
  const std::string name =
      given_name.empty() ? fmt::format("{}.[{}]{}", name_, list, seq ? fmt::format("#{}", seq) : "") : given_name;
  // The first member allocates the new communicator id; the others wait for it.
  if (new_rank == 0) {
    int64_t id = context_->store()->add("next_comm_id", 1);
    if (id > kMaxCommId)
      throw Unsupported(fmt::format("{}more than {} communicators were created in this job", errorContext(rank_, op),
                                    kMaxCommId));
    store_->set(id_key, std::to_string(id));
    return makeChild(std::move(members), 0, static_cast<uint32_t>(id), name);
  }
  const Deadline deadline = defaultDeadline();
  std::string text;
  while (text.empty()) {  // in slices, so an abort ends the wait at once
    throwIfAborted(errorContext(rank_, op) +
                   fmt::format("the communicator was aborted while waiting for rank {}: ", ranks[0]));
    try {
      text = toString(store_->get(id_key, deadline.min(Deadline::after(Millis(100)))));
    } catch (const Timeout&) {
      if (deadline.expired())
        throw Timeout(fmt::format("{}rank {} (host {}), the first of [{}], did not make split {} of this list within "
                                  "the deadline; every member must call splitMembers with the same list",
                                  errorContext(rank_, op), ranks[0], host(ranks[0]), list, seq),
                      {ranks[0]});
    }
  }
  return makeChild(std::move(members), new_rank, static_cast<uint32_t>(std::stoul(text)), name);
}

std::shared_ptr<Communicator> Communicator::makeChild(std::vector<int> members, int new_rank, uint32_t id,
                                                      const std::string& name) {
  auto child = std::shared_ptr<Communicator>(new Communicator());
  child->context_ = context_;
  child->split_abort_ = SplitAbort::childOf(split_abort_);
  child->members_ = std::move(members);
  child->rank_ = new_rank;
  child->id_ = id;
  child->epoch_ = epoch_;
  child->name_ = name;
  child->timeout_ = timeout_;
  child->store_ = std::make_shared<PrefixStore>(fmt::format("comm{}", id), context_->store());
  child->local_peers_ = child->nodePeers(new_rank);
  child->num_nodes_ = child->countNodes();
  child->local_rank_ = static_cast<int>(std::find(child->local_peers_.begin(), child->local_peers_.end(), new_rank) -
                                        child->local_peers_.begin());
  child->countMachinePeers();
  CB_INFO("comm", "{}", child->describe());
  return child;
}

}  // namespace crossbar
