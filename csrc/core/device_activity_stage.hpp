// Kernel activity and hardware counters joined to the step records, on the writer
// thread. The records of both arrive in batches, a delivery or two after the device ran
// the work, so a step record waits here (in step order) until the deliveries that must
// hold its data have happened, or at most kMaxHold, then gets its `kernels` and
// `counters` and goes on to the detectors and the file.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "step_completer.hpp"
#include "step_record.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace::detail {

/// Per-step kernel figures from the step's kernels (any order). The step's device
/// window starts at `not_before_ns` (the later of the step's host start and the end of
/// the previous step's device work: the device cannot run the step earlier) or at its
/// first kernel when that is earlier, and ends with its last kernel; idle is the part of
/// the window no kernel covers. Unions, not sums: concurrent kernels count once.
KernelStats kernel_stats(std::vector<KernelRecord>& kernels, std::int64_t not_before_ns);

/// Completes step records with what the activity backend and the counter sampler
/// delivered. Writer thread only (the backends are driven by the training thread).
class DeviceActivityStage final : public HoldingCompleter {
 public:
  /// Either backend may be null. They outlive the stage.
  DeviceActivityStage(const Config& config, KernelActivitySource* activity,
                      CounterSampler* sampler);

  /// Fills r.kernels / r.counters; false while their data may still come (the record
  /// waits). `force`: fill with what is known now (close, flush, a full queue).
  bool complete(StepRecord& r, bool force) override;
  /// Close: the device has synchronized; the backends deliver what is left and stop.
  void finish() noexcept override;
  /// run_end's "device_activity": top kernels, record and sample counts, losses.
  std::string run_end_fields() override;

 private:
  /// The deliveries so far (every record, on arrival).
  void note_arrival(StepRecord& r) override;
  /// r's device work is unknown when no kernel of it arrived: false (and counted) when it
  /// may have run kernels that never reached us, so that r goes out without `kernels`
  /// rather than with zeros.
  bool kernels_known(const StepRecord& r, bool kernels_in);
  std::string not_collected_reason(std::int64_t total) const;
  void take_kernels();
  void take_samples();
  void fill_counters(StepRecord& r);
  void drop_front_sample();
  std::int64_t unused_pending() const;

  const Config& config_;
  KernelActivitySource* activity_;
  CounterSampler* sampler_;

  std::vector<KernelRecord> incoming_;
  std::map<std::int64_t, std::vector<KernelRecord>> by_step_;  // steps not written yet
  std::int64_t written_through_ = -1;                          // last step record completed
  std::int64_t prev_device_end_ns_ = INT64_MIN;
  struct KernelTotal {
    std::int64_t ns = 0;
    std::int64_t count = 0;
    KernelWork work = KernelWork::kCompute;
  };
  std::map<std::uint32_t, KernelTotal> totals_;  // by kernel name id, for the top list
  std::int64_t kernel_records_ = 0;
  std::int64_t dropped_records_ = 0;
  std::int64_t late_records_ = 0;     // arrived after their step record was written
  std::int64_t outside_records_ = 0;  // launched outside any step
  enum class NotCollected : std::size_t {
    kNotBack,    // written before the buffers that may hold its kernels came back
    kElsewhere,  // device work, no call of the backend's callbacks: another tool had them
    kStopped,    // kernel activity had stopped (a foreign cuptiFinalize, a failed resume), or
                 // its kernels cannot be placed in steps (no launch record ever came)
    kCount,
  };
  std::int64_t not_collected_[static_cast<std::size_t>(NotCollected::kCount)] = {};
  bool finished_ = false;  // finish() ran: nothing more can come

  std::vector<CounterSample> incoming_samples_;
  struct PendingSample {
    CounterSample sample;
    bool used = false;  // fell in a sampled step's window
  };
  std::deque<PendingSample> samples_;  // decoded, not yet past the steps written
  // Bound on samples_: samples that never fit a step (a sampler clock that does not
  // match the steps') must not pile up.
  static constexpr std::size_t kMaxPendingSamples = std::size_t{1} << 16;
  std::int64_t unaligned_samples_ = 0;  // left without ever falling in a sampled step
  std::int64_t sample_count_ = 0;
  std::int64_t dropped_samples_ = 0;
  bool overflow_ = false;
  std::int64_t sampled_steps_ = 0;
  std::int64_t steps_with_counters_ = 0;
};

}  // namespace steptrace::detail
