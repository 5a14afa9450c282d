// The C++ tests' profiler on a fake clock and a fake memory source (test_profiler,
// test_step_recorder, test_watchdog).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/fake/fake_backends.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace::testing {

constexpr std::int64_t kMs = 1'000'000;

// A profiler on a fake clock and a fake memory source, both still reachable by the test.
struct Fixture {
  explicit Fixture(const TempDir& tmp, const std::function<void(Config&)>& tweak = {}) {
    Config config = testing::run_config(tmp);
    if (tweak) tweak(config);
    Backends backends;
    auto c = std::make_unique<fake::FakeClock>();
    clock = c.get();
    backends.clock = std::move(c);
    auto m = std::make_unique<fake::FakeMemorySource>();
    memory = m.get();
    backends.memory_sources.push_back(std::move(m));
    prof = std::make_unique<Profiler>(config, RunInfo{{{"python", "3.11"}}}, std::move(backends));
    path = prof->log_path();
  }
  std::vector<nlohmann::json> close_and_read() {
    prof->close();
    return read_jsonl(path);
  }
  fake::FakeClock* clock;
  fake::FakeMemorySource* memory;
  std::unique_ptr<Profiler> prof;
  std::string path;
};

}  // namespace steptrace::testing
