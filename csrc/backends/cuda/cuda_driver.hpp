// The few CUDA driver API entry points steptrace uses, declared here (no cuda.h needed
// to build) and resolved at run time from the libcuda already loaded in the process, or
// loaded with dlopen.
#pragma once

#include <cstdint>
#include <string>

namespace steptrace::detail::cuda {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUevent = struct CUevent_st*;
using CUstream = struct CUstream_st*;

inline constexpr CUresult kSuccess = 0;
inline constexpr CUresult kNotReady = 600;
// cuStreamIsCapturing on the legacy stream while a blocking stream is capturing.
inline constexpr CUresult kStreamCaptureImplicit = 906;

// CUstreamCaptureStatus and CUstreamCaptureMode (cuda.h).
inline constexpr int kCaptureStatusNone = 0;
inline constexpr int kCaptureModeRelaxed = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED

struct Driver {
  CUresult (*cuInit)(unsigned int) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxGetDevice)(CUdevice*) = nullptr;
  CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;  // _v2 through cuGetProcAddress
  CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuStreamGetCtx)(CUstream, CUcontext*) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceTotalMem)(std::size_t*, CUdevice) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned int) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventQuery)(CUevent) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuStreamIsCapturing)(CUstream, int*) = nullptr;      // CUstreamCaptureStatus*
  CUresult (*cuThreadExchangeStreamCaptureMode)(int*) = nullptr;  // CUstreamCaptureMode*
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  int version = 0;  // e.g. 12040 or 13000

  /// Loads the driver and resolves every entry point; false with `why` when it cannot.
  bool load(std::string* why);
  /// "CUDA_ERROR_NOT_READY (600)" and the like.
  std::string error_name(CUresult r) const;
};

}  // namespace steptrace::detail::cuda
