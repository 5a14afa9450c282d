#include "run_environment.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <system_error>

#include "../core/check.hpp"
#include "steptrace/error.hpp"

namespace steptrace::detail {

std::int64_t unix_now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// When this process started (unix ns), from /proc/self/stat's starttime (field 22, clock
// ticks after boot; proc(5)) against CLOCK_BOOTTIME; 0 where unknown.
std::int64_t process_start_unix_ns() {
  std::FILE* f = std::fopen("/proc/self/stat", "re");
  if (f == nullptr) return 0;
  char buf[1024];
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces
  if (p == nullptr) return 0;
  unsigned long long start_ticks = 0;
  // fields 3..22 after ") ": state, then 18 numbers, then starttime
  if (std::sscanf(
          p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
          &start_ticks) != 1) {
    return 0;
  }
  const long hz = sysconf(_SC_CLK_TCK);
  timespec boot{};
  if (hz <= 0 || clock_gettime(CLOCK_BOOTTIME, &boot) != 0) return 0;
  const std::int64_t boot_ns =
      static_cast<std::int64_t>(boot.tv_sec) * 1'000'000'000 + boot.tv_nsec;
  const auto start_ns = static_cast<std::int64_t>(start_ticks) * (1'000'000'000 / hz);
  const std::int64_t age = boot_ns - start_ns;
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

// Resolves rank, world size and run id; throws ConfigError for inconsistent values.
void resolve(Config& c) {
  if (c.rank < 0) c.rank = env_int("RANK", 0);
  if (c.world_size < 0) c.world_size = env_int("WORLD_SIZE", 1);
  STEPTRACE_CHECK(c.world_size >= 1 && c.rank < c.world_size, ConfigError,
                  "rank={} is not below world_size={}; ranks are 0..world_size-1", c.rank,
                  c.world_size);
  if (c.run_id.empty()) c.run_id = default_run_id();
  if (c.job.empty()) {
    const char* job = std::getenv("STEPTRACE_JOB");
    c.job = job != nullptr && *job != '\0' ? job : "steptrace";
  }
}

// Creates log_dir and opens the rank's file; every failure is a ConfigError that names
// the path. Nothing is left behind when the directory cannot be used.
int open_log_file(const Config& c, std::string& path_out) {
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
  path_out = (dir / fmt::format("rank{}.jsonl", c.rank)).string();
  // Never through what another user may have planted at the path (a symlink to a victim
  // file, a hard link, a FIFO that would block the open): the file is always created
  // here (O_EXCL follows no link); overwrite removes the old name first (unlink touches the
  // name, never what a link points to). log_mode: logs hold exception text and host names.
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_APPEND | O_NOFOLLOW;
  const auto mode = static_cast<mode_t>(c.log_mode);
  int fd = ::open(path_out.c_str(), flags, mode);
  if (fd < 0 && errno == EEXIST) {
    struct stat st {};
    const bool known = ::lstat(path_out.c_str(), &st) == 0;
    STEPTRACE_CHECK(!known || !S_ISLNK(st.st_mode), ConfigError,
                    "log file {:?} is a symbolic link; steptrace follows no link in the log "
                    "folder: remove it, or use another log_dir",
                    path_out);
    STEPTRACE_CHECK(!known || !S_ISDIR(st.st_mode), ConfigError,
                    "log file {:?} is a directory; remove it, or use another log_dir", path_out);
    STEPTRACE_CHECK(c.overwrite, ConfigError,
                    "log file {:?} already exists (an earlier run); pass overwrite=True or "
                    "use another log_dir",
                    path_out);
    STEPTRACE_CHECK(::unlink(path_out.c_str()) == 0 || errno == ENOENT, ConfigError,
                    "cannot replace log file {:?}: {}", path_out, std::strerror(errno));
    fd = ::open(path_out.c_str(), flags, mode);
    STEPTRACE_CHECK(fd >= 0 || errno != EEXIST, ConfigError,
                    "log file {:?} was created again by someone else while it was replaced; "
                    "use a log_dir only this job writes in",
                    path_out);
  }
  STEPTRACE_CHECK(fd >= 0, ConfigError, "cannot write in log_dir {:?}: {}", c.log_dir,
                  std::strerror(errno));
  return fd;
}

std::int64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::int64_t>(pages) * page : 0;
}

}  // namespace steptrace::detail
