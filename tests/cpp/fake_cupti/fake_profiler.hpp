// A stand-in for libcupti's profiler, host and range-profiler entry points (no PM
// sampling: it poses as a CUPTI without it) and for the few libcuda entry points
// steptrace uses, for testing the range-profiler backend's call layer without a GPU.
// The test sets the training thread's current context and inspects what was asked.
#pragma once

#include <cstdint>

extern "C" {

/// Forgets every call and setting; the chip is GH100, no context is current.
void fake_rp_reset();
/// cuptiProfilerInitialize fails with `result` (0: succeeds).
void fake_rp_fail_initialize(int result);
/// The context cuCtxGetCurrent returns (any thread; null: none) and its device; the
/// libcuda half (fake_cuda.cpp, soname libcuda.so.1).
void fake_cuda_set_current(void* ctx, int device);
void* fake_cuda_current();

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
}
