// The environment registry's parsers (sizes, booleans, integers, durations, enums):
// anything may arrive from a user's shell. The first byte picks the parser.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "comm/env.h"
#include "comm/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  if (text.find('\0') != std::string::npos) return 0;  // cannot be in an environment value
  using namespace crossbar;
  try {
    switch (data[0] % 6) {
      case 0:
        env::parseSize(text, "fuzz");
        break;
      case 1:
        env::parseBool(text, "fuzz");
        break;
      case 2:
        env::parseInt(text, "fuzz");
        break;
      case 3:
        setenv("CROSSBAR_TIMEOUT", text.c_str(), 1);
        env::getMillis("CROSSBAR_TIMEOUT");
        break;
      case 4:
        setenv("CROSSBAR_DEBUG", text.c_str(), 1);
        env::getEnum("CROSSBAR_DEBUG");
        break;
      case 5:
        setenv("CROSSBAR_SHM_RING_SIZE", text.c_str(), 1);
        env::getSize("CROSSBAR_SHM_RING_SIZE");
        break;
    }
  } catch (const InvalidArgument&) {
  }
  unsetenv("CROSSBAR_TIMEOUT");
  unsetenv("CROSSBAR_DEBUG");
  unsetenv("CROSSBAR_SHM_RING_SIZE");
  return 0;
}
