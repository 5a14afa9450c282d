// A profiler on a fake host clock with a device timer the test chooses (the FakeDeviceTimer
// in test_device_timing.cpp, the real CudaTimer on the stand-in libcuda in
// test_cuda_timer_fake.cpp), and the standard step those tests run: forward 1 ms on the
// host and 3 ms on the device, backward 1 ms and 5 ms. The device's part is a callback,
// since each fake device is driven its own way.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/fake/fake_backends.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace::testing {

inline constexpr std::int64_t kMs = 1'000'000;

struct DeviceTimingRun {
  /// `device_work(ms)`: the device is given `ms` of work on the run's stream; `configure`
  /// adjusts the config (run_config with max_inflight) before the profiler is made.
  DeviceTimingRun(const TempDir& tmp, std::unique_ptr<DeviceTimer> timer, int max_inflight,
                  std::uintptr_t stream, std::function<void(double)> device_work,
                  const std::function<void(Config&)>& configure = {})
      : work(std::move(device_work)) {
    Config config = run_config(tmp);
    config.max_inflight_steps = max_inflight;
    // Device timing only: the machine's real CUPTI and NVML (the CUDA toolkit's libcupti
    // loads here without a GPU) stay out of these tests.
    config.kernel_activity = "off";
    config.counters = "off";
    config.nvml = "off";
    if (configure) configure(config);
    Backends backends;
    auto c = std::make_unique<fake::FakeClock>();
    clock = c.get();
    backends.clock = std::move(c);
    backends.device_timer = std::move(timer);
    prof = std::make_unique<Profiler>(config, RunInfo{}, std::move(backends));
    path = prof->log_path();
    prof->set_stream(stream);
  }
  /// One phase of the current step: `host_ms` on the host clock, `device_ms` of device work.
  void phase(Step& s, const char* name, std::int64_t host_ms, double device_ms) {
    auto p = s.phase(name);
    clock->advance(host_ms * kMs);
    work(device_ms);
  }
  // A step whose forward takes 1 ms on the host and 3 ms on the device, backward 1 / 5.
  void step() {
    auto s = prof->step();
    phase(s, "forward", 1, 3);
    phase(s, "backward", 1, 5);
  }
  std::vector<nlohmann::json> steps_written() {
    prof->flush();
    return of_kind(read_jsonl(path), "step");
  }

  std::function<void(double)> work;
  fake::FakeClock* clock = nullptr;
  std::unique_ptr<Profiler> prof;
  std::string path;
};

}  // namespace steptrace::testing
