// A stand-in for libcupti's profiler, host and range-profiler entry points and, built
// with FAKE_CUPTI_PM_SAMPLING, PM sampling (without, it poses as a CUPTI older than
// 12.6), and for the few libcuda entry points steptrace uses, for testing the counter
// backends' call layer without a GPU. The test sets the training thread's current
// context and the visible devices, tears CUPTI down under the backend (cuptiFinalize,
// which fake_cupti.cpp defines), and inspects what was asked.
#pragma once

#include <cstdint>

extern "C" {

/// Forgets every call and setting; the chip is GH100, no context is current.
void fake_rp_reset();
/// cuptiProfilerInitialize fails with `result` (0: succeeds).
void fake_rp_fail_initialize(int result);
/// The context cuCtxGetCurrent returns (null: none) on every thread that has not called
/// cuCtxSetCurrent itself (contexts are per thread, fake_cuda.hpp), and its device; the
/// libcuda half (fake_cuda.cpp, soname libcuda.so.1).
void fake_cuda_set_current(void* ctx, int device);
void* fake_cuda_current();
/// cuDeviceGetCount's answer (8 until set).
void fake_cuda_set_device_count(int n);

int fake_rp_initializes();
int fake_rp_deinitializes();
/// cuptiRangeProfilerEnable calls, those with a null context, and the last context.
int fake_rp_enables();
int fake_rp_null_context_enables();
void* fake_rp_enabled_context();
int fake_rp_disables();
int fake_rp_set_configs();
int fake_rp_starts();
int fake_rp_stops();
int fake_rp_pops();
int fake_rp_decodes();
/// Ranges pushed so far, and the name of the i-th ("" past the end).
int fake_rp_pushes();
const char* fake_rp_pushed_name(int i);
/// Calls made out of order (push outside a pass, decode of a running pass, ...).
int fake_rp_misuses();

/// What a call naming an object destroyed by cuptiFinalize returns (default
/// CUPTI_ERROR_NOT_INITIALIZED; the real library's answer is undocumented).
void fake_rp_set_stale_result(int result);
/// Calls naming a destroyed object; and those that would free one (Disable, host
/// Deinitialize) or undo an initialization cuptiFinalize already undid (DeInitialize).
int fake_rp_stale_calls();
int fake_rp_stale_teardowns();
/// The device cuptiDeviceGetChipName was last asked about (-1: never).
int fake_rp_chip_device();

/// PM sampling (FAKE_CUPTI_PM_SAMPLING): the device of the last Enable and of the last
/// counter availability query (-1: none), and calls so far.
int fake_pm_enabled_device();
int fake_pm_availability_device();
int fake_pm_enables();
int fake_pm_disables();
int fake_pm_starts();
int fake_pm_decodes();
/// cuptiPmSamplingStart fails with `result` (0: succeeds): counters held by another tool.
void fake_pm_fail_start(int result);
}
