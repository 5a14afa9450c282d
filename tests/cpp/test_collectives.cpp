// Host-timed collectives (the comm object of a step) and records written from outside the
// core (the cross-rank view's cluster records and alerts).
#include <gtest/gtest.h>

#include <thread>

#include "backends/fake/fake_backends.hpp"
#include "core/collective_timer.hpp"
#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;

constexpr std::int64_t kMs = 1'000'000;

TEST(CollectiveTimer, OverlappingCollectivesCountOnceAndExposedIsAfterTheLastLaunch) {
  detail::CollectiveTimer t;
  // Two buckets: the first launched at 10 ms and done at 30, the second launched at 20
  // (queued behind the first) and done at 45. Outstanding 10..45 = 35 ms, not 20 + 25.
  t.begin(10 * kMs);
  t.begin(20 * kMs);
  EXPECT_EQ(t.in_flight(), 2);
  t.end(10 * kMs, 30 * kMs, 3);
  t.end(20 * kMs, 45 * kMs, 4);
  EXPECT_EQ(t.in_flight(), 0);
  const detail::CommStats s = t.take();
  EXPECT_EQ(s.count, 2);
  EXPECT_EQ(s.busy_ns, 35 * kMs);
  EXPECT_EQ(s.exposed_ns, 25 * kMs);  // blocked from the last launch (20) to the last end (45)
  EXPECT_EQ(s.exposed_phase, 4);      // the phase open when the last one completed
  EXPECT_EQ(t.take().count, 0);       // take() resets
}

// NCCL's work completes on the device while the host goes on (its future is complete at
// enqueue): such a collective counts as outstanding time, never as time the step blocked.
TEST(CollectiveTimer, WorkTheHostDidNotWaitForIsOutstandingNotBlocked) {
  detail::CollectiveTimer t;
  t.begin(10 * kMs);
  t.end(10 * kMs, 60 * kMs, 2, /*host_blocked=*/false);
  detail::CommStats s = t.take();
  EXPECT_EQ(s.count, 1);
  EXPECT_EQ(s.busy_ns, 50 * kMs);
  EXPECT_EQ(s.exposed_ns, 0);
  EXPECT_EQ(s.exposed_phase, -1);
  // one the host waited for beside it: only that one's wait is blocked time
  t.begin(100 * kMs);
  t.begin(110 * kMs);
  t.end(100 * kMs, 130 * kMs, 3, /*host_blocked=*/false);
  t.end(110 * kMs, 120 * kMs, 4);
  s = t.take();
  EXPECT_EQ(s.busy_ns, 30 * kMs);
  EXPECT_EQ(s.exposed_ns, 10 * kMs);
  EXPECT_EQ(s.exposed_phase, 4);
}

struct FakeClockRun {
  explicit FakeClockRun(const TempDir& tmp) {
    Config config = testing::run_config(tmp);
    Backends backends;
    auto c = std::make_unique<fake::FakeClock>();
    clock = c.get();
    backends.clock = std::move(c);
    prof = std::make_unique<Profiler>(config, RunInfo{}, std::move(backends));
  }
  fake::FakeClock* clock;
  std::unique_ptr<Profiler> prof;
};

TEST(Collectives, AStepGetsTheCommOfCollectivesCompletedOnAnotherThread) {
  TempDir tmp;
  FakeClockRun run(tmp);
  Profiler& p = *run.prof;
  {
    auto step = p.step();
    auto fwd = step.phase("forward");
    run.clock->advance(8 * kMs);
  }
  {
    auto step = p.step();
    auto bwd = step.phase("backward");
    run.clock->advance(5 * kMs);
    const std::int64_t token = p.collective_begin();  // the last bucket is launched here
    EXPECT_EQ(p.collectives_in_flight(), 1);
    EXPECT_EQ(p.current_phase(), "backward");
    run.clock->advance(3 * kMs);
    // completes on the backend's thread while the training thread waits in backward
    std::thread([&] { p.collective_end(token); }).join();
    EXPECT_EQ(p.collectives_in_flight(), 0);
  }
  p.close();
  const auto steps = of_kind(read_jsonl(p.log_path()), "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_FALSE(steps[0].contains("comm"));  // no collective: no comm object
  const auto& comm = steps[1].at("comm");
  EXPECT_EQ(comm.at("method"), "host");
  EXPECT_EQ(comm.at("collectives"), 1);
  EXPECT_DOUBLE_EQ(comm.at("comm_ms").get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(comm.at("exposed_ms").get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(comm.at("compute_ms").get<double>(), steps[1].at("host_ms").get<double>() - 3.0);
  EXPECT_EQ(comm.at("exposed_in"), "backward");
}

// A barrier between two steps (every rank waits while rank 0 saves a checkpoint): the next
// step's comm says how long the host was blocked in it before the step began, apart from
// the step's own blocked time.
TEST(Collectives, ACollectiveBetweenStepsIsTheGapsBlockedTime) {
  TempDir tmp;
  FakeClockRun run(tmp);
  Profiler& p = *run.prof;
  {
    auto step = p.step();
    run.clock->advance(4 * kMs);
  }
  const std::int64_t barrier = p.collective_begin();
  run.clock->advance(300 * kMs);
  p.collective_end(barrier);
  {
    auto step = p.step();
    auto bwd = step.phase("backward");
    run.clock->advance(2 * kMs);
    const std::int64_t token = p.collective_begin();
    run.clock->advance(1 * kMs);
    p.collective_end(token);
  }
  p.close();
  const auto steps = of_kind(read_jsonl(p.log_path()), "step");
  ASSERT_EQ(steps.size(), 2u);
  const auto& comm = steps[1].at("comm");
  EXPECT_DOUBLE_EQ(comm.at("blocked_between_ms").get<double>(), 300.0);
  EXPECT_DOUBLE_EQ(comm.at("exposed_ms").get<double>(), 1.0);  // the step's own
  EXPECT_EQ(comm.at("collectives"), 2);
  EXPECT_FALSE(steps[0].contains("comm"));
}

// nccl-tests' bandwidths (doc/PERFORMANCE.md): algbw = S / t, busbw = algbw x the bus
// factor (all-reduce on 4 ranks: 2 x 3 / 4 = 1.5); t here is the step's outstanding time.
TEST(Collectives, AStepWithSizedCollectivesGetsAlgorithmAndBusBandwidth) {
  TempDir tmp;
  FakeClockRun run(tmp);
  Profiler& p = *run.prof;
  {
    auto step = p.step();
    const std::int64_t token = p.collective_begin();
    run.clock->advance(4 * kMs);  // 100 MB in 4 ms: 25 GB/s
    p.collective_end(token, /*host_blocked=*/true, 100'000'000, 150'000'000);
  }
  {
    auto step = p.step();
    p.collective_end(p.collective_begin());  // a size nobody knows: no bandwidth
  }
  p.close();
  const auto steps = of_kind(read_jsonl(p.log_path()), "step");
  ASSERT_EQ(steps.size(), 2u);
  const auto& comm = steps[0].at("comm");
  EXPECT_EQ(comm.at("bytes"), 100'000'000);
  EXPECT_DOUBLE_EQ(comm.at("algbw_gbps").get<double>(), 25.0);
  EXPECT_DOUBLE_EQ(comm.at("busbw_gbps").get<double>(), 37.5);
  EXPECT_FALSE(steps[1].at("comm").contains("algbw_gbps"));
}

TEST(Collectives, WriteRecordAcceptsClusterRecordsAndCountsItsAlerts) {
  TempDir tmp;
  FakeClockRun run(tmp);
  Profiler& p = *run.prof;
  std::vector<std::string> seen;
  p.set_alert_callback([&](const std::string& line) { seen.push_back(line); });
  p.write_record(R"({"kind":"cluster","rank":7,"step":49,"ranks":[]})");
  p.write_record(
      R"({"kind":"alert","type":"straggler","step":49,"value":1,"baseline":1,"threshold":1,"message":"m","subject_rank":1})");
  p.write_record(
      R"({"kind":"resolved","type":"straggler","step":99,"first_step":49,"repeats":2,"message":"m"})");
  // Nothing half-written for bad input: each names what is wrong and what is allowed.
  EXPECT_THROW(p.write_record("not json"), UsageError);
  EXPECT_THROW(p.write_record(R"({"kind":"step","step":1})"), UsageError);
  EXPECT_THROW(p.write_record(R"({"kind":"alert","step":1})"), UsageError);
  p.close();
  p.write_record(R"({"kind":"cluster","step":50,"ranks":[]})");  // after close: nothing
  const auto records = read_jsonl(p.log_path());
  const auto clusters = of_kind(records, "cluster");
  ASSERT_EQ(clusters.size(), 1u);
  EXPECT_EQ(clusters[0].at("rank"), 0);  // the writer's rank, whatever the caller said
  ASSERT_EQ(of_kind(records, "alert").size(), 1u);
  EXPECT_EQ(of_kind(records, "alert")[0].at("subject_rank"), 1);
  const auto end = of_kind(records, "run_end").at(0);
  EXPECT_EQ(end.at("alerts").at("straggler"), 1);
  EXPECT_EQ(end.at("alert_repeats").at("straggler"), 2);
  EXPECT_EQ(seen.size(), 2u);  // the alert and its resolved record reached the callback
}

}  // namespace
}  // namespace steptrace
