// What to look at when a phase (or the loader's wait, or the host work between steps) is
// the one that grew: the advice every slow-step alert ends with.
#pragma once

#include <string_view>

namespace steptrace::detail {

inline const char* phase_advice(std::string_view phase) {
  if (phase == "data") {
    return "the input pipeline is the bottleneck: add DataLoader workers, prefetch, or "
           "pin_memory";
  }
  if (phase == "other") {
    return "host work between steps grew (logging, callbacks, or a loader steptrace does not "
           "see): wrap the loader with prof.data() and mark evaluation and checkpoints with "
           "prof.interval() to tell them apart";
  }
  if (phase == "optimizer") return "check for optimizer-state offload or host-device copies";
  if (phase == "backward") {
    return "check for gradient communication, recomputation or a changed model";
  }
  if (phase == "forward") return "check for shape changes, recompilation or a changed model";
  return "compare this phase with the steps before";
}

}  // namespace steptrace::detail
