#include "comm/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>

#include "comm/env.h"
#include "comm/errors.h"

namespace crossbar::log {

namespace {
std::atomic<int> g_rank{-1};
std::mutex g_mutex;

FILE* openSink() {
  std::string path = env::getString("CROSSBAR_DEBUG_FILE");
  if (path.empty()) return stderr;
  std::string expanded;
  for (size_t i = 0; i < path.size(); ++i) {
    if (path[i] == '%' && i + 1 < path.size()) {
      char c = path[++i];
      if (c == 'h') expanded += hostName();
      else if (c == 'p') expanded += std::to_string(getpid());
      else if (c == 'r') expanded += std::to_string(g_rank.load());
      else expanded += c;
    } else {
      expanded += path[i];
    }
  }
  FILE* f = std::fopen(expanded.c_str(), "a");
  return f ? f : stderr;
}
}  // namespace

Level level() {
  static const Level value = [] {
    try {
      std::string v = env::getEnum("CROSSBAR_DEBUG");
      if (v == "trace") return Level::kTrace;
      if (v == "info") return Level::kInfo;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "crossbar: %s; using WARN\n", e.what());
    }
    return Level::kWarn;
  }();
  return value;
}

void setRank(int rank) { g_rank.store(rank); }

void write(Level l, std::string_view subsystem, std::string_view message) {
  static const char* names[] = {"WARN", "INFO", "TRACE"};
  static FILE* sink = openSink();
  std::string line = fmt::format("{}:{}:{} [{}] {}: {}\n", hostName(), getpid(), g_rank.load(),
                                 names[static_cast<int>(l)], subsystem, message);
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fwrite(line.data(), 1, line.size(), sink);
  std::fflush(sink);
}

}  // namespace crossbar::log
