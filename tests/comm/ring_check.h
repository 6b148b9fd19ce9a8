// Shared check of the split tests: a ring exchange on one communicator proves its messages
// reach the right ranks and no other communicator's message is taken on the way.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>

#include "comm/communicator.h"

namespace crossbar::testing {

// Each rank sends [salt, its world rank] to the next rank on `c` (tag `tag`) and checks
// what the previous one sent.
inline void ring(Communicator& c, int salt, uint32_t tag = 7) {
  if (c.size() == 1) return;
  const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
  int out[2] = {salt, c.worldRank(c.rank())}, in[2] = {-1, -1};
  auto r = c.irecv(in, sizeof in, prev, tag);
  auto s = c.isend(out, sizeof out, next, tag);
  c.waitAll({r, s}, c.defaultDeadline());
  EXPECT_EQ(in[0], salt) << c.describe() << ": message of another communicator";
  EXPECT_EQ(in[1], c.worldRank(prev)) << c.describe();
}

}  // namespace crossbar::testing
