// Shared-memory transport: forked ranks over real memfd rings and Unix sockets.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/fd_exchange.h"
#include "comm/progress.h"
#include "comm/shm_segment.h"
#include "comm/shm_transport.h"
#include "comm/store.h"
#include "harness/multiprocess.h"

namespace crossbar {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;
using LargePath = ShmTransportOptions::LargePath;
using namespace std::chrono_literals;

std::vector<int> othersOf(const RankEnv& env) {
  std::vector<int> peers;
  for (int r = 0; r < env.size; ++r)
    if (r != env.rank) peers.push_back(r);
  return peers;
}

// One rank's transport and the engine that drives it.
struct Shm {
  ProgressEngine engine;
  std::unique_ptr<Transport> t;
  explicit Shm(RankEnv& env, ShmTransportOptions options = {}, std::vector<int> peers = {}) {
    if (peers.empty()) peers = othersOf(env);
    TransportSetup s{env.store, env.rank, env.size, peers, nullptr, &engine, Deadline::after(30s),
                     nullptr,   0};
    t = makeShmTransport(s, options);
    engine.add(t.get());
  }
  ~Shm() { engine.remove(t.get()); }
};

void barrier(RankEnv& env, const std::string& name) {
  std::vector<std::string> keys;
  for (int r = 0; r < env.size; ++r) keys.push_back(fmt::format("test-barrier/{}/{}", name, r));
  env.store->set(keys[env.rank], "1");
  env.store->wait(keys, Deadline::after(60s));
}

// Verifiable payload: a function of (src, dst, tag, index).
uint64_t word(int src, int dst, uint64_t tag, size_t i) {
  uint64_t x = (uint64_t(src) << 56) ^ (uint64_t(dst) << 48) ^ (tag << 20) ^ i;
  x *= 0x9E3779B97F4A7C15ull;
  return x ^ (x >> 29);
}
void fill(uint8_t* buf, size_t bytes, int src, int dst, uint64_t tag) {
  size_t words = bytes / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w = word(src, dst, tag, i);
    std::memcpy(buf + 8 * i, &w, 8);
  }
  for (size_t i = words * 8; i < bytes; ++i) buf[i] = static_cast<uint8_t>(word(src, dst, tag, i));
}
void fill(std::vector<uint8_t>& buf, int src, int dst, uint64_t tag) {
  fill(buf.data(), buf.size(), src, dst, tag);
}
// Returns the first wrong byte offset, or -1.
int64_t check(const uint8_t* buf, size_t bytes, int src, int dst, uint64_t tag) {
  size_t words = bytes / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, buf + 8 * i, 8);
    if (w != word(src, dst, tag, i)) return static_cast<int64_t>(i * 8);
  }
  for (size_t i = words * 8; i < bytes; ++i)
    if (buf[i] != static_cast<uint8_t>(word(src, dst, tag, i))) return static_cast<int64_t>(i);
  return -1;
}
int64_t check(const std::vector<uint8_t>& buf, size_t bytes, int src, int dst, uint64_t tag) {
  return check(buf.data(), bytes, src, dst, tag);
}
// Uninitialized (untouched) memory: big buffers cost nothing until used.
std::unique_ptr<uint8_t[]> rawBuffer(size_t bytes) {
  return std::unique_ptr<uint8_t[]>(new uint8_t[bytes]);
}

size_t ringSize() {
  return env::getSize("CROSSBAR_SHM_RING_SIZE");
}

// ---------------------------------------------------------------- building blocks

TEST(ShmSegment, CreateAttachShareMemory) {
  auto a = ShmSegment::create(10'000, {.name = "test-seg"});
  ASSERT_TRUE(a.valid());
  EXPECT_GE(a.size(), 10'000u);
  std::memset(a.data(), 0x5a, a.size());
  auto b = ShmSegment::attach(::dup(a.fd()));
  ASSERT_EQ(b.size(), a.size());
  EXPECT_EQ(b.as<uint8_t>()[123], 0x5a);
  b.as<uint8_t>()[7] = 1;
  EXPECT_EQ(a.as<uint8_t>()[7], 1);
  ShmSegment moved = std::move(a);
  EXPECT_FALSE(a.valid());
  EXPECT_EQ(moved.as<uint8_t>()[7], 1);
}

TEST(ShmSegment, HugePagesFallBackAndPopulate) {
  // Works whether or not the machine reserves huge pages.
  auto s = ShmSegment::create(3u << 20, {.name = "test-huge", .populate = true, .huge_pages = true});
  ASSERT_TRUE(s.valid());
  EXPECT_GE(s.size(), 3u << 20);
  s.as<uint8_t>()[s.size() - 1] = 9;
  auto peer = ShmSegment::attach(::dup(s.fd()));
  EXPECT_EQ(peer.hugePages(), s.hugePages());
  EXPECT_EQ(peer.as<uint8_t>()[s.size() - 1], 9);
}

TEST(FdExchange, AbstractSocketsPassFds) {
  runRanks(2, [](RankEnv& env) {
    std::string nonce = jobNonce(*env.store, "test/nonce");
    env.store->set(fmt::format("nonce/{}", env.rank), nonce);
    EXPECT_EQ(toString(env.store->get(fmt::format("nonce/{}", 1 - env.rank), Deadline::after(10s))), nonce);
    auto deadline = Deadline::after(10s);
    if (env.rank == 0) {
      UnixListener l(socketName(nonce, "t", 0), 0);
      UnixConn c = l.accept(deadline, "rank 1");
      UnixMessage m = c.recv(deadline);
      ASSERT_EQ(m.fds.size(), 1u);
      EXPECT_EQ(toString(m.bytes), "segment");
      auto seg = ShmSegment::attach(m.fds[0].release());
      EXPECT_EQ(std::string(seg.as<char>(), 5), "hello");
      EXPECT_GT(c.peerPid(), 0);
      c.send(std::string("ok").data(), 2, {}, deadline);
      // Rank 1 exits: its end of the connection hangs up.
      EXPECT_GT(pollOne(c.fd(), POLLIN, Deadline::after(10s)) & (POLLHUP | POLLIN), 0);
    } else {
      auto seg = ShmSegment::create(4096, {.name = "test-pass"});
      std::memcpy(seg.data(), "hello", 5);
      UnixConn c = UnixConn::connect(socketName(nonce, "t", 0), deadline, 1, "rank 0");
      c.send(std::string("segment").data(), 7, {seg.fd()}, deadline);
      EXPECT_EQ(toString(c.recv(deadline).bytes), "ok");
    }
  });
}

TEST(FdExchange, ConnectTimesOutNamingPeer) {
  auto start = Clock::now();
  try {
    UnixConn::connect(socketName("no-such-nonce", "t", 0), Deadline::after(200ms), 1, "peer rank 0");
    FAIL() << "connect should time out";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("peer rank 0"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - start, 2s);
}

// ---------------------------------------------------------------- data movement

// Every rank sends `sizes` to every other rank at once (all nonblocking).
void allPairs(int n, const std::vector<size_t>& sizes, ShmTransportOptions options = {}) {
  runRanks(n, [&](RankEnv& env) {
    Shm shm(env, options);
    std::vector<std::vector<uint8_t>> out, in;
    std::vector<RequestPtr> reqs;
    std::vector<std::tuple<int, uint64_t, size_t>> recvs;  // src, tag, bytes
    for (int peer : othersOf(env)) {
      for (size_t k = 0; k < sizes.size(); ++k) {
        in.emplace_back(sizes[k]);
        reqs.push_back(shm.t->irecv(peer, k, in.back().data(), in.back().size()));
        recvs.emplace_back(peer, k, sizes[k]);
        out.emplace_back(sizes[k]);
        fill(out.back(), env.rank, peer, k);
        reqs.push_back(shm.t->isend(peer, k, out.back().data(), out.back().size()));
      }
    }
    for (auto& r : reqs) r->wait(Deadline::after(60s));
    for (size_t i = 0; i < recvs.size(); ++i) {
      auto [src, tag, bytes] = recvs[i];
      EXPECT_EQ(reqs[2 * i]->status().bytes, bytes);
      EXPECT_EQ(reqs[2 * i]->status().source, src);
      EXPECT_EQ(check(in[i], bytes, src, env.rank, tag), -1) << "from " << src << " tag " << tag;
    }
    barrier(env, "done");  // nobody leaves while a peer still reads its buffers
  });
}

TEST(ShmTransport, AllPairs2) {
  allPairs(2, {0, 1, 7, 4095, 65537, ringSize() + 1});
}
TEST(ShmTransport, AllPairs4) {
  allPairs(4, {0, 1, 7, 4095, 65537, ringSize() + 1});
}
TEST(ShmTransport, AllPairs8) {
  allPairs(8, {0, 1, 7, 4095, 65537, ringSize() + 1});
}
TEST(ShmTransport, AllPairs4Cma) {
  ShmTransportOptions o;
  o.large_path = LargePath::kCma;
  allPairs(4, {0, 1, 7, 4095, 65537, ringSize() + 1}, o);
}
TEST(ShmTransport, AllPairs4Ring) {
  ShmTransportOptions o;
  o.large_path = LargePath::kRing;
  allPairs(4, {0, 1, 7, 4095, 65537, ringSize() + 1}, o);
}

// Sizes one by one (blocking), both large-message paths, a small ring to wrap often.
void sizesTest(const std::vector<size_t>& sizes, ShmTransportOptions options) {
  runRanks(2, [&](RankEnv& env) {
    Shm shm(env, options);
    int peer = 1 - env.rank;
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::vector<uint8_t> buf(sizes[k]);
      if (env.rank == 0) {
        fill(buf, 0, 1, k);
        shm.t->isend(peer, k, buf.data(), buf.size())->wait(Deadline::after(60s));
      } else {
        auto r = shm.t->irecv(peer, k, buf.data(), buf.size());
        r->wait(Deadline::after(60s));
        EXPECT_EQ(r->status().bytes, sizes[k]);
        EXPECT_EQ(check(buf, sizes[k], 0, 1, k), -1) << "size " << sizes[k];
      }
    }
  });
}

TEST(ShmTransport, SizesCma) {
  ShmTransportOptions o;
  o.large_path = LargePath::kCma;
  sizesTest({0, 1, 7, 4095, ringSize() + 1, size_t{64} << 20}, o);
}
TEST(ShmTransport, SizesRing) {
  ShmTransportOptions o;
  o.large_path = LargePath::kRing;
  sizesTest({0, 1, 7, 4095, ringSize() + 1, size_t{64} << 20}, o);
}
TEST(ShmTransport, SizesSmallRingWrapsOften) {
  ShmTransportOptions o;
  o.ring_bytes = 64 << 10;
  o.eager_limit = 32 << 10;
  o.large_path = LargePath::kRing;
  sizesTest({0, 1, 7, 4095, 32 << 10, (32 << 10) + 1, (64 << 10) + 1, 3'000'001}, o);
}

TEST(ShmTransport, OneGiB) {
  runRanks(2, [](RankEnv& env) {
    Shm shm(env);
    const size_t bytes = size_t{1} << 30;
    auto buf = rawBuffer(bytes);
    if (env.rank == 0) fill(buf.get(), bytes, 0, 1, 3);
    barrier(env, "filled");
    auto start = Clock::now();
    if (env.rank == 0) {
      shm.t->isend(1, 3, buf.get(), bytes)->wait(Deadline::after(60s));
    } else {
      auto r = shm.t->irecv(0, 3, buf.get(), bytes);
      r->wait(Deadline::after(60s));
      double s = std::chrono::duration<double>(Clock::now() - start).count();
      std::printf("1 GiB in %.3f s (%.2f GB/s, receive buffer faulted in during the transfer)\n", s,
                  bytes / s / 1e9);
      EXPECT_EQ(r->status().bytes, bytes);
      EXPECT_EQ(check(buf.get(), bytes, 0, 1, 3), -1);
    }
  });
}

TEST(ShmTransport, ManyTagsOutOfOrder) {
  for (LargePath path : {LargePath::kCma, LargePath::kRing}) {
    runRanks(2, [&](RankEnv& env) {
      ShmTransportOptions o;
      o.large_path = path;
      Shm shm(env, o);
      const int kTags = 200;
      auto sizeOf = [](int tag) -> size_t { return tag % 10 == 0 ? 200'000 + tag : tag * 3; };
      if (env.rank == 0) {
        // Tags in order, then two more messages on tag 5 (ordered per tag).
        std::vector<std::vector<uint8_t>> out;
        std::vector<RequestPtr> reqs;
        barrier(env, "early-posted");  // rank 1 posted the first half of its receives
        for (int tag = 0; tag < kTags; ++tag) {
          out.emplace_back(sizeOf(tag));
          fill(out.back(), 0, 1, tag);
          reqs.push_back(shm.t->isend(1, tag, out.back().data(), out.back().size()));
        }
        for (int k = 0; k < 2; ++k) {
          out.emplace_back(100 + k);
          fill(out.back(), 0, 1, 1000 + k);
          reqs.push_back(shm.t->isend(1, 5, out.back().data(), out.back().size()));
        }
        for (auto& r : reqs) r->wait(Deadline::after(30s));
      } else {
        std::vector<std::vector<uint8_t>> in(kTags);
        std::vector<RequestPtr> reqs(kTags);
        // Reverse order; the upper half before the sends exist, the rest after.
        for (int tag = kTags - 1; tag >= kTags / 2; --tag) {
          in[tag].resize(sizeOf(tag) + 5);  // larger than the message is fine
          reqs[tag] = shm.t->irecv(0, tag, in[tag].data(), in[tag].size());
        }
        barrier(env, "early-posted");
        std::this_thread::sleep_for(20ms);  // let messages arrive unexpected
        for (int tag = kTags / 2 - 1; tag >= 0; --tag) {
          if (tag == 5) continue;
          in[tag].resize(sizeOf(tag));
          reqs[tag] = shm.t->irecv(0, tag, in[tag].data(), in[tag].size());
        }
        // Tag 5 three times: matched in send order.
        std::vector<std::vector<uint8_t>> five(3, std::vector<uint8_t>(200));
        std::vector<RequestPtr> five_reqs;
        for (auto& b : five) five_reqs.push_back(shm.t->irecv(0, 5, b.data(), b.size()));
        for (int tag = 0; tag < kTags; ++tag) {
          if (tag == 5) continue;
          reqs[tag]->wait(Deadline::after(30s));
          EXPECT_EQ(reqs[tag]->status().bytes, sizeOf(tag));
          EXPECT_EQ(check(in[tag], sizeOf(tag), 0, 1, tag), -1) << "tag " << tag;
        }
        for (auto& r : five_reqs) r->wait(Deadline::after(30s));
        EXPECT_EQ(five_reqs[0]->status().bytes, sizeOf(5));
        EXPECT_EQ(check(five[0], sizeOf(5), 0, 1, 5), -1);
        EXPECT_EQ(five_reqs[1]->status().bytes, 100u);
        EXPECT_EQ(check(five[1], 100, 0, 1, 1000), -1);
        EXPECT_EQ(five_reqs[2]->status().bytes, 101u);
        EXPECT_EQ(check(five[2], 101, 0, 1, 1001), -1);
      }
      barrier(env, "done");
    });
  }
}

TEST(ShmTransport, LargeTagsAndBadArguments) {
  runRanks(2, [](RankEnv& env) {
    Shm shm(env);
    uint64_t tag = kMaxTransportTag;
    uint32_t v = 42, got = 0;
    if (env.rank == 0) {
      shm.t->isend(1, tag, &v, sizeof(v))->wait(Deadline::after(10s));
    } else {
      shm.t->irecv(0, tag, &got, sizeof(got))->wait(Deadline::after(10s));
      EXPECT_EQ(got, 42u);
    }
    EXPECT_THROW(shm.t->isend(1 - env.rank, kMaxTransportTag + 1, &v, 4), InvalidArgument);
    EXPECT_THROW(shm.t->isend(env.rank, 0, &v, 4), InvalidArgument);  // not a peer
    EXPECT_THROW(shm.t->irecv(7, 0, &v, 4), InvalidArgument);
  });
}

TEST(ShmTransport, TruncationFailsRecvAndStreamStaysConsistent) {
  for (LargePath path : {LargePath::kCma, LargePath::kRing}) {
    runRanks(2, [&](RankEnv& env) {
      ShmTransportOptions o;
      o.large_path = path;
      Shm shm(env, o);
      std::vector<uint8_t> small(100), big(1 << 20), tail(10);
      if (env.rank == 0) {
        fill(small, 0, 1, 1);
        fill(big, 0, 1, 2);
        fill(tail, 0, 1, 3);
        auto a = shm.t->isend(1, 1, small.data(), small.size());
        auto b = shm.t->isend(1, 2, big.data(), big.size());
        auto c = shm.t->isend(1, 3, tail.data(), tail.size());
        a->wait(Deadline::after(10s));  // eager: the sender cannot know
        try {
          b->wait(Deadline::after(10s));
          ADD_FAILURE() << "rendezvous send into a too-small receive should fail";
        } catch (const InvalidUsage& e) {
          EXPECT_NE(std::string(e.what()).find("1048576"), std::string::npos) << e.what();
        }
        c->wait(Deadline::after(10s));
      } else {
        std::vector<uint8_t> r1(50), r2(1000), r3(10);
        auto a = shm.t->irecv(0, 1, r1.data(), r1.size());
        auto b = shm.t->irecv(0, 2, r2.data(), r2.size());
        auto c = shm.t->irecv(0, 3, r3.data(), r3.size());
        for (auto& [req, sent, cap] : {std::tuple{a, 100, 50}, std::tuple{b, 1 << 20, 1000}}) {
          try {
            req->wait(Deadline::after(10s));
            ADD_FAILURE() << "truncated receive should fail";
          } catch (const InvalidUsage& e) {
            std::string m = e.what();
            EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
            EXPECT_NE(m.find(fmt::format("{} bytes", sent)), std::string::npos) << m;
            EXPECT_NE(m.find(fmt::format("only {} bytes", cap)), std::string::npos) << m;
            EXPECT_NE(m.find("tag"), std::string::npos) << m;
            EXPECT_EQ(e.peers(), std::vector<int>{0});
          }
        }
        c->wait(Deadline::after(10s));
        EXPECT_EQ(check(r3, 10, 0, 1, 3), -1);
      }
      barrier(env, "done");
    });
  }
}

TEST(ShmTransport, SilentPeerTimesOutWithinDeadline) {
  runRanks(2, [](RankEnv& env) {
    Shm shm(env);
    if (env.rank == 1) {
      uint64_t v;
      auto r = shm.t->irecv(0, 9, &v, sizeof(v));
      auto start = Clock::now();
      EXPECT_THROW(r->wait(Deadline::after(300ms)), Timeout);
      auto took = Clock::now() - start;
      EXPECT_GE(took, 290ms);
      EXPECT_LT(took, 1500ms);
    }
    barrier(env, "done");
  });
}

TEST(ShmTransport, AbortFailsPendingAndIsIdempotent) {
  runRanks(2, [](RankEnv& env) {
    Shm shm(env);
    if (env.rank == 0) {
      uint64_t v;
      auto r = shm.t->irecv(1, 1, &v, sizeof(v));
      std::vector<uint8_t> big(1 << 20);
      auto s = shm.t->isend(1, 2, big.data(), big.size());  // rendezvous: waits for a receive
      std::thread other([&] { shm.t->abort(std::make_exception_ptr(Aborted("test abort"))); });
      shm.t->abort(std::make_exception_ptr(Aborted("test abort")));
      other.join();
      EXPECT_THROW(r->wait(Deadline::after(5s)), Aborted);
      EXPECT_THROW(s->wait(Deadline::after(5s)), Aborted);
      EXPECT_THROW(shm.t->isend(1, 3, &v, sizeof(v))->wait(Deadline::after(5s)), Aborted);
    } else {
      // A waiter blocked in poll() is woken by an abort from another thread.
      uint64_t v;
      auto r = shm.t->irecv(0, 1, &v, sizeof(v));
      std::thread aborter([&] {
        std::this_thread::sleep_for(50ms);
        shm.t->abort(std::make_exception_ptr(Aborted("watchdog abort")));
      });
      auto start = Clock::now();
      EXPECT_THROW(r->wait(Deadline::after(5s)), Aborted);
      EXPECT_LT(Clock::now() - start, 2s);
      aborter.join();
    }
    barrier(env, "done");
  });
}

// The victim dies (SIGKILL) in the middle of a large transfer in each direction;
// the survivors' requests fail with PeerFailure naming it, quickly.
void peerKilled(LargePath path) {
  RunOptions ro;
  ro.allow_rank_death = true;
  ro.timeout = 60s;
  auto results = runRanks(
      3,
      [&](RankEnv& env) {
        ShmTransportOptions o;
        o.large_path = path;
        Shm shm(env, o);
        const size_t big = size_t{64} << 20;
        auto out_buf = rawBuffer(big), in_buf = rawBuffer(big);
        uint8_t *out = out_buf.get(), *in = in_buf.get();
        if (env.rank == 0) {  // victim: sends to 1, receives from 2, dies midway
          env.store->set("victim-pid", std::to_string(getpid()));
          auto s = shm.t->isend(1, 1, out, big);
          auto r = shm.t->irecv(2, 2, in, big);
          barrier(env, "started");
          for (int i = 0; i < 4; ++i) shm.engine.progressOnce();
          ::raise(SIGKILL);
        }
        std::string pid = toString(env.store->get("victim-pid", Deadline::after(10s)));
        // Rank 1 receives a large message from the victim, rank 2 sends it one; both
        // also wait for a message the victim never sends.
        uint64_t never = 0;
        RequestPtr req = env.rank == 1 ? shm.t->irecv(0, 1, in, big) : shm.t->isend(0, 2, out, big);
        RequestPtr never_req = shm.t->irecv(0, 11, &never, sizeof(never));
        barrier(env, "started");
        auto start = Clock::now();
        auto expectPeerFailure = [&](RequestPtr r, bool may_succeed) {
          try {
            r->wait(Deadline::after(20s));
            if (!may_succeed) ADD_FAILURE() << "transfer with a killed peer should fail";
          } catch (const PeerFailure& e) {
            std::string m = e.what();
            EXPECT_NE(m.find("peer rank 0"), std::string::npos) << m;
            EXPECT_NE(m.find("pid " + pid), std::string::npos) << m;
            EXPECT_NE(m.find(fmt::format("rank {}", env.rank)), std::string::npos) << m;
            EXPECT_EQ(e.peers(), std::vector<int>{0});
          }
        };
        expectPeerFailure(req, path == LargePath::kCma);  // CMA may finish before the kill
        expectPeerFailure(never_req, false);
        EXPECT_LT(Clock::now() - start, 5s);
        // New requests to the dead peer fail at once.
        uint64_t v = 0;
        EXPECT_THROW(shm.t->isend(0, 5, &v, sizeof(v))->wait(Deadline::after(1s)), PeerFailure);
        EXPECT_THROW(shm.t->irecv(0, 5, &v, sizeof(v))->wait(Deadline::after(1s)), PeerFailure);
        // The survivors still talk to each other.
        int other = 3 - env.rank;
        uint64_t x = env.rank, y = 99;
        auto rr = shm.t->irecv(other, 7, &y, sizeof(y));
        shm.t->isend(other, 7, &x, sizeof(x))->wait(Deadline::after(10s));
        rr->wait(Deadline::after(10s));
        EXPECT_EQ(y, uint64_t(other));
        // Keep my buffers until the other survivor is done.
        std::vector<std::string> keys = {"left/1", "left/2"};
        env.store->set(keys[env.rank - 1], "1");
        env.store->wait(keys, Deadline::after(10s));
      },
      ro);
  EXPECT_EQ(results[0].exit_code, -SIGKILL);
}

TEST(ShmTransport, PeerKilledMidTransferRing) {
  peerKilled(LargePath::kRing);
}
TEST(ShmTransport, PeerKilledMidTransferCma) {
  peerKilled(LargePath::kCma);
}

TEST(ShmTransport, PeerMissingAtSetupTimesOut) {
  RunOptions ro;
  ro.timeout = 30s;
  runRanks(
      3,
      [](RankEnv& env) {
        if (env.rank == 2) return;  // never constructs its transport
        ProgressEngine engine;
        TransportSetup s{env.store, env.rank, env.size, {0, 1, 2}, nullptr, &engine, Deadline::after(500ms),
                         nullptr,   0};
        s.peers.erase(std::find(s.peers.begin(), s.peers.end(), env.rank));
        auto start = Clock::now();
        try {
          makeShmTransport(s);
          ADD_FAILURE() << "setup should time out";
        } catch (const Timeout& e) {
          EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
        }
        EXPECT_LT(Clock::now() - start, 3s);
      },
      ro);
}

TEST(ShmTransport, EightRanksPingPongOnFewCoresIsFast) {
  runRanks(8, [](RankEnv& env) {
    Shm shm(env);
    const int iters = 2000;
    int partner = env.rank ^ 1;
    uint64_t v = 0;
    barrier(env, "start");
    auto start = Clock::now();
    for (int i = 0; i < iters; ++i) {
      if ((env.rank & 1) == (i & 1)) {
        uint64_t x = i;
        shm.t->isend(partner, 1, &x, sizeof(x))->wait(Deadline::after(10s));
      } else {
        shm.t->irecv(partner, 1, &v, sizeof(v))->wait(Deadline::after(10s));
        EXPECT_EQ(v, uint64_t(i));
      }
    }
    // Plus an all-to-all round per rank (every pair active at once).
    std::vector<uint64_t> got(env.size);
    std::vector<RequestPtr> reqs;
    uint64_t me = env.rank;
    for (int p : othersOf(env)) {
      reqs.push_back(shm.t->irecv(p, 2, &got[p], 8));
      reqs.push_back(shm.t->isend(p, 2, &me, 8));
    }
    for (auto& r : reqs) r->wait(Deadline::after(10s));
    for (int p : othersOf(env)) EXPECT_EQ(got[p], uint64_t(p));
    auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
    if (env.rank == 0)
      std::printf("8 ranks / %d cores: %d one-way messages per pair in %.1f ms (%.1f us each)\n",
                  int(sysconf(_SC_NPROCESSORS_ONLN)), iters, us / 1000.0, double(us) / iters);
    EXPECT_LT(us, 10'000'000);
    barrier(env, "done");
  });
}

// Bandwidth report (not a benchmark gate): 64 MiB one way, ring vs CMA vs memcpy.
TEST(ShmTransport, BandwidthReport) {
  for (LargePath path : {LargePath::kCma, LargePath::kRing}) {
    runRanks(2, [&](RankEnv& env) {
      ShmTransportOptions o;
      o.large_path = path;
      Shm shm(env, o);
      const size_t bytes = size_t{64} << 20;
      std::vector<uint8_t> buf(bytes, 1);
      const int reps = 5;
      double best = 1e9;
      for (int i = 0; i < reps + 1; ++i) {
        barrier(env, fmt::format("rep{}", i));
        auto start = Clock::now();
        if (env.rank == 0)
          shm.t->isend(1, i, buf.data(), bytes)->wait(Deadline::after(30s));
        else
          shm.t->irecv(0, i, buf.data(), bytes)->wait(Deadline::after(30s));
        double s = std::chrono::duration<double>(Clock::now() - start).count();
        if (i > 0) best = std::min(best, s);
      }
      if (env.rank == 1) {
        std::vector<uint8_t> dst(bytes);
        std::memcpy(dst.data(), buf.data(), bytes);
        double mbest = 1e9;
        for (int i = 0; i < reps; ++i) {
          auto start = Clock::now();
          std::memcpy(dst.data(), buf.data(), bytes);
          mbest = std::min(mbest, std::chrono::duration<double>(Clock::now() - start).count());
        }
        std::printf("64 MiB via %s: %.2f GB/s (memcpy in one process: %.2f GB/s)\n",
                    path == LargePath::kRing ? "ring" : "CMA", bytes / best / 1e9, bytes / mbest / 1e9);
      }
      barrier(env, "done");
    });
  }
}

}  // namespace
}  // namespace crossbar

namespace crossbar {
namespace {
// Manual sweep: ./test_shm_transport --gtest_also_run_disabled_tests --gtest_filter='*Sweep*'
TEST(ShmTransport, DISABLED_BandwidthSweep) {
  for (size_t chunk : {size_t{64} << 10, size_t{256} << 10, size_t{1} << 20}) {
    for (LargePath path : {LargePath::kCma, LargePath::kRing}) {
      runRanks(2, [&](RankEnv& env) {
        ShmTransportOptions o;
        o.large_path = path;
        o.pipeline_bytes = chunk;
        Shm shm(env, o);
        for (size_t bytes : {size_t{8}, size_t{16} << 10, size_t{128} << 10, size_t{1} << 20, size_t{4} << 20,
                             size_t{16} << 20, size_t{64} << 20, size_t{256} << 20}) {
          std::vector<uint8_t> buf(bytes, 1);
          int reps = static_cast<int>(std::clamp<size_t>((size_t{512} << 20) / bytes, 3, 2000));
          barrier(env, fmt::format("b{}", bytes));
          Clock::time_point start;
          for (int i = 0; i < reps + 1; ++i) {
            if (i == 1) start = Clock::now();
            if (env.rank == 0) {
              shm.t->isend(1, i, buf.data(), bytes)->wait(Deadline::after(30s));
              shm.t->irecv(1, i, nullptr, 0)->wait(Deadline::after(30s));
            } else {
              shm.t->irecv(0, i, buf.data(), bytes)->wait(Deadline::after(30s));
              shm.t->isend(0, i, nullptr, 0)->wait(Deadline::after(30s));
            }
          }
          double s = std::chrono::duration<double>(Clock::now() - start).count() / reps;
          if (env.rank == 0)
            std::printf("%-4s chunk %4zu KiB %9zu B: %6.2f GB/s (%.1f us)\n",
                        path == LargePath::kRing ? "ring" : "cma", chunk >> 10, bytes, bytes / s / 1e9,
                        s * 1e6);
        }
        barrier(env, "done");
      });
    }
  }
}
}  // namespace
}  // namespace crossbar
