// TCP store: a server (a thread inside rank 0, or the standalone crossbar-store
// binary so the store outlives any rank) and clients that reconnect on transient
// errors. Messages are length-prefixed and bounded (kStoreMax*Bytes).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/store.h"

namespace crossbar {

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // server: address to bind; client: address to reach
  uint16_t port = 0;               // server: 0 picks a free port
  bool is_server = false;          // also run a server in this process
  Millis connect_timeout{60'000};  // how long a client keeps retrying to connect
};

class TcpStoreServer {
 public:
  // Binds and starts serving on a background thread.
  TcpStoreServer(const std::string& host, uint16_t port);
  ~TcpStoreServer();
  uint16_t port() const;
  void stop();

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
