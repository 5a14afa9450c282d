// The Prometheus sink: the registry's exposition from synthetic records, the endpoint of
// a real profiler scraped over HTTP, and the sink seam (a failing sink is isolated).
#include "sinks/prometheus_sink.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/record_pipeline.hpp"
#include "sinks/jsonl_file_sink.hpp"
#include "sinks/metrics_http.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace::detail {
namespace {

using steptrace::testing::of_kind;
using steptrace::testing::read_jsonl;
using steptrace::testing::run_config;
using steptrace::testing::TempDir;

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Parses the text format (no escapes inside label values in these tests' data).
std::vector<Sample> parse(const std::string& text) {
  std::vector<Sample> out;
  std::istringstream in(text);
  const std::regex line_re(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} (\S+)$)");
  const std::regex label_re(R"re(([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)")re");
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::smatch m;
    EXPECT_TRUE(std::regex_match(line, m, line_re)) << line;
    if (m.empty()) continue;
    Sample s;
    s.name = m[1];
    const std::string labels = m[2];
    for (auto it = std::sregex_iterator(labels.begin(), labels.end(), label_re);
         it != std::sregex_iterator(); ++it) {
      s.labels[(*it)[1]] = (*it)[2];
    }
    const std::string v = m[3];
    s.value = v == "+Inf" ? INFINITY : std::stod(v);
    out.push_back(s);
  }
  return out;
}

std::vector<Sample> named(const std::vector<Sample>& all, const std::string& name,
                          const std::map<std::string, std::string>& match = {}) {
  std::vector<Sample> out;
  for (const Sample& s : all) {
    if (s.name != name) continue;
    bool ok = true;
    for (const auto& [k, v] : match) ok = ok && s.labels.count(k) && s.labels.at(k) == v;
    if (ok) out.push_back(s);
  }
  return out;
}

double value_of(const std::vector<Sample>& all, const std::string& name,
                const std::map<std::string, std::string>& match = {}) {
  const auto s = named(all, name, match);
  EXPECT_EQ(s.size(), 1u) << name;
  return s.empty() ? NAN : s[0].value;
}

// Cumulative buckets never fall, and +Inf equals _count.
void check_histogram(const std::vector<Sample>& all, const std::string& name,
                     const std::map<std::string, std::string>& match, double count) {
  const auto buckets = named(all, name + "_bucket", match);
  ASSERT_EQ(buckets.size(), kDurationBuckets.size() + 1) << name;
  double prev = 0;
  double prev_le = -1;
  for (const Sample& b : buckets) {
    const double le = b.labels.at("le") == "+Inf" ? INFINITY : std::stod(b.labels.at("le"));
    EXPECT_GT(le, prev_le) << name;
    EXPECT_GE(b.value, prev) << name << " le=" << b.labels.at("le");
    prev = b.value;
    prev_le = le;
  }
  EXPECT_EQ(buckets.back().labels.at("le"), "+Inf");
  EXPECT_EQ(buckets.back().value, count) << name;
  EXPECT_EQ(value_of(all, name + "_count", match), count) << name;
}

// An alert (or, resolved, the end of its episode) as the sinks get it.
AlertEvent alert_event(std::string type, bool resolved = false,
                       nlohmann::ordered_json details = nlohmann::ordered_json::object()) {
  AlertEvent e;
  e.type = std::move(type);
  e.resolved = resolved;
  e.details = std::move(details);
  return e;
}

StepRecord record(std::int64_t step, std::int64_t step_ns) {
  StepRecord r;
  r.step = step;
  r.step_ns = step_ns;
  r.host_ns = step_ns;
  r.start_unix_ns = 1'700'000'000'000'000'000 + step * step_ns;
  return r;
}

TEST(MetricsRegistry, RendersEveryFamilyFromTheRecords) {
  PhaseNames names;
  const std::uint16_t fwd = names.intern("forward");
  MetricLabels labels{"train \"a\"", "run-1", 3, "node\\7"};
  MetricsRegistry reg(
      labels, names, "9.9.9", [] { return 0.25; }, [] { return 1.5; });
  StepRecord a = record(0, 2'000'000);  // 2 ms
  a.data_ns = 500'000'000;
  a.phase_count = 1;
  a.phase_ids[0] = fwd;
  a.phase_ns[0] = 1'000'000;
  a.memory.allocated_bytes = 100;
  a.memory.rss_bytes = 4096;
  a.counters.present = true;
  a.counters.values[0] = 45.0;
  a.counters.values[1] = NAN;
  a.counters.values[2] = 120.0;  // clamped to 1
  a.kernels.present = true;
  a.kernels.compute_ns = 1'000'000;
  a.kernels.nccl_ns = 400'000;
  a.kernels.exposed_nccl_ns = 100'000;
  reg.observe_step(a);
  StepRecord b = record(1, 70'000'000'000);  // 70 s: past the last bucket
  b.failed = true;
  b.comm.count = 2;
  b.comm.busy_ns = 3'000'000'000;
  b.comm.exposed_ns = 1'000'000'000;
  reg.observe_step(b);
  reg.observe_alert(alert_event("stall"));
  reg.observe_alert(alert_event("stall", /*resolved=*/true));
  reg.observe_alert(alert_event("straggler"));
  reg.observe_alert(alert_event("stall"));
  const std::string text = reg.render();
  EXPECT_NE(text.find("# TYPE steptrace_step_duration_seconds histogram"), std::string::npos);
  EXPECT_NE(text.find("job=\"train \\\"a\\\"\""), std::string::npos) << text;
  EXPECT_NE(text.find("host=\"node\\\\7\""), std::string::npos) << text;
  const auto all = parse(text);
  check_histogram(all, "steptrace_step_duration_seconds", {}, 2);
  EXPECT_EQ(named(all, "steptrace_step_duration_seconds_bucket", {{"le", "0.0025"}})[0].value, 1);
  EXPECT_EQ(named(all, "steptrace_step_duration_seconds_bucket", {{"le", "60"}})[0].value, 1);
  check_histogram(all, "steptrace_phase_duration_seconds", {{"phase", "forward"}}, 1);
  EXPECT_EQ(value_of(all, "steptrace_steps_total"), 2);
  EXPECT_EQ(value_of(all, "steptrace_error_steps_total"), 1);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_data_wait_seconds_total"), 0.5);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_step_median_seconds"), 0.25);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_step_in_flight_seconds"), 1.5);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_last_step_timestamp_seconds"),
                   static_cast<double>(b.start_unix_ns + b.host_ns) / 1e9);
  EXPECT_EQ(value_of(all, "steptrace_memory_bytes", {{"kind", "allocated"}}), 100);
  EXPECT_EQ(value_of(all, "steptrace_memory_bytes", {{"kind", "rss"}}), 4096);
  EXPECT_TRUE(named(all, "steptrace_memory_bytes", {{"kind", "reserved"}}).empty());
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_tensor_active_ratio"), 0.45);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_sm_occupancy_ratio"), 1.0);
  EXPECT_TRUE(named(all, "steptrace_dram_throughput_ratio").empty());
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_compute_seconds_total"), 0.001 + 69.0);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_comm_seconds_total"), 0.0004 + 3.0);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_comm_exposed_seconds_total"), 0.0001 + 1.0);
  EXPECT_EQ(value_of(all, "steptrace_alerts_total", {{"type", "stall"}}), 2);
  EXPECT_EQ(value_of(all, "steptrace_alerts_total", {{"type", "straggler"}}), 1);
  EXPECT_EQ(value_of(all, "steptrace_info", {{"version", "9.9.9"}}), 1);
  for (const Sample& s : all) {
    EXPECT_EQ(s.labels.at("rank"), "3") << s.name;
    EXPECT_EQ(s.labels.at("run_id"), "run-1") << s.name;
  }
}

TEST(MetricsRegistry, AbsentDataIsAbsent) {
  PhaseNames names;
  MetricsRegistry reg(MetricLabels{}, names, "1");
  const auto all = parse(reg.render());
  EXPECT_EQ(value_of(all, "steptrace_steps_total"), 0);
  for (const char* absent :
       {"steptrace_step_median_seconds", "steptrace_last_step_timestamp_seconds",
        "steptrace_memory_bytes", "steptrace_alerts_total", "steptrace_tensor_active_ratio",
        "steptrace_comm_seconds_total", "steptrace_phase_duration_seconds_count",
        "steptrace_runq_wait_seconds_total", "steptrace_interval_in_flight_seconds",
        "steptrace_tokens_per_second", "steptrace_samples_per_second",
        "steptrace_model_tflops_per_second", "steptrace_mfu_ratio", "steptrace_tokens_total",
        "steptrace_samples_total"}) {
    EXPECT_TRUE(named(all, absent).empty()) << absent;
  }
  // every kind of the wall clock is there from the start, at 0
  EXPECT_EQ(named(all, "steptrace_time_seconds_total").size(), kTimeKinds.size());
  for (const Sample& s : named(all, "steptrace_time_seconds_total")) EXPECT_EQ(s.value, 0);
}

// Useful work: the last step's rates as gauges (each only once a step knew it), samples
// and tokens summed over the steps as counters; the rates over the training iteration
// (data wait + step), MFU as a 0..1 ratio of the step's peak.
TEST(MetricsRegistry, UsefulWorkOfTheLastStepAndTotals) {
  PhaseNames names;
  MetricsRegistry reg(MetricLabels{}, names, "1");
  StepRecord a = record(0, 1'500'000'000);  // 1.5 s step + 0.5 s data wait = 2 s
  a.data_ns = 500'000'000;
  a.work.add(8, 1024, 4e12, WorkSource::kUser);
  a.work.peak_flops_per_s = 10e12;
  reg.observe_step(a);
  auto all = parse(reg.render());
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_samples_per_second"), 4.0);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_tokens_per_second"), 512.0);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_model_tflops_per_second"), 2.0);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_mfu_ratio"), 0.2);
  EXPECT_EQ(value_of(all, "steptrace_samples_total"), 8);
  EXPECT_EQ(value_of(all, "steptrace_tokens_total"), 1024);

  StepRecord b = record(1, 1'000'000'000);  // samples only: the other gauges keep a's
  b.work.add(4, -1, -1, WorkSource::kBatch);
  reg.observe_step(b);
  reg.observe_step(record(2, 1'000'000'000));  // no work at all: nothing changes
  all = parse(reg.render());
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_samples_per_second"), 4.0);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_tokens_per_second"), 512.0);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_mfu_ratio"), 0.2);
  EXPECT_EQ(value_of(all, "steptrace_samples_total"), 12);
  EXPECT_EQ(value_of(all, "steptrace_tokens_total"), 1024);

  // Samples without tokens, FLOPs without a peak: only the series it knows.
  MetricsRegistry partial(MetricLabels{}, names, "1");
  StepRecord c = record(0, 2'000'000'000);
  c.work.add(16, -1, 6e12, WorkSource::kBatch);
  partial.observe_step(c);
  all = parse(partial.render());
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_samples_per_second"), 8.0);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_model_tflops_per_second"), 3.0);
  for (const char* absent :
       {"steptrace_tokens_per_second", "steptrace_tokens_total", "steptrace_mfu_ratio"}) {
    EXPECT_TRUE(named(all, absent).empty()) << absent;
  }
}

// Wall clock by kind from the records' between-steps account, run-queue wait from the
// readings, the detectors' new alert types counted like any other.
TEST(MetricsRegistry, TimeByKindAndRunQueueWaitFromTheRecords) {
  PhaseNames names;
  OpenIntervalProbe open;  // what the live probe reports at each render
  MetricsRegistry reg(MetricLabels{"j", "run", 2, "h"}, names, "1", {}, {}, [&] { return open; });
  StepRecord a = record(0, 100'000'000);  // 100 ms step after a 20 ms data wait and 5 ms other
  a.data_ns = 20'000'000;
  a.between.other_ns = 5'000'000;
  a.runq_ns = -1;  // not read at this step
  reg.observe_step(a);
  auto all = parse(reg.render());
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_time_seconds_total", {{"kind", "step"}}), 0.1);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_time_seconds_total", {{"kind", "data"}}), 0.02);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_time_seconds_total", {{"kind", "other"}}), 0.005);
  EXPECT_EQ(value_of(all, "steptrace_time_seconds_total", {{"kind", "eval"}}), 0);
  EXPECT_EQ(value_of(all, "steptrace_time_seconds_total", {{"kind", "checkpoint"}}), 0);
  EXPECT_TRUE(named(all, "steptrace_runq_wait_seconds_total").empty()) << "no reading yet";
  for (const char* kind : {"eval", "checkpoint", "other"}) {
    EXPECT_EQ(value_of(all, "steptrace_interval_in_flight_seconds", {{"kind", kind}}), 0) << kind;
  }
  EXPECT_TRUE(named(all, "steptrace_peers_in_interval").empty()) << "no cross-rank exchange";

  // A 200 ms step with a 50 ms evaluation inside it, after a 1 s checkpoint and 10 ms other.
  StepRecord b = record(1, 200'000'000);
  b.between.interval_ns[static_cast<std::size_t>(IntervalKind::kEval)] = 50'000'000;
  b.between.inside_step_ns = 50'000'000;
  b.between.interval_ns[static_cast<std::size_t>(IntervalKind::kCheckpoint)] = 1'000'000'000;
  b.between.other_ns = 10'000'000;
  b.runq_ns = 30'000'000;
  b.runq_span_ns = 1'300'000'000;
  reg.observe_step(b);
  // A 100 ms step after a 2 s evaluation; a reading with no wait.
  StepRecord c = record(2, 100'000'000);
  c.between.interval_ns[static_cast<std::size_t>(IntervalKind::kEval)] = 2'000'000'000;
  c.runq_ns = 0;
  reg.observe_step(c);
  reg.observe_alert(alert_event("host_contention"));
  reg.observe_alert(alert_event("host_contention", /*resolved=*/true));
  reg.observe_alert(alert_event("slow_checkpoint"));
  open = {IntervalKind::kCheckpoint, 12.5, /*peers_in_interval=*/1};
  all = parse(reg.render());
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_time_seconds_total", {{"kind", "step"}}),
                   0.1 + 0.15 + 0.1);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_time_seconds_total", {{"kind", "data"}}), 0.02);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_time_seconds_total", {{"kind", "eval"}}), 2.05);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_time_seconds_total", {{"kind", "checkpoint"}}), 1.0);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_time_seconds_total", {{"kind", "other"}}), 0.015);
  EXPECT_EQ(named(all, "steptrace_time_seconds_total").size(), kTimeKinds.size());
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_runq_wait_seconds_total"), 0.03);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_data_wait_seconds_total"), 0.02);  // kept as is
  EXPECT_EQ(value_of(all, "steptrace_alerts_total", {{"type", "host_contention"}}), 1);
  EXPECT_EQ(value_of(all, "steptrace_alerts_total", {{"type", "slow_checkpoint"}}), 1);
  EXPECT_EQ(value_of(all, "steptrace_interval_in_flight_seconds", {{"kind", "checkpoint"}}), 12.5);
  EXPECT_EQ(value_of(all, "steptrace_interval_in_flight_seconds", {{"kind", "eval"}}), 0);
  EXPECT_EQ(value_of(all, "steptrace_peers_in_interval"), 1);  // a peer's, this rank waits for
  for (const Sample& s : all) EXPECT_EQ(s.labels.at("rank"), "2") << s.name;
  const std::string text = reg.render();
  EXPECT_NE(text.find("# TYPE steptrace_time_seconds_total counter"), std::string::npos);
  EXPECT_NE(text.find("# TYPE steptrace_runq_wait_seconds_total counter"), std::string::npos);
  EXPECT_NE(text.find("# TYPE steptrace_interval_in_flight_seconds gauge"), std::string::npos);
}

std::string scrape(int port, std::string* content_type = nullptr) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(5, 0);
  auto res = client.Get("/metrics");
  EXPECT_TRUE(res) << "GET /metrics on port " << port << " failed";
  if (!res) return "";
  EXPECT_EQ(res->status, 200);
  if (content_type != nullptr) *content_type = res->get_header_value("Content-Type");
  return res->body;
}

TEST(PrometheusEndpoint, AProfilerServesItsStepsOverHttp) {
  TempDir tmp;
  Config config = run_config(tmp);
  config.metrics_port = 0;
  config.run_id = "endpoint-test";
  config.job = "unit";
  config.clock = "host";
  Profiler prof(config);
  ASSERT_GT(prof.metrics_port(), 0);
  const auto start = read_jsonl(prof.log_path());
  ASSERT_FALSE(start.empty());
  EXPECT_EQ(start[0]["metrics"]["host"], "127.0.0.1");  // loopback unless metrics_host says
  EXPECT_EQ(start[0]["metrics"]["port"], prof.metrics_port());
  EXPECT_EQ(start[0]["metrics"]["path"], "/metrics");
  EXPECT_EQ(start[0]["config"]["metrics_port"], 0);

  constexpr int kSteps = 25;
  for (int i = 0; i < kSteps; ++i) {
    auto step = prof.step();
    {
      auto p = step.phase("forward");
      std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
    { auto p = step.phase("backward"); }
    if (i == 3) step.fail();
  }
  prof.write_record(R"({"kind":"alert","type":"straggler","step":3,"message":"x"})");
  prof.flush();
  std::string content_type;
  const std::string text = scrape(prof.metrics_port(), &content_type);
  EXPECT_EQ(content_type, "text/plain; version=0.0.4; charset=utf-8");
  const auto all = parse(text);
  ASSERT_FALSE(all.empty()) << text;
  for (const Sample& s : all) {
    EXPECT_EQ(s.labels.at("job"), "unit") << s.name;
    EXPECT_EQ(s.labels.at("run_id"), "endpoint-test") << s.name;
    EXPECT_EQ(s.labels.at("rank"), "0") << s.name;
    EXPECT_FALSE(s.labels.at("host").empty()) << s.name;
  }
  EXPECT_EQ(value_of(all, "steptrace_steps_total"), kSteps);
  EXPECT_EQ(value_of(all, "steptrace_error_steps_total"), 1);
  check_histogram(all, "steptrace_step_duration_seconds", {}, kSteps);
  check_histogram(all, "steptrace_phase_duration_seconds", {{"phase", "forward"}}, kSteps);
  check_histogram(all, "steptrace_phase_duration_seconds", {{"phase", "backward"}}, kSteps);
  EXPECT_GT(value_of(all, "steptrace_step_duration_seconds_sum"), kSteps * 0.0003 * 0.9);
  EXPECT_EQ(value_of(all, "steptrace_alerts_total", {{"type", "straggler"}}), 1);
  EXPECT_EQ(value_of(all, "steptrace_step_in_flight_seconds"), 0);
  EXPECT_GT(value_of(all, "steptrace_memory_bytes", {{"kind", "rss"}}), 0);
  EXPECT_GT(value_of(all, "steptrace_step_median_seconds"), 0);
  const double last = value_of(all, "steptrace_last_step_timestamp_seconds");
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  EXPECT_NEAR(last, now, 60);
  EXPECT_EQ(named(all, "steptrace_info").size(), 1u);
  EXPECT_EQ(named(all, "steptrace_info")[0].labels.at("version"), version());

  {  // a step in flight has an age
    auto step = prof.step();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_GT(value_of(parse(scrape(prof.metrics_port())), "steptrace_step_in_flight_seconds"),
              0.015);
  }
  {  // an evaluation between steps is booked as eval when the next step ends
    auto eval = prof.interval(IntervalKind::kEval);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  { auto step = prof.step(); }
  prof.flush();
  const auto booked = parse(scrape(prof.metrics_port()));
  EXPECT_GE(value_of(booked, "steptrace_time_seconds_total", {{"kind", "eval"}}), 0.029);
  EXPECT_GT(value_of(booked, "steptrace_time_seconds_total", {{"kind", "step"}}),
            kSteps * 0.0003 * 0.9);
  const int port = prof.metrics_port();
  prof.close();
  httplib::Client after("127.0.0.1", port);
  after.set_connection_timeout(1, 0);
  EXPECT_FALSE(after.Get("/metrics")) << "the endpoint stops with the run";
}

TEST(PrometheusEndpoint, ABusyPortLeavesTheRunWithoutTheEndpoint) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::unsetenv("LOCAL_RANK");  // the port itself, not a rank's offset from it
  TempDir tmp;
  Config config = run_config(tmp);
  config.metrics_port = ntohs(addr.sin_port);
  std::string log;
  {
    Profiler prof(config);
    EXPECT_EQ(prof.metrics_port(), -1);
    { auto s = prof.step(); }
    log = prof.log_path();
  }
  ::close(fd);
  const auto records = read_jsonl(log);
  EXPECT_TRUE(records[0]["metrics"]["port"].is_null());
  EXPECT_NE(records[0]["metrics"]["error"].get<std::string>().find("could not bind"),
            std::string::npos);
  EXPECT_EQ(of_kind(records, "step").size(), 1u);
}

TEST(PrometheusEndpoint, OffByDefault) {
  TempDir tmp;
  Profiler prof(run_config(tmp));
  EXPECT_EQ(prof.metrics_port(), -1);
  EXPECT_FALSE(read_jsonl(prof.log_path())[0].contains("metrics"));
}

TEST(PrometheusEndpoint, TextfileModeWritesTheMetricsAtomically) {
  TempDir tmp;
  Config config = run_config(tmp);
  config.metrics_textfile = tmp.str("steptrace.prom");
  config.flush_interval_ms = 10;
  {
    Profiler prof(config);
    EXPECT_EQ(prof.metrics_port(), -1);  // no HTTP endpoint in textfile mode alone
    for (int i = 0; i < 7; ++i) {
      auto s = prof.step();
    }
    prof.flush();
    ASSERT_TRUE(std::filesystem::exists(config.metrics_textfile));  // the first batch's
    const auto start = read_jsonl(prof.log_path())[0];
    EXPECT_TRUE(start["metrics"]["port"].is_null());
    EXPECT_EQ(start["metrics"]["textfile"], config.metrics_textfile);
  }
  std::ifstream in(config.metrics_textfile);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto all = parse(text);
  EXPECT_EQ(value_of(all, "steptrace_steps_total"), 7);  // the final values, from close
  check_histogram(all, "steptrace_step_duration_seconds", {}, 7);
  for (const auto& entry : std::filesystem::directory_iterator(tmp.path())) {
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << entry.path();
  }
}

TEST(PrometheusEndpoint, PushesToAPushgatewayAtClose) {
  httplib::Server gateway;
  std::mutex mu;
  std::vector<std::pair<std::string, std::string>> pushes;  // path, body
  gateway.Put(R"(/prefix/metrics/.*)", [&](const httplib::Request& req, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu);
    pushes.emplace_back(req.path, req.body);
    res.status = 200;
  });
  const int port = gateway.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread server([&] { gateway.listen_after_bind(); });
  while (!gateway.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  TempDir tmp;
  Config config = run_config(tmp);
  config.run_id = "short/job";
  config.job = "batch";
  config.metrics_pushgateway = fmt::format("http://127.0.0.1:{}/prefix/", port);
  {
    Profiler prof(config);
    for (int i = 0; i < 4; ++i) {
      auto s = prof.step();
    }
  }
  gateway.stop();
  server.join();
  ASSERT_EQ(pushes.size(), 1u);
  EXPECT_EQ(pushes[0].first, fmt::format("/prefix/metrics/job@base64/{}/run_id@base64/{}/rank/0",
                                         base64url("batch"), base64url("short/job")));
  EXPECT_EQ(value_of(parse(pushes[0].second), "steptrace_steps_total"), 4);
}

TEST(PrometheusEndpoint, Base64urlPadsAndUsesTheUrlAlphabet) {
  EXPECT_EQ(base64url(""), "");
  EXPECT_EQ(base64url("f"), "Zg==");
  EXPECT_EQ(base64url("fo"), "Zm8=");
  EXPECT_EQ(base64url("foo"), "Zm9v");
  EXPECT_EQ(base64url("\xfb\xff"), "-_8=");
}

// ---- The endpoint against hostile clients (real loopback sockets, shortened limits) ----

using SteadyClock = std::chrono::steady_clock;

double seconds_since(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

// A raw client socket connected to 127.0.0.1:port (-1 on failure).
int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void send_text(int fd, const std::string& text) {
  ASSERT_EQ(::send(fd, text.data(), text.size(), MSG_NOSIGNAL), static_cast<ssize_t>(text.size()));
}

// Waits up to `limit_s` for the server to close `fd` (EOF or reset); the seconds it took,
// or -1 when it stayed open. What the server answered before closing is discarded.
double seconds_until_closed(int fd, double limit_s) {
  const auto t0 = SteadyClock::now();
  char buf[4096];
  while (seconds_since(t0) < limit_s) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return seconds_since(t0);
  }
  return -1;
}

std::string metrics_text() { return "# HELP up Test.\n# TYPE up gauge\nup 1\n"; }

// A PrometheusSink serving on `port` (0: any free port).
std::unique_ptr<PrometheusSink> serving_sink(const PhaseNames& names, int port) {
  MetricsOutputs outputs;
  outputs.port = port;
  return std::make_unique<PrometheusSink>(outputs, MetricLabels{}, names, "test", nullptr, nullptr);
}

TEST(MetricsEndpoint, ASecondEndpointOnABusyPortGetsTheClearError) {
  // cpp-httplib's default socket options set SO_REUSEPORT: the second bind succeeded and
  // both runs' series were served, mixed, on one port.
  PhaseNames names;
  auto first = serving_sink(names, 0);
  ASSERT_GT(first->port(), 0);
  auto second = serving_sink(names, first->port());
  EXPECT_EQ(second->port(), -1);
  EXPECT_EQ(second->error(),
            fmt::format("could not bind 127.0.0.1:{}: Address already in use", first->port()));
  EXPECT_NE(scrape(first->port()).find("steptrace_steps_total"), std::string::npos);
}

TEST(MetricsEndpoint, KeepAliveServesSeveralRequestsOnOneConnection) {
  MetricsEndpoint endpoint("127.0.0.1", 0, metrics_text);
  httplib::Client client("127.0.0.1", endpoint.port());
  client.set_keep_alive(true);
  client.set_read_timeout(5, 0);
  for (int i = 0; i < 3; ++i) {
    auto res = client.Get("/metrics");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    EXPECT_EQ(res->body, metrics_text());
  }
  EXPECT_EQ(endpoint.connections(), 1u);
  // Two requests in one write (pipelined): both answered, in order.
  const int fd = connect_to(endpoint.port());
  send_text(fd,
            "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nHEAD /metrics HTTP/1.1\r\nHost: x\r\n"
            "Connection: close\r\n\r\n");
  std::string answer;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) answer.append(buf, n);
  ::close(fd);
  EXPECT_EQ(answer.find("HTTP/1.1 200 OK"), 0u);
  EXPECT_NE(answer.find("HTTP/1.1 200 OK", 10), std::string::npos) << answer;
}

TEST(MetricsEndpoint, AnIdleConnectionIsClosedAfterTheIdleTimeout) {
  EndpointLimits limits;
  limits.idle_timeout = std::chrono::milliseconds(200);
  MetricsEndpoint endpoint("127.0.0.1", 0, metrics_text, limits);
  const int fd = connect_to(endpoint.port());
  const double took = seconds_until_closed(fd, 10.0);
  ::close(fd);
  ASSERT_GE(took, 0.0) << "an idle connection stayed open";
  EXPECT_GE(took, 0.1);
  EXPECT_LT(took, 5.0);
}

TEST(MetricsEndpoint, ADrippingClientIsCutAtTheDeadlineAndHoldsNoWorker) {
  // One worker, and a client that sends a header line every 100 ms and never ends its
  // request: scrapes are answered meanwhile, and the client is cut at the deadline.
  EndpointLimits limits;
  limits.workers = 1;
  limits.request_deadline = std::chrono::milliseconds(600);
  MetricsEndpoint endpoint("127.0.0.1", 0, metrics_text, limits);
  const int fd = connect_to(endpoint.port());
  const auto t0 = SteadyClock::now();
  send_text(fd, "GET /metrics HTTP/1.1\r\n");
  double cut = -1;
  for (int i = 0; i < 100 && cut < 0; ++i) {
    if (::send(fd, "X-Drip: y\r\n", 11, MSG_NOSIGNAL) < 0) break;
    EXPECT_EQ(scrape(endpoint.port()), metrics_text());
    if (seconds_until_closed(fd, 0.1) >= 0) cut = seconds_since(t0);
  }
  if (cut < 0 && seconds_until_closed(fd, 5.0) >= 0) cut = seconds_since(t0);
  ::close(fd);
  EXPECT_GE(cut, 0.5);
  EXPECT_LT(cut, 5.0) << "the dripping client was not cut at its deadline";
}

TEST(MetricsEndpoint, AnOversizedHeadIsRefusedAfterTheLimit) {
  MetricsEndpoint endpoint("127.0.0.1", 0, metrics_text);
  const int fd = connect_to(endpoint.port());
  const std::string head = "GET /metrics HTTP/1.1\r\nX-Big: " + std::string(64 * 1024, 'a');
  // The server stops reading at 16 KiB and answers 431; the rest may fail to send.
  (void)::send(fd, head.data(), head.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  char buf[512] = {};
  pollfd p{fd, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1);
  const ssize_t n = ::recv(fd, buf, sizeof(buf) - 1, 0);
  ::close(fd);
  if (n > 0) EXPECT_EQ(std::string(buf).rfind("HTTP/1.1 431", 0), 0u) << buf;
  EXPECT_EQ(scrape(endpoint.port()), metrics_text());
}

TEST(MetricsEndpoint, ConnectionsBeyondTheCapCloseTheOldestUnanswered) {
  EndpointLimits limits;
  limits.max_connections = 4;
  MetricsEndpoint endpoint("127.0.0.1", 0, metrics_text, limits);
  std::vector<int> fds;
  for (int i = 0; i < 12; ++i) {
    fds.push_back(connect_to(endpoint.port()));
    ASSERT_GE(fds.back(), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // distinct accept times
    EXPECT_LE(endpoint.connections(), 4u);
  }
  // the first ones were closed to make room, the newest are open
  EXPECT_GE(seconds_until_closed(fds.front(), 5.0), 0.0);
  EXPECT_EQ(scrape(endpoint.port()), metrics_text());
  EXPECT_LE(endpoint.connections(), 4u);
  for (const int fd : fds) ::close(fd);
}

TEST(MetricsEndpoint, StopDoesNotWaitOnAClientInTheMiddleOfARequestOrAnAnswer) {
  // One client half-way through its request, one that asked for 32 MB and reads none of
  // it (its worker blocked in send): stop() returns at once, far before the 5 s deadline.
  const std::string big(32 << 20, 'x');
  MetricsEndpoint endpoint("127.0.0.1", 0, [&big] { return big; });
  const int dripping = connect_to(endpoint.port());
  send_text(dripping, "GET /metrics HTTP/1.1\r\nX-Drip: y\r\n");
  const int stalled = connect_to(endpoint.port());
  const int small = 4096;
  ::setsockopt(stalled, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  send_text(stalled, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  // The answer has begun to arrive: its worker is in send(), blocked on the full socket.
  pollfd p{stalled, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 30000), 1);
  const auto t0 = SteadyClock::now();
  endpoint.stop();
  // Far below the 5 s request deadline the worker would otherwise have waited out.
  EXPECT_LT(seconds_since(t0), 2.5);
  EXPECT_EQ(endpoint.connections(), 0u);
  EXPECT_GE(seconds_until_closed(dripping, 2.0), 0.0);
  ::close(dripping);
  ::close(stalled);
}

TEST(MetricsEndpoint, LeavesTheProcessSigpipeAsItWas) {
  // httplib::Server's constructor sets SIGPIPE to SIG_IGN for the whole process: a C++
  // trainer that relies on the default (a closed pipe ends it) silently lost it.
  struct sigaction before {};
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGPIPE, &dfl, &before);
  {
    PhaseNames names;
    auto sink = serving_sink(names, 0);
    struct sigaction now {};
    ::sigaction(SIGPIPE, nullptr, &now);
    EXPECT_EQ(now.sa_handler, SIG_DFL);
    EXPECT_NE(scrape(sink->port()).find("steptrace_steps_total"), std::string::npos);
  }
  ::sigaction(SIGPIPE, &before, nullptr);
}

TEST(HttpPut, OneDeadlineForAGatewayThatDribblesItsAnswer) {
  // A gateway that reads the request, then sends its answer one byte every 200 ms.
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  std::atomic<bool> done{false};
  std::thread gateway([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    char buf[4096];
    (void)::recv(fd, buf, sizeof(buf), 0);
    const std::string answer = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
    for (std::size_t i = 0; i < answer.size() && !done; ++i) {
      if (::send(fd, answer.data() + i, 1, MSG_NOSIGNAL) < 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    ::close(fd);
  });
  const auto t0 = SteadyClock::now();
  const std::string error =
      http_put(fmt::format("http://127.0.0.1:{}", ntohs(addr.sin_port)), "/metrics/job/x", "up 1\n",
               "text/plain", std::chrono::milliseconds(500));
  const double took = seconds_since(t0);
  done = true;
  gateway.join();
  ::close(listener);
  EXPECT_LT(took, 1.5);
  EXPECT_FALSE(error.empty());
}

// A sink that throws on its first step, and one that counts what it was fed.
class ThrowingSink final : public RecordSink {
 public:
  std::string_view name() const noexcept override { return "throwing"; }
  void on_step(const StepRecord&) override { throw std::runtime_error("disk on fire"); }
};
class CountingSink final : public RecordSink {
 public:
  std::string_view name() const noexcept override { return "counting"; }
  void write(std::string_view lines) override {
    for (char c : lines) lines_ += c == '\n';
  }
  void on_step(const StepRecord&) override { ++steps_; }
  void on_close() override { closed_ = true; }
  int steps_ = 0;
  int lines_ = 0;
  bool closed_ = false;
};

TEST(RecordSinks, AFailingSinkIsDisabledOnceAndTheOthersCarryOn) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  ThrowingSink bad;
  CountingSink good;
  {
    RecordPipeline w(std::make_unique<JsonlFileSink>(
                         ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)),
                     "{\"kind\":\"run_start\"}\n", 0, names, 64, std::chrono::milliseconds(10),
                     nullptr, nullptr, {&bad, &good});
    for (int i = 0; i < 10; ++i) w.push_step_record(record(i, 1000));
    w.close(RunEnd{"normal", {}, 1, 0.5, 0});
    ASSERT_EQ(w.sink_failures().size(), 1u);
    EXPECT_NE(w.sink_failures()[0].find("throwing: disk on fire"), std::string::npos);
  }
  EXPECT_EQ(good.steps_, 10);
  EXPECT_EQ(good.lines_, 12);  // run_start, 10 steps, run_end: what the file has
  EXPECT_TRUE(good.closed_);
  EXPECT_EQ(read_jsonl(path).size(), 12u);
  // run_end names each sink's status: the file first, the thrower failing (switched off)
  const auto end = read_jsonl(path).back();
  ASSERT_TRUE(end.contains("sinks")) << end.dump();
  const auto& sinks = end["sinks"];
  ASSERT_EQ(sinks.size(), 3u);
  EXPECT_EQ(sinks[0]["name"], "jsonl");
  EXPECT_EQ(sinks[0]["status"], "ok");
  EXPECT_FALSE(sinks[0].contains("error"));
  EXPECT_EQ(sinks[1]["name"], "throwing");
  EXPECT_EQ(sinks[1]["status"], "failing");
  EXPECT_EQ(sinks[1]["error"], "disk on fire");
  EXPECT_EQ(sinks[1]["disabled"], true);
  EXPECT_EQ(sinks[2]["name"], "counting");
  EXPECT_EQ(sinks[2]["status"], "ok");
  EXPECT_EQ(sinks[2]["slow_calls"], 0);
}

// A sink whose step calls block past the slow limit (twice), and one that handles its own
// failure and carries on.
class SlowSink final : public RecordSink {
 public:
  std::string_view name() const noexcept override { return "slow"; }
  void on_step(const StepRecord& r) override {
    if (r.step < 2) std::this_thread::sleep_for(RecordPipeline::kSlowSinkCall + kMargin);
  }
  static constexpr std::chrono::milliseconds kMargin{20};
};
class SelfHealingSink final : public RecordSink {
 public:
  std::string_view name() const noexcept override { return "remote"; }
  void write(std::string_view) override {
    if (error_.empty()) error_ = "connect: refused";  // said once, retried later
  }
  std::string first_error() const override { return error_; }
  std::string error_;
};

TEST(RecordSinks, RunEndSaysWhichSinkWasSlowOrFailing) {
  TempDir tmp;
  const std::string path = tmp.str("log.jsonl");
  PhaseNames names;
  SlowSink slow;
  SelfHealingSink remote;
  {
    RecordPipeline w(std::make_unique<JsonlFileSink>(
                         ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)),
                     "{\"kind\":\"run_start\"}\n", 0, names, 64, std::chrono::milliseconds(10),
                     nullptr, nullptr, {&slow, &remote});
    for (int i = 0; i < 5; ++i) w.push_step_record(record(i, 1000));
    w.close(RunEnd{"normal", {}, 1, 0.5, 0});
    EXPECT_TRUE(w.sink_failures().empty());  // nothing threw
  }
  const auto records = read_jsonl(path);
  EXPECT_EQ(of_kind(records, "step").size(), 5u);  // the slow sink delayed, lost nothing
  const auto& sinks = records.back()["sinks"];
  ASSERT_EQ(sinks.size(), 3u);
  EXPECT_EQ(sinks[1]["name"], "slow");
  EXPECT_EQ(sinks[1]["status"], "slow");
  EXPECT_EQ(sinks[1]["slow_calls"], 2);
  EXPECT_GE(sinks[1]["max_call_ms"].get<double>(), 1000.0);
  EXPECT_EQ(sinks[2]["name"], "remote");
  EXPECT_EQ(sinks[2]["status"], "failing");
  EXPECT_EQ(sinks[2]["error"], "connect: refused");
  EXPECT_EQ(sinks[2]["disabled"], false);
}

TEST(RecordSinks, AnUnwritableTextfileIsAFailingMetricsSink) {
  TempDir tmp;
  Config config = run_config(tmp);
  config.metrics_textfile = tmp.str("no-such-dir/steptrace.prom");
  std::string log;
  {
    Profiler prof(config);
    log = prof.log_path();
    auto s = prof.step();
  }
  const auto end = read_jsonl(log).back();
  const auto& sinks = end["sinks"];
  ASSERT_EQ(sinks.size(), 2u) << end.dump();
  EXPECT_EQ(sinks[0]["status"], "ok");
  EXPECT_EQ(sinks[1]["name"], "prometheus");
  EXPECT_EQ(sinks[1]["status"], "failing");
  EXPECT_NE(sinks[1]["error"].get<std::string>().find("no-such-dir"), std::string::npos);
}

StepRecord hw_record(std::int64_t step, double power_w, double temp_c, std::uint64_t reasons) {
  StepRecord r = record(step, 100'000'000);
  r.hw.present = true;
  r.hw.samples = 2;
  r.hw.avg_power_w = power_w;
  r.hw.min_power_w = power_w - 10;
  r.hw.energy_j = power_w * 0.1;
  r.hw.max_temp_c = temp_c;
  r.hw.sm_clock_mhz = 1980;
  r.hw.power_limit_w = 700;
  r.hw.throttle_reasons = reasons;
  return r;
}

TEST(MetricsRegistry, HardwareFiguresOfTheLastStepAndErrorsByKind) {
  PhaseNames names;
  MetricsRegistry reg(MetricLabels{"j", "r", 1, "h"}, names, "1");
  reg.observe_step(hw_record(0, 650, 60, kThrottleSwPowerCap));
  StepRecord b = hw_record(1, 500, 71, kThrottleSwPowerCap | kThrottleHwThermal);
  b.hw.mem_clock_mhz = 2619;
  b.hw.max_mem_temp_c = 80;
  b.hw.pcie_tx_mb_s = 12.5;
  b.hw.nvlink_tx_mb_s = 4096;
  b.hw.nvlink_rx_mb_s = 2048;
  reg.observe_step(b);
  reg.observe_step(record(2, 1000));  // a step without hw keeps the last figures
  reg.observe_alert(alert_event("hardware_error", false, {{"kind", "xid"}, {"code", 79}}));
  reg.observe_alert(
      alert_event("hardware_error", false, {{"kind", "nvlink_crc"}, {"code", 12}, {"delta", 3}}));
  reg.observe_alert(alert_event("hardware_error", false, {{"kind", "made-up"}}));
  reg.observe_alert(alert_event("hardware_error", /*resolved=*/true));
  const auto all = parse(reg.render());
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_gpu_power_watts"), 500);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_gpu_power_limit_watts"), 700);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_gpu_energy_joules_total"), 65 + 50);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_gpu_temperature_celsius"), 71);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_gpu_memory_temperature_celsius"), 80);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_gpu_sm_clock_hertz"), 1980e6);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_gpu_memory_clock_hertz"), 2619e6);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_gpu_pcie_bytes_per_second", {{"direction", "tx"}}),
                   12.5e6);
  EXPECT_TRUE(named(all, "steptrace_gpu_pcie_bytes_per_second", {{"direction", "rx"}}).empty());
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_gpu_nvlink_bytes_per_second", {{"direction", "tx"}}),
                   4096e6);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_gpu_nvlink_bytes_per_second", {{"direction", "rx"}}),
                   2048e6);
  EXPECT_EQ(value_of(all, "steptrace_gpu_throttled_steps_total", {{"reason", "sw_power_cap"}}), 2);
  EXPECT_EQ(
      value_of(all, "steptrace_gpu_throttled_steps_total", {{"reason", "hw_thermal_slowdown"}}), 1);
  EXPECT_EQ(named(all, "steptrace_gpu_throttled_steps_total").size(), 2u);  // seen reasons only
  EXPECT_EQ(value_of(all, "steptrace_gpu_hardware_errors_total", {{"kind", "xid"}}), 1);
  EXPECT_EQ(value_of(all, "steptrace_gpu_hardware_errors_total", {{"kind", "nvlink_crc"}}), 1);
  EXPECT_EQ(value_of(all, "steptrace_gpu_hardware_errors_total", {{"kind", "other"}}), 1);
  EXPECT_EQ(value_of(all, "steptrace_gpu_last_xid"), 79);
  EXPECT_EQ(value_of(all, "steptrace_alerts_total", {{"type", "hardware_error"}}), 3);
  for (const Sample& s : all) EXPECT_EQ(s.labels.at("rank"), "1") << s.name;
}

TEST(MetricsRegistry, NoHardwareNoClusterNoSeries) {
  PhaseNames names;
  MetricsRegistry reg(MetricLabels{}, names, "1");
  reg.observe_step(record(0, 1000));
  for (const Sample& s : parse(reg.render())) {
    EXPECT_EQ(s.name.rfind("steptrace_gpu_", 0), std::string::npos) << s.name;
    EXPECT_EQ(s.name.rfind("steptrace_rank_", 0), std::string::npos) << s.name;
    EXPECT_EQ(s.name.rfind("steptrace_cluster_", 0), std::string::npos) << s.name;
  }
}

// A cluster record as cluster.py writes it (Profiler::write_record parses it for the sinks).
nlohmann::ordered_json cluster_record(int ranks, std::vector<int> stragglers, int slow_rank) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (int r = 0; r < ranks; ++r) {
    const double own = r == slow_rank ? 13.0 : 10.0 + 0.001 * r;
    rows.push_back({{"rank", r},
                    {"host", fmt::format("node{}", r / 8)},
                    {"steps", 20},
                    {"step_ms", 20.0},
                    {"step_p95_ms", 22.0},
                    {"data_ms", 1.0},
                    {"compute_ms", own - 1.0},
                    {"comm_ms", r == 1 ? nlohmann::ordered_json() : nlohmann::ordered_json(4.0)},
                    {"wait_ms", r == slow_rank ? 0.0 : 3.0},
                    {"own_ms", own},
                    {"straggler_pct", r == slow_rank ? 30.0 : 0.01 * r}});
  }
  nlohmann::ordered_json j = {{"kind", "cluster"},   {"rank", 0},
                              {"step", 39},          {"window", 1},
                              {"world_size", ranks}, {"ranks_reporting", ranks},
                              {"ranks", rows},       {"stragglers", stragglers}};
  return j;
}

TEST(MetricsRegistry, ClusterRecordsGivePerRankSeriesWithBoundedRows) {
  PhaseNames names;
  MetricsRegistry reg(MetricLabels{"j", "run", 0, "node0"}, names, "1");
  reg.observe_cluster(cluster_record(3, {2}, 2));
  auto all = parse(reg.render());
  EXPECT_EQ(value_of(all, "steptrace_cluster_windows_total"), 1);
  EXPECT_EQ(value_of(all, "steptrace_cluster_ranks_reporting"), 3);
  EXPECT_EQ(value_of(all, "steptrace_cluster_stragglers"), 1);
  ASSERT_EQ(named(all, "steptrace_rank_straggler_score").size(), 3u);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_rank_straggler_score", {{"rank", "2"}}), 0.30);
  EXPECT_EQ(value_of(all, "steptrace_rank_straggler", {{"rank", "2"}}), 1);
  EXPECT_EQ(value_of(all, "steptrace_rank_straggler", {{"rank", "0"}}), 0);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_rank_step_median_seconds", {{"rank", "1"}}), 0.020);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_rank_step_p95_seconds", {{"rank", "1"}}), 0.022);
  EXPECT_DOUBLE_EQ(
      value_of(all, "steptrace_rank_split_seconds", {{"rank", "2"}, {"part", "compute"}}), 0.012);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_rank_split_seconds", {{"rank", "0"}, {"part", "wait"}}),
                   0.003);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_rank_split_seconds", {{"rank", "0"}, {"part", "data"}}),
                   0.001);
  // comm null for rank 1: no sample, the other parts are there
  EXPECT_TRUE(
      named(all, "steptrace_rank_split_seconds", {{"rank", "1"}, {"part", "comm"}}).empty());
  EXPECT_EQ(named(all, "steptrace_rank_split_seconds", {{"rank", "1"}}).size(), 3u);
  // the per-rank series name the rank they describe and its host
  EXPECT_EQ(named(all, "steptrace_rank_straggler_score", {{"rank", "2"}})[0].labels.at("host"),
            "node0");

  // A big job: the next window replaces the rows, capped, the straggler kept.
  reg.observe_cluster(cluster_record(300, {250}, 250));
  all = parse(reg.render());
  EXPECT_EQ(value_of(all, "steptrace_cluster_windows_total"), 2);
  EXPECT_EQ(value_of(all, "steptrace_cluster_world_size"), 300);
  const auto scores = named(all, "steptrace_rank_straggler_score");
  EXPECT_EQ(scores.size(), kMaxClusterRows);
  EXPECT_DOUBLE_EQ(value_of(all, "steptrace_rank_straggler_score", {{"rank", "250"}}), 0.30);
  // then the 63 highest scores of the others: ranks 236..299
  EXPECT_NEAR(value_of(all, "steptrace_rank_straggler_score", {{"rank", "299"}}), 0.0299, 1e-12);
  EXPECT_NEAR(value_of(all, "steptrace_rank_straggler_score", {{"rank", "236"}}), 0.0236, 1e-12);
  EXPECT_TRUE(named(all, "steptrace_rank_straggler_score", {{"rank", "235"}}).empty());
  EXPECT_TRUE(named(all, "steptrace_rank_straggler_score", {{"rank", "0"}}).empty());
  EXPECT_EQ(named(all, "steptrace_rank_split_seconds").size(), 4 * kMaxClusterRows);
}

}  // namespace
}  // namespace steptrace::detail
