// CPU tests of the CUDA collectives path (no GPU needed): the cuda rows of the
// selection table and their fallbacks, CROSSBAR_ALGO with CUDA names, the table
// printout, and clean failures of device-memory calls where CUDA cannot run (no
// driver, or a build without CUDA). Ranks are forked processes, so the gtest
// process never initializes CUDA.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/cuda/route.h"
#include "collectives/selection.h"
#include "comm/errors.h"
#include "harness/multiprocess.h"

#if defined(CROSSBAR_HAVE_CUDA_COLLECTIVES)
#include "collectives/cuda/cuda_collectives.h"
#include "symmem/cuda/driver_api.h"
#endif

namespace crossbar {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;

CollArgs args(CollType c, size_t count, DataType t = DataType::kFloat32) {
  CollArgs a;
  a.coll = c;
  a.count = count;
  a.type = t;
  a.send = reinterpret_cast<const void*>(0x1000);
  a.recv = reinterpret_cast<void*>(0x40000000);
  return a;
}

std::string pick(const CollArgs& a, const Communicator& c, const std::string& forced = "",
                 const AlgoOverride& ov = {}) {
  return selectAlgorithm(a, c, forced, ov, MemoryKind::kCuda).algorithm->name;
}

TEST(CudaSelection, OneNodeUsesTheHeapAlgorithms) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    EXPECT_EQ(pick(args(CollType::kAllreduce, 1024), *comm), "oneshot");     // 4 KiB
    EXPECT_EQ(pick(args(CollType::kAllreduce, 1 << 20), *comm), "twoshot");  // 4 MiB
    EXPECT_EQ(pick(args(CollType::kReduceScatter, 1 << 20), *comm), "direct");
    EXPECT_EQ(pick(args(CollType::kReduce, 7), *comm), "direct");
    for (CollType c : {CollType::kAllgather, CollType::kAlltoall, CollType::kAlltoallv, CollType::kBroadcast,
                       CollType::kGather, CollType::kScatter})
      EXPECT_EQ(pick(args(c, 1000), *comm), "ce") << collTypeName(c);
    EXPECT_EQ(pick(args(CollType::kBarrier, 0), *comm), "signal");
    CollArgs s = args(CollType::kSend, 10);
    s.peer = 1 - comm->rank();
    EXPECT_EQ(pick(s, *comm), "nccl");  // point to point always goes to NCCL
    // The host table is unchanged by the cuda rows.
    EXPECT_EQ(selectAlgorithm(args(CollType::kAllgather, 1000), *comm, "", {}).algorithm->name, "symm");
  });
}

TEST(CudaSelection, SeveralNodesFallBackToNccl) {
  RunOptions opt;
  opt.env["CROSSBAR_RANKS_PER_NODE"] = "1";  // 2 virtual nodes
  runRanks(
      2,
      [](RankEnv& env) {
        auto comm = env.communicator();
        ASSERT_EQ(comm->numNodes(), 2);
        for (int i = 0; i < kNumCollTypes; ++i) {
          CollArgs a = args(static_cast<CollType>(i), 64);
          a.peer = 1 - comm->rank();
          EXPECT_EQ(pick(a, *comm), "nccl") << collTypeName(a.coll);
        }
        // Forcing a heap algorithm that does not apply falls back, saying why.
        Selection s =
            selectAlgorithm(args(CollType::kAllreduce, 64), *comm, "oneshot", {}, MemoryKind::kCuda);
        EXPECT_EQ(s.algorithm->name, "nccl");
        EXPECT_NE(s.reason.find("does not apply"), std::string::npos) << s.reason;
        EXPECT_NE(s.reason.find("2 nodes"), std::string::npos) << s.reason;
      },
      opt);
}

TEST(CudaSelection, OverridesAndUnknownNames) {
  runRanks(1, [](RankEnv& env) {
    auto comm = env.communicator();
    AlgoOverride ov = parseAlgoOverride("nccl");  // a bare CUDA-only name: every collective
    for (int i = 0; i < kNumCollTypes; ++i) EXPECT_EQ(ov.per_coll[i], "nccl");
    EXPECT_EQ(pick(args(CollType::kAllreduce, 8), *comm, "", ov), "nccl");
    // The host path ignores a name it does not have.
    EXPECT_NE(selectAlgorithm(args(CollType::kAllreduce, 8), *comm, "", ov).algorithm->name, "nccl");
    AlgoOverride two = parseAlgoOverride("allreduce=twoshot");
    EXPECT_EQ(pick(args(CollType::kAllreduce, 8), *comm, "", two), "twoshot");
    EXPECT_EQ(selectAlgorithm(args(CollType::kAllreduce, 8), *comm, "", two).algorithm->name, "twoshot");
    EXPECT_EQ(pick(args(CollType::kAllgather, 8), *comm, "", parseAlgoOverride("allgather=nccl")), "nccl");
    EXPECT_THROW(parseAlgoOverride("allgather=oneshot"), InvalidArgument);
    EXPECT_THROW(parseAlgoOverride("allreduce=cee"), InvalidArgument);
    try {
      pick(args(CollType::kAllreduce, 8), *comm, "ring");  // a host-only name forced on cuda memory
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("cuda memory"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("oneshot"), std::string::npos) << e.what();
    }
    EXPECT_EQ(pick(args(CollType::kAllreduce, 8), *comm, "twoshot"), "twoshot");
  });
}

TEST(CudaSelection, TablePrintsTheCudaRows) {
  const std::string t = describeAlgorithmTable();
  EXPECT_NE(t.find("cuda allreduce"), std::string::npos) << t;
  EXPECT_NE(t.find("-> oneshot"), std::string::npos) << t;
  EXPECT_NE(t.find("host allreduce"), std::string::npos) << t;
  size_t nccl_rows = 0;
  for (const SelectionRule& r : selectionTable())
    if (r.memory == MemoryKind::kCuda && r.algorithm == "nccl") ++nccl_rows;
  EXPECT_EQ(nccl_rows, static_cast<size_t>(kNumCollTypes));  // every collective has an NCCL row
  for (const SelectionRule& r : selectionTable())
    EXPECT_NE(findAlgorithm(r.coll, r.algorithm, r.memory), nullptr) << r.algorithm;
}

// Host pointers keep the host path; device-memory requests fail clearly where CUDA
// cannot run (this machine: no driver; or a build without CUDA).
TEST(CudaFrontEnd, HostPointersStayOnTheHostAndCudaStreamFailsCleanly) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    Collectives coll(comm);
    std::vector<float> in(100, 1.0f), out(100, 0.0f);
    EXPECT_EQ(pointerMemoryKind(in.data()), MemoryKind::kHost);
    coll.allreduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kSum)->wait();
    EXPECT_EQ(out[99], 2.0f);
#if defined(CROSSBAR_HAVE_CUDA_COLLECTIVES)
    if (cuda::driverAvailable()) GTEST_SKIP() << "a CUDA driver is present: the GPU test covers this";
#endif
    CollOptions o;
    o.cuda_stream = reinterpret_cast<void*>(0x1);  // never dereferenced: refused first
    try {
      coll.allreduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kSum, o);
      ADD_FAILURE() << "no error";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find("cuda_stream"), std::string::npos) << e.what();
    }
    // The host path still works afterwards (nothing was enqueued or made sticky).
    coll.allreduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kMax)->wait();
    EXPECT_EQ(out[0], 1.0f);
  });
}

#if defined(CROSSBAR_HAVE_CUDA_COLLECTIVES)
// The library loads and CudaCollectives refuses cleanly without a driver.
TEST(CudaCollectivesNoDriver, ConstructorSaysWhy) {
  runRanks(1, [](RankEnv& env) {
    if (cuda::driverAvailable()) GTEST_SKIP() << "a CUDA driver is present";
    try {
      CudaCollectives cc(env.communicator());
      ADD_FAILURE() << "no error";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find("no usable CUDA driver"), std::string::npos) << e.what();
    }
  });
}
#endif

// Argument checks shared with the CUDA front end run before anything else.
TEST(CudaFrontEnd, ValidateCollArgs) {
  runRanks(2, [](RankEnv& env) {
    auto comm = env.communicator();
    CollArgs a = args(CollType::kAllreduce, 16);
    EXPECT_NO_THROW(validateCollArgs(a, *comm));
    a.recv = nullptr;
    EXPECT_THROW(validateCollArgs(a, *comm), InvalidArgument);
    CollArgs b = args(CollType::kBroadcast, 16);
    b.root = 2;
    EXPECT_THROW(validateCollArgs(b, *comm), InvalidArgument);
    CollArgs o = args(CollType::kAllgather, 16);
    o.recv = const_cast<void*>(o.send);  // overlapping, not the in-place layout (rank 1)
    if (comm->rank() == 1) {
      EXPECT_THROW(validateCollArgs(o, *comm), InvalidArgument);
    }
    CollArgs p = args(CollType::kAllreduce, 16, DataType::kInt32);
    p.op = ReduceOp::kPreMulSum;
    EXPECT_THROW(validateCollArgs(p, *comm), InvalidArgument);
  });
}

}  // namespace
}  // namespace crossbar
