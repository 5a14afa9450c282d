// Useful work (Profiler::add_work, flops_per_step, peak_tflops, set_mfu_dtype): the step
// record's "work", run_start's and run_end's.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "backends/fake/fake_backends.hpp"
#include "backends/fake/fake_device_timer.hpp"
#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;

constexpr std::int64_t kStepNs = 100'000'000;  // 100 ms per step on the fake clock

struct WorkRun {
  std::unique_ptr<Profiler> prof;
  fake::FakeClock* clock = nullptr;
  fake::FakeDeviceTimer* device = nullptr;
};

WorkRun start(const TempDir& tmp, Config config, const char* device_name = nullptr) {
  WorkRun run;
  Backends backends;
  run.clock = testing::install(std::make_unique<fake::FakeClock>(), backends.clock);
  if (device_name != nullptr) {
    auto device = std::make_unique<fake::FakeDeviceTimer>();
    device->gpu_name = device_name;
    device->complete_all(/*from_now_on=*/true);
    run.device = testing::install(std::move(device), backends.device_timer);
  }
  run.prof = std::make_unique<Profiler>(std::move(config), RunInfo{}, std::move(backends));
  if (device_name != nullptr) run.prof->set_stream(7);
  return run;
}

// One step of kStepNs (with no gap before it on the fake clock), its work added inside.
void step(WorkRun& run, double samples, double tokens, double flops,
          WorkSource source = WorkSource::kUser) {
  auto s = run.prof->step();
  run.prof->add_work(samples, tokens, flops, source);
  run.clock->advance(kStepNs);
  if (run.device != nullptr) run.device->advance_device(kStepNs);
}

TEST(Work, RatesArePerSecondOfTheIterationAndMfuIsOverThePeak) {
  TempDir tmp;
  Config config = testing::run_config(tmp);
  config.peak_tflops = 100;  // on the host clock MFU needs the option
  WorkRun run = start(tmp, config);
  step(run, 8, 2048, 5e12);
  run.prof->close();
  const auto records = read_jsonl(run.prof->log_path());
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);
  const auto& w = steps[0].at("work");
  EXPECT_EQ(w.at("samples"), 8);
  EXPECT_EQ(w.at("tokens"), 2048);
  EXPECT_DOUBLE_EQ(w.at("flops").get<double>(), 5e12);
  EXPECT_NEAR(w.at("samples_per_s").get<double>(), 80, 1e-6);    // 8 / 0.1 s
  EXPECT_NEAR(w.at("tokens_per_s").get<double>(), 20480, 1e-3);  // 2048 / 0.1 s
  EXPECT_NEAR(w.at("tflops_per_s").get<double>(), 50, 1e-6);     // 5e12 / 0.1 s
  EXPECT_NEAR(w.at("mfu_pct").get<double>(), 50, 1e-3);          // 50 of 100 TFLOP/s
  EXPECT_FALSE(w.contains("j_per_token"));                       // no NVML here
  const auto start_work = of_kind(records, "run_start").at(0).at("work");
  EXPECT_DOUBLE_EQ(start_work.at("peak_tflops").get<double>(), 100);
  EXPECT_EQ(start_work.at("chip"), "peak_tflops option");
  const auto end_work = of_kind(records, "run_end").at(0).at("work");
  EXPECT_NEAR(end_work.at("mfu_pct").get<double>(), 50, 1e-3);
  EXPECT_NEAR(end_work.at("tokens_per_s").get<double>(), 20480, 1e-3);
}

// On the CUDA clock, a host that runs ahead of the device (its step took 100 ms to queue,
// the device 250 ms to run): rates and MFU are over the device's time of the step, not
// the host's shorter one; a host-bound step (the device done in 40 ms) keeps its wall time.
TEST(Work, OnTheCudaClockRatesAreOverTheDevicesTimeWhenTheHostRunsAhead) {
  TempDir tmp;
  Config config = testing::run_config(tmp);
  config.peak_tflops = 100;
  WorkRun run = start(tmp, config, "Fake GPU");
  auto step_on_device = [&](std::int64_t device_ns) {
    auto s = run.prof->step();
    run.prof->add_work(8, 2048, 5e12, WorkSource::kUser);
    run.clock->advance(kStepNs);
    run.device->advance_device(device_ns);
  };
  step_on_device(250'000'000);
  step_on_device(40'000'000);
  run.prof->close();
  const auto records = read_jsonl(run.prof->log_path());
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].at("clock"), "cuda");
  EXPECT_DOUBLE_EQ(steps[0].at("step_ms").get<double>(), 250);
  EXPECT_DOUBLE_EQ(steps[0].at("host_ms").get<double>(), 100);
  const auto& ahead = steps[0].at("work");
  EXPECT_NEAR(ahead.at("tokens_per_s").get<double>(), 2048 / 0.25, 1e-3);
  EXPECT_NEAR(ahead.at("tflops_per_s").get<double>(), 20, 1e-6);  // 5e12 / 0.25 s, not 50
  EXPECT_NEAR(ahead.at("mfu_pct").get<double>(), 20, 1e-3);
  const auto& bound = steps[1].at("work");
  EXPECT_NEAR(bound.at("tflops_per_s").get<double>(), 50, 1e-6);  // the wall's 100 ms
  const auto end_work = of_kind(records, "run_end").at(0).at("work");
  EXPECT_NEAR(end_work.at("mfu_pct").get<double>(), 100.0 * 1e13 / 0.35 / 1e14, 1e-3);
  EXPECT_NEAR(end_work.at("tokens_per_s").get<double>(), 4096 / 0.35, 0.1);  // 6 digits
}

TEST(Work, OneSourceAddsUpAndAMoreTrustedSourceReplacesALessTrustedOne) {
  TempDir tmp;
  WorkRun run = start(tmp, testing::run_config(tmp));
  {
    auto s = run.prof->step();
    // two micro-batches seen by the model, then the loader's figure for samples
    run.prof->add_work(4, 512, 1e9, WorkSource::kModel);
    run.prof->add_work(4, 512, 1e9, WorkSource::kModel);
    run.prof->add_work(16, -1, -1, WorkSource::kBatch);
    run.prof->add_work(3, -1, -1, WorkSource::kModel);  // less trusted than the batch: ignored
    run.clock->advance(kStepNs);
  }
  run.prof->add_work(1, -1, -1);  // between steps: the next step's
  {
    auto s = run.prof->step();
    run.clock->advance(kStepNs);
  }
  { auto s = run.prof->step(); }  // nothing added: no work object
  run.prof->close();
  const auto steps = of_kind(read_jsonl(run.prof->log_path()), "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0].at("work").at("samples"), 16);
  EXPECT_EQ(steps[0].at("work").at("tokens"), 1024);
  EXPECT_DOUBLE_EQ(steps[0].at("work").at("flops").get<double>(), 2e9);
  EXPECT_FALSE(steps[0].at("work").contains("mfu_pct"));  // no peak on the host clock
  EXPECT_EQ(steps[1].at("work").at("samples"), 1);
  EXPECT_FALSE(steps[1].at("work").contains("flops"));
  EXPECT_FALSE(steps[2].contains("work"));
}

TEST(Work, FlopsPerStepFillsEveryStepUnlessTheProgramGivesItsOwn) {
  TempDir tmp;
  Config config = testing::run_config(tmp);
  config.flops_per_step = 3e9;
  WorkRun run = start(tmp, config);
  step(run, -1, -1, 7e8, WorkSource::kModel);  // counted: the option wins
  step(run, -1, -1, 5e9, WorkSource::kUser);   // the program's own figure wins
  step(run, 2, -1, -1);
  run.prof->close();
  const auto steps = of_kind(read_jsonl(run.prof->log_path()), "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_DOUBLE_EQ(steps[0].at("work").at("flops").get<double>(), 3e9);
  EXPECT_DOUBLE_EQ(steps[1].at("work").at("flops").get<double>(), 5e9);
  EXPECT_DOUBLE_EQ(steps[2].at("work").at("flops").get<double>(), 3e9);
}

TEST(Work, WithoutAPeakThereIsNoMfuAndRunStartSaysWhy) {
  TempDir tmp;
  WorkRun run = start(tmp, testing::run_config(tmp), "Fake GPU");
  step(run, 1, -1, 1e12);
  run.prof->close();
  const auto records = read_jsonl(run.prof->log_path());
  const auto start_work = of_kind(records, "run_start").at(0).at("work");
  EXPECT_TRUE(start_work.at("peak_tflops").is_null());
  const std::string why = start_work.at("mfu_unavailable");
  EXPECT_NE(why.find("Fake GPU"), std::string::npos) << why;
  EXPECT_NE(why.find("peak_tflops"), std::string::npos) << why;
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_TRUE(steps[0].at("work").contains("tflops_per_s"));
  EXPECT_FALSE(steps[0].at("work").contains("mfu_pct"));  // never another chip's peak
}

TEST(Work, AKnownGpuTakesItsDatasheetPeakForTheModelsDtype) {
  TempDir tmp;
  WorkRun run = start(tmp, testing::run_config(tmp), "NVIDIA H100 80GB HBM3");
  step(run, 1, -1, 1e12);  // mfu_dtype auto: bf16 assumed until the model says
  EXPECT_TRUE(run.prof->set_mfu_dtype("fp32"));
  step(run, 1, -1, 1e12);
  EXPECT_THROW(run.prof->set_mfu_dtype("int4"), ConfigError);
  run.prof->close();
  const auto records = read_jsonl(run.prof->log_path());
  const auto start_work = of_kind(records, "run_start").at(0).at("work");
  EXPECT_EQ(start_work.at("mfu_dtype"), "bf16");
  EXPECT_EQ(start_work.at("mfu_dtype_assumed"), true);
  const double bf16_peak = start_work.at("peak_tflops");
  EXPECT_GT(bf16_peak, 500);  // an H100 SXM's dense bf16 peak is near 1000 TFLOP/s
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  const double mfu_bf16 = steps[0].at("work").at("mfu_pct");
  const double mfu_fp32 = steps[1].at("work").at("mfu_pct");
  EXPECT_NEAR(mfu_bf16, 100.0 * 10 / bf16_peak, 1e-3);  // 10 TFLOP/s achieved
  EXPECT_GT(mfu_fp32, 5 * mfu_bf16);                    // fp32's peak is far lower
  const auto end_work = of_kind(records, "run_end").at(0).at("work");
  EXPECT_EQ(end_work.at("mfu_dtype"), "fp32");
  EXPECT_FALSE(end_work.contains("mfu_dtype_assumed"));
}

TEST(Work, ExplicitOptionsWinOverTheModelsDtype) {
  TempDir tmp;
  Config config = testing::run_config(tmp);
  config.mfu_dtype = "tf32";
  WorkRun run = start(tmp, config, "NVIDIA H100 80GB HBM3");
  EXPECT_FALSE(run.prof->set_mfu_dtype("bf16"));
  run.prof->close();
  const auto start_work = of_kind(read_jsonl(run.prof->log_path()), "run_start").at(0).at("work");
  EXPECT_EQ(start_work.at("mfu_dtype"), "tf32");
  EXPECT_FALSE(start_work.contains("mfu_dtype_assumed"));
}

TEST(Work, BadOptionsAreRefusedBeforeAnythingIsWritten) {
  TempDir tmp;
  Config config = testing::run_config(tmp);
  config.flops_per_step = -1;
  EXPECT_THROW(config.validate(), ConfigError);
  config.flops_per_step = 0;
  config.peak_tflops = -5;
  EXPECT_THROW(config.validate(), ConfigError);
  config.peak_tflops = 0;
  config.mfu_dtype = "int8";
  EXPECT_THROW(config.validate(), ConfigError);
}

}  // namespace
}  // namespace steptrace
