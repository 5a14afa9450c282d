// The host figures of a step: schedstat (run-queue wait, time on a CPU) and /proc/stat's
// steal. The texts are the kernel's documented formats (Documentation/scheduler/
// sched-stats.rst for schedstat; proc(5) for /proc/stat: "cpuN user nice system idle iowait
// irq softirq steal guest guest_nice", in USER_HZ ticks).
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "core/host/host_readings.hpp"
#include "core/host/host_steal.hpp"
#include "core/host/run_queue.hpp"

namespace steptrace::detail {
namespace {

TEST(Schedstat, ParsesTimeOnACpuAndTheRunQueueWait) {
  const std::string text = "564177204 460144 44\n";
  const SchedStat s = parse_schedstat(text.data(), text.size());
  EXPECT_EQ(s.on_cpu_ns, 564177204);
  EXPECT_EQ(s.wait_ns, 460144);
  for (const std::string bad : {"", "12", "12x 3 4", " 1 2 3"}) {
    EXPECT_EQ(parse_schedstat(bad.data(), bad.size()).wait_ns, -1) << bad;
  }
}

TEST(Schedstat, ThisThreadsOwnReadingMovesWithItsWork) {
  RunQueueReader reader;
  const SchedStat before = reader.read();
  if (before.wait_ns < 0) GTEST_SKIP() << "no /proc/thread-self/schedstat on this kernel";
  volatile double x = 0;
  for (int i = 0; i < 20'000'000; ++i) x = x + 1.0 / (i + 1);
  const SchedStat after = reader.read();
  EXPECT_GT(after.on_cpu_ns, before.on_cpu_ns);
  EXPECT_GE(after.wait_ns, before.wait_ns);
}

constexpr const char* kProcStat =
    "cpu  2265333 861540 380269 944431 8944 0 4409 8961 0 0\n"
    "cpu0 1027403 445561 170077 584498 2458 0 2468 4503 0 0\n"
    "cpu1 1237930 415978 210191 359932 6486 0 1940 4458 0 0\n"
    "intr 123 4 5\n"
    "ctxt 99\n";

TEST(ProcStat, ReadsEachCpusStealColumnAndNotTheSum) {
  std::array<std::int64_t, 4> steal{};
  const std::string text = kProcStat;
  ASSERT_EQ(parse_proc_stat_steal(text.data(), text.size(), steal.data(), 4), 2);
  EXPECT_EQ(steal[0], 4503);
  EXPECT_EQ(steal[1], 4458);
  // a line the buffer cut is not read; a malformed CPU line fails the read
  EXPECT_EQ(parse_proc_stat_steal(text.data(), text.find("cpu1") + 20, steal.data(), 4), 1);
  const std::string bad = "cpu0 1 2 3\n";
  EXPECT_EQ(parse_proc_stat_steal(bad.data(), bad.size(), steal.data(), 4), -1);
}

std::string write_stat(const std::string& path, long steal0, long steal1) {
  std::ofstream(path) << "cpu  1 1 1 1 1 0 0 " << steal0 + steal1 << " 0 0\n"
                      << "cpu0 1 1 1 1 1 0 0 " << steal0 << " 0 0\n"
                      << "cpu1 1 1 1 1 1 0 0 " << steal1 << " 0 0\nintr 1\n";
  return path;
}

TEST(StealReader, CountsTheMostAnyOneCpuLostBetweenReads) {
  const std::string path = ::testing::TempDir() + "steal_stat";
  const std::int64_t tick_ns = 1'000'000'000 / ::sysconf(_SC_CLK_TCK);
  write_stat(path, 100, 200);
  StealReader reader(path);
  ASSERT_TRUE(reader.available());
  write_stat(path, 103, 201);  // cpu0 lost 3 ticks, cpu1 1: a thread lost at most 3
  EXPECT_EQ(reader.sample(), 3 * tick_ns);
  write_stat(path, 103, 206);
  EXPECT_EQ(reader.sample(), 8 * tick_ns);  // a running total
  EXPECT_EQ(reader.sample(), 8 * tick_ns);
}

TEST(StealReader, NothingToSampleWithoutASteal) {
  const std::string path = ::testing::TempDir() + "steal_stat_bare";
  write_stat(path, 0, 0);  // bare metal: the column stays 0
  EXPECT_FALSE(StealReader(path).available());
  EXPECT_FALSE(StealReader(path + ".missing").available());
}

TEST(StealCadence, ReadsEvery100msUntilStealMovesThen10msForAQuietSecond) {
  StealCadence c;
  EXPECT_EQ(c.period_ms(), 100);  // nothing stolen yet: a tenth of the wake-ups
  for (int i = 0; i < 50; ++i) c.on_read(false, c.period_ms());
  EXPECT_EQ(c.period_ms(), 100);
  c.on_read(true, c.period_ms());  // steal moved: at the steal column's tick
  EXPECT_EQ(c.period_ms(), 10);
  for (int ms = 10; ms < 1000; ms += 10) {
    c.on_read(false, c.period_ms());
    ASSERT_EQ(c.period_ms(), 10) << "after " << ms << " quiet ms";
  }
  c.on_read(true, c.period_ms());  // moved again within the second: the second restarts
  for (int ms = 10; ms < 1000; ms += 10) c.on_read(false, c.period_ms());
  EXPECT_EQ(c.period_ms(), 10);
  c.on_read(false, c.period_ms());  // a whole quiet second: back to 100 ms
  EXPECT_EQ(c.period_ms(), 100);
  EXPECT_FALSE(c.active());
}

// A memory source the watchdog may read (MemorySource::any_thread): its figure counts its
// reads.
class CountingSource final : public MemorySource {
 public:
  const char* name() const noexcept override { return "counting"; }
  void sample(MemorySample& out) noexcept override { out.rss_bytes = ++reads * 4096; }
  std::int64_t min_interval_ns() const noexcept override { return 10'000'000; }
  bool any_thread() const noexcept override { return true; }
  int reads = 0;
};

TEST(HostReadings, ReadsASourceOnceItsIntervalHasPassedAndAStepTakesEachReadingOnce) {
  CountingSource source;
  HostReadings host;
  host.add_source(&source);
  std::uint64_t seen = 0;
  MemorySample m;
  EXPECT_FALSE(host.take_memory(&seen, &m)) << "nothing read yet";
  EXPECT_EQ(host.poll(1'000), 1'000 + 10'000'000) << "read at once; the next read is due then";
  ASSERT_TRUE(host.has_memory_since(seen));
  ASSERT_TRUE(host.take_memory(&seen, &m));
  EXPECT_EQ(m.rss_bytes, 4096);
  EXPECT_FALSE(host.has_memory_since(seen)) << "each reading is taken once";
  EXPECT_FALSE(host.take_memory(&seen, &m));
  host.poll(1'000 + 9'999'999);
  EXPECT_EQ(source.reads, 1);
  EXPECT_FALSE(host.has_memory_since(seen));
  host.poll(1'000 + 10'000'000);
  EXPECT_EQ(source.reads, 2);
  ASSERT_TRUE(host.take_memory(&seen, &m));
  EXPECT_EQ(m.rss_bytes, 8192);
}

// The watchdog reads the stepping thread's schedstat and CPU clock from its own thread.
TEST(HostReadings, ReadsTheRunQueueOfTheSteppingThreadFromAnotherThread) {
  HostReadings host;
  std::uint64_t seen = 0;
  std::int64_t at = 0;
  SchedStat s;
  host.poll(5);
  EXPECT_FALSE(host.has_run_queue_since(seen)) << "no thread to read yet";
  clockid_t cpu_clock{};
  ASSERT_EQ(pthread_getcpuclockid(pthread_self(), &cpu_clock), 0);
  host.watch_thread(static_cast<long>(::syscall(SYS_gettid)), cpu_clock);
  std::thread([&] { host.poll(1'000); }).join();
  if (!host.has_run_queue_since(seen)) GTEST_SKIP() << "no schedstat for threads here";
  ASSERT_TRUE(host.take_run_queue(&seen, &at, &s));
  EXPECT_EQ(at, 1'000);
  EXPECT_GE(s.wait_ns, 0);
  // This thread's work shows in the next reading, though another thread takes it.
  volatile double x = 0;
  for (int i = 0; i < 20'000'000; ++i) x = x + 1.0 / (i + 1);
  std::thread([&] { host.poll(1'000 + 5'000'000); }).join();
  EXPECT_FALSE(host.has_run_queue_since(seen)) << "read at most every 10 ms";
  std::thread([&] { host.poll(1'000 + 10'000'000); }).join();
  SchedStat after;
  ASSERT_TRUE(host.take_run_queue(&seen, &at, &after));
  EXPECT_EQ(at, 1'000 + 10'000'000);
  EXPECT_GT(after.on_cpu_ns - s.on_cpu_ns, 10'000'000)
      << "this thread's CPU time, not the poller's";
  // a reading of a thread the steps have left is not theirs
  host.poll(1'000 + 20'000'000);
  host.watch_thread(1, cpu_clock);
  EXPECT_FALSE(host.take_run_queue(&seen, &at, &after));
}

}  // namespace
}  // namespace steptrace::detail
