// This process as /proc describes it (proc(5)), read through ProcFile like the other host
// readers: how long it has run (/proc/self/stat) and its resident set size
// (/proc/self/statm, make_rss_source in steptrace/backend.hpp: the run's default memory
// source).
#pragma once

#include <cstdint>

namespace steptrace::detail {

/// How long this process has run (ns), from /proc/self/stat's starttime (field 22, clock
/// ticks after boot) against CLOCK_BOOTTIME; -1 where unknown.
std::int64_t process_age_ns();

}  // namespace steptrace::detail
