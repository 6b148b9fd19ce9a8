#include "symmem/cuda/driver_api.h"

#include <fmt/format.h>

#include <mutex>

#include "comm/errors.h"

namespace crossbar::cuda {
namespace {

struct Probe {
  bool available = false;
  std::string reason;
  int device_count = 0;
  DriverApi api;
};

// Resolves one symbol at the ABI `version` (the CUDA version whose signature
// DriverApi declares). Returns false when the driver lacks it.
template <typename Fn>
bool resolve(Fn*& out, const char* symbol, unsigned version, std::string* missing) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();  // do not leave a sticky-looking error for the caller
    if (missing) {
      if (!missing->empty()) *missing += ", ";
      *missing += symbol;
    }
    out = nullptr;
    return false;
  }
  out = reinterpret_cast<Fn*>(fn);
  return true;
}

Probe runProbe() {
  Probe p;
  int driver_version = 0;
  if (cudaDriverGetVersion(&driver_version) != cudaSuccess || driver_version == 0) {
    cudaGetLastError();
    p.reason =
        "no CUDA driver (libcuda.so not loadable); run on a machine with an NVIDIA GPU and driver, "
        "or use the host (CPU) backend";
    return p;
  }
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    p.reason = fmt::format(
        "no usable CUDA device (driver {}.{}, cudaGetDeviceCount: {}); check "
        "CUDA_VISIBLE_DEVICES and nvidia-smi, or use the host (CPU) backend",
        driver_version / 1000, (driver_version % 1000) / 10,
        err == cudaSuccess ? "0 devices" : cudaGetErrorString(err));
    return p;
  }
  p.device_count = count;
  // ABI of CUDA 12.0 for everything (the v2 stream memory operations); multicast needs 12.1.
  std::string missing;
  DriverApi& a = p.api;
  resolve(a.cuGetErrorName, "cuGetErrorName", 12000, &missing);
  resolve(a.cuGetErrorString, "cuGetErrorString", 12000, &missing);
  resolve(a.cuDeviceGet, "cuDeviceGet", 12000, &missing);
  resolve(a.cuDeviceGetAttribute, "cuDeviceGetAttribute", 12000, &missing);
  resolve(a.cuMemCreate, "cuMemCreate", 12000, &missing);
  resolve(a.cuMemRelease, "cuMemRelease", 12000, &missing);
  resolve(a.cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 12000, &missing);
  resolve(a.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", 12000, &missing);
  resolve(a.cuMemAddressReserve, "cuMemAddressReserve", 12000, &missing);
  resolve(a.cuMemAddressFree, "cuMemAddressFree", 12000, &missing);
  resolve(a.cuMemMap, "cuMemMap", 12000, &missing);
  resolve(a.cuMemUnmap, "cuMemUnmap", 12000, &missing);
  resolve(a.cuMemSetAccess, "cuMemSetAccess", 12000, &missing);
  resolve(a.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", 12000, &missing);
  resolve(a.cuStreamWriteValue32, "cuStreamWriteValue32", 12000, &missing);
  resolve(a.cuStreamWriteValue64, "cuStreamWriteValue64", 12000, &missing);
  resolve(a.cuStreamWaitValue32, "cuStreamWaitValue32", 12000, &missing);
  resolve(a.cuStreamWaitValue64, "cuStreamWaitValue64", 12000, &missing);
  // Optional: absence only disables multicast.
  resolve(a.cuMulticastCreate, "cuMulticastCreate", 12010, nullptr);
  resolve(a.cuMulticastAddDevice, "cuMulticastAddDevice", 12010, nullptr);
  resolve(a.cuMulticastBindMem, "cuMulticastBindMem", 12010, nullptr);
  resolve(a.cuMulticastUnbind, "cuMulticastUnbind", 12010, nullptr);
  resolve(a.cuMulticastGetGranularity, "cuMulticastGetGranularity", 12010, nullptr);
  if (!missing.empty()) {
    p.reason = fmt::format("the CUDA driver ({}.{}) lacks entry points: {}; upgrade the NVIDIA driver",
                           driver_version / 1000, (driver_version % 1000) / 10, missing);
    p.api = DriverApi{};
    return p;
  }
  p.available = true;
  return p;
}

const Probe& probe() {
  static const Probe* p = [] {
    try {
      return new Probe(runProbe());  // leaked on purpose: usable during static destruction
    } catch (...) {
      auto* q = new Probe();
      q->reason = "CUDA probe failed unexpectedly";
      return q;
    }
  }();
  return *p;
}

}  // namespace

bool driverAvailable() {
  return probe().available;
}

const std::string& driverUnavailableReason() {
  return probe().reason;
}

const DriverApi& driver(std::string_view operation) {
  const Probe& p = probe();
  if (!p.available) throw Unsupported(errorContext(-1, operation) + p.reason);
  return p.api;
}

int deviceCount() {
  return probe().device_count;
}

std::string cuResultText(CUresult result) {
  const Probe& p = probe();
  const char* name = nullptr;
  const char* text = nullptr;
  if (p.available) {
    p.api.cuGetErrorName(result, &name);
    p.api.cuGetErrorString(result, &text);
  }
  if (!name) return fmt::format("CUresult {}", static_cast<int>(result));
  return fmt::format("{} ({})", name, text ? text : "no description");
}

namespace {
std::string defaultHint(bool oom) {
  return oom ? "Free GPU memory (other processes? see nvidia-smi) or reduce the buffer size"
             : "Check that the device is healthy (nvidia-smi) and that CROSSBAR_DEBUG=INFO logs show the "
               "preceding calls; report a bug if it persists";
}
}  // namespace

void checkCu(CUresult result, std::string_view call, int device, std::string_view hint) {
  if (result == CUDA_SUCCESS) return;
  std::string msg =
      fmt::format("{}device {}: {}. {}", errorContext(-1, call), device, cuResultText(result),
                  hint.empty() ? defaultHint(result == CUDA_ERROR_OUT_OF_MEMORY) : std::string(hint));
  throw CudaError(msg);
}

void checkCuda(cudaError_t error, std::string_view call, int device, std::string_view hint) {
  if (error == cudaSuccess) return;
  cudaGetLastError();  // clear non-sticky errors so the next call is not blamed
  std::string msg =
      fmt::format("{}device {}: {} ({}). {}", errorContext(-1, call), device, cudaGetErrorName(error),
                  cudaGetErrorString(error),
                  hint.empty() ? defaultHint(error == cudaErrorMemoryAllocation) : std::string(hint));
  throw CudaError(msg);
}

void ensureContext(int device, std::string_view operation) {
  const Probe& p = probe();
  if (!p.available) throw Unsupported(errorContext(-1, operation) + p.reason);
  if (device < 0 || device >= p.device_count) {
    throw InvalidArgument(
        fmt::format("{}device ordinal {} is out of range: {} device(s) visible. Pass an "
                    "ordinal below {} (check CUDA_VISIBLE_DEVICES)",
                    errorContext(-1, operation), device, p.device_count, p.device_count));
  }
  checkCuda(cudaSetDevice(device), "cudaSetDevice", device);
  checkCuda(cudaFree(nullptr), "cudaFree(nullptr) (runtime init)", device);
}

int deviceAttribute(int device, CUdevice_attribute attribute, int fallback) {
  const Probe& p = probe();
  if (!p.available || device < 0 || device >= p.device_count) return fallback;
  CUdevice dev = 0;
  if (p.api.cuDeviceGet(&dev, device) != CUDA_SUCCESS) return fallback;
  int value = 0;
  if (p.api.cuDeviceGetAttribute(&value, attribute, dev) != CUDA_SUCCESS) return fallback;
  return value;
}

}  // namespace crossbar::cuda
