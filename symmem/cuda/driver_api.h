// CUDA driver entry points, resolved lazily through the runtime
// (cudaGetDriverEntryPointByVersion) so that crossbar links libcudart only and
// loads on machines without a GPU or driver. <cuda.h> is included for types only.
//
// Error policy: a missing driver/device or a feature the device lacks raises
// crossbar::Unsupported; a driver/runtime call that fails raises crossbar::CudaError
// naming the call, the CUresult name and text, the device, and what to do.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

namespace crossbar::cuda {

// The subset of the driver API crossbar uses. Every pointer is non-null once
// driver() returns (required entries) unless noted "optional".
struct DriverApi {
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice) = nullptr;

  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemExportToShareableHandle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                           unsigned long long) = nullptr;
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*,
                                             CUmemAllocationHandleType) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*,
                                            CUmemAllocationGranularity_flags) = nullptr;

  CUresult (*cuStreamWriteValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*cuStreamWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*cuStreamWaitValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*cuStreamWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;

  // Optional (CUDA >= 12.1 drivers): multicast objects.
  CUresult (*cuMulticastCreate)(CUmemGenericAllocationHandle*, const CUmulticastObjectProp*) = nullptr;
  CUresult (*cuMulticastAddDevice)(CUmemGenericAllocationHandle, CUdevice) = nullptr;
  CUresult (*cuMulticastBindMem)(CUmemGenericAllocationHandle, size_t, CUmemGenericAllocationHandle, size_t,
                                 size_t, unsigned long long) = nullptr;
  CUresult (*cuMulticastUnbind)(CUmemGenericAllocationHandle, CUdevice, size_t, size_t) = nullptr;
  CUresult (*cuMulticastGetGranularity)(size_t*, const CUmulticastObjectProp*,
                                        CUmulticastGranularity_flags) = nullptr;
};

// True when a CUDA driver, at least one device and every required entry point
// are present. Never throws; the probe runs once (it initializes the CUDA runtime,
// so in a process that will fork() CUDA users, call it in the children only).
bool driverAvailable();

// Why driverAvailable() is false ("" when it is true); suitable for GTEST_SKIP.
const std::string& driverUnavailableReason();

// The resolved table. Throws Unsupported naming `operation` when no driver/device.
const DriverApi& driver(std::string_view operation);

// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)"; works without a driver (falls back to the number).
std::string cuResultText(CUresult result);

// Throw CudaError when `result` is not success: "<context>cuMemMap (device 0, ...): <name> (<text>). <hint>".
void checkCu(CUresult result, std::string_view call, int device, std::string_view hint = {});
void checkCuda(cudaError_t error, std::string_view call, int device, std::string_view hint = {});

// cudaSetDevice + runtime init so driver calls find the primary context current.
// Throws Unsupported without a driver, InvalidArgument for a bad ordinal.
void ensureContext(int device, std::string_view operation);

// Number of visible devices (0 without a driver).
int deviceCount();

// Reads a device attribute; `fallback` when the driver does not know it.
int deviceAttribute(int device, CUdevice_attribute attribute, int fallback = 0);

}  // namespace crossbar::cuda
