// FileStore: a store in one file on a shared file system (torch's FileStore idea),
// for jobs without a reachable TCP port. PrefixStore: namespaces keys of another store.
#pragma once

#include <memory>
#include <string>

#include "comm/store.h"

namespace crossbar {

class FileStore : public Store {
 public:
  explicit FileStore(const std::string& path);
  ~FileStore() override;
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

class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);
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
  // Counts keys of the base store (like torch's PrefixStore).
  int64_t numKeys() override;
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string key(const std::string& k) const { return prefix_ + "/" + k; }
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace crossbar
