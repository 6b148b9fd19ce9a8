// SymmDeviceHandle: a plain struct describing one symmetric buffer as seen by one
// rank, passed by value to kernels (MSCCL++ DeviceHandle style). Host code fills it
// from mapped peer allocations; the inline helpers below are the device side of
// put / signal / wait. Compiles as plain C++ (no CUDA) so host code can include it.
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define CROSSBAR_HD __host__ __device__
#define CROSSBAR_DEVICE __device__
#else
#define CROSSBAR_HD
#define CROSSBAR_DEVICE
#endif

namespace crossbar::cuda {

// Local ranks (GPUs in one NVLink domain node) a handle can address.
inline constexpr int kMaxLocalRanks = 8;

struct SymmDeviceHandle {
  // peer_ptrs[r]: rank r's buffer mapped in this process (peer_ptrs[rank] is our own).
  void* peer_ptrs[kMaxLocalRanks];
  // signal_pads[r]: rank r's signal pad mapped here; slot [s * signal_stride] of pad r is
  // written by rank s only (so no two writers share a word) and read by rank r.
  uint64_t* signal_pads[kMaxLocalRanks];
  // Set to 1 by waitSignal() on timeout; device or mapped host memory, may be null.
  unsigned int* timeout_flag;
  int rank;
  int local_size;
  size_t size;  // bytes of every rank's buffer
  // uint64 words between consecutive slots of a pad: 1 for packed pads, 2 for the
  // symmetric heap's 16-byte slots (makeDeviceHandle, symmem/cuda/cuda_symmetric.h).
  int signal_stride = 1;

  template <typename T>
  CROSSBAR_HD T* peer(int r, size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(peer_ptrs[r]) + byte_offset);
  }
  // Where this rank signals peer `to` / reads what peer `from` signaled.
  CROSSBAR_HD uint64_t* outboxSlot(int to) const { return signal_pads[to] + rank * signal_stride; }
  CROSSBAR_HD uint64_t* inboxSlot(int from) const { return signal_pads[rank] + from * signal_stride; }

#if defined(__CUDACC__)
  // --- device side: call from one thread after the data writes of the block are
  // complete (e.g. after __syncthreads()).

  // Publishes `value` to peer `to` with release semantics at system scope: the
  // peer's acquire load that sees it also sees every write ordered before it.
  __device__ void putSignal(int to, uint64_t value) const {
    __threadfence_system();  // covers writes by other threads of the block seen through the barrier
    uint64_t* p = outboxSlot(to);
    asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(value) : "memory");
  }

  // Adds `delta` to peer `to`'s slot (several blocks each contribute one).
  __device__ void addSignal(int to, uint64_t delta) const {
    __threadfence_system();
    atomicAdd_system(reinterpret_cast<unsigned long long*>(outboxSlot(to)),
                     static_cast<unsigned long long>(delta));
  }

  __device__ static uint64_t loadAcquire(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
  }

  // Spins until peer `from`'s signal reaches `value` (>=). Returns false and sets
  // *timeout_flag after `timeout_cycles` SM clock cycles, so a dead peer never hangs
  // the kernel forever; the host turns the flag into crossbar::Timeout.
  __device__ bool waitSignal(int from, uint64_t value, long long timeout_cycles) const {
    const uint64_t* p = inboxSlot(from);
    const long long start = clock64();
    while (loadAcquire(p) < value) {
      if (clock64() - start > timeout_cycles) {
        if (timeout_flag) atomicExch(timeout_flag, 1u);
        return false;
      }
      __nanosleep(100);  // yield issue slots to co-resident blocks
    }
    return true;
  }
#endif
};

}  // namespace crossbar::cuda
