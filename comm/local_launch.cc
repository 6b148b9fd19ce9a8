#include "comm/local_launch.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <optional>
#include <thread>

#include "comm/errors.h"
#include "comm/log.h"
#include "comm/tcp_store.h"

namespace crossbar {

std::vector<LocalRankExit> launchLocalRanks(
    int size, const std::function<int(int, int, std::shared_ptr<Store>)>& body, LocalLaunchOptions options) {
  TcpStoreServer server("127.0.0.1", 0);
  const uint16_t port = server.port();
  std::vector<pid_t> pids(size, -1);
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < size; ++r) {
    pid_t pid = fork();
    if (pid < 0) throwSystemError(-1, "fork local rank", errno);
    if (pid == 0) {
      int code = 1;
      try {
        log::setRank(r);
        TcpStoreOptions so;
        so.port = port;
        code = body(r, size, std::make_shared<TcpStore>(so));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "crossbar: rank %d failed: %s\n", r, e.what());
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids[r] = pid;
  }
  std::vector<LocalRankExit> exits(size);
  std::vector<bool> done(size, false);
  int remaining = size;
  auto deadline = options.timeout.count() > 0 ? Deadline::after(options.timeout) : Deadline::never();
  std::optional<Deadline> grace;
  while (remaining > 0) {
    bool reaped = false;
    for (int r = 0; r < size; ++r) {
      if (done[r]) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
        --remaining;
        reaped = true;
        exits[r] = {r, WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status)};
        if (exits[r].exit_code != 0 && !grace) grace = Deadline::after(Millis(5000));
      }
    }
    if (remaining == 0) break;
    if (deadline.expired() || (grace && grace->expired())) {
      for (int r = 0; r < size; ++r) {
        if (done[r]) continue;
        std::fprintf(stderr, "crossbar: killing rank %d (%s)\n", r,
                     deadline.expired() ? "job timed out" : "another rank failed");
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        exits[r] = {r, -SIGKILL};
        done[r] = true;
      }
      break;
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return exits;
}

int combinedExitCode(const std::vector<LocalRankExit>& exits) {
  for (auto& e : exits)
    if (e.exit_code != 0) return e.exit_code > 0 ? e.exit_code : 128 - e.exit_code;
  return 0;
}

}  // namespace crossbar
