#include "comm/ft.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string_view>
#include <tuple>

#include "comm/context.h"
#include "comm/env.h"
#include "comm/file_store.h"
#include "comm/interrupt.h"
#include "comm/log.h"
#include "comm/thread_name.h"
#include "comm/ucx_context.h"

namespace crossbar::ft {

struct CallbackList {
  std::mutex mu;
  std::vector<FailureCallback> list;
  std::vector<std::shared_ptr<EpochResource>> resources;
};

namespace {

// Data-path probes travel on the epoch communicator with an internal tag (below the
// collectives' range, never used by users: kInternalTagBase and up are reserved).
constexpr uint32_t kProbeTag = kInternalTagBase + 0x100;
// Probes a cut link leaves queued: more prove nothing and would only pile up.
constexpr size_t kMaxProbeSends = 4;

// Serialized fault: "rank kind pid reporter host detail..." (one per line).
std::string serialize(const std::vector<PeerFault>& faults) {
  std::string out;
  for (const auto& f : faults)
    out += fmt::format("{} {} {} {} {} {}\n", f.rank, static_cast<int>(f.kind), f.pid, f.reporter,
                       f.host.empty() ? "?" : f.host, f.detail);
  return out;
}

std::vector<PeerFault> parseFaults(std::istream& in) {
  std::vector<PeerFault> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream l(line);
    PeerFault f;
    int kind = 0;
    if (!(l >> f.rank >> kind >> f.pid >> f.reporter >> f.host)) continue;
    f.kind = static_cast<FailureKind>(kind);
    std::getline(l >> std::ws, f.detail);
    out.push_back(f);
  }
  return out;
}

std::vector<PeerFault> parseFaults(const std::string& text) {
  std::istringstream in(text);
  return parseFaults(in);
}

void merge(std::vector<PeerFault>& into, const std::vector<PeerFault>& more) {
  for (const auto& f : more) {
    auto it = std::find_if(into.begin(), into.end(), [&](const PeerFault& g) { return g.rank == f.rank; });
    if (it == into.end()) into.push_back(f);
  }
}

std::string describeAll(const std::vector<PeerFault>& faults) {
  std::string out;
  for (const auto& f : faults) out += (out.empty() ? "" : "; ") + f.describe();
  return out;
}

Millis resolve(Millis given, const char* var) {
  return given.count() > 0 ? given : Millis(env::getMillis(var));
}

Member thisProcess() {
  return Member{hostName(), static_cast<int>(::getpid())};
}

std::string memberLine(int old_rank, const Member& m) {
  return fmt::format("{} {} {}\n", old_rank, m.host, m.pid);
}

// PeerFailure for dead or unreachable ranks, Timeout when all are only silent (hung).
std::exception_ptr faultError(const std::vector<PeerFault>& faults, const std::string& message) {
  std::vector<int> ranks;
  bool all_hung = !faults.empty(), store_lost = false;
  for (const auto& f : faults) {
    if (f.rank >= 0) ranks.push_back(f.rank);
    all_hung &= f.kind == FailureKind::kHung;
    store_lost |= f.kind == FailureKind::kStoreLost;
  }
  if (store_lost) return std::make_exception_ptr(SystemError(message, ranks));
  if (faults.empty()) return std::make_exception_ptr(Aborted(message, ranks));
  if (all_hung) return std::make_exception_ptr(Timeout(message, ranks));
  return std::make_exception_ptr(PeerFailure(message, ranks));
}

// "?" if the process is on another host (or unknown); else its state letter, "" if gone.
std::string processState(const Member& m) {
  if (m.host != hostName() || m.pid <= 0) return "?";
  std::ifstream in(fmt::format("/proc/{}/stat", m.pid));
  std::string text;
  if (!in || !std::getline(in, text)) return "";
  auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return "?";
  return std::string(1, text[close + 2]);
}

}  // namespace

bool goneOrExited(const std::string& state) {
  return state.empty() || state == "Z" || state == "X";
}

// Liveness while a new epoch's communicator is built. Setup (rank records, shm and UCX
// address exchange and handshakes) waits for every member; one that died after the
// decision would otherwise be waited for until CROSSBAR_CONNECT_TIMEOUT. This thread
// keeps this rank's heartbeat (the key the epoch's detector continues) and checks the
// others: a same-host process that is gone (or a zombie) is dead at once; a member
// whose heartbeat did not move for the detection bound since setup began is hung (or
// dead elsewhere); a revoke of the new epoch written by another member (its setup
// failed, or its detector saw a death once its setup was done) is adopted.
class SetupWatch {
 public:
  SetupWatch(std::shared_ptr<Store> epoch_store, std::vector<Member> members, int rank, Millis detect_timeout,
             Millis heartbeat_interval)
      : store_(std::move(epoch_store)),
        members_(std::move(members)),
        rank_(rank),
        detect_timeout_(detect_timeout),
        heartbeat_interval_(heartbeat_interval),
        last_hb_(members_.size(), -1),
        changed_(members_.size(), Clock::now()) {
    thread_ = std::thread([this] {
      nameThisThread("cb-ft-setup");
      run();
    });
  }
  ~SetupWatch() { stop(); }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  std::vector<PeerFault> faults() const {
    std::lock_guard<std::mutex> lock(mu_);
    return faults_;
  }
  bool failed() const { return failed_.load(); }

  // The setup failed with an error naming `named` (empty: nobody). Waits, up to the
  // detection bound plus a few periods, until it is clear whom to blame: whatever the
  // watch finds meanwhile (a member gone or silent, or another member's revoke: a
  // survivor whose own setup failed tears its half-built transports down, so the
  // hang-up we saw may only be the consequence), else a named member whose process is
  // gone. Named members still alive at the bound are unreachable if their heartbeat
  // moves (the transport failed, not the process), hung if it does not.
  std::vector<PeerFault> classify(const std::vector<int>& named) {
    const auto start = Clock::now();
    const Deadline deadline = Deadline::after(detect_timeout_ + 4 * heartbeat_interval_);
    std::set<int> pending;
    for (int r : named)
      if (r >= 0 && r < static_cast<int>(members_.size()) && r != rank_) pending.insert(r);
    while (!failed()) {
      for (int r : pending)
        if (goneOrExited(processState(members_[r]))) {
          std::lock_guard<std::mutex> lock(mu_);
          addLocked(r, FailureKind::kDead, "process gone (its connection failed during the setup)");
        }
      if (failed()) break;
      if (deadline.expired()) {
        std::lock_guard<std::mutex> lock(mu_);
        for (int r : pending) {
          if (changed_[r] > start + heartbeat_interval_)
            addLocked(r, FailureKind::kUnreachable, "its connection failed during the setup while its heartbeat continues");
          else
            addLocked(r, FailureKind::kHung, "its connection failed during the setup and no heartbeat since");
        }
        break;
      }
      std::this_thread::sleep_for(Millis(10));
    }
    return faults();
  }

 private:
  void addLocked(int r, FailureKind kind, std::string detail) {
    for (const auto& f : faults_)
      if (f.rank == r) return;
    faults_.push_back(PeerFault{r, kind, members_[r].host, members_[r].pid, rank_, std::move(detail)});
    failed_.store(true);
  }
  void run() {
    const int n = static_cast<int>(members_.size());
    auto last_tick = Clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      const auto now = Clock::now();
      if (now - last_tick > detect_timeout_ / 2)  // this thread was starved: silence proves nothing
        std::fill(changed_.begin(), changed_.end(), now);
      last_tick = now;
      lock.unlock();
      std::vector<std::pair<int, std::string>> dead;
      std::vector<std::pair<int, int64_t>> beats;
      std::set<int> stopped;  // state T: noted when it is reported hung
      std::vector<PeerFault> adopted;
      try {
        if (store_->check({"revoked"})) {
          std::istringstream in(toString(store_->get("revoked", Deadline::after(detect_timeout_))));
          std::string why;
          std::getline(in, why);
          adopted = parseFaults(in);
        }
        store_->add(fmt::format("hb/{}", rank_), 1);
        for (int r = 0; r < n; ++r) {
          if (r == rank_) continue;
          std::string state = processState(members_[r]);
          if (goneOrExited(state)) {
            dead.emplace_back(r, state.empty() ? "process gone" : "process exited (zombie)");
            continue;
          }
          beats.emplace_back(r, store_->add(fmt::format("hb/{}", r), 0));
          if (state == "T" || state == "t") stopped.insert(r);
        }
      } catch (const std::exception& e) {
        CB_TRACE("ft", "setup watch: store call failed: {}", e.what());  // setup's own calls report it
      }
      lock.lock();
      for (auto& f : adopted)
        if (f.rank >= 0 && f.rank < n && f.rank != rank_ &&
            std::none_of(faults_.begin(), faults_.end(), [&](const PeerFault& g) { return g.rank == f.rank; })) {
          faults_.push_back(f);  // under its own reporter
          failed_.store(true);
        }
      for (auto& [r, why] : dead) addLocked(r, FailureKind::kDead, why + " after the decision");
      for (auto& [r, v] : beats) {
        if (v != last_hb_[r]) {
          last_hb_[r] = v;
          changed_[r] = now;
        } else if (now - changed_[r] > detect_timeout_) {
          addLocked(r, FailureKind::kHung,
                    fmt::format("no heartbeat for {} ms while the new epoch was set up{}",
                                std::chrono::duration_cast<Millis>(now - changed_[r]).count(),
                                stopped.count(r) ? ", process stopped (state T)" : ""));
        }
      }
      cv_.wait_for(lock, heartbeat_interval_, [&] { return stopping_; });
    }
  }

  std::shared_ptr<Store> store_;
  std::vector<Member> members_;
  int rank_;
  Millis detect_timeout_, heartbeat_interval_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::atomic<bool> failed_{false};
  std::vector<PeerFault> faults_;
  std::vector<int64_t> last_hb_;            // per member: heartbeat counter last read
  std::vector<Clock::time_point> changed_;  // per member: when it last moved
  std::thread thread_;
};

namespace {

// The test hook CROSSBAR_FT_TEST_EXIT_AT ("E:R:STEP" or "E:R:STEP:stop"): the step at
// which this process, as rank `rank` of epoch `epoch`, kills (or stops) itself.
struct TestExit {
  std::string step;  // empty: the hook names another rank or epoch, or is off
  bool stop = false;  // SIGSTOP (hung) instead of SIGKILL (dead)
};
TestExit testExit(uint64_t epoch, int rank) {
  const std::string spec = env::getString("CROSSBAR_FT_TEST_EXIT_AT");
  if (spec.empty()) return {};
  const auto a = spec.find(':'), b = a == std::string::npos ? a : spec.find(':', a + 1);
  uint64_t e = 0;
  int r = -1;
  try {
    if (b == std::string::npos || b + 1 >= spec.size()) throw std::invalid_argument(spec);
    e = std::stoull(spec.substr(0, a));
    r = std::stoi(spec.substr(a + 1, b - a - 1));
  } catch (const std::logic_error&) {
    throw InvalidArgument(fmt::format("{}CROSSBAR_FT_TEST_EXIT_AT='{}' is not EPOCH:RANK:STEP[:stop]",
                                      errorContext(rank, "ft setup"), spec));
  }
  if (e != epoch || r != rank) return {};
  TestExit out{spec.substr(b + 1)};
  if (out.step.size() > 5 && out.step.ends_with(":stop")) {
    out.step.resize(out.step.size() - 5);
    out.stop = true;
  }
  return out;
}

// The store a new epoch's communicator is built over: its blocking calls run in 100 ms
// slices and end with PeerFailure / Timeout as soon as the SetupWatch found a member
// failed; checkpoint() does the same for the setup's other waits (comm/interrupt.h).
// The communicator keeps the store after setup; the watch is dropped then, and the
// calls go straight through.
class WatchedStore final : public Store {
 public:
  WatchedStore(std::shared_ptr<Store> inner, int rank, TestExit test_exit)
      : inner_(std::move(inner)), rank_(rank), test_exit_(std::move(test_exit)) {}
  void watch(std::shared_ptr<SetupWatch> w, std::string what) {
    std::lock_guard<std::mutex> lock(mu_);
    watch_ = std::move(w);
    what_ = std::move(what);
  }
  // An interruption point of the setup: a wait's name or a store key.
  void checkpoint(std::string_view step) {
    maybeExit(step);
    throwIfFailed(step);
  }
  void set(const std::string& key, const Bytes& value) override {
    maybeExit(key);
    inner_->set(key, value);
  }
  Bytes get(const std::string& key, Deadline deadline) override {
    maybeExit(key);
    while (true) {
      throwIfFailed(key);
      try {
        return inner_->get(key, watching() ? deadline.min(Deadline::after(kSlice)) : deadline);
      } catch (const Timeout&) {
        if (deadline.expired() || !watching()) throw;
      }
    }
  }
  int64_t add(const std::string& key, int64_t delta) override {
    maybeExit(key);
    return inner_->add(key, delta);
  }
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    maybeExit(key);
    return inner_->compareSet(key, expected, desired);
  }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  void wait(const std::vector<std::string>& keys, Deadline deadline) override {
    for (const auto& k : keys) maybeExit(k);
    while (true) {
      throwIfFailed(keys.empty() ? std::string() : keys.front());
      try {
        inner_->wait(keys, watching() ? deadline.min(Deadline::after(kSlice)) : deadline);
        return;
      } catch (const Timeout&) {
        if (deadline.expired() || !watching()) throw;
      }
    }
  }
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  int64_t numKeys() override { return inner_->numKeys(); }

 private:
  static constexpr Millis kSlice{100};
  void maybeExit(std::string_view step) const {
    if (test_exit_.step.empty() || step.find(test_exit_.step) == std::string_view::npos) return;
    CB_WARN("ft", "CROSSBAR_FT_TEST_EXIT_AT: rank {} {} itself at '{}'", rank_, test_exit_.stop ? "stops" : "kills",
            step);
    ::kill(::getpid(), test_exit_.stop ? SIGSTOP : SIGKILL);
  }
  bool watching() {
    std::lock_guard<std::mutex> lock(mu_);
    return watch_ != nullptr;
  }
  void throwIfFailed(std::string_view key) {
    std::shared_ptr<SetupWatch> w;
    std::string what;
    {
      std::lock_guard<std::mutex> lock(mu_);
      w = watch_;
      what = what_;
    }
    if (!w || !w->failed()) return;
    auto faults = w->faults();
    std::rethrow_exception(faultError(
        faults, fmt::format("{}{} while waiting for '{}' in the setup of {}", errorContext(rank_, "ft setup"),
                            describeAll(faults), printableKey(std::string(key)), what)));
  }

  std::shared_ptr<Store> inner_;
  int rank_;
  const TestExit test_exit_;  // CROSSBAR_FT_TEST_EXIT_AT for this rank and epoch, usually off
  std::mutex mu_;
  std::shared_ptr<SetupWatch> watch_;
  std::string what_;
};

}  // namespace

const char* failureKindName(FailureKind kind) {
  switch (kind) {
    case FailureKind::kDead:
      return "dead";
    case FailureKind::kHung:
      return "hung";
    case FailureKind::kUnreachable:
      return "unreachable";
    case FailureKind::kStoreLost:
      return "store lost";
  }
  return "?";
}

std::string PeerFault::describe() const {
  const char* what = "failed";
  switch (kind) {
    case FailureKind::kDead:
      what = "died";
      break;
    case FailureKind::kHung:
      what = "is not responding (hung or stopped; reported as a timeout)";
      break;
    case FailureKind::kUnreachable:
      what = "is alive but unreachable (link failure)";
      break;
    case FailureKind::kStoreLost:
      return fmt::format("the store stopped answering ({})", detail);
  }
  return fmt::format("rank {} (host {}, pid {}) {}{}{}", rank, host, pid, what, detail.empty() ? "" : ": ",
                     detail);
}

std::string Member::id() const {
  return fmt::format("{}:{}", host, pid);
}

// ------------------------------------------------------------------------------------
// FailureDetector

FailureDetector::FailureDetector(std::shared_ptr<Store> epoch_store, std::shared_ptr<Communicator> comm,
                                 std::vector<Member> members, Millis detect_timeout,
                                 Millis heartbeat_interval, std::shared_ptr<CallbackList> callbacks,
                                 bool data_path_probes)
    : store_(std::move(epoch_store)),
      comm_(std::move(comm)),
      members_(std::move(members)),
      epoch_(comm_->epoch()),
      rank_(comm_->rank()),
      detect_timeout_(detect_timeout),
      heartbeat_interval_(heartbeat_interval),
      callbacks_(std::move(callbacks)) {
  const auto now = Clock::now();
  last_hb_.assign(members_.size(), -1);
  last_change_.assign(members_.size(), now);
  last_tick_ = last_heartbeat_ = now;
  // Peers on other nodes are reached over the network, which can fail on its own.
  for (int r = 0; data_path_probes && r < static_cast<int>(members_.size()); ++r)
    if (r != rank_ && std::string_view(comm_->context().transportName(comm_->worldRank(r))) == "ucx")
      probes_.push_back(Probe{r, nullptr, {}, now, false, false});
  for (auto& p : probes_) p.ready = peerReady(p.rank);  // usually all: members finish setup together
  thread_ = std::thread([this] {
    nameThisThread("cb-ft-detect");
    run();
  });
}

FailureDetector::~FailureDetector() {
  stop();
}

void FailureDetector::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  flushRevoke();  // survivors must learn of a revoke even if we move on at once
}

std::vector<PeerFault> FailureDetector::faults() const {
  std::lock_guard<std::mutex> lock(mu_);
  return faults_;
}

void FailureDetector::run() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, heartbeat_interval_, [&] { return stopping_ || !pending_revoke_.empty(); });
      if (stopping_) return;
    }
    const auto now = Clock::now();
    const bool heartbeat = now - last_heartbeat_ >= 2 * heartbeat_interval_;
    try {
      tick(heartbeat);
    } catch (const std::exception& e) {
      CB_WARN("ft", "failure detector of epoch {}: {}", epoch_, e.what());
    }
    if (heartbeat) last_heartbeat_ = now;
  }
}

bool FailureDetector::processGone(int rank, char* state) const {
  *state = '?';
  if (members_[rank].host != hostName() || members_[rank].pid <= 0) return false;
  std::ifstream in(fmt::format("/proc/{}/stat", members_[rank].pid));
  std::string text;
  if (!in || !std::getline(in, text)) return true;
  auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  *state = text[close + 2];
  return *state == 'Z' || *state == 'X';  // a zombie is dead, only not yet reaped
}

bool FailureDetector::peerReady(int rank) {
  try {
    return store_->check({fmt::format("ready/{}", rank)});
  } catch (const std::exception&) {
    return false;  // tick() reports a store that stays unreachable
  }
}

bool FailureDetector::leftCleanly(int rank) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (left_.count(rank)) return true;
  }
  try {
    if (!store_->check({fmt::format("left/{}", rank)})) return false;
  } catch (const std::exception&) {
    return false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  left_.insert(rank);
  return true;
}

void FailureDetector::tick(bool heartbeat) {
  const auto now = Clock::now();
  // If this thread itself was starved (loaded machine), peers' silence proves nothing.
  if (now - last_tick_ > detect_timeout_ / 2) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& t : last_change_) t = now;
    for (auto& p : probes_) p.last_seen = now;
  }
  last_tick_ = now;

  const int n = static_cast<int>(members_.size());
  std::vector<PeerFault> found;
  // Ranks this detector accused itself (or that left) need no more checks. One known only
  // from another rank's revoke is still checked: should the agreement leave that reporter
  // out (it hung or died too), its accusations no longer count, and this rank's own
  // finding is what keeps a dead peer out of the next epoch.
  std::set<int> known;
  for (const auto& f : faults())
    if (f.reporter == rank_) known.insert(f.rank);
  {
    std::lock_guard<std::mutex> lock(mu_);
    known.insert(left_.begin(), left_.end());
  }
  auto fault = [&](int r, FailureKind kind, std::string detail) {
    known.insert(r);
    if (leftCleanly(r)) return;
    found.push_back(PeerFault{r, kind, members_[r].host, members_[r].pid, rank_, std::move(detail)});
  };
  for (int r = 0; r < n; ++r) {
    char state;
    if (r != rank_ && !known.count(r) && processGone(r, &state))
      fault(r, FailureKind::kDead, state == '?' ? "process gone" : "process exited (zombie)");
  }

  flushRevoke();
  try {
    if (heartbeat) {
      store_->add(fmt::format("hb/{}", rank_), 1);
      for (int r = 0; r < n; ++r) {
        if (r == rank_ || known.count(r)) continue;
        int64_t v = store_->add(fmt::format("hb/{}", r), 0);
        Clock::time_point changed;
        {
          std::lock_guard<std::mutex> lock(mu_);  // classify() reads last_change_
          if (v != last_hb_[r]) {
            last_hb_[r] = v;
            last_change_[r] = now;
          }
          changed = last_change_[r];
        }
        if (now - changed > detect_timeout_) {
          char state;
          bool gone = processGone(r, &state);
          std::string detail = fmt::format("no heartbeat for {} ms{}",
                                           std::chrono::duration_cast<Millis>(now - changed).count(),
                                           state == 'T' || state == 't' ? ", process stopped (state T)" : "");
          fault(r, gone ? FailureKind::kDead : FailureKind::kHung, detail);
        }
      }
    }
    if (!revoked_.load() && store_->check({"revoked"}))
      adopt(toString(store_->get("revoked", Deadline::after(detect_timeout_))));
    store_failing_ = false;
  } catch (const std::exception& e) {
    if (!store_failing_) {
      store_failing_ = true;
      store_ok_since_ = now;
    } else if (now - store_ok_since_ > detect_timeout_ && !revoked_.load()) {
      found.push_back(PeerFault{-1, FailureKind::kStoreLost, "", 0, rank_, e.what()});
    }
  }
  probe(heartbeat, known, found);
  if (!found.empty()) revoke(found, fmt::format("detected by rank {}", rank_));
}

void FailureDetector::probe(bool send, const std::set<int>& known, std::vector<PeerFault>& found) {
  if (probes_.empty() || revoked_.load() || comm_->aborted()) return;
  const auto now = Clock::now();
  for (auto& p : probes_) {
    if (known.count(p.rank)) continue;
    try {
      // Every probe that arrived counts; the receive is reposted (bounded per tick).
      for (int i = 0; i < 64 && !p.broken; ++i) {
        if (!p.recv) p.recv = comm_->irecv(nullptr, 0, p.rank, kProbeTag);
        if (!p.recv->test()) break;
        p.last_seen = now;
        p.ready = true;
        p.recv.reset();
      }
      if (send && !p.broken) {
        // The receive's test() progressed; a failed send rethrows here, outside the
        // erase (a throwing predicate would leave moved-from, null entries behind).
        // One look per send: a send that fails between a rethrow pass and the erase would be
        // dropped with its failure unseen.
        RequestPtr failed;
        std::erase_if(p.sends, [&](const RequestPtr& r) {
          if (!r->done()) return false;
          if (r->failed() && !failed) failed = r;
          return true;
        });
        if (failed) failed->rethrowIfFailed();
        if (p.sends.size() < kMaxProbeSends) p.sends.push_back(comm_->isend(nullptr, 0, p.rank, kProbeTag));
      }
    } catch (const std::exception& e) {
      p.recv.reset();  // zero-byte requests: the transport may complete them after we let go
      p.sends.clear();
      if (comm_->aborted()) return;  // the epoch ended: not this peer's doing
      if (!p.broken)
        CB_INFO("ft", "epoch {}: data-path probe to rank {} failed: {}", epoch_, p.rank, e.what());
      p.broken = true;  // silent from now on; the check below decides what it means
      p.ready = true;   // the transport itself failed: that counts whatever the peer's setup
    }
    if (!p.ready && peerReady(p.rank)) {
      p.ready = true;
      p.last_seen = now;  // its silence counts from here
    }
    // Silent on the data path, yet its store heartbeat is fresh: the process runs but
    // the network between us does not carry its messages.
    Clock::time_point heartbeat;
    {
      std::lock_guard<std::mutex> lock(mu_);
      heartbeat = last_change_[p.rank];
    }
    if (p.ready && now - p.last_seen > detect_timeout_ && now - heartbeat < detect_timeout_ / 2 &&
        !leftCleanly(p.rank)) {
      found.push_back(
          PeerFault{p.rank, FailureKind::kUnreachable, members_[p.rank].host, members_[p.rank].pid, rank_,
                    fmt::format("no data-path probe over {} for {} ms while its store heartbeat continues",
                                comm_->context().transportName(comm_->worldRank(p.rank)),
                                std::chrono::duration_cast<Millis>(now - p.last_seen).count())});
    }
  }
  // A cut link usually cuts a whole node off. Once a revoke goes out nobody probes any
  // more, so report now the cut peer's node-mates that were silent for over half the
  // bound too (their last probe may just have slipped through): otherwise the revoke
  // names only some ranks of that node and a leader among the others keeps both sides.
  std::set<int> cut_nodes;
  for (const auto& f : found)
    if (f.kind == FailureKind::kUnreachable) cut_nodes.insert(comm_->nodeOf(f.rank));
  for (auto& p : probes_) {
    if (cut_nodes.empty()) break;
    if (known.count(p.rank) || !cut_nodes.count(comm_->nodeOf(p.rank))) continue;
    if (std::any_of(found.begin(), found.end(), [&](const PeerFault& f) { return f.rank == p.rank; })) continue;
    Clock::time_point heartbeat;
    {
      std::lock_guard<std::mutex> lock(mu_);
      heartbeat = last_change_[p.rank];
    }
    if (p.ready && now - p.last_seen > detect_timeout_ / 2 && now - heartbeat < detect_timeout_ / 2 &&
        !leftCleanly(p.rank))
      found.push_back(
          PeerFault{p.rank, FailureKind::kUnreachable, members_[p.rank].host, members_[p.rank].pid, rank_,
                    fmt::format("no data-path probe over {} for {} ms while its store heartbeat continues, and "
                                "a peer on its node is cut off",
                                comm_->context().transportName(comm_->worldRank(p.rank)),
                                std::chrono::duration_cast<Millis>(now - p.last_seen).count())});
  }
}

std::exception_ptr FailureDetector::errorFor(const std::vector<PeerFault>& faults,
                                             const std::string& message) const {
  return faultError(faults, message);
}

void FailureDetector::revoke(std::vector<PeerFault> faults, const std::string& why) {
  std::vector<PeerFault> all, fresh, confirmed;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& f : faults) {
      auto it = std::find_if(faults_.begin(), faults_.end(), [&](const PeerFault& g) { return g.rank == f.rank; });
      if (it == faults_.end()) {
        fresh.push_back(f);
      } else if (f.reporter == rank_ && it->reporter != rank_) {
        *it = f;  // an adopted accusation, now this rank's own (see tick())
        confirmed.push_back(f);
      }
    }
    merge(faults_, fresh);
    all = faults_;
    first = !revoked_.exchange(true);
    bool store_lost =
        std::any_of(all.begin(), all.end(), [](auto& f) { return f.kind == FailureKind::kStoreLost; });
    // The store write happens on the detector thread, so revoke() never blocks on the store.
    if ((first || !fresh.empty() || !confirmed.empty()) && !store_lost) pending_revoke_ = why + "\n" + serialize(all);
  }
  cv_.notify_all();
  if (!confirmed.empty())
    CB_INFO("ft", "rank {}: epoch {}: confirmed here: {}", rank_, epoch_, describeAll(confirmed));
  if (!first && fresh.empty()) return;
  std::string message = fmt::format(
      "{}communicator '{}' epoch {} revoked ({}): {}. Operations on it fail; call shrink() on the survivors "
      "(crossbar::ft) to continue without the failed ranks",
      errorContext(rank_, "fault tolerance"), comm_->name(), epoch_, why,
      all.empty() ? std::string("no rank blamed") : describeAll(all));
  if (first) {
    CB_WARN("ft", "{}", message);
    abortEpoch(why, errorFor(all, message));
  }
  fire(FailureEvent{epoch_, first ? all : fresh, true, message});
}

void FailureDetector::flushRevoke() {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(mu_);
    text.swap(pending_revoke_);
  }
  if (text.empty()) return;
  try {
    // First writer wins; later ones add their own findings under their rank.
    store_->compareSet("revoked", {}, toBytes(text));
    store_->set(fmt::format("revoked_by/{}", rank_), text);
  } catch (const std::exception& e) {
    CB_WARN("ft", "could not publish the revoke of epoch {}: {}", epoch_, e.what());
  }
}

void FailureDetector::adopt(const std::string& text) {
  std::istringstream in(text);
  std::string why;
  std::getline(in, why);
  auto faults = parseFaults(in);
  std::vector<PeerFault> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (revoked_.exchange(true)) return;
    merge(faults_, faults);
    all = faults_;
  }
  std::string message = fmt::format(
      "{}communicator '{}' epoch {} was revoked by another rank ({}): {}. Call shrink() on the survivors "
      "(crossbar::ft) to continue without the failed ranks",
      errorContext(rank_, "fault tolerance"), comm_->name(), epoch_, why,
      all.empty() ? std::string("no rank blamed") : describeAll(all));
  CB_WARN("ft", "{}", message);
  abortEpoch(why, errorFor(all, message));
  fire(FailureEvent{epoch_, all, false, message});
}

std::vector<PeerFault> FailureDetector::classify(const std::vector<int>& ranks) {
  // Dead: the pid check says so. Alive: its heartbeat moves after this call began
  // (then the transport, not the process, failed). A revoke by someone else first
  // means the error was only the consequence of their abort.
  const auto start = Clock::now();
  const Deadline deadline = Deadline::after(detect_timeout_ + 4 * heartbeat_interval_);
  std::vector<PeerFault> found;
  std::set<int> pending(ranks.begin(), ranks.end());
  pending.erase(rank_);
  for (const auto& f : faults()) pending.erase(f.rank);
  while (!pending.empty() && !revoked_.load()) {
    for (auto it = pending.begin(); it != pending.end();) {
      int r = *it;
      char state;
      bool moved;
      {
        std::lock_guard<std::mutex> lock(mu_);
        moved = r < static_cast<int>(last_change_.size()) && last_change_[r] > start + heartbeat_interval_;
      }
      if (r < 0 || r >= static_cast<int>(members_.size()) || leftCleanly(r)) {
        it = pending.erase(it);
      } else if (processGone(r, &state)) {
        found.push_back(PeerFault{r, FailureKind::kDead, members_[r].host, members_[r].pid, rank_,
                                  "transport hang-up; process gone"});
        it = pending.erase(it);
      } else if (moved) {
        found.push_back(PeerFault{r, FailureKind::kUnreachable, members_[r].host, members_[r].pid, rank_,
                                  "transport failed while its heartbeat continues"});
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
    if (pending.empty()) break;
    if (deadline.expired()) {
      for (int r : pending)
        found.push_back(PeerFault{r, FailureKind::kHung, members_[r].host, members_[r].pid, rank_,
                                  "transport failed and no heartbeat since"});
      break;
    }
    std::this_thread::sleep_for(Millis(10));
  }
  if (!found.empty() || !revoked_.load()) revoke(found, fmt::format("detected by rank {}", rank_));
  return faults();
}

std::vector<PeerFault> FailureDetector::blameDead(const std::vector<int>& ranks, const std::string& why) {
  std::vector<PeerFault> dead;
  for (int r : ranks) {
    char state;
    if (r >= 0 && r < static_cast<int>(members_.size()) && r != rank_ && !leftCleanly(r) &&
        processGone(r, &state))
      dead.push_back(PeerFault{r, FailureKind::kDead, members_[r].host, members_[r].pid, rank_,
                               "an operation on it failed; process gone"});
  }
  revoke(dead, dead.empty() ? why : fmt::format("detected by rank {}", rank_));
  return faults();
}

void FailureDetector::abortEpoch(const std::string& why, std::exception_ptr error) {
  comm_->abort(why, error);
  if (!callbacks_) return;
  std::vector<std::shared_ptr<EpochResource>> resources;
  {
    std::lock_guard<std::mutex> lock(callbacks_->mu);
    resources = callbacks_->resources;
  }
  for (auto& r : resources) {
    try {
      r->abortEpoch(why, error);
    } catch (const std::exception& e) {
      CB_WARN("ft", "aborting a resource of epoch {} failed: {}", epoch_, e.what());
    }
  }
}

void FailureDetector::fire(const FailureEvent& event) {
  if (!callbacks_) return;
  std::vector<FailureCallback> list;
  {
    std::lock_guard<std::mutex> lock(callbacks_->mu);
    list = callbacks_->list;
  }
  for (auto& cb : list) {
    try {
      cb(event);
    } catch (const std::exception& e) {
      CB_WARN("ft", "failure callback threw: {}", e.what());
    }
  }
}

Agreement agree(int size, int leader, const std::map<int, std::vector<PeerFault>>& views,
                const std::set<int>& left) {
  struct Accusation {
    int reporter, accused;
  };
  std::vector<Accusation> all;
  for (const auto& [poster, view] : views)
    for (const auto& f : view) {
      const int reporter = f.reporter >= 0 && f.reporter < size ? f.reporter : poster;
      if (f.rank < 0 || f.rank >= size || f.rank == reporter) continue;
      all.push_back({reporter, f.rank});
    }
  std::stable_sort(all.begin(), all.end(), [&](const Accusation& a, const Accusation& b) {
    const bool al = a.reporter == leader, bl = b.reporter == leader;
    if (al != bl) return al;
    return std::tie(a.reporter, a.accused) < std::tie(b.reporter, b.accused);
  });
  Agreement out;
  for (int r : left)
    if (r != leader) out.excluded.insert(r);
  for (const auto& a : all) {
    if (out.excluded.count(a.reporter)) continue;
    out.excluded.insert(a.accused == leader ? a.reporter : a.accused);
  }
  for (int r = 0; r < size; ++r) {
    if (out.excluded.count(r)) continue;
    (views.count(r) ? out.members : out.waiting).push_back(r);
  }
  return out;
}

// ------------------------------------------------------------------------------------
// FaultTolerantComm

std::string FaultTolerantComm::epochPrefix(uint64_t epoch) const {
  return fmt::format("e{}", epoch);
}

std::shared_ptr<Store> FaultTolerantComm::epochStore(uint64_t epoch, bool detector) const {
  return std::make_shared<PrefixStore>(epochPrefix(epoch), detector ? detector_store_ : store_);
}

std::unique_ptr<FaultTolerantComm> FaultTolerantComm::create(std::shared_ptr<Store> store, int rank, int size,
                                                             FtOptions options) {
  if (!store) throw InvalidArgument(errorContext(rank, "ft create") + "store is null");
  if (size <= 0 || rank < 0 || rank >= size)
    throw InvalidArgument(
        fmt::format("{}rank {} / size {} is out of range", errorContext(rank, "ft create"), rank, size));
  std::unique_ptr<FaultTolerantComm> ft(new FaultTolerantComm());
  ft->options_ = options;
  ft->callbacks_ = std::make_shared<CallbackList>();
  ft->store_ = std::make_shared<PrefixStore>("crossbar/ft/" + options.name, store);
  ft->detector_store_ = options.detector_store ? std::make_shared<PrefixStore>("crossbar/ft/" + options.name,
                                                                               options.detector_store)
                                               : ft->store_;
  ft->detect_timeout_ = resolve(options.detect_timeout, "CROSSBAR_FT_DETECT_TIMEOUT");
  ft->heartbeat_interval_ = resolve(options.heartbeat_interval, "CROSSBAR_FT_HEARTBEAT");
  // Everyone learns everyone's process (for pid liveness and to recognise itself later).
  auto e0 = ft->epochStore(0, false);
  Member me = thisProcess();
  e0->set(fmt::format("member/{}", rank), memberLine(rank, me));
  auto deadline = Deadline::after(Millis(env::getMillis("CROSSBAR_CONNECT_TIMEOUT")));
  std::string decision = "create 0\n";
  for (int r = 0; r < size; ++r) {
    try {
      decision += toString(e0->get(fmt::format("member/{}", r), deadline));
    } catch (const Timeout&) {
      throw Timeout(fmt::format("{}rank {} never joined the fault-tolerant communicator '{}' (size {})",
                                errorContext(rank, "ft create"), r, options.name, size),
                    {r});
    }
  }
  ft->epoch_ = 0;
  ft->applyDecision(decision, /*first=*/true);
  return ft;
}

std::unique_ptr<FaultTolerantComm> FaultTolerantComm::join(std::shared_ptr<Store> store, FtOptions options) {
  if (!store) throw InvalidArgument(errorContext(-1, "ft join") + "store is null");
  std::unique_ptr<FaultTolerantComm> ft(new FaultTolerantComm());
  ft->options_ = options;
  ft->callbacks_ = std::make_shared<CallbackList>();
  ft->store_ = std::make_shared<PrefixStore>("crossbar/ft/" + options.name, store);
  ft->detector_store_ = options.detector_store ? std::make_shared<PrefixStore>("crossbar/ft/" + options.name,
                                                                               options.detector_store)
                                               : ft->store_;
  ft->detect_timeout_ = resolve(options.detect_timeout, "CROSSBAR_FT_DETECT_TIMEOUT");
  ft->heartbeat_interval_ = resolve(options.heartbeat_interval, "CROSSBAR_FT_HEARTBEAT");
  Millis timeout = options.comm.timeout.count() > 0 ? options.comm.timeout : defaultTimeout();
  int64_t slot = ft->store_->add("joinq/count", 1) - 1;
  ft->store_->set(fmt::format("joinq/{}", slot), memberLine(-1, thisProcess()));
  CB_INFO("ft", "joining '{}' as candidate {}", options.name, slot);
  uint64_t epoch = 0;
  try {
    epoch =
        std::stoull(toString(ft->store_->get(fmt::format("joinq/{}/epoch", slot), Deadline::after(timeout))));
  } catch (const Timeout&) {
    throw Timeout(
        fmt::format("{}no member of '{}' admitted this process within {} ms; the members must call "
                    "grow() (candidate {} in the join queue)",
                    errorContext(-1, "ft join"), options.name, timeout.count(), slot));
  }
  ft->epoch_ = epoch - 1;
  std::string decision =
      toString(ft->store_->get(fmt::format("e{}/decision", epoch - 1), Deadline::after(timeout)));
  ft->applyDecision(decision, /*first=*/true);
  return ft;
}

FaultTolerantComm::~FaultTolerantComm() {
  close();
}

void FaultTolerantComm::close() {
  if (!detector_ && !setupFailed()) return;
  try {
    epochStore(epoch_, true)->set(fmt::format("left/{}", rank_), "1");
  } catch (const std::exception& e) {
    CB_WARN("ft", "could not announce leaving epoch {}: {}", epoch_, e.what());
  }
  if (detector_) detector_->stop();
  detector_.reset();
  failed_setup_watch_.reset();
  comm_.reset();
  ucx_fabric_.reset();  // the UCX worker goes with the last context still using it
  setup_faults_.clear();
}

void FaultTolerantComm::onFailure(FailureCallback callback) {
  std::lock_guard<std::mutex> lock(callbacks_->mu);
  callbacks_->list.push_back(std::move(callback));
}

void FaultTolerantComm::abort(const std::string& reason) {
  if (detector_) detector_->revoke({}, reason);
}

void FaultTolerantComm::attach(std::shared_ptr<EpochResource> resource) {
  if (!resource) throw InvalidArgument(errorContext(-1, "ft attach") + "resource is null");
  std::lock_guard<std::mutex> lock(callbacks_->mu);
  callbacks_->resources.push_back(std::move(resource));
}

void FaultTolerantComm::detach(const EpochResource* resource) {
  std::lock_guard<std::mutex> lock(callbacks_->mu);
  std::erase_if(callbacks_->resources, [&](const auto& r) { return r.get() == resource; });
}

std::vector<PeerFault> FaultTolerantComm::handleError(const std::exception& error) {
  auto* e = dynamic_cast<const Error*>(&error);
  requireOpen("handleError");
  if (setupFailed()) return setup_faults_;  // the failed setup already named them
  if (detector_->revoked()) return detector_->faults();
  if (e && !e->peers().empty() && (e->code() == ErrorCode::kPeerFailure || e->code() == ErrorCode::kTimeout))
    return detector_->classify(e->peers());
  if (e && !e->peers().empty()) return detector_->blameDead(e->peers(), error.what());
  detector_->revoke({}, error.what());
  return detector_->faults();
}

void FaultTolerantComm::enter(uint64_t epoch, std::vector<Member> members, int my_rank) {
  CommOptions co = options_.comm;
  co.epoch = epoch;
  if (!ucx_fabric_) ucx_fabric_ = std::make_shared<ucx::Fabric>();
  co.ucx_fabric = ucx_fabric_;
  if (co.name.empty()) co.name = options_.name;
  epoch_ = epoch;
  members_ = members;
  rank_ = my_rank;
  setup_faults_.clear();
  auto ctx_store = std::make_shared<WatchedStore>(
      std::make_shared<PrefixStore>(epochPrefix(epoch) + "/ctx", store_), my_rank, testExit(epoch, my_rank));
  // Started by applyDecision before the old epoch is torn down (that can take seconds:
  // bounded UCX endpoint closes), so this rank's heartbeat never pauses meanwhile.
  auto watch = std::move(setup_watch_);
  if (!watch)
    watch = std::make_shared<SetupWatch>(epochStore(epoch, true), members, my_rank, detect_timeout_,
                                         heartbeat_interval_);
  ctx_store->watch(watch, fmt::format("epoch {} of '{}'", epoch, options_.name));
  try {
    // Socket connect/accept and the UCX handshake wait for every member too: they
    // end within kInterruptSlice once the watch found one failed.
    ScopedInterruptCheck interrupt([&](std::string_view step) { ctx_store->checkpoint(step); });
    comm_ = Communicator::create(ctx_store, my_rank, static_cast<int>(members.size()), co);
  } catch (const Error& e) {
    // A member failed after the decision (or during setup): find out who, tell the
    // others (the revoke key of the new epoch ends their setups, and members whose
    // setup finished learn it from their detector) and let the caller shrink again.
    // The watch, with this rank's heartbeat, runs until the revoke is out. Errors of
    // the caller's own making (bad arguments, usage, crossbar bugs) blame nobody.
    ctx_store->watch(nullptr, {});
    const bool ours = e.code() == ErrorCode::kInvalidArgument || e.code() == ErrorCode::kInvalidUsage ||
                      e.code() == ErrorCode::kInternal || e.code() == ErrorCode::kUnsupported;
    setup_faults_ = ours ? std::vector<PeerFault>() : watch->classify(e.peers());
    if (setup_faults_.empty()) {
      watch->stop();
      throw;
    }
    const std::string why = fmt::format("setup failed at rank {}", my_rank);
    try {
      auto es = epochStore(epoch, true);
      std::string text = why + "\n" + serialize(setup_faults_);
      std::string stored = toString(es->compareSet("revoked", {}, toBytes(text)));
      es->set(fmt::format("revoked_by/{}", my_rank), text);
      std::istringstream in(stored);
      std::string first_why;
      std::getline(in, first_why);
      merge(setup_faults_, parseFaults(in));
    } catch (const std::exception& store_error) {
      CB_WARN("ft", "could not publish the failed setup of epoch {}: {}", epoch, store_error.what());
    }
    // Not stopped: the agreement that follows needs this rank's heartbeat, and the
    // watch's verdicts on the others (a leader dying now would otherwise be waited for
    // until CROSSBAR_TIMEOUT: no detector exists for a failed epoch).
    failed_setup_watch_ = watch;
    std::string message = fmt::format(
        "{}building epoch {} of '{}' failed: {}. Call handleError() and shrink() again to continue without "
        "them (cause: {})",
        errorContext(my_rank, "ft setup"), epoch, options_.name, describeAll(setup_faults_), e.what());
    CB_WARN("ft", "{}", message);
    std::rethrow_exception(faultError(setup_faults_, message));
  }
  watch->stop();
  ctx_store->watch(nullptr, {});
  // Peers' detectors count this rank's data-path silence from here (FailureDetector::Probe).
  try {
    epochStore(epoch, true)->set(fmt::format("ready/{}", my_rank), "1");
  } catch (const std::exception& e) {
    CB_WARN("ft", "could not announce epoch {} as built: {}", epoch, e.what());  // the detector reports the store
  }
  detector_ =
      std::make_unique<FailureDetector>(epochStore(epoch, true), comm_, std::move(members), detect_timeout_,
                                        heartbeat_interval_, callbacks_, options_.data_path_probes);
  if (my_rank == 0) store_->set("epoch", std::to_string(epoch));
}

std::string FaultTolerantComm::awaitDecision(const std::function<std::string()>& leader_decide,
                                             bool shrinking) {
  auto es = epochStore(epoch_, false);
  const Deadline overall = operationDeadline();
  const std::string op = shrinking ? "shrink" : "grow";
  while (true) {
    if (es->check({"decision"})) return toString(es->get("decision", overall));
    // Leader: the lowest rank no known fault names, own or adopted from a revoke. Adopted
    // "unreachable" faults count too: after a revoke nobody probes any more, so for a
    // cut link seen by one side only, the far side's accusation is the only evidence
    // (a rank on the accused side must then not lead: it would keep both sides).
    std::set<int> failed;
    for (const auto& f : currentFaults()) failed.insert(f.rank);
    int leader = 0;
    while (failed.count(leader)) ++leader;
    if (leader == rank_) return leader_decide();
    try {
      return toString(
          es->get("decision", Deadline::after(std::max(Millis(200), 2 * heartbeat_interval_)).min(overall)));
    } catch (const Timeout&) {
      if (overall.expired())
        throw Timeout(fmt::format("{}rank {} (host {}) did not publish the membership of epoch {} in time",
                                  errorContext(rank_, op), leader, members_[leader].host, epoch_ + 1),
                      {leader});
    }
  }
}

std::vector<PeerFault> FaultTolerantComm::currentFaults() const {
  if (detector_) return detector_->faults();
  std::vector<PeerFault> faults = setup_faults_;
  if (failed_setup_watch_ && setupFailed()) merge(faults, failed_setup_watch_->faults());
  return faults;
}

Deadline FaultTolerantComm::operationDeadline() const {
  if (comm_) return comm_->defaultDeadline();
  return Deadline::after(options_.comm.timeout.count() > 0 ? options_.comm.timeout : defaultTimeout());
}

void FaultTolerantComm::requireOpen(const char* op) const {
  if ((!detector_ || !comm_) && !setupFailed())
    throw InvalidUsage(fmt::format("{}this process left '{}' (closed, or excluded by an earlier shrink)",
                                   errorContext(-1, op), options_.name));
}

std::shared_ptr<Communicator> FaultTolerantComm::shrink() {
  requireOpen("shrink");
  const int me = rank_, n = size();
  if (detector_ && !detector_->revoked()) detector_->revoke({}, fmt::format("rank {} called shrink()", me));
  auto es = epochStore(epoch_, false);
  es->set(fmt::format("view/{}", me), serialize(currentFaults()));

  auto decide = [&]() -> std::string {
    // Collect views until every rank that no standing accusation excludes has posted
    // one. A rank that is alive is waited for up to the operation deadline: it may be
    // busy (a long training step, a starved process) and post at its next call, and
    // leaving a healthy rank out costs the job that rank. One that dies or hangs
    // meanwhile is accused by this rank's own detector (or setup watch) within the
    // detection bound, and is no longer waited for.
    // (Ends a detection bound before the others stop waiting for the decision.)
    const Deadline views_deadline =
        Deadline::after(std::max<Millis>(2 * detect_timeout_, operationDeadline().remaining() - detect_timeout_));
    auto next_note = Clock::now() + detect_timeout_;
    std::map<int, std::vector<PeerFault>> views;
    std::set<int> left;
    Agreement agreed;
    while (true) {
      views[me] = currentFaults();
      agreed = agree(n, me, views, left);
      for (int r : agreed.waiting) {
        std::string key = fmt::format("view/{}", r);
        if (es->check({key}))
          views[r] = parseFaults(toString(es->get(key, views_deadline)));
        else if (es->check({fmt::format("left/{}", r)}))
          left.insert(r);
      }
      agreed = agree(n, me, views, left);
      if (agreed.waiting.empty() || views_deadline.expired()) break;
      if (Clock::now() >= next_note) {
        std::vector<std::string> hosts;
        for (int r : agreed.waiting) hosts.push_back(members_[r].host);
        CB_WARN("ft",
                "rank {} (leader of epoch {}) still waits for {}: alive, but not in shrink() yet; left out at the "
                "operation deadline (CROSSBAR_TIMEOUT), or as soon as found dead or hung",
                me, epoch_ + 1, formatPeers(agreed.waiting, hosts));
        next_note = Clock::now() + detect_timeout_;
      }
      std::this_thread::sleep_for(Millis(5));
    }
    std::string text = fmt::format("shrink {}\n", epoch_ + 1);
    for (int r : agreed.members) text += memberLine(r, members_[r]);
    if (!agreed.waiting.empty())
      CB_WARN("ft", "rank {} decides epoch {} without {} (alive, but not in shrink() before the operation deadline)",
              me, epoch_ + 1, formatPeers(agreed.waiting));
    CB_INFO("ft", "rank {} decides epoch {}: {} of {} ranks stay", me, epoch_ + 1, agreed.members.size(), n);
    return toString(es->compareSet("decision", {}, toBytes(text)));
  };
  return applyDecision(awaitDecision(decide, true), false);
}

std::shared_ptr<Communicator> FaultTolerantComm::grow(int target_size) {
  requireOpen("grow");
  if (setupFailed())
    throw InvalidUsage(fmt::format("{}epoch {} failed while it was built ({}); shrink() first",
                                   errorContext(rank_, "grow"), epoch_, describeAll(setup_faults_)));
  const int n = comm_->size();
  if (target_size <= n)
    throw InvalidArgument(fmt::format("{}target size {} is not larger than the current size {}",
                                      errorContext(comm_->rank(), "grow"), target_size, n));
  const int need = target_size - n;
  auto es = epochStore(epoch_, false);
  auto decide = [&]() -> std::string {
    int64_t first = store_->add("joinq/next", 0);
    std::vector<std::string> keys;
    for (int i = 0; i < need; ++i) keys.push_back(fmt::format("joinq/{}", first + i));
    try {
      store_->wait(keys, comm_->defaultDeadline());
    } catch (const Timeout&) {
      throw Timeout(fmt::format("{}only {} of {} replacement processes called join() within {} ms",
                                errorContext(comm_->rank(), "grow"), store_->add("joinq/count", 0) - first,
                                need, comm_->timeout().count()));
    }
    std::string text = fmt::format("grow {}\n", epoch_ + 1);
    for (int r = 0; r < n; ++r) text += memberLine(r, members_[r]);
    for (auto& k : keys) text += toString(store_->get(k, comm_->defaultDeadline()));
    std::string stored = toString(es->compareSet("decision", {}, toBytes(text)));
    if (stored == text) {
      store_->add("joinq/next", need);
      for (int i = 0; i < need; ++i)
        store_->set(fmt::format("joinq/{}/epoch", first + i), std::to_string(epoch_ + 1));
    }
    return stored;
  };
  return applyDecision(awaitDecision(decide, false), false);
}

std::shared_ptr<Communicator> FaultTolerantComm::applyDecision(const std::string& decision, bool first) {
  std::istringstream in(decision);
  std::string kind;
  uint64_t epoch = 0;
  in >> kind >> epoch;
  std::vector<Member> members;
  int my_rank = -1;
  const Member me = thisProcess();
  EpochChange change;
  change.old_epoch = epoch_;
  change.new_epoch = epoch;
  change.shrink = kind == "shrink";
  change.old_size = first ? 0 : size();
  std::string line;
  std::getline(in, line);
  while (std::getline(in, line)) {
    std::istringstream l(line);
    int old_rank;
    Member m;
    if (!(l >> old_rank >> m.host >> m.pid)) continue;
    if (m.host == me.host && m.pid == me.pid) my_rank = static_cast<int>(members.size());
    members.push_back(m);
    change.old_rank_of.push_back(first ? -1 : old_rank);
  }
  for (int r = 0; r < change.old_size; ++r)
    if (std::find(change.old_rank_of.begin(), change.old_rank_of.end(), r) == change.old_rank_of.end())
      change.excluded.push_back(r);
  if (my_rank >= 0)
    setup_watch_ = std::make_shared<SetupWatch>(epochStore(epoch, true), members, my_rank, detect_timeout_,
                                                heartbeat_interval_);
  const uint64_t old_epoch = epoch_;
  if (detector_) detector_->stop();
  detector_.reset();
  failed_setup_watch_.reset();  // the next epoch's watch (above) keeps the heartbeat
  const std::string ended = fmt::format("epoch {} replaced by epoch {}", old_epoch, epoch);
  if (comm_ && !comm_->aborted()) comm_->abort(ended);
  std::vector<std::shared_ptr<EpochResource>> resources;
  {
    std::lock_guard<std::mutex> lock(callbacks_->mu);
    resources = callbacks_->resources;
  }
  for (auto& r : resources) {
    try {
      r->abortEpoch(ended, comm_ ? comm_->context().abortError() : nullptr);
    } catch (const std::exception& e) {
      CB_WARN("ft", "ending a resource of epoch {} failed: {}", old_epoch, e.what());
    }
  }
  comm_.reset();
  if (my_rank < 0)
    throw Excluded(
        fmt::format("{}this process ({}) is not a member of epoch {} of '{}': the survivors agreed "
                    "without it (it was considered failed: dead, hung or unreachable). It must not "
                    "use this communicator again; exit, or call join() as a new process",
                    errorContext(-1, first ? "ft join" : kind), me.id(), epoch, options_.name));
  if (unadvanced_) {
    // The resources never saw the epoch whose setup failed: give them one change
    // from the epoch they are in.
    const EpochChange& before = *unadvanced_;
    change.old_epoch = before.old_epoch;
    change.old_size = before.old_size;
    change.shrink = change.shrink && before.shrink;
    for (int& o : change.old_rank_of)
      if (o >= 0) o = before.old_rank_of[o];
    change.excluded.clear();
    for (int r = 0; r < change.old_size; ++r)
      if (std::find(change.old_rank_of.begin(), change.old_rank_of.end(), r) == change.old_rank_of.end())
        change.excluded.push_back(r);
  }
  CB_INFO("ft", "entering epoch {} ({}) as rank {} of {}", epoch, kind, my_rank, members.size());
  try {
    enter(epoch, std::move(members), my_rank);
  } catch (...) {
    if (setupFailed()) unadvanced_ = std::make_unique<EpochChange>(change);
    throw;
  }
  unadvanced_.reset();
  change.comm = comm_;
  for (auto& r : resources) r->advance(change);  // collective; errors reach the caller
  return comm_;
}

}  // namespace crossbar::ft
