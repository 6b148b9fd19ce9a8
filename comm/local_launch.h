// Self-launching: fork N local ranks with an embedded store, so one command runs a
// multi-rank job with no launcher (perf binaries' --nranks N, the demo).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/deadline.h"
#include "comm/store.h"

namespace crossbar {

// A TCP store server (127.0.0.1, ephemeral port) in its own forked process, ended with
// this object or when the parent dies. The parent keeps no server thread, so it can
// fork ranks safely: a live thread at fork time can leave children stuck on locks it
// held (sanitizer allocators, malloc arenas), and ThreadSanitizer refuses such forks.
class ForkedStoreServer {
 public:
  ForkedStoreServer();
  ~ForkedStoreServer();
  ForkedStoreServer(const ForkedStoreServer&) = delete;
  ForkedStoreServer& operator=(const ForkedStoreServer&) = delete;
  uint16_t port() const { return port_; }
  // Forked ranks close their inherited copy (closeInChild), so only the parent's end
  // keeps the server alive.
  void closeInChild() const;

 private:
  void stop();
  int pid_ = -1;
  int life_fd_ = -1;
  uint16_t port_ = 0;
};

struct LocalLaunchOptions {
  Millis timeout{0};  // 0: no limit besides the ranks' own deadlines
};

struct LocalRankExit {
  int rank = 0;
  int exit_code = 0;  // negative: killed by that signal
};

// Runs body(rank, size, store) in `size` forked processes; each child exits with
// body's return value (an escaping exception prints and exits 1). Returns every
// rank's exit. If one rank fails, the others are given 5 s and then killed, so a
// failed job never hangs.
std::vector<LocalRankExit> launchLocalRanks(
    int size, const std::function<int(int rank, int size, std::shared_ptr<Store> store)>& body,
    LocalLaunchOptions options = {});

// 0 if every rank exited 0, else the first non-zero (signals as 128+n).
int combinedExitCode(const std::vector<LocalRankExit>& exits);

}  // namespace crossbar
