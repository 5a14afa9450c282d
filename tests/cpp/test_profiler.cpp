#include "steptrace/profiler.hpp"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/auxv.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include "backends/fake/fake_backends.hpp"
#include "backends/host/monotonic_clock.hpp"
#include "backends/host/tsc_clock.hpp"
#include "core/this_thread.hpp"
#include "profiler_fixture.hpp"
#include "runtime/run_lifecycle.hpp"
#include "steptrace/error.hpp"
#include "steptrace/ext/background_thread.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;
using testing::thread_ids;

using testing::Fixture;
using testing::kMs;

TEST(Profiler, ScopesTimePhasesAndSteps) {
  TempDir tmp;
  Fixture f(tmp);
  {
    auto step = f.prof->step();
    {
      auto p = step.phase("forward");
      f.clock->advance(2 * kMs);
    }
    {
      auto p = step.phase("backward");
      f.clock->advance(3 * kMs);
    }
    f.clock->advance(1 * kMs);  // outside any phase
  }
  const auto records = f.close_and_read();
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["step"], 0);
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["forward"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["backward"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(steps[0]["step_ms"].get<double>(), 6.0);
  EXPECT_DOUBLE_EQ(steps[0]["host_ms"].get<double>(), 6.0);
  EXPECT_EQ(steps[0]["clock"], "host");
  EXPECT_EQ(steps[0]["status"], "ok");
  EXPECT_EQ(records.front()["kind"], "run_start");
  EXPECT_EQ(records.front()["versions"]["python"], "3.11");
  EXPECT_EQ(records.back()["kind"], "run_end");
  EXPECT_EQ(records.back()["reason"], "normal");
}

// The gap between steps is data only where the loader's wait was measured; the rest is
// other host work, and intervals are their own kinds.
TEST(Profiler, MisuseThrowsAndLeavesTheLogValid) {
  TempDir tmp;
  Fixture f(tmp);
  const PhaseId fwd = f.prof->phase_id("forward");
  EXPECT_THROW(f.prof->begin_phase(fwd), UsageError);  // outside a step
  EXPECT_THROW(f.prof->end_step(), UsageError);        // end without start
  f.prof->begin_step();
  EXPECT_THROW(f.prof->begin_step(), UsageError);    // step inside a step
  EXPECT_THROW(f.prof->end_phase(fwd), UsageError);  // end without start
  f.prof->begin_phase(fwd);
  EXPECT_THROW(f.prof->begin_phase(fwd), UsageError);  // nested in itself
  f.prof->begin_data();  // loader inside a step: counted, not thrown (DataInsideAStep...)
  f.prof->end_data();
  f.clock->advance(kMs);
  f.prof->end_phase(fwd);
  f.prof->end_step();
  EXPECT_THROW(f.prof->end_data(), UsageError);
  EXPECT_THROW(f.prof->phase_id(""), ConfigError);
  try {
    f.prof->begin_phase(fwd);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("\"forward\""), std::string::npos) << e.what();
  }
  const auto records = f.close_and_read();
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);  // the misuse did not start, end or corrupt a step
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["forward"].get<double>(), 1.0);
  EXPECT_EQ(records.back()["kind"], "run_end");
}

TEST(Profiler, ExceptionInAStepMarksItFailed) {
  TempDir tmp;
  Fixture f(tmp);
  try {
    auto s = f.prof->step();
    auto p = s.phase("forward");
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  { auto s = f.prof->step(); }
  const auto records = f.close_and_read();
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0]["status"], "error");
  EXPECT_EQ(steps[1]["status"], "ok");
  EXPECT_EQ(records.back()["error_steps"], 1);
}

TEST(Profiler, DestroyedByAnExceptionEndsWithReasonException) {
  TempDir tmp;
  std::string path;
  try {
    Fixture f(tmp);
    path = f.path;
    auto s = f.prof->step();
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  const auto records = read_jsonl(path);
  EXPECT_EQ(records.back()["reason"], "exception");
}

TEST(Profiler, CloseEndsAnOpenStepAsFailedAndIsIdempotent) {
  TempDir tmp;
  Fixture f(tmp);
  f.prof->begin_step();
  f.prof->close(EndReason::kSignal);
  f.prof->close();
  EXPECT_TRUE(f.prof->closed());
  EXPECT_THROW(f.prof->begin_step(), UsageError);
  const auto records = read_jsonl(f.path);
  ASSERT_EQ(of_kind(records, "step").size(), 1u);
  EXPECT_EQ(of_kind(records, "step")[0]["status"], "error");
  EXPECT_EQ(records.back()["reason"], "signal");
  EXPECT_EQ(of_kind(records, "run_end").size(), 1u);
}

TEST(Profiler, FlushMakesStepsVisibleWhileRunning) {
  TempDir tmp;
  Fixture f(tmp);
  for (int i = 0; i < 5; ++i) auto s = f.prof->step();
  f.prof->flush();
  EXPECT_EQ(of_kind(read_jsonl(f.path), "step").size(), 5u);
  EXPECT_EQ(f.prof->step_index(), 5);
}

TEST(Profiler, RegressionAlertFollowsItsStepAndIsCounted) {
  TempDir tmp;
  Fixture f(tmp);
  std::atomic<int> callbacks{0};
  f.prof->set_alert_callback([&](const std::string& line) {
    if (line.find("\"kind\":\"alert\"") != std::string::npos) ++callbacks;
  });
  auto run_step = [&](std::int64_t backward_ms) {
    auto s = f.prof->step();
    auto p = s.phase("backward");
    f.clock->advance(backward_ms * kMs);
  };
  for (int i = 0; i < 30; ++i) run_step(10);
  // a regression's slow steps last regression_min_ms (1,000 ms) in all: 34 of 30 ms
  for (int i = 0; i < 40; ++i) run_step(30);  // steps 30..69: 3x
  run_step(10);
  const auto records = f.close_and_read();
  std::size_t alert_at = 0;
  for (std::size_t i = 0; i < records.size(); ++i) {
    if (records[i]["kind"] == "alert") alert_at = i;
  }
  ASSERT_GT(alert_at, 0u);
  const auto& alert = records[alert_at];
  EXPECT_EQ(alert["type"], "step_regression");
  EXPECT_EQ(alert["step"], 63);
  EXPECT_EQ(alert["phase"], "backward");
  EXPECT_EQ(records[alert_at - 1]["kind"], "step");  // written right after its step
  EXPECT_EQ(records[alert_at - 1]["step"], 63);
  // stamped with its step's end, on the run's clock: never after run_end
  const auto& step63 = records[alert_at - 1];
  EXPECT_EQ(alert["unix_ns"].get<std::int64_t>(),
            step63["start_unix_ns"].get<std::int64_t>() + 30 * kMs);
  EXPECT_LE(alert["unix_ns"].get<std::int64_t>(),
            records.back()["end_unix_ns"].get<std::int64_t>());
  const auto resolved = of_kind(records, "resolved");
  ASSERT_EQ(resolved.size(), 1u);
  EXPECT_EQ(resolved[0]["first_step"], 30);
  EXPECT_EQ(resolved[0]["repeats"], 39);
  EXPECT_EQ(records.back()["alerts"]["step_regression"], 1);
  EXPECT_EQ(records.back()["alert_repeats"]["step_regression"], 39);
  EXPECT_EQ(callbacks.load(), 1);
}

TEST(Profiler, DetectionCanBeTurnedOff) {
  TempDir tmp;
  Fixture f(tmp, [](Config& c) { c.detect = false; });
  for (int i = 0; i < 30; ++i) {
    auto s = f.prof->step();
    f.clock->advance((i == 25 ? 100 : 1) * kMs);
  }
  const auto records = f.close_and_read();
  EXPECT_TRUE(of_kind(records, "alert").empty());
}

TEST(Profiler, RealHostClockAndRss) {
  TempDir tmp;
  Config config;
  config.log_dir = tmp.str();
  config.overwrite = true;
  std::string path;
  {
    Profiler prof(config);
    auto s = prof.step();
    auto p = s.phase("forward");
    path = prof.log_path();
  }
  const auto records = read_jsonl(path);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_GT(steps[0]["memory"]["rss_bytes"].get<std::int64_t>(), 0);
  EXPECT_GE(steps[0]["step_ms"].get<double>(), steps[0]["phases_ms"]["forward"].get<double>());
  EXPECT_EQ(records.front()["backends"]["memory"]["active"][0], "rss");
}

// On the host clock the boundaries read the CPU's counter once it is calibrated (100 ms in,
// then checked every second: tsc_clock.hpp): across both, a phase measures what the
// kernel's clock measures inside and around it.
TEST(HostClock, APhaseMeasuresWhatTheKernelsClockMeasuresAroundIt) {
  TempDir tmp;
  Config config;
  config.log_dir = tmp.str();
  config.overwrite = true;
  config.detect = false;
  struct Bracket {
    std::int64_t outer_ns;  // from before the phase began to after it ended
    std::int64_t inner_ns;  // from after it began to before it ended
  };
  std::vector<Bracket> brackets;
  std::string path;
  {
    Profiler prof(config);
    path = prof.log_path();
    const std::int64_t until = monotonic_now_ns() + 1'300'000'000;  // a calibration, a check
    while (monotonic_now_ns() < until) {
      auto s = prof.step();
      Bracket b{};
      b.outer_ns = -monotonic_now_ns();
      {
        auto p = s.phase("forward");
        b.inner_ns = -monotonic_now_ns();
        const std::int64_t end = monotonic_now_ns() + 2'000'000;  // 2 ms of work
        while (monotonic_now_ns() < end) {
        }
        b.inner_ns += monotonic_now_ns();
      }
      b.outer_ns += monotonic_now_ns();
      brackets.push_back(b);
    }
  }
  const auto records = read_jsonl(path);
  const std::string method = records.front()["backends"]["timer"]["method"];
  EXPECT_EQ(method.find("time-stamp counter") != std::string::npos, tsc_clock_chosen()) << method;
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), brackets.size());
  int outside = 0;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    // phases_ms has four decimals (100 ns); the counter's map is within ~1 us of the clock
    const auto ns = std::llround(steps[i]["phases_ms"]["forward"].get<double>() * 1e6);
    const bool in = ns >= brackets[i].inner_ns - 2'000 && ns <= brackets[i].outer_ns + 2'000;
    outside += !in;
    EXPECT_TRUE(in) << "step " << i << ": " << ns << " ns, the kernel's clock "
                    << brackets[i].inner_ns << " inside and " << brackets[i].outer_ns << " around";
    if (outside > 5) break;
  }
}

TEST(HostClock, ReadsTheKernelsClockThroughTheVdsoAsLibcDoes) {
  const ClockGettime read = vdso_clock_gettime();
#if defined(__GLIBC__) && (defined(__x86_64__) || defined(__aarch64__))
  if (getauxval(AT_SYSINFO_EHDR) != 0) {  // the kernel mapped a vDSO (vdso(7))
    EXPECT_NE(read, &::clock_gettime) << "the vDSO's clock_gettime was not found";
  }
#endif
  for (const clockid_t id : {CLOCK_MONOTONIC, CLOCK_REALTIME}) {
    timespec before{};
    timespec mid{};
    timespec after{};
    ASSERT_EQ(::clock_gettime(id, &before), 0);
    ASSERT_EQ(read(id, &mid), 0);
    ASSERT_EQ(::clock_gettime(id, &after), 0);
    auto ns = [](const timespec& t) { return t.tv_sec * 1'000'000'000LL + t.tv_nsec; };
    EXPECT_LE(ns(before), ns(mid)) << "clock " << id;  // the same clock as libc's
    EXPECT_LE(ns(mid), ns(after)) << "clock " << id;
  }
}

TEST(ThisThreadToken, TellsTheRunningThreadsApart) {
  const void* mine = detail::this_thread_token();
  EXPECT_NE(mine, nullptr);
  EXPECT_EQ(detail::this_thread_token(), mine);
  const void* other = nullptr;
  std::thread([&] { other = detail::this_thread_token(); }).join();  // both alive meanwhile
  EXPECT_NE(other, mine);
}

// ---- lifecycle: close from another thread, fork, SIGTERM ----

// A one-shot event between threads (no sleeps).
class Event {
 public:
  void set() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      set_ = true;
    }
    cv_.notify_all();
  }
  bool wait(std::chrono::seconds limit = std::chrono::seconds(60)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return set_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

// Joins `t`, or ends the test binary when it does not finish in time (a hung thread
// cannot be joined).
void join_within(std::thread& t, std::future<void>& done, std::chrono::seconds limit) {
  if (done.wait_for(limit) != std::future_status::ready) {
    ADD_FAILURE() << "the thread did not finish within " << limit.count() << " s (a hang)";
    std::_Exit(1);
  }
  t.join();
}

Config host_config(const TempDir& tmp) {
  Config c;
  c.log_dir = tmp.str();
  c.overwrite = true;
  c.queue_capacity = 16;  // small: steps not drained would fill it at once
  c.flush_interval_ms = 1;
  return c;
}

TEST(Profiler, CloseFromAnotherThreadWhileTheLoopKeepsStepping) {
  TempDir tmp;
  Profiler prof(host_config(tmp));
  const std::string path = prof.log_path();
  std::atomic<std::int64_t> steps_done{0};
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  Event stepped;
  std::packaged_task<void()> loop([&] {
    const PhaseId fwd = prof.phase_id("forward");
    while (!stop.load()) {
      try {
        auto s = prof.step();
        auto p = s.phase(fwd);
      } catch (const std::exception&) {
        errors.fetch_add(1);  // nothing may reach the training loop
      }
      if (steps_done.fetch_add(1) + 1 == 20) stepped.set();
    }
  });
  auto done = loop.get_future();
  std::thread trainer(std::move(loop));
  ASSERT_TRUE(stepped.wait());
  prof.close();  // from this thread while the loop keeps stepping
  EXPECT_TRUE(prof.closed());
  // Many more steps than the ring holds after the close: none waits, none is recorded.
  const std::int64_t at_close = steps_done.load();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (steps_done.load() < at_close + 200 &&
         done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "the loop stopped stepping after the close (a hang)";
      std::_Exit(1);
    }
    std::this_thread::yield();
  }
  stop.store(true);
  join_within(trainer, done, std::chrono::seconds(60));
  EXPECT_EQ(errors.load(), 0);
  const auto records = read_jsonl(path);
  const auto steps = of_kind(records, "step");
  ASSERT_GE(steps.size(), 20u);
  EXPECT_LE(static_cast<std::int64_t>(steps.size()), at_close + 1);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    ASSERT_EQ(steps[i]["step"], static_cast<std::int64_t>(i));
    EXPECT_EQ(steps[i]["status"], "ok");  // the step in progress ended normally
  }
  EXPECT_EQ(of_kind(records, "run_end").size(), 1u);
  EXPECT_EQ(records.back()["kind"], "run_end");
  EXPECT_EQ(records.back()["steps"], steps.size());
}

TEST(Profiler, CloseFromAnotherThreadWaitsForTheStepInProgress) {
  TempDir tmp;
  Profiler prof(host_config(tmp));
  const std::string path = prof.log_path();
  Event in_step;
  Event go;
  Event closed;
  std::packaged_task<void()> loop([&] {
    {
      auto s = prof.step();
      auto p = s.phase("forward");
      in_step.set();
      go.wait();
    }
    closed.wait();
    auto s = prof.step();  // after the close: not recorded, nothing thrown
    auto p = s.phase("forward");
  });
  auto done = loop.get_future();
  std::thread trainer(std::move(loop));
  ASSERT_TRUE(in_step.wait());
  std::thread closer([&] { prof.close(); });
  go.set();  // whether the close request comes before the step ends or not, it ends normally
  closer.join();
  closed.set();
  join_within(trainer, done, std::chrono::seconds(60));
  const auto records = read_jsonl(path);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["status"], "ok");
  EXPECT_EQ(records.back()["kind"], "run_end");
  EXPECT_EQ(records.back().count("error"), 0u);
}

TEST(Profiler, CloseFromAnotherThreadGivesUpOnAStepThatDoesNotEnd) {
  TempDir tmp;
  Config config = host_config(tmp);
  config.close_wait_s = 0.2;
  Profiler prof(config);
  const std::string path = prof.log_path();
  Event in_step;
  Event go;
  std::packaged_task<void()> loop([&] {
    {
      auto s = prof.step();
      in_step.set();
      go.wait();  // "hung" until the close has returned
    }
    auto s = prof.step();
  });
  auto done = loop.get_future();
  std::thread trainer(std::move(loop));
  ASSERT_TRUE(in_step.wait());
  prof.close(EndReason::kSignal);
  EXPECT_TRUE(prof.closed());
  go.set();
  join_within(trainer, done, std::chrono::seconds(60));
  const auto records = read_jsonl(path);
  EXPECT_TRUE(of_kind(records, "step").empty());
  const auto& end = records.back();
  EXPECT_EQ(end["kind"], "run_end");
  EXPECT_EQ(end["reason"], "signal");
  EXPECT_NE(end["error"].get<std::string>().find("close_wait_s"), std::string::npos);
}

// Runs `child` in a forked process (ended by _exit with its return value, or by a 60 s
// alarm if it hangs) and returns its wait status.
// ---- the lifecycle state machine on its own (runtime/run_lifecycle.hpp) ----

TEST(RunLifecycle, AForeignCloseBetweenStepsDetachesTheTrainingThreadAtOnce) {
  detail::RunLifecycle life;
  life.claim();
  EXPECT_FALSE(life.foreign());
  ASSERT_TRUE(life.stay_attached());
  ASSERT_TRUE(life.enter_step());
  life.leave_step();
  bool foreign = false;
  bool left_running = true;
  std::thread closer([&] {
    foreign = life.foreign();
    left_running = life.request_close_and_wait(std::chrono::seconds(60));
  });
  closer.join();
  EXPECT_TRUE(foreign);
  EXPECT_FALSE(left_running);  // no step running: nothing to wait for
  EXPECT_TRUE(life.close_requested());
  EXPECT_FALSE(life.stay_attached());  // the training thread's next boundary
  EXPECT_TRUE(life.detached());
}

TEST(RunLifecycle, AForeignCloseGivesUpOnAStepInProgressAndItsNextStepIsNotEntered) {
  detail::RunLifecycle life;
  life.claim();
  ASSERT_TRUE(life.enter_step());
  bool left_running = false;
  std::thread closer([&] { left_running = life.request_close_and_wait(std::chrono::seconds(0)); });
  closer.join();
  EXPECT_TRUE(left_running);
  EXPECT_FALSE(life.detached());  // the step in progress is the training thread's
  life.leave_step();
  EXPECT_FALSE(life.enter_step());  // the close came first: not recorded
  EXPECT_TRUE(life.detached());
}

TEST(RunLifecycle, ClosedAndAbandonedOnce) {
  detail::RunLifecycle life;
  EXPECT_FALSE(life.forked());
  EXPECT_NO_THROW(life.check_open());
  life.mark_closed();
  EXPECT_TRUE(life.closed());
  EXPECT_THROW(life.check_open(), UsageError);
  detail::RunLifecycle child;
  EXPECT_TRUE(child.abandon());
  EXPECT_FALSE(child.abandon());
  EXPECT_TRUE(child.detached());
  EXPECT_TRUE(child.closed());
}

int run_forked(const std::function<int()>& child) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(60);
    int rc = 1;
    try {
      rc = child();
    } catch (...) {
      rc = 2;
    }
    ::_exit(rc);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

TEST(Profiler, AForkedChildWritesNothingToTheParentsLog) {
  TempDir tmp;
  auto prof = std::make_unique<Profiler>(host_config(tmp));
  const std::string path = prof->log_path();
  for (int i = 0; i < 5; ++i) auto s = prof->step();
  prof->flush();
  for (const bool close_in_child : {true, false}) {
    const int status = run_forked([&] {
      for (int i = 0; i < 100; ++i) {  // more than the ring holds: no writer thread here
        auto s = prof->step();
        auto p = s.phase("forward");
      }
      prof->flush();
      if (close_in_child) prof->close();
      prof.reset();  // the destructor neither writes nor joins the parent's threads
      return 0;
    });
    ASSERT_TRUE(WIFEXITED(status)) << "child status " << status;
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
  for (int i = 0; i < 3; ++i) auto s = prof->step();
  prof.reset();
  const auto records = read_jsonl(path);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 8u);
  for (std::size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i]["step"], i);
  EXPECT_EQ(of_kind(records, "run_end").size(), 1u);
  EXPECT_EQ(of_kind(records, "run_start").size(), 1u);
}

TEST(Profiler, ItsThreadsLeaveTheProcessesSignalsToTheProgramsThreads) {
  // A SIGTERM sent to the process must reach a thread of the program (under TSan, one that
  // landed on the writer waited out its flush interval), so steptrace's threads block it.
  std::thread([] {}).join();  // a sanitizer's own background thread, if any, starts now
  const std::set<std::string> before = thread_ids();
  TempDir tmp;
  Config config = host_config(tmp);
  config.metrics_port = 0;  // the Prometheus server's thread too
  Profiler prof(config);
  // read once each is past its start (a thread still starting has every signal blocked)
  const auto masks = testing::masks_of_started_threads(before);
  testing::expect_signals_left_to_the_program(masks);
  EXPECT_GE(masks.size(), 2U);  // the writer and the watchdog at least
}

TEST(BackgroundThread, BlocksTheAsynchronousSignalsNotTheFaults) {
  sigset_t caller;
  pthread_sigmask(SIG_BLOCK, nullptr, &caller);
  sigset_t in_thread;
  sigemptyset(&in_thread);
  start_background_thread([&] { pthread_sigmask(SIG_BLOCK, nullptr, &in_thread); }).join();
  EXPECT_EQ(sigismember(&in_thread, SIGTERM), 1);
  EXPECT_EQ(sigismember(&in_thread, SIGINT), 1);
  EXPECT_EQ(sigismember(&in_thread, SIGUSR1), 1);
  // a fault in the thread still reaches the program's handlers (faulthandler)
  EXPECT_EQ(sigismember(&in_thread, SIGSEGV), 0);
  EXPECT_EQ(sigismember(&in_thread, SIGABRT), 0);
  sigset_t here;
  pthread_sigmask(SIG_BLOCK, nullptr, &here);
  // the starting thread's mask is back
  EXPECT_EQ(sigismember(&here, SIGTERM), sigismember(&caller, SIGTERM));
}

TEST(Profiler, SigtermWhileEveryThreadIsBlockedWritesRunEnd) {
  TempDir tmp;
  const std::string path = tmp.str("rank0.jsonl");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(60);
    ::close(ready[0]);
    Config config = host_config(tmp);
    config.flush_interval_ms = 60000;  // only the signal path gets the steps out
    Profiler prof(config);
    for (int i = 0; i < 7; ++i) auto s = prof.step();
    auto s = prof.step();  // still running when the signal comes
    if (!install_sigterm_handler(/*terminate=*/true, /*grace_s=*/0.0)) ::_exit(3);
    (void)!::write(ready[1], "r", 1);
    // Blocked for good in native code: the handler runs, but nothing after it returns to
    // the program. (Not a self-deadlocked mutex: ThreadSanitizer holds a signal back until
    // pthread_mutex_lock returns, so under TSan the handler would never run.)
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child status " << status;
  EXPECT_EQ(WTERMSIG(status), SIGTERM);  // re-raised with the default action
  const auto records = read_jsonl(path);
  EXPECT_EQ(of_kind(records, "step").size(), 7u);
  const auto& end = records.back();
  EXPECT_EQ(end["kind"], "run_end");
  EXPECT_EQ(end["reason"], "signal");
  EXPECT_EQ(end["steps"], 7);
}

}  // namespace
}  // namespace steptrace
