// UCX teardown after a failure must never abort a survivor.
//
// UCX 1.13 (Debian 12) asserts "got REP message" in ucp_request_send_state_ff when an
// endpoint or worker goes away while a wireup REPLY is still queued on a plain tcp
// endpoint (the assertion was removed upstream, openucx/ucx#8175). A REPLY is queued
// when a peer's wireup REQUEST arrives after setup: with UCX's default
// RESOLVE_REMOTE_EP_ID=off a peer sends it at its first rendezvous (large) send, in the
// middle of a run; if this side's socket to the peer is full at that moment, the REPLY
// waits behind the data. A failure then closes the endpoint, and the process dies of
// SIGABRT (seen in FtKill with the pipelined hierarchical allreduce over virtual nodes).
// UcxContext resolves the remote endpoint ids during setup, so no REQUEST comes later.
//
// This test builds that moment on purpose, over two virtual nodes (UCX between them):
// rank 0 holds its UCX context's mutex, so its progress thread reads nothing, while
// rank 1 queues 16 MB of eager sends to it (both sockets fill up); rank 0 then posts a
// 4 MB (rendezvous) send to rank 1, still without progressing, and rank 1 aborts its
// communicator (force-closing the endpoint, which purges its queue). Before the fix
// rank 1 died of SIGABRT here (run with UCX_RESOLVE_REMOTE_EP_ID=off to see it).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/context.h"
#include "comm/errors.h"
#include "comm/file_store.h"
#include "comm/ucx_context.h"
#include "harness/multiprocess.h"

namespace crossbar::testing {
namespace {

constexpr int kRounds = 3;                  // fresh communicators, each with a fresh wireup
constexpr size_t kSmall = 1024;             // eager: never needs the peer's endpoint id
constexpr int kSmallCount = 16 * 1024;      // 16 MB: more than both socket buffers hold
constexpr size_t kLarge = 4 * 1024 * 1024;  // rendezvous: needs the peer's endpoint id

TEST(FtUcxTeardown, LateWireupDoesNotAbortASurvivor) {
  RunOptions o;
  o.timeout = Millis(120'000);
  o.env["CROSSBAR_RANKS_PER_NODE"] = "1";  // two virtual nodes: UCX between the ranks
  o.env["CROSSBAR_CONNECT_TIMEOUT"] = "20s";  // a rank that died is not waited for long
  auto results = runRanks(
      2,
      [&](RankEnv& env) {
        for (int round = 0; round < kRounds; ++round) {
          CommOptions co;
          co.name = fmt::format("wireup{}", round);
          auto comm = Communicator::create(std::make_shared<PrefixStore>(co.name, env.store), env.rank, 2, co);
          const int peer = 1 - env.rank;
          ASSERT_STREQ(comm->context().transportName(peer), "ucx");
          auto ucx = ucx::ucxContextOf(comm->context().transportTo(peer));
          ASSERT_NE(ucx, nullptr);
          comm->barrier();
          auto key = [&](const char* what) { return fmt::format("{}/{}", co.name, what); };
          const Deadline deadline = Deadline::after(Millis(20'000));
          if (env.rank == 0) {
            std::vector<char> large(kLarge, 'l');
            RequestPtr send;
            {
              std::lock_guard<std::recursive_mutex> hold(ucx->mutex());  // rank 0 reads nothing now
              env.store->set(key("held"), "1");
              env.store->get(key("filled"), deadline);
              send = comm->isend(large.data(), large.size(), peer, 7);
              env.store->set(key("sent"), "1");
              env.store->get(key("aborted"), deadline);
            }
            comm->abort("test: round over");
            EXPECT_THROW(send->wait(deadline), Error);
          } else {
            std::vector<char> small(kSmall, 's');
            std::vector<RequestPtr> sends;
            env.store->get(key("held"), deadline);
            for (int i = 0; i < kSmallCount; ++i) sends.push_back(comm->isend(small.data(), small.size(), peer, 5));
            env.store->set(key("filled"), "1");
            env.store->get(key("sent"), deadline);
            // Let the progress thread take rank 0's message (a wireup REQUEST before the fix).
            std::this_thread::sleep_for(Millis(500));
            comm->abort("test: the peer is gone");  // force-closes the endpoint: purges its queue
            env.store->set(key("aborted"), "1");
            size_t failed = 0;
            for (auto& s : sends) {
              try {
                s->wait(deadline);
              } catch (const Error&) {
                ++failed;
              }
            }
            EXPECT_GT(failed, 0u) << "every eager send completed: the sockets never filled, so the test "
                                     "did not build the moment it is about";
          }
        }
      },
      o);
  for (const auto& r : results) EXPECT_TRUE(r.ok) << "rank " << r.rank << " (exit " << r.exit_code << "): " << r.failure;
}

}  // namespace
}  // namespace crossbar::testing
