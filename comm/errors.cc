#include "comm/errors.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstring>

namespace crossbar {

const char* errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "InvalidArgument";
    case ErrorCode::kInvalidUsage: return "InvalidUsage";
    case ErrorCode::kTimeout: return "Timeout";
    case ErrorCode::kPeerFailure: return "PeerFailure";
    case ErrorCode::kAborted: return "Aborted";
    case ErrorCode::kUnsupported: return "Unsupported";
    case ErrorCode::kSystemError: return "SystemError";
    case ErrorCode::kCudaError: return "CudaError";
    case ErrorCode::kNcclError: return "NcclError";
    case ErrorCode::kUcxError: return "UcxError";
    case ErrorCode::kInternal: return "InternalError";
  }
  return "Error";
}

const std::string& hostName() {
  static const std::string name = [] {
    char buf[256] = {};
    if (gethostname(buf, sizeof(buf) - 1) != 0) return std::string("unknown-host");
    return std::string(buf);
  }();
  return name;
}

std::string errorContext(int rank, std::string_view operation) {
  if (rank < 0) return fmt::format("(host {}, pid {}) {}: ", hostName(), getpid(), operation);
  return fmt::format("rank {} (host {}, pid {}) {}: ", rank, hostName(), getpid(), operation);
}

std::string formatPeers(const std::vector<int>& peers, const std::vector<std::string>& hosts) {
  std::string out = peers.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < peers.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(peers[i]);
    if (i < hosts.size() && !hosts[i].empty()) out += fmt::format(" (host {})", hosts[i]);
  }
  return out;
}

void throwSystemError(int rank, std::string_view operation, int errno_value, std::string_view hint) {
  std::string msg = errorContext(rank, operation) + std::strerror(errno_value);
  if (!hint.empty()) msg += fmt::format(". {}", hint);
  throw SystemError(msg);
}

}  // namespace crossbar
