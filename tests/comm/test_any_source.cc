// Any-source receives (Communicator::irecv with kAnySource) over shm, UCX and both at
// once (virtual nodes): every message taken exactly once, the sender reported, FIFO per
// sender, receives posted before and after the messages arrive, eager and rendezvous
// sizes, precedence of receives naming the sender, sub-communicator ranks, errors.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "comm/communicator.h"
#include "comm/context.h"
#include "comm/errors.h"
#include "harness/multiprocess.h"

using namespace crossbar;
using crossbar::testing::RankEnv;
using crossbar::testing::RunOptions;
using crossbar::testing::runRanks;

namespace {

constexpr uint32_t kTag = 21;

// Message `seq` from `src`: words [src, seq, checksum words...].
std::vector<uint32_t> message(int src, uint32_t seq, size_t words) {
  std::vector<uint32_t> m(std::max<size_t>(words, 2));
  m[0] = static_cast<uint32_t>(src);
  m[1] = seq;
  for (size_t i = 2; i < m.size(); ++i)
    m[i] = static_cast<uint32_t>(src * 7919u + seq * 104729u + i * 2654435761u);
  return m;
}

// Checks one received message against status().source and returns its seq.
uint32_t checkMessage(const std::vector<uint32_t>& got, const Status& st, size_t words) {
  EXPECT_GE(st.source, 0);
  EXPECT_EQ(st.bytes, std::max<size_t>(words, 2) * 4);
  EXPECT_EQ(static_cast<int>(got[0]), st.source) << "status().source does not name the sender";
  auto expected = message(st.source, got[1], words);
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(got[i], expected[i]) << "word " << i << " from rank " << st.source;
    if (got[i] != expected[i]) break;
  }
  return got[1];
}

// Rank 0 receives `per_rank` messages of `words` words from every other rank with
// any-source receives, posted before the messages arrive (`preposted`) or after.
void fanIn(Communicator& c, int per_rank, size_t words, bool preposted) {
  const int n = c.size();
  const size_t len = std::max<size_t>(words, 2);
  if (c.rank() == 0) {
    const int total = (n - 1) * per_rank;
    std::vector<std::vector<uint32_t>> bufs(total, std::vector<uint32_t>(len));
    std::vector<RequestPtr> reqs;
    auto post = [&] {
      for (int i = 0; i < total; ++i) reqs.push_back(c.irecv(bufs[i].data(), len * 4, kAnySource, kTag));
    };
    if (preposted) post();
    c.barrier();
    if (!preposted) {
      c.barrier();  // senders' eager messages are here (rendezvous ones announced)
      post();
    }
    c.waitAll(reqs, c.defaultDeadline());
    // Every (source, seq) exactly once; each source's messages in its sending order
    // (receives complete in posting order per source).
    std::map<int, std::vector<uint32_t>> seqs;
    for (int i = 0; i < total; ++i) {
      const Status& st = reqs[i]->status();
      EXPECT_EQ(st.tag, kTag);
      seqs[st.source].push_back(checkMessage(bufs[i], st, words));
    }
    ASSERT_EQ(seqs.size(), static_cast<size_t>(n - 1));
    for (auto& [src, s] : seqs) {
      ASSERT_EQ(s.size(), static_cast<size_t>(per_rank)) << "from rank " << src;
      for (int k = 0; k < per_rank; ++k) EXPECT_EQ(s[k], static_cast<uint32_t>(k)) << "from rank " << src;
    }
  } else {
    std::vector<std::vector<uint32_t>> msgs;
    for (int k = 0; k < per_rank; ++k) msgs.push_back(message(c.rank(), k, words));
    if (preposted) c.barrier();
    std::vector<RequestPtr> reqs;
    for (auto& m : msgs) reqs.push_back(c.isend(m.data(), m.size() * 4, 0, kTag));
    if (!preposted) {
      c.barrier();
      c.barrier();
    }
    c.waitAll(reqs, c.defaultDeadline());
  }
  c.barrier();
}

class AnySource : public ::testing::TestWithParam<int> {};  // ranks per node: 0 shm, 1 ucx, 2 both

TEST_P(AnySource, FanInEveryMessageOnceWithItsSender) {
  RunOptions opts;
  opts.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(GetParam());
  runRanks(
      4,
      [](RankEnv& env) {
        auto c = env.communicator();
        for (bool preposted : {true, false}) {
          fanIn(*c, 5, 16, preposted);       // eager
          fanIn(*c, 2, 100'000, preposted);  // rendezvous (400 KB)
        }
        c->destroy();
      },
      opts);
}

TEST_P(AnySource, NamedReceiveTakesPrecedence) {
  RunOptions opts;
  opts.env["CROSSBAR_RANKS_PER_NODE"] = std::to_string(GetParam());
  runRanks(
      3,
      [](RankEnv& env) {
        auto c = env.communicator();
        if (c->rank() == 0) {
          // Both posted before anything arrives: rank 1's message goes to the receive naming it.
          std::vector<uint32_t> named(2), any(2);
          auto any_req = c->irecv(any.data(), 8, kAnySource, kTag);
          auto named_req = c->irecv(named.data(), 8, 1, kTag);
          c->barrier();
          c->waitAll({any_req, named_req}, c->defaultDeadline());
          EXPECT_EQ(named_req->status().source, 1);
          EXPECT_EQ(named[0], 1u);
          EXPECT_EQ(any_req->status().source, 2);
          EXPECT_EQ(any[0], 2u);
          // Other tags are not taken by an any-source receive.
          std::vector<uint32_t> other(2);
          auto any2 = c->irecv(any.data(), 8, kAnySource, kTag + 1);
          c->recv(other.data(), 8, 2, kTag + 2);
          EXPECT_FALSE(any2->done());
          c->barrier();
          Status st = c->recv(other.data(), 8, kAnySource, kTag + 3);  // blocking form reports the sender too
          EXPECT_EQ(st.source, 1);
          EXPECT_EQ(st.tag, kTag + 3);
          any2->wait(c->defaultDeadline());
          EXPECT_EQ(any2->status().source, 1);
        } else {
          c->barrier();
          auto m = message(c->rank(), 0, 2);
          c->send(m.data(), 8, 0, kTag);
          if (c->rank() == 2) c->send(m.data(), 8, 0, kTag + 2);
          c->barrier();
          if (c->rank() == 1) {
            c->send(m.data(), 8, 0, kTag + 3);
            c->send(m.data(), 8, 0, kTag + 1);
          }
        }
        c->barrier();
      },
      opts);
}

INSTANTIATE_TEST_SUITE_P(Transports, AnySource, ::testing::Values(0, 1, 2),
                         [](const auto& info) { return "rpn" + std::to_string(info.param); });

TEST(AnySourceComm, SubCommunicatorRanksAndSeparation) {
  RunOptions opts;
  opts.env["CROSSBAR_RANKS_PER_NODE"] = "2";  // shm and UCX inside each half
  runRanks(
      6,
      [](RankEnv& env) {
        auto world = env.communicator();
        // Evens and odds, reversed: sub-ranks differ from world ranks.
        auto half = world->split(env.rank % 2, -env.rank);
        ASSERT_TRUE(half);
        // World traffic with the same user tag must not be taken by the halves' receives.
        if (world->rank() == 0) {
          std::vector<uint32_t> m(2);
          Status st = world->recv(m.data(), 8, kAnySource, kTag);
          EXPECT_EQ(st.source, 5);
          EXPECT_EQ(m[0], 5u);
        } else if (world->rank() == 5) {
          auto m = message(5, 0, 2);
          world->send(m.data(), 8, 0, kTag);
        }
        fanIn(*half, 3, 8, env.rank % 2 == 0);  // same choice within a half
        world->barrier();
      },
      opts);
}

TEST(AnySourceComm, TruncationTimeoutAbortAndMisuse) {
  runRanks(2, [](RankEnv& env) {
    auto c = env.communicator();
    if (c->rank() == 0) {
      // Too small a receive fails that receive only.
      std::vector<uint32_t> small(1), ok(4);
      auto r = c->irecv(small.data(), 4, kAnySource, kTag);
      EXPECT_THROW(r->wait(c->defaultDeadline()), InvalidUsage);
      Status st = c->recv(ok.data(), 16, kAnySource, kTag);
      EXPECT_EQ(st.source, 1);
      EXPECT_EQ(st.bytes, 8u);
      // Nobody sends: a bounded wait times out, naming the operation.
      auto pending = c->irecv(ok.data(), 16, kAnySource, kTag + 9);
      try {
        pending->wait(Deadline::after(Millis(100)));
        ADD_FAILURE() << "expected a timeout";
      } catch (const Timeout& e) {
        EXPECT_NE(std::string(e.what()).find("any rank"), std::string::npos) << e.what();
      }
      EXPECT_THROW(c->irecv(nullptr, 4, kAnySource, kTag), InvalidArgument);
      auto self = c->split(c->rank(), 0);  // a communicator of one
      EXPECT_THROW(self->irecv(ok.data(), 16, kAnySource, kTag), InvalidUsage);
      c->barrier();
      // Abort fails what is still pending, and later posts.
      c->abort("test");
      EXPECT_THROW(pending->wait(c->defaultDeadline()), Aborted);
      EXPECT_THROW(c->irecv(ok.data(), 16, kAnySource, kTag), Aborted);
    } else {
      std::vector<uint32_t> m = {1, 2};
      c->send(m.data(), 8, 0, kTag);
      c->send(m.data(), 8, 0, kTag);
      (void)c->split(c->rank(), 0);
      c->barrier();
    }
  });
}

}  // namespace
