// The rank's log file as the Profiler opens it (csrc/runtime/run_environment.cpp,
// open_log_file): nothing planted at the log path is followed or truncated, and the file
// gets the mode the options say.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::read_jsonl;
using testing::TempDir;

std::string file_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A planted rank0.jsonl -> victim: overwrite=true (steptrace run's default) truncated the
// victim through the link; now a clear error naming the link, and the victim untouched.
TEST(LogOpen, ASymlinkAtTheLogPathIsAnErrorAndItsTargetIsUntouched) {
  TempDir tmp;
  const auto victim = tmp.path() / "victim.txt";
  std::ofstream(victim) << "precious\n";
  Config config = testing::run_config(tmp);
  std::filesystem::create_directories(config.log_dir);
  const auto link = std::filesystem::path(config.log_dir) / "rank0.jsonl";
  std::filesystem::create_symlink(victim, link);
  for (const bool overwrite : {true, false}) {
    config.overwrite = overwrite;
    try {
      Profiler prof(config);
      FAIL() << "a symlink at the log path was opened";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("symbolic link"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(link.string()), std::string::npos) << e.what();
    }
    EXPECT_EQ(file_text(victim), "precious\n");
    EXPECT_TRUE(std::filesystem::is_symlink(link));  // left for the user to look at
  }
  // a dangling link (to a file it would create) is refused the same way
  std::filesystem::remove(link);
  std::filesystem::create_symlink(tmp.path() / "created.txt", link);
  config.overwrite = true;
  EXPECT_THROW(Profiler prof(config), ConfigError);
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / "created.txt"));
}

// overwrite replaces the name: a hard link to another file is unlinked, not truncated;
// a FIFO planted at the path is replaced, never opened (an open for writing would block).
TEST(LogOpen, OverwriteReplacesTheNameNeverWhatItLinksTo) {
  TempDir tmp;
  const auto victim = tmp.path() / "victim.txt";
  std::ofstream(victim) << "precious\n";
  Config config = testing::run_config(tmp);
  config.overwrite = true;
  std::filesystem::create_directories(config.log_dir);
  const auto path = std::filesystem::path(config.log_dir) / "rank0.jsonl";
  std::filesystem::create_hard_link(victim, path);
  { Profiler prof(config); }
  EXPECT_EQ(file_text(victim), "precious\n");
  EXPECT_EQ(std::filesystem::hard_link_count(path), 1u);
  EXPECT_EQ(read_jsonl(path.string()).front()["kind"], "run_start");
  std::filesystem::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  { Profiler prof(config); }
  EXPECT_TRUE(std::filesystem::is_regular_file(path));
  EXPECT_EQ(read_jsonl(path.string()).back()["kind"], "run_end");
}

// Logs hold exception text, stack dumps and host names: 0640 by default, log_mode to change
// it (the umask still applies); a replaced log gets the mode again.
TEST(LogOpen, TheLogIsNotWorldReadableByDefault) {
  TempDir tmp;
  const mode_t old_umask = ::umask(022);
  Config config = testing::run_config(tmp);
  std::string path;
  {
    Profiler prof(config);
    path = prof.log_path();
  }
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  config.overwrite = true;
  config.log_mode = 0644;
  { Profiler prof(config); }
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  config.log_mode = 0400;  // the owner must be able to write its own log
  EXPECT_THROW(Profiler prof(config), ConfigError);
  ::umask(old_umask);
}

}  // namespace
}  // namespace steptrace
