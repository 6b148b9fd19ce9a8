// The store client's reply decoder fed arbitrary bytes (a hostile or broken server).
#include <cstdint>
#include <string>
#include <string_view>

#include "comm/tcp_store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string error;
  crossbar::TcpStoreServer::decodeRepliesForTesting(
      std::string_view(reinterpret_cast<const char*>(data), size), error);
  return 0;
}
