// Which thread this is, inline: the thread pointer (%fs:0 on x86-64, TPIDR_EL0 on
// AArch64), unique among the running threads as pthread_self() is (glibc's pthread_self()
// returns it), without a call through libc's PLT: two lines that are cold at a step's
// begin after the model's work (issue 30).
#pragma once

namespace steptrace::detail {

inline const void* this_thread_token() noexcept { return __builtin_thread_pointer(); }

}  // namespace steptrace::detail
