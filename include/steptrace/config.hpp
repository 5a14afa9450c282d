// Profiler configuration. Every field has a documented default; validate() throws
// ConfigError naming the bad value and what is allowed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "steptrace/export.hpp"

namespace steptrace {

/// Options of one profiler. Plain data: copy it, change fields, pass it to Profiler.
struct STEPTRACE_API Config {
  /// Folder of the run; one JSONL file per rank (rank<N>.jsonl) is written in it.
  /// Created (with parents) when missing.
  std::string log_dir;
  /// Replace an existing rank<N>.jsonl instead of refusing to start.
  bool overwrite = false;
  /// Identifies the run in run_start; empty means generated from time and pid.
  std::string run_id;
  /// Rank and world size; -1 means read RANK / WORLD_SIZE from the environment
  /// (torchrun sets them), else 0 and 1.
  int rank = -1;
  int world_size = -1;
  /// Phase names known up front (the summary orders these first). Others may be used too.
  std::vector<std::string> phases = {"forward", "loss", "backward", "clip", "optimizer"};
  /// Longest time a record waits in memory before the writer thread writes it.
  int flush_interval_ms = 100;
  /// Step records buffered between the training thread and the writer (bounded memory).
  int queue_capacity = 4096;
  /// Sample the process resident set size at the end of every step (at most every 10 ms).
  bool sample_rss = true;
  /// Read the C heap's in-use bytes (glibc mallinfo2) at the end of steps: the CPU
  /// memory-growth signal. Its cost grows with the heap's free chunks, so it is read at
  /// most every k-th step, k chosen to keep the reads under 1% of the step time.
  bool sample_heap = true;
  /// Timer: "auto" (CUDA events when a CUDA stream is set and the driver works, else the
  /// host clock), "host", or "cuda" (CUDA events, or ConfigError when unavailable).
  std::string clock = "auto";
  /// Steps whose device times may still be pending; at the bound the profiler waits.
  int max_inflight_steps = 8;
  /// Detection: trailing window of completed steps, warmup steps excluded from it.
  int window = 100;
  int warmup_steps = 10;
  /// Iteration time over the trailing median that counts as a regression / a stall.
  double regression_threshold = 1.5;
  double stall_threshold = 5.0;
  /// Consecutive slow steps that make a regression (one noisy step does not); a stall
  /// fires on a single step.
  int regression_min_steps = 3;
  /// Completed steps (after warmup) needed before a step can be called slow.
  int min_history = 20;
  /// Noise rule: a step counts as slow only when its excess over the median is also
  /// above min_excess_ms and above noise_sigmas standard deviations of the window (the
  /// larger of 1.4826 x its median absolute deviation and (p90 - p50) / 1.2816); a stall needs
  /// stall_min_excess_ms, twice noise_sigmas, and regression_threshold x the window's 95th
  /// percentile too. (A step is also slow when the phase that grew most is over
  /// regression_threshold x its own median and the iteration's excess passes this rule.)
  double min_excess_ms = 2.0;
  double stall_min_excess_ms = 50.0;
  double noise_sigmas = 3.0;
  /// A regression lasts at least regression_min_ms of baseline time: it needs
  /// max(regression_min_steps, ceil(regression_min_ms / median)) slow steps in a row,
  /// at most 10 (or regression_min_steps when that is larger).
  double regression_min_ms = 200.0;
  /// Run the detectors (regression, stall, memory growth) and the hang watchdog.
  bool detect = true;
  /// Hang: a step still running after hang_threshold x the median iteration time, and
  /// at least hang_min_s; hang_floor_s applies until min_history steps are known.
  double hang_threshold = 5.0;
  double hang_min_s = 1.0;
  double hang_floor_s = 10.0;
  /// Memory growth: tolerated rise above the peak of the first steps after warmup, in %.
  double memory_growth_pct = 2.0;

  /// Kernel activity (CUPTI activity records: compute / NCCL / idle time per step):
  /// "auto" (on when steps are timed with CUDA events and CUPTI works) or "off".
  std::string kernel_activity = "auto";
  /// Hardware counters (CUPTI PM sampling: tensor-core, DRAM, occupancy): "auto" or "off".
  std::string counters = "auto";
  /// Steps with counters: counter_burst consecutive steps out of every counter_every
  /// (1/1: every step; 10/1: every 10th; 100/10: a 10% duty cycle).
  int counter_every = 10;
  int counter_burst = 1;
  /// CUDA device the counters sample; -1: the current device.
  int device_index = -1;
  /// Kernels listed by total time in run_end (0: none).
  int top_kernels = 10;
  /// Diagnoses on sampled steps after warmup: low_tensor_core below tensor_core_min_pct
  /// where matmul kernels take at least matmul_dominated_pct of the kernel time;
  /// memory_bound with occupancy below occupancy_min_pct and DRAM above dram_bound_pct;
  /// comm_bound where NCCL kernels take more than comm_bound_pct of the step.
  double tensor_core_min_pct = 60.0;
  double matmul_dominated_pct = 50.0;
  double occupancy_min_pct = 60.0;
  double dram_bound_pct = 80.0;
  double comm_bound_pct = 25.0;

  /// GPU hardware telemetry (NVML: power, energy, temperature, clocks, throttling, XID
  /// and ECC errors) of the rank's device (device_index, else $LOCAL_RANK, else 0):
  /// "auto" (on where libnvidia-ml.so.1 loads and sees the device) or "off".
  std::string nvml = "auto";
  /// Interval of the NVML sampler thread.
  int nvml_interval_ms = 100;
  /// power_low: average step power below power_low_fraction x the device's power limit
  /// for power_low_min_s seconds of consecutive steps (after warmup).
  double power_low_fraction = 0.7;
  double power_low_min_s = 30.0;
  /// ... and, where a step has CUPTI counters, its SM throughput below this percentage:
  /// a GPU whose SMs are busy at low power is doing work (memory- or latency-bound
  /// kernels), not waiting on the input pipeline or the network.
  double power_low_sm_pct = 50.0;
  /// power_low is named data-pipeline bound when the loader's wait is more than this
  /// percentage of the iteration (else communication bound above comm_bound_pct).
  double power_low_data_pct = 20.0;
  /// temperature_rising: the hottest reading of the steps rising faster than this over
  /// the last minute (at least 30 s of history).
  double temp_rise_c_per_min = 10.0;
  /// power_drop: power falling between two readings by more than
  /// min(power_drop_w, power_drop_fraction x the power limit): whichever comes first, so
  /// it fires on a 300 W card (120 W) as on a 700 W one (280 W).
  double power_drop_w = 300.0;
  double power_drop_fraction = 0.4;

  /// close() from a thread other than the one driving the steps waits at most this long
  /// for the step in progress to end; after it, the run is closed without that step and
  /// without the steps still waiting for device times.
  double close_wait_s = 10.0;

  /// Prometheus endpoint (http://<host>:<port>/metrics, text format 0.0.4) served from a
  /// thread of the process: -1 off, 0 any free port, N > 0 port N + $LOCAL_RANK (so the
  /// ranks of one host use N, N+1, ...). The bound port is in run_start.metrics.port and
  /// Profiler::metrics_port(); when it cannot be bound the run goes on without it.
  int metrics_port = -1;
  /// The `job` label of the metrics; empty: $STEPTRACE_JOB, else "steptrace".
  std::string job;
  /// node-exporter textfile mode: the metrics are also written to this file (name it
  /// *.prom in the collector's folder), atomically (temporary file + rename), at most once
  /// a second and at close. Empty: off. Independent of metrics_port.
  std::string metrics_textfile;
  /// Pushgateway base URL ("http://host:9091"): the final metrics are pushed (PUT, grouped
  /// by job, run_id and rank) when the run closes, for jobs too short to be scraped.
  /// Empty: off.
  std::string metrics_pushgateway;

  /// Throws ConfigError for the first bad value, naming it and what is allowed.
  void validate() const;
};

/// Limits on phases, shared by validation and the fixed-size step records.
inline constexpr std::size_t kMaxPhases = 32;
inline constexpr std::size_t kMaxPhaseNameBytes = 64;
/// Distinct names of per-step values (Profiler::set_step_value) a run may use; a step
/// record holds one slot per name, so a step never runs out of room for its values.
inline constexpr std::size_t kMaxStepValues = 16;

/// Throws ConfigError unless `name` can be a phase name (non-empty, at most
/// kMaxPhaseNameBytes bytes, no control characters, not the reserved "data").
STEPTRACE_API void validate_phase_name(const std::string& name);

}  // namespace steptrace
