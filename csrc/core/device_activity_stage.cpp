#include "device_activity_stage.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "sample_aggregation.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace::detail {
namespace {

constexpr double kNsPerMs = 1e6;
// A step this long on CUDA events ran work on the device (back-to-back events are a few
// microseconds apart).
constexpr std::int64_t kDeviceWorkNs = 100'000;

const char* work_name(KernelWork w) {
  switch (w) {
    case KernelWork::kCompute:
      return "compute";
    case KernelWork::kMatmul:
      return "matmul";
    case KernelWork::kCommunication:
      return "nccl";
  }
  return "compute";
}

// Total length of the union of the intervals of `kernels` (sorted by start) that `keep`.
template <typename Keep>
std::int64_t union_ns(const std::vector<KernelRecord>& kernels, Keep keep) {
  std::int64_t total = 0;
  std::int64_t cur_start = 0;
  std::int64_t cur_end = std::numeric_limits<std::int64_t>::min();
  for (const KernelRecord& k : kernels) {
    if (!keep(k) || k.end_ns <= k.start_ns) continue;
    if (k.start_ns > cur_end) {
      if (cur_end > cur_start) total += cur_end - cur_start;
      cur_start = k.start_ns;
      cur_end = k.end_ns;
    } else {
      cur_end = std::max(cur_end, k.end_ns);
    }
  }
  if (cur_end > cur_start) total += cur_end - cur_start;
  return total;
}

}  // namespace

KernelStats kernel_stats(std::vector<KernelRecord>& kernels, std::int64_t not_before_ns) {
  KernelStats s;
  s.present = true;
  s.count = static_cast<std::int64_t>(kernels.size());
  if (kernels.empty()) return s;
  std::sort(kernels.begin(), kernels.end(),
            [](const KernelRecord& a, const KernelRecord& b) { return a.start_ns < b.start_ns; });
  auto is_comm = [](const KernelRecord& k) { return k.work == KernelWork::kCommunication; };
  s.busy_ns = union_ns(kernels, [](const KernelRecord&) { return true; });
  s.compute_ns = union_ns(kernels, [&](const KernelRecord& k) { return !is_comm(k); });
  s.nccl_ns = union_ns(kernels, is_comm);
  s.matmul_ns =
      union_ns(kernels, [](const KernelRecord& k) { return k.work == KernelWork::kMatmul; });
  s.exposed_nccl_ns = s.busy_ns - s.compute_ns;  // busy time with no compute running
  std::int64_t last_end = kernels.front().end_ns;
  for (const KernelRecord& k : kernels) last_end = std::max(last_end, k.end_ns);
  s.window_start_ns = std::min(kernels.front().start_ns, not_before_ns);
  s.window_end_ns = last_end;
  s.idle_ns = std::max<std::int64_t>(0, (s.window_end_ns - s.window_start_ns) - s.busy_ns);
  return s;
}

DeviceActivityStage::DeviceActivityStage(const Config& config, KernelActivitySource* activity,
                                         CounterSampler* sampler)
    : config_(config), activity_(activity), sampler_(sampler) {}

void DeviceActivityStage::note_arrival(StepRecord& r) {
  r.activity_deliveries_at_arrival = activity_ != nullptr ? activity_->deliveries() : 0;
  r.activity_mark_at_arrival = activity_ != nullptr ? activity_->delivery_mark() : 0;
  r.sampler_deliveries_at_arrival = sampler_ != nullptr ? sampler_->deliveries() : 0;
}

bool DeviceActivityStage::complete(StepRecord& r, bool force) {
  const bool wants_kernels = activity_ != nullptr && r.activity_begin_ns >= 0;
  const bool wants_counters = sampler_ != nullptr && r.counters_sampled;
  // The record's device work had finished when it reached the writer; a delivery that
  // started after that brings its data, and the second one after arrival surely did,
  // once every activity buffer that was out then has come back (CUPTI returns the one
  // being filled only when it is full: a flush tick alone proves nothing).
  const bool kernels_in = !wants_kernels || finished_ ||
                          (activity_->deliveries() >= r.activity_deliveries_at_arrival + 2 &&
                           activity_->delivered(r.activity_mark_at_arrival));
  const bool counters_in =
      !wants_counters || sampler_->deliveries() >= r.sampler_deliveries_at_arrival + 2;
  if (!hold_over(r, kernels_in && counters_in, force)) return false;

  if (activity_ != nullptr) take_kernels();
  if (wants_kernels) {
    auto it = by_step_.find(r.step);
    std::vector<KernelRecord> none;
    std::vector<KernelRecord>& kernels = it != by_step_.end() ? it->second : none;
    if (kernels.empty() && !kernels_known(r, kernels_in)) {
      r.kernels = KernelStats{};  // absent: unknown, not a step that ran no kernel
    } else {
      const std::int64_t not_before = std::max(r.activity_begin_ns, prev_device_end_ns_);
      r.kernels = kernel_stats(kernels, not_before);
      if (r.kernels.count > 0) {
        prev_device_end_ns_ = std::max(prev_device_end_ns_, r.kernels.window_end_ns);
      }
    }
  }
  by_step_.erase(by_step_.begin(), by_step_.upper_bound(r.step));

  if (sampler_ != nullptr) take_samples();
  if (wants_counters) fill_counters(r);
  written_through_ = std::max(written_through_, r.step);
  return true;
}

bool DeviceActivityStage::kernels_known(const StepRecord& r, bool kernels_in) {
  const ActivityReach reach = activity_->reach(r.activity_begin_ns);
  NotCollected why = NotCollected::kCount;
  if (reach == ActivityReach::kStopped) {
    why = NotCollected::kStopped;
  } else if (!kernels_in) {
    why = NotCollected::kNotBack;  // written on the hold bound, or by flush()
  } else if (reach == ActivityReach::kUnheard && r.device_clock && r.step_ns >= kDeviceWorkNs) {
    // the device worked, yet no record of it reached the backend's callbacks
    why = NotCollected::kElsewhere;
  }
  if (why == NotCollected::kCount) return true;
  ++not_collected_[static_cast<std::size_t>(why)];
  return false;
}

void DeviceActivityStage::take_kernels() {
  incoming_.clear();
  activity_->take(incoming_, &dropped_records_);
  for (const KernelRecord& k : incoming_) {
    ++kernel_records_;
    KernelTotal& t = totals_[k.name_id];
    t.ns += std::max<std::int64_t>(0, k.end_ns - k.start_ns);
    ++t.count;
    t.work = k.work;
    if (k.step < 0) {
      ++outside_records_;
    } else if (k.step <= written_through_) {
      ++late_records_;
    } else {
      by_step_[k.step].push_back(k);
    }
  }
}

void DeviceActivityStage::take_samples() {
  incoming_samples_.clear();
  bool overflow = false;
  sampler_->take(incoming_samples_, &dropped_samples_, &overflow);
  overflow_ = overflow_ || overflow;
  sample_count_ += static_cast<std::int64_t>(incoming_samples_.size());
  for (const CounterSample& c : incoming_samples_) samples_.push_back({c, false});
  while (samples_.size() > kMaxPendingSamples) drop_front_sample();
}

void DeviceActivityStage::drop_front_sample() {
  if (!samples_.front().used) ++unaligned_samples_;
  samples_.pop_front();
}

void DeviceActivityStage::fill_counters(StepRecord& r) {
  ++sampled_steps_;
  // The step's device window when its kernels tell it, else its host span (both on the
  // CUPTI timestamp clock with the real backends).
  StepWindow w{r.step, r.sampler_begin_ns, r.sampler_end_ns};
  if (r.kernels.present && r.kernels.count > 0) {
    w.start_ns = r.kernels.window_start_ns;
    w.end_ns = r.kernels.window_end_ns;
  }
  std::vector<PmSample> overlapping;
  for (PendingSample& pending : samples_) {
    const CounterSample& s = pending.sample;
    // a zero-length sample counts as 1 ns at its timestamp, as aggregate_samples has it
    const std::int64_t end_ns = std::max(s.end_ns, s.start_ns + 1);
    const bool match =
        s.step >= 0 ? s.step == r.step : end_ns > w.start_ns && s.start_ns < w.end_ns;
    if (!match) continue;
    pending.used = true;
    PmSample p;
    // A sample measured over exactly this step stands for the whole window.
    p.start_ns = s.step >= 0 ? w.start_ns : s.start_ns;
    p.end_ns = s.step >= 0 ? w.end_ns : s.end_ns;
    p.values.assign(std::begin(s.values), std::end(s.values));
    overlapping.push_back(std::move(p));
  }
  // Samples wholly before this window can serve no later step.
  while (!samples_.empty()) {
    const CounterSample& front = samples_.front().sample;
    if (front.step >= 0 ? front.step > r.step : front.end_ns > w.start_ns) break;
    drop_front_sample();
  }
  if (overlapping.empty()) return;
  const AggregationResult agg = aggregate_samples(overlapping, {w}, kCounterCount);
  const StepCounters& c = agg.steps.front();
  r.counters.present = false;
  for (std::size_t i = 0; i < kCounterCount; ++i) {
    r.counters.values[i] = c.values[i];
    r.counters.present = r.counters.present || std::isfinite(c.values[i]);
  }
  r.counters.coverage_pct = c.coverage_pct;
  if (r.counters.present) ++steps_with_counters_;
}

void DeviceActivityStage::finish() noexcept {
  if (activity_ != nullptr) activity_->finish();
  if (sampler_ != nullptr) sampler_->finish();
  finished_ = true;  // everything the backends held has been delivered
}

std::int64_t DeviceActivityStage::unused_pending() const {
  std::int64_t n = 0;
  for (const PendingSample& p : samples_) n += p.used ? 0 : 1;
  return n;
}

std::string DeviceActivityStage::not_collected_reason(std::int64_t total) const {
  const auto n = [this](NotCollected w) { return not_collected_[static_cast<std::size_t>(w)]; };
  std::string out =
      fmt::format("{} step records written without kernels, their kernels unknown:", total);
  const char* sep = " ";
  if (n(NotCollected::kNotBack) > 0) {
    out += fmt::format(
        "{}{} written before their activity buffers came back ({} ms bound, or "
        "flush; any that came later count as late_records)",
        sep, n(NotCollected::kNotBack), kMaxHold.count());
    sep = "; ";
  }
  if (n(NotCollected::kElsewhere) > 0) {
    out += fmt::format(
        "{}{} that ran device work while no activity buffer reached steptrace's "
        "CUPTI callbacks: another tool (torch.profiler/Kineto on demand through "
        "dynolog, proton) had taken them",
        sep, n(NotCollected::kElsewhere));
    sep = "; ";
  }
  if (n(NotCollected::kStopped) > 0) {
    out += fmt::format(
        "{}{} after kernel activity had stopped, or while kernels could not be attributed to "
        "steps (see status)",
        sep, n(NotCollected::kStopped));
  }
  return out;
}

std::string DeviceActivityStage::run_end_fields() {
  using nlohmann::ordered_json;
  ordered_json out = ordered_json::object();
  if (activity_ != nullptr) {
    take_kernels();
    std::vector<std::pair<std::uint32_t, KernelTotal>> top(totals_.begin(), totals_.end());
    std::sort(top.begin(), top.end(),
              [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
    std::int64_t all_ns = 0;
    for (const auto& [id, t] : top) all_ns += t.ns;
    if (top.size() > static_cast<std::size_t>(config_.top_kernels)) {
      top.resize(static_cast<std::size_t>(config_.top_kernels));
    }
    ordered_json list = ordered_json::array();
    for (const auto& [id, t] : top) {
      list.push_back(
          {{"name", activity_->kernel_name(id)},
           {"work", work_name(t.work)},
           {"total_ms", static_cast<double>(t.ns) / kNsPerMs},
           {"count", t.count},
           {"share_pct",
            all_ns > 0 ? 100.0 * static_cast<double>(t.ns) / static_cast<double>(all_ns) : 0.0}});
    }
    out["kernels"] = {
        {"records", kernel_records_},         {"dropped_records", dropped_records_},
        {"late_records", late_records_},      {"outside_step_records", outside_records_},
        {"distinct_kernels", totals_.size()}, {"top", list}};
    std::int64_t not_collected = 0;
    for (const std::int64_t n : not_collected_) not_collected += n;
    if (not_collected > 0) {
      out["kernels"]["not_collected_steps"] = not_collected;
      out["kernels"]["not_collected"] = not_collected_reason(not_collected);
    }
    if (std::string status = activity_->status(); !status.empty()) {
      out["kernels"]["status"] = std::move(status);
    }
  }
  if (sampler_ != nullptr) {
    out["counters"] = {{"samples", sample_count_},
                       {"dropped_samples", dropped_samples_},
                       // between sampled steps (sampling runs on a little), or on a clock
                       // the steps do not share: a check for new devices and drivers
                       {"unaligned_samples", unaligned_samples_ + unused_pending()},
                       {"overflow", overflow_},
                       {"sampled_steps", sampled_steps_},
                       {"steps_with_counters", steps_with_counters_}};
    // why sampling stopped (a CUPTI torn down under it), or how it ended and on which device
    if (std::string status = sampler_->status(); !status.empty()) {
      out["counters"]["status"] = std::move(status);
    }
  }
  return "\"device_activity\":" + out.dump();
}

}  // namespace steptrace::detail
