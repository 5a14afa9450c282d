// The lifecycle the CUPTI counter samplers share (counter_session.hpp).
#include "counter_session.hpp"

#if STEPTRACE_HAVE_CUPTI_HEADERS

#include <utility>

#include <fmt/format.h>

#include "cupti_errors.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace::detail::cupti {

CounterSession::CounterSession(const ProfilerApi& profiler, const HostApi& host_api, Device device,
                               ProfilerMode mode, const char* what)
    : QueuedCounterSampler(kMaxPending),
      profiler_(profiler),
      host_api_(host_api),
      device_(std::move(device)),
      mode_(mode),
      what_(what) {}

bool CounterSession::setup(std::string* why) {
  if (!open(why)) {
    teardown();
    *why += "; " + device_.describe();
    return false;
  }
  decoder_.start(kDecodePeriod, [this] { decode_pass(); });
  return true;
}

bool CounterSession::open(std::string* why) {
  const ChipFamily* family = nullptr;
  CUptiResult result = CUPTI_SUCCESS;
  if (!initialize_profiler(profiler_, host_api_, device_.index, &profiler_initialized_, &chip_,
                           &family, &result, why)) {
    setup_result_ = result;
    return false;
  }
  if (!before_host(*family, why)) return false;
  const std::uint8_t* availability = availability_.empty() ? nullptr : availability_.data();
  host_ = std::make_unique<HostObject>(host_api_, chip_, mode_, availability);
  if (host_->status() != CUPTI_SUCCESS) {
    *why = setup_reason("cuptiProfilerHostInitialize", host_->status());
    return false;
  }
  if (!one_pass_config(host_api_, *host_, chip_, *family, mode_, availability, &map_, &config_,
                       why)) {
    return false;
  }
  for (const auto& m : map_.metrics) metric_names_.push_back(m.c_str());
  evaluated_.assign(map_.metrics.size(), 0.0);
  return open_session(*family, why);
}

std::string CounterSession::setup_reason(const char* call, CUptiResult r) {
  setup_result_ = r;
  return call_reason(host_api_, call, r);
}

std::int64_t CounterSession::now_ns() noexcept {
  // cuptiGetTimestamp: ns, the clock of CUPTI's activity records. Whether PM samples'
  // start/end timestamps are on the same clock is not documented (the API reference
  // says only "start/end time of the sample"): unverified without a GPU.
  std::uint64_t ts = 0;
  profiler_.get_timestamp(&ts);
  return static_cast<std::int64_t>(ts);
}

void CounterSession::finish() noexcept {
  std::lock_guard<std::mutex> lock(finish_mutex_);
  if (finished_.exchange(true)) return;
  stop_mode();
  decoder_.stop();
  final_pass();
  teardown();
}

std::string CounterSession::status() const {
  if (call_failure_.failed()) {
    const auto result = static_cast<CUptiResult>(call_failure_.result());
    const std::string text = host_api_.result_text(result);
    if (call_failure_.torn_down()) {
      return torn_down_reason(what_, call_failure_.call(), result, text) +
             fmt::format(" (noticed at step {}); ", call_failure_.after_step()) +
             device_.describe();
    }
    return unavailable_reason(call_failure_.call(), result, text) + "; " + device_.describe();
  }
  if (!finished_.load()) return {};
  return "finished (close); " + device_.describe() + ", " + chip_ + finished_detail();
}

void CounterSession::fail(const char* call, CUptiResult r) noexcept {
  if (!call_failure_.record(call, r)) return;
  if (profiler_torn_down(profiler_, device_.index, r)) {
    call_failure_.set_torn_down(last_step_.load(std::memory_order_relaxed));
  }
}

void CounterSession::add_sample(std::size_t index, bool known, CounterSample sample,
                                std::vector<CounterSample>* batch, std::int64_t* lost) {
  if (!known || !evaluate_range(host_api_, host_->get(), counter_data_, index, metric_names_,
                                evaluated_.data())) {
    ++*lost;
    return;
  }
  map_.to_values(evaluated_.data(), sample.values);
  batch->push_back(sample);
}

void CounterSession::teardown() noexcept {
  const bool torn_down = call_failure_.torn_down();
  // Torn down: cuptiFinalize destroyed the mode's object, the host object and the
  // profiler's initialization; calling into them would touch freed state.
  close_object(torn_down);
  if (torn_down) {
    if (host_) host_->abandon();
    host_.reset();
    profiler_initialized_ = false;
    return;
  }
  host_.reset();
  if (profiler_initialized_) {
    deinitialize_profiler(profiler_);
    profiler_initialized_ = false;
  }
}

}  // namespace steptrace::detail::cupti

#endif  // STEPTRACE_HAVE_CUPTI_HEADERS
