// Where a step's figure of useful work (Profiler::add_work) comes from.
#pragma once

#include <cstdint>

namespace steptrace {

/// A step keeps each figure (samples, tokens, FLOPs) from its most trusted source: a
/// higher source's figure replaces a lower one's, and one source's figures add up (one
/// per micro-batch).
enum class WorkSource : std::uint8_t {
  kNone = 0,
  kModel = 1,   // a watched model's training forward: its inputs, its FLOPs counted once
  kBatch = 2,   // a batch of the wrapped loader, or a framework's callback
  kOption = 3,  // the flops_per_step option
  kUser = 4,    // the program's own call
};

}  // namespace steptrace
