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
/// Which job a run belongs to, and where it came from: the `job` option, else
/// $STEPTRACE_JOB, $TORCHELASTIC_RUN_ID (not "none"), $SLURM_JOB_ID; empty id: none known.
struct JobIdentity {
  std::string id;
  std::string source;  // the option or variable it came from
};
JobIdentity resolve_job(const Config& c);
/// Resolves rank, world size, run id and the job from the environment where unset (`job`
/// becomes the metrics' label: the job id, else "steptrace"); throws ConfigError for
/// inconsistent values.
JobIdentity resolve(Config& c);

/// The rank's log file of this attempt of the job: attempt 0 is `<log_dir>/rank<N>.jsonl`,
/// attempt k >= 1 `<log_dir>/attempt<k>/rank<N>.jsonl`.
struct LogFile {
  int fd = -1;
  std::string path;
  int attempt = 0;
  int previous_attempt = -1;  // the latest earlier attempt with a file of this rank; -1: none
  std::string previous_path;  // and that file; empty: none
};
/// Creates log_dir and opens the rank's file. With a job id, a file of the same job is an
/// earlier attempt and is never replaced: the run becomes the next attempt (from
/// $TORCHELASTIC_RESTART_COUNT, else $SLURM_RESTART_COUNT, upwards). Every failure is a
/// ConfigError that names the path; nothing is left behind when the folder is unusable.
LogFile open_log_file(const Config& c, const JobIdentity& job);
/// The machine's physical memory in bytes (0: unknown).
std::int64_t host_memory_bytes();

}  // namespace steptrace::detail
