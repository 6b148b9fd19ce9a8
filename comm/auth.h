// Shared-secret authentication of store connections: SHA-256 and HMAC-SHA256 (FIPS 180-4,
// RFC 2104), written here so the store needs no crypto library, plus the job secret's
// lookup (CROSSBAR_SECRET, or the file CROSSBAR_SECRET_FILE; neither set: no auth).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace crossbar::auth {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  Sha256& update(const void* data, size_t size);
  Sha256& update(std::string_view s) { return update(s.data(), s.size()); }
  Digest finish();  // the object is spent afterwards

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

Digest sha256(std::string_view data);
Digest hmacSha256(std::string_view key, std::string_view message);
std::string toHex(const Digest& d);

// Compares without early exit, so timing does not reveal how many bytes matched.
bool constantTimeEqual(const void* a, const void* b, size_t size);

// `size` bytes from the kernel's CSPRNG (getrandom); SystemError if unavailable.
std::string randomBytes(size_t size);

// The job secret: CROSSBAR_SECRET if set, else the contents of CROSSBAR_SECRET_FILE
// (one trailing newline dropped), else "" (authentication off). InvalidArgument if the
// file cannot be read or is empty.
std::string loadSecret();

}  // namespace crossbar::auth
