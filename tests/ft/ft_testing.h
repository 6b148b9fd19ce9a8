// Helpers shared by the fault-tolerance tests and the recovery benchmark.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "comm/errors.h"
#include "comm/ft.h"
#include "comm/tcp_store.h"
#include "harness/multiprocess.h"

namespace crossbar::testing {

// A second store connection for the detector thread (the TCP client serializes calls).
inline std::shared_ptr<Store> detectorStore(const RankEnv& env) {
  TcpStoreOptions so;
  so.host = "127.0.0.1";
  so.port = static_cast<uint16_t>(std::stoi(env.store_addr.substr(env.store_addr.rfind(':') + 1)));
  return std::make_shared<TcpStore>(so);
}

inline ft::FtOptions ftOptions(const RankEnv& env) {
  ft::FtOptions o;
  o.detector_store = detectorStore(env);
  return o;
}

// Monotonic clock in ns; CLOCK_MONOTONIC is shared by every process on the machine.
inline int64_t monoNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Closed-form data: exact in any reduction order.
inline int32_t value(int rank, size_t i, uint32_t seed) {
  return static_cast<int32_t>((rank + 1) * static_cast<int32_t>(i % 97) + static_cast<int32_t>(seed % 13));
}

// One verified collective: allreduce or alltoall, small (eager) or large (rendezvous).
inline void step(Collectives& c, int iter, uint32_t seed) {
  const int n = c.comm().size(), me = c.comm().rank();
  const size_t count = (iter % 4 < 2) ? 257 : 40'000;
  if (iter % 2 == 0) {
    std::vector<int32_t> in(count), out(count, -1);
    for (size_t i = 0; i < count; ++i) in[i] = value(me, i, seed + iter);
    c.allreduce(in.data(), out.data(), count, DataType::kInt32, ReduceOp::kSum)->wait();
    for (size_t i = 0; i < count; ++i) {
      int32_t want = 0;
      for (int r = 0; r < n; ++r) want += value(r, i, seed + iter);
      if (out[i] != want) {
        ADD_FAILURE() << "allreduce iter " << iter << " element " << i << ": " << out[i] << " != " << want;
        return;
      }
    }
  } else {
    const size_t block = count / 8 + 1;
    std::vector<int32_t> in(block * n), out(block * n, -1);
    for (int r = 0; r < n; ++r)
      for (size_t j = 0; j < block; ++j) in[r * block + j] = value(me * 31 + r, j, seed + iter);
    c.alltoall(in.data(), out.data(), block, DataType::kInt32)->wait();
    for (int s = 0; s < n; ++s)
      for (size_t j = 0; j < block; ++j)
        if (out[s * block + j] != value(s * 31 + me, j, seed + iter)) {
          ADD_FAILURE() << "alltoall iter " << iter << " from " << s << " element " << j;
          return;
        }
  }
}

// Shared-memory segments mapped by this process, and open descriptors.
inline int countShmMaps() {
  std::ifstream in("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(in, line))
    if (line.find("crossbar-shm") != std::string::npos) ++n;
  return n;
}

inline int countFds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

// Verified collectives on `coll` until one fails: rank `victim` SIGKILLs itself at the
// third. The failure must blame exactly `victim` (handleError). Leaves `coll` empty;
// false (with a test failure recorded) when the loop did not fail or blamed others.
inline bool loseRankInCollectives(ft::FaultTolerantComm& ft, std::unique_ptr<Collectives>& coll, int rank,
                                  int victim, uint32_t seed) {
  try {
    for (int it = 0; it < 2000; ++it) {
      if (rank == victim && it == 2) ::kill(::getpid(), SIGKILL);
      step(*coll, it, seed);
    }
    ADD_FAILURE() << "no failure after 2000 iterations";
    return false;
  } catch (const Error& e) {
    coll.reset();
    auto faults = ft.handleError(e);
    EXPECT_EQ(faults.size(), 1u) << e.what();
    if (faults.size() != 1) return false;
    EXPECT_EQ(faults[0].rank, victim);
  }
  return true;
}

// `e`, from an operation that failed because rank `victim` died: PeerFailure (or Aborted)
// within `bound` of `since_ns`; handleError() must blame exactly that rank, as dead.
inline void expectDeathBlamed(ft::FaultTolerantComm& ft, const Error& e, int victim, int64_t since_ns,
                              Millis bound) {
  EXPECT_TRUE(e.code() == ErrorCode::kPeerFailure || e.code() == ErrorCode::kAborted) << e.what();
  EXPECT_LT(monoNs() - since_ns, bound.count() * 1'000'000LL)
      << "waited too long for rank " << victim << ": " << e.what();
  auto faults = ft.handleError(e);
  ASSERT_EQ(faults.size(), 1u) << e.what();
  EXPECT_EQ(faults[0].rank, victim) << faults[0].describe();
  EXPECT_EQ(faults[0].kind, ft::FailureKind::kDead) << faults[0].describe();
}

}  // namespace crossbar::testing
