#include "collectives/cma.h"

#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "comm/errors.h"

namespace crossbar::cma {

std::string allowPeerReads() {
  std::ifstream yama("/proc/sys/kernel/yama/ptrace_scope");
  int scope = 0;
  if (!(yama >> scope) || scope == 0) return "";
  if (scope >= 2) return fmt::format("Yama ptrace_scope is {} (only root may attach)", scope);
  if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0)
    return fmt::format("prctl(PR_SET_PTRACER_ANY) failed: {}", std::strerror(errno));
  return "";
}

std::string probe(pid_t pid, const void* remote, uint64_t expect, int peer) {
  uint64_t got = 0;
  iovec l{&got, sizeof got}, r{const_cast<void*>(remote), sizeof got};
  const ssize_t n = process_vm_readv(pid, &l, 1, &r, 1, 0);
  if (n < 0)
    return fmt::format("process_vm_readv of rank {} (pid {}) failed: {}", peer, pid, std::strerror(errno));
  if (n != static_cast<ssize_t>(sizeof got) || got != expect)
    return fmt::format("process_vm_readv of rank {} (pid {}) read other data (separate PID namespaces?)",
                       peer, pid);
  return "";
}

void read(pid_t pid, void* local, const void* remote, size_t bytes, int rank, int peer, const char* op) {
  auto* dst = static_cast<char*>(local);
  auto* src = static_cast<const char*>(remote);
  while (bytes > 0) {
    iovec l{dst, bytes}, r{const_cast<char*>(src), bytes};
    const ssize_t n = process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == ESRCH)  // the peer exited: the fault-tolerance layer needs PeerFailure naming it
        throw PeerFailure(fmt::format("{}rank {} (pid {}) exited during a single-copy read",
                                      errorContext(rank, op), peer, pid),
                          {peer});
      throw SystemError(
          fmt::format("{}single-copy read of {} bytes from rank {} (pid {}) at {} failed: {}; "
                      "was its buffer freed early, or did it exit? Set CROSSBAR_COLL_CMA=off to "
                      "use the staged path",
                      errorContext(rank, op), bytes, peer, pid, remote,
                      n < 0 ? std::strerror(errno) : "no progress"),
          {peer});
    }
    dst += n;
    src += n;
    bytes -= static_cast<size_t>(n);
  }
}

}  // namespace crossbar::cma
