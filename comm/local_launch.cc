#include "comm/local_launch.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <optional>
#include <thread>

#include "comm/errors.h"
#include "comm/log.h"
#include "comm/tcp_store.h"

namespace crossbar {

ForkedStoreServer::ForkedStoreServer() {
  int port_pipe[2], life_pipe[2];
  if (pipe(port_pipe) != 0) throwSystemError(-1, "store server pipe", errno);
  if (pipe(life_pipe) != 0) {
    const int err = errno;
    ::close(port_pipe[0]);
    ::close(port_pipe[1]);
    throwSystemError(-1, "store server pipe", err);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  pid_ = fork();
  if (pid_ < 0) throwSystemError(-1, "fork store server", errno);
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::close(port_pipe[0]);
    ::close(life_pipe[1]);
    uint16_t port = 0;
    try {
      TcpStoreServer server("127.0.0.1", 0);
      port = server.port();
      if (::write(port_pipe[1], &port, sizeof(port)) != static_cast<ssize_t>(sizeof(port))) _exit(1);
      // Serve until every holder of the write end has closed it (or died).
      for (char c;;)
        if (::read(life_pipe[0], &c, 1) >= 0 || errno != EINTR) break;
      server.stop();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "crossbar: store server process: %s\n", e.what());
    }
    _exit(port ? 0 : 1);
  }
  ::close(port_pipe[1]);
  ::close(life_pipe[0]);
  life_fd_ = life_pipe[1];
  ssize_t n;
  do {
    n = ::read(port_pipe[0], &port_, sizeof(port_));
  } while (n < 0 && errno == EINTR);
  ::close(port_pipe[0]);
  if (n != static_cast<ssize_t>(sizeof(port_))) {
    stop();
    throw SystemError("crossbar: the store server process failed to start (see its message above)");
  }
}

ForkedStoreServer::~ForkedStoreServer() { stop(); }

void ForkedStoreServer::closeInChild() const {
  if (life_fd_ >= 0) ::close(life_fd_);
}

void ForkedStoreServer::stop() {
  if (life_fd_ >= 0) ::close(life_fd_);
  life_fd_ = -1;
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  pid_ = -1;
}

std::vector<LocalRankExit> launchLocalRanks(
    int size, const std::function<int(int, int, std::shared_ptr<Store>)>& body, LocalLaunchOptions options) {
  ForkedStoreServer server;
  const uint16_t port = server.port();
  std::vector<pid_t> pids(size, -1);
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < size; ++r) {
    pid_t pid = fork();
    if (pid < 0) throwSystemError(-1, "fork local rank", errno);
    if (pid == 0) {
      server.closeInChild();
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
