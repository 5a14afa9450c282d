#include "record_json.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "check.hpp"
#include "steptrace/error.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "telemetry_stage.hpp"

namespace steptrace::detail {
namespace {

constexpr double kNsPerMs = 1e6;

// Milliseconds with 0.1 us resolution: CUDA events resolve about 0.5 us.
void append_ms(fmt::memory_buffer& out, std::int64_t ns) {
  fmt::format_to(std::back_inserter(out), "{:.4f}", static_cast<double>(ns) / kNsPerMs);
}

// `gc`: Python's collections in the step (ms, gen2_ms) and in the gap before it
// (between_ms, between_gen2_ms), each only when > 0, and how many ended in either.
void append_gc(fmt::memory_buffer& out, const StepRecord& r) {
  out.append(std::string_view(",\"gc\":{"));
  auto field = [&](std::string_view key, std::int64_t ns) {
    if (ns <= 0) return;
    out.append(key);
    append_ms(out, ns);
    out.push_back(',');
  };
  std::int64_t in_step = 0, between = 0;
  for (std::size_t g = 0; g < kGcGenerations; ++g) {
    in_step += r.gc_ns[g];
    between += r.gc_between_ns[g];
  }
  field("\"ms\":", in_step);
  field("\"gen2_ms\":", r.gc_ns[2]);
  field("\"between_ms\":", between);
  field("\"between_gen2_ms\":", r.gc_between_ns[2]);
  fmt::format_to(std::back_inserter(out), "\"count\":{}}}", r.gc_count);
}

void append_memory(fmt::memory_buffer& out, const MemorySample& m) {
  auto it = std::back_inserter(out);
  bool first = true;
  auto field = [&](const char* key, std::int64_t v) {
    if (v < 0) return;
    fmt::format_to(it, "{}\"{}\":{}", first ? "" : ",", key, v);
    first = false;
  };
  out.push_back('{');
  field("allocated_bytes", m.allocated_bytes);
  field("reserved_bytes", m.reserved_bytes);
  field("peak_bytes", m.peak_bytes);
  field("rss_bytes", m.rss_bytes);
  field("heap_bytes", m.heap_bytes);
  field("device_used_bytes", m.device_used_bytes);
  field("device_total_bytes", m.device_total_bytes);
  out.push_back('}');
}

void append_kernels(fmt::memory_buffer& out, const KernelStats& k) {
  out.append(std::string_view(",\"kernels\":{\"compute_ms\":"));
  append_ms(out, k.compute_ns);
  out.append(std::string_view(",\"nccl_ms\":"));
  append_ms(out, k.nccl_ns);
  out.append(std::string_view(",\"exposed_nccl_ms\":"));
  append_ms(out, k.exposed_nccl_ns);
  out.append(std::string_view(",\"matmul_ms\":"));
  append_ms(out, k.matmul_ns);
  out.append(std::string_view(",\"idle_ms\":"));
  append_ms(out, k.idle_ns);
  fmt::format_to(std::back_inserter(out), ",\"count\":{}}}", k.count);
}

// Host-timed collectives: compute_ms is the step's host time not blocked on them.
void append_comm(fmt::memory_buffer& out, const StepRecord& r, const PhaseNames& names) {
  const CommStats& c = r.comm;
  out.append(std::string_view(",\"comm\":{\"method\":\"host\",\"comm_ms\":"));
  append_ms(out, c.busy_ns);
  out.append(std::string_view(",\"exposed_ms\":"));
  append_ms(out, std::min(c.exposed_ns, r.host_ns));
  out.append(std::string_view(",\"compute_ms\":"));
  append_ms(out, std::max<std::int64_t>(0, r.host_ns - c.exposed_ns));
  fmt::format_to(std::back_inserter(out), ",\"collectives\":{}", c.count);
  if (c.bytes > 0 && c.busy_ns > 0) {  // bytes per ns are GB/s
    const double ns = static_cast<double>(c.busy_ns);
    fmt::format_to(std::back_inserter(out),
                   ",\"bytes\":{},\"algbw_gbps\":{:.6g},\"busbw_gbps\":{:.6g}", c.bytes,
                   static_cast<double>(c.bytes) / ns, static_cast<double>(c.bus_bytes) / ns);
  }
  if (c.exposed_phase >= 0 && static_cast<std::size_t>(c.exposed_phase) < names.size()) {
    out.append(std::string_view(",\"exposed_in\":"));
    const std::string& key = names.json_key(static_cast<std::uint16_t>(c.exposed_phase));
    out.append(key.data(), key.data() + key.size());
  }
  if (c.between_blocked_ns > 0) {
    out.append(std::string_view(",\"blocked_between_ms\":"));
    append_ms(out, c.between_blocked_ns);
  }
  out.push_back('}');
}

// `"key":value` after `sep` (then sep becomes ","), for a known figure of work: a count or
// rate is never negative, and an unknown one (NaN, < 0) is left out.
void append_work_field(fmt::memory_buffer& out, const char*& sep, const char* key, double v,
                       const char* spec) {
  if (!std::isfinite(v) || v < 0) return;
  auto it = std::back_inserter(out);
  fmt::format_to(it, "{}\"{}\":", sep, key);
  fmt::format_to(it, fmt::runtime(spec), v);
  sep = ",";
}

// The step's useful work and what it comes to per second (work.hpp); unknown figures are
// left out.
void append_work(fmt::memory_buffer& out, const StepRecord& r) {
  const WorkCount& c = r.work;
  const WorkRates w = work_rates(r);
  out.append(std::string_view(",\"work\":{"));
  const char* sep = "";
  auto field = [&](const char* key, double v, const char* spec) {
    append_work_field(out, sep, key, v, spec);
  };
  field("samples", c.samples, "{:.15g}");
  field("tokens", c.tokens, "{:.15g}");
  field("flops", c.flops, "{:.6g}");
  field("samples_per_s", w.samples_per_s, "{:.6g}");
  field("tokens_per_s", w.tokens_per_s, "{:.6g}");
  field("tflops_per_s", w.tflops_per_s, "{:.6g}");
  field("mfu_pct", w.mfu_pct, "{:.6g}");
  field("j_per_sample", w.j_per_sample, "{:.6g}");
  field("j_per_token", w.j_per_token, "{:.6g}");
  out.push_back('}');
}

void append_counters(fmt::memory_buffer& out, const CounterStats& c) {
  auto it = std::back_inserter(out);
  out.append(std::string_view(",\"counters\":{"));
  for (std::size_t i = 0; i < kCounterCount; ++i) {
    if (!std::isfinite(c.values[i])) continue;
    // percentages of peak; rounding in the counters' evaluation can overshoot a little
    fmt::format_to(it, "\"{}\":{:.2f},", kCounterNames[i], std::clamp(c.values[i], 0.0, 100.0));
  }
  fmt::format_to(it, "\"coverage_pct\":{:.1f}}}", c.coverage_pct);
}

// NVML figures of the step; a figure the device does not report is left out.
void append_hw(fmt::memory_buffer& out, const HwStats& h) {
  auto it = std::back_inserter(out);
  fmt::format_to(it, ",\"hw\":{{\"power_w\":{:.1f},\"min_power_w\":{:.1f},\"energy_j\":{:.3f}",
                 h.avg_power_w, h.min_power_w, h.energy_j);
  if (std::isfinite(h.max_temp_c)) fmt::format_to(it, ",\"max_temp_c\":{:.0f}", h.max_temp_c);
  if (std::isfinite(h.sm_clock_mhz)) fmt::format_to(it, ",\"sm_clock_mhz\":{:.0f}", h.sm_clock_mhz);
  if (h.power_limit_w > 0) fmt::format_to(it, ",\"power_limit_w\":{:.0f}", h.power_limit_w);
  if (std::isfinite(h.pcie_tx_mb_s)) fmt::format_to(it, ",\"pcie_tx_mb_s\":{:.1f}", h.pcie_tx_mb_s);
  if (std::isfinite(h.pcie_rx_mb_s)) fmt::format_to(it, ",\"pcie_rx_mb_s\":{:.1f}", h.pcie_rx_mb_s);
  if (std::isfinite(h.nvlink_tx_mb_s))
    fmt::format_to(it, ",\"nvlink_tx_mb_s\":{:.1f}", h.nvlink_tx_mb_s);
  if (std::isfinite(h.nvlink_rx_mb_s))
    fmt::format_to(it, ",\"nvlink_rx_mb_s\":{:.1f}", h.nvlink_rx_mb_s);
  if (std::isfinite(h.mem_clock_mhz))
    fmt::format_to(it, ",\"mem_clock_mhz\":{:.0f}", h.mem_clock_mhz);
  if (std::isfinite(h.max_mem_temp_c))
    fmt::format_to(it, ",\"max_mem_temp_c\":{:.0f}", h.max_mem_temp_c);
  if (std::isfinite(h.util_pct)) fmt::format_to(it, ",\"util_pct\":{:.1f}", h.util_pct);
  out.append(std::string_view(",\"throttle_reasons\":["));
  const char* sep = "";
  for (const std::string& name : throttle_reason_names(h.throttle_reasons)) {
    fmt::format_to(it, "{}\"{}\"", sep, name);
    sep = ",";
  }
  fmt::format_to(it, "],\"samples\":{}}}", h.samples);
}

template <typename Values>
void append_phase_map(fmt::memory_buffer& out, const StepRecord& r, const Values& values,
                      const PhaseNames& names) {
  out.push_back('{');
  for (std::uint16_t i = 0; i < r.phase_count; ++i) {
    if (i != 0) out.push_back(',');
    const std::string& key = names.json_key(r.phase_ids[i]);
    out.append(key.data(), key.data() + key.size());
    out.push_back(':');
    append_ms(out, values[i]);
  }
  out.push_back('}');
}

// Shortest round-trip form ("120", "0.001"); JSON has no NaN or infinity: null.
void append_meta(fmt::memory_buffer& out, const StepRecord& r, const PhaseNames& names) {
  out.append(std::string_view(",\"meta\":{"));
  for (std::uint8_t i = 0; i < r.value_count; ++i) {
    if (i != 0) out.push_back(',');
    const std::string& key = names.value_json_key(r.value_ids[i]);
    out.append(key.data(), key.data() + key.size());
    out.push_back(':');
    if (std::isfinite(r.values[i])) {
      fmt::format_to(std::back_inserter(out), "{}", r.values[i]);
    } else {
      out.append(std::string_view("null"));
    }
  }
  out.push_back('}');
}

// run_end's "goodput": the wall clock from the process's start (else the profiler's) to
// the end, split into parts that add up to it: startup (to the first step), the steps
// (less intervals inside them), the loader's waits, evaluation, checkpoints, other host
// work between steps, and the time after the last step.
void append_goodput_json(fmt::memory_buffer& out, const RunEnd& end, const RunTotals& t) {
  const std::int64_t origin =
      end.process_start_unix_ns > 0 ? end.process_start_unix_ns : end.profiler_start_unix_ns;
  const std::int64_t wall = std::max<std::int64_t>(0, end.end_unix_ns - origin);
  const BetweenSteps& tail = end.trailing;
  const std::int64_t tail_intervals = tail.own_kinds_ns();
  std::int64_t startup = 0, after = 0;
  if (t.steps > 0) {
    startup = t.first_start_unix_ns - origin - t.before_first_ns;
    after = end.end_unix_ns - t.last_end_unix_ns - tail_intervals;
  } else {
    startup = wall - tail_intervals;
  }
  auto sec = [](std::int64_t ns) {
    return static_cast<double>(std::max<std::int64_t>(0, ns)) / 1e9;
  };
  fmt::format_to(
      std::back_inserter(out),
      "\"goodput\":{{\"wall_s\":{:.3f},\"startup_s\":{:.3f},\"steps_s\":{:.3f},"
      "\"data_s\":{:.3f},\"eval_s\":{:.3f},\"checkpoint_s\":{:.3f},\"restore_s\":{:.3f},"
      "\"other_s\":{:.3f},\"after_last_step_s\":{:.3f},\"training_pct\":{:.2f},\"from\":\"{}\"}},",
      sec(wall), sec(startup), sec(t.training_ns_sum), sec(t.data_ns_sum),
      sec(t.interval_ns_sum[0] + tail.eval_ns()), sec(t.interval_ns_sum[1] + tail.checkpoint_ns()),
      sec(t.interval_ns_sum[3] + tail.restore_ns()), sec(t.other_ns_sum), sec(after),
      wall > 0 ? 100.0 * static_cast<double>(t.training_ns_sum) / static_cast<double>(wall) : 0.0,
      end.process_start_unix_ns > 0 ? "process_start" : "profiler_start");
}

}  // namespace

void RunTotals::add(const StepRecord& r) noexcept {
  ++steps;
  if (r.failed) ++error_steps;
  step_ns_sum += r.step_ns;
  step_ns_max = std::max(step_ns_max, r.step_ns);
  data_ns_sum += r.data_ns;
  if (steps == 1) {
    first_start_unix_ns = r.start_unix_ns;
    // what came before the first step and is counted in its own part: not startup
    before_first_ns = r.data_ns + r.between.own_kinds_ns() - r.between.inside_step_ns;
  }
  last_end_unix_ns = std::max(last_end_unix_ns, r.start_unix_ns + r.host_ns);
  training_ns_sum += r.host_ns - r.between.inside_step_ns;
  other_ns_sum += r.between.other_ns;
  for (std::size_t k = 0; k < kIntervalKinds; ++k) interval_ns_sum[k] += r.between.interval_ns[k];
  if (r.runq_ns > 0) runq_ns_sum += r.runq_ns;
  gc_ns_sum += gc_in_iteration_ns(r);
  gc_gen2_ns_sum += gc_in_iteration_ns(r, /*gen2_only=*/true);
  gc_count += r.gc_count;
  if (r.steal_ns >= 0) steal_ns_sum = std::max<std::int64_t>(steal_ns_sum, 0) + r.steal_ns;
  if (r.device_clock) ++device_clock_steps;
  if (r.captured) ++captured_steps;
  clamped_intervals += r.clamped_intervals;
  work.add(r);
  for (std::uint16_t i = 0; i < r.phase_count; ++i) {
    phase_ns_sum[r.phase_ids[i]] += r.phase_ns[i];
    phase_seen[r.phase_ids[i]] = true;
  }
}

void append_json_string(fmt::memory_buffer& out, std::string_view s) {
  out.push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"':
        out.append(std::string_view("\\\""));
        break;
      case '\\':
        out.append(std::string_view("\\\\"));
        break;
      case '\n':
        out.append(std::string_view("\\n"));
        break;
      case '\r':
        out.append(std::string_view("\\r"));
        break;
      case '\t':
        out.append(std::string_view("\\t"));
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          fmt::format_to(std::back_inserter(out), "\\u{:04x}", static_cast<int>(c));
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

void append_interval_json(fmt::memory_buffer& out, const IntervalEntry& e, std::int64_t step,
                          int rank) {
  const std::string_view kind = interval_name(e.kind);
  fmt::format_to(std::back_inserter(out),
                 "{{\"kind\":\"interval\",\"rank\":{},\"interval\":\"{}\",\"step\":{},"
                 "\"inside_step\":{},\"start_unix_ns\":{},\"duration_ms\":",
                 rank, kind, step, e.inside_step, e.start_unix_ns);
  append_ms(out, e.duration_ns);
  out.append(std::string_view("}\n"));
}

void append_step_json(fmt::memory_buffer& out, const StepRecord& r, int rank,
                      const PhaseNames& names) {
  const BetweenSteps& between = r.between;
  for (std::uint8_t i = 0; i < between.listed; ++i) {
    append_interval_json(out, between.intervals[i], r.step, rank);
  }
  auto it = std::back_inserter(out);
  fmt::format_to(it,
                 "{{\"kind\":\"step\",\"rank\":{},\"step\":{},\"start_unix_ns\":{},"
                 "\"clock\":\"{}\",\"status\":\"{}\",\"step_ms\":",
                 rank, r.step, r.start_unix_ns, r.device_clock ? "cuda" : "host",
                 r.failed ? "error" : "ok");
  append_ms(out, r.step_ns);
  out.append(std::string_view(",\"data_ms\":"));
  append_ms(out, r.data_ns);
  if (r.progress >= 0) fmt::format_to(it, ",\"progress\":{}", r.progress);
  if (r.compile_ns > 0) {
    out.append(std::string_view(",\"compile_ms\":"));
    append_ms(out, r.compile_ns);
  }
  if (r.data_start_ns > 0) {
    out.append(std::string_view(",\"data_start_ms\":"));
    append_ms(out, r.data_start_ns);
  }
  out.append(std::string_view(",\"other_ms\":"));
  append_ms(out, between.other_ns);
  if (between.eval_ns() > 0) {
    out.append(std::string_view(",\"eval_ms\":"));
    append_ms(out, between.eval_ns());
  }
  if (between.checkpoint_ns() > 0) {
    out.append(std::string_view(",\"checkpoint_ms\":"));
    append_ms(out, between.checkpoint_ns());
  }
  if (between.restore_ns() > 0) {
    out.append(std::string_view(",\"restore_ms\":"));
    append_ms(out, between.restore_ns());
  }
  if (between.inside_step_ns > 0) {
    out.append(std::string_view(",\"interval_in_step_ms\":"));
    append_ms(out, between.inside_step_ns);
  }
  if (r.runq_ns >= 0) {
    out.append(std::string_view(",\"host\":{\"runq_ms\":"));
    append_ms(out, r.runq_ns);
    out.append(std::string_view(",\"runq_span_ms\":"));
    append_ms(out, r.runq_span_ns);
    if (r.on_cpu_ns >= 0) {
      out.append(std::string_view(",\"on_cpu_ms\":"));
      append_ms(out, r.on_cpu_ns);
    }
    if (r.steal_ns >= 0) {
      out.append(std::string_view(",\"steal_ms\":"));
      append_ms(out, r.steal_ns);
    }
    out.push_back('}');
  }
  if (r.gc_count > 0) append_gc(out, r);
  out.append(std::string_view(",\"host_ms\":"));
  append_ms(out, r.host_ns);
  out.append(std::string_view(",\"phases_ms\":"));
  append_phase_map(out, r, r.phase_ns, names);
  if (r.phase_memory) {
    const auto retained = retained_by_phase(r);
    out.append(std::string_view(",\"phase_retained_bytes\":{"));
    for (std::uint16_t i = 0; i < r.phase_count; ++i) {
      if (i != 0) out.push_back(',');
      const std::string& key = names.json_key(r.phase_ids[i]);
      out.append(key.data(), key.data() + key.size());
      fmt::format_to(it, ":{}", retained[i]);
    }
    out.push_back('}');
  }
  if (r.waited) out.append(std::string_view(",\"waited\":true"));
  if (r.captured) out.append(std::string_view(",\"captured\":true"));
  if (r.profiled) out.append(std::string_view(",\"profiled\":true"));
  if (r.device_clock) {
    fmt::format_to(it, ",\"stream\":{{\"id\":{},\"device\":{}}}", r.stream.handle, r.stream.device);
    if (r.clamped_intervals > 0)
      fmt::format_to(it, ",\"clamped_intervals\":{}", r.clamped_intervals);
    out.append(std::string_view(",\"host_phases_ms\":"));
    append_phase_map(out, r, r.host_phase_ns, names);
  }
  out.append(std::string_view(",\"memory\":"));
  append_memory(out, r.memory);
  if (r.kernels.present) append_kernels(out, r.kernels);
  if (r.counters.present) append_counters(out, r.counters);
  if (r.comm.count > 0) append_comm(out, r, names);
  if (r.hw.present) append_hw(out, r.hw);
  if (r.work.any()) append_work(out, r);
  if (r.value_count > 0) append_meta(out, r, names);
  out.append(std::string_view("}\n"));
}

// The run's work over the iterations that reported it, its energy where NVML measured it,
// and the MFU over the whole run (total FLOPs / their iterations' time / the peak).
void append_run_work_json(fmt::memory_buffer& out, const RunEnd& end, const WorkTotals& w) {
  auto it = std::back_inserter(out);
  out.append(std::string_view("\"work\":{"));
  const char* sep = "";
  auto field = [&](const char* key, double v, const char* spec) {
    append_work_field(out, sep, key, v, spec);
  };
  auto per_s = [](double v, std::int64_t ns) {
    return ns > 0 ? v / (static_cast<double>(ns) * 1e-9) : WorkRates::kUnknown;
  };
  if (w.samples_ns > 0) {
    field("samples", w.samples, "{:.15g}");
    field("samples_per_s", per_s(w.samples, w.samples_ns), "{:.6g}");
  }
  if (w.tokens_ns > 0) {
    field("tokens", w.tokens, "{:.15g}");
    field("tokens_per_s", per_s(w.tokens, w.tokens_ns), "{:.6g}");
  }
  if (w.flops_ns > 0) {
    field("flops", w.flops, "{:.6g}");
    const double flops_per_s = per_s(w.flops, w.flops_ns);
    field("tflops_per_s", flops_per_s * 1e-12, "{:.6g}");
    if (w.peak_flops_per_s > 0) {
      field("mfu_pct", 100.0 * flops_per_s / w.peak_flops_per_s, "{:.6g}");
      field("peak_tflops", w.peak_flops_per_s * 1e-12, "{:.6g}");
      if (!end.mfu_dtype.empty()) {
        fmt::format_to(it, ",\"mfu_dtype\":\"{}\"", end.mfu_dtype);
        if (end.mfu_dtype_assumed) out.append(std::string_view(",\"mfu_dtype_assumed\":true"));
      }
    }
  }
  if (w.energy_tokens > 0) {
    field("energy_j", w.energy_j, "{:.6g}");
    field("j_per_token", w.energy_j / w.energy_tokens, "{:.6g}");
    // 1 kWh = 3.6e6 J
    field("tokens_per_kwh", w.energy_tokens / (w.energy_j / 3.6e6), "{:.6g}");
  }
  out.append(std::string_view("},"));
}

void append_run_end_json(fmt::memory_buffer& out, const RunEnd& end, const RunTotals& totals,
                         int rank, const PhaseNames& names) {
  auto it = std::back_inserter(out);
  fmt::format_to(it, "{{\"kind\":\"run_end\",\"rank\":{},\"reason\":\"{}\",", rank, end.reason);
  if (!end.error.empty()) {
    out.append(std::string_view("\"error\":"));
    append_json_string(out, end.error);
    out.push_back(',');
  }
  fmt::format_to(it,
                 "\"end_unix_ns\":{},\"steps\":{},\"error_steps\":{},\"wall_s\":{:.3f},"
                 "\"writer_waits\":{},\"dropped_steps\":{},\"write_errors\":{},"
                 "\"data_inside_step\":{},",
                 end.end_unix_ns, totals.steps, totals.error_steps, end.wall_s, end.writer_waits,
                 end.dropped_steps, end.write_errors, end.data_inside_step);
  if (!end.write_error.empty()) {
    out.append(std::string_view("\"write_error\":"));
    append_json_string(out, end.write_error);
    out.push_back(',');
  }
  if (totals.device_clock_steps > 0 || totals.captured_steps > 0) {
    fmt::format_to(it,
                   "\"device_timing\":{{\"steps\":{},\"captured_steps\":{},"
                   "\"clamped_intervals\":{}}},",
                   totals.device_clock_steps, totals.captured_steps, totals.clamped_intervals);
  }
  out.append(std::string_view("\"alerts\":{"));
  auto append_counts = [&](const std::map<std::string, std::int64_t>& counts) {
    bool first_entry = true;
    for (const auto& [type, count] : counts) {
      if (!first_entry) out.push_back(',');
      first_entry = false;
      append_json_string(out, type);
      fmt::format_to(it, ":{}", count);
    }
    out.append(std::string_view("},"));
  };
  append_counts(end.alerts);
  if (!end.alert_repeats.empty()) {
    out.append(std::string_view("\"alert_repeats\":{"));
    append_counts(end.alert_repeats);
  }
  if (!end.extra_fields.empty()) {
    out.append(end.extra_fields);
    out.push_back(',');
  }
  append_goodput_json(out, end, totals);
  if (totals.work.any()) append_run_work_json(out, end, totals.work);
  out.append(std::string_view("\"summary\":{\"step_ms_mean\":"));
  append_ms(out, totals.steps > 0 ? totals.step_ns_sum / totals.steps : 0);
  out.append(std::string_view(",\"step_ms_max\":"));
  append_ms(out, totals.step_ns_max);
  out.append(std::string_view(",\"data_ms_total\":"));
  append_ms(out, totals.data_ns_sum);
  out.append(std::string_view(",\"runq_ms_total\":"));
  append_ms(out, totals.runq_ns_sum);
  if (totals.gc_count > 0) {
    out.append(std::string_view(",\"gc_ms_total\":"));
    append_ms(out, totals.gc_ns_sum);
    out.append(std::string_view(",\"gc_gen2_ms_total\":"));
    append_ms(out, totals.gc_gen2_ns_sum);
    fmt::format_to(std::back_inserter(out), ",\"gc_count\":{}", totals.gc_count);
  }
  if (totals.steal_ns_sum >= 0) {
    out.append(std::string_view(",\"steal_ms_total\":"));
    append_ms(out, totals.steal_ns_sum);
  }
  out.append(std::string_view(",\"phases_ms_total\":{"));
  bool first = true;
  for (std::size_t id = 0; id < names.size(); ++id) {
    if (!totals.phase_seen[id]) continue;
    if (!first) out.push_back(',');
    first = false;
    const std::string& key = names.json_key(static_cast<std::uint16_t>(id));
    out.append(key.data(), key.data() + key.size());
    out.push_back(':');
    append_ms(out, totals.phase_ns_sum[id]);
  }
  out.append(std::string_view("}}}\n"));
}

template <std::size_t N>
std::uint16_t PhaseNames::Table<N>::append(std::string owned) {
  const std::size_t n = count.load(std::memory_order_relaxed);
  fmt::memory_buffer key;
  append_json_string(key, owned);
  keys[n] = fmt::to_string(key);
  names[n] = std::move(owned);
  count.store(n + 1, std::memory_order_release);
  return static_cast<std::uint16_t>(n);
}

std::uint16_t PhaseNames::intern(std::string_view name) {
  const int found = phases_.find(name);
  if (found >= 0) return static_cast<std::uint16_t>(found);
  std::string owned(name);
  validate_phase_name(owned);
  const std::size_t n = phases_.size();
  STEPTRACE_CHECK(n < kMaxPhases, ConfigError,
                  "phase {:?} would be distinct phase number {}; at most {} are allowed", owned,
                  n + 1, kMaxPhases);
  return phases_.append(std::move(owned));
}

std::uint16_t PhaseNames::intern_value(std::string_view name) {
  const int found = values_.find(name);
  if (found >= 0) return static_cast<std::uint16_t>(found);
  std::string owned(name);
  STEPTRACE_CHECK(!owned.empty(), ConfigError,
                  "step value name is empty; give it a name such as \"global_step\"");
  STEPTRACE_CHECK(owned.size() <= kMaxPhaseNameBytes, ConfigError,
                  "step value name \"{}...\" is {} bytes long; at most {} bytes are allowed",
                  owned.substr(0, 16), owned.size(), kMaxPhaseNameBytes);
  for (const char c : owned) {
    STEPTRACE_CHECK(static_cast<unsigned char>(c) >= 0x20 && c != 0x7f, ConfigError,
                    "step value name {:?} contains a control character; use printable characters",
                    owned);
  }
  const std::size_t n = values_.size();
  STEPTRACE_CHECK(n < kMaxStepValues, ConfigError,
                  "step value {:?} would be distinct step value number {}; at most {} names are "
                  "allowed per run",
                  owned, n + 1, kMaxStepValues);
  return values_.append(std::move(owned));
}

}  // namespace steptrace::detail
