// Two virtual nodes as Linux network namespaces joined by a veth pair, for cutting a
// real link under running ranks. Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and `ip`;
// create() says why not when it cannot, so the test can skip.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <memory>
#include <string>

namespace crossbar::testing {

class NetnsPair {
 public:
  // Namespaces "cbft<pid>a" / "cbft<pid>b", veth ends of the same names (at most 15
  // characters), 10.213.0.1/30 and .2/30. Namespaces left by dead test processes are
  // removed first.
  static std::unique_ptr<NetnsPair> create(std::string* why_not) {
    removeStale();
    std::unique_ptr<NetnsPair> p(new NetnsPair());
    const int pid = static_cast<int>(::getpid());
    for (int i = 0; i < 2; ++i) {
      p->ns[i] = fmt::format("cbft{}{}", pid, i == 0 ? 'a' : 'b');
      p->dev[i] = p->ns[i];
      p->ip[i] = fmt::format("10.213.0.{}", i + 1);
    }
    const std::string steps[] = {
        fmt::format("ip netns add {}", p->ns[0]),
        fmt::format("ip netns add {}", p->ns[1]),
        fmt::format("ip link add {} type veth peer name {}", p->dev[0], p->dev[1]),
        fmt::format("ip link set {} netns {}", p->dev[0], p->ns[0]),
        fmt::format("ip link set {} netns {}", p->dev[1], p->ns[1]),
        fmt::format("ip -n {} addr add {}/30 dev {}", p->ns[0], p->ip[0], p->dev[0]),
        fmt::format("ip -n {} addr add {}/30 dev {}", p->ns[1], p->ip[1], p->dev[1]),
        fmt::format("ip -n {} link set lo up", p->ns[0]),
        fmt::format("ip -n {} link set lo up", p->ns[1]),
        fmt::format("ip -n {} link set {} up", p->ns[0], p->dev[0]),
        fmt::format("ip -n {} link set {} up", p->ns[1], p->dev[1]),
    };
    p->created_ = true;
    for (const auto& cmd : steps) {
      std::string out;
      if (!run(cmd, &out)) {
        *why_not = fmt::format("`{}` failed ({}); network namespaces need root with CAP_NET_ADMIN", cmd, out);
        return nullptr;  // the destructor removes what was made
      }
    }
    std::string out;
    if (!p->waitCarrier(&out)) {
      *why_not = out;
      return nullptr;
    }
    return p;
  }

  ~NetnsPair() {
    if (!created_) return;
    std::string out;
    for (auto& n : ns) run(fmt::format("ip netns del {}", n), &out);  // the veth goes with them
    run(fmt::format("ip link del {}", dev[0]), &out);                 // unless it never moved
  }

  // Link state of node 0's end (the peer end loses carrier with it).
  bool setLink(bool up, std::string* out) const {
    if (!run(fmt::format("ip -n {} link set {} {}", ns[0], dev[0], up ? "up" : "down"), out)) return false;
    return !up || waitCarrier(out);
  }

  // Until both ends are operationally up ("state UP": IFF_RUNNING, set by the kernel's
  // linkwatch, which may lag the carrier by up to a second), at most 5 s: UCX lists a
  // device that is not running as unavailable ("network device ... is not available",
  // UCS_ERR_NO_DEVICE), which a rank starting right after `link set up` ran into.
  bool waitCarrier(std::string* out) const {
    for (int i = 0; i < 250; ++i) {
      bool up = true;
      for (int k = 0; k < 2 && up; ++k)
        up = run(fmt::format("ip -n {} link show dev {}", ns[k], dev[k]), out) &&
             out->find("LOWER_UP") != std::string::npos && out->find("state UP") != std::string::npos;
      if (up) return true;
      ::usleep(20'000);
    }
    *out = fmt::format("the veth pair {} / {} is not up 5 s after `link set up`: {}", dev[0], dev[1], *out);
    return false;
  }

  // Moves this (single-threaded) process into namespace `name`, like `ip netns exec`:
  // a private mount namespace with /sys remounted, since UCX lists network devices
  // from /sys/class/net. Sockets opened before keep their namespace: that is how
  // ranks keep their store connections outside the cut (a management network apart
  // from the data link).
  static bool enter(const std::string& name, std::string* err) {
    int fd = ::open(fmt::format("/run/netns/{}", name).c_str(), O_RDONLY | O_CLOEXEC);
    auto fail = [&](const char* what) {
      *err = fmt::format("entering network namespace {}: {} failed: errno {}", name, what, errno);
      if (fd >= 0) ::close(fd);
      return false;
    };
    if (fd < 0) return fail("open");
    if (::setns(fd, CLONE_NEWNET) != 0) return fail("setns");
    if (::unshare(CLONE_NEWNS) != 0) return fail("unshare(CLONE_NEWNS)");
    if (::mount("none", "/", nullptr, MS_REC | MS_SLAVE, nullptr) != 0) return fail("mount --make-rslave /");
    ::umount2("/sys", MNT_DETACH);
    if (::mount(name.c_str(), "/sys", "sysfs", 0, nullptr) != 0) return fail("mount sysfs");
    ::close(fd);
    return true;
  }

  std::array<std::string, 2> ns, dev, ip;

 private:
  NetnsPair() = default;

  static bool run(const std::string& cmd, std::string* out) {
    out->clear();
    FILE* f = ::popen((cmd + " 2>&1").c_str(), "r");
    if (!f) return false;
    char buf[256];
    while (std::fgets(buf, sizeof(buf), f)) *out += buf;
    while (!out->empty() && out->back() == '\n') out->pop_back();
    return ::pclose(f) == 0;
  }

  // cbft<pid>a / cbft<pid>b of test processes that no longer run.
  static void removeStale() {
    DIR* d = ::opendir("/run/netns");
    if (!d) return;
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.size() < 6 || name.rfind("cbft", 0) != 0 || (name.back() != 'a' && name.back() != 'b'))
        continue;
      std::string digits = name.substr(4, name.size() - 5);
      if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
      if (::kill(std::stoi(digits), 0) == 0 || errno != ESRCH) continue;
      std::string out;
      run(fmt::format("ip netns del {}", name), &out);
    }
    ::closedir(d);
  }

  bool created_ = false;
};

}  // namespace crossbar::testing
