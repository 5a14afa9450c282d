// The run's identity and its log file: which job a run belongs to, which attempt of it it
// is, and that a restart never loses (or is refused because of) an earlier attempt's log.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "runtime/run_environment.hpp"
#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::read_jsonl;
using testing::TempDir;

// Sets an environment variable for one test and puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// No launcher variable of the machine running the tests leaks into them.
struct CleanLauncherEnv {
  ScopedEnv job{"STEPTRACE_JOB", nullptr};
  ScopedEnv elastic{"TORCHELASTIC_RUN_ID", nullptr};
  ScopedEnv slurm{"SLURM_JOB_ID", nullptr};
  ScopedEnv restarts{"TORCHELASTIC_RESTART_COUNT", nullptr};
  ScopedEnv requeues{"SLURM_RESTART_COUNT", nullptr};
};

Config job_config(const TempDir& tmp, const std::string& job) {
  Config c = testing::run_config(tmp);
  c.job = job;
  return c;
}

// Runs one attempt with two steps; returns its log's path and its run_start's job object.
std::pair<std::string, nlohmann::json> run_attempt(const Config& config) {
  Profiler prof(config);
  for (int i = 0; i < 2; ++i) {
    auto step = prof.step();
  }
  const std::string path = prof.log_path();
  prof.close();
  return {path, read_jsonl(path).front().at("job")};
}

TEST(JobIdentity, TheOptionThenTheLaunchersVariablesInOrder) {
  CleanLauncherEnv clean;
  Config c;
  EXPECT_TRUE(detail::resolve_job(c).id.empty());
  ScopedEnv slurm("SLURM_JOB_ID", "4242");
  EXPECT_EQ(detail::resolve_job(c).id, "4242");
  EXPECT_EQ(detail::resolve_job(c).source, "SLURM_JOB_ID");
  ScopedEnv none("TORCHELASTIC_RUN_ID", "none");  // torchrun's default: no id
  EXPECT_EQ(detail::resolve_job(c).id, "4242");
  ScopedEnv elastic("TORCHELASTIC_RUN_ID", "rdzv-7");
  EXPECT_EQ(detail::resolve_job(c).id, "rdzv-7");
  ScopedEnv job("STEPTRACE_JOB", "named");
  EXPECT_EQ(detail::resolve_job(c).source, "STEPTRACE_JOB");
  c.job = "given";
  EXPECT_EQ(detail::resolve_job(c).id, "given");
  EXPECT_EQ(detail::resolve_job(c).source, "option");
}

// torchrun restarted the ranks: before, the restart died on "already exists" (or, with
// overwrite, destroyed the failed attempt's log). Now each attempt keeps its own file.
TEST(JobAttempts, ARestartOfTheSameJobWritesItsOwnFileBesideTheFailedOne) {
  CleanLauncherEnv clean;
  TempDir tmp;
  const Config config = job_config(tmp, "job-1");
  const auto [first, first_job] = run_attempt(config);
  const auto before = read_jsonl(first);
  for (const bool overwrite : {false, true}) {
    Config again = config;
    again.overwrite = overwrite;
    const auto [path, job] = run_attempt(again);
    EXPECT_NE(path, first);
    EXPECT_EQ(job.at("id"), "job-1");
    EXPECT_EQ(job.at("source"), "option");
  }
  EXPECT_EQ(read_jsonl(first), before);  // the failed attempt's log, untouched
  EXPECT_EQ(first_job.at("attempt"), 0);
  EXPECT_TRUE(first_job.at("previous_attempt").is_null());
  const auto second = read_jsonl(tmp.str("run/attempt1/rank0.jsonl"));
  EXPECT_EQ(second.front().at("job").at("attempt"), 1);
  EXPECT_EQ(second.front().at("job").at("previous_attempt"), 0);
  EXPECT_EQ(read_jsonl(tmp.str("run/attempt2/rank0.jsonl")).front().at("job").at("attempt"), 2);
}

// The launcher's restart counter says which attempt it is: the ranks of one restart agree
// even where a rank left no file in an earlier attempt.
TEST(JobAttempts, TheRestartCounterNumbersTheAttempt) {
  CleanLauncherEnv clean;
  TempDir tmp;
  ScopedEnv job("TORCHELASTIC_RUN_ID", "rdzv-9");
  ScopedEnv restarts("TORCHELASTIC_RESTART_COUNT", "2");
  const auto [path, ids] = run_attempt(testing::run_config(tmp));
  EXPECT_EQ(path, tmp.str("run/attempt2/rank0.jsonl"));
  EXPECT_EQ(ids.at("id"), "rdzv-9");
  EXPECT_EQ(ids.at("source"), "TORCHELASTIC_RUN_ID");
  EXPECT_TRUE(ids.at("previous_attempt").is_null());  // no file of this rank before it
  // a resubmit of the whole launcher counts from 0 again: moved past the files the job wrote
  ScopedEnv again("TORCHELASTIC_RESTART_COUNT", "0");
  run_attempt(testing::run_config(tmp));
  const auto [third, third_job] = run_attempt(testing::run_config(tmp));
  EXPECT_EQ(third, tmp.str("run/attempt1/rank0.jsonl"));
  EXPECT_EQ(third_job.at("previous_attempt"), 0);
}

// Another job's log (or one with no job) is not an attempt of this one: refused as before,
// or, with overwrite, replaced together with that run's later attempts of this rank.
TEST(JobAttempts, AnotherJobsLogIsRefusedOrReplacedWithItsLaterAttempts) {
  CleanLauncherEnv clean;
  TempDir tmp;
  run_attempt(job_config(tmp, "old"));
  run_attempt(job_config(tmp, "old"));
  ASSERT_TRUE(std::filesystem::exists(tmp.str("run/attempt1/rank0.jsonl")));
  try {
    run_attempt(job_config(tmp, "new"));
    FAIL() << "another job's log was taken for an earlier attempt";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("already exists"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not of job \"new\""), std::string::npos) << e.what();
  }
  Config replace = job_config(tmp, "new");
  replace.overwrite = true;
  const auto [path, job] = run_attempt(replace);
  EXPECT_EQ(path, tmp.str("run/rank0.jsonl"));
  EXPECT_EQ(job.at("id"), "new");
  EXPECT_FALSE(std::filesystem::exists(tmp.str("run/attempt1")));
  // without a job id nothing changes: one file, refused or replaced
  Config plain = testing::run_config(tmp);
  EXPECT_THROW(run_attempt(plain), ConfigError);
  plain.overwrite = true;
  EXPECT_EQ(run_attempt(plain).second.at("id"), nullptr);
}

// The attempt folder is the job's own: a link planted in its place is refused, never
// followed.
TEST(JobAttempts, AnAttemptFolderThatIsALinkIsRefused) {
  CleanLauncherEnv clean;
  TempDir tmp;
  run_attempt(job_config(tmp, "j"));
  std::filesystem::create_directories(tmp.str("elsewhere"));
  std::filesystem::create_directory_symlink(tmp.str("elsewhere"), tmp.str("run/attempt1"));
  try {
    run_attempt(job_config(tmp, "j"));
    FAIL() << "the attempt folder's link was followed";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("follows no link"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(std::filesystem::is_empty(tmp.str("elsewhere")));
}

// A torn first line (the attempt died while writing run_start) is not this job's: the
// file is left alone and, without overwrite, the error names it.
TEST(JobAttempts, ALogWhoseRunStartIsTornIsNotTakenForAnAttempt) {
  CleanLauncherEnv clean;
  TempDir tmp;
  std::filesystem::create_directories(tmp.str("run"));
  std::ofstream(tmp.str("run/rank0.jsonl")) << R"({"kind":"run_start","job":{"id":"j")";
  EXPECT_THROW(run_attempt(job_config(tmp, "j")), ConfigError);
}

}  // namespace
}  // namespace steptrace
