// What the two CUPTI counter samplers share: one counter session on one device, from the
// profiler's initialization and the host object with its one-pass metric set, through the
// decode thread and the evaluation of decoded samples, to the first failure, the status
// line and the teardown. The modes (cupti_pm_sampler.cpp, cupti_range_profiler.cpp) add
// their CUPTI object: how it is set up, started and stopped, decoded and released. Only
// for files built with the CUPTI headers (STEPTRACE_HAVE_CUPTI_HEADERS).
#pragma once

#if STEPTRACE_HAVE_CUPTI_HEADERS

#include <cupti_result.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cupti_host.hpp"
#include "metric_sets.hpp"
#include "pm_sampling_logic.hpp"
#include "profiler_host.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace::detail::cupti {

class CounterSession : public QueuedCounterSampler {
 public:
  /// Decoded samples waiting for take(); beyond this they are dropped and counted.
  static constexpr std::size_t kMaxPending = std::size_t{1} << 16;
  static constexpr auto kDecodePeriod = std::chrono::milliseconds(25);

  CounterSession(const ProfilerApi& profiler, const HostApi& host_api, Device device,
                 ProfilerMode mode, const char* what);
  CounterSession(const CounterSession&) = delete;
  CounterSession& operator=(const CounterSession&) = delete;
  // A mode's destructor calls finish(): the decode thread is joined and the session torn
  // down before the mode's members go.
  ~CounterSession() override = default;

  /// The profiler, the host object, the metric set and its config image, then the mode's
  /// session (open_session) and a running decode thread; false with `why` (one line)
  /// after undoing what was set up.
  bool setup(std::string* why);

  /// cuptiGetTimestamp: ns, the clock of CUPTI's activity records.
  std::int64_t now_ns() noexcept override;
  /// Once, from any thread: stops the mode (stop_mode), joins the decode thread, runs the
  /// last delivery (final_pass) and tears the session down.
  void finish() noexcept override;
  std::string status() const override;
  std::string device() const override { return device_.describe(); }

 protected:
  // The mode's hooks, in the order setup and finish call them.
  /// Before the host object: checks the chip, fills availability_ (optional); false with
  /// `why` (through setup_reason when a CUPTI call failed).
  virtual bool before_host(const ChipFamily& /*family*/, std::string* /*why*/) { return true; }
  /// After the metric set: the mode's own CUPTI object, as far as it needs no context.
  virtual bool open_session(const ChipFamily& /*family*/, std::string* /*why*/) { return true; }
  /// Decode thread: one delivery.
  virtual void decode_pass() noexcept = 0;
  /// finish(), before the decode thread is joined: no new start from the training thread.
  virtual void stop_mode() noexcept = 0;
  /// finish(), decode thread joined: what the device recorded up to the stop.
  virtual void final_pass() noexcept = 0;
  /// teardown(): releases the mode's object; `torn_down`: cuptiFinalize destroyed it, so
  /// it is only forgotten, never called.
  virtual void close_object(bool torn_down) noexcept = 0;
  /// status() after finish: more to say after "finished (close); <device>, <chip>".
  virtual std::string finished_detail() const { return {}; }

  /// A setup call's reason; its result is kept for setup_result().
  std::string setup_reason(const char* call, CUptiResult r);
  /// The result of the setup call that failed (CUPTI_SUCCESS: none, or no CUPTI call).
  CUptiResult setup_result() const { return setup_result_; }

  /// A CUPTI call on the session failed after setup: remember the first, and whether
  /// CUPTI was torn down under us (then no call may touch the session again, its release
  /// included).
  void fail(const char* call, CUptiResult r) noexcept;

  /// Evaluates sample (or range) `index` of counter_data_ into `sample`'s values and adds
  /// it to `batch`; counts it in `lost` instead when it is not `known` or CUPTI refuses.
  /// Decode thread (or finish).
  void add_sample(std::size_t index, bool known, CounterSample sample,
                  std::vector<CounterSample>* batch, std::int64_t* lost);

  ProfilerApi profiler_;
  HostApi host_api_;  // before host_: HostObject refers to it
  Device device_;
  std::string chip_;
  std::vector<std::uint8_t> availability_;  // outlives host_, which was initialized with it
  std::unique_ptr<HostObject> host_;
  std::vector<std::uint8_t> config_;
  std::vector<const char*> metric_names_;  // into map_.metrics

  // Whoever owns the mode's object: the image decoded into, its evaluated metrics.
  std::vector<std::uint8_t> counter_data_;
  std::vector<double> evaluated_;

  FirstFailure call_failure_;                // the first CUPTI call that failed after setup
  std::atomic<std::int64_t> last_step_{-1};  // for the report of a teardown
  std::atomic<bool> finished_{false};
  PeriodicThread decoder_;  // joined by finish(), before the mode's members go

 private:
  bool open(std::string* why);
  /// Undoes setup in reverse order; safe after a partial setup. Decode thread joined.
  void teardown() noexcept;

  const ProfilerMode mode_;
  const char* what_;  // "PM sampling", "the range profiler": for status()
  bool profiler_initialized_ = false;
  CUptiResult setup_result_ = CUPTI_SUCCESS;
  std::mutex finish_mutex_;
};

/// A mode's entry points from `lib`: the profiler's (api->profiler), the mode's own
/// (api->resolve_mode(SymbolResolver&)) and the host API; false with `why` (one line),
/// and *mode_missing when one of the mode's own is missing (a CUPTI too old for `feature`).
template <class ModeApi>
bool load_session_api(const Library& lib, const char* feature, ModeApi* api, HostApi* host_api,
                      std::string* why, bool* mode_missing) {
  *mode_missing = false;
  std::string missing;
  if (!api->profiler.load(lib.handle, &missing)) {
    *why = fmt::format("CUPTI at {} has no {}", lib.path, missing);
    return false;
  }
  SymbolResolver resolve(lib.handle, &missing);
  api->resolve_mode(resolve);
  if (!resolve.ok()) {
    *mode_missing = true;
    *why = missing_symbol_reason(lib, feature, missing);
    return false;
  }
  if (!host_api->load(lib.handle, &missing)) {
    *why = missing_symbol_reason(lib, "the profiler host API", missing);
    return false;
  }
  return true;
}

}  // namespace steptrace::detail::cupti

#endif  // STEPTRACE_HAVE_CUPTI_HEADERS
