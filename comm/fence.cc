#include "comm/fence.h"

#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#include "comm/env.h"
#include "comm/log.h"

namespace crossbar::fence {
namespace {

long membarrier(int cmd) {
  return ::syscall(__NR_membarrier, cmd, 0, 0);
}

// Whether this kernel lets any process run the expedited global barrier.
bool kernelHasExpedited() {
  static const bool has = [] {
    const long supported = membarrier(MEMBARRIER_CMD_QUERY);
    const long need = MEMBARRIER_CMD_GLOBAL_EXPEDITED | MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED;
    return supported >= 0 && (supported & need) == need;
  }();
  return has;
}

bool registerExpedited() {
  if (!env::getBool("CROSSBAR_ASYMMETRIC_FENCE")) return false;
  if (!kernelHasExpedited()) {
    CB_INFO("fence", "asymmetric fences off: no expedited global membarrier in this kernel (full fences instead)");
    return false;
  }
  if (membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED) != 0) {
    CB_INFO("fence", "asymmetric fences off: membarrier registration failed (full fences instead)");
    return false;
  }
  // Stores this thread made before it took the light side are drained here.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  return true;
}

}  // namespace

bool asymmetric() {
  static const bool on = registerExpedited();
  return on;
}

void heavy() {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (!kernelHasExpedited()) return;
  if (membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) != 0) {
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true))
      CB_WARN("fence", "membarrier(GLOBAL_EXPEDITED) failed: a peer's wake-up may wait for the end of a sleep slice");
  }
}

}  // namespace crossbar::fence
