// crossbar-store: a standalone TCP store, so rendezvous outlives any rank (elastic
// jobs, restarts). Point ranks at it with CROSSBAR_STORE_ADDR=host:port.
#include <fmt/format.h>
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/tcp_store.h"

namespace {

constexpr uint16_t kDefaultPort = 29500;

void usage(FILE* out) {
  std::fprintf(out,
               "usage: crossbar-store [--host HOST] [--port PORT]\n"
               "\n"
               "Serves a crossbar TCP store until SIGINT or SIGTERM.\n"
               "  --host HOST  address to bind (default: all interfaces, IPv4 and IPv6);\n"
               "               a host name, IPv4 or IPv6 address\n"
               "  --port PORT  port to listen on (default %u; 0 picks a free port)\n"
               "  --help       show this help\n"
               "\n"
               "Ranks reach it with CROSSBAR_STORE_ADDR=HOST:PORT.\n",
               kDefaultPort);
}

}  // namespace

int main(int argc, char** argv) {
  std::string host;
  uint16_t port = kDefaultPort;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string_view arg = argv[i];
      auto value = [&](std::string_view flag) -> std::string {
        if (arg.size() > flag.size() && arg.substr(0, flag.size()) == flag && arg[flag.size()] == '=')
          return std::string(arg.substr(flag.size() + 1));
        if (i + 1 >= argc) throw crossbar::InvalidArgument(fmt::format("{} needs a value", flag));
        return argv[++i];
      };
      if (arg == "--help" || arg == "-h") {
        usage(stdout);
        return 0;
      } else if (arg == "--host" || arg.starts_with("--host=")) {
        host = value("--host");
      } else if (arg == "--port" || arg.starts_with("--port=")) {
        const int64_t p = crossbar::env::parseInt(value("--port"), "--port");
        if (p < 0 || p > 65535)
          throw crossbar::InvalidArgument(fmt::format("--port={}: expected 0..65535", p));
        port = static_cast<uint16_t>(p);
      } else {
        throw crossbar::InvalidArgument(fmt::format("unknown argument '{}'", arg));
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "crossbar-store: %s\n", e.what());
    usage(stderr);
    return 2;
  }

  // Block the stop signals before the server thread starts so only sigwait() sees them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  try {
    crossbar::TcpStoreServer server(host, port);
    const std::string shown = host.empty() ? "0.0.0.0" : host;
    std::printf("crossbar-store listening on %s:%u\n",
                shown.find(':') != std::string::npos ? ("[" + shown + "]").c_str() : shown.c_str(),
                server.port());
    std::fflush(stdout);
    int sig = 0;
    sigwait(&stop_signals, &sig);
    std::fprintf(stderr, "crossbar-store: %s received, shutting down\n", strsignal(sig));
    server.stop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "crossbar-store: %s\n", e.what());
    return 1;
  }
  return 0;
}
