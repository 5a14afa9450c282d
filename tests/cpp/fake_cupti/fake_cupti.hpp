// A stand-in libcupti (soname libcupti.so.13) for testing the CUPTI activity backend's
// call layer without a GPU: it implements the activity entry points the backend resolves
// and writes canned records into the backend's buffers when flushed. The test drives it
// through these functions and inspects what the backend asked of it.
#pragma once

#include <cstdint>

extern "C" {

/// Forgets everything (enabled kinds, callbacks, pending records, counters).
void fake_cupti_reset();
/// A kernel launch from the calling thread: records an external correlation for each id
/// pushed on this thread (when that kind is enabled) and queues the kernel record (when
/// CONCURRENT_KERNEL is enabled); both reach the callbacks at the next flush, kernel
/// records first when `kernel_first`. Returns the correlation id.
std::uint32_t fake_cupti_launch(const char* name, std::uint64_t start_ns, std::uint64_t end_ns,
                                bool kernel_first);
/// Records dropped for lack of buffer space, reported once at the next completion.
void fake_cupti_set_dropped(std::uint64_t n);
/// Makes cuptiActivityEnable(kind) fail with `result` (0: succeed).
void fake_cupti_fail_enable(int kind, int result);
/// Another tool (Kineto) registers its own buffer callbacks.
void fake_cupti_register_other();
/// Drops the queued records (the other tool flushed them into its own buffers).
void fake_cupti_discard_pending();

bool fake_cupti_kind_enabled(int kind);
/// Whether the callbacks CUPTI would use now are the first ones ever registered.
bool fake_cupti_first_callbacks_registered();
int fake_cupti_registrations();
int fake_cupti_flushes(bool forced);
int fake_cupti_pushes();
int fake_cupti_pops();
int fake_cupti_disables();
/// Depth of the external-id stack of `kind` on the calling thread.
int fake_cupti_stack_depth(int kind);
}
