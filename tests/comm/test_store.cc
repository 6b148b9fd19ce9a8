// Store semantics (TcpStore, FileStore, PrefixStore over both), multi-process
// concurrency, deadlines, size limits and the TCP server's robustness.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <set>
#include <thread>

#include "comm/errors.h"
#include "comm/file_store.h"
#include "comm/tcp_store.h"
#include "harness/multiprocess.h"

namespace crossbar {
namespace {

using namespace std::chrono_literals;

// ---- helpers -------------------------------------------------------------------------

// Runs fn(rank) in `n` forked processes; returns what each returned (or "EXC: ...").
std::vector<std::string> forkRanks(int n, const std::function<std::string(int)>& fn, Millis limit = 20s) {
  std::vector<pid_t> pids;
  std::vector<int> fds;
  std::fflush(nullptr);
  for (int r = 0; r < n; ++r) {
    int p[2];
    if (pipe(p) != 0) throw std::runtime_error("pipe");
    pid_t pid = fork();
    if (pid == 0) {
      ::close(p[0]);
      std::string out;
      int code = 0;
      try {
        out = fn(r);
      } catch (const std::exception& e) {
        out = std::string("EXC: ") + e.what();
        code = 1;
      }
      size_t off = 0;
      while (off < out.size()) {
        ssize_t k = ::write(p[1], out.data() + off, out.size() - off);
        if (k <= 0) break;
        off += k;
      }
      _exit(code);
    }
    ::close(p[1]);
    pids.push_back(pid);
    fds.push_back(p[0]);
  }
  std::vector<std::string> results(n);
  const Deadline deadline = Deadline::after(limit);
  for (int r = 0; r < n; ++r) {
    for (;;) {
      pollfd pfd{fds[r], POLLIN, 0};
      int rc = ::poll(&pfd, 1, static_cast<int>(deadline.remaining().count()));
      if (rc <= 0) {
        results[r] = "EXC: rank timed out";
        break;
      }
      char buf[4096];
      ssize_t k = ::read(fds[r], buf, sizeof(buf));
      if (k <= 0) break;
      results[r].append(buf, k);
    }
    ::close(fds[r]);
  }
  for (pid_t pid : pids) {
    kill(pid, SIGKILL);  // no-op for ranks that finished
    waitpid(pid, nullptr, 0);
  }
  return results;
}

std::string tempPath(const std::string& tag) {
  static std::atomic<int> counter{0};
  return (std::filesystem::temp_directory_path() /
          fmt::format("crossbar_store_test_{}_{}_{}", getpid(), tag, counter++))
      .string();
}

template <class F>
Millis timed(F&& f) {
  auto t0 = Clock::now();
  f();
  return std::chrono::duration_cast<Millis>(Clock::now() - t0);
}

// ---- parameterized over store kinds ---------------------------------------------------

enum class Kind { kTcp, kFile, kPrefixTcp, kPrefixFile };

std::string kindName(const ::testing::TestParamInfo<Kind>& info) {
  switch (info.param) {
    case Kind::kTcp:
      return "Tcp";
    case Kind::kFile:
      return "File";
    case Kind::kPrefixTcp:
      return "PrefixTcp";
    case Kind::kPrefixFile:
      return "PrefixFile";
  }
  return "?";
}

class StoreTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    if (GetParam() == Kind::kTcp || GetParam() == Kind::kPrefixTcp)
      server_ = std::make_unique<TcpStoreServer>("127.0.0.1", 0);
    else
      path_ = tempPath("fs");
    store_ = connect();
  }
  void TearDown() override {
    store_.reset();
    server_.reset();
    if (!path_.empty()) std::filesystem::remove(path_);
  }

  // A new client of the same store (usable in a forked child).
  std::shared_ptr<Store> connect() {
    std::shared_ptr<Store> base;
    if (server_) {
      TcpStoreOptions o;
      o.port = server_->port();
      o.connect_timeout = 5s;
      base = std::make_shared<TcpStore>(o);
    } else {
      base = std::make_shared<FileStore>(path_);
    }
    if (GetParam() == Kind::kPrefixTcp || GetParam() == Kind::kPrefixFile)
      return std::make_shared<PrefixStore>("job1", base);
    return base;
  }

  std::unique_ptr<TcpStoreServer> server_;
  std::string path_;
  std::shared_ptr<Store> store_;
};

TEST_P(StoreTest, SetGetOverwrite) {
  store_->set("a", "1");
  EXPECT_EQ(toString(store_->get("a", Deadline::after(1s))), "1");
  store_->set("a", "two");
  EXPECT_EQ(toString(store_->get("a")), "two");
  Bytes binary = {0, 1, 2, 0, 255};
  store_->set("bin", binary);
  EXPECT_EQ(store_->get("bin", Deadline::after(1s)), binary);
  store_->set("empty", Bytes{});
  EXPECT_TRUE(store_->get("empty", Deadline::after(1s)).empty());
  EXPECT_TRUE(store_->check({"empty"}));
}

TEST_P(StoreTest, AddCreatesCounterAtZeroStoredAsText) {
  EXPECT_EQ(store_->add("c", 5), 5);
  EXPECT_EQ(store_->add("c", -2), 3);
  EXPECT_EQ(store_->add("c", 0), 3);
  EXPECT_EQ(toString(store_->get("c", Deadline::after(1s))), "3");
  store_->set("n", "40");
  EXPECT_EQ(store_->add("n", 2), 42);
  store_->set("text", "hello");
  try {
    store_->add("text", 1);
    FAIL() << "add on a non-integer value should throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not a decimal integer"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store_->add("c", 1), 4);  // the store keeps serving this client
}

TEST_P(StoreTest, CompareSet) {
  // Absent key: matches an empty `expected` only.
  EXPECT_EQ(toString(store_->compareSet("k", toBytes("x"), toBytes("y"))), "");
  EXPECT_FALSE(store_->check({"k"}));
  EXPECT_EQ(toString(store_->compareSet("k", {}, toBytes("first"))), "first");
  // Present: swaps only on a match, returns what is stored.
  EXPECT_EQ(toString(store_->compareSet("k", toBytes("wrong"), toBytes("second"))), "first");
  EXPECT_EQ(toString(store_->compareSet("k", toBytes("first"), toBytes("second"))), "second");
  EXPECT_EQ(toString(store_->get("k", Deadline::after(1s))), "second");
  EXPECT_EQ(toString(store_->compareSet("k", {}, toBytes("third"))), "second");
}

TEST_P(StoreTest, CheckDeleteNumKeys) {
  const int64_t base = store_->numKeys();
  EXPECT_TRUE(store_->check({}));
  EXPECT_FALSE(store_->check({"x"}));
  store_->set("x", "1");
  store_->set("y", "2");
  EXPECT_TRUE(store_->check({"x"}));
  EXPECT_TRUE(store_->check({"x", "y"}));
  EXPECT_FALSE(store_->check({"x", "z"}));
  EXPECT_EQ(store_->numKeys(), base + 2);
  EXPECT_TRUE(store_->deleteKey("x"));
  EXPECT_FALSE(store_->deleteKey("x"));
  EXPECT_FALSE(store_->check({"x"}));
  EXPECT_EQ(store_->numKeys(), base + 1);
  store_->set("x", "again");
  EXPECT_EQ(toString(store_->get("x", Deadline::after(1s))), "again");
}

TEST_P(StoreTest, GetTimesOutWithinDeadlineNamingTheKey) {
  Millis took = timed([&] {
    try {
      store_->get("never-set-key", Deadline::after(200ms));
      FAIL() << "expected Timeout";
    } catch (const Timeout& e) {
      EXPECT_NE(std::string(e.what()).find("never-set-key"), std::string::npos) << e.what();
      if (server_) {
        EXPECT_NE(std::string(e.what()).find(fmt::format("127.0.0.1:{}", server_->port())), std::string::npos)
            << e.what();
      }
    }
  });
  EXPECT_GE(took, 190ms);
  EXPECT_LT(took, 1500ms);
  // An expired deadline times out at once.
  EXPECT_THROW(store_->get("never-set-key", Deadline::after(0ms)), Timeout);
  // And the store still works afterwards.
  store_->set("after", "ok");
  EXPECT_EQ(toString(store_->get("after", Deadline::after(1s))), "ok");
}

TEST_P(StoreTest, WaitTimeoutListsOnlyMissingKeys) {
  store_->set("present", "1");
  try {
    store_->wait({"present", "missing-one", "missing-two"}, Deadline::after(150ms));
    FAIL() << "expected Timeout";
  } catch (const Timeout& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("missing-one"), std::string::npos) << what;
    EXPECT_NE(what.find("missing-two"), std::string::npos) << what;
    EXPECT_EQ(what.find("'present'"), std::string::npos) << what;
  }
  store_->wait({"present"}, Deadline::after(1s));
  store_->wait({});
}

TEST_P(StoreTest, GetBlocksUntilAnotherProcessSets) {
  std::thread setter([&] {
    std::this_thread::sleep_for(200ms);
    store_->set("late", "value");
    store_->set("w1", "a");
    store_->set("w2", "b");
  });
  auto results = forkRanks(1, [&](int) {
    auto s = connect();
    auto t0 = Clock::now();
    std::string v = toString(s->get("late", Deadline::after(5s)));
    s->wait({"w1", "w2"}, Deadline::after(5s));
    return fmt::format("{} {}", v, Clock::now() - t0 >= 100ms ? "blocked" : "early");
  });
  setter.join();
  EXPECT_EQ(results[0], "value blocked");
}

TEST_P(StoreTest, ManyProcessesWaitOnOneKey) {
  auto setter = std::thread([&] {
    std::this_thread::sleep_for(200ms);
    store_->set("go", "1");
  });
  auto results = forkRanks(6, [&](int) {
    auto s = connect();
    s->wait({"go"}, Deadline::after(5s));
    return toString(s->get("go", Deadline::after(1s)));
  });
  setter.join();
  for (auto& r : results) EXPECT_EQ(r, "1");
}

TEST_P(StoreTest, ConcurrentAddsFromEightProcessesAreExact) {
  auto results = forkRanks(8, [&](int) {
    auto s = connect();
    for (int i = 0; i < 1000; ++i) s->add("counter", 1);
    return std::string("ok");
  });
  for (auto& r : results) EXPECT_EQ(r, "ok");
  EXPECT_EQ(store_->add("counter", 0), 8000);
  EXPECT_EQ(toString(store_->get("counter", Deadline::after(1s))), "8000");
}

TEST_P(StoreTest, ConcurrentCompareSetElectsExactlyOneWinner) {
  auto results = forkRanks(8, [&](int rank) {
    auto s = connect();
    s->add("ready", 1);
    // Start together so the compareSets race.
    while (s->add("ready", 0) < 8) std::this_thread::sleep_for(1ms);
    Bytes mine = toBytes(std::to_string(rank));
    Bytes now = s->compareSet("leader", {}, mine);
    return fmt::format("{} {}", now == mine ? "won" : "lost", toString(now));
  });
  int winners = 0;
  std::set<std::string> leaders;
  for (auto& r : results) {
    ASSERT_EQ(r.rfind("EXC", 0), std::string::npos) << r;
    winners += r.rfind("won", 0) == 0;
    leaders.insert(r.substr(r.find(' ') + 1));
  }
  EXPECT_EQ(winners, 1);
  EXPECT_EQ(leaders.size(), 1u);
  EXPECT_EQ(toString(store_->get("leader", Deadline::after(1s))), *leaders.begin());
}

TEST_P(StoreTest, ThreadsShareOneClient) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 250; ++i) store_->add("shared", 1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(store_->add("shared", 0), 1000);
}

// A thread parked in get() must not hold up the other threads of the same client: the
// set it waits for comes from one of them (a single shared connection made this a
// deadlock until the get's deadline; threads splitting several communicators at once
// stalled each other across processes that way).
TEST_P(StoreTest, ParkedGetDoesNotBlockOtherThreadsOfTheClient) {
  std::string got;
  std::thread waiter([&] {
    try {
      got = toString(store_->get("parked", Deadline::after(30s)));
    } catch (const std::exception& e) {
      got = e.what();
    }
  });
  std::this_thread::sleep_for(100ms);  // the get is parked (the test passes either way)
  store_->set("parked", "v");
  waiter.join();
  EXPECT_EQ(got, "v");
}

// More parked gets than the client keeps connections for: the sets still go through.
TEST_P(StoreTest, ManyParkedThreadsStillLetSetsThrough) {
  constexpr int kThreads = 24;
  std::vector<std::string> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      try {
        got[t] = toString(store_->get(fmt::format("k{}", t), Deadline::after(30s)));
        store_->wait({"all"}, Deadline::after(30s));
      } catch (const std::exception& e) {
        got[t] = e.what();
      }
    });
  std::this_thread::sleep_for(100ms);
  for (int t = 0; t < kThreads; ++t) store_->set(fmt::format("k{}", t), fmt::format("v{}", t));
  store_->set("all", "1");
  for (auto& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(got[t], fmt::format("v{}", t));
}

TEST_P(StoreTest, OversizedKeyAndValueAreRejectedClearly) {
  const std::string long_key(kStoreMaxKeyBytes + 1, 'k');
  try {
    store_->set(long_key, "v");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("limit"), std::string::npos) << e.what();
  }
  EXPECT_THROW(store_->get(long_key, Deadline::after(100ms)), InvalidArgument);
  EXPECT_THROW(store_->add(long_key, 1), InvalidArgument);
  EXPECT_THROW(store_->wait({"ok", long_key}, Deadline::after(100ms)), InvalidArgument);
  Bytes huge(kStoreMaxValueBytes + 1, 7);
  try {
    store_->set("big", huge);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("kStoreMaxValueBytes"), std::string::npos) << e.what();
  }
  // At the limits exactly is fine.
  const bool prefixed = GetParam() == Kind::kPrefixTcp || GetParam() == Kind::kPrefixFile;
  const std::string max_key(kStoreMaxKeyBytes - (prefixed ? 5 : 0), 'm');  // "job1/" counts
  store_->set(max_key, "v");
  EXPECT_EQ(toString(store_->get(max_key, Deadline::after(1s))), "v");
  EXPECT_FALSE(store_->check({"big"}));
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreTest,
                         ::testing::Values(Kind::kTcp, Kind::kFile, Kind::kPrefixTcp, Kind::kPrefixFile),
                         kindName);

// ---- PrefixStore -------------------------------------------------------------------------

TEST(PrefixStore, NamespacesKeysOfTheBase) {
  auto path = tempPath("prefix");
  auto base = std::make_shared<FileStore>(path);
  PrefixStore a("a", base), b("b", base);
  a.set("k", "from a");
  b.set("k", "from b");
  EXPECT_EQ(toString(base->get("a/k", Deadline::after(1s))), "from a");
  EXPECT_EQ(toString(b.get("k", Deadline::after(1s))), "from b");
  EXPECT_EQ(a.numKeys(), 2);  // counts the base's keys, like torch
  EXPECT_TRUE(a.deleteKey("k"));
  EXPECT_FALSE(a.check({"k"}));
  EXPECT_TRUE(b.check({"k"}));
  try {
    a.get("missing", Deadline::after(50ms));
    FAIL();
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("a/missing"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

// ---- TCP specifics ---------------------------------------------------------------------

int rawConnect(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{3, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

void rawSend(int fd, const std::vector<uint8_t>& bytes) {
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
}

// Reads until the server closes the connection (or 3 s pass).
std::string rawReadAll(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, n);
  }
  return out;
}

std::vector<uint8_t> le(uint64_t v, int bytes) {
  std::vector<uint8_t> out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
  return out;
}

std::vector<uint8_t> hello(uint16_t version) {
  auto out = le(0x54534243, 4);
  auto v = le(version, 2);
  out.insert(out.end(), v.begin(), v.end());
  out.push_back(0);
  out.push_back(0);
  return out;
}

TcpStoreOptions clientOptions(uint16_t port, Millis connect_timeout = 5s) {
  TcpStoreOptions o;
  o.port = port;
  o.connect_timeout = connect_timeout;
  return o;
}

TEST(TcpStore, OversizedFrameClosesOnlyThatClient) {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore good(clientOptions(server.port()));
  good.set("before", "1");
  // A client parked in a get must survive the bad client too.
  std::thread parked([&] {
    TcpStore waiter(clientOptions(server.port()));
    EXPECT_EQ(toString(waiter.get("later", Deadline::after(5s))), "2");
  });

  int fd = rawConnect(server.port());
  ASSERT_GE(fd, 0);
  auto msg = hello(1);
  for (auto part : {le(1, 2), le(0, 2), le(2, 4), le(kStoreMaxKeyBytes + 1, 4)})  // set, key too long
    msg.insert(msg.end(), part.begin(), part.end());
  rawSend(fd, msg);
  std::string reply = rawReadAll(fd);  // hello reply, error frame, then close
  ::close(fd);
  EXPECT_NE(reply.find("exceeds the store's limit"), std::string::npos) << reply.size();

  // A value length beyond kStoreMaxValueBytes is refused before the body arrives.
  fd = rawConnect(server.port());
  msg = hello(1);
  for (auto part : {le(1, 2), le(0, 2), le(2, 4), le(1, 4), le('k', 1), le(0xFFFFFFF0u, 4)})
    msg.insert(msg.end(), part.begin(), part.end());
  rawSend(fd, msg);
  reply = rawReadAll(fd);
  ::close(fd);
  EXPECT_NE(reply.find("value of"), std::string::npos);

  // A malformed header (unknown operation) is closed too.
  fd = rawConnect(server.port());
  msg = hello(1);
  for (auto part : {le(999, 2), le(0, 2), le(0, 4)}) msg.insert(msg.end(), part.begin(), part.end());
  rawSend(fd, msg);
  reply = rawReadAll(fd);
  ::close(fd);
  EXPECT_NE(reply.find("malformed"), std::string::npos);

  good.set("after", "1");
  EXPECT_EQ(good.numKeys(), 2);
  good.set("later", "2");
  parked.join();
}

TEST(TcpStore, ValueAtTheLimitRoundTrips) {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore a(clientOptions(server.port())), b(clientOptions(server.port()));
  Bytes big(kStoreMaxValueBytes);
  for (size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<uint8_t>(i >> 12);
  big.back() = 42;
  a.set("big", big);
  EXPECT_TRUE(b.get("big", Deadline::after(5s)) == big);
  EXPECT_EQ(b.add("after", 1), 1);  // the stream stays in step after a big reply
}

TEST(TcpStore, HandshakeRejectsGarbageAndUnknownVersions) {
  TcpStoreServer server("127.0.0.1", 0);
  int fd = rawConnect(server.port());
  rawSend(fd, {'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T', 'P'});
  EXPECT_EQ(rawReadAll(fd), "");  // closed without a reply
  ::close(fd);

  fd = rawConnect(server.port());
  rawSend(fd, hello(99));
  std::string reply = rawReadAll(fd);
  ::close(fd);
  ASSERT_EQ(reply.size(), 8u);
  EXPECT_EQ(static_cast<uint8_t>(reply[6]), 1);  // status: unsupported version

  TcpStore good(clientOptions(server.port()));
  good.set("still", "serving");
  EXPECT_EQ(toString(good.get("still", Deadline::after(1s))), "serving");
}

uint16_t freePort() {
  TcpStoreServer probe("127.0.0.1", 0);
  return probe.port();
}

TEST(TcpStore, ClientConnectsBeforeServerStarts) {
  const uint16_t port = freePort();
  std::unique_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(300ms);
    server = std::make_unique<TcpStoreServer>("127.0.0.1", port);
  });
  Millis took = timed([&] {
    TcpStore client(clientOptions(port, 5s));
    client.set("k", "v");
    EXPECT_EQ(toString(client.get("k", Deadline::after(1s))), "v");
  });
  starter.join();
  EXPECT_GE(took, 250ms);
}

TEST(TcpStore, ConnectTimesOutNamingTheAddress) {
  const uint16_t port = freePort();
  Millis took = timed([&] {
    try {
      TcpStore client(clientOptions(port, 300ms));
      FAIL() << "expected Timeout";
    } catch (const Timeout& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("127.0.0.1:{}", port)), std::string::npos) << e.what();
    }
  });
  EXPECT_LT(took, 2000ms);
}

TEST(TcpStore, LostServerGivesClearError) {
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0);
  TcpStore client(clientOptions(server->port(), 300ms));
  client.set("k", "v");
  server.reset();
  Millis took = timed([&] {
    try {
      client.set("k", "w");
      FAIL() << "expected SystemError";
    } catch (const SystemError& e) {
      EXPECT_NE(std::string(e.what()).find("lost connection to the store"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("still running"), std::string::npos) << e.what();
    }
  });
  EXPECT_LT(took, 2000ms);
  EXPECT_THROW(client.add("n", 1), SystemError);
}

TEST(TcpStore, LostServerWhileWaitingDoesNotHang) {
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0);
  TcpStore client(clientOptions(server->port(), 300ms));
  std::thread killer([&] {
    std::this_thread::sleep_for(200ms);
    server->stop();
  });
  Millis took = timed([&] { EXPECT_THROW(client.get("never", Deadline::after(10s)), SystemError); });
  killer.join();
  EXPECT_LT(took, 3000ms);
}

TEST(TcpStore, IsServerServesOtherClients) {
  TcpStoreOptions o;
  o.is_server = true;
  TcpStore rank0(o);
  ASSERT_NE(rank0.port(), 0);
  TcpStore rank1(clientOptions(rank0.port()));
  rank1.set("hello", "from rank 1");
  EXPECT_EQ(toString(rank0.get("hello", Deadline::after(1s))), "from rank 1");
  EXPECT_EQ(rank0.port(), rank1.port());
}

TEST(TcpStore, ResolvesHostNamesAndIPv6) {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStoreOptions o = clientOptions(server.port());
  o.host = "localhost";
  TcpStore byName(o);
  byName.set("k", "v");

  std::unique_ptr<TcpStoreServer> v6;
  try {
    v6 = std::make_unique<TcpStoreServer>("::1", 0);
  } catch (const Error& e) {
    GTEST_SKIP() << "no IPv6 loopback here: " << e.what();
  }
  o = clientOptions(v6->port());
  o.host = "::1";
  TcpStore client(o);
  client.set("six", "6");
  EXPECT_EQ(toString(client.get("six", Deadline::after(1s))), "6");
}

TEST(TcpStore, ParkedGetDoesNotBlockOtherClients) {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore a(clientOptions(server.port())), b(clientOptions(server.port()));
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    EXPECT_EQ(toString(a.get("k", Deadline::after(5s))), "v");
    got = true;
  });
  std::this_thread::sleep_for(50ms);
  Millis took = timed([&] {
    for (int i = 0; i < 100; ++i) b.add("busy", 1);
    EXPECT_EQ(b.numKeys(), 1);
  });
  EXPECT_LT(took, 1000ms);
  EXPECT_FALSE(got.load());
  b.set("k", "v");
  waiter.join();
  EXPECT_TRUE(got.load());
}

TEST(TcpStore, WorksForTheHarnessRanks) {
  testing::RunOptions opts;
  opts.timeout = 20s;
  testing::runRanks(
      4,
      [](testing::RankEnv& env) {
        env.store->add("arrived", 1);
        env.store->set(fmt::format("rank{}", env.rank), std::to_string(env.rank));
        std::vector<std::string> keys;
        for (int r = 0; r < env.size; ++r) keys.push_back(fmt::format("rank{}", r));
        env.store->wait(keys, Deadline::after(5s));
        EXPECT_EQ(toString(env.store->get(fmt::format("rank{}", (env.rank + 1) % env.size))),
                  std::to_string((env.rank + 1) % env.size));
      },
      opts);
}

// ---- crossbar-store binary -------------------------------------------------------------

TEST(CrossbarStoreBinary, ServesUntilSigterm) {
  const auto exe = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "crossbar-store";
  if (!std::filesystem::exists(exe)) GTEST_SKIP() << exe << " not built";
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    ::close(out[0]);
    ::close(out[1]);
    execl(exe.c_str(), exe.c_str(), "--host", "127.0.0.1", "--port", "0", nullptr);
    _exit(127);
  }
  ::close(out[1]);
  std::string line;
  char c;
  pollfd pfd{out[0], POLLIN, 0};
  while (line.find('\n') == std::string::npos && ::poll(&pfd, 1, 5000) > 0 && ::read(out[0], &c, 1) == 1)
    line.push_back(c);
  ::close(out[0]);
  const std::string prefix = "crossbar-store listening on 127.0.0.1:";
  ASSERT_EQ(line.rfind(prefix, 0), 0u) << line;
  const auto port = static_cast<uint16_t>(std::stoi(line.substr(prefix.size())));
  {
    TcpStore client(clientOptions(port));
    client.set("k", "v");
    EXPECT_EQ(client.add("n", 3), 3);
  }
  {
    TcpStore again(clientOptions(port));  // state outlives the first client
    EXPECT_EQ(toString(again.get("k", Deadline::after(1s))), "v");
  }
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
}  // namespace crossbar
