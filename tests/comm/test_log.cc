// Log line timestamps (CROSSBAR_DEBUG_TIMESTAMP_FORMAT / _LEVELS).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "comm/errors.h"
#include "comm/log.h"

namespace crossbar {
namespace {

using std::chrono::system_clock;

// 2026-12-01 11:03:11.123456789 UTC
system_clock::time_point sample() {
  return system_clock::time_point(std::chrono::duration_cast<system_clock::duration>(
      std::chrono::seconds(1796122991) + std::chrono::nanoseconds(123456789)));
}

class LogTimestamp : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("TZ", "UTC", 1);
    ::tzset();
  }
};

TEST_F(LogTimestamp, StrftimeWithFractionDigits) {
  EXPECT_EQ(log::formatTimestamp("[%F %T] ", sample()), "[2026-12-01 11:03:11] ");
  EXPECT_EQ(log::formatTimestamp("[%F %T.%3f] ", sample()), "[2026-12-01 11:03:11.123] ");
  EXPECT_EQ(log::formatTimestamp("%T.%6f", sample()), "11:03:11.123456");
  EXPECT_EQ(log::formatTimestamp("%s.%9f", sample()), "1796122991.123456789");
  EXPECT_EQ(log::formatTimestamp("%1f|%%f|100%%", sample()), "1|%f|100%");
  EXPECT_EQ(log::formatTimestamp("", sample()), "");
  EXPECT_EQ(log::formatTimestamp("no fields", sample()), "no fields");
}

TEST(LogTimestampLevels, Parse) {
  EXPECT_EQ(log::parseTimestampLevels("WARN"), 1u);
  EXPECT_EQ(log::parseTimestampLevels("warn, Info"), 3u);
  EXPECT_EQ(log::parseTimestampLevels("TRACE"), 4u);
  EXPECT_EQ(log::parseTimestampLevels("ALL"), 7u);
  EXPECT_EQ(log::parseTimestampLevels("NONE"), 0u);
  EXPECT_EQ(log::parseTimestampLevels(""), 0u);
  try {
    log::parseTimestampLevels("WARN,DEBUG");
    FAIL() << "DEBUG accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'DEBUG' is not WARN, INFO, TRACE"), std::string::npos) << e.what();
  }
}

// The settings are read once per process: each case logs from a fresh child (this
// binary logs nothing itself, so the child starts with nothing read).
std::string logFromChild(const char* levels, const char* format) {
  char path[] = "/tmp/crossbar_test_log_XXXXXX";
  const int fd = ::mkstemp(path);
  EXPECT_GE(fd, 0);
  ::close(fd);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("CROSSBAR_DEBUG_FILE", path, 1);
    ::setenv("CROSSBAR_DEBUG", "INFO", 1);
    if (levels) ::setenv("CROSSBAR_DEBUG_TIMESTAMP_LEVELS", levels, 1);
    if (format) ::setenv("CROSSBAR_DEBUG_TIMESTAMP_FORMAT", format, 1);
    CB_WARN("test", "a warning");
    CB_INFO("test", "some info");
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  ::unlink(path);
  return text.str();
}

TEST(LogTimestampLines, DefaultStampsWarningsOnly) {
  const std::string text = logFromChild(nullptr, nullptr);
  const std::regex warn(R"(^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\] [^ ]+:\d+:-1 \[WARN\] test: a warning$)");
  const std::regex info(R"(^[^ \[]+:\d+:-1 \[INFO\] test: some info$)");
  std::istringstream lines(text);
  std::string first, second;
  std::getline(lines, first);
  std::getline(lines, second);
  EXPECT_TRUE(std::regex_match(first, warn)) << text;
  EXPECT_TRUE(std::regex_match(second, info)) << text;
}

TEST(LogTimestampLines, LevelsAndFormatFromEnvironment) {
  const std::string text = logFromChild("ALL", "<%s> ");
  const std::regex stamped(R"(^<\d+> [^ ]+:\d+:-1 \[(WARN|INFO)\] test: .*$)");
  std::istringstream lines(text);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    EXPECT_TRUE(std::regex_match(line, stamped)) << line;
    ++n;
  }
  EXPECT_EQ(n, 2) << text;
  const std::string none = logFromChild("NONE", nullptr);
  EXPECT_EQ(none.find('['), none.find("[WARN]")) << none;
}

}  // namespace
}  // namespace crossbar
