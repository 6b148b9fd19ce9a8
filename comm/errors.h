// Typed errors. Messages name the rank, host, operation and peers involved,
// and say what to do; use errorContext() to build the prefix.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace crossbar {

enum class ErrorCode {
  kInvalidArgument,  // bad input from the caller
  kInvalidUsage,     // API misuse, or ranks disagree about a call
  kTimeout,          // a deadline passed; peers() never arrived
  kPeerFailure,      // peers() died or hung up
  kAborted,          // the communicator was aborted / revoked
  kUnsupported,      // valid request this build or algorithm cannot do
  kSystemError,      // an OS call failed
  kCudaError,
  kNcclError,
  kUcxError,
  kInternal,         // a crossbar bug
};

const char* errorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message, std::vector<int> peers = {})
      : std::runtime_error(message), code_(code), peers_(std::move(peers)) {}
  ErrorCode code() const { return code_; }
  // Ranks (in the communicator of the failed operation) this error is about.
  const std::vector<int>& peers() const { return peers_; }

 private:
  ErrorCode code_;
  std::vector<int> peers_;
};

#define CROSSBAR_DEFINE_ERROR(Name, Code)                                                   \
  class Name : public Error {                                                               \
   public:                                                                                  \
    explicit Name(const std::string& message, std::vector<int> peers = {})                  \
        : Error(ErrorCode::Code, message, std::move(peers)) {}                              \
  };
CROSSBAR_DEFINE_ERROR(InvalidArgument, kInvalidArgument)
CROSSBAR_DEFINE_ERROR(InvalidUsage, kInvalidUsage)
CROSSBAR_DEFINE_ERROR(Timeout, kTimeout)
CROSSBAR_DEFINE_ERROR(PeerFailure, kPeerFailure)
CROSSBAR_DEFINE_ERROR(Aborted, kAborted)
CROSSBAR_DEFINE_ERROR(Unsupported, kUnsupported)
CROSSBAR_DEFINE_ERROR(SystemError, kSystemError)
CROSSBAR_DEFINE_ERROR(CudaError, kCudaError)
CROSSBAR_DEFINE_ERROR(NcclError, kNcclError)
CROSSBAR_DEFINE_ERROR(UcxError, kUcxError)
CROSSBAR_DEFINE_ERROR(InternalError, kInternal)
#undef CROSSBAR_DEFINE_ERROR

// "rank 3 (host node7, pid 1234) allreduce: " -- rank < 0 omits the rank.
std::string errorContext(int rank, std::string_view operation);

// "ranks 1 (host a), 5 (host b)" style list; hosts optional.
std::string formatPeers(const std::vector<int>& peers, const std::vector<std::string>& hosts = {});

// Throws SystemError naming the operation and strerror(errno_value).
[[noreturn]] void throwSystemError(int rank, std::string_view operation, int errno_value,
                                   std::string_view hint = {});

// This machine's host name (cached).
const std::string& hostName();

}  // namespace crossbar
