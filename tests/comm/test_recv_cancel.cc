// Request::cancel of a posted receive over shm (one node), UCX (one rank per node) and
// both (virtual nodes), named and from any source:
//  * withdrawn before any data: the request fails with Aborted naming the operation,
//    peer and tag, its buffer stays untouched, and the message sent later goes to the
//    next receive with that tag (nothing lost);
//  * racing with the message's arrival (another thread drives progress meanwhile), many
//    times: either withdrawn (failed, buffer never written, the message goes to the next
//    receive) or not (completes with the message), never both;
//  * sends, finished requests and a second cancel are not withdrawn;
//  * a split's abort withdraws its receives: a message its peer (which did not abort)
//    sends later is not written into them.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/progress.h"
#include "harness/multiprocess.h"

using namespace crossbar;
using crossbar::testing::RankEnv;
using crossbar::testing::RunOptions;
using crossbar::testing::runRanks;
using crossbar::testing::withRanksPerNode;

namespace {

constexpr uint32_t kTag = 11;
constexpr uint32_t kGoTag = 12;
constexpr int64_t kUnwritten = -7;
constexpr size_t kBig = 1 << 18;  // int64 words: 2 MiB, rendezvous on both transports

CommOptions longTimeout() {
  CommOptions o;
  o.timeout = Millis(60'000);  // a wait that should have ended fails the test by timing out
  return o;
}

// A message of `words` int64 words, every word `value` (so a partial write shows).
std::vector<int64_t> filled(size_t words, int64_t value) { return std::vector<int64_t>(words, value); }

bool all(const std::vector<int64_t>& v, int64_t value) {
  return std::all_of(v.begin(), v.end(), [&](int64_t x) { return x == value; });
}

// Expects `r` failed with Aborted, its message containing every one of `parts`.
void expectCancelled(const RequestPtr& r, std::initializer_list<std::string> parts, const std::vector<int>& peers) {
  ASSERT_TRUE(r->done()) << r->what();
  ASSERT_TRUE(r->failed()) << r->what();
  try {
    r->rethrowIfFailed();
  } catch (const Aborted& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << p << " in: " << e.what();
    EXPECT_EQ(e.peers(), peers) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected Aborted, got: " << e.what();
  }
}

class RecvCancel : public ::testing::TestWithParam<int> {};  // ranks per node: 0 shm, 1 ucx

}  // namespace

TEST_P(RecvCancel, BeforeAnyDataThenTheMessageGoesToTheNextReceive) {
  runRanks(
      2,
      [](RankEnv& env) {
        auto c = env.communicator(longTimeout());
        if (c->rank() == 0) {
          auto small = filled(4, kUnwritten), big = filled(kBig, kUnwritten), any = filled(4, kUnwritten);
          auto r_small = c->irecv(small.data(), small.size() * 8, 1, kTag);
          auto r_big = c->irecv(big.data(), big.size() * 8, 1, kTag + 1);
          auto r_any = c->irecv(any.data(), any.size() * 8, kAnySource, kTag + 2);
          for (auto* r : {&r_small, &r_big, &r_any}) {
            EXPECT_TRUE((*r)->cancel()) << (*r)->what();
            EXPECT_FALSE((*r)->cancel()) << "a second cancel has nothing to withdraw";
          }
          // Named receives: the transport's operation (its tag includes the communicator id) and peer.
          expectCancelled(r_small, {"rank 0", "cancelled", "tag", "rank 1"}, {1});
          expectCancelled(r_big, {"cancelled", "tag"}, {1});
          expectCancelled(r_any, {"any rank", "tag 13", "cancelled"}, {});
          c->barrier();  // now rank 1 sends
          auto small2 = filled(4, 0), big2 = filled(kBig, 0), any2 = filled(4, 0);
          c->recv(small2.data(), small2.size() * 8, 1, kTag);
          c->recv(big2.data(), big2.size() * 8, 1, kTag + 1);
          Status st = c->recv(any2.data(), any2.size() * 8, kAnySource, kTag + 2);
          EXPECT_EQ(st.source, 1);
          EXPECT_TRUE(all(small2, 1));
          EXPECT_TRUE(all(big2, 2));
          EXPECT_TRUE(all(any2, 3));
          EXPECT_TRUE(all(small, kUnwritten));
          EXPECT_TRUE(all(big, kUnwritten));
          EXPECT_TRUE(all(any, kUnwritten));
        } else {
          c->barrier();
          auto small = filled(4, 1), big = filled(kBig, 2), any = filled(4, 3);
          auto s1 = c->isend(small.data(), small.size() * 8, 0, kTag);
          auto s2 = c->isend(big.data(), big.size() * 8, 0, kTag + 1);
          auto s3 = c->isend(any.data(), any.size() * 8, 0, kTag + 2);
          EXPECT_FALSE(s2->cancel()) << "sends are not withdrawn";
          c->waitAll({s1, s2, s3}, c->defaultDeadline());
          EXPECT_FALSE(s1->cancel());
        }
        c->barrier();
        // A finished receive has nothing to withdraw.
        int64_t x = 0, y = 5;
        if (c->rank() == 0) {
          auto r = c->irecv(&x, 8, 1, kTag + 3);
          r->wait(c->defaultDeadline());
          EXPECT_FALSE(r->cancel());
          EXPECT_EQ(x, 5);
          EXPECT_FALSE(r->failed());
        } else {
          c->send(&y, 8, 0, kTag + 3);
        }
        c->destroy();
      },
      withRanksPerNode(GetParam()));
}

// Rank 0 posts a receive, lets rank 1 send into it, and cancels while the message is on
// its way, with a second thread driving the progress engine: every outcome is one of
// the two the contract allows, checked after the message is known to be delivered.
TEST_P(RecvCancel, RacesWithArrivingData) {
  runRanks(
      2,
      [](RankEnv& env) {
        auto c = env.communicator(longTimeout());
        constexpr int kRounds = 200;
        auto words = [](int i) { return i % 8 == 7 ? kBig : size_t{1} + i % 5; };  // eager and rendezvous
        if (c->rank() == 1) {
          for (int i = 0; i < kRounds; ++i) {
            int go = 0;
            c->recv(&go, sizeof go, 0, kGoTag);
            auto m = filled(words(i), i);
            c->send(m.data(), m.size() * 8, 0, kTag);
          }
          c->barrier();
          return;
        }
        std::atomic<bool> stop{false};
        std::thread driver([&] {
          while (!stop.load()) {
            c->engine().progressOnce();
            std::this_thread::yield();
          }
        });
        int withdrawn = 0, completed = 0;
        for (int i = 0; i < kRounds; ++i) {
          const bool any_source = i % 3 == 2;
          const int from = any_source ? kAnySource : 1;
          auto buf = filled(words(i), kUnwritten);
          auto r = c->irecv(buf.data(), buf.size() * 8, from, kTag);
          int go = i;
          c->send(&go, sizeof go, 1, kGoTag);
          for (int spin = 0; spin < (i * 7) % 50; ++spin) std::this_thread::yield();
          if (r->cancel()) {
            ++withdrawn;
            ASSERT_TRUE(r->failed()) << "round " << i;
            EXPECT_FALSE(r->cancel());
            auto next = filled(words(i), 0);
            Status st = c->recv(next.data(), next.size() * 8, from, kTag);  // takes message i
            EXPECT_EQ(st.bytes, words(i) * 8);
            ASSERT_TRUE(all(next, i)) << "round " << i << ": the message after a withdrawn receive";
            ASSERT_TRUE(all(buf, kUnwritten)) << "round " << i << ": a withdrawn receive's buffer was written";
          } else {
            ++completed;
            r->wait(c->defaultDeadline());  // throws if it failed
            EXPECT_EQ(r->status().bytes, words(i) * 8);
            if (any_source) {
              EXPECT_EQ(r->status().source, 1);
            }
            ASSERT_TRUE(all(buf, i)) << "round " << i;
          }
        }
        stop.store(true);
        driver.join();
        std::printf("rank 0: %d withdrawn, %d completed before the cancel\n", withdrawn, completed);
        c->barrier();
      },
      withRanksPerNode(GetParam()));
}

// A split's abort withdraws its posted receives: rank 1, which did not abort the split,
// sends into them later, and rank 0's buffers stay untouched.
TEST_P(RecvCancel, SplitAbortWithdrawsItsReceives) {
  runRanks(
      2,
      [](RankEnv& env) {
        auto world = env.communicator(longTimeout());
        auto a = world->splitMembers({0, 1});
        ASSERT_TRUE(a);
        auto small = filled(4, kUnwritten), big = filled(kBig, kUnwritten), any = filled(4, kUnwritten);
        if (world->rank() == 0) {
          auto r_small = a->irecv(small.data(), small.size() * 8, 1, kTag);
          auto r_big = a->irecv(big.data(), big.size() * 8, 1, kTag + 1);
          auto r_any = a->irecv(any.data(), any.size() * 8, kAnySource, kTag + 2);
          a->abort("test: abort on rank 0 only");
          for (auto* r : {&r_small, &r_big, &r_any}) {
            EXPECT_TRUE((*r)->failed());
            EXPECT_FALSE((*r)->cancel()) << "the abort withdrew it already";
          }
          expectCancelled(r_small, {"test: abort on rank 0 only", "withdrawn", "tag"}, {});
          expectCancelled(r_any, {"test: abort on rank 0 only", "withdrawn", "any rank"}, {});
          world->barrier();  // rank 1 sends on its (not aborted) split now
          int done = 0;
          world->recv(&done, sizeof done, 1, kTag);  // after its sends on the split finished
          // Each transport delivers a pair's messages in order, but the world message may
          // overtake the split's on UCX: a second round makes sure they were handled.
          world->barrier();
          world->engine().progressOnce();
          EXPECT_TRUE(all(small, kUnwritten));
          EXPECT_TRUE(all(big, kUnwritten));
          EXPECT_TRUE(all(any, kUnwritten));
        } else {
          world->barrier();
          small.assign(small.size(), 1);
          big.assign(big.size(), 2);
          any.assign(any.size(), 3);
          // The small ones are eager: sent without a receive. The big one may wait for a
          // receive that never comes (rank 0's was withdrawn): not awaited.
          a->send(small.data(), small.size() * 8, 0, kTag);
          auto big_send = a->isend(big.data(), big.size() * 8, 0, kTag + 1);
          a->send(any.data(), any.size() * 8, 0, kTag + 2);
          int done = 1;
          world->send(&done, sizeof done, 0, kTag);
          world->barrier();
          a->abort("test: rank 1 is done with the split");
        }
        world->barrier();
      },
      withRanksPerNode(GetParam()));
}

// A blocking recv that times out withdraws its receive: the buffer stays untouched and
// the message sent afterwards reaches the next receive.
TEST_P(RecvCancel, BlockingRecvTimeoutWithdrawsTheReceive) {
  runRanks(
      2,
      [](RankEnv& env) {
        CommOptions o;
        o.timeout = Millis(200);
        auto c = env.communicator(o);
        const Deadline patient = Deadline::after(Millis(60'000));
        auto first = filled(4, kUnwritten), second = filled(4, 0);
        if (c->rank() == 0) {
          EXPECT_THROW(c->recv(first.data(), first.size() * 8, 1, kTag), Timeout);
          c->barrier(patient);  // now rank 1 sends
          auto r = c->irecv(second.data(), second.size() * 8, 1, kTag);
          r->wait(patient);
          EXPECT_TRUE(all(second, 4));
          EXPECT_TRUE(all(first, kUnwritten)) << "the timed-out receive's buffer was written";
        } else {
          c->barrier(patient);
          auto msg = filled(4, 4);
          c->isend(msg.data(), msg.size() * 8, 0, kTag)->wait(patient);
        }
        c->barrier(patient);
      },
      withRanksPerNode(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Transports, RecvCancel, ::testing::Values(0, 1),
                         [](const auto& info) { return info.param == 0 ? "shm" : "ucx"; });

// Any-source receives over shm and UCX at once (rank 0 and 1 share a node, rank 2 is on
// another): withdrawn ones take no message from either transport.
TEST(RecvCancelMixed, AnySourceOverBothTransports) {
  runRanks(
      3,
      [](RankEnv& env) {
        auto c = env.communicator(longTimeout());
        if (c->rank() == 0) {
          auto a = filled(4, kUnwritten), b = filled(4, kUnwritten);
          auto ra = c->irecv(a.data(), 32, kAnySource, kTag);
          auto rb = c->irecv(b.data(), 32, kAnySource, kTag);
          EXPECT_TRUE(ra->cancel());
          c->barrier();  // ranks 1 and 2 send one message each
          // rb was posted behind ra: it takes one message now, and the next receive the other.
          rb->wait(c->defaultDeadline());
          auto n = filled(4, 0);
          Status st = c->recv(n.data(), 32, kAnySource, kTag);
          EXPECT_NE(st.source, rb->status().source);
          EXPECT_TRUE(all(b, rb->status().source));
          EXPECT_TRUE(all(n, st.source));
          EXPECT_TRUE(all(a, kUnwritten));
        } else {
          c->barrier();
          auto m = filled(4, c->rank());
          c->send(m.data(), 32, 0, kTag);
        }
        c->barrier();
        c->destroy();
      },
      withRanksPerNode(2));
}

// After the transports are gone (the context aborted, then destroyed), cancel() is a no-op.
TEST(RecvCancelLifetime, AfterTheTransportsAreGone) {
  for (int rpn : {2, 1}) {  // shm, UCX
    SCOPED_TRACE(rpn == 2 ? "shm" : "ucx");
    runRanks(
      2,
      [](RankEnv& env) {
        RequestPtr r;
        int64_t x = kUnwritten;
        {
          auto c = env.communicator(longTimeout());
          r = c->irecv(&x, 8, 1 - c->rank(), kTag);
          c->abort("test: abort the context");
          EXPECT_TRUE(r->failed());
          EXPECT_FALSE(r->cancel()) << "the abort released it";
          env.comm.reset();
        }
        EXPECT_FALSE(r->cancel());
        EXPECT_EQ(x, kUnwritten);
      },
      withRanksPerNode(rpn));
  }
}
