// Hardening: SHA-256/HMAC against published vectors, the store's authenticated
// handshake (every mismatch combination), hostile protocol input (bad magic, unknown
// versions, oversized lengths, random and mutated streams) and parsers under random input.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "comm/auth.h"
#include "comm/bootstrap.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/tcp_store.h"
#include "comm/topology.h"

namespace crossbar {
namespace {

using namespace std::chrono_literals;

std::string unhex(std::string_view hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return out;
}

// ---- SHA-256 (FIPS 180-2 appendix B) and HMAC-SHA256 (RFC 4231) ---------------------------

TEST(Sha256, FipsVectors) {
  EXPECT_EQ(auth::toHex(auth::sha256("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(auth::toHex(auth::sha256("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(auth::toHex(auth::sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(auth::toHex(auth::sha256(std::string(1'000'000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, IncrementalEqualsOneShot) {
  std::mt19937 rng(1);
  std::string data(1000, '\0');
  for (auto& c : data) c = static_cast<char>(rng());
  for (size_t len : {0, 1, 55, 56, 63, 64, 65, 119, 128, 1000}) {
    const std::string part = data.substr(0, len);
    for (size_t step : {1, 3, 64, 100}) {
      auth::Sha256 h;
      for (size_t off = 0; off < part.size(); off += step) h.update(std::string_view(part).substr(off, step));
      EXPECT_EQ(h.finish(), auth::sha256(part)) << "len " << len << " step " << step;
    }
  }
}

TEST(HmacSha256, Rfc4231Vectors) {
  struct Case {
    std::string key, data, mac;
  };
  const std::vector<Case> cases = {
      {std::string(20, '\x0b'), "Hi There",
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {std::string(20, '\xaa'), std::string(50, '\xdd'),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {unhex("0102030405060708090a0b0c0d0e0f10111213141516171819"), std::string(50, '\xcd'),
       "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {std::string(131, '\xaa'),
       "This is a test using a larger than block-size key and a larger than block-size data. The key "
       "needs to be hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const auto& c : cases) EXPECT_EQ(auth::toHex(auth::hmacSha256(c.key, c.data)), c.mac) << c.data;
  // Case 5 (truncated to 128 bits).
  EXPECT_EQ(auth::toHex(auth::hmacSha256(std::string(20, '\x0c'), "Test With Truncation")).substr(0, 32),
            "a3b6167473100ee06e0c796c2955552b");
}

TEST(Auth, ConstantTimeEqualAndRandom) {
  const std::string a = "0123456789abcdef", b = "0123456789abcdeF";
  EXPECT_TRUE(auth::constantTimeEqual(a.data(), a.data(), a.size()));
  EXPECT_FALSE(auth::constantTimeEqual(a.data(), b.data(), a.size()));
  EXPECT_TRUE(auth::constantTimeEqual(a.data(), b.data(), a.size() - 1));
  const std::string r1 = auth::randomBytes(32), r2 = auth::randomBytes(32);
  EXPECT_EQ(r1.size(), 32u);
  EXPECT_NE(r1, r2);
}

// Sets (or unsets, for nullptr) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(Auth, LoadSecret) {
  ScopedEnv s1("CROSSBAR_SECRET", nullptr), s2("CROSSBAR_SECRET_FILE", nullptr);
  EXPECT_EQ(auth::loadSecret(), "");
  const auto path = std::filesystem::temp_directory_path() / fmt::format("crossbar-secret-{}", getpid());
  { std::ofstream(path) << "from-file\n"; }
  std::filesystem::permissions(path,
                               std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  {
    ScopedEnv f("CROSSBAR_SECRET_FILE", path.c_str());
    EXPECT_EQ(auth::loadSecret(), "from-file");
    ScopedEnv e("CROSSBAR_SECRET", "from-env");
    EXPECT_EQ(auth::loadSecret(), "from-env");  // the variable wins over the file
  }
  {
    std::ofstream(path, std::ios::trunc) << "";
    ScopedEnv f("CROSSBAR_SECRET_FILE", path.c_str());
    EXPECT_THROW(auth::loadSecret(), InvalidArgument);  // empty would silently disable auth
  }
  {
    ScopedEnv f("CROSSBAR_SECRET_FILE", "/nonexistent/crossbar-secret");
    try {
      auth::loadSecret();
      FAIL();
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("CROSSBAR_SECRET_FILE"), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove(path);
}

// ---- the authenticated store handshake -----------------------------------------------------

TcpStoreOptions clientOptions(uint16_t port, std::optional<std::string> secret) {
  TcpStoreOptions o;
  o.port = port;
  o.secret = std::move(secret);
  o.connect_timeout = 3s;
  return o;
}

std::string errorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(StoreAuth, MatchingSecretsWork) {
  TcpStoreServer server("127.0.0.1", 0, std::string("s3cret"));
  TcpStore a(clientOptions(server.port(), "s3cret")), b(clientOptions(server.port(), "s3cret"));
  a.set("k", toBytes(std::string("v")));
  EXPECT_EQ(toString(b.get("k", Deadline::after(5s))), "v");
  EXPECT_EQ(b.add("n", 3), 3);
  // A server-owning TcpStore passes its secret to its own server.
  TcpStoreOptions o = clientOptions(0, "x");
  o.is_server = true;
  TcpStore owner(o);
  TcpStore peer(clientOptions(owner.port(), "x"));
  owner.set("a", toBytes(std::string("1")));
  EXPECT_TRUE(peer.check({"a"}));
}

TEST(StoreAuth, NoSecretAnywhereStillWorks) {
  TcpStoreServer server("127.0.0.1", 0, std::string());
  TcpStore a(clientOptions(server.port(), std::string()));
  a.set("k", toBytes(std::string("v")));
  EXPECT_EQ(a.numKeys(), 1);
}

TEST(StoreAuth, WrongSecretIsRejectedWithClearError) {
  TcpStoreServer server("127.0.0.1", 0, std::string("right"));
  const auto t0 = Clock::now();
  const std::string err = errorOf([&] { TcpStore c(clientOptions(server.port(), "wrong")); });
  EXPECT_NE(err.find(fmt::format("the store at 127.0.0.1:{} rejected our credentials: CROSSBAR_SECRET "
                                 "differs between ranks?",
                                 server.port())),
            std::string::npos)
      << err;
  EXPECT_LT(Clock::now() - t0, 2s) << "an auth failure must not be retried until the connect timeout";
  // The server keeps serving the right clients.
  TcpStore ok(clientOptions(server.port(), "right"));
  ok.set("k", toBytes(std::string("v")));
}

TEST(StoreAuth, ClientWithoutSecretIsToldToSetIt) {
  TcpStoreServer server("127.0.0.1", 0, std::string("right"));
  const std::string err = errorOf([&] { TcpStore c(clientOptions(server.port(), std::string())); });
  EXPECT_NE(err.find("requires authentication"), std::string::npos) << err;
  EXPECT_NE(err.find("CROSSBAR_SECRET"), std::string::npos) << err;
}

TEST(StoreAuth, ClientWithSecretRefusesUnauthenticatedServer) {
  TcpStoreServer server("127.0.0.1", 0, std::string());
  const std::string err = errorOf([&] { TcpStore c(clientOptions(server.port(), "mine")); });
  EXPECT_NE(err.find("does not authenticate"), std::string::npos) << err;
}

TEST(StoreAuth, SecretFromEnvironment) {
  ScopedEnv s1("CROSSBAR_SECRET", "env-secret"), s2("CROSSBAR_SECRET_FILE", nullptr);
  TcpStoreServer server("127.0.0.1", 0);  // reads CROSSBAR_SECRET
  TcpStore a(clientOptions(server.port(), std::nullopt));
  a.set("k", toBytes(std::string("v")));
  EXPECT_NE(
      errorOf([&] { TcpStore c(clientOptions(server.port(), "other")); }).find("rejected our credentials"),
      std::string::npos);
}

// ---- hostile input, without sockets (the server's real state machine) ---------------------

std::string hello(uint16_t version = 1, uint16_t flags = 0) {
  std::string h = "CBST";
  h.push_back(static_cast<char>(version & 0xff));
  h.push_back(static_cast<char>(version >> 8));
  h.push_back(static_cast<char>(flags & 0xff));
  h.push_back(static_cast<char>(flags >> 8));
  return h;
}
std::string u16(uint16_t v) {
  return std::string{static_cast<char>(v & 0xff), static_cast<char>(v >> 8)};
}
std::string u32(uint32_t v) {
  std::string s;
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return s;
}
std::string frame(uint16_t op, const std::vector<std::string>& args) {
  std::string f = u16(op) + u16(0) + u32(static_cast<uint32_t>(args.size()));
  for (auto& a : args) f += u32(static_cast<uint32_t>(a.size())) + a;
  return f;
}
const std::string kOkHello = hello().substr(0, 4) + u16(1) + u16(0);

TEST(StoreProtocol, ValidStreamAnsweredInAnyChunking) {
  const std::string in =
      hello() + frame(1, {"key", "value"}) + frame(2, {"key", std::string(8, '\0')}) + frame(8, {});
  const std::string want = TcpStoreServer::serveBytesForTesting(in, "", in.size());
  EXPECT_EQ(want.substr(0, 8), kOkHello);
  EXPECT_NE(want.find("value"), std::string::npos);
  for (size_t chunk : {1, 2, 7, 13}) EXPECT_EQ(TcpStoreServer::serveBytesForTesting(in, "", chunk), want);
}

TEST(StoreProtocol, BadMagicAndUnknownVersionsAreRejected) {
  bool closed = false;
  EXPECT_EQ(TcpStoreServer::serveBytesForTesting("GET / HTTP/1.1\r\n\r\n", "", 64, &closed), "");
  EXPECT_TRUE(closed);
  for (uint16_t v : {0, 2, 0xffff}) {
    const std::string out = TcpStoreServer::serveBytesForTesting(hello(v) + frame(8, {}), "", 64, &closed);
    EXPECT_TRUE(closed) << v;
    ASSERT_EQ(out.size(), 8u) << v;  // the hello reply only; the request is not served
    EXPECT_EQ(out.substr(6, 2), u16(1)) << "kHelloBadVersion";
  }
}

TEST(StoreProtocol, OversizedLengthsRejectedBeforeAllocating) {
  bool closed = false;
  // Lengths near 4 GiB: a server that allocated before checking would die under ASan or OOM.
  for (const std::string& bad : {
           u16(1) + u16(0) + u32(2) + u32(0xffffffffu),                 // key length
           u16(1) + u16(0) + u32(2) + u32(1) + "k" + u32(0xfffffff0u),  // value length
           u16(5) + u16(0) + u32(0xffffffffu),                          // check: nargs
           u16(6) + u16(0) + u32(0),                                    // wait: no timeout
           u16(2) + u16(0) + u32(2) + u32(1) + "k" + u32(4) + "1234",   // get: short int
           u16(99) + u16(0) + u32(0),                                   // unknown op
       }) {
    const std::string out = TcpStoreServer::serveBytesForTesting(hello() + bad, "", 1 << 20, &closed);
    EXPECT_TRUE(closed);
    ASSERT_GT(out.size(), 8u);
    EXPECT_EQ(out.substr(8, 2), u16(2)) << "an error reply (kError) explains why";
    EXPECT_NE(out.find("rejected the request"), std::string::npos);
  }
}

TEST(StoreProtocol, UnauthenticatedRequestsAreNotServed) {
  bool closed = false;
  // A client that ignores the challenge: its request bytes are taken as a (wrong) answer.
  const std::string out = TcpStoreServer::serveBytesForTesting(
      hello() + frame(1, {"key", "value"}) + std::string(64, 'x') + frame(8, {}), "secret", 5, &closed);
  EXPECT_TRUE(closed);
  ASSERT_EQ(out.size(), 8u + 32u + 4u);  // hello + nonce, then the rejection, nothing served
  EXPECT_EQ(out.substr(6, 2), u16(2)) << "kHelloAuth";
  EXPECT_EQ(out.substr(40, 2), u16(1)) << "kAuthRejected";
}

// Silences stderr for one scope: every rejected input logs a warning.
class QuietStderr {
 public:
  QuietStderr() : saved_(::dup(2)) {
    int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, 2);
    ::close(devnull);
  }
  ~QuietStderr() {
    ::dup2(saved_, 2);
    ::close(saved_);
  }

 private:
  int saved_;
};

TEST(StoreProtocol, RandomAndMutatedStreamsNeverCrash) {
  QuietStderr quiet;
  std::mt19937_64 rng(12345);
  const std::string valid = hello() + frame(1, {"a", "b"}) + frame(3, {"n", std::string(8, '\1')}) +
                            frame(4, {"a", "b", "c"}) + frame(5, {"a", "n"}) + frame(7, {"a"}) + frame(8, {});
  for (int iter = 0; iter < 3000; ++iter) {
    std::string in;
    if (iter % 2 == 0) {
      in = valid;
      for (int m = 0, n = 1 + static_cast<int>(rng() % 4); m < n; ++m)
        in[rng() % in.size()] = static_cast<char>(rng());
    } else {
      in = hello();
      for (size_t i = 0, n = rng() % 200; i < n; ++i) in.push_back(static_cast<char>(rng()));
    }
    TcpStoreServer::serveBytesForTesting(in, iter % 5 == 0 ? "s" : "", 1 + rng() % 32);
    std::string error;
    TcpStoreServer::decodeRepliesForTesting(in.substr(8), error);
  }
}

// ---- hostile input over a real socket --------------------------------------------------------

int rawConnect(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) ADD_FAILURE() << "connect";
  return fd;
}

// Reads until EOF or 3 s; returns what came.
std::string readUntilClosed(int fd, bool& eof) {
  std::string got;
  eof = false;
  const auto until = Clock::now() + 3s;
  while (Clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char buf[4096];
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      eof = true;
      break;
    }
    got.append(buf, n);
  }
  return got;
}

TEST(StoreProtocol, ServerSurvivesHostileClientsOverSockets) {
  TcpStoreServer server("127.0.0.1", 0, std::string("s"));
  for (const std::string& bad :
       {std::string("\x00\x00\x00\x00", 4), hello(7), hello() + std::string(64, '\0')}) {
    int fd = rawConnect(server.port());
    ASSERT_EQ(::send(fd, bad.data(), bad.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bad.size()));
    bool eof = false;
    readUntilClosed(fd, eof);
    EXPECT_TRUE(eof) << "the server hangs up on a bad handshake";
    ::close(fd);
  }
  TcpStore ok(clientOptions(server.port(), "s"));
  ok.set("still", toBytes(std::string("alive")));
  EXPECT_TRUE(ok.check({"still"}));
}

// ---- other parsers under random input ----------------------------------------------------------

TEST(Parsers, RandomInputOnlyThrowsTypedErrors) {
  std::mt19937_64 rng(7);
  const std::string alphabet = "0123456789kKmMgGtTsSx-+ .e\n=\\";
  const std::string info = RankInfo{"h", "m", -1, 0, "0-3", 1}.serialize();
  for (int iter = 0; iter < 5000; ++iter) {
    std::string text;
    for (size_t i = 0, n = rng() % 24; i < n; ++i) text.push_back(alphabet[rng() % alphabet.size()]);
    try {
      env::parseSize(text, "fuzz");
    } catch (const InvalidArgument&) {
    }
    try {
      env::parseInt(text, "fuzz");
    } catch (const InvalidArgument&) {
    }
    try {
      env::parseBool(text, "fuzz");
    } catch (const InvalidArgument&) {
    }
    std::string mutated = info;
    mutated[rng() % mutated.size()] = static_cast<char>(rng());
    try {
      RankInfo::deserialize(mutated);
    } catch (const InvalidArgument&) {
    }
    std::map<std::string, std::string> envmap = {
        {"RANK", text}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", text}};
    try {
      detectBootstrap(envmap);
    } catch (const InvalidArgument&) {
    }
  }
}

TEST(Parsers, EnvEdgeCasesFoundByFuzzing) {
  // " -1" used to parse as 2^64-1 bytes (strtoull skips blanks, then negates).
  EXPECT_THROW(env::parseSize(" -1", "X"), InvalidArgument);
  EXPECT_THROW(env::parseSize("\t-5K", "X"), InvalidArgument);
  EXPECT_EQ(env::parseSize("4M", "X"), 4u << 20);
  // An embedded NUL used to end the number early.
  EXPECT_THROW(env::parseInt(std::string("12\0x", 4), "X"), InvalidArgument);
  EXPECT_EQ(env::parseInt("-12", "X"), -12);
  // Durations beyond int64 milliseconds (or inf/nan) were converted with undefined behaviour.
  for (const char* bad : {"18446744073709551915", "1e300s", "inf", "nan", "1e17m"}) {
    ScopedEnv e("CROSSBAR_TIMEOUT", bad);
    EXPECT_THROW(env::getMillis("CROSSBAR_TIMEOUT"), InvalidArgument) << bad;
  }
  ScopedEnv e("CROSSBAR_TIMEOUT", "1.5s");
  EXPECT_EQ(env::getMillis("CROSSBAR_TIMEOUT"), 1500);
  {
    // A bare number read as milliseconds turned CROSSBAR_TIMEOUT=30 (meant: seconds) into 30 ms.
    ScopedEnv bare("CROSSBAR_TIMEOUT", "30");
    try {
      env::getMillis("CROSSBAR_TIMEOUT");
      ADD_FAILURE() << "a bare number was accepted";
    } catch (const InvalidArgument& err) {
      EXPECT_NE(std::string(err.what()).find("30s"), std::string::npos) << err.what();
    }
    ScopedEnv zero("CROSSBAR_TIMEOUT", "0");
    EXPECT_EQ(env::getMillis("CROSSBAR_TIMEOUT"), 0);
    ScopedEnv ms("CROSSBAR_TELEMETRY_STALL_MS", "25");  // the name says milliseconds
    EXPECT_EQ(env::getMillis("CROSSBAR_TELEMETRY_STALL_MS"), 25);
  }
}

TEST(Parsers, HostlistExpansionIsBounded) {
  // Found while writing the fuzz target: several groups multiplied past any memory, and a
  // 1M-name range took quadratic time (vector front erase: ~2e10 string moves for the
  // last case, far beyond the test's ctest timeout; no wall-clock check here, which a
  // loaded or sanitized run would break).
  EXPECT_THROW(expandHostlist("n[0-999999][0-999999]"), InvalidArgument);
  EXPECT_THROW(expandHostlist("a[0-600000],b[0-600000]"), InvalidArgument);
  EXPECT_EQ(expandHostlist("n[1-200000]").size(), 200000u);
}

}  // namespace
}  // namespace crossbar
