// Profiler configuration. Every field has a documented default; validate() throws
// ConfigError naming the bad value and what is allowed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "steptrace/export.hpp"

namespace steptrace {

/// Options of one profiler. Plain data: copy it, change fields, pass it to Profiler.
/// The fields, their order, defaults and documentation are the table in
/// steptrace/config_options.def (the one source of the options; see docs/configuration.md).
struct STEPTRACE_API Config {
#define STEPTRACE_CONFIG_OPTION(group, type, name, default_value, check, doc) \
  type name = default_value;
#include "steptrace/config_options.def"

  /// Throws ConfigError for the first bad value, naming it and what is allowed.
  void validate() const;
};

/// Limits on phases, shared by validation and the fixed-size step records.
inline constexpr std::size_t kMaxPhases = 32;
inline constexpr std::size_t kMaxPhaseNameBytes = 64;
/// Distinct names of per-step values (Profiler::set_step_value) a run may use; a step
/// record holds one slot per name, so a step never runs out of room for its values.
inline constexpr std::size_t kMaxStepValues = 16;

/// Throws ConfigError unless `name` can be a phase name (non-empty, at most
/// kMaxPhaseNameBytes bytes, no control characters, not the reserved "data").
STEPTRACE_API void validate_phase_name(const std::string& name);

}  // namespace steptrace
