// gtest main for crossbar tests.
#include <gtest/gtest.h>
#include <signal.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  signal(SIGPIPE, SIG_IGN);  // a dead peer's socket must give EPIPE, not kill us
  return RUN_ALL_TESTS();
}
