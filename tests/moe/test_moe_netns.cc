// moe_netns_bench in its smallest form: 2 virtual nodes x 2 ranks in network namespaces
// joined by tc-limited veth links. The benchmark itself checks that the two-level and the
// flat all-to-all deliver the same tokens and combine sums (exit 1 otherwise); this test
// checks it runs, produces its table and leaves no namespace behind. Skips without root or
// network-namespace support (the benchmark exits 77).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace {

std::string run(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return "popen failed";
  char buf[512];
  while (fgets(buf, sizeof buf, p)) out += buf;
  *status = pclose(p);
  return out;
}

TEST(MoeNetns, SmallRunMatchesFlatAllToAll) {
  int st = 0;
  const std::string out = run(std::string(MOE_NETNS_BENCH) +
                                  " --tokens 24 --hidden 256 --experts 16 --topk 4 --formats bf16,fp8"
                                  " --iters 1 --warmup 0 --rate 1gbit",
                              &st);
  ASSERT_TRUE(WIFEXITED(st)) << out;
  if (WEXITSTATUS(st) == 77) GTEST_SKIP() << out;
  ASSERT_EQ(WEXITSTATUS(st), 0) << out;
  EXPECT_NE(out.find("tc tbf 1gbit"), std::string::npos) << out;
  EXPECT_NE(out.find("     bf16 "), std::string::npos) << out;
  EXPECT_NE(out.find("      fp8 "), std::string::npos) << out;
  EXPECT_EQ(out.find("MISMATCH"), std::string::npos) << out;
  const std::string left = run("ip netns list", &st);
  EXPECT_EQ(left.find("cbxmoe"), std::string::npos) << "namespaces left behind:\n" << left;
}

}  // namespace
