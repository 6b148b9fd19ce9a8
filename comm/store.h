// Key-value store used for rendezvous, with torch.distributed's Store semantics:
// get() waits until the key exists; add() creates a counter at 0; compareSet()
// sets `desired` when the current value equals `expected` (an absent key matches
// an empty `expected`) and returns the value now stored.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/deadline.h"

namespace crossbar {

using Bytes = std::vector<uint8_t>;

inline Bytes toBytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
inline std::string toString(const Bytes& b) { return std::string(b.begin(), b.end()); }

// Limits enforced by every store, before anything is allocated.
constexpr size_t kStoreMaxKeyBytes = 4096;
constexpr size_t kStoreMaxValueBytes = 64u << 20;

class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Waits (until `deadline`) for the key; Timeout names the key.
  virtual Bytes get(const std::string& key, Deadline deadline) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;
  // True if every key exists now (no waiting).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits until every key exists; Timeout names the missing keys.
  virtual void wait(const std::vector<std::string>& keys, Deadline deadline) = 0;
  // Returns whether the key existed.
  virtual bool deleteKey(const std::string& key) = 0;
  virtual int64_t numKeys() = 0;

  // Convenience: default deadline from CROSSBAR_TIMEOUT.
  Bytes get(const std::string& key);
  void wait(const std::vector<std::string>& keys);
  void set(const std::string& key, const std::string& value) { set(key, toBytes(value)); }
};

// Default deadline for blocking operations (CROSSBAR_TIMEOUT).
Millis defaultTimeout();

// Keys may be binary or long: the first 200 bytes with non-printables escaped, for errors.
std::string printableKey(const std::string& key);
// InvalidArgument, prefixed by `context`, when a key or value passes the limits above.
void checkStoreKey(const std::string& context, const std::string& key);
void checkStoreValue(const std::string& context, const std::string& key, size_t size);

}  // namespace crossbar
