#include "comm/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>
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

struct Timestamps {
  std::string format;
  unsigned levels = 0;
};

const Timestamps& timestamps() {
  static const Timestamps value = [] {
    Timestamps t;
    t.format = env::getString("CROSSBAR_DEBUG_TIMESTAMP_FORMAT");
    try {
      t.levels = parseTimestampLevels(env::getString("CROSSBAR_DEBUG_TIMESTAMP_LEVELS"));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "crossbar: %s; using WARN\n", e.what());
      t.levels = 1u << static_cast<int>(Level::kWarn);
    }
    return t;
  }();
  return value;
}
}  // namespace

std::string formatTimestamp(std::string_view format, std::chrono::system_clock::time_point t) {
  const auto since = t.time_since_epoch();
  const std::time_t seconds = std::chrono::duration_cast<std::chrono::seconds>(since).count();
  const long nanos = static_cast<long>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(since - std::chrono::seconds(seconds)).count());
  std::tm local{};
  localtime_r(&seconds, &local);
  // %<N>f is replaced here; the rest goes to strftime piece by piece.
  std::string out, piece;
  auto flush = [&] {
    if (piece.empty()) return;
    char buffer[256];
    const size_t n = std::strftime(buffer, sizeof buffer, piece.c_str(), &local);
    out.append(buffer, n);
    piece.clear();
  };
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] == '%' && i + 2 < format.size() && format[i + 1] >= '1' && format[i + 1] <= '9' &&
        format[i + 2] == 'f') {
      flush();
      const int digits = format[i + 1] - '0';
      out += fmt::format("{:09d}", nanos).substr(0, digits);
      i += 2;
    } else if (format[i] == '%' && i + 1 < format.size()) {
      piece += format.substr(i, 2);  // keeps "%%" and "%F" together
      ++i;
    } else {
      piece += format[i];
    }
  }
  flush();
  return out;
}

unsigned parseTimestampLevels(std::string_view text) {
  static const char* names[] = {"warn", "info", "trace"};
  unsigned levels = 0;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = std::min(text.find(',', start), text.size());
    std::string given(text.substr(start, end - start));
    given.erase(0, given.find_first_not_of(' '));
    given.erase(given.find_last_not_of(' ') + 1);
    std::string word = given;
    std::transform(word.begin(), word.end(), word.begin(), [](unsigned char c) { return std::tolower(c); });
    if (word == "all") {
      levels = 0b111;
    } else if (word == "none") {
      // nothing
    } else if (!word.empty()) {
      auto it = std::find(std::begin(names), std::end(names), word);
      if (it == std::end(names))
        throw InvalidArgument(fmt::format("CROSSBAR_DEBUG_TIMESTAMP_LEVELS='{}': '{}' is not WARN, INFO, TRACE, "
                                          "ALL or NONE",
                                          text, given));
      levels |= 1u << (it - std::begin(names));
    }
    start = end + 1;
  }
  return levels;
}

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
  const Timestamps& stamps = timestamps();
  std::string line = (stamps.levels >> static_cast<int>(l)) & 1u
                         ? formatTimestamp(stamps.format, std::chrono::system_clock::now())
                         : std::string();
  line += fmt::format("{}:{}:{} [{}] {}: {}\n", hostName(), getpid(), g_rank.load(), names[static_cast<int>(l)],
                      subsystem, message);
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fwrite(line.data(), 1, line.size(), sink);
  std::fflush(sink);
}

}  // namespace crossbar::log
