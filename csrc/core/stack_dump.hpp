// Stacks of every thread for hang alerts, taken by a signal handler that needs no lock of
// the program: Python's faulthandler reads the interpreter's thread states without the
// GIL, so it answers even while the hung thread holds the GIL in native code, where a
// Python thread asked for its stacks never runs. The watchdog raises the signal on its
// own thread (so the handler runs there, before raise returns) and reads back the file
// the handler wrote to.
#pragma once

#include <cstddef>
#include <string>

namespace steptrace::detail {

/// Arms the dump: `signum` has a handler that writes the stacks to `fd` (a regular file).
/// False (and disarmed) when no handler is installed for it; signum < 0 disarms.
bool arm_stack_dump(int signum, int fd) noexcept;

/// The stacks the armed handler writes, at most max_bytes; "" when nothing is armed, in a
/// forked child of the process that armed it, or when the handler in place is no longer
/// the one armed (raising the signal then could end the process).
std::string dump_stacks(std::size_t max_bytes = std::size_t{256} * 1024) noexcept;
/// True when the signal armed in this process is back at its default disposition (someone
/// restored it, as Lightning's Trainer does for every signal at the end of fit): arm again.
bool armed_signal_reset() noexcept;

/// A real-time signal with its default disposition (nobody handles it), highest first;
/// -1 when there is none.
int spare_signal() noexcept;

}  // namespace steptrace::detail
