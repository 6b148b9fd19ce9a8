#include "harness/multiprocess.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/local_launch.h"
#include "comm/log.h"
#include "comm/tcp_store.h"

namespace crossbar::testing {

std::shared_ptr<Communicator> RankEnv::communicator(CommOptions options) {
  if (!comm) comm = Communicator::create(store, rank, size, options);
  return comm;
}

namespace {

// Collects gtest failures raised inside a forked rank so they can be sent home.
class FailureCollector : public ::testing::EmptyTestEventListener {
 public:
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      text += fmt::format("{}:{}: {}\n", r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }
  std::string text;
};

void writeAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return;
    off += n;
  }
}

[[noreturn]] void runChild(int rank, int size, const std::string& addr, uint16_t port, int fd,
                           const std::function<void(RankEnv&)>& body, const RunOptions& options) {
  // Keep this rank's failures out of the parent's result printer.
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  auto* collector = new FailureCollector;
  listeners.Append(collector);
  for (auto& [k, v] : options.env) setenv(k.c_str(), v.c_str(), 1);
  log::setRank(rank);
  int code = 0;
  try {
    RankEnv env;
    env.rank = rank;
    env.size = size;
    env.store_addr = addr;
    TcpStoreOptions so;
    so.host = "127.0.0.1";
    so.port = port;
    env.store = std::make_shared<TcpStore>(so);
    body(env);
    env.comm.reset();
  } catch (const std::exception& e) {
    collector->text += fmt::format("uncaught exception: {}\n", e.what());
  } catch (...) {
    collector->text += "uncaught non-standard exception\n";
  }
  if (!collector->text.empty()) {
    writeAll(fd, collector->text);
    code = 1;
  }
  ::close(fd);
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(code);
}

}  // namespace

std::vector<RankResult> runRanks(int size, const std::function<void(RankEnv&)>& body,
                                 RunOptions options, bool expect_ok) {
  ForkedStoreServer server;  // no server thread here: ranks fork from a thread-free parent
  const uint16_t port = server.port();
  const std::string addr = fmt::format("127.0.0.1:{}", port);

  std::vector<pid_t> pids(size, -1);
  std::vector<int> fds(size, -1);
  std::vector<RankResult> results(size);
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < size; ++r) {
    int p[2];
    if (pipe(p) != 0) throw std::runtime_error("pipe failed");
    pid_t pid = fork();
    if (pid == 0) {
      ::close(p[0]);
      server.closeInChild();
      for (int q = 0; q < r; ++q) ::close(fds[q]);
      runChild(r, size, addr, port, p[1], body, options);
    }
    ::close(p[1]);
    pids[r] = pid;
    fds[r] = p[0];
    results[r].rank = r;
  }

  // Read failure text from every rank while waiting, up to the deadline.
  auto deadline = Deadline::after(options.timeout);
  int remaining = size;
  std::vector<bool> exited(size, false);
  while (remaining > 0) {
    for (int r = 0; r < size; ++r) {
      if (fds[r] < 0) continue;
      pollfd pfd{fds[r], POLLIN, 0};
      while (::poll(&pfd, 1, 0) > 0) {
        char buf[4096];
        ssize_t n = ::read(fds[r], buf, sizeof(buf));
        if (n <= 0) {
          ::close(fds[r]);
          fds[r] = -1;
          break;
        }
        results[r].failure.append(buf, n);
      }
    }
    for (int r = 0; r < size; ++r) {
      if (exited[r]) continue;
      int status = 0;
      pid_t w = waitpid(pids[r], &status, WNOHANG);
      if (w == pids[r]) {
        exited[r] = true;
        --remaining;
        results[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
    }
    if (remaining == 0) break;
    if (deadline.expired()) {
      for (int r = 0; r < size; ++r) {
        if (exited[r]) continue;
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        exited[r] = true;
        results[r].exit_code = -SIGKILL;
        results[r].failure += fmt::format("rank {} did not finish within {} ms and was killed\n", r,
                                          options.timeout.count());
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (int r = 0; r < size; ++r) {
    if (fds[r] >= 0) {
      char buf[4096];
      ssize_t n;
      while ((n = ::read(fds[r], buf, sizeof(buf))) > 0) results[r].failure.append(buf, n);
      ::close(fds[r]);
    }
    results[r].ok = results[r].exit_code == 0 && results[r].failure.empty();
    if (expect_ok && !results[r].ok && !(options.allow_rank_death && results[r].exit_code < 0)) {
      ADD_FAILURE() << "rank " << r << " of " << size << " failed (exit " << results[r].exit_code
                    << "):\n" << results[r].failure;
    }
  }
  return results;
}

}  // namespace crossbar::testing
