// crossbar-demo: a self-launched multi-rank run on this machine. Forks N ranks with
// an embedded store, splits them into virtual nodes (so both the shared-memory and
// the UCX transport carry traffic), checks a ring exchange and measures
// point-to-point bandwidth and latency per transport.
//
//   crossbar-demo --nranks 4 [--ranks-per-node 2] [--max-bytes 64M]
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/context.h"
#include "comm/env.h"
#include "comm/errors.h"
#include "comm/local_launch.h"

using namespace crossbar;

namespace {

struct Args {
  int nranks = 4;
  int ranks_per_node = 2;
  uint64_t max_bytes = 64ull << 20;
  int iters = 20;
};

void usage() {
  std::puts(
      "usage: crossbar-demo [--nranks N] [--ranks-per-node K] [--max-bytes SIZE] [--iters N]\n"
      "  Forks N local ranks (default 4) grouped into virtual nodes of K ranks (default 2):\n"
      "  peers in one virtual node talk through shared memory, others through UCX.");
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw InvalidArgument(fmt::format("{} needs a value", s));
      return argv[++i];
    };
    if (s == "--nranks" || s == "-n") a.nranks = static_cast<int>(env::parseInt(next(), s));
    else if (s == "--ranks-per-node") a.ranks_per_node = static_cast<int>(env::parseInt(next(), s));
    else if (s == "--max-bytes") a.max_bytes = env::parseSize(next(), s);
    else if (s == "--iters") a.iters = static_cast<int>(env::parseInt(next(), s));
    else if (s == "-h" || s == "--help") { usage(); std::exit(0); }
    else throw InvalidArgument(fmt::format("unknown option {}; see --help", s));
  }
  if (a.nranks < 2) throw InvalidArgument("--nranks must be at least 2");
  if (a.ranks_per_node < 1) throw InvalidArgument("--ranks-per-node must be at least 1");
  return a;
}

double pingPongSeconds(Communicator& c, int peer, std::vector<char>& buf, size_t bytes, int iters) {
  // Rank 0 and `peer` bounce `bytes` back and forth; one-way time per message.
  auto run = [&](int n) {
    for (int i = 0; i < n; ++i) {
      if (c.rank() == 0) {
        c.send(buf.data(), bytes, peer, 1);
        c.recv(buf.data(), bytes, peer, 2);
      } else {
        c.recv(buf.data(), bytes, 0, 1);
        c.send(buf.data(), bytes, 0, 2);
      }
    }
  };
  // Warm up until the transports' buffers have been through once (an shm ring is 4 MiB
  // by default): first-touch page faults are a start-up cost, not the steady state a
  // ping-pong reports (on a VM that backs guest memory lazily, 2-3 us per 4 KiB page).
  run(static_cast<int>(std::clamp<size_t>((8u << 20) / std::max<size_t>(bytes, 1), 2, 1000)));
  auto t0 = Clock::now();
  run(iters);
  return std::chrono::duration<double>(Clock::now() - t0).count() / (2.0 * iters);
}

int rankMain(const Args& a, int rank, int size, std::shared_ptr<Store> store) {
  CommOptions opts;
  opts.ranks_per_node = a.ranks_per_node;
  auto world = Communicator::create(store, rank, size, opts);
  if (rank == 0) {
    fmt::print("# crossbar-demo: {} ranks in {} virtual node(s) of {} on host {}\n", size, world->numNodes(),
               a.ranks_per_node, world->host(0));
  }
  world->barrier();
  fmt::print("#   {}\n", world->describe());
  std::fflush(stdout);
  world->barrier();

  // Ring exchange with verifiable data: every rank sends its pattern to the next.
  const size_t ring_bytes = 1 << 20;
  std::vector<uint32_t> out(ring_bytes / 4), in(ring_bytes / 4);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint32_t>(rank * 2654435761u + i);
  int next = (rank + 1) % size, prev = (rank - 1 + size) % size;
  auto r = world->irecv(in.data(), ring_bytes, prev, 7);
  auto s = world->isend(out.data(), ring_bytes, next, 7);
  world->waitAll({r, s}, world->defaultDeadline());
  size_t wrong = 0;
  for (size_t i = 0; i < in.size(); ++i) wrong += in[i] != static_cast<uint32_t>(prev * 2654435761u + i);
  if (wrong) fmt::print(stderr, "rank {}: ring exchange: {} wrong words from rank {}\n", rank, wrong, prev);
  world->barrier();
  if (rank == 0) fmt::print("# ring exchange of 1 MiB per rank: {}\n", wrong ? "WRONG" : "ok");

  // Ping-pong from rank 0 to one peer per transport: the first peer in rank 0's
  // (virtual) node and the first one outside it. Every rank computes the same list.
  std::vector<int> targets;
  int same = -1, other = -1;
  for (int p = 1; p < size; ++p) {
    if (world->nodeOf(p) == world->nodeOf(0)) {
      if (same < 0) same = p;
    } else if (other < 0) {
      other = p;
    }
  }
  for (int p : {same, other})
    if (p > 0) targets.push_back(p);
  std::vector<char> buf(a.max_bytes);
  std::memset(buf.data(), 1, buf.size());
  for (int peer : targets) {
    if (rank == 0)
      fmt::print("#\n# ping-pong rank 0 <-> rank {} over {}\n# {:>12} {:>12} {:>12}\n", peer,
                 world->context().transportName(world->worldRank(peer)), "size(B)", "time(us)", "bw(GB/s)");
    for (size_t bytes = 8; bytes <= a.max_bytes; bytes *= 8) {
      if (rank == 0 || rank == peer) {
        int iters = bytes >= (1u << 20) ? std::max(3, a.iters / 4) : a.iters * 5;
        double sec = pingPongSeconds(*world, peer, buf, bytes, iters);
        if (rank == 0) fmt::print("  {:>12} {:>12.2f} {:>12.3f}\n", bytes, sec * 1e6, bytes / sec / 1e9);
      }
    }
    std::fflush(stdout);
    world->barrier();
  }
  world->destroy();
  return wrong ? 2 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a = parse(argc, argv);
    auto exits = launchLocalRanks(a.nranks, [&](int rank, int size, std::shared_ptr<Store> store) {
      return rankMain(a, rank, size, std::move(store));
    });
    int code = combinedExitCode(exits);
    std::printf("# %s\n", code == 0 ? "demo finished: all ranks ok" : "demo FAILED");
    return code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "crossbar-demo: %s\n", e.what());
    return 1;
  }
}
