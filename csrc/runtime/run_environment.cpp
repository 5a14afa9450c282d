#include "run_environment.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <system_error>

#include "../core/check.hpp"
#include "../core/host/process_stat.hpp"
#include "steptrace/error.hpp"

namespace steptrace::detail {

std::int64_t unix_now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// When this process started (unix ns): its age (core/host/process_stat.hpp) before now;
// 0 where unknown.
std::int64_t process_start_unix_ns() {
  const std::int64_t age = process_age_ns();
  return age >= 0 ? unix_now_ns() - age : 0;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

// An int from the environment, or `fallback` when unset; ConfigError when malformed.
int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  STEPTRACE_CHECK(*end == '\0' && parsed >= 0 && parsed < (1 << 24), ConfigError,
                  "environment variable {}={:?} is not a non-negative integer", name, value);
  return static_cast<int>(parsed);
}

namespace {

std::string default_run_id() {
  for (const char* var : {"STEPTRACE_RUN_ID", "TORCHELASTIC_RUN_ID"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && *v != '\0' && std::strcmp(v, "none") != 0) return v;
  }
  // torchrun without a rendezvous id: every rank of one job shares the master address.
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  if (addr != nullptr && port != nullptr && std::getenv("WORLD_SIZE") != nullptr) {
    return fmt::format("job-{}-{}", addr, port);
  }
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  return fmt::format("{:04}{:02}{:02}T{:02}{:02}{:02}Z-{}-{}", tm.tm_year + 1900, tm.tm_mon + 1,
                     tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, host_name(), getpid());
}

}  // namespace

// Resolves rank, world size, run id and job; throws ConfigError for inconsistent values.
JobIdentity resolve(Config& c) {
  if (c.rank < 0) c.rank = env_int("RANK", 0);
  if (c.world_size < 0) c.world_size = env_int("WORLD_SIZE", 1);
  STEPTRACE_CHECK(c.world_size >= 1 && c.rank < c.world_size, ConfigError,
                  "rank={} is not below world_size={}; ranks are 0..world_size-1", c.rank,
                  c.world_size);
  if (c.run_id.empty()) c.run_id = default_run_id();
  JobIdentity job = resolve_job(c);
  c.job = job.id.empty() ? "steptrace" : job.id;  // the metrics' job label
  return job;
}

JobIdentity resolve_job(const Config& c) {
  if (!c.job.empty()) return {c.job, "option"};
  for (const char* var : {"STEPTRACE_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"}) {
    const char* v = std::getenv(var);
    // torchrun's --rdzv-id defaults to "none": no id of a job
    if (v != nullptr && *v != '\0' && std::strcmp(v, "none") != 0) return {v, var};
  }
  return {};
}

namespace {

// The job id in the run_start at the top of an existing log, or nothing (unreadable, not a
// regular file, torn, no job): only a file this job wrote counts as an earlier attempt.
std::optional<std::string> log_job_id(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return std::nullopt;
  struct stat st {};
  std::string head;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    // a run_start is a few KiB; its line ends well before this
    head.resize(std::size_t{64} * 1024);
    const ssize_t n = ::read(fd, head.data(), head.size());
    head.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  }
  ::close(fd);
  const auto eol = head.find('\n');
  if (eol == std::string::npos) return std::nullopt;
  const auto record = nlohmann::json::parse(head.begin(), head.begin() + static_cast<long>(eol),
                                            nullptr, /*allow_exceptions=*/false);
  if (!record.is_object() || record.value("kind", "") != "run_start") return std::nullopt;
  const auto job = record.find("job");
  if (job == record.end() || !job->is_object()) return std::nullopt;
  const auto id = job->find("id");
  if (id == job->end() || !id->is_string()) return std::nullopt;
  return id->get<std::string>();
}

// The folder of attempt k; created (not through a link) for k >= 1.
std::filesystem::path attempt_dir(const std::filesystem::path& root, int attempt, bool create) {
  if (attempt == 0) return root;
  auto dir = root / fmt::format("attempt{}", attempt);
  if (create) {
    std::error_code ec;
    std::filesystem::create_directory(dir, ec);
    struct stat st {};
    STEPTRACE_CHECK(::lstat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), ConfigError,
                    "cannot use the attempt folder {:?}{}: steptrace follows no link in the log "
                    "folder",
                    dir.string(), ec ? fmt::format(" ({})", ec.message()) : std::string());
  }
  return dir;
}

std::string rank_file(int rank) { return fmt::format("rank{}.jsonl", rank); }

// Replacing a run (overwrite=True) replaces its later attempts of this rank too, so the
// job root does not mix the new run with an old one's restarts.
void remove_later_attempts(const std::filesystem::path& root, int rank, int from) {
  for (int k = std::max(from, 1);; ++k) {
    const auto dir = attempt_dir(root, k, false);
    struct stat st {};
    if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return;
    ::unlink((dir / rank_file(rank)).c_str());
    ::rmdir(dir.c_str());  // only when no other rank's file is left
  }
}

constexpr int kMaxAttempts = 100000;

}  // namespace

// Creates log_dir and opens the rank's file; every failure is a ConfigError that names
// the path. Nothing is left behind when the directory cannot be used.
LogFile open_log_file(const Config& c, const JobIdentity& job) {
  namespace fs = std::filesystem;
  const fs::path dir(c.log_dir);
  std::error_code ec;
  const auto status = fs::status(dir, ec);
  if (fs::exists(status)) {
    STEPTRACE_CHECK(fs::is_directory(status), ConfigError,
                    "log_dir {:?} exists and is not a directory; give a folder", c.log_dir);
  } else {
    fs::create_directories(dir, ec);
    STEPTRACE_CHECK(!ec, ConfigError, "cannot create log_dir {:?}: {}", c.log_dir, ec.message());
  }
  LogFile out;
  // A restart counter says which attempt this is; the files say whether one before it with
  // the same number already ran (a resubmit of the whole launcher).
  if (!job.id.empty()) {
    out.attempt = env_int("TORCHELASTIC_RESTART_COUNT", env_int("SLURM_RESTART_COUNT", 0));
  }
  // Never through what another user may have planted at the path (a symlink to a victim
  // file, a hard link, a FIFO that would block the open): the file is always created
  // here (O_EXCL follows no link); overwrite removes the old name first (unlink touches the
  // name, never what a link points to). log_mode: logs hold exception text and host names.
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_APPEND | O_NOFOLLOW;
  const auto mode = static_cast<mode_t>(c.log_mode);
  for (;; ++out.attempt) {
    STEPTRACE_CHECK(out.attempt < kMaxAttempts, ConfigError,
                    "log_dir {:?} holds {} attempts of job {:?}; use another log_dir", c.log_dir,
                    kMaxAttempts, job.id);
    out.path = (attempt_dir(dir, out.attempt, true) / rank_file(c.rank)).string();
    out.fd = ::open(out.path.c_str(), flags, mode);
    if (out.fd >= 0 || errno != EEXIST) break;
    struct stat st {};
    const bool known = ::lstat(out.path.c_str(), &st) == 0;
    STEPTRACE_CHECK(!known || !S_ISLNK(st.st_mode), ConfigError,
                    "log file {:?} is a symbolic link; steptrace follows no link in the log "
                    "folder: remove it, or use another log_dir",
                    out.path);
    STEPTRACE_CHECK(!known || !S_ISDIR(st.st_mode), ConfigError,
                    "log file {:?} is a directory; remove it, or use another log_dir", out.path);
    if (!job.id.empty() && log_job_id(out.path) == job.id) continue;  // an earlier attempt
    STEPTRACE_CHECK(c.overwrite, ConfigError,
                    "log file {:?} already exists (an earlier run{}); pass overwrite=True, "
                    "use another log_dir, or give the runs of one job the same job id (the "
                    "`job` option or $STEPTRACE_JOB) to keep each attempt",
                    out.path,
                    job.id.empty() ? std::string() : fmt::format(", not of job {:?}", job.id));
    STEPTRACE_CHECK(::unlink(out.path.c_str()) == 0 || errno == ENOENT, ConfigError,
                    "cannot replace log file {:?}: {}", out.path, std::strerror(errno));
    remove_later_attempts(dir, c.rank, out.attempt + 1);
    out.fd = ::open(out.path.c_str(), flags, mode);
    STEPTRACE_CHECK(out.fd >= 0 || errno != EEXIST, ConfigError,
                    "log file {:?} was created again by someone else while it was replaced; "
                    "use a log_dir only this job writes in",
                    out.path);
    break;
  }
  STEPTRACE_CHECK(out.fd >= 0, ConfigError, "cannot write in log_dir {:?}: {}", c.log_dir,
                  std::strerror(errno));
  for (int k = out.attempt - 1; k >= 0; --k) {
    struct stat st {};
    const auto previous = attempt_dir(dir, k, false) / rank_file(c.rank);
    if (::lstat(previous.c_str(), &st) == 0) {
      out.previous_attempt = k;
      out.previous_path = previous.string();
      break;
    }
  }
  return out;
}

std::int64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::int64_t>(pages) * page : 0;
}

}  // namespace steptrace::detail
