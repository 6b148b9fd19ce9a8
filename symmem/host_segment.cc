// Host backend of the symmetric heap: memfd segments (comm/shm_segment.h). memfd
// has no name in any file system, so a crashed process leaves nothing behind, and
// a mapping keeps the memory alive after the owner unmapped it or died (peers that
// still map a freed buffer never fault). Segments are sealed against shrinking.
#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"
#include "comm/shm_segment.h"
#include "symmem/segment_allocator.h"

namespace crossbar::symm {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr int kMpolPreferred = 1;  // <numaif.h> MPOL_PREFERRED, without requiring libnuma headers

// Best effort: prefer the NUMA node this thread runs on for [p, p+bytes).
void preferLocalNode(void* p, size_t bytes) {
  unsigned cpu = 0, node = 0;
  if (syscall(SYS_getcpu, &cpu, &node, nullptr) != 0 || node >= 64) return;
  unsigned long mask = 1ul << node;
  if (syscall(SYS_mbind, p, bytes, kMpolPreferred, &mask, 64ul, 0u) != 0)
    CB_TRACE("symmem", "mbind to NUMA node {} failed ({}); relying on first touch", node,
             std::strerror(errno));
}

class HostSegment : public Segment {
 public:
  explicit HostSegment(ShmSegment seg, bool own) : seg_(std::move(seg)), own_(own) {}
  void* ptr() const override { return seg_.data(); }
  size_t size() const override { return seg_.size(); }
  int exportFd() const override {
    if (seg_.fd() < 0) return -1;
    return ::fcntl(seg_.fd(), F_DUPFD_CLOEXEC, 0);
  }
  void exportDone() override { seg_.closeFd(); }
  std::string describe() const override {
    return fmt::format("memfd {} bytes{}{}", seg_.size(), seg_.hugePages() ? " (2 MiB pages)" : "",
                       own_ ? "" : " (peer)");
  }

 private:
  ShmSegment seg_;
  bool own_;
};

class HostSegmentAllocator : public SegmentAllocator {
 public:
  explicit HostSegmentAllocator(const HostSegmentOptions& o) : options_(o) {}
  const char* name() const override { return "host"; }
  MemoryKind kind() const override { return MemoryKind::kHost; }
  bool hostAccessible() const override { return true; }
  size_t granularity() const override { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

  std::unique_ptr<Segment> allocate(const SegmentRequest& request) override {
    ShmOptions so;
    so.name = request.name.empty() ? "crossbar-symm" : request.name;
    so.huge_pages = options_.huge_pages;
    so.populate = options_.populate && !options_.bind_numa;
    so.rank = request.rank;
    ShmSegment seg = ShmSegment::create(request.bytes, so);
    if (options_.populate && options_.bind_numa) {
      preferLocalNode(seg.data(), seg.size());
      // First touch by the owner, after the policy is set: pages land on its node.
      const size_t step = seg.hugePages() ? kHugePage : granularity();
      auto* base = static_cast<volatile char*>(seg.data());
      for (size_t off = 0; off < seg.size(); off += step) base[off] = 0;
    }
    return std::make_unique<HostSegment>(std::move(seg), true);
  }

  std::unique_ptr<Segment> import(int fd, std::span<const uint8_t>, size_t bytes, int rank) override {
    int mine = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mine < 0) throwSystemError(rank, "dup of a peer's symmetric-memory fd", errno);
    ShmOptions so;
    so.rank = rank;
    ShmSegment seg = ShmSegment::attach(mine, bytes, so);
    seg.closeFd();  // the mapping alone keeps the memory alive
    return std::make_unique<HostSegment>(std::move(seg), false);
  }

 private:
  HostSegmentOptions options_;
};

}  // namespace

std::unique_ptr<SegmentAllocator> makeHostSegmentAllocator(const HostSegmentOptions& options) {
  return std::make_unique<HostSegmentAllocator>(options);
}

std::unique_ptr<SegmentAllocator> makeHostSegmentAllocator() {
  HostSegmentOptions o;
  o.huge_pages = env::getBool("CROSSBAR_SYMMEM_HUGEPAGES");
  return makeHostSegmentAllocator(o);
}

}  // namespace crossbar::symm
