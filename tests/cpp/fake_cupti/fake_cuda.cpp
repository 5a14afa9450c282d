// The libcuda half of the range-profiler fake (fake_profiler.hpp): the entry points
// cuda::Driver resolves, through cuGetProcAddress_v2, and a current context the test sets.
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "fake_profiler.hpp"

namespace {
std::atomic<void*> g_ctx{nullptr};
std::atomic<int> g_device{0};
std::atomic<int> g_device_count{8};
}  // namespace

extern "C" {

using CUresult = int;
CUresult cuInit(unsigned int) { return 0; }
CUresult cuDriverGetVersion(int* v) {
  *v = 13000;
  return 0;
}
void fake_cuda_set_current(void* ctx, int device) {
  g_ctx.store(ctx);
  g_device.store(device);
}
void* fake_cuda_current() { return g_ctx.load(); }
void fake_cuda_set_device_count(int n) { g_device_count.store(n); }

CUresult cuDeviceGetCount(int* n) {
  *n = g_device_count.load();
  return 0;
}

CUresult cuCtxGetCurrent(void** ctx) {
  *ctx = g_ctx.load();
  return 0;
}
CUresult cuCtxGetDevice(int* dev) {
  if (g_ctx.load() == nullptr) return 201;  // CUDA_ERROR_INVALID_CONTEXT
  *dev = g_device.load();
  return 0;
}
CUresult cuDeviceGetName(char* name, int len, int) {
  std::strncpy(name, "Fake H200", static_cast<std::size_t>(len));
  return 0;
}
CUresult cuDeviceTotalMem(std::size_t* bytes, int) {
  *bytes = 0;
  return 0;
}
CUresult cuEventCreate(void**, unsigned int) { return 999; }
CUresult cuEventRecord(void*, void*) { return 999; }
CUresult cuEventQuery(void*) { return 999; }
CUresult cuEventSynchronize(void*) { return 999; }
CUresult cuEventElapsedTime(float*, void*, void*) { return 999; }
CUresult cuEventDestroy(void*) { return 999; }
CUresult cuGetErrorName(CUresult, const char** name) {
  *name = "CUDA_ERROR_FAKE";
  return 0;
}
CUresult cuGetProcAddress_v2(const char* symbol, void** fn, int, std::uint64_t, int* status) {
  *fn = dlsym(RTLD_DEFAULT, symbol);
  if (status != nullptr) *status = *fn != nullptr ? 0 : 1;
  return *fn != nullptr ? 0 : 500;  // CUDA_ERROR_NOT_FOUND
}

}  // extern "C"
