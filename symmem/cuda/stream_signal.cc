#include "symmem/cuda/stream_signal.h"

#include <fmt/format.h>

#include "comm/errors.h"
#include "symmem/cuda/driver_api.h"

namespace crossbar::cuda {
namespace {

int currentDevice() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return d;
}

void requireAddr(const void* addr, size_t align, std::string_view op) {
  if (addr == nullptr || reinterpret_cast<uintptr_t>(addr) % align != 0) {
    throw InvalidArgument(
        fmt::format("{}address {} must be non-null and {}-byte aligned", errorContext(-1, op), addr, align));
  }
}

unsigned waitFlags(WaitCond cond) {
  return cond == WaitCond::kEq ? CU_STREAM_WAIT_VALUE_EQ : CU_STREAM_WAIT_VALUE_GEQ;
}

constexpr std::string_view kHint =
    "The address must be device memory, a mapped peer allocation or cudaHostRegister'ed memory of this "
    "process, and the stream must belong to the current device";

}  // namespace

void streamWriteValue32(cudaStream_t stream, uint32_t* addr, uint32_t value) {
  constexpr std::string_view kOp = "streamWriteValue32";
  const DriverApi& api = driver(kOp);
  requireAddr(addr, 4, kOp);
  checkCu(api.cuStreamWriteValue32(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr),
                                   value, CU_STREAM_WRITE_VALUE_DEFAULT),
          fmt::format("cuStreamWriteValue32({}, {})", static_cast<void*>(addr), value), currentDevice(),
          kHint);
}

void streamWriteValue64(cudaStream_t stream, uint64_t* addr, uint64_t value) {
  constexpr std::string_view kOp = "streamWriteValue64";
  const DriverApi& api = driver(kOp);
  requireAddr(addr, 8, kOp);
  checkCu(api.cuStreamWriteValue64(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr),
                                   value, CU_STREAM_WRITE_VALUE_DEFAULT),
          fmt::format("cuStreamWriteValue64({}, {})", static_cast<void*>(addr), value), currentDevice(),
          kHint);
}

void streamWaitValue32(cudaStream_t stream, const uint32_t* addr, uint32_t value, WaitCond cond) {
  constexpr std::string_view kOp = "streamWaitValue32";
  const DriverApi& api = driver(kOp);
  requireAddr(addr, 4, kOp);
  checkCu(api.cuStreamWaitValue32(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr),
                                  value, waitFlags(cond)),
          fmt::format("cuStreamWaitValue32({}, {})", static_cast<const void*>(addr), value), currentDevice(),
          kHint);
}

void streamWaitValue64(cudaStream_t stream, const uint64_t* addr, uint64_t value, WaitCond cond) {
  constexpr std::string_view kOp = "streamWaitValue64";
  const DriverApi& api = driver(kOp);
  requireAddr(addr, 8, kOp);
  checkCu(api.cuStreamWaitValue64(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr),
                                  value, waitFlags(cond)),
          fmt::format("cuStreamWaitValue64({}, {})", static_cast<const void*>(addr), value), currentDevice(),
          kHint);
}

bool streamMemOps64Supported(int device) {
  return deviceAttribute(device, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, 0) != 0;
}

}  // namespace crossbar::cuda
