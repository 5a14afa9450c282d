// What the runtime reads from the process and its environment: clocks, the process's
// start, the run's identity (rank, world size, run id, job from the launcher's variables)
// and the rank's log file.
#pragma once

#include <cstdint>
#include <string>

#include "steptrace/config.hpp"

namespace steptrace::detail {

std::int64_t unix_now_ns();
/// The run's one mapping of its clock to unix time, taken as it starts.
struct ClockMapping {
  std::int64_t start_ns = 0;       // a reading of the run's clock
  std::int64_t start_unix_ns = 0;  // and unix time then
  std::int64_t unix_ns_at(std::int64_t clock_ns) const noexcept {
    return start_unix_ns + (clock_ns - start_ns);
  }
};
/// When this process started (unix ns); 0 where unknown.
std::int64_t process_start_unix_ns();
std::string host_name();
/// An int from the environment, or `fallback` when unset; ConfigError when malformed.
int env_int(const char* name, int fallback);
/// Resolves rank, world size, run id and job from the environment where unset; throws
/// ConfigError for inconsistent values.
void resolve(Config& c);
/// Creates log_dir and opens the rank's file (its path in path_out); every failure is a
/// ConfigError that names the path, and nothing is left behind when the folder is unusable.
int open_log_file(const Config& c, std::string& path_out);
/// The machine's physical memory in bytes (0: unknown).
std::int64_t host_memory_bytes();

}  // namespace steptrace::detail
