// The parts ProfilerImpl (profiler.cpp) is made of, grouped by what they are for, so that
// the façade holds a few named parts rather than every field of the run. Plain holders:
// the façade assembles them and decides the order of operations. Within each part, and
// between the parts in ProfilerImpl, the declaration order is the destruction order that
// matters (see the comments there).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "../core/detection_stage.hpp"
#include "../core/host/heap_sampler.hpp"
#include "../core/host/host_readings.hpp"
#include "../core/work_accounting.hpp"
#include "../sinks/prometheus_sink.hpp"
#include "../sinks/record_tap.hpp"
#include "run_environment.hpp"
#include "steptrace/backend.hpp"
#include "watchdog.hpp"

namespace steptrace::detail {

/// The run's clock and its one mapping to unix time.
struct RunClock {
  std::unique_ptr<Clock> clock;
  bool host = false;     // clock is make_host_clock()'s
  bool counter = false;  // the training thread reads it from the CPU's counter
  ClockMapping start;    // unix time of a reading of clock
};

/// Which run this is: the job, the attempt and its log file, and when the process began.
struct RunIdentity {
  JobIdentity job;
  LogFile log;                             // which attempt of the job this run is
  std::int64_t process_start_unix_ns = 0;  // 0: unknown
};

/// The host's memory readings: every memory source, split between those the watchdog
/// polls (HostReadings, every 10 ms) and those read at a step's end, and the C heap.
struct HostSampling {
  std::vector<std::unique_ptr<MemorySource>> sources;  // all (run_start lists them)
  std::vector<MemorySource*> at_step_end;              // read at a step's end
  HostReadings readings;            // the watchdog's: the others, and the steps' run queue
  std::optional<HeapSampler> heap;  // the C heap, when sample_heap

  /// Gives each source to the watchdog's readings where it polls (`polled`) and the source
  /// may be read from any thread at an interval, else to the step's end.
  void split(bool polled) {
    for (const auto& source : sources) {
      if (polled && source->any_thread() && source->min_interval_ns() > 0) {
        readings.add_source(source.get());
      } else {
        at_step_end.push_back(source.get());
      }
    }
  }
};

/// MFU's divisor: set_mfu_dtype (training thread) may change it while close() reads it.
struct MfuPeak {
  PeakChoice choice;
  mutable std::mutex mutex;  // choice's strings: set_mfu_dtype against close
};

/// What watches the run: the detectors on the writer thread, and the watchdog thread with
/// what it knows of the other ranks (peers is read by the watchdog and the metrics sink).
struct RunWatch {
  std::unique_ptr<DetectionStage> detection;
  PeerState peers;
  Watchdog watchdog;
};

/// The sinks the record pipeline feeds beside the log file: both outlive the pipeline.
struct ExtraSinks {
  // The Prometheus sink; its server thread reads the names, the detection stage and the
  // in-flight atomics, all declared before it.
  std::unique_ptr<PrometheusSink> metrics;
  RecordTap tap;  // in-process readers of the records
};

}  // namespace steptrace::detail
