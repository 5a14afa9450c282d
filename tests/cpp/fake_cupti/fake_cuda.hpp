// The test's controls of the fake device in the stand-in libcuda.so.1 (fake_cuda.cpp),
// and the driver entry points a test calls itself to play the user's part (a CUDA graph
// capture on a stream). The device has one clock, which moves only when the test
// advances it (or a cuEventSynchronize waits); each stream runs its queued work in order;
// an event completes when the device reaches the point of its stream where it was
// recorded. Streams are any non-zero handles (0 is the legacy stream), created on first
// use as blocking streams, or by cuStreamCreate (non-blocking ones too). All functions are
// thread-safe.
#pragma once

#include <cstdint>

extern "C" {

/// Device time back to 0, streams and counters forgotten (live events are kept).
void fake_cuda_reset();
/// Queues `ms` of work on `stream` (after what it already has; not run while it captures).
void fake_cuda_enqueue(std::uintptr_t stream, double ms);
/// Moves the device clock on by `ms`.
void fake_cuda_advance(double ms);
double fake_cuda_now_ms();
/// Captures invalidated so far (a prohibited call during a capture), and the calls that
/// were allowed while a capture was live (the caller was in relaxed mode).
int fake_cuda_invalidated_captures();
int fake_cuda_unsafe_calls_during_capture();
/// Events created and not destroyed; cuEventRecord / cuEventQuery / cuEventSynchronize calls.
int fake_cuda_live_events();
int fake_cuda_event_records();
int fake_cuda_event_queries();
int fake_cuda_event_syncs();
/// The PCI bus id cuDeviceGetPCIBusId gives for `device` (nullptr: back to the default,
/// 0000:<1B+16 device>:00.0, the bus of the fake NVML's GPU `device`).
void fake_cuda_set_pci_bus_id(int device, const char* bus_id);

/// The context current on threads that set none (a test's stand-in for the framework's),
/// and the device it is on; nullptr: none.
void fake_cuda_set_current(void* ctx, int device);
/// Binds a created stream to a context (streams otherwise take the context current where
/// they are first used).
void fake_cuda_set_stream_context(std::uintptr_t stream, void* ctx);
/// A device's primary context, and how many retains on it are outstanding.
void* fake_cuda_primary_context(int device);
int fake_cuda_primary_retains(int device);

// The driver's own entry points (CUstream as void*, CUstreamCaptureMode as int).
int cuStreamCreate(void** stream, unsigned int flags);  // CU_STREAM_DEFAULT / NON_BLOCKING
int cuStreamBeginCapture_v2(void* stream, int mode);
int cuStreamEndCapture(void* stream, void** graph);
int cuStreamIsCapturing(void* stream, int* status);
int cuThreadExchangeStreamCaptureMode(int* mode);
int cuCtxSetCurrent(void* ctx);
int cuCtxGetCurrent(void** ctx);
int cuCtxPushCurrent(void* ctx);
int cuCtxPopCurrent(void** ctx);
}

namespace fake_cuda {
inline constexpr int kCaptureModeGlobal = 0;  // CU_STREAM_CAPTURE_MODE_GLOBAL
inline constexpr int kCaptureModeThreadLocal = 1;
inline constexpr int kCaptureModeRelaxed = 2;
inline constexpr unsigned kStreamNonBlocking = 1;      // CU_STREAM_NON_BLOCKING
inline constexpr int kStreamCaptureInvalidated = 901;  // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
inline constexpr int kCapturedEvent = 907;             // CUDA_ERROR_CAPTURED_EVENT
}  // namespace fake_cuda
