// Symbol visibility for the steptrace library: the shared library is built with hidden
// visibility, and only what is marked STEPTRACE_API is exported.
#pragma once

#if defined(_WIN32)
#define STEPTRACE_API
#else
#define STEPTRACE_API __attribute__((visibility("default")))
#endif
