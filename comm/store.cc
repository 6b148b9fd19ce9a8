#include "comm/store.h"

#include <fmt/format.h>

#include "comm/env.h"
#include "comm/errors.h"

namespace crossbar {

Millis defaultTimeout() {
  return Millis(env::getMillis("CROSSBAR_TIMEOUT"));
}

Bytes Store::get(const std::string& key) {
  return get(key, Deadline::after(defaultTimeout()));
}

void Store::wait(const std::vector<std::string>& keys) {
  wait(keys, Deadline::after(defaultTimeout()));
}

std::string printableKey(const std::string& key) {
  std::string out;
  for (unsigned char c : key.substr(0, 200)) {
    if (c >= 0x20 && c < 0x7f)
      out.push_back(static_cast<char>(c));
    else
      out += fmt::format("\\x{:02x}", c);
  }
  if (key.size() > 200) out += fmt::format("...({} bytes)", key.size());
  return out;
}

void checkStoreKey(const std::string& context, const std::string& key) {
  if (key.size() > kStoreMaxKeyBytes)
    throw InvalidArgument(context + fmt::format("key '{}' is {} bytes, more than the store's limit of {} bytes "
                                                "(kStoreMaxKeyBytes); use a shorter key",
                                                printableKey(key.substr(0, 64)), key.size(), kStoreMaxKeyBytes));
}

void checkStoreValue(const std::string& context, const std::string& key, size_t size) {
  if (size > kStoreMaxValueBytes)
    throw InvalidArgument(context + fmt::format("value for key '{}' is {} bytes, more than the store's limit "
                                                "of {} bytes (kStoreMaxValueBytes); exchange bulk data "
                                                "through a communicator, not the store",
                                                printableKey(key), size, kStoreMaxValueBytes));
}

}  // namespace crossbar
