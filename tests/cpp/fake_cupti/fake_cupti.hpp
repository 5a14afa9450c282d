// A stand-in libcupti (soname libcupti.so.13) for testing the CUPTI activity backend's
// call layer without a GPU. It behaves the way the real library is documented to
// (cupti_activity.h) where steptrace depends on it:
//  - records are written only for the activity kinds (and, through
//    cuptiActivityEnableRuntimeApi / EnableDriverApi, the API calls) that are enabled;
//  - every API call gets a correlation id from one process-wide increasing counter,
//    whichever thread makes it; an API record carries it with the call's start time;
//  - external correlation ids are pushed per calling thread, and an external
//    correlation record is written only beside an API record (so only when the
//    call's API record is enabled, and only for ids pushed on the calling thread);
//  - records go into the client's buffers as they are created (a kernel's record at
//    its launch, timestamps filled in once it has run); a non-forced flush returns only
//    buffers that are full and whose records are all complete, so the buffer being
//    filled comes back only when it is full or the flush is forced, and a forced flush
//    returns kernels that have not run yet without timestamps (0, 0);
//  - a completed buffer goes to the completion callback registered at that moment,
//    whoever asked for it: after another tool registers its callbacks, the buffer being
//    filled still fills and then reaches the other tool's callback; a request callback
//    may decline (NULL): the record is dropped and counted;
//  - cuptiActivityFlushAll without registered callbacks fails with INVALID_OPERATION, and
//    cuptiFinalize forgets callbacks, kinds and the buffers CUPTI held.
// Timestamps (cuptiGetTimestamp, API records) come from the steady clock, made strictly
// increasing. The test drives it through these functions and inspects what was asked.
#pragma once

#include <cstdint>

extern "C" {

/// Forgets everything (enabled kinds and calls, callbacks, buffers, counters). Buffers
/// the client handed over are dropped, not returned.
void fake_cupti_reset();

/// A kernel launch from the calling thread through the runtime's cudaLaunchKernel.
/// Writes, when enabled: an external correlation record for each id pushed on this
/// thread and the API record (both at the call's exit), and the kernel record (reserved
/// at the launch, so ahead of the API record when `kernel_first`). The kernel runs over
/// [start_ns, end_ns): at once, or when fake_cupti_complete_kernels() is called while
/// the device is busy (fake_cupti_set_busy). Returns the correlation id.
std::uint32_t fake_cupti_launch(const char* name, std::uint64_t start_ns, std::uint64_t end_ns,
                                bool kernel_first);
/// The same through any launch call: `driver` picks the domain (cuLaunchKernel is 307,
/// cuLaunchKernelEx 652; cudaGraphLaunch is runtime 311). A graph launch runs `count`
/// kernels that share the call's correlation id, the i-th over [start + i, end + i).
std::uint32_t fake_cupti_launch_via(bool driver, int cbid, const char* name, std::uint64_t start_ns,
                                    std::uint64_t end_ns, bool kernel_first, int count);
/// An API call that launches nothing (cudaGetLastError, cuEventRecord, ...): it takes a
/// correlation id and writes an API record when that call's records are enabled.
std::uint32_t fake_cupti_api_call(bool driver, int cbid);
/// While busy, launched kernels have not run: their records stay incomplete (and their
/// buffers unreturnable by a non-forced flush) until fake_cupti_complete_kernels().
void fake_cupti_set_busy(bool busy);
void fake_cupti_complete_kernels();

/// CUPTI asks the client for a buffer it keeps in reserve and never fills (handed back,
/// empty, only by a forced flush).
void fake_cupti_hold_spare();

/// Records dropped for lack of buffer space, reported once at the next completion.
void fake_cupti_set_dropped(std::uint64_t n);
/// Makes cuptiActivityEnable(kind) fail with `result` (0: succeed).
void fake_cupti_fail_enable(int kind, int result);
/// Makes cuptiActivityEnableRuntimeApi / EnableDriverApi fail with `result` (0: succeed).
void fake_cupti_fail_api_filter(int result);
/// CUDA has initialized (a context exists), and from now on a call's records enabled one by
/// one (cuptiActivityEnableRuntimeApi / EnableDriverApi) are never written, though the
/// call returns CUPTI_SUCCESS: what a third party reported of CUDA 13 (steptrace issue 49).
/// cupti_activity.h documents no such limit (only CUPTI_SUCCESS and NOT_INITIALIZED, and
/// that the whole RUNTIME / DRIVER kinds override these settings): this models a reported
/// defect, not documented behaviour. Kernel records still come, with their correlation ids
/// ("correlationId ... the kernel's launch API record", CUpti_ActivityKernel*), and the
/// whole kinds still write every call's record.
void fake_cupti_ignore_api_filters_after_init();
/// Another tool (Kineto) registers its own buffer callbacks. Its buffers come from its
/// own arena; its completion callback leaves buffers it did not hand out alone (as
/// Kineto's does: "bufferCompleted called with unknown buffer").
void fake_cupti_register_other();
/// The other tool stops; `flush`: with a forced flush first (Kineto's), else leaving what
/// CUPTI holds (a tool that does not flush, or one taken down).
void fake_cupti_other_stop(bool flush);
/// Runs `fn` inside the next cuptiActivityRegisterCallbacks, before the new callbacks take
/// effect (a launch on another thread racing with the registration).
void fake_cupti_before_next_registration(void (*fn)());
/// Buffers the other tool's completion callback got that were not its own.
int fake_cupti_other_unknown_buffers();
/// The other tool's buffers not returned to it yet, and those it got back.
int fake_cupti_other_buffers_out();
int fake_cupti_other_buffers_received();
/// The other tool's buffers that a client's request callback handed to CUPTI as its own.
int fake_cupti_stolen_buffers();
/// Another tool tears CUPTI down (Kineto with TEARDOWN_CUPTI=1: a forced flush, then
/// cuptiFinalize from a CUDA API exit callback). With the profiler half linked in, its
/// objects are destroyed too (fake_profiler.hpp).
void fake_cupti_finalize(bool flush_first);
int fake_cupti_finalizes();

bool fake_cupti_kind_enabled(int kind);
/// Whether the records of API call `cbid` of the runtime (or driver) are enabled, through
/// the whole kind or that call alone.
bool fake_cupti_api_enabled(bool driver, int cbid);
/// How many calls have their records enabled one by one (EnableRuntimeApi/DriverApi).
int fake_cupti_api_filters();
/// Whether the callbacks CUPTI would use now are the first ones ever registered.
bool fake_cupti_first_callbacks_registered();
int fake_cupti_registrations();
int fake_cupti_flushes(bool forced);
int fake_cupti_pushes();
int fake_cupti_pops();
int fake_cupti_disables();
/// Depth of the external-id stack of `kind` on the calling thread.
int fake_cupti_stack_depth(int kind);
/// Records written so far, by kind (CUpti_ActivityKind).
int fake_cupti_records(int kind);
/// Buffers asked of the client, and returned to it.
int fake_cupti_buffers_requested();
int fake_cupti_buffers_returned();
/// Buffers filled (no room for the next record) and not returned yet.
int fake_cupti_full_buffers();
/// The size the client gave the last buffer it handed over.
std::uint64_t fake_cupti_last_buffer_size();
}
