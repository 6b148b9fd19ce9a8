// --mem cuda in a build without the CUDA collectives: a clear refusal.
#include "comm/errors.h"
#include "crossbar_build_info.h"
#include "perf/backend.h"

namespace crossbar::perf {

std::string cudaUnavailableReason() {
  return CROSSBAR_CUDA_ENABLED
             ? "this crossbar was built without the CUDA collectives (collectives/cuda missing from the "
               "build)"
             : "this crossbar was built without CUDA (CROSSBAR_WITH_CUDA=OFF or no CUDA toolkit found)";
}

std::unique_ptr<RunBackend> makeCudaBackend(std::shared_ptr<Communicator>, const Options&) {
  throw InvalidUsage("perf: --mem cuda: " + cudaUnavailableReason());
}

}  // namespace crossbar::perf
