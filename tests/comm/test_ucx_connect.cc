// How UCX endpoints are connected (comm/ucx_context.h, "Connecting"): the address
// record's encoding, the per-pair choice between worker-address and client-server
// wireup, the listener's address, and contexts on a kept fabric (fault tolerance)
// connecting client-server between forked ranks, falling back to worker addresses for
// a rank that cannot listen, and waiting boundedly (and interruptibly) for a client
// that never connects.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

#include "comm/errors.h"
#include "comm/interrupt.h"
#include "comm/progress.h"
#include "comm/store.h"
#include "comm/transport.h"
#include "comm/ucx_context.h"
#include "harness/multiprocess.h"

namespace crossbar {
namespace {

using testing::RankEnv;
using testing::RunOptions;
using testing::runRanks;
using ucx::detail::Record;

// Sets an environment variable for one test, restoring the old value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_.c_str(), old_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

Record sampleRecord() {
  Record r;
  r.info = {"node7", 4242};
  r.identity = "node7:4242:abc";
  r.live = {"node1:1:1", "node2:2:2"};
  r.listen = "10.1.2.3:40001";
  r.client_id = 0x0123456789abcdefull;
  r.address = {1, 2, 3, 0, 255};
  return r;
}

TEST(UcxRecord, RoundTrip) {
  const Record r = sampleRecord();
  const Record back = ucx::detail::decodeRecord(ucx::detail::encodeRecord(r), 0, 1);
  EXPECT_EQ(back.info.host, r.info.host);
  EXPECT_EQ(back.info.pid, r.info.pid);
  EXPECT_EQ(back.identity, r.identity);
  EXPECT_EQ(back.live, r.live);
  EXPECT_EQ(back.listen, r.listen);
  EXPECT_EQ(back.client_id, r.client_id);
  EXPECT_EQ(back.address, r.address);

  Record none;  // no listener, no live endpoints
  none.address = {9};
  const Record back2 = ucx::detail::decodeRecord(ucx::detail::encodeRecord(none), 0, 1);
  EXPECT_TRUE(back2.listen.empty());
  EXPECT_EQ(back2.address, none.address);
}

TEST(UcxRecord, MalformedIsRefusedNamingThePeer) {
  auto bytes = ucx::detail::encodeRecord(sampleRecord());
  bytes.resize(20);
  try {
    ucx::detail::decodeRecord(bytes, 2, 5);
    FAIL() << "a truncated record was accepted";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("from rank 5"), std::string::npos) << e.what();
  }
  Record bad = sampleRecord();
  bad.listen = "not-an-address";
  EXPECT_THROW(ucx::detail::decodeRecord(ucx::detail::encodeRecord(bad), 0, 1), InternalError);
}

TEST(UcxConnectMode, ClientServerOnlyWhenBothListen) {
  Record a = sampleRecord(), b = sampleRecord();
  EXPECT_TRUE(ucx::detail::clientServer(a, b));
  b.listen.clear();  // b could not listen: both sides pick worker addresses
  EXPECT_FALSE(ucx::detail::clientServer(a, b));
  EXPECT_FALSE(ucx::detail::clientServer(b, a));
}

TEST(UcxConnectMode, Variable) {
  {
    ScopedEnv mode("CROSSBAR_UCX_CONNECT", nullptr);
    EXPECT_TRUE(ucx::detail::wantListener(/*kept=*/true));
    EXPECT_FALSE(ucx::detail::wantListener(/*kept=*/false));
  }
  {
    ScopedEnv mode("CROSSBAR_UCX_CONNECT", "address");
    EXPECT_FALSE(ucx::detail::wantListener(true));
  }
  {
    ScopedEnv mode("CROSSBAR_UCX_CONNECT", "listener");
    EXPECT_TRUE(ucx::detail::wantListener(false));
  }
  {
    ScopedEnv mode("CROSSBAR_UCX_CONNECT", "sometimes");
    EXPECT_THROW(ucx::detail::wantListener(true), InvalidArgument);
  }
}

TEST(UcxListenAddress, OverrideDevicesAndDefault) {
  ScopedEnv devices("UCX_NET_DEVICES", nullptr);
  std::string source;
  {
    ScopedEnv addr("CROSSBAR_UCX_LISTEN_ADDR", "127.0.0.1");
    EXPECT_EQ(ucx::detail::listenAddress(0, &source), "127.0.0.1");
    EXPECT_EQ(source, "CROSSBAR_UCX_LISTEN_ADDR");
  }
  {
    ScopedEnv addr("CROSSBAR_UCX_LISTEN_ADDR", "lo");  // an interface name
    EXPECT_EQ(ucx::detail::listenAddress(0, &source), "127.0.0.1");
  }
  {
    ScopedEnv addr("CROSSBAR_UCX_LISTEN_ADDR", "no-such-if0");
    try {
      ucx::detail::listenAddress(3, &source);
      FAIL() << "an unknown interface was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("CROSSBAR_UCX_LISTEN_ADDR=no-such-if0"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("lo 127.0.0.1"), std::string::npos) << e.what();
    }
  }
  {
    // The first UCX device with an IPv4 address (an IB port has none).
    ScopedEnv dev("UCX_NET_DEVICES", "mlx5_0:1,lo");
    EXPECT_EQ(ucx::detail::listenAddress(0, &source), "127.0.0.1");
    EXPECT_EQ(source, "UCX_NET_DEVICES device lo");
  }
  // No setting: some IPv4 address of this host, never empty.
  const std::string any = ucx::detail::listenAddress(0, &source);
  EXPECT_FALSE(any.empty()) << source;
}

// A UCX transport on a kept fabric, driven by its own engine.
struct FabricPeer {
  ProgressEngine engine;
  std::shared_ptr<ucx::Fabric> fabric = std::make_shared<ucx::Fabric>();
  std::unique_ptr<Transport> t;
  explicit FabricPeer(RankEnv& env) {
    std::vector<int> peers;
    for (int r = 0; r < env.size; ++r)
      if (r != env.rank) peers.push_back(r);
    TransportSetup s{env.store, env.rank, env.size, peers, nullptr, &engine, Deadline::after(Millis(30'000)),
                     fabric,    0};
    t = makeUcxTransport(s);
    engine.add(t.get());
  }
  ~FabricPeer() {
    engine.remove(t.get());
    t.reset();
  }
  const ucx::UcxContext& context() { return *ucx::ucxContextOf(*t); }
};

// Every rank sends its rank to every other one and checks what it got.
void exchange(RankEnv& env, Transport& t) {
  std::vector<int> out(env.size, env.rank), in(env.size, -1);
  std::vector<RequestPtr> reqs;
  for (int p = 0; p < env.size; ++p) {
    if (p == env.rank) continue;
    reqs.push_back(t.irecv(p, 7, &in[p], sizeof(int)));
    reqs.push_back(t.isend(p, 7, &out[p], sizeof(int)));
  }
  for (auto& r : reqs) r->wait(Deadline::after(Millis(30'000)));
  for (int p = 0; p < env.size; ++p)
    if (p != env.rank) {
      EXPECT_EQ(in[p], p);
    }
}

std::vector<int> othersOf(const RankEnv& env) {
  std::vector<int> peers;
  for (int r = 0; r < env.size; ++r)
    if (r != env.rank) peers.push_back(r);
  return peers;
}

TEST(UcxConnect, KeptFabricConnectsClientServer) {
  RunOptions o;
  o.env["CROSSBAR_UCX_TLS"] = "tcp";
  runRanks(
      3,
      [](RankEnv& env) {
        FabricPeer peer(env);
        EXPECT_EQ(peer.context().clientServerPeers(), othersOf(env));
        exchange(env, *peer.t);
      },
      o);
}

TEST(UcxConnect, AddressModeOnRequest) {
  RunOptions o;
  o.env["CROSSBAR_UCX_TLS"] = "tcp";
  o.env["CROSSBAR_UCX_CONNECT"] = "address";
  runRanks(
      3,
      [](RankEnv& env) {
        FabricPeer peer(env);
        EXPECT_TRUE(peer.context().clientServerPeers().empty());
        exchange(env, *peer.t);
      },
      o);
}

// Rank 2 cannot listen (no connection manager allowed): its pairs fall back to worker
// addresses on both sides, the pair 0-1 still connects client-server.
TEST(UcxConnect, RankThatCannotListenFallsBackPerPair) {
  RunOptions o;
  o.env["CROSSBAR_UCX_TLS"] = "tcp";
  runRanks(
      3,
      [](RankEnv& env) {
        if (env.rank == 2) setenv("UCX_SOCKADDR_TLS_PRIORITY", "rdmacm", 1);  // this host has no rdmacm
        FabricPeer peer(env);
        const std::vector<int> expected = env.rank == 2 ? std::vector<int>{} : std::vector<int>{1 - env.rank};
        EXPECT_EQ(peer.context().clientServerPeers(), expected);
        exchange(env, *peer.t);
      },
      o);
}

// The server of a pair waits for its client's connection request only until the setup
// deadline (Timeout naming the client), and reaches the interruption point meanwhile
// (fault tolerance ends the wait there when the client died). Rank 0 publishes a record
// with a listener, as a client would, and never connects.
TEST(UcxConnect, ServerWaitForAbsentClientIsBoundedAndInterruptible) {
  RunOptions o;
  o.env["CROSSBAR_UCX_TLS"] = "tcp";
  runRanks(
      2,
      [](RankEnv& env) {
        if (env.rank == 0) {
          Record r = sampleRecord();
          r.info = {hostName(), static_cast<int>(getpid())};
          r.listen = "127.0.0.1:9";  // never used: rank 0 is the client
          env.store->set("ucx/addr/0", ucx::detail::encodeRecord(r));
          env.store->get("test/done", Deadline::after(Millis(60'000)));
          return;
        }
        auto fabric = std::make_shared<ucx::Fabric>();
        TransportSetup s{env.store, 1, 2, {0}, nullptr, nullptr, Deadline::after(Millis(1500)), fabric, 0};
        const auto t0 = std::chrono::steady_clock::now();
        try {
          ucx::UcxContext ctx(s, "ucx/addr");
          ADD_FAILURE() << "setup finished without the client";
        } catch (const Timeout& e) {
          EXPECT_EQ(e.peers(), std::vector<int>{0});
          EXPECT_NE(std::string(e.what()).find("never connected to this rank's listener"), std::string::npos)
              << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));

        int points = 0;
        {
          ScopedInterruptCheck check([&](std::string_view step) {
            if (step == "ucx handshake" && ++points == 3) throw PeerFailure("client died (test)", {0});
          });
          s.deadline = Deadline::after(Millis(60'000));
          try {
            ucx::UcxContext ctx(s, "ucx/addr");
            ADD_FAILURE() << "setup finished without the client";
          } catch (const PeerFailure& e) {
            EXPECT_EQ(std::string(e.what()), "client died (test)");
          }
        }
        EXPECT_EQ(points, 3);
        env.store->set("test/done", toBytes("1"));
      },
      o);
}

}  // namespace
}  // namespace crossbar
