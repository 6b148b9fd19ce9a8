// libnccl-tuner-crossbar.so: an NCCL tuner (v5) driven by a CSV table.
//
//   # collective, min_bytes, max_bytes, nranks, nnodes, algorithm, protocol, channels
//   allreduce,   0,         64K,       *,      1,      ring,      ll,       4
//   allreduce,   64K,       *,         8,      *,      tree,      simple,   0
//
// The first row whose collective matches, whose [min_bytes, max_bytes) holds the size
// and whose nranks/nnodes match ('*' or -1: any) wins; its algorithm/protocol entry of
// the cost table is set to 0 (the cheapest, so NCCL picks it) unless NCCL marked it
// unusable, other entries are untouched; channels > 0 sets nChannels. No row: NCCL's own
// choice. The table path is CROSSBAR_TUNER_TABLE. Self-contained (no crossbar libraries)
// so it loads into any NCCL process.
#include <cctype>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <atomic>

#include "plugins/nccl/nccl_tuner_v5.h"
#include "plugins/nccl/plugin_stats.h"

namespace {

struct Counters {
  std::atomic<uint64_t> inits{0}, rules{0}, consulted{0}, applied{0};
} counters;

struct Rule {
  int coll = -1;  // ncclFunc_t
  uint64_t min_bytes = 0, max_bytes = UINT64_MAX;
  long nranks = -1, nnodes = -1;
  int algo = NCCL_ALGO_UNDEF, proto = NCCL_PROTO_UNDEF;
  int channels = 0;
};

struct Context {
  size_t nranks = 0, nnodes = 0;
  ncclDebugLogger_t log = nullptr;
  std::vector<Rule> rules;
};

std::string lower(std::string s) {
  std::string out;
  for (char c : s)
    if (!std::isspace(static_cast<unsigned char>(c)) && c != '_' && c != '-')
      out += char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

int parseColl(const std::string& s) {
  static const char* names[] = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce"};
  for (int i = 0; i < 5; ++i)
    if (s == names[i]) return i;
  return -2;
}

int parseAlgo(const std::string& s) {
  static const char* names[] = {"tree", "ring", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat"};
  for (int i = 0; i < NCCL_NUM_ALGORITHMS_V5; ++i)
    if (s == names[i]) return i;
  return -2;
}

int parseProto(const std::string& s) {
  if (s == "ll") return NCCL_PROTO_LL;
  if (s == "ll128") return NCCL_PROTO_LL128;
  if (s == "simple") return NCCL_PROTO_SIMPLE;
  return -2;
}

// Bytes with optional K/M/G suffix (powers of two); '*' = unbounded.
bool parseBytes(const std::string& s, uint64_t unbounded, uint64_t& out) {
  if (s == "*" || s.empty()) return out = unbounded, true;
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (end == s.c_str()) return false;
  std::string suffix(end);
  if (!suffix.empty() && suffix.back() == 'b') suffix.pop_back();
  int shift = suffix.empty() ? 0 : suffix == "k" ? 10 : suffix == "m" ? 20 : suffix == "g" ? 30 : -1;
  if (shift < 0) return false;
  out = uint64_t(v) << shift;
  return true;
}

bool parseCount(const std::string& s, long& out) {
  if (s == "*" || s.empty()) return out = -1, true;
  char* end = nullptr;
  out = std::strtol(s.c_str(), &end, 10);
  return *end == '\0' && end != s.c_str();
}

void logf(Context* ctx, ncclDebugLogLevel level, const char* fmt, const std::string& a, int line) {
  if (ctx->log) ctx->log(level, NCCL_TUNING, __FILE__, line, fmt, a.c_str(), line);
}

bool loadTable(Context* ctx, const char* path) {
  std::ifstream in(path);
  if (!in) {
    logf(ctx, NCCL_LOG_WARN,
         "crossbar tuner: cannot open CROSSBAR_TUNER_TABLE=%s (line %d); using NCCL's choice", path, 0);
    return false;
  }
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    lineno++;
    auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::vector<std::string> f;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) f.push_back(lower(cell));
    if (f.empty() || (f.size() == 1 && f[0].empty())) continue;
    if (f[0] == "collective") continue;  // header row
    Rule r;
    bool ok = f.size() >= 7;
    if (ok) {
      r.coll = parseColl(f[0]);
      r.algo = parseAlgo(f[5]);
      r.proto = parseProto(f[6]);
      ok = r.coll >= 0 && r.algo >= 0 && r.proto >= 0 && parseBytes(f[1], 0, r.min_bytes) &&
           parseBytes(f[2], UINT64_MAX, r.max_bytes) && parseCount(f[3], r.nranks) &&
           parseCount(f[4], r.nnodes);
      if (ok && f.size() >= 8 && !f[7].empty()) {
        long ch;
        ok = parseCount(f[7], ch);
        r.channels = ch > 0 ? int(ch) : 0;
      }
    }
    if (!ok) {
      logf(ctx, NCCL_LOG_WARN,
           "crossbar tuner: %s:%d: bad row (expected collective,min_bytes,max_bytes,nranks,"
           "nnodes,algorithm,protocol[,channels]); skipped",
           path, lineno);
      continue;
    }
    ctx->rules.push_back(r);
  }
  return true;
}

ncclResult_t tunerInit(void** context, uint64_t /*commId*/, size_t nRanks, size_t nNodes,
                       ncclDebugLogger_t logFunction, ncclNvlDomainInfo_v5_t* /*nvlDomainInfo*/,
                       ncclTunerConstants_v5_t* /*constants*/) {
  auto* ctx = new Context;
  ctx->nranks = nRanks;
  ctx->nnodes = nNodes;
  ctx->log = logFunction;
  if (const char* path = std::getenv("CROSSBAR_TUNER_TABLE"); path && *path) loadTable(ctx, path);
  counters.inits++;
  counters.rules += ctx->rules.size();
  *context = ctx;
  return ncclSuccess;
}

ncclResult_t tunerGetCollInfo(void* context, ncclFunc_t collType, size_t nBytes, int /*numPipeOps*/,
                              float** collCostTable, int numAlgo, int numProto, int /*regBuff*/,
                              int* nChannels) {
  auto* ctx = static_cast<Context*>(context);
  if (!ctx || !collCostTable) return ncclSuccess;
  counters.consulted++;
  for (const Rule& r : ctx->rules) {
    if (r.coll != int(collType) || nBytes < r.min_bytes || nBytes >= r.max_bytes) continue;
    if (r.nranks >= 0 && size_t(r.nranks) != ctx->nranks) continue;
    if (r.nnodes >= 0 && size_t(r.nnodes) != ctx->nnodes) continue;
    if (r.algo >= numAlgo || r.proto >= numProto) return ncclSuccess;
    // NCCL passes a contiguous float[numAlgo][numProto] as float**.
    float* table = reinterpret_cast<float*>(collCostTable);
    float& cost = table[r.algo * numProto + r.proto];
    if (cost == float(NCCL_ALGO_PROTO_IGNORE)) return ncclSuccess;  // unusable here: NCCL decides
    cost = 0.0f;
    if (r.channels > 0 && nChannels) *nChannels = r.channels;
    counters.applied++;
    return ncclSuccess;
  }
  return ncclSuccess;
}

ncclResult_t tunerFinalize(void* context) {
  delete static_cast<Context*>(context);
  return ncclSuccess;
}

}  // namespace

// extern: a namespace-scope const would otherwise have internal linkage.
extern "C" {
extern __attribute__((visibility("default"))) const ncclTuner_v5_t ncclTunerPlugin_v5;
const ncclTuner_v5_t ncclTunerPlugin_v5 = {"crossbar", tunerInit, tunerGetCollInfo, tunerFinalize};

__attribute__((visibility("default"))) int crossbar_tuner_stats(CrossbarTunerStats* out) {
  out->inits = counters.inits.load();
  out->rules = counters.rules.load();
  out->consulted = counters.consulted.load();
  out->applied = counters.applied.load();
  return 0;
}
}
