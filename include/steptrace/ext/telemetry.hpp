// GPU hardware telemetry backends (NVML: power, energy, clocks, temperature, PCIe, NVLink,
// hardware errors) read on a background thread, with their factory.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "steptrace/backend.hpp"
#include "steptrace/export.hpp"

namespace steptrace {

/// One reading of the device's hardware state (NVML; a fake library in tests). NaN where
/// the device does not report a figure.
struct TelemetrySample {
  std::int64_t t_ns = 0;               // on TelemetrySource::now_ns()'s clock
  double power_w = 0;                  // board power draw
  double energy_j = 0;                 // cumulative energy counter since driver load
  double temp_c = 0;                   // GPU temperature
  double sm_clock_mhz = 0;             // SM clock
  double util_pct = 0;                 // GPU utilization (share of time a kernel ran)
  std::uint64_t throttle_reasons = 0;  // NVML clock event reason bits
  // Optional readings: NaN, or -1 for counters, where the device does not report them.
  double pcie_tx_mb_s = std::numeric_limits<double>::quiet_NaN();  // PCIe TX, MB/s
  double pcie_rx_mb_s = std::numeric_limits<double>::quiet_NaN();  // PCIe RX, MB/s
  // NVLink data TX / RX, MB/s, summed over the active links: the growth of their
  // throughput counters since the reading before (NaN on the first reading)
  double nvlink_tx_mb_s = std::numeric_limits<double>::quiet_NaN();
  double nvlink_rx_mb_s = std::numeric_limits<double>::quiet_NaN();
  double mem_clock_mhz = std::numeric_limits<double>::quiet_NaN();  // memory clock
  double mem_temp_c = std::numeric_limits<double>::quiet_NaN();     // HBM temperature
  std::int64_t nvlink_crc_errors = -1;     // CRC flit errors summed over active links
  std::int64_t nvlink_replay_errors = -1;  // replay errors summed over active links
  std::int64_t remap_corrected = -1;       // remapped rows: correctable
  std::int64_t remap_uncorrected = -1;     // remapped rows: uncorrectable
  std::int64_t remap_pending = -1;         // 1: a remap waits for a GPU reset
  std::int64_t remap_failure = -1;         // 1: a remap failed
};

/// A hardware fault the sampler found: a critical XID event, a rise of the volatile
/// uncorrected ECC count, NVLink CRC errors that keep growing, or a new uncorrectable
/// row remap or remap failure.
struct HardwareError {
  std::int64_t t_ns = 0;
  std::string kind;         // "xid", "ecc_uncorrected", "nvlink_crc" or "remapped_rows"
  std::uint64_t code = 0;   // the XID, or the new count
  std::uint64_t delta = 0;  // the counts: the rise that raised it
};

/// GPU hardware telemetry read on a background thread (never the training thread) every
/// interval. Samples are handed over in batches to the writer thread.
class STEPTRACE_API TelemetrySource {
 public:
  virtual ~TelemetrySource() = default;
  /// "nvml", "fake", ...
  virtual const char* name() const noexcept = 0;
  /// Now on the samples' clock. Training thread, at step boundaries: must be cheap.
  virtual std::int64_t now_ns() noexcept = 0;
  /// The device's enforced power limit in W; 0 when unknown.
  virtual double power_limit_w() const noexcept = 0;
  /// The device sampled and how it was chosen, for run_start.
  virtual std::string device() const { return {}; }
  /// Called for every hardware error as the sampler finds it (on the sampler thread).
  /// Set once, before start().
  virtual void set_error_handler(std::function<void(const HardwareError&)> handler) = 0;
  /// Starts sampling (no-op for sources sampled by hand).
  virtual void start() = 0;
  /// Writer thread: appends the samples read since the last call, oldest first.
  virtual void take(std::vector<TelemetrySample>& out) = 0;
  /// Stops the sampler thread (idempotent).
  virtual void finish() noexcept = 0;
  /// "" while sampling; else why it stopped.
  virtual std::string status() const = 0;
  /// The sample figures that are the whole board's rather than the device's the steps run
  /// on (a MIG slice: power, energy, temperature, clocks, PCIe, NVLink); empty otherwise.
  virtual std::vector<std::string> board_wide() const { return {}; }
  /// Device-wide used and total memory (every process's) at the latest reading: false when
  /// the source does not read it; -1 until its first reading. Training thread, at step
  /// ends: must be cheap (no driver call).
  virtual bool device_memory(std::int64_t* used, std::int64_t* total) const noexcept {
    (void)used;
    (void)total;
    return false;
  }
};

/// NVML telemetry of CUDA device `device_index` (-1: $LOCAL_RANK, else 0), found through
/// its PCI bus id where libcuda is there, else through CUDA_VISIBLE_DEVICES (a GPU UUID,
/// whole or a prefix; a MIG UUID: its board; an index), from libnvidia-ml.so.1 loaded at run
/// time ($STEPTRACE_NVML_LIBRARY overrides the path). `interval_ms` > 0: a sampler thread
/// reads every interval_ms once start() is called; 0: no thread (the C++ tests read with a
/// hook of their own). `clock`: the samples' clock (not owned; null: CLOCK_MONOTONIC).
/// nullptr when unavailable; `why_not` then says why in one line.
STEPTRACE_API std::unique_ptr<TelemetrySource> make_nvml_telemetry(int device_index,
                                                                   int interval_ms,
                                                                   std::string* why_not,
                                                                   Clock* clock = nullptr);

}  // namespace steptrace
