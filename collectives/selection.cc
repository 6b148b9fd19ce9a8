#include "collectives/selection.h"

#include "collectives/eager.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"

namespace crossbar {

// ---- collective names and arguments --------------------------------------------------

const char* collTypeName(CollType c) {
  switch (c) {
    case CollType::kAllreduce:
      return "allreduce";
    case CollType::kAllgather:
      return "allgather";
    case CollType::kReduceScatter:
      return "reduce_scatter";
    case CollType::kBroadcast:
      return "broadcast";
    case CollType::kReduce:
      return "reduce";
    case CollType::kAlltoall:
      return "alltoall";
    case CollType::kAlltoallv:
      return "alltoallv";
    case CollType::kGather:
      return "gather";
    case CollType::kScatter:
      return "scatter";
    case CollType::kBarrier:
      return "barrier";
    case CollType::kSend:
      return "send";
    case CollType::kRecv:
      return "recv";
  }
  return "unknown";
}

bool parseCollType(const std::string& name, CollType* out) {
  for (int i = 0; i < kNumCollTypes; ++i) {
    auto c = static_cast<CollType>(i);
    if (name == collTypeName(c)) {
      *out = c;
      return true;
    }
  }
  if (name == "reducescatter" || name == "reduce-scatter") {
    *out = CollType::kReduceScatter;
    return true;
  }
  if (name == "bcast") {
    *out = CollType::kBroadcast;
    return true;
  }
  return false;
}

size_t CollArgs::selectionBytes(int nranks) const {
  const size_t es = elementSize(type);
  switch (coll) {
    case CollType::kAllgather:
    case CollType::kReduceScatter:
    case CollType::kAlltoall:
    case CollType::kGather:
    case CollType::kScatter:
      return count * es * static_cast<size_t>(nranks);
    case CollType::kAlltoallv: {
      size_t total = 0;
      for (size_t c : send_counts) total += c;
      return total * es;
    }
    case CollType::kBarrier:
      return 0;
    default:
      return count * es;
  }
}

std::string CollArgs::describe() const {
  switch (coll) {
    case CollType::kBarrier:
      return "barrier";
    case CollType::kSend:
      return fmt::format("send {} x {} to rank {} tag {}", count, dataTypeName(type), peer, tag);
    case CollType::kRecv:
      return fmt::format("recv {} x {} from rank {} tag {}", count, dataTypeName(type), peer, tag);
    case CollType::kAlltoallv: {
      size_t total = 0;
      for (size_t c : send_counts) total += c;
      return fmt::format("alltoallv {} x {} sent", total, dataTypeName(type));
    }
    default:
      break;
  }
  std::string s = fmt::format("{} {} x {}", collTypeName(coll), count, dataTypeName(type));
  if (hasReduceOp(coll)) s += fmt::format(" {}", reduceOpName(op));
  if (coll == CollType::kBroadcast || coll == CollType::kReduce || coll == CollType::kGather ||
      coll == CollType::kScatter)
    s += fmt::format(" root {}", root);
  return s;
}

// ---- registry ------------------------------------------------------------------------

namespace {
std::mutex& registryMutex() {
  static std::mutex m;
  return m;
}
std::deque<Algorithm>& registry() {
  static std::deque<Algorithm>* r = [] {
    auto* v = new std::deque<Algorithm>();
    registerHostAlgorithms(*v);
    registerSymmAlgorithms(*v);
    registerHierAlgorithms(*v);
    registerEagerAlgorithms(*v);
    return v;
  }();
  return *r;
}
}  // namespace

const std::deque<Algorithm>& algorithms() {
  std::lock_guard<std::mutex> lock(registryMutex());
  return registry();
}

const Algorithm* findAlgorithm(CollType coll, const std::string& name) {
  for (const Algorithm& a : algorithms())
    if (a.coll == coll && a.name == name) return &a;
  return nullptr;
}

// Entries are never removed or moved (deque), so selection can hold pointers.
void registerAlgorithm(Algorithm a) {
  std::lock_guard<std::mutex> lock(registryMutex());
  auto& r = registry();
  for (const Algorithm& e : r)
    if (e.coll == a.coll && e.name == a.name)
      throw InvalidUsage(
          fmt::format("algorithm {} for {} is already registered", a.name, collTypeName(a.coll)));
  r.push_back(std::move(a));
}

// ---- CUDA-memory algorithms -----------------------------------------------------------

namespace {

// Local ranks a CUDA symmetric-heap device handle addresses (cuda::kMaxLocalRanks).
constexpr int kCudaHeapMaxRanks = 8;

std::string cudaHeapApplies(const CollArgs&, const Communicator& comm) {
  if (comm.numNodes() != 1)
    return fmt::format("{} nodes: peers' GPU memory is only mapped within a node", comm.numNodes());
  if (comm.size() > kCudaHeapMaxRanks)
    return fmt::format("{} ranks: the CUDA heap kernels address at most {}", comm.size(), kCudaHeapMaxRanks);
  return "";
}

std::string alwaysApplies(const CollArgs&, const Communicator&) {
  return "";
}

}  // namespace

const std::deque<Algorithm>& cudaAlgorithms() {
  static const std::deque<Algorithm>* catalog = [] {
    auto* v = new std::deque<Algorithm>();
    auto add = [&](CollType c, const char* name, const char* summary, bool heap) {
      Algorithm a;
      a.coll = c;
      a.name = name;
      a.summary = summary;
      a.applies = heap ? cudaHeapApplies : alwaysApplies;
      v->push_back(std::move(a));
    };
    add(CollType::kAllreduce, "oneshot", "[cuda] kernel reads every peer's staged buffer, one barrier round",
        true);
    add(CollType::kAllreduce, "twoshot", "[cuda] kernel reduce-scatter into peers' staging, copy-out", true);
    add(CollType::kReduceScatter, "direct", "[cuda] kernel reduces this rank's block from every peer", true);
    add(CollType::kReduce, "direct", "[cuda] root's kernel reduces every peer's staged buffer", true);
    add(CollType::kAllgather, "ce", "[cuda] copy engines pull peers' blocks (zero SMs)", true);
    add(CollType::kAlltoall, "ce", "[cuda] copy engines pull this rank's block from each peer", true);
    add(CollType::kAlltoallv, "ce", "[cuda] copy engines pull (displacements exchanged on the host)", true);
    add(CollType::kBroadcast, "ce", "[cuda] copy engines pull the root's staged buffer", true);
    add(CollType::kGather, "ce", "[cuda] root's copy engines pull every block", true);
    add(CollType::kScatter, "ce", "[cuda] copy engines pull this rank's block from the root", true);
    add(CollType::kBarrier, "signal", "[cuda] stream memory operations on the heap's signal pads", true);
    for (int i = 0; i < kNumCollTypes; ++i)
      add(static_cast<CollType>(i), "nccl", "[cuda] NCCL (created on first use; CTA policy zero, windows)",
          false);
    return v;
  }();
  return *catalog;
}

const Algorithm* findAlgorithm(CollType coll, const std::string& name, MemoryKind memory) {
  if (memory == MemoryKind::kHost) return findAlgorithm(coll, name);
  for (const Algorithm& a : cudaAlgorithms())
    if (a.coll == coll && a.name == name) return &a;
  return nullptr;
}

bool uniformNodes(const Communicator& comm) {
  const size_t local = comm.nodePeers(comm.rank()).size();
  for (int r = 0; r < comm.size(); ++r)
    if (comm.nodePeers(r).size() != local) return false;
  return true;
}

// ---- the table -----------------------------------------------------------------------

namespace {
constexpr size_t K = 1024, M = 1024 * 1024;
constexpr size_t kInf = std::numeric_limits<size_t>::max();
constexpr int kAnyRanks = std::numeric_limits<int>::max();
}  // namespace

// Thresholds: latency-bound algorithms (log p rounds of the whole buffer) below the
// point where moving 2(p-1)/p of the data in p-1 steps wins; measured on shm.
const std::vector<SelectionRule>& selectionTable() {
  static const std::vector<SelectionRule> table = {
      // One node, small calls: the eager path (eager.h), below CROSSBAR_EAGER_BYTES
      // (default 8K): data, completion and call check in one slot store per rank, one
      // wait per peer (the staged algorithms pay a call-check round plus a signal per
      // chunk and peer). Measured in docs/performance.md ("Small messages").
      {CollType::kAllreduce, 0, eagerMaxBytes(), 1, kAnyRanks, NodeScope::kSingle, "eager"},
      {CollType::kAllgather, 0, eagerMaxBytes(), 1, kAnyRanks, NodeScope::kSingle, "eager"},
      {CollType::kReduceScatter, 0, eagerMaxBytes(), 1, kAnyRanks, NodeScope::kSingle, "eager"},
      {CollType::kBroadcast, 0, eagerMaxBytes(), 1, kAnyRanks, NodeScope::kSingle, "eager"},
      {CollType::kAlltoall, 0, eagerMaxBytes(), 1, kAnyRanks, NodeScope::kSingle, "eager"},
      {CollType::kBarrier, 0, kInf, 1, kAnyRanks, NodeScope::kSingle, "eager"},
      // One node: symmetric memory (symm_algorithms.cc). One-shot while reading every
      // peer's whole buffer is cheaper than a second synchronization round; streaming
      // output stores once the result no longer fits in cache with the staging.
      // Two ranks too: since two-shot stages only the peer's half (session 6) it is
      // faster from 64K (2 ranks, alternating runs: 64K 14.8 vs 17.7 us, 1M 121 vs 143,
      // 4M 501 vs 641; docs/performance.md "Session 6").
      {CollType::kAllreduce, 0, 64 * K, 1, 8, NodeScope::kSingle, "oneshot"},
      {CollType::kAllreduce, 0, 1 * M, 1, kAnyRanks, NodeScope::kSingle, "twoshot"},
      {CollType::kAllreduce, 1 * M, kInf, 1, kAnyRanks, NodeScope::kSingle, "twoshot_nt"},
      // Data movement: staged ("symm"). The single-copy "cma" algorithms (peers read the
      // user buffer with process_vm_readv) measured slower on this VM at 256K-16M, 2 and
      // 4 ranks (docs/performance.md): select them with CROSSBAR_ALGO where CMA is fast.
      {CollType::kAllgather, 0, kInf, 1, kAnyRanks, NodeScope::kSingle, "symm"},
      {CollType::kReduceScatter, 0, kInf, 1, kAnyRanks, NodeScope::kSingle, "symm"},
      {CollType::kBroadcast, 0, kInf, 1, kAnyRanks, NodeScope::kSingle, "symm"},
      {CollType::kReduce, 0, kInf, 1, kAnyRanks, NodeScope::kSingle, "symm"},
      {CollType::kAlltoall, 0, kInf, 1, kAnyRanks, NodeScope::kSingle, "symm"},
      {CollType::kAlltoallv, 0, kInf, 1, kAnyRanks, NodeScope::kSingle, "symm"},
      {CollType::kGather, 0, kInf, 1, kAnyRanks, NodeScope::kSingle, "symm"},
      {CollType::kScatter, 0, kInf, 1, kAnyRanks, NodeScope::kSingle, "symm"},
      // Several nodes: symmetric memory inside each node, point-to-point across,
      // pipelined in chunks (CROSSBAR_COLL_HIER_CHUNK) so the inter-node phase of a
      // chunk overlaps the intra-node phases of its neighbours (hier_algorithms.cc; one
      // chunk = hierarchical_symm). Measured on 2 virtual nodes x 2 ranks (noisy: see
      // docs/performance.md): reduce_scatter 2-5x pairwise/ring at 8K-64M, the others
      // ahead from 64K/256K; alltoall (aggregated per node pair) is not ahead on one
      // machine, so it is only used when forced. (The UCX 1.13 teardown abort seen with
      // allreduce=hier_pipelined after a kill is fixed in ucx_context.cc:
      // docs/fault-tolerance.md, Known limits.)
      {CollType::kAllreduce, 256 * K, kInf, 4, kAnyRanks, NodeScope::kMulti, "hier_pipelined"},
      {CollType::kAllgather, 256 * K, kInf, 4, kAnyRanks, NodeScope::kMulti, "hier_pipelined"},
      {CollType::kReduceScatter, 0, kInf, 4, kAnyRanks, NodeScope::kMulti, "hier_pipelined"},
      {CollType::kBroadcast, 256 * K, kInf, 4, kAnyRanks, NodeScope::kMulti, "hier_pipelined"},
      {CollType::kAllreduce, 0, 64 * K, 1, kAnyRanks, NodeScope::kAny, "rd"},
      {CollType::kAllreduce, 64 * K, kInf, 1, kAnyRanks, NodeScope::kAny, "ring"},
      {CollType::kAllgather, 0, 256 * K, 1, kAnyRanks, NodeScope::kAny, "rd"},  // powers of 2
      {CollType::kAllgather, 0, 256 * K, 1, kAnyRanks, NodeScope::kAny, "bruck"},
      {CollType::kAllgather, 256 * K, kInf, 1, kAnyRanks, NodeScope::kAny, "ring"},
      {CollType::kReduceScatter, 0, 1 * M, 1, kAnyRanks, NodeScope::kAny, "pairwise"},
      {CollType::kReduceScatter, 1 * M, kInf, 1, kAnyRanks, NodeScope::kAny, "ring"},
      {CollType::kBroadcast, 0, 64 * K, 1, kAnyRanks, NodeScope::kAny, "binomial"},
      {CollType::kBroadcast, 1 * M, kInf, 8, kAnyRanks, NodeScope::kAny, "scatter_allgather"},
      {CollType::kBroadcast, 64 * K, kInf, 1, kAnyRanks, NodeScope::kAny, "chain"},
      {CollType::kReduce, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "binomial"},
      {CollType::kAlltoall, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "pairwise"},
      {CollType::kAlltoallv, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "pairwise"},
      {CollType::kGather, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "direct"},
      {CollType::kScatter, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "direct"},
      {CollType::kBarrier, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "dissemination"},
      {CollType::kSend, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "p2p"},
      {CollType::kRecv, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "p2p"},
      // CUDA memory (collectives/cuda). One node: the CUDA symmetric heap; one-shot
      // while reading every peer's whole buffer beats a second round (NVLink-class
      // threshold, not yet tuned by measurement). Else, and for send/recv: NCCL.
      {CollType::kAllreduce, 0, 256 * K, 1, 8, NodeScope::kSingle, "oneshot", MemoryKind::kCuda},
      {CollType::kAllreduce, 256 * K, kInf, 1, 8, NodeScope::kSingle, "twoshot", MemoryKind::kCuda},
      {CollType::kReduceScatter, 0, kInf, 1, 8, NodeScope::kSingle, "direct", MemoryKind::kCuda},
      {CollType::kReduce, 0, kInf, 1, 8, NodeScope::kSingle, "direct", MemoryKind::kCuda},
      {CollType::kAllgather, 0, kInf, 1, 8, NodeScope::kSingle, "ce", MemoryKind::kCuda},
      {CollType::kAlltoall, 0, kInf, 1, 8, NodeScope::kSingle, "ce", MemoryKind::kCuda},
      {CollType::kAlltoallv, 0, kInf, 1, 8, NodeScope::kSingle, "ce", MemoryKind::kCuda},
      {CollType::kBroadcast, 0, kInf, 1, 8, NodeScope::kSingle, "ce", MemoryKind::kCuda},
      {CollType::kGather, 0, kInf, 1, 8, NodeScope::kSingle, "ce", MemoryKind::kCuda},
      {CollType::kScatter, 0, kInf, 1, 8, NodeScope::kSingle, "ce", MemoryKind::kCuda},
      {CollType::kBarrier, 0, kInf, 1, 8, NodeScope::kSingle, "signal", MemoryKind::kCuda},
      {CollType::kAllreduce, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kAllgather, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kReduceScatter, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kBroadcast, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kReduce, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kAlltoall, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kAlltoallv, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kGather, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kScatter, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kBarrier, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kSend, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
      {CollType::kRecv, 0, kInf, 1, kAnyRanks, NodeScope::kAny, "nccl", MemoryKind::kCuda},
  };
  return table;
}

static std::string fmtBytes(size_t b) {
  if (b == kInf) return "inf";
  if (b >= M && b % M == 0) return fmt::format("{}M", b / M);
  if (b >= K && b % K == 0) return fmt::format("{}K", b / K);
  return std::to_string(b);
}

static const char* scopeName(NodeScope s) {
  switch (s) {
    case NodeScope::kAny:
      return "any";
    case NodeScope::kSingle:
      return "1";
    case NodeScope::kMulti:
      return ">1";
  }
  return "?";
}

static const char* memoryName(MemoryKind m) {
  return m == MemoryKind::kCuda ? "cuda" : "host";
}

static std::string ruleText(const SelectionRule& r) {
  std::string ranks = r.max_ranks == kAnyRanks ? fmt::format(">={}", r.min_ranks)
                                               : fmt::format("{}..{}", r.min_ranks, r.max_ranks);
  return fmt::format("{:<4} {:<15} {:>6} .. {:<6} ranks {:<5} nodes {:<4} -> {}", memoryName(r.memory),
                     collTypeName(r.coll), fmtBytes(r.min_bytes), fmtBytes(r.max_bytes), ranks,
                     scopeName(r.nodes), r.algorithm);
}

std::string describeAlgorithmTable() {
  std::string out =
      "Collective algorithm table (first matching row whose algorithm applies wins;\n"
      "bytes = nccl-tests size: the whole buffer of allgather/reduce_scatter/alltoall/gather/scatter;\n"
      "memory = where the buffers are: host, or cuda for device pointers):\n";
  for (const SelectionRule& r : selectionTable()) out += "  " + ruleText(r) + "\n";
  out += "Registered algorithms:\n";
  for (const Algorithm& a : algorithms())
    out += fmt::format("  host {:<15} {:<18} {}\n", collTypeName(a.coll), a.name, a.summary);
  for (const Algorithm& a : cudaAlgorithms())
    out += fmt::format("  cuda {:<15} {:<18} {}\n", collTypeName(a.coll), a.name, a.summary);
  std::string env = env::getString("CROSSBAR_ALGO");
  out += fmt::format("CROSSBAR_ALGO={}\n", env.empty() ? "(unset: table)" : env);
  return out;
}

// ---- overrides -----------------------------------------------------------------------

static std::string namesFor(CollType c, MemoryKind m) {
  std::string s;
  for (const Algorithm& a : m == MemoryKind::kHost ? algorithms() : cudaAlgorithms())
    if (a.coll == c) s += (s.empty() ? "" : ", ") + a.name;
  return s;
}

static std::string namesFor(CollType c) {
  return fmt::format("host: {}; cuda: {}", namesFor(c, MemoryKind::kHost), namesFor(c, MemoryKind::kCuda));
}

AlgoOverride parseAlgoOverride(const std::string& text) {
  AlgoOverride o;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(pos, comma - pos);
    pos = comma + 1;
    item.erase(std::remove_if(item.begin(), item.end(), [](char ch) { return ch == ' '; }), item.end());
    if (item.empty()) continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos) {
      // A bare name applies to every collective that has an algorithm of that name.
      bool any = false;
      for (const auto* list : {&algorithms(), &cudaAlgorithms()})
        for (const Algorithm& a : *list)
          if (a.name == item) {
            o.per_coll[static_cast<int>(a.coll)] = item;
            any = true;
          }
      if (!any)
        throw InvalidArgument(
            fmt::format("CROSSBAR_ALGO={}: no collective has an algorithm named '{}'. "
                        "Run crossbar-info for the algorithm table",
                        text, item));
      continue;
    }
    std::string cname = item.substr(0, eq), aname = item.substr(eq + 1);
    CollType c;
    if (!parseCollType(cname, &c))
      throw InvalidArgument(
          fmt::format("CROSSBAR_ALGO={}: unknown collective '{}' (allreduce, allgather, "
                      "reduce_scatter, broadcast, reduce, alltoall, alltoallv, gather, scatter, "
                      "barrier)",
                      text, cname));
    if (!findAlgorithm(c, aname, MemoryKind::kHost) && !findAlgorithm(c, aname, MemoryKind::kCuda))
      throw InvalidArgument(fmt::format("CROSSBAR_ALGO={}: {} has no algorithm '{}'; choices: {}", text,
                                        cname, aname, namesFor(c)));
    o.per_coll[static_cast<int>(c)] = aname;
  }
  return o;
}

namespace {
// The algorithm of table row `i`, looked up once (a registry lookup locks and compares
// names; small calls feel it). Registry entries never move, so the pointers stay valid.
const Algorithm* rowAlgorithm(size_t i, const SelectionRule& r) {
  static std::vector<std::atomic<const Algorithm*>> cache(selectionTable().size());
  const Algorithm* a = cache[i].load(std::memory_order_acquire);
  if (!a) {
    a = findAlgorithm(r.coll, r.algorithm, r.memory);
    if (a) cache[i].store(a, std::memory_order_release);
  }
  return a;
}
}  // namespace

Selection selectAlgorithm(const CollArgs& args, const Communicator& comm, const std::string& forced,
                          const AlgoOverride& env_override, MemoryKind memory) {
  std::string fallback_note;
  const char* mem = memoryName(memory);
  auto tryNamed = [&](const std::string& name, const char* source) -> const Algorithm* {
    const Algorithm* a = findAlgorithm(args.coll, name, memory);
    if (!a)
      throw InvalidArgument(fmt::format("{}{} '{}' is not an algorithm of {} on {} memory; choices: {}",
                                        errorContext(comm.rank(), collTypeName(args.coll)), source, name,
                                        collTypeName(args.coll), mem, namesFor(args.coll, memory)));
    std::string why = a->applies(args, comm);
    if (why.empty()) return a;
    fallback_note = fmt::format(" ({} '{}' does not apply: {})", source, name, why);
    return nullptr;
  };
  if (!forced.empty())
    if (const Algorithm* a = tryNamed(forced, "CollOptions.algorithm")) return {a, "CollOptions.algorithm"};
  const std::string& env_name = env_override.per_coll[static_cast<int>(args.coll)];
  // A CROSSBAR_ALGO name of the other memory kind only (e.g. nccl for a host call) is ignored.
  if (!env_name.empty() && forced.empty() && findAlgorithm(args.coll, env_name, memory))
    if (const Algorithm* a = tryNamed(env_name, "CROSSBAR_ALGO")) return {a, "CROSSBAR_ALGO"};

  const size_t bytes = args.selectionBytes(comm.size());
  const int n = comm.size();
  // The table only tells 1 node from several.
  const int nodes = comm.localSize() == comm.size() ? 1 : 2;
  const std::vector<SelectionRule>& table = selectionTable();
  for (size_t i = 0; i < table.size(); ++i) {
    const SelectionRule& r = table[i];
    if (r.memory != memory || r.coll != args.coll || bytes < r.min_bytes || bytes >= r.max_bytes) continue;
    if (n < r.min_ranks || n > r.max_ranks) continue;
    if ((r.nodes == NodeScope::kSingle && nodes != 1) || (r.nodes == NodeScope::kMulti && nodes < 2))
      continue;
    const Algorithm* a = rowAlgorithm(i, r);
    if (!a || !a->applies(args, comm).empty()) continue;
    // A table pick's reason is for the INFO log only (formatting it costs more than a
    // small call); a forced choice that did not apply always says why.
    if (fallback_note.empty() && !log::enabled(log::Level::kInfo)) return {a, {}};
    return {a, "table: " + ruleText(r) + fallback_note};
  }
  for (const Algorithm& a : memory == MemoryKind::kHost ? algorithms() : cudaAlgorithms())
    if (a.coll == args.coll && a.applies(args, comm).empty())
      return {&a, "fallback: first that applies" + fallback_note};
  throw InternalError(fmt::format("{}no algorithm applies to {} on {} ranks ({} memory)",
                                  errorContext(comm.rank(), "select"), args.describe(), n, mem));
}

}  // namespace crossbar
