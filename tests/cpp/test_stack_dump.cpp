// The signal-handler stack dump the watchdog uses for hang alerts: the armed handler runs
// on the calling thread and its output is read back; a replaced handler, or none, gives
// "" (the caller falls back to asking a subscriber) and is never raised.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "core/stack_dump.hpp"

namespace steptrace {
namespace {

int g_fd = -1;
int g_calls = 0;
pthread_t g_thread;

void write_stacks(int) {  // stands in for faulthandler's handler
  ++g_calls;
  g_thread = pthread_self();
  static const char kText[] =
      "Thread 0x1 (most recent call first):\n  File \"x.py\", line 3 in f\n";
  (void)!write(g_fd, kText, sizeof(kText) - 1);
}

int calls_of_other = 0;
void other_handler(int) { ++calls_of_other; }

bool set_handler(int sig, void (*handler)(int)) {
  struct sigaction sa {};
  sa.sa_handler = handler;
  return sigaction(sig, &sa, nullptr) == 0;
}

struct TempFile {
  TempFile() {
    FILE* f = tmpfile();
    fd = dup(fileno(f));
    fclose(f);
  }
  ~TempFile() { close(fd); }
  int fd;
};

TEST(StackDump, TheArmedHandlerWritesAndTheDumpReadsItBackEachTime) {
  const int sig = detail::spare_signal();
  ASSERT_GE(sig, SIGRTMIN);
  TempFile file;
  g_fd = file.fd;
  struct sigaction sa {};
  sa.sa_handler = write_stacks;
  ASSERT_EQ(sigaction(sig, &sa, nullptr), 0);
  EXPECT_NE(detail::spare_signal(), sig);  // taken now
  ASSERT_TRUE(detail::arm_stack_dump(sig, file.fd));
  g_calls = 0;
  std::string stacks;
  pthread_t caller{};
  std::thread watchdog([&] {
    caller = pthread_self();
    stacks = detail::dump_stacks();
    stacks += detail::dump_stacks();  // the file is emptied before each dump
  });
  watchdog.join();
  EXPECT_EQ(g_calls, 2);
  EXPECT_TRUE(pthread_equal(g_thread, caller));  // ran on the dumping thread
  const std::string one = "Thread 0x1 (most recent call first):\n  File \"x.py\", line 3 in f\n";
  EXPECT_EQ(stacks, one + one);
  EXPECT_EQ(detail::dump_stacks(10).substr(0, 10), one.substr(0, 10));  // capped

  // Someone else took the signal since: never raise it (their handler is not a dump).
  sa.sa_handler = other_handler;
  ASSERT_EQ(sigaction(sig, &sa, nullptr), 0);
  EXPECT_EQ(detail::dump_stacks(), "");
  EXPECT_EQ(calls_of_other, 0);

  // Nothing installed: cannot be armed, and a dump is empty.
  sa.sa_handler = SIG_DFL;
  ASSERT_EQ(sigaction(sig, &sa, nullptr), 0);
  EXPECT_FALSE(detail::arm_stack_dump(sig, file.fd));
  EXPECT_EQ(detail::dump_stacks(), "");
}

// A spare real-time signal with write_stacks installed for it, armed to write to `file`.
int install_and_arm(const TempFile& file) {
  const int sig = detail::spare_signal();
  g_fd = file.fd;
  if (sig < SIGRTMIN || !set_handler(sig, write_stacks) || !detail::arm_stack_dump(sig, file.fd)) {
    return -1;
  }
  return sig;
}

TEST(StackDump, ASignalPutBackToItsDefaultIsReportedAsResetNotAnotherHandler) {
  TempFile file;
  const int sig = install_and_arm(file);
  ASSERT_GE(sig, SIGRTMIN);
  EXPECT_FALSE(detail::armed_signal_reset());

  ASSERT_TRUE(set_handler(sig, other_handler));  // taken by someone else: not ours to put back
  EXPECT_FALSE(detail::armed_signal_reset());

  ASSERT_TRUE(set_handler(sig, SIG_DFL));  // what Lightning's Trainer restores after fit
  EXPECT_TRUE(detail::armed_signal_reset());
  EXPECT_EQ(detail::dump_stacks(), "");  // never raised at its default (it would end us)

  ASSERT_TRUE(set_handler(sig, write_stacks));  // installed and armed again
  ASSERT_TRUE(detail::arm_stack_dump(sig, file.fd));
  EXPECT_FALSE(detail::armed_signal_reset());
  EXPECT_FALSE(detail::dump_stacks().empty());

  detail::arm_stack_dump(-1, -1);  // disarmed: nothing to report
  ASSERT_TRUE(set_handler(sig, SIG_DFL));
  EXPECT_FALSE(detail::armed_signal_reset());
}

TEST(StackDump, AForkedChildDoesNotDumpIntoTheParentsFile) {
  TempFile file;
  const int sig = install_and_arm(file);
  ASSERT_GE(sig, SIGRTMIN);
  const pid_t child = fork();
  if (child == 0) _exit(detail::dump_stacks().empty() ? 0 : 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_FALSE(detail::dump_stacks().empty());  // the parent still dumps
  detail::arm_stack_dump(-1, -1);
  EXPECT_EQ(detail::dump_stacks(), "");
  set_handler(sig, SIG_DFL);
}

}  // namespace
}  // namespace steptrace
