#include "core/record_pipeline.hpp"

#include "sinks/jsonl_file_sink.hpp"
#include "sinks/record_tap.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace::detail {
namespace {

using steptrace::testing::read_jsonl;
using steptrace::testing::TempDir;

int open_file(const std::string& path) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
}

void push_steps(RecordPipeline& w, std::int64_t first, std::int64_t count) {
  for (std::int64_t i = first; i < first + count; ++i) {
    StepRecord* r = w.begin_step_record();
    *r = StepRecord{};
    r->step = i;
    r->step_ns = 1000;
    w.commit_step_record();
  }
}

TEST(RecordPipeline, WritesEveryRecordInOrder) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  {
    RecordPipeline w(std::make_unique<JsonlFileSink>(open_file(path)), "{\"kind\":\"run_start\"}\n",
                     0, names, 16, std::chrono::milliseconds(100));
    push_steps(w, 0, 5000);  // far more than the ring holds: the producer waits
    w.push_line("{\"kind\":\"alert\"}\n");
    w.close(RunEnd{"normal", {}, 1, 0.5, 0});
    EXPECT_GT(w.waits(), 0);
    EXPECT_EQ(w.capacity(), 16u);  // memory stayed bounded by the ring
  }
  const auto records = read_jsonl(path);
  ASSERT_EQ(records.size(), 5000u + 3u);
  EXPECT_EQ(records.front()["kind"], "run_start");
  for (std::int64_t i = 0; i < 5000; ++i) ASSERT_EQ(records[1 + i]["step"], i);
  EXPECT_EQ(records[5001]["kind"], "alert");
  EXPECT_EQ(records.back()["kind"], "run_end");
  EXPECT_EQ(records.back()["steps"], 5000);
}

TEST(RecordPipeline, APushedRecordCarriesItsOwnPhasesWhateverItsRingSlotHeld) {
  // push_step_record copies the phase arrays' first entries whole and the rest by count:
  // each record must come out with its own phases, fewer or more than the slot's last.
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  for (std::size_t i = 0; i < kMaxPhases; ++i) names.intern("p" + std::to_string(i));
  const std::vector<std::uint16_t> counts = {32, 3, 9, 0, 8, 1, 32, 2, 7, 31};
  const std::int64_t steps = 60;  // the 4-slot ring is reused 15 times
  {
    RecordPipeline w(std::make_unique<JsonlFileSink>(open_file(path)), "{\"kind\":\"run_start\"}\n",
                     0, names, 4, std::chrono::milliseconds(100));
    for (std::int64_t step = 0; step < steps; ++step) {
      StepRecord r;
      r.step = step;
      r.step_ns = 1'000'000'000;
      r.phase_count = counts[static_cast<std::size_t>(step) % counts.size()];
      for (std::uint16_t i = 0; i < r.phase_count; ++i) {
        r.phase_ids[i] = static_cast<std::uint16_t>(kMaxPhases - 1 - i);  // not the slot
        r.phase_ns[i] = r.host_phase_ns[i] = (step + 1) * 1'000'000 + i * 1000;
      }
      w.push_step_record(r);
    }
    w.close(RunEnd{"normal", {}, 1, 0.5, 0});
  }
  const auto records = read_jsonl(path);
  ASSERT_EQ(records.size(), static_cast<std::size_t>(steps) + 2);
  for (std::int64_t step = 0; step < steps; ++step) {
    const auto& phases = records[1 + step]["phases_ms"];
    const std::size_t count = counts[static_cast<std::size_t>(step) % counts.size()];
    ASSERT_EQ(phases.size(), count) << "step " << step;
    for (std::size_t i = 0; i < count; ++i) {
      const std::string name = "p" + std::to_string(kMaxPhases - 1 - i);
      ASSERT_TRUE(phases.contains(name)) << "step " << step << " phase " << name;
      EXPECT_NEAR(phases[name].get<double>(), static_cast<double>(step + 1) + i * 1e-3, 1e-9)
          << "step " << step << " phase " << name;
    }
  }
}

TEST(RecordPipeline, AFullRingWakesTheWriterAtOnce) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  // A flush interval far longer than the test: only the producer's wake-ups can drain.
  RecordPipeline w(std::make_unique<JsonlFileSink>(open_file(path)), "{\"kind\":\"run_start\"}\n",
                   0, names, 16, std::chrono::milliseconds(60000));
  const auto start = std::chrono::steady_clock::now();
  push_steps(w, 0, 5000);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  w.close(RunEnd{"normal", {}, 1, 0.5, 0});
  EXPECT_EQ(read_jsonl(path).size(), 5002u);
}

TEST(RecordPipeline, FlushMakesRecordsVisible) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  // An interval far longer than the test: only flush() can get the records out.
  RecordPipeline w(std::make_unique<JsonlFileSink>(open_file(path)), "{\"kind\":\"run_start\"}\n",
                   0, names, 64, std::chrono::milliseconds(60000));
  EXPECT_EQ(read_jsonl(path).size(), 1u);  // run_start is written at construction
  push_steps(w, 0, 10);
  w.flush();
  EXPECT_EQ(read_jsonl(path).size(), 11u);
  w.close(RunEnd{"normal", {}, 1, 0.5, 0});
  w.close(RunEnd{"normal", {}, 1, 0.5, 0});  // idempotent
  w.flush();                                 // no-op once closed
  EXPECT_EQ(read_jsonl(path).size(), 12u);
}

TEST(RecordPipeline, RecordsReachTheFileWithinTheFlushInterval) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  RecordPipeline w(std::make_unique<JsonlFileSink>(open_file(path)), "{\"kind\":\"run_start\"}\n",
                   0, names, 64, std::chrono::milliseconds(20));
  push_steps(w, 0, 3);
  // Poll (not sleep-and-hope): the writer's own timer must get the lines out.
  const auto start = std::chrono::steady_clock::now();
  while (read_jsonl(path).size() < 4 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
    std::this_thread::yield();
  }
  EXPECT_EQ(read_jsonl(path).size(), 4u);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  w.close(RunEnd{"normal", {}, 1, 0.5, 0});
}

TEST(RecordPipeline, DestructorWritesRunEnd) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  {
    RecordPipeline w(std::make_unique<JsonlFileSink>(open_file(path)), "{\"kind\":\"run_start\"}\n",
                     0, names, 64, std::chrono::milliseconds(100));
    push_steps(w, 0, 2);
  }
  const auto records = read_jsonl(path);
  ASSERT_EQ(records.size(), 4u);
  EXPECT_EQ(records.back()["reason"], "exit");
}

// Runs `body` on a thread and fails (ending the test binary: a hung thread cannot be
// joined) when it does not return within `limit`.
void within(std::chrono::seconds limit, const std::function<void()>& body) {
  std::packaged_task<void()> task(body);
  auto done = task.get_future();
  std::thread t(std::move(task));
  if (done.wait_for(limit) != std::future_status::ready) {
    ADD_FAILURE() << "did not return within " << limit.count() << " s (a hang)";
    std::_Exit(1);
  }
  t.join();
}

TEST(RecordPipeline, AClosedWriterDropsAndCountsInsteadOfWaiting) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  RecordPipeline w(std::make_unique<JsonlFileSink>(open_file(path)), "{\"kind\":\"run_start\"}\n",
                   0, names, 16, std::chrono::milliseconds(60000));
  push_steps(w, 0, 3);
  w.close(RunEnd{"normal", {}, 1, 0.5, 0});
  // Nothing drains the ring any more: far more records than it holds must not wait.
  within(std::chrono::seconds(30), [&] {
    for (int i = 0; i < 100; ++i) EXPECT_EQ(w.begin_step_record(), nullptr);
    StepRecord r;
    w.push_step_record(r);
  });
  EXPECT_EQ(w.dropped(), 101);
  EXPECT_EQ(w.waits(), 0);
  const auto records = read_jsonl(path);
  ASSERT_EQ(records.size(), 5u);  // run_start, 3 steps, run_end: nothing after run_end
  EXPECT_EQ(records.back()["kind"], "run_end");
  EXPECT_EQ(records.back()["dropped_steps"], 0);
}

TEST(RecordPipeline, WriteErrorsAreCountedAndReportedInRunEnd) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  // /dev/full fails every write with ENOSPC, like a full disk.
  const int fd = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  RecordPipeline w(std::make_unique<JsonlFileSink>(fd), "{\"kind\":\"run_start\"}\n", 0, names, 64,
                   std::chrono::milliseconds(60000));
  EXPECT_EQ(w.write_errors(), 1);  // run_start
  push_steps(w, 0, 10);
  w.flush();  // the batch is lost: counted, training goes on
  EXPECT_EQ(w.write_errors(), 2);
  EXPECT_EQ(w.first_errno(), ENOSPC);
  EXPECT_EQ(w.last_errno(), ENOSPC);
  // Space again (the same descriptor now names a real file): run_end says what was lost.
  const int file = open_file(path);
  ASSERT_GE(file, 0);
  ASSERT_EQ(::dup2(file, fd), fd);
  ::close(file);
  push_steps(w, 10, 2);
  w.close(RunEnd{"normal", {}, 1, 0.5, 0});
  const auto records = read_jsonl(path);
  ASSERT_EQ(records.size(), 3u);  // the two steps after the disk had room, and run_end
  EXPECT_EQ(records[0]["step"], 10);
  const auto& end = records.back();
  EXPECT_EQ(end["kind"], "run_end");
  EXPECT_EQ(end["write_errors"], 2);
  EXPECT_EQ(end["write_error"], std::strerror(ENOSPC));
  EXPECT_EQ(end["steps"], 12);  // handed over, including the ones the disk lost
  EXPECT_EQ(w.write_errors(), 2);
}

}  // namespace
}  // namespace steptrace::detail

namespace steptrace::detail {
namespace {

// What a sink is handed, in order: each typed call ("step 3", "alert hang", "resolved hang",
// "cluster 1") with the count of lines written to it before the call, and every line.
class RecordingSink final : public RecordSink {
 public:
  struct Call {
    std::string what;
    std::size_t lines_before;
    std::thread::id thread;
  };
  std::string_view name() const noexcept override { return "recording"; }
  void write(std::string_view batch) override {
    for_each_line(batch, [&](std::string_view line) { lines.emplace_back(line); });
  }
  void on_step(const StepRecord& r) override { add(fmt::format("step {}", r.step)); }
  void on_alert(const AlertEvent& e) override {
    add(fmt::format("{} {} at {}", e.resolved ? "resolved" : "alert", e.type, e.step));
  }
  void on_cluster(const nlohmann::ordered_json& record) override {
    add(fmt::format("cluster {}", record.at("window").get<int>()));
  }
  std::vector<Call> calls;
  std::vector<std::string> lines;

 private:
  void add(std::string what) {
    calls.push_back({std::move(what), lines.size(), std::this_thread::get_id()});
  }
};

// The typed call a line of the log stands for ("" for run_start and run_end).
std::string typed_call_of(const nlohmann::json& j) {
  const std::string kind = j.at("kind");
  if (kind == "step") return fmt::format("step {}", j.at("step").get<int>());
  if (kind == "alert" || kind == "resolved") {
    return fmt::format("{} {} at {}", kind, j.at("type").get<std::string>(),
                       j.at("step").get<int>());
  }
  if (kind == "cluster") return fmt::format("cluster {}", j.at("window").get<int>());
  return "";
}

// A detector stand-in: a stall alert after step 2 (on the writer thread).
class StallAtStepTwo final : public StepObserver {
 public:
  void on_step(const StepRecord& r, AlertOutput& out) override {
    if (r.step != 2) return;
    AlertEvent e;
    e.type = "stall";
    e.step = r.step;
    out.alert(e, alert_json_line(e, 0));
  }
  std::map<std::string, std::int64_t> alert_counts() const override { return {}; }
};

TEST(RecordPipeline, SinksGetAlertsAndClusterRecordsTypedInOrderWithTheLines) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  StallAtStepTwo observer;
  RecordingSink sink;
  {
    RecordPipeline w(std::make_unique<JsonlFileSink>(open_file(path)), "{\"kind\":\"run_start\"}\n",
                     0, names, 64, std::chrono::milliseconds(60000), &observer, nullptr, {&sink});
    push_steps(w, 0, 3);
    w.flush();
    // A watchdog's alert from its own thread, a cluster record, the alert's end.
    std::thread::id pusher;
    std::thread watchdog([&] {
      pusher = std::this_thread::get_id();
      AlertEvent hang;
      hang.type = "hang";
      hang.step = 2;
      hang.details = {{"stacks", "main"}};
      w.push_alert(hang, alert_json_line(hang, 0));
    });
    watchdog.join();
    nlohmann::ordered_json cluster = {
        {"kind", "cluster"}, {"rank", 0}, {"window", 1}, {"world_size", 2}, {"stragglers", {1}}};
    w.push_cluster(cluster, cluster.dump() + "\n");
    AlertEvent resolved;
    resolved.resolved = true;
    resolved.type = "hang";
    resolved.step = 2;
    resolved.first_step = 2;
    w.push_alert(resolved, alert_json_line(resolved, 0), /*now=*/false);
    w.flush();
    push_steps(w, 3, 2);
    w.close(RunEnd{"normal", {}, 1, 0.5, 0});
    // Up to the second flush everything came from the writer thread: neither this thread
    // nor the one that pushed the alert (close() drains the rest on the closing thread).
    ASSERT_GE(sink.calls.size(), 7u);
    const std::thread::id writer = sink.calls.front().thread;
    EXPECT_NE(writer, std::this_thread::get_id());
    EXPECT_NE(writer, pusher);
    for (std::size_t i = 0; i < 7; ++i)
      EXPECT_EQ(sink.calls[i].thread, writer) << sink.calls[i].what;
  }
  const std::vector<std::string> expected = {"step 0",
                                             "step 1",
                                             "step 2",
                                             "alert stall at 2",
                                             "alert hang at 2",
                                             "cluster 1",
                                             "resolved hang at 2",
                                             "step 3",
                                             "step 4"};
  std::vector<std::string> called;
  for (const auto& call : sink.calls) called.push_back(call.what);
  EXPECT_EQ(called, expected);
  // The lines, to the log and to the sink, in the same order; each typed call came before
  // the write() that had its line.
  std::vector<std::string> in_log;
  for (const auto& record : read_jsonl(path)) {
    if (const std::string call = typed_call_of(record); !call.empty()) in_log.push_back(call);
  }
  EXPECT_EQ(in_log, expected);
  std::vector<std::string> in_sink;
  std::size_t next_call = 0;
  for (std::size_t i = 0; i < sink.lines.size(); ++i) {
    const std::string call = typed_call_of(nlohmann::json::parse(sink.lines[i]));
    if (call.empty()) continue;
    in_sink.push_back(call);
    ASSERT_LT(next_call, sink.calls.size());
    EXPECT_EQ(sink.calls[next_call].what, call);
    EXPECT_LE(sink.calls[next_call].lines_before, i) << call;
    ++next_call;
  }
  EXPECT_EQ(in_sink, expected);
  EXPECT_EQ(nlohmann::json::parse(sink.lines.back())["kind"], "run_end");
}

// A stage whose records wait until the test says their data came; it notes a record
// completed with force while its data was still missing.
class WaitsForData final : public StepCompleter {
 public:
  void arrived(StepRecord& /*r*/) override {}
  bool complete(StepRecord& r, bool force) override {
    const bool ready = data_came.load();
    if (force && !ready) forced_without_data.push_back(r.step);
    return ready || force;
  }
  void finish() noexcept override {}
  std::string run_end_fields() override { return ""; }
  std::atomic<bool> data_came{false};
  std::vector<std::int64_t> forced_without_data;  // writer thread, then after close
};

// Tells the test when the writer has handed an alert to the sinks.
class AlertSignal final : public RecordSink {
 public:
  std::string_view name() const noexcept override { return "signal"; }
  void write(std::string_view /*batch*/) override {}
  void on_step(const StepRecord& /*r*/) override { steps_written.fetch_add(1); }
  void on_alert(const AlertEvent& /*e*/) override { alerted.set_value(); }
  std::promise<void> alerted;
  std::atomic<int> steps_written{0};
};

// An alert from another thread (an XID from the NVML sampler, a hang from the watchdog)
// goes out at once, but does not force the steps still waiting for their data: written
// then, they would lack their telemetry for good.
TEST(RecordPipeline, AnAlertGoesOutAtOnceWhileStepsWaitingForDataKeepWaiting) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  WaitsForData stage;
  AlertSignal sink;
  std::future<void> alerted = sink.alerted.get_future();
  {
    RecordPipeline w(std::make_unique<JsonlFileSink>(open_file(path)), "{\"kind\":\"run_start\"}\n",
                     0, names, 64, std::chrono::milliseconds(60000), nullptr, &stage, {&sink});
    push_steps(w, 0, 2);
    AlertEvent xid;
    xid.type = "hardware_error";
    xid.step = 1;
    std::thread sampler([&] { w.push_alert(xid, alert_json_line(xid, 0)); });
    sampler.join();
    ASSERT_EQ(alerted.wait_for(std::chrono::seconds(30)), std::future_status::ready);
    EXPECT_EQ(sink.steps_written.load(), 0);
    stage.data_came = true;
    w.close(RunEnd{"normal", {}, 1, 0.5, 0});
  }
  EXPECT_EQ(stage.forced_without_data, std::vector<std::int64_t>{});
  std::vector<std::string> kinds;
  for (const auto& record : read_jsonl(path)) kinds.push_back(record.at("kind"));
  EXPECT_EQ(kinds, (std::vector<std::string>{"run_start", "alert", "step", "step", "run_end"}));
}

TEST(AlertFromJson, ReadsBackWhatAlertJsonLineWrote) {
  AlertEvent a;
  a.type = "hardware_error";
  a.step = 7;
  a.unix_ns = 123;
  a.value = 79;
  a.baseline = 1.5;
  a.threshold = 2;
  a.phase = "forward";
  a.message = "XID 79";
  a.details = {{"kind", "xid"}, {"code", 79}};
  AlertEvent b = alert_from_json(nlohmann::ordered_json::parse(alert_json_line(a, 3)));
  EXPECT_FALSE(b.resolved || b.update);
  EXPECT_EQ(b.type, a.type);
  EXPECT_EQ(b.step, 7);
  EXPECT_EQ(b.unix_ns, 123);
  EXPECT_EQ(b.value, 79);
  ASSERT_TRUE(b.baseline.has_value());
  EXPECT_EQ(*b.baseline, 1.5);
  EXPECT_EQ(b.threshold, 2);
  EXPECT_EQ(b.phase, "forward");
  EXPECT_EQ(b.message, "XID 79");
  EXPECT_EQ(b.details, a.details);

  AlertEvent r;
  r.resolved = true;
  r.type = "stall";
  r.step = 9;
  r.first_step = 4;
  r.repeats = 2;
  b = alert_from_json(nlohmann::ordered_json::parse(alert_json_line(r, 0)));
  EXPECT_TRUE(b.resolved);
  EXPECT_EQ(b.first_step, 4);
  EXPECT_EQ(b.repeats, 2);
  // What Python may leave out or null keeps the defaults.
  b = alert_from_json({{"kind", "alert"}, {"type", "straggler"}, {"baseline", nullptr}});
  EXPECT_EQ(b.type, "straggler");
  EXPECT_FALSE(b.baseline.has_value());
  EXPECT_TRUE(b.phase.empty());
}

TEST(RecordTap, AReaderGetsRunStartThenWhatFollowsItsOpening) {
  RecordTap tap;
  tap.write("{\"kind\":\"run_start\"}\n{\"kind\":\"step\",\"step\":0}\n");  // before any reader
  auto reader = tap.open();
  tap.write("{\"kind\":\"step\",\"step\":1}\n{\"kind\":\"step\",\"step\":2}\n");
  EXPECT_EQ(reader->new_lines(),
            (std::vector<std::string>{"{\"kind\":\"run_start\"}", "{\"kind\":\"step\",\"step\":1}",
                                      "{\"kind\":\"step\",\"step\":2}"}));
  EXPECT_TRUE(reader->new_lines().empty());  // each line once
  auto late = tap.open();
  tap.write("{\"kind\":\"run_end\"}\n");
  EXPECT_EQ(reader->new_lines(), (std::vector<std::string>{"{\"kind\":\"run_end\"}"}));
  EXPECT_EQ(late->new_lines(),
            (std::vector<std::string>{"{\"kind\":\"run_start\"}", "{\"kind\":\"run_end\"}"}));
}

TEST(RecordTap, AReaderFarBehindLosesTheOldestLinesAndCountsThem) {
  RecordTap tap;
  tap.write("start\n");
  auto reader = tap.open();
  for (std::size_t i = 0; i < RecordTap::kMaxLines + 10; ++i) tap.write(std::to_string(i) + "\n");
  const std::vector<std::string> lines = reader->new_lines();
  ASSERT_EQ(lines.size(), RecordTap::kMaxLines);
  EXPECT_EQ(lines.front(), "10");  // run_start and lines 0-9 went first
  EXPECT_EQ(reader->dropped(), 11);
}

TEST(RecordTap, AReaderOpenedForStepsIsGivenNoOtherKind) {
  RecordTap tap;
  tap.write("{\"kind\":\"run_start\"}\n");
  auto steps = tap.open({"step"});
  auto all = tap.open();
  tap.write(
      "{\"kind\":\"step\",\"step\":0}\n{\"kind\":\"alert\",\"type\":\"stall\"}\n"
      "{\"kind\":\"stepping\"}\n{\"rank\":0,\"kind\":\"step\",\"step\":1}\n"
      "{\"rank\":0,\"kind\":\"cluster\"}\nnot json\n{\"kind\":\"run_end\"}\n");
  // run_start is not a step either; a kind that is not the record's first member is read
  // from the object
  EXPECT_EQ(steps->new_lines(),
            (std::vector<std::string>{"{\"kind\":\"step\",\"step\":0}",
                                      "{\"rank\":0,\"kind\":\"step\",\"step\":1}"}));
  EXPECT_EQ(all->new_lines().size(), 8u);
  auto alerts = tap.open({"alert", "run_start"});
  tap.write("{\"kind\":\"alert\"}\n{\"kind\":\"step\"}\n");
  EXPECT_EQ(alerts->new_lines(),
            (std::vector<std::string>{"{\"kind\":\"run_start\"}", "{\"kind\":\"alert\"}"}));
}

TEST(RecordTap, OtherKindsTakeNoPlaceInAFilteredReadersBoundedQueue) {
  RecordTap tap;
  tap.write("{\"kind\":\"run_start\"}\n");
  auto steps = tap.open({"step"});
  auto all = tap.open();
  // As many alerts as the queue holds, between as many steps: a reader of steps keeps
  // every step and loses none; the reader of every kind keeps the newest kMaxLines.
  std::string batch;
  for (std::size_t i = 0; i < RecordTap::kMaxLines; ++i) {
    batch.clear();
    batch.append("{\"kind\":\"step\",\"step\":").append(std::to_string(i)).append("}\n");
    batch.append("{\"kind\":\"alert\",\"type\":\"stall\"}\n");
    tap.write(batch);
  }
  const std::vector<std::string> got = steps->new_lines();
  ASSERT_EQ(got.size(), RecordTap::kMaxLines);
  EXPECT_EQ(got.front(), "{\"kind\":\"step\",\"step\":0}");
  EXPECT_EQ(steps->dropped(), 0);
  EXPECT_EQ(all->new_lines().size(), RecordTap::kMaxLines);
  EXPECT_EQ(all->dropped(), static_cast<std::int64_t>(RecordTap::kMaxLines) + 1);
}

TEST(RecordTap, AProfilersReaderOfStepsGetsStepsOnly) {
  testing::TempDir tmp;
  Config config;
  config.log_dir = tmp.str("run");
  Profiler prof(config);
  auto next = prof.record_reader({"step"});
  for (int i = 0; i < 3; ++i) {
    auto s = prof.step();
  }
  prof.write_record(R"({"kind":"alert","type":"external","message":"m"})");
  prof.close();
  std::vector<std::string> lines = next();
  ASSERT_EQ(lines.size(), 3u);
  for (const std::string& line : lines) EXPECT_EQ(nlohmann::json::parse(line)["kind"], "step");
}

TEST(RecordTap, AProfilersReaderFollowsItsRecordsWithoutTheFile) {
  testing::TempDir tmp;
  Config config;
  config.log_dir = tmp.str("run");
  Profiler prof(config);
  auto next = prof.record_reader();
  { auto s = prof.step(); }
  prof.close();
  std::vector<std::string> lines = next();
  ASSERT_GE(lines.size(), 3u);
  std::filesystem::remove_all(tmp.str("run"));  // nothing below reads the file
  EXPECT_EQ(nlohmann::json::parse(lines.front())["kind"], "run_start");
  EXPECT_EQ(nlohmann::json::parse(lines[1])["kind"], "step");
  EXPECT_EQ(nlohmann::json::parse(lines.back())["kind"], "run_end");
  EXPECT_TRUE(next().empty());
}

}  // namespace
}  // namespace steptrace::detail
