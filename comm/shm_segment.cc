#include "comm/shm_segment.h"

#include <fcntl.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "comm/errors.h"
#include "comm/log.h"

#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004U
#endif

namespace crossbar {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

size_t roundUp(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}

size_t pageSize() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

// Maps `fd` shared; returns MAP_FAILED on error (errno set).
void* mapFd(int fd, size_t bytes, bool populate) {
  int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
  return ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, flags, fd, 0);
}

}  // namespace

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    fd_ = std::exchange(other.fd_, -1);
    huge_ = std::exchange(other.huge_, false);
  }
  return *this;
}

void ShmSegment::reset() {
  if (data_) ::munmap(data_, size_);
  closeFd();
  data_ = nullptr;
  size_ = 0;
  huge_ = false;
}

void ShmSegment::closeFd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

ShmSegment ShmSegment::create(size_t bytes, const ShmOptions& options) {
  if (bytes == 0) bytes = 1;
  ShmSegment seg;
  // Huge pages first when asked (fewer TLB misses on large buffers); they need a
  // reserved pool (vm.nr_hugepages), so any failure falls back to normal pages.
  if (options.huge_pages && bytes >= kHugePage) {
    int fd = ::memfd_create(options.name.c_str(), MFD_CLOEXEC | MFD_HUGETLB | MFD_ALLOW_SEALING);
    if (fd >= 0) {
      size_t size = roundUp(bytes, kHugePage);
      void* p = MAP_FAILED;
      if (::ftruncate(fd, static_cast<off_t>(size)) == 0) p = mapFd(fd, size, options.populate);
      if (p != MAP_FAILED) {
        seg.data_ = p;
        seg.size_ = size;
        seg.fd_ = fd;
        seg.huge_ = true;
      } else {
        CB_TRACE("shm", "huge-page segment '{}' of {} bytes unavailable ({}); using 4 KiB pages",
                 options.name, size, std::strerror(errno));
        ::close(fd);
      }
    }
  }
  if (!seg.valid()) {
    int fd = ::memfd_create(options.name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) throwSystemError(options.rank, "memfd_create for shared-memory segment", errno);
    size_t size = roundUp(bytes, pageSize());
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      int e = errno;
      ::close(fd);
      throwSystemError(options.rank,
                       fmt::format("sizing shared-memory segment '{}' to {} bytes", options.name, size), e,
                       "check available memory and RLIMIT_FSIZE");
    }
    void* p = mapFd(fd, size, options.populate);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      throwSystemError(options.rank,
                       fmt::format("mapping shared-memory segment '{}' of {} bytes", options.name, size), e,
                       "check available memory and the address-space limit (ulimit -v)");
    }
    seg.data_ = p;
    seg.size_ = size;
    seg.fd_ = fd;
  }
  // Fix the size so no process can shrink it under another's mapping (SIGBUS).
  (void)::fcntl(seg.fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  CB_TRACE("shm", "created segment '{}': {} bytes{}", options.name, seg.size_,
           seg.huge_ ? " (huge pages)" : "");
  return seg;
}

ShmSegment ShmSegment::attach(int fd, size_t bytes, const ShmOptions& options) {
  ShmSegment seg;
  seg.fd_ = fd;  // owned from here on, closed on any error
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    throwSystemError(options.rank, "fstat of a received shared-memory segment", errno);
  size_t whole = static_cast<size_t>(st.st_size);
  if (bytes == 0) bytes = whole;
  if (bytes > whole) {
    throw InvalidArgument(fmt::format("{}segment has {} bytes, {} were expected; the peer sent the wrong fd",
                                      errorContext(options.rank, "attaching shared-memory segment"), whole,
                                      bytes));
  }
  seg.huge_ = static_cast<size_t>(st.st_blksize) >= kHugePage;
  size_t map_bytes = roundUp(bytes, seg.huge_ ? static_cast<size_t>(st.st_blksize) : pageSize());
  if (map_bytes > whole) map_bytes = whole;
  void* p = mapFd(fd, map_bytes, options.populate);
  if (p == MAP_FAILED)
    throwSystemError(options.rank,
                     fmt::format("mapping a peer's shared-memory segment of {} bytes", map_bytes), errno,
                     "check the address-space limit (ulimit -v)");
  seg.data_ = p;
  seg.size_ = map_bytes;
  return seg;
}

}  // namespace crossbar
