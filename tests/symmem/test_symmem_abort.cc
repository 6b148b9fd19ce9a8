// SymmetricHeap::create observes an abort of its communicator: a rank that never
// arrives (it died before the first collective) must not hold the others in the
// heap's socket rendezvous until the deadline once the communicator is aborted.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "comm/errors.h"
#include "harness/multiprocess.h"
#include "symmem/symmetric_heap.h"

namespace crossbar::symm {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;

TEST(SymmHeapAbort, AbortEndsCreateRendezvous) {
  constexpr int kAbsent = 2;
  const Millis timeout{60'000};  // what the ranks would wait without the abort
  runRanks(3, [&](RankEnv& env) {
    CommOptions co;
    co.timeout = timeout;
    auto comm = env.communicator(co);
    if (env.rank == kAbsent) {  // never creates the heap; leaves when the others are done
      env.store->get("test/done/0", Deadline::after(timeout));
      env.store->get("test/done/1", Deadline::after(timeout));
      return;
    }
    // Ranks 0 and 1 block accepting rank 2's connection; a watchdog aborts.
    std::thread watchdog([&] {
      std::this_thread::sleep_for(Millis(300));
      comm->abort("test: rank 2 is gone");
    });
    const auto t0 = Clock::now();
    try {
      SymmetricHeap::create(comm);
      ADD_FAILURE() << "rank " << env.rank << ": create() returned without rank " << kAbsent;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
      const std::string what = e.what();
      EXPECT_NE(what.find("create"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 2 is gone"), std::string::npos) << what;
    }
    // Far below the 60 s deadline, far above a 100 ms slice on a loaded machine.
    EXPECT_LT(Clock::now() - t0, Millis(20'000));
    watchdog.join();
    env.store->set("test/done/" + std::to_string(env.rank), std::string("1"));
  });
}

// A heap made on a split: the split's own abort (not its context's) releases a rank
// waiting for a peer's signal that never comes, and the parent keeps working.
TEST(SymmHeapAbort, AbortOfASplitEndsItsSignalWaits) {
  const Millis timeout{60'000};
  runRanks(2, [&](RankEnv& env) {
    CommOptions co;
    co.timeout = timeout;
    auto parent = env.communicator(co);
    auto split = parent->dup();
    auto heap = SymmetricHeap::create(split);
    auto buf = heap.allocate(4096);
    if (env.rank == 0) {  // waits for rank 1's signal; a watchdog aborts the split
      std::thread watchdog([&] {
        std::this_thread::sleep_for(Millis(300));
        split->abort("test: the group is abandoned");
      });
      const auto t0 = Clock::now();
      try {
        buf->waitSignal(1, 0, Deadline::after(timeout));
        ADD_FAILURE() << "waitSignal returned without rank 1's signal";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
      }
      EXPECT_LT(Clock::now() - t0, Millis(20'000));
      watchdog.join();
      EXPECT_FALSE(parent->aborted());
    }
    parent->barrier();  // the parent's transports still work
  });
}

}  // namespace
}  // namespace crossbar::symm
