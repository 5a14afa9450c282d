#include "cuda_driver.hpp"

#include <dlfcn.h>

#include <fmt/format.h>

namespace steptrace::detail::cuda {
namespace {

// cuGetProcAddress_v2 (CUDA 12+): the symbol's ABI for a given CUDA version, which is
// how versioned entry points (cuEventDestroy_v2, cuEventElapsedTime_v2 in 13) are found.
using GetProcAddress = CUresult (*)(const char*, void**, int, std::uint64_t, int*);
constexpr int kAbiVersion = 12000;  // the oldest driver API steptrace supports

}  // namespace

bool Driver::load(std::string* why) {
  // RTLD_NOLOAD first: reuse the driver the process (torch) already loaded.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    *why = "libcuda.so.1 could not be loaded (no NVIDIA driver on this machine)";
    return false;
  }
  auto get_proc = reinterpret_cast<GetProcAddress>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    *why = "the NVIDIA driver is older than CUDA 12 (no cuGetProcAddress_v2)";
    return false;
  }
  bool ok = true;
  auto resolve = [&](auto& fn, const char* name) {
    void* p = nullptr;
    int status = 0;
    if (get_proc(name, &p, kAbiVersion, 0, &status) != kSuccess || p == nullptr) {
      if (ok) *why = fmt::format("the NVIDIA driver has no {}", name);
      ok = false;
      return;
    }
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  resolve(cuInit, "cuInit");
  resolve(cuDriverGetVersion, "cuDriverGetVersion");
  resolve(cuCtxGetCurrent, "cuCtxGetCurrent");
  resolve(cuCtxGetDevice, "cuCtxGetDevice");
  resolve(cuCtxPushCurrent, "cuCtxPushCurrent");
  resolve(cuCtxPopCurrent, "cuCtxPopCurrent");
  resolve(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  resolve(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease");
  resolve(cuStreamGetCtx, "cuStreamGetCtx");
  resolve(cuDeviceGetName, "cuDeviceGetName");
  resolve(cuDeviceTotalMem, "cuDeviceTotalMem");
  resolve(cuEventCreate, "cuEventCreate");
  resolve(cuEventRecord, "cuEventRecord");
  resolve(cuEventQuery, "cuEventQuery");
  resolve(cuEventSynchronize, "cuEventSynchronize");
  resolve(cuEventElapsedTime, "cuEventElapsedTime");
  resolve(cuEventDestroy, "cuEventDestroy");
  resolve(cuStreamIsCapturing, "cuStreamIsCapturing");  // both since CUDA 10.1
  resolve(cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode");
  resolve(cuGetErrorName, "cuGetErrorName");
  if (!ok) return false;
  const CUresult init = cuInit(0);
  if (init != kSuccess) {
    *why = fmt::format("cuInit failed: {}", error_name(init));
    return false;
  }
  cuDriverGetVersion(&version);
  return true;
}

std::string Driver::error_name(CUresult r) const {
  const char* name = nullptr;
  if (cuGetErrorName != nullptr && cuGetErrorName(r, &name) == kSuccess && name != nullptr) {
    return fmt::format("{} ({})", name, r);
  }
  return fmt::format("CUDA error {}", r);
}

}  // namespace steptrace::detail::cuda
