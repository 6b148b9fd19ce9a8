// Logging through fmt. CROSSBAR_DEBUG=WARN|INFO|TRACE; each line is prefixed with
// host, pid and rank:  "node7:1234:3 [INFO] comm: ...", and lines of the levels in
// CROSSBAR_DEBUG_TIMESTAMP_LEVELS (default WARN) with the wall-clock time in
// CROSSBAR_DEBUG_TIMESTAMP_FORMAT (default "[%F %T.%3f] "), as NCCL_DEBUG_TIMESTAMP_* do.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <string>
#include <string_view>

namespace crossbar::log {

enum class Level { kWarn = 0, kInfo = 1, kTrace = 2 };

Level level();                    // from CROSSBAR_DEBUG, read once
void setRank(int rank);           // shown in the prefix; -1 = unknown
void write(Level level, std::string_view subsystem, std::string_view message);

// Exposed for tests. strftime format plus %<N>f: the first N (1-9) digits of the
// second's fraction, so lines of different hosts can be ordered to the millisecond.
std::string formatTimestamp(std::string_view format, std::chrono::system_clock::time_point t);
// "WARN,INFO", "ALL" or "NONE" (case-insensitive) -> bit (1 << level) per level.
// Throws InvalidArgument naming the variable on anything else.
unsigned parseTimestampLevels(std::string_view text);

inline bool enabled(Level l) { return static_cast<int>(l) <= static_cast<int>(level()); }

}  // namespace crossbar::log

#define CROSSBAR_LOG(LEVEL, SUBSYS, ...)                                                     \
  do {                                                                                       \
    if (::crossbar::log::enabled(::crossbar::log::Level::LEVEL))                             \
      ::crossbar::log::write(::crossbar::log::Level::LEVEL, SUBSYS, fmt::format(__VA_ARGS__)); \
  } while (0)
#define CB_WARN(SUBSYS, ...) CROSSBAR_LOG(kWarn, SUBSYS, __VA_ARGS__)
#define CB_INFO(SUBSYS, ...) CROSSBAR_LOG(kInfo, SUBSYS, __VA_ARGS__)
#define CB_TRACE(SUBSYS, ...) CROSSBAR_LOG(kTrace, SUBSYS, __VA_ARGS__)
