// The metrics table (csrc/sinks/metrics.def) against the registry: a registry given every
// kind of data renders exactly the table's families, each with its row's type, HELP line and
// labels. The Python test (test_metrics_table.py) checks a real scrape, which cannot reach
// the GPU hardware and useful-work families on a CPU machine; this one reaches all of them.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "sinks/metrics_registry.hpp"

namespace steptrace::detail {
namespace {

std::set<std::string> split(std::string_view csv) {
  std::set<std::string> out;
  std::stringstream in{std::string(csv)};
  for (std::string item; std::getline(in, item, ',');) out.insert(item);
  return out;
}

// A step with every figure the registry exports: phases, memory, counters, GPU hardware,
// sized collectives, useful work and a run-queue reading.
StepRecord full_step(PhaseNames& names) {
  StepRecord r;
  r.step = 0;
  r.step_ns = r.host_ns = 200'000'000;
  r.start_unix_ns = 1'700'000'000'000'000'000;
  r.data_ns = 1'000'000;
  r.runq_ns = 2'000'000;
  r.phase_count = 1;
  r.phase_ids[0] = names.intern("forward");
  r.phase_ns[0] = 100'000'000;
  r.memory.allocated_bytes = 100;
  r.counters.present = true;
  r.counters.values[0] = r.counters.values[1] = r.counters.values[2] = 50.0;
  HwStats& h = r.hw;
  h.present = true;
  h.samples = 2;
  h.avg_power_w = 500;
  h.power_limit_w = 700;
  h.energy_j = 50;
  h.max_temp_c = 70;
  h.max_mem_temp_c = 80;
  h.sm_clock_mhz = 1980;
  h.mem_clock_mhz = 2619;
  h.util_pct = 90;
  h.pcie_tx_mb_s = h.pcie_rx_mb_s = 10;
  h.nvlink_tx_mb_s = h.nvlink_rx_mb_s = 20;
  h.throttle_reasons = kThrottleSwPowerCap;
  r.comm.count = 1;
  r.comm.busy_ns = 10'000'000;
  r.comm.exposed_ns = 5'000'000;
  r.comm.bytes = 4'000'000;
  r.comm.bus_bytes = 6'000'000;
  r.work.add(8, 1024, 4e12, WorkSource::kUser);
  r.work.peak_flops_per_s = 10e12;
  return r;
}

TEST(MetricTable, RowsAreWellFormed) {
  std::set<std::string_view> names;
  for (const MetricDef& d : kMetrics) {
    EXPECT_TRUE(names.insert(d.name).second) << d.name;
    EXPECT_EQ(d.name.substr(0, 10), "steptrace_") << d.name;
    EXPECT_FALSE(d.help.empty()) << d.name;
    EXPECT_EQ(d.help.find('\n'), std::string_view::npos) << d.name;
    EXPECT_EQ(d.buckets != MetricBuckets::none, d.type == MetricType::histogram) << d.name;
    if (d.type == MetricType::counter) {
      EXPECT_EQ(d.name.substr(d.name.size() - 6), "_total") << d.name;
    }
  }
  std::set<Metric> exported;
  for (const OtlpInstrumentDef& o : kOtlpInstruments) {
    EXPECT_TRUE(exported.insert(o.metric).second) << o.name;  // one instrument per family
    EXPECT_EQ(o.name.substr(0, 10), "steptrace.") << o.name;
  }
}

TEST(MetricTable, ARegistryWithEveryKindOfDataRendersExactlyTheTablesFamilies) {
  PhaseNames names;
  const OpenIntervalProbe open{IntervalKind::kEval, 3.0, 1};
  MetricsRegistry reg(
      MetricLabels{"j", "r", 0, "h"}, names, "1", [] { return 0.2; }, [] { return 0.1; },
      [&] { return open; });
  reg.start_badput(1'699'999'999'000'000'000);
  reg.seed_badput(BadputCause::kRecovery, 5.0);
  reg.observe_step(full_step(names));
  AlertEvent xid;
  xid.type = "hardware_error";
  xid.details = {{"kind", "xid"}, {"code", 79}};
  reg.observe_alert(xid);
  reg.observe_cluster(nlohmann::ordered_json::parse(R"({"kind": "cluster", "world_size": 2,
      "ranks_reporting": 2, "stragglers": [1], "ranks": [
        {"rank": 0, "host": "a", "step_ms": 10, "step_p95_ms": 11, "compute_ms": 6, "comm_ms": 1,
         "wait_ms": 0, "data_ms": 1, "straggler_pct": 0, "busbw_gbps": 12.5},
        {"rank": 1, "host": "b", "step_ms": 14, "step_p95_ms": 15, "compute_ms": 9, "comm_ms": 1,
         "wait_ms": 0, "data_ms": 1, "straggler_pct": 40, "busbw_gbps": 11}]})"));
  const std::string text = reg.render();

  std::map<std::string, std::string> types, helps;
  std::map<std::string, std::set<std::string>> labels;
  const std::regex help_re("# HELP (\\S+) (.*)"), type_re("# TYPE (\\S+) (\\S+)");
  const std::regex sample_re("(\\w+)\\{(.*)\\} \\S+"), label_re("(\\w+)=\"(?:[^\"\\\\]|\\\\.)*\"");
  std::istringstream in(text);
  std::string family;
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_match(line, m, help_re)) {
      family = m[1];
      helps[family] = m[2];
    } else if (std::regex_match(line, m, type_re)) {
      types[m[1]] = m[2];
    } else if (std::regex_match(line, m, sample_re)) {
      const std::string name = m[1];
      EXPECT_EQ(name.rfind(family, 0), 0u) << name << " outside its family " << family;
      const std::string ls = m[2];
      for (auto it = std::sregex_iterator(ls.begin(), ls.end(), label_re);
           it != std::sregex_iterator(); ++it) {
        labels[family].insert((*it)[1]);
      }
    } else {
      ADD_FAILURE() << "unexpected line: " << line;
    }
  }

  std::set<std::string> table;
  for (const MetricDef& d : kMetrics) {
    const std::string name(d.name);
    table.insert(name);
    ASSERT_TRUE(types.count(name)) << name << " is in the table but not rendered";
    EXPECT_EQ(types[name], metric_type_name(d.type)) << name;
    EXPECT_EQ(helps[name], d.help) << name;
    std::set<std::string> want = split(d.labels);
    want.insert({"job", "run_id", "rank", "host"});
    if (d.type == MetricType::histogram) want.insert("le");
    EXPECT_EQ(labels[name], want) << name;
  }
  for (const auto& [name, type] : types) {
    EXPECT_TRUE(table.count(name)) << name << " is rendered but not in the table";
  }
  EXPECT_EQ(types.size(), std::size(kMetrics));
}

}  // namespace
}  // namespace steptrace::detail
