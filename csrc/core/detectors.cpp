#include "detectors.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace steptrace::detail {
namespace {

constexpr double kNsPerMs = 1e6;

const char* advice_for(const std::string& phase) {
  if (phase == "data") {
    return "the input pipeline is the bottleneck: add DataLoader workers, prefetch, or "
           "pin_memory";
  }
  if (phase == "optimizer") return "check for optimizer-state offload or host-device copies";
  if (phase == "backward") {
    return "check for gradient communication, recomputation or a changed model";
  }
  if (phase == "forward") return "check for shape changes, recompilation or a changed model";
  return "compare this phase with the steps before";
}

std::string mib(double bytes) { return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024.0)); }

double median_of(std::vector<double> v) {
  if (v.empty()) return 0.0;
  const std::size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  double m = v[mid];
  if (v.size() % 2 == 0) m = 0.5 * (m + *std::max_element(v.begin(), v.begin() + mid));
  return m;
}

}  // namespace

// ---- step_regression / stall ----

SlowStepDetector::SlowStepDetector(const Config& config, const PhaseNames& names)
    : config_(config),
      names_(names),
      iteration_(static_cast<std::size_t>(config.window)),
      data_(static_cast<std::size_t>(config.window)) {}

void SlowStepDetector::observe(const StepRecord& r, std::vector<AlertEvent>& out) {
  // Warmup steps and failed (partial) steps say nothing about steady-state speed.
  if (r.step < config_.warmup_steps || r.failed) return;
  const double iteration_ms = static_cast<double>(r.data_ns + r.step_ns) / kNsPerMs;
  const double data_ms = static_cast<double>(r.data_ns) / kNsPerMs;
  if (phases_.size() < names_.size()) phases_.resize(names_.size());

  if (iteration_.size() >= static_cast<std::size_t>(config_.min_history)) {
    const double median = iteration_.median();
    const double ratio = median > 0 ? iteration_ms / median : 0.0;
    const bool slow = ratio > config_.regression_threshold;
    if (slow && slow_streak_++ == 0) streak_start_ = r.step;
    if (!slow) slow_streak_ = 0;
    const int level = ratio > config_.stall_threshold                        ? 2
                      : slow && slow_streak_ >= config_.regression_min_steps ? 1
                                                                             : 0;
    if (level > level_) {  // a new episode, or a regression that became a stall
      // The phase (data included) that grew most, in ms, against its own median.
      std::string grew = "data";
      double grew_ms = data_ms, grew_median = data_.median();
      double best = data_ms - grew_median;
      for (std::uint16_t i = 0; i < r.phase_count; ++i) {
        const auto id = r.phase_ids[i];
        const double ms = static_cast<double>(r.phase_ns[i]) / kNsPerMs;
        const double med = phases_[id] ? phases_[id]->median() : 0.0;
        if (ms - med > best) {
          best = ms - med;
          grew = names_.name(id);
          grew_ms = ms;
          grew_median = med;
        }
      }
      AlertEvent a;
      a.type = level == 2 ? "stall" : "step_regression";
      a.step = r.step;
      a.value = iteration_ms;
      a.baseline = median;
      a.threshold = level == 2 ? config_.stall_threshold : config_.regression_threshold;
      a.phase = grew;
      a.message = fmt::format(
          "step {} took {:.1f}x the trailing median ({:.2f} ms vs {:.2f} ms over {} steps){}; "
          "{} grew most ({:.2f} ms vs its median {:.2f} ms): {}",
          r.step, ratio, iteration_ms, median, iteration_.size(),
          slow_streak_ > 1 ? fmt::format(", slow since step {}", streak_start_) : "", grew, grew_ms,
          grew_median, advice_for(grew));
      a.details = {{"ratio", ratio},
                   {"phase_ms", grew_ms},
                   {"phase_median_ms", grew_median},
                   {"window_steps", iteration_.size()},
                   {"slow_since_step", streak_start_}};
      if (level_ == 0) episode_start_ = level == 2 ? r.step : streak_start_;
      level_ = level;
      out.push_back(std::move(a));
    } else if (!slow && level_ > 0) {
      AlertEvent done;
      done.resolved = true;
      done.type = level_ == 2 ? "stall" : "step_regression";
      done.step = r.step;
      done.first_step = episode_start_;
      done.message = fmt::format(
          "step {} is back within {:.1f}x the trailing median ({} slow "
          "steps from step {})",
          r.step, config_.regression_threshold, r.step - episode_start_, episode_start_);
      out.push_back(std::move(done));
      level_ = 0;
    }
  }

  iteration_.push(iteration_ms);
  data_.push(data_ms);
  // Every phase seen so far gets a value each step (0 when it did not run).
  std::vector<bool>& present = present_;  // reused: no allocation per step
  present.assign(names_.size(), false);
  for (std::uint16_t i = 0; i < r.phase_count; ++i) {
    const auto id = r.phase_ids[i];
    present[id] = true;
    if (!phases_[id]) {
      phases_[id] = std::make_unique<RollingMedian>(static_cast<std::size_t>(config_.window));
    }
    phases_[id]->push(static_cast<double>(r.phase_ns[i]) / kNsPerMs);
  }
  for (std::size_t id = 0; id < phases_.size(); ++id) {
    if (phases_[id] && !present[id]) phases_[id]->push(0.0);
  }
}

// ---- memory_growth ----

MemoryGrowthDetector::MemoryGrowthDetector(const Config& config, const PhaseNames& names,
                                           std::int64_t host_limit_bytes)
    : config_(config),
      names_(names),
      host_limit_bytes_(host_limit_bytes),
      window_(static_cast<std::size_t>(config.window)) {}

std::vector<double> MemoryGrowthDetector::ordered_window() const {
  std::vector<double> ordered(count_);
  const std::size_t start = count_ < window_.size() ? 0 : next_;
  for (std::size_t i = 0; i < count_; ++i) ordered[i] = window_[(start + i) % window_.size()];
  return ordered;
}

// Rising: the medians of the window's four quarters each clearly above the one before,
// "clearly" meaning by more than 3 standard errors estimated from the quarters' own
// spread (MAD). A linear leak passes even when tiny; a single jump (two plateaus) or
// noise does not, since two of its three steps between quarters are noise.
bool MemoryGrowthDetector::rising() const {
  if (count_ < kMinTrendPoints) return false;
  const std::vector<double> ordered = ordered_window();
  const std::size_t q = count_ / 4;
  constexpr double kMadToSigma = 1.4826;  // normal distribution
  constexpr double kMedianSe = 1.2533;    // s.e. of a median / (sigma / sqrt(n))
  double prev_median = 0, prev_se = 0;
  for (std::size_t k = 0; k < 4; ++k) {
    const auto first = ordered.begin() + static_cast<std::ptrdiff_t>(k * q);
    std::vector<double> quarter(first, first + static_cast<std::ptrdiff_t>(q));
    const double m = median_of(quarter);
    for (double& v : quarter) v = std::abs(v - m);
    const double se =
        kMedianSe * kMadToSigma * median_of(quarter) / std::sqrt(static_cast<double>(q));
    if (k > 0 &&
        !(m - prev_median > 3.0 * std::sqrt(se * se + prev_se * prev_se) && m > prev_median)) {
      return false;
    }
    prev_median = m;
    prev_se = se;
  }
  return true;
}

double MemoryGrowthDetector::theil_sen_slope() const {
  const std::vector<double> ordered = ordered_window();
  std::vector<double> slopes;
  slopes.reserve(count_ * (count_ - 1) / 2);
  for (std::size_t i = 0; i < count_; ++i) {
    for (std::size_t j = i + 1; j < count_; ++j) {
      slopes.push_back((ordered[j] - ordered[i]) / static_cast<double>(j - i));
    }
  }
  return median_of(std::move(slopes));
}

void MemoryGrowthDetector::observe(const StepRecord& r, std::vector<AlertEvent>& out) {
  if (r.step < config_.warmup_steps) return;
  const bool allocator = r.memory.allocated_bytes >= 0;
  const std::int64_t raw = allocator ? r.memory.allocated_bytes : r.memory.rss_bytes;
  if (raw < 0) return;
  const double value = static_cast<double>(raw);
  if (baseline_steps_ < config_.min_history) {  // the peak of the first steps is the baseline
    baseline_ = std::max(baseline_, value);
    ++baseline_steps_;
    return;
  }
  window_[next_] = value;
  next_ = (next_ + 1) % window_.size();
  count_ = std::min(count_ + 1, window_.size());

  if (r.phase_memory) {
    if (phase_growth_.size() < names_.size()) phase_growth_.resize(names_.size(), 0.0);
    const auto retained = retained_by_phase(r);
    for (std::uint16_t i = 0; i < r.phase_count; ++i) {
      phase_growth_[r.phase_ids[i]] += static_cast<double>(retained[i]);
    }
    ++attributed_steps_;
  }

  const double limit = baseline_ * (1.0 + config_.memory_growth_pct / 100.0);
  if (active_) {
    if (value <= limit) {
      AlertEvent done;
      done.resolved = true;
      done.type = "memory_growth";
      done.step = r.step;
      done.first_step = episode_start_;
      done.message = fmt::format("memory is back within {}% of the {} baseline",
                                 config_.memory_growth_pct, mib(baseline_));
      out.push_back(std::move(done));
      active_ = false;
      attributing_ = false;
    }
    return;
  }
  // Per-phase measurements start at half the tolerance, so that they are there when the
  // limit is crossed (the writer sees steps up to a flush interval late), and stop again
  // below a quarter of it.
  const double tolerance = limit - baseline_;
  if (value > baseline_ + 0.5 * tolerance) attributing_ = true;
  if (value < baseline_ + 0.25 * tolerance) attributing_ = false;
  if (value <= limit) {
    over_steps_ = 0;
    return;
  }
  ++over_steps_;
  if (!rising()) return;
  if (attributed_steps_ < kMinAttributedSteps && over_steps_ < kMaxAttributionWait) return;

  const double slope = theil_sen_slope();
  if (slope <= 0) return;
  std::string phase;
  double phase_bytes = 0;
  for (std::size_t id = 0; id < phase_growth_.size(); ++id) {
    if (phase_growth_[id] > phase_bytes) {
      phase_bytes = phase_growth_[id];
      phase = names_.name(static_cast<std::uint16_t>(id));
    }
  }
  const double total = allocator && r.memory.device_total_bytes > 0
                           ? static_cast<double>(r.memory.device_total_bytes)
                           : static_cast<double>(host_limit_bytes_);
  const double steps_left = total > value ? (total - value) / slope : -1.0;  // -1: unknown

  AlertEvent a;
  a.type = "memory_growth";
  a.step = r.step;
  a.value = value;
  a.baseline = baseline_;
  a.threshold = 1.0 + config_.memory_growth_pct / 100.0;
  a.phase = phase;
  const char* metric = allocator ? "allocated_bytes" : "rss_bytes";
  a.message = fmt::format(
      "memory ({}) grew to {}, {:.1f}% above the {} of the first steps, rising {:.1f} "
      "KiB/step{}{}: "
      "look for tensors kept across steps (e.g. a loss appended to a list without .item())",
      metric, mib(value), 100.0 * (value / baseline_ - 1.0), mib(baseline_), slope / 1024.0,
      phase.empty() ? "" : fmt::format(", most of it in {}", phase),
      steps_left >= 0 ? fmt::format("; full in about {:.0f} steps", steps_left) : "");
  a.details = {{"metric", metric},
               {"bytes_per_step", slope},
               {"steps_until_full",
                steps_left >= 0 ? nlohmann::ordered_json(steps_left) : nlohmann::ordered_json()},
               {"limit_bytes", total},
               {"phase_growth_bytes", phase_bytes}};
  out.push_back(std::move(a));
  active_ = true;
  episode_start_ = r.step;
}

// ---- hang ----

std::optional<AlertEvent> HangDetector::check(std::int64_t now_ns, std::int64_t step,
                                              std::int64_t start_ns, const std::string& phase,
                                              double median_ms, bool history_ok) {
  if (flagged_step_ >= 0 && step != flagged_step_) {  // the hung step finished
    AlertEvent done;
    done.resolved = true;
    done.type = "hang";
    done.step = flagged_step_;
    done.first_step = flagged_step_;
    done.message = fmt::format("step {} finished", flagged_step_);
    flagged_step_ = -1;
    return done;
  }
  if (step < 0 || step == flagged_step_) return std::nullopt;
  const double elapsed_s = static_cast<double>(now_ns - start_ns) / 1e9;
  const double limit_s =
      history_ok ? std::max(config_.hang_threshold * median_ms / 1e3, config_.hang_min_s)
                 : config_.hang_floor_s;
  if (elapsed_s <= limit_s) return std::nullopt;
  flagged_step_ = step;
  AlertEvent a;
  a.type = "hang";
  a.step = step;
  a.value = elapsed_s * 1e3;
  if (history_ok) a.baseline = median_ms;
  a.threshold = config_.hang_threshold;
  a.phase = phase;
  a.message = fmt::format(
      "step {} has been running for {:.1f} s{} (limit {:.1f} s{}) and may be hung: see "
      "details.stacks for where each thread is",
      step, elapsed_s, phase.empty() ? "" : fmt::format(" in phase {}", phase), limit_s,
      history_ok ? fmt::format(", {}x the median iteration of {:.2f} ms", config_.hang_threshold,
                               median_ms)
                 : " before enough history");
  a.details = {{"elapsed_s", elapsed_s}, {"limit_s", limit_s}};
  return a;
}

template <typename Explain>
void DeviceDiagnosisDetector::update(Episode& e, const char* type, bool condition,
                                     const StepRecord& r, double value, double threshold,
                                     Explain explain, std::vector<AlertEvent>& out) {
  if (condition) {
    e.misses = 0;
    if (e.hits++ == 0) e.hits_from = r.step;
    if (!e.active && e.hits >= config_.regression_min_steps) {
      Diagnosis d = explain();
      AlertEvent a;
      a.value = value;
      a.threshold = threshold;
      a.message = std::move(d.message);
      a.details = std::move(d.details);
      a.type = type;
      a.step = r.step;
      a.details["since_step"] = e.hits_from;
      out.push_back(std::move(a));
      e.active = true;
      e.start = e.hits_from;
    }
    return;
  }
  e.hits = 0;
  if (e.active && ++e.misses >= config_.regression_min_steps) {
    AlertEvent done;
    done.resolved = true;
    done.type = type;
    done.step = r.step;
    done.first_step = e.start;
    done.message = fmt::format("{} ended at step {} (from step {})", type, r.step, e.start);
    out.push_back(std::move(done));
    e = Episode{};
  }
}

void DeviceDiagnosisDetector::observe(const StepRecord& r, std::vector<AlertEvent>& out) {
  if (r.failed || r.step < config_.warmup_steps) return;
  const KernelStats& k = r.kernels;
  const double tensor = r.counters.present ? r.counters.values[0] : NAN;
  const double dram = r.counters.present ? r.counters.values[1] : NAN;
  const double occupancy = r.counters.present ? r.counters.values[2] : NAN;

  if (std::isfinite(tensor) && k.present && k.compute_ns > 0) {
    const double matmul_pct =
        100.0 * static_cast<double>(k.matmul_ns) / static_cast<double>(k.compute_ns);
    const bool dominated = matmul_pct >= config_.matmul_dominated_pct;
    update(
        tensor_, "low_tensor_core", dominated && tensor < config_.tensor_core_min_pct, r, tensor,
        config_.tensor_core_min_pct,
        [&]() -> Diagnosis {
          return {
              fmt::format(
                  "tensor cores active {:.0f}% of the time on step {} while matmul kernels take "
                  "{:.0f}% of the compute time (expected at least {:.0f}%): run matmuls in "
                  "bf16/fp16 (torch.autocast) or TF32 "
                  "(torch.set_float32_matmul_precision(\"high\")), and keep matmul dimensions "
                  "multiples of 8",
                  tensor, r.step, matmul_pct, config_.tensor_core_min_pct),
              {{"matmul_share_pct", matmul_pct}}};
        },
        out);
  }
  if (std::isfinite(dram) && std::isfinite(occupancy)) {
    update(
        memory_, "memory_bound",
        occupancy < config_.occupancy_min_pct && dram > config_.dram_bound_pct, r, dram,
        config_.dram_bound_pct,
        [&]() -> Diagnosis {
          return {fmt::format(
                      "step {} is memory-bound: DRAM throughput {:.0f}% of peak with SM occupancy "
                      "{:.0f}% (below {:.0f}%): fuse elementwise kernels (torch.compile), keep "
                      "activations in bf16, or raise the batch size",
                      r.step, dram, occupancy, config_.occupancy_min_pct),
                  {{"sm_occupancy_pct", occupancy}}};
        },
        out);
  }
  // The step on the kernels' clock: its device window, else the record's step time.
  const std::int64_t window_ns = k.window_end_ns - k.window_start_ns;
  const std::int64_t step_ns = window_ns > 0 ? window_ns : r.step_ns;
  if (k.present && step_ns > 0) {
    const double nccl_pct = 100.0 * static_cast<double>(k.nccl_ns) / static_cast<double>(step_ns);
    update(
        comm_, "comm_bound", nccl_pct > config_.comm_bound_pct, r, nccl_pct, config_.comm_bound_pct,
        [&]() -> Diagnosis {
          return {fmt::format(
                      "NCCL kernels take {:.0f}% of step {} ({:.2f} ms of {:.2f} ms, {:.2f} ms not "
                      "overlapped by compute; above {:.0f}%): accumulate gradients over more "
                      "micro-batches per all-reduce, overlap communication with compute, or use a "
                      "faster interconnect",
                      nccl_pct, r.step, static_cast<double>(k.nccl_ns) / kNsPerMs,
                      static_cast<double>(step_ns) / kNsPerMs,
                      static_cast<double>(k.exposed_nccl_ns) / kNsPerMs, config_.comm_bound_pct),
                  {{"nccl_ms", static_cast<double>(k.nccl_ns) / kNsPerMs},
                   {"exposed_nccl_ms", static_cast<double>(k.exposed_nccl_ns) / kNsPerMs}}};
        },
        out);
  }
}

}  // namespace steptrace::detail
