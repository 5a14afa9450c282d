// LibTorch adapter: torch-specific values for the profiler, for C++ trainers that link
// libtorch. Built into steptrace::torch only when CMake finds Torch. No torch types here.
#pragma once

#include <memory>

#include "steptrace/backend.hpp"
#include "steptrace/export.hpp"
#include "steptrace/profiler.hpp"

namespace steptrace {

/// Allocator statistics of torch's CUDA caching allocator for the current device
/// (allocated, reserved, peak since the last step, which it resets); nullptr when torch
/// has no usable CUDA device, since the CPU allocator keeps no statistics.
STEPTRACE_API std::unique_ptr<MemorySource> make_torch_memory_source();

/// c10's current CUDA stream, asked every step; nullptr when torch has no usable CUDA
/// device or this adapter was built without CUDA headers.
STEPTRACE_API std::unique_ptr<StreamSource> make_torch_stream_source();

/// Backends for a LibTorch trainer: the defaults plus the torch allocator and c10's
/// current CUDA stream when present.
STEPTRACE_API Backends torch_backends();

}  // namespace steptrace
