// Cross-memory attach (CMA): read another process's memory with one copy
// (process_vm_readv), for the single-copy host collectives (symm_algorithms.cc) between
// same-user processes on one host. Whether it works is environment-dependent (Yama
// ptrace_scope, seccomp in containers, separate PID namespaces), so users probe once and
// fall back to the staged path when it does not.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace crossbar::cma {

// Lets same-user peers read this process (Yama ptrace_scope 1 allows only descendants:
// PR_SET_PTRACER_ANY). "" when reads may work; otherwise why not.
std::string allowPeerReads();

// Whether one read from `pid` at `remote` yields the 8-byte `expect` (permission, the
// right process, the syscall itself). "" on success; otherwise the reason, naming `peer`.
std::string probe(pid_t pid, const void* remote, uint64_t expect, int peer);

// Copies `bytes` from `remote` in process `pid` (rank `peer`) to `local`, looping over
// partial reads. SystemError naming `rank`, `op` and `peer` on failure.
void read(pid_t pid, void* local, const void* remote, size_t bytes, int rank, int peer, const char* op);

}  // namespace crossbar::cma
