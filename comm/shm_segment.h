// ShmSegment: an anonymous shared-memory segment (memfd) mapped into this process.
// memfd has no name on any file system, so a killed process leaves nothing behind:
// the memory is freed when the last fd and mapping are gone. Other processes map
// it after receiving the fd over a Unix socket (comm/fd_exchange.h).
//
//   auto seg = ShmSegment::create(64 << 20, {.name = "rings"});
//   sendFds(conn, {seg.fd()});                      // peer: ShmSegment::attach(fd)
//
// Reused by the shm transport and the symmetric-memory layer.
#pragma once

#include <cstddef>
#include <string>

namespace crossbar {

struct ShmOptions {
  std::string name = "crossbar";  // shown in /proc/PID/maps (memfd:NAME)
  bool populate = false;          // MAP_POPULATE: fault every page in now (no page faults later)
  bool huge_pages = false;        // try MFD_HUGETLB (2 MiB pages); silently falls back to 4 KiB
  int rank = -1;                  // for error messages only
};

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment() { reset(); }
  ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Creates a zero-filled segment of at least `bytes` (rounded up to the page
  // size in use) and maps it read-write. Throws SystemError.
  static ShmSegment create(size_t bytes, const ShmOptions& options = {});
  // Maps a segment received from another process; takes ownership of `fd`.
  // `bytes` = 0 maps the whole segment (size from fstat).
  static ShmSegment attach(int fd, size_t bytes = 0, const ShmOptions& options = {});

  void* data() const { return data_; }
  template <typename T>
  T* as(size_t offset = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(data_) + offset);
  }
  size_t size() const { return size_; }
  int fd() const { return fd_; }  // owned by the segment; dup() it to keep it longer
  bool hugePages() const { return huge_; }
  bool valid() const { return data_ != nullptr; }

  // Unmaps and closes the fd.
  void reset();
  // Closes the fd but keeps the mapping (once every peer has its copy).
  void closeFd();

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
  bool huge_ = false;
};

}  // namespace crossbar
