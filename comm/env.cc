#include "comm/env.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "comm/errors.h"

namespace crossbar::env {

// THE table. Add new variables here, nowhere else.
const std::vector<Variable>& all() {
  static const std::vector<Variable> table = {
      {"CROSSBAR_DEBUG", Type::kEnum, "WARN", "Log level: WARN, INFO or TRACE.", {"warn", "info", "trace"}},
      {"CROSSBAR_DEBUG_FILE", Type::kString, "", "Write logs to this file instead of stderr (%h host, %p pid, %r rank)."},
      {"CROSSBAR_DEBUG_TIMESTAMP_FORMAT", Type::kString, "[%F %T.%3f] ", "Wall-clock prefix of log lines (of the levels in CROSSBAR_DEBUG_TIMESTAMP_LEVELS): strftime format, plus %<N>f for the first N (1-9) digits of the second's fraction. As NCCL_DEBUG_TIMESTAMP_FORMAT."},
      {"CROSSBAR_DEBUG_TIMESTAMP_LEVELS", Type::kString, "WARN", "Log levels whose lines carry the timestamp: a comma list of WARN, INFO, TRACE, or ALL, or NONE. As NCCL_DEBUG_TIMESTAMP_LEVELS."},
      {"CROSSBAR_TIMEOUT", Type::kMillis, "300s", "Default deadline of blocking operations (store waits, collectives, p2p)."},
      {"CROSSBAR_CONNECT_TIMEOUT", Type::kMillis, "60s", "Deadline for connecting to the store and building transports."},
      {"CROSSBAR_STORE_ADDR", Type::kString, "", "host:port of a running store (crossbar-store or rank 0's). Default MASTER_ADDR:MASTER_PORT."},
      {"CROSSBAR_NODE_ID", Type::kInt, "-1", "Topology override: this rank's node id (virtual nodes on one machine). -1: from the host name."},
      {"CROSSBAR_RANKS_PER_NODE", Type::kInt, "0", "Topology override: split ranks into virtual nodes of this many consecutive ranks. 0: off."},
      {"CROSSBAR_TRANSPORT", Type::kEnum, "auto", "Transport between peers: auto (shm within a node, ucx across), shm, ucx.", {"auto", "shm", "ucx"}},
      {"CROSSBAR_SHM_RING_SIZE", Type::kSize, "4M", "Bytes of each shared-memory receive ring (one per local peer pair and direction)."},
      {"CROSSBAR_SPIN_US", Type::kInt, "50", "Microseconds a wait spins before it blocks, when every process of the job on this machine has a core; otherwise waits yield the core between looks for up to 2 ms instead."},
      {"CROSSBAR_ASYMMETRIC_FENCE", Type::kBool, "1", "Publish-then-wake handshakes between local ranks use a compiler barrier on the frequent side and membarrier(GLOBAL_EXPEDITED) before a sleep, instead of a full fence per publish."},
      {"CROSSBAR_BIND", Type::kEnum, "none", "Bind each rank to cores: none, numa (its NUMA node's cores), core (one core per rank on the machine, virtual nodes counted together).", {"none", "numa", "core"}},
      {"CROSSBAR_UCX_TLS", Type::kString, "", "UCX_TLS to use for crossbar's UCX context (default: UCX's own choice)."},
      {"CROSSBAR_UCX_CONNECT", Type::kEnum, "auto", "How new UCX endpoints are connected: address (from the peer's worker address, both sides at once), listener (client-server: each worker listens on CROSSBAR_UCX_LISTEN_ADDR's address, the lower rank of a pair connects to the higher), auto (listener for fault-tolerant communicators, where a peer killed in the middle of an address wireup can abort the others inside UCX 1.13; address elsewhere). A pair uses the listener only when both ranks have one.", {"auto", "address", "listener"}},
      {"CROSSBAR_UCX_LISTEN_ADDR", Type::kString, "", "IPv4 address or interface name the UCX listener binds to and publishes (CROSSBAR_UCX_CONNECT). Default: the first device of UCX_NET_DEVICES with an IPv4 address, else the interface of the default route, else the host name's address, else 127.0.0.1."},
      {"CROSSBAR_ALGO", Type::kString, "", "Collective algorithm override: one name for every collective that has it (ring), or collective=name pairs (allreduce=ring,allgather=bruck). See crossbar-info's algorithm table."},
      {"CROSSBAR_COLL_CHUNK_SIZE", Type::kSize, "512K", "Bytes per pipelined chunk of the host ring/chain collectives."},
      {"CROSSBAR_SYMMEM_HUGEPAGES", Type::kBool, "1", "Back host symmetric buffers with 2 MiB huge pages (MFD_HUGETLB) when the pool has them; falls back to 4 KiB pages."},
      {"CROSSBAR_SYMMEM_CHANNELS", Type::kInt, "16", "Signal channels per symmetric buffer (counters per channel and peer in its signal pad)."},
      {"CROSSBAR_COPY_ENGINE_THREADS", Type::kInt, "1", "Worker threads of the host copy engine (0: copies run in the submitting thread)."},
      {"CROSSBAR_COPY_ENGINE_NT_THRESHOLD", Type::kSize, "1M", "Host copies of at least this many bytes use non-temporal (streaming) stores."},
      {"CROSSBAR_FT_DETECT_TIMEOUT", Type::kMillis, "5s", "Fault tolerance: a rank whose heartbeat stalls this long is reported hung (Timeout); also how long the store may be unreachable."},
      {"CROSSBAR_FT_HEARTBEAT", Type::kMillis, "100ms", "Fault tolerance: period of the failure detector (pid liveness, revoke checks); heartbeats go to the store every 2 periods."},
      {"CROSSBAR_FT_TEST_EXIT_AT", Type::kString, "", "Test hook (fault tolerance): 'E:R:STEP' makes rank R of epoch E SIGKILL itself (':stop' appended: SIGSTOP) at the first step of that epoch's setup or rendezvous matching STEP: a wait's name (unix connect, unix accept, unix send, unix recv, ucx handshake) or part of a store key (rankinfo/, shm/nonce, ucx/addr, symmem/). Empty: off."},
      {"CROSSBAR_TELEMETRY", Type::kBool, "0", "Record step-aligned telemetry (per-op records, phases, memory) and write one JSON line per step."},
      {"CROSSBAR_TELEMETRY_DIR", Type::kString, "crossbar-telemetry", "Directory of the per-rank telemetry files (rank<r>.jsonl); crossbar-report reads it."},
      {"CROSSBAR_TELEMETRY_RING", Type::kInt, "8192", "Records per thread in the telemetry ring buffer (power of two); full rings drop records and count them."},
      {"CROSSBAR_TELEMETRY_CREEP_BYTES", Type::kSize, "1M", "Memory creep threshold: host RSS growth per step (linear fit over the window) above this is flagged."},
      {"CROSSBAR_TELEMETRY_STALL_MS", Type::kMillis, "20ms", "Data-loader stall: a rank's data phase this much longer than the median rank's (and 3x it) is flagged."},
      {"CROSSBAR_TUNER_TABLE", Type::kString, "", "CSV tuning table of the NCCL tuner plugin (libnccl-tuner-crossbar.so): collective,min_bytes,max_bytes,nranks,nnodes,algorithm,protocol,channels."},
      {"CROSSBAR_COLL_SYMM_BYTES", Type::kSize, "8M", "Bytes of symmetric staging memory per rank for the host symmetric-memory collectives (two halves, double-buffered; created at the first such collective). 0 disables those algorithms."},
      {"CROSSBAR_COLL_CMA", Type::kEnum, "auto", "Single-copy host collectives: the 'cma' algorithms of allgather, alltoall(v), broadcast, gather, scatter (chosen with CROSSBAR_ALGO; the table keeps the staged 'symm'), where peers read each other's user buffers with process_vm_readv (CMA). auto: probed once per communicator (all ranks must succeed, else every rank uses the staged two-copy path and logs why at INFO); off: always staged.", {"auto", "off"}},
      {"CROSSBAR_COLL_HIER_CHUNK", Type::kSize, "1M", "Bytes per pipelined chunk of the multi-node hierarchical host collectives (hier_pipelined): chunk k's inter-node phase overlaps the intra-node phases of chunks k-1 and k+1."},
      {"CROSSBAR_EAGER_BYTES", Type::kSize, "8K", "Host collectives on one node (allreduce, allgather, reduce_scatter, broadcast, alltoall, barrier) whose size (nccl-tests size) is below this take the eager path: data, completion and call check in one shared-memory slot per rank (algorithm 'eager'; at most 1M). 0 disables it."},
      {"CROSSBAR_COLL_STREAM_BYTES", Type::kSize, "2M", "Host data movers on one node (allgather, broadcast, alltoall(v), symmetric-memory algorithms): a rank whose output is at least this many bytes writes it with streaming (non-temporal) stores: no read-for-ownership of each output line, but the output is not left in the cache for the code that reads it next (from about a core's L2 up, reading it right after costs the same either way; docs/performance.md, session 16)."},
      {"CROSSBAR_COLL_START_POLL_US", Type::kInt, "500", "Host collectives: how often (microseconds) the worker thread looks for a nonblocking call that nobody waits for or tests, while calls keep coming (a call that is waited for runs on the waiting thread at once; after 50 ms without calls the worker sleeps until the next one wakes it). So such a call starts at most this late. 0: every issue wakes the worker (a call nobody waits for starts within 50 us, but each wake-up costs a thread switch, which on a machine without a spare core preempts a rank: 2x on an issue-then-wait 64 KiB allreduce)."},
      {"CROSSBAR_COLL_SYMM_CHUNK", Type::kSize, "1M", "Largest pipelined chunk (bytes per rank) of the symmetric-memory collectives; capped at half of CROSSBAR_COLL_SYMM_BYTES."},
      {"CROSSBAR_CHECK_CALLS", Type::kEnum, "cheap", "Cross-rank check that every rank issued the same collective (kind, count, type, op, root, order): off; cheap (a 16-byte hash exchanged in log2(ranks) rounds per collective, full report on mismatch); full (every rank's complete call, including alltoallv counts per pair, sent to every rank on each collective; for debugging). Mismatches raise InvalidUsage on every rank. Within a node the cheap check rides in shared memory (~0.3 us); across nodes it is a round trip of its own before each collective, which doubles the latency of small multi-node calls.", {"off", "cheap", "full"}},
      {"CROSSBAR_MOE_CHUNK_TOKENS", Type::kInt, "128", "Tokens per pipelined chunk of MoE dispatch/combine (network phase of chunk k+1 overlaps the intra-node phase of chunk k). 0: one chunk (no pipelining)."},
      {"CROSSBAR_MOE_NET_MESSAGE_BYTES", Type::kInt, "32768", "Largest network message of MoE dispatch/combine: a chunk goes as several messages this size, small enough for UCX's eager protocol (up to 64 KiB over TCP with crossbar's UCX_TCP_TX_SEG_SIZE=64K; keep it under that segment if you set UCX_TCP_TX_SEG_SIZE), so no chunk waits for a rendezvous reply behind bulk data. 0: one message per chunk."},
      {"CROSSBAR_MOE_HOST_CODEC", Type::kEnum, "auto", "Implementation of the MoE host payload codecs (fp8 / mxfp8 / nvfp4 encode and decode; identical bytes either way): auto (AVX-512 with BF16 where the CPU has it, else AVX2, else scalar), avx512 / avx2 (an error where the CPU lacks it; avx2 uses no AVX-512 path), scalar (the portable reference, for comparison).", {"auto", "avx512", "avx2", "scalar"}},
      {"CROSSBAR_SECRET", Type::kString, "", "Shared job secret: store clients and server prove knowledge of it (HMAC-SHA256 challenge-response). Same value on every rank and crossbar-store; unset: no authentication (single-host jobs). Prefer CROSSBAR_SECRET_FILE (env is visible in /proc and crossbar-info)."},
      {"CROSSBAR_SECRET_FILE", Type::kString, "", "File holding the shared job secret (used when CROSSBAR_SECRET is unset; one trailing newline ignored; chmod 600)."},
  };
  return table;
}

const char* typeName(Type type) {
  switch (type) {
    case Type::kBool: return "bool";
    case Type::kInt: return "int";
    case Type::kSize: return "size";
    case Type::kString: return "string";
    case Type::kEnum: return "enum";
    case Type::kMillis: return "duration";
  }
  return "?";
}

const Variable& lookup(std::string_view name) {
  for (const auto& v : all())
    if (v.name == name) return v;
  throw InternalError(fmt::format("environment variable {} is not declared in comm/env.cc", name));
}

bool isSet(std::string_view name) {
  lookup(name);
  const char* value = std::getenv(std::string(name).c_str());
  return value && *value;
}

std::string raw(std::string_view name) {
  const Variable& v = lookup(name);
  const char* value = std::getenv(std::string(name).c_str());
  return (value && *value) ? std::string(value) : std::string(v.default_value);
}

static std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

bool parseBool(std::string_view text, std::string_view what) {
  std::string t = lower(text);
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  throw InvalidArgument(fmt::format("{}={}: expected a boolean (1/0, true/false, yes/no, on/off)", what, text));
}

int64_t parseInt(std::string_view text, std::string_view what) {
  std::string t(text);
  char* end = nullptr;
  errno = 0;
  long long value = std::strtoll(t.c_str(), &end, 10);
  // The end check (not *end) also rejects an embedded NUL: "12\0x" is not 12.
  if (t.empty() || end != t.c_str() + t.size() || errno == ERANGE)
    throw InvalidArgument(fmt::format("{}={}: expected a decimal integer", what, text));
  return value;
}

uint64_t parseSize(std::string_view text, std::string_view what) {
  std::string t(text);
  char* end = nullptr;
  errno = 0;
  // strtoull skips blanks and then negates "-1" to 2^64-1: refuse a sign after blanks too.
  const size_t first = t.find_first_not_of(" \t\n\v\f\r");
  if (first == std::string::npos || t[first] == '-')
    throw InvalidArgument(fmt::format("{}={}: expected a size in bytes with optional K, M, G or T suffix", what, text));
  unsigned long long value = std::strtoull(t.c_str(), &end, 10);
  std::string suffix = lower(end);
  if (!suffix.empty() && suffix.back() == 'b') suffix.pop_back();  // accept "KB", "MiB" loosely
  if (suffix.size() == 2 && suffix[1] == 'i') suffix.pop_back();
  unsigned shift = 0;
  if (suffix.empty()) shift = 0;
  else if (suffix == "k") shift = 10;
  else if (suffix == "m") shift = 20;
  else if (suffix == "g") shift = 30;
  else if (suffix == "t") shift = 40;
  else throw InvalidArgument(fmt::format("{}={}: expected a size in bytes with optional K, M, G or T suffix", what, text));
  if (end == t.c_str() || errno == ERANGE || (shift && value > (~0ull >> shift)))
    throw InvalidArgument(fmt::format("{}={}: expected a size in bytes with optional K, M, G or T suffix", what, text));
  return value << shift;
}

bool getBool(std::string_view name) { return parseBool(raw(name), name); }
int64_t getInt(std::string_view name) { return parseInt(raw(name), name); }
uint64_t getSize(std::string_view name) { return parseSize(raw(name), name); }
std::string getString(std::string_view name) { return raw(name); }

int64_t getMillis(std::string_view name) {
  std::string t = lower(raw(name));
  auto fail = [&] {
    return InvalidArgument(fmt::format("{}={}: expected a duration such as 500ms, 30s or 5m", name, raw(name)));
  };
  char* end = nullptr;
  errno = 0;
  double value = std::strtod(t.c_str(), &end);
  if (end == t.c_str() || !(value >= 0) || errno == ERANGE) throw fail();  // !(>=) also catches NaN
  std::string suffix(end);
  // A bare number is ambiguous (torch and NCCL users think in seconds): demand a unit,
  // except for 0 and for variables whose name says milliseconds.
  if (suffix.empty() && value != 0 && !name.ends_with("_MS"))
    throw InvalidArgument(fmt::format("{}={}: a bare number is ambiguous; write a unit, e.g. {}s for seconds or "
                                      "{}ms for milliseconds",
                                      name, raw(name), raw(name), raw(name)));
  double scale = 0;
  if (suffix.empty() || suffix == "ms") scale = 1;
  else if (suffix == "s") scale = 1000;
  else if (suffix == "m") scale = 60'000;
  else throw fail();
  // Converting a double beyond int64 (or inf) is undefined behaviour: refuse it.
  if (!(value * scale < 9.2e18)) throw fail();
  return static_cast<int64_t>(value * scale);
}

std::string getEnum(std::string_view name) {
  const Variable& v = lookup(name);
  std::string t = lower(raw(name));
  for (auto c : v.choices)
    if (t == c) return t;
  std::string accepted;
  for (auto c : v.choices) accepted += (accepted.empty() ? "" : ", ") + std::string(c);
  throw InvalidArgument(fmt::format("{}={}: accepted values are {}", name, raw(name), accepted));
}

}  // namespace crossbar::env
