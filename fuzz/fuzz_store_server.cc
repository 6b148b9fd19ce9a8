// The TCP store server's protocol state machine (hello, auth, request frames, the
// handlers) fed arbitrary bytes, without sockets. The first byte picks the chunking and
// whether the server has a secret, so partial frames and the auth path are explored.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "comm/tcp_store.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("CROSSBAR_DEBUG_FILE", "/dev/null", 1);  // rejections log a warning each
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  const std::string_view input(reinterpret_cast<const char*>(data + 1), size - 1);
  const size_t chunk = 1 + (mode & 0x3f);
  try {
    crossbar::TcpStoreServer::serveBytesForTesting(input, (mode & 0x80) ? "secret" : "", chunk);
  } catch (const std::exception&) {
    // Typed errors are acceptable; crashes, leaks and UB are what we look for.
  }
  return 0;
}
