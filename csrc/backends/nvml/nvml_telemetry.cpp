// NVML telemetry: libnvidia-ml.so.1 loaded at run time (nvml_api.*), the rank's device
// found (nvml_device.*), read on a sampler thread of its own (here).
#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "steptrace/backend.hpp"
#include "steptrace/ext/background_thread.hpp"
#include "steptrace/ext/telemetry.hpp"

#include "../host/monotonic_clock.hpp"
#include "nvml_api.hpp"
#include "nvml_device.hpp"
#include "nvml_testing.hpp"

namespace steptrace {
namespace detail::nvml {
namespace {

// Slow readings (PCIe throughput, which samples for 20 ms per counter; NVLink counters, one
// call per link; ECC, row remapping, memory clock and temperature) are taken at most this
// often; the fast ones (power, energy, temperature, SM clock, utilization, throttle
// reasons, device memory) at every tick. Each slow figure holds until its next reading.
constexpr std::int64_t kSlowPeriodNs = 1'000'000'000;
// NVML_NVLINK_MAX_LINKS: 18 in CUDA 12's nvml.h, 36 in CUDA 13's; links past a device's
// last answer INVALID_ARGUMENT, so probing the larger bound is safe with either driver.
constexpr unsigned kNvLinkMaxLinks = 36;
constexpr unsigned kNvLinkErrorReplay = 0;   // NVML_NVLINK_ERROR_DL_REPLAY
constexpr unsigned kNvLinkErrorCrcFlit = 2;  // NVML_NVLINK_ERROR_DL_CRC_FLIT
constexpr unsigned kFeatureEnabled = 1;      // NVML_FEATURE_ENABLED
// NVLink CRC errors "keep growing" when the sum rises in this many consecutive readings
// at least kNvLinkGrowthGapNs apart (closer readings are skipped): one corrupted flit
// is noise, a link that keeps corrupting is failing.
constexpr int kNvLinkGrowthReadings = 3;
constexpr std::int64_t kNvLinkGrowthGapNs = 1'000'000'000;

class NvmlTelemetry final : public TelemetrySource {
 public:
  NvmlTelemetry(const Api& api, Device dev, std::string device, int interval_ms, Clock* clock,
                bool mig, bool instant_power)
      : api_(api),
        dev_(dev),
        device_(std::move(device)),
        interval_ms_(interval_ms),
        clock_(clock),
        mig_(mig),
        instant_power_(instant_power) {
    // device-wide memory, unless the handle is a MIG slice's board (whose memory is every
    // slice's: the step's own is torch's mem_get_info then)
    Memory m{};
    reads_memory_ = !mig_ && api_.memory_info != nullptr && api_.memory_info(dev_, &m) == kSuccess;
    unsigned mw = 0;
    if (api_.power_limit != nullptr && api_.power_limit(dev_, &mw) == kSuccess) {
      power_limit_w_ = mw / 1000.0;
    }
    if (api_.event_set_create != nullptr && api_.register_events != nullptr &&
        api_.event_wait != nullptr && api_.event_set_create(&events_) == kSuccess &&
        api_.register_events(dev_, kEventXidCritical, events_) != kSuccess) {
      events_ = nullptr;  // not supported (a vGPU, a MIG slice): no XID events then
    }
    // the active links, once: NOT_SUPPORTED without NVLink, INVALID_ARGUMENT past the last
    if (api_.nvlink_state != nullptr && api_.nvlink_error != nullptr) {
      for (unsigned link = 0; link < kNvLinkMaxLinks; ++link) {
        unsigned state = 0;
        if (api_.nvlink_state(dev_, link, &state) == kSuccess && state == kFeatureEnabled) {
          nvlinks_.push_back(link);
        }
      }
    }
    // one field-value request for both throughput counters, all links' scope
    if (!nvlinks_.empty()) {
      for (const unsigned field : {kFieldNvLinkTxKib, kFieldNvLinkRxKib}) {
        FieldValue f{};
        f.field_id = field;
        f.scope_id = kAllLinksScope;
        nvlink_fields_.push_back(f);
      }
    }
  }
  ~NvmlTelemetry() override { finish(); }

  const char* name() const noexcept override { return "nvml"; }
  std::int64_t now_ns() noexcept override {
    return clock_ != nullptr ? clock_->now_ns() : monotonic_now_ns();
  }
  double power_limit_w() const noexcept override { return power_limit_w_; }
  std::string device() const override { return device_; }
  void set_error_handler(std::function<void(const HardwareError&)> handler) override {
    on_error_ = std::move(handler);
  }
  void start() override {
    if (interval_ms_ <= 0 || thread_.joinable()) return;
    thread_ = start_background_thread([this] { loop(); });
  }
  void take(std::vector<TelemetrySample>& out) override {
    std::lock_guard<std::mutex> lock(mu_);
    out.insert(out.end(), pending_.begin(), pending_.end());
    pending_.clear();
  }
  void finish() noexcept override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
      // a closing reading: the last steps' periods end after them
      sample();
    }
  }
  std::string status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  std::vector<std::string> board_wide() const override {
    if (!mig_) return {};
    // a MIG slice shares its board's power supply, sensors, clocks and links
    return {"power_w",        "energy_j",       "temp_c",          "sm_clock_mhz",
            "mem_clock_mhz",  "max_mem_temp_c", "pcie_tx_mb_s",    "pcie_rx_mb_s",
            "nvlink_tx_mb_s", "nvlink_rx_mb_s", "throttle_reasons"};
  }
  bool device_memory(std::int64_t* used, std::int64_t* total) const noexcept override {
    if (!reads_memory_) return false;
    *used = mem_used_.load(std::memory_order_relaxed);
    *total = mem_total_.load(std::memory_order_relaxed);
    return true;
  }

  // One reading of every figure; the hardware-error checks too. Sampler thread (or the
  // test's, with interval_ms = 0).
  bool sample() {
    TelemetrySample s;
    constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
    unsigned v = 0;
    Return pr = kNotSupported;
    if (instant_power_) {
      pr = instant_power_w(api_, dev_, &s.power_w);
      // a field the driver stopped knowing: GetPowerUsage from now on; another failure:
      // GetPowerUsage for this reading
      if (pr == kNotSupported) instant_power_ = false;
    }
    if (pr != kSuccess) {
      pr = api_.power_usage(dev_, &v);
      if (pr != kSuccess) {
        std::lock_guard<std::mutex> lock(mu_);
        if (status_.empty()) status_ = "nvmlDeviceGetPowerUsage failed: " + api_.error(pr);
        return false;
      }
      s.power_w = v / 1000.0;
    }
    unsigned long long mj = 0;
    s.energy_j = api_.energy != nullptr && api_.energy(dev_, &mj) == kSuccess
                     ? static_cast<double>(mj) / 1000.0
                     : kNaN;
    // the reading's time: power and energy's, taken right after them (the other fast
    // figures follow within microseconds; the slow ones come after, held until read again)
    s.t_ns = now_ns();
    s.temp_c =
        api_.temperature != nullptr && api_.temperature(dev_, kTemperatureGpu, &v) == kSuccess
            ? v
            : kNaN;
    s.sm_clock_mhz =
        api_.clock_info != nullptr && api_.clock_info(dev_, kClockSm, &v) == kSuccess ? v : kNaN;
    Utilization u{};
    s.util_pct =
        api_.utilization != nullptr && api_.utilization(dev_, &u) == kSuccess ? u.gpu : kNaN;
    unsigned long long reasons = 0;
    if (api_.throttle != nullptr && api_.throttle(dev_, &reasons) == kSuccess) {
      s.throttle_reasons = reasons;
    }
    if (reads_memory_) {
      Memory m{};
      if (api_.memory_info(dev_, &m) == kSuccess) {
        mem_total_.store(static_cast<std::int64_t>(m.total), std::memory_order_relaxed);
        mem_used_.store(static_cast<std::int64_t>(m.total - m.free), std::memory_order_relaxed);
      }
    }
    if (slow_t_ns_ == INT64_MIN || s.t_ns - slow_t_ns_ >= kSlowPeriodNs) {
      TelemetrySample& slow = slow_;
      slow = TelemetrySample{};
      slow.t_ns = s.t_ns;
      read_nvlink_throughput(slow);  // first: its rate is over the time between readings
      read_optional(slow);
      slow_t_ns_ = s.t_ns;
      check_errors(slow, true);
    } else {
      check_errors(s, false);  // the XID events only
    }
    hold_slow(s);
    std::lock_guard<std::mutex> lock(mu_);
    // Bounded: a writer that stopped taking must not grow this without end.
    if (pending_.size() < kMaxPending) pending_.push_back(s);
    return true;
  }

 private:
  // The readings a device may lack (NaN / -1 then); each stops being asked for once NVML
  // says the device does not support it.
  void read_optional(TelemetrySample& s) {
    unsigned v = 0;
    auto pcie = [&](unsigned counter, double* out) {
      if (api_.pcie_throughput == nullptr || pcie_unsupported_) return;
      const Return r = api_.pcie_throughput(dev_, counter, &v);
      if (r == kSuccess) *out = v / 1000.0;  // KB/s
      pcie_unsupported_ = r == kNotSupported;
    };
    pcie(kPcieTxBytes, &s.pcie_tx_mb_s);
    pcie(kPcieRxBytes, &s.pcie_rx_mb_s);
    if (api_.clock_info != nullptr && api_.clock_info(dev_, kClockMem, &v) == kSuccess) {
      s.mem_clock_mhz = v;
    }
    if (api_.field_values != nullptr && !mem_temp_unsupported_) {
      FieldValue f{};
      f.field_id = kFieldMemoryTemp;
      const Return r = api_.field_values(dev_, 1, &f);
      if (r == kSuccess && f.nvml_return == kSuccess) s.mem_temp_c = field_number(f);
      mem_temp_unsupported_ = r == kNotSupported || f.nvml_return == kNotSupported;
    }
    if (!nvlinks_.empty()) {
      // summed over the links that answered; none answering leaves the count unknown (-1),
      // not a 0 that a later answer would read as a rise
      auto link_errors = [&](unsigned counter, std::int64_t* out) {
        for (const unsigned link : nvlinks_) {
          unsigned long long n = 0;
          if (api_.nvlink_error(dev_, link, counter, &n) != kSuccess) continue;
          *out = std::max<std::int64_t>(*out, 0) + static_cast<std::int64_t>(n);
        }
      };
      link_errors(kNvLinkErrorCrcFlit, &s.nvlink_crc_errors);
      link_errors(kNvLinkErrorReplay, &s.nvlink_replay_errors);
    }
    if (api_.remapped_rows != nullptr && !remap_unsupported_) {
      unsigned corrected = 0, uncorrected = 0, pending = 0, failure = 0;
      const Return r = api_.remapped_rows(dev_, &corrected, &uncorrected, &pending, &failure);
      if (r == kSuccess) {
        s.remap_corrected = corrected;
        s.remap_uncorrected = uncorrected;
        s.remap_pending = pending;
        s.remap_failure = failure;
      }
      remap_unsupported_ = r == kNotSupported;
    }
  }

  // NVLink data throughput: the growth of the links' KiB counters since the reading
  // before, over the time between them (NaN on the first reading and after a counter
  // went back, a driver reload). Stops being asked for once NVML says not supported.
  void read_nvlink_throughput(TelemetrySample& s) {
    if (nvlink_fields_.empty() || api_.field_values == nullptr || nvlink_rate_unsupported_) {
      return;
    }
    for (FieldValue& f : nvlink_fields_) f.nvml_return = -1;
    const Return r =
        api_.field_values(dev_, static_cast<int>(nvlink_fields_.size()), nvlink_fields_.data());
    double kib[2] = {0, 0};  // tx, rx
    double first[2] = {-1, -1};
    bool same[2] = {true, true};
    for (const FieldValue& f : nvlink_fields_) {
      if (r != kSuccess || f.nvml_return != kSuccess) {
        if (!per_link_ && r == kSuccess) {
          // a driver without the all-links scope: each link's own, from the next reading
          per_link_ = true;
          nvlink_fields_.clear();
          for (const unsigned link : nvlinks_) {
            for (const unsigned field : {kFieldNvLinkTxKib, kFieldNvLinkRxKib}) {
              FieldValue g{};
              g.field_id = field;
              g.scope_id = link;
              nvlink_fields_.push_back(g);
            }
          }
        } else {
          nvlink_rate_unsupported_ = r == kNotSupported || f.nvml_return == kNotSupported;
        }
        nvlink_kib_t_ns_ = INT64_MIN;  // no rate across a failed reading
        return;
      }
      const int i = f.field_id == kFieldNvLinkTxKib ? 0 : 1;
      const double v = field_number(f);
      if (first[i] < 0) first[i] = v;
      same[i] = same[i] && v == first[i];
      kib[i] += v;
    }
    for (int i = 0; i < 2; ++i) {
      // per link, every link answering the same count is the all-links total on each
      if (per_link_ && same[i] && nvlinks_.size() > 1) kib[i] = first[i];
    }
    if (nvlink_kib_t_ns_ != INT64_MIN && s.t_ns > nvlink_kib_t_ns_ && kib[0] >= nvlink_kib_[0] &&
        kib[1] >= nvlink_kib_[1]) {
      const double mb_per_kib_s =
          1024.0 / 1e6 / (static_cast<double>(s.t_ns - nvlink_kib_t_ns_) / 1e9);
      s.nvlink_tx_mb_s = (kib[0] - nvlink_kib_[0]) * mb_per_kib_s;
      s.nvlink_rx_mb_s = (kib[1] - nvlink_kib_[1]) * mb_per_kib_s;
    }
    nvlink_kib_[0] = kib[0];
    nvlink_kib_[1] = kib[1];
    nvlink_kib_t_ns_ = s.t_ns;
  }

  void check_nvlink(const TelemetrySample& s) {
    if (s.nvlink_crc_errors < 0) return;
    if (nvlink_t_ns_ != INT64_MIN && s.t_ns - nvlink_t_ns_ < kNvLinkGrowthGapNs) return;
    if (nvlink_t_ns_ != INT64_MIN && s.nvlink_crc_errors > nvlink_crc_) {
      if (++nvlink_rises_ == kNvLinkGrowthReadings) {
        report({s.t_ns, "nvlink_crc", static_cast<std::uint64_t>(s.nvlink_crc_errors),
                static_cast<std::uint64_t>(s.nvlink_crc_errors - nvlink_crc_base_)});
      }
    } else {
      nvlink_rises_ = 0;  // one alert per growth episode
      nvlink_crc_base_ = s.nvlink_crc_errors;
    }
    nvlink_t_ns_ = s.t_ns;
    nvlink_crc_ = s.nvlink_crc_errors;
  }

  void check_remap(const TelemetrySample& s) {
    if (s.remap_uncorrected < 0) return;
    if (remap_uncorrected_ >= 0 && (s.remap_uncorrected > remap_uncorrected_ ||
                                    (s.remap_failure != 0 && remap_failure_ == 0))) {
      report({s.t_ns, "remapped_rows", static_cast<std::uint64_t>(s.remap_uncorrected),
              static_cast<std::uint64_t>(
                  std::max<std::int64_t>(s.remap_uncorrected - remap_uncorrected_, 0))});
    }
    remap_uncorrected_ = s.remap_uncorrected;
    remap_failure_ = s.remap_failure;
  }

  // The slow figures of the last slow reading, into a fast one.
  void hold_slow(TelemetrySample& s) const {
    s.pcie_tx_mb_s = slow_.pcie_tx_mb_s;
    s.pcie_rx_mb_s = slow_.pcie_rx_mb_s;
    s.nvlink_tx_mb_s = slow_.nvlink_tx_mb_s;
    s.nvlink_rx_mb_s = slow_.nvlink_rx_mb_s;
    s.mem_clock_mhz = slow_.mem_clock_mhz;
    s.mem_temp_c = slow_.mem_temp_c;
    s.nvlink_crc_errors = slow_.nvlink_crc_errors;
    s.nvlink_replay_errors = slow_.nvlink_replay_errors;
    s.remap_corrected = slow_.remap_corrected;
    s.remap_uncorrected = slow_.remap_uncorrected;
    s.remap_pending = slow_.remap_pending;
    s.remap_failure = slow_.remap_failure;
  }

  // XID events at every reading; the counters (NVLink CRC, row remapping, ECC) with the
  // slow ones.
  void check_errors(const TelemetrySample& s, bool counters) {
    const std::int64_t t_ns = s.t_ns;
    if (counters) {
      check_nvlink(s);
      check_remap(s);
    }
    if (events_ != nullptr) {
      EventData data{};
      // timeout 0: only what is pending; the sampler's own wait paces the loop
      while (api_.event_wait(events_, &data, 0) == kSuccess) {
        if ((data.event_type & kEventXidCritical) != 0) {
          report({t_ns, "xid", data.event_data, 1});
        }
      }
    }
    unsigned long long count = 0;
    if (counters && api_.ecc != nullptr && !ecc_unsupported_) {
      const Return r = api_.ecc(dev_, kMemoryErrorUncorrected, kVolatileEcc, &count);
      if (r == kNotSupported) {
        ecc_unsupported_ = true;
      } else if (r == kSuccess) {
        if (ecc_seen_ && count > ecc_count_)
          report({t_ns, "ecc_uncorrected", count, count - ecc_count_});
        ecc_count_ = count;
        ecc_seen_ = true;
      }
    }
  }
  void report(const HardwareError& e) {
    if (on_error_) on_error_(e);
  }
  // Readings on a fixed schedule (start + k x interval): a slow reading delays the next
  // one, not every one after it; ticks missed altogether are skipped, not made up.
  void loop() {
    const auto period = std::chrono::milliseconds(interval_ms_);
    auto next = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      sample();
      next += period;
      const auto now = std::chrono::steady_clock::now();
      if (next < now) next += (now - next) / period * period + period;
      lock.lock();
      wake_.wait_until(lock, next, [this] { return stop_; });
    }
  }

  static constexpr std::size_t kMaxPending = 1 << 16;
  Api api_;
  Device dev_;
  std::string device_;
  const int interval_ms_;
  Clock* clock_;
  const bool mig_;      // the device is a MIG slice; dev_ its board
  bool instant_power_;  // power from NVML_FI_DEV_POWER_INSTANT, else nvmlDeviceGetPowerUsage
  bool reads_memory_ = false;
  std::atomic<std::int64_t> mem_used_{-1};  // the latest reading's device memory
  std::atomic<std::int64_t> mem_total_{-1};
  TelemetrySample slow_;                // the latest slow reading
  std::int64_t slow_t_ns_ = INT64_MIN;  // and its time; INT64_MIN: none yet
  double power_limit_w_ = 0;
  EventSet events_ = nullptr;
  bool ecc_unsupported_ = false;
  bool ecc_seen_ = false;
  unsigned long long ecc_count_ = 0;
  bool pcie_unsupported_ = false;
  bool mem_temp_unsupported_ = false;
  bool remap_unsupported_ = false;
  std::vector<unsigned> nvlinks_;          // the links active at creation
  std::vector<FieldValue> nvlink_fields_;  // their TX and RX throughput counters
  bool nvlink_rate_unsupported_ = false;
  bool per_link_ = false;          // the driver lacks the all-links scope: links' own counters
  double nvlink_kib_[2] = {0, 0};  // the last reading's sums: tx, rx
  std::int64_t nvlink_kib_t_ns_ = INT64_MIN;  // and its time; INT64_MIN: none
  std::int64_t nvlink_t_ns_ = INT64_MIN;      // the last reading compared, and its CRC sum
  std::int64_t nvlink_crc_ = 0;
  std::int64_t nvlink_crc_base_ = 0;  // the sum before the current run of rises
  int nvlink_rises_ = 0;
  std::int64_t remap_uncorrected_ = -1;
  std::int64_t remap_failure_ = 0;
  std::function<void(const HardwareError&)> on_error_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::vector<TelemetrySample> pending_;  // guarded by mu_
  std::string status_;                    // guarded by mu_
  bool stop_ = false;                     // guarded by mu_
  std::thread thread_;
};

}  // namespace
}  // namespace detail::nvml

std::unique_ptr<TelemetrySource> make_nvml_telemetry(int device_index, int interval_ms,
                                                     std::string* why_not, Clock* clock) {
  using namespace detail::nvml;
  std::string why;
  Api api;
  if (!load(api, &why)) {
    if (why_not != nullptr) *why_not = why;
    return nullptr;
  }
  Device dev = nullptr;
  std::string detail;
  bool mig = false;
  why = choose_device(api, device_index, &dev, &detail, &mig);
  if (!why.empty()) {
    if (why_not != nullptr) *why_not = why;
    return nullptr;
  }
  char name[96] = {};
  if (api.get_name != nullptr && api.get_name(dev, name, sizeof(name)) == kSuccess) {
    detail += fmt::format(", {}", name);
  }
  double w = 0;
  const bool instant = instant_power_w(api, dev, &w) == kSuccess;
  if (!instant) {
    unsigned mw = 0;
    if (const Return r = api.power_usage(dev, &mw); r != kSuccess) {
      if (why_not != nullptr) *why_not = "nvmlDeviceGetPowerUsage failed: " + api.error(r);
      return nullptr;
    }
  }
  detail += instant
                ? ", power: instantaneous (NVML_FI_DEV_POWER_INSTANT))"
                : ", power: nvmlDeviceGetPowerUsage (a 1 s mean on Ampere and newer but GA100))";
  return std::make_unique<NvmlTelemetry>(api, dev, detail, interval_ms, clock, mig, instant);
}

bool sample_nvml_now(TelemetrySource& source) {
  auto* nvml = dynamic_cast<detail::nvml::NvmlTelemetry*>(&source);
  return nvml != nullptr && nvml->sample();
}

}  // namespace steptrace
