// Uses the installed crossbar: the env registry, a FileStore, the build info.
#include <cstdio>
#include <string>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/file_store.h"
#include "crossbar_build_info.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer STORE_PATH\n");
    return 2;
  }
  try {
    crossbar::FileStore store(argv[1]);
    store.set("greeting", std::string("hello"));
    std::string value = crossbar::toString(store.get("greeting"));
    int64_t n = store.add("counter", 41) + 1;
    std::printf("crossbar %s: %zu environment variables, store says %s %lld\n", CROSSBAR_VERSION,
                crossbar::env::all().size(), value.c_str(), static_cast<long long>(n));
    return value == "hello" && n == 42 && !crossbar::env::all().empty() ? 0 : 1;
  } catch (const crossbar::Error& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
