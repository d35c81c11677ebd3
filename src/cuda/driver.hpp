// The CUDA driver API, loaded at run time (internal).
//
// stagelink builds, installs and passes every other test on machines without CUDA or a GPU: it
// never links libcuda. The first call that needs the driver opens libcuda.so.1 with dlopen and
// binds the few entry points the transports use; where there is no library, no device, or a
// driver that fails to start, driver() says why (Errc::unsupported), once, the same way every time.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"

namespace stagelink::cuda {

// The driver API's own types, as the ABI has them (cuda.h is not needed to build).
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
struct CUipcMemHandle {
  char reserved[64];
};
struct CUipcEventHandle {
  char reserved[64];
};
struct CUuuid {
  unsigned char bytes[16];
};

// Entry points, bound by name (the _v2 ones where the driver exports both).
struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDeviceGetUuid)(CUuuid*, CUdevice);
  CUresult (*cuDeviceTotalMem)(size_t*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemHostRegister)(void*, size_t, unsigned);
  CUresult (*cuMemHostUnregister)(void*);
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned);
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
  CUresult (*cuIpcGetEventHandle)(CUipcEventHandle*, CUevent);
  CUresult (*cuIpcOpenEventHandle)(CUevent*, CUipcEventHandle);
  CUresult (*cuPointerGetAttribute)(void*, int, CUdeviceptr);
  CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*cuDeviceCanAccessPeer)(int*, CUdevice, CUdevice);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  int version = 0;       // cuDriverGetVersion: 12040 is CUDA 12.4
  int device_count = 0;  // devices this process sees
};

// Flags and attributes the transports use (values of the driver ABI).
inline constexpr unsigned kEventBlockingSync = 0x1, kEventDisableTiming = 0x2, kEventInterprocess = 0x4;
inline constexpr unsigned kIpcLazyEnablePeerAccess = 0x1;
inline constexpr unsigned kHostRegisterPortable = 0x1;
inline constexpr unsigned kStreamNonBlocking = 0x1;
inline constexpr CUresult kSuccess = 0, kNotReady = 600;

// The driver, started (cuInit) and with at least one device; else unsupported, saying why. The
// first call loads it; later calls return the same answer.
Result<const Driver*> driver();

// `r` as an Error: "what: CUDA_ERROR_NAME (its text)"; ok for kSuccess.
Status check(CUresult r, const std::string& what);

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  std::string uuid;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it
  CUuuid raw{};      // the same, as the driver gives it
  size_t total_bytes = 0;
};
std::vector<DeviceInfo> devices();
std::string uuid_string(const CUuuid& u);

// For health(): {"available": bool, "reason": why not | "driver_version", "devices": [...]}.
Value status();

}  // namespace stagelink::cuda
