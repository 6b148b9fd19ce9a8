#include "comm/store.h"

#include "comm/env.h"

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

}  // namespace crossbar
