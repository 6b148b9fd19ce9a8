// TCP store: a server (a thread inside rank 0, or the standalone crossbar-store
// binary so the store outlives any rank) and clients that reconnect on transient
// errors. Messages are length-prefixed and bounded (kStoreMax*Bytes).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "comm/store.h"

namespace crossbar {

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // server: address to bind; client: address to reach
  uint16_t port = 0;               // server: 0 picks a free port
  bool is_server = false;          // also run a server in this process
  Millis connect_timeout{60'000};  // how long a client keeps retrying to connect
  // Shared job secret for the HMAC handshake; unset: auth::loadSecret() (CROSSBAR_SECRET
  // or CROSSBAR_SECRET_FILE). Empty: no authentication.
  std::optional<std::string> secret;
};

class TcpStoreServer {
 public:
  // Binds and starts serving on a background thread. `secret` as in TcpStoreOptions.
  TcpStoreServer(const std::string& host, uint16_t port, std::optional<std::string> secret = std::nullopt);
  ~TcpStoreServer();
  uint16_t port() const;
  void stop();

  // The server's protocol state machine without sockets (fuzzing, tests): one fresh
  // connection receives `input` in pieces of `chunk` bytes and gets whatever it would
  // be sent. Returns the bytes sent back; `closed` says whether the server hung up.
  static std::string serveBytesForTesting(std::string_view input, const std::string& secret, size_t chunk,
                                          bool* closed = nullptr);
  // The client's reply decoding without sockets: how many complete replies `input`
  // holds before a malformed one (then `error` says why) or an incomplete tail.
  static size_t decodeRepliesForTesting(std::string_view input, std::string& error);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class TcpStore : public Store {
 public:
  explicit TcpStore(const TcpStoreOptions& options);
  ~TcpStore() override;
  uint16_t port() const;  // the server's port (useful when 0 was asked)

  using Store::get;
  using Store::set;
  using Store::wait;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Deadline deadline) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Deadline deadline) override;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace crossbar
