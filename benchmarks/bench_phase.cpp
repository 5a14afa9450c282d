// Host-side cost of steptrace's C++ API, side by side with the alternatives, in one run.
//
//   BM_EmptyLoop                 the loop itself (subtracted in the summary)
//   BM_SteadyClockPair           the hand-written alternative: two steady_clock::now() calls
//   BM_PhaseById                 one Phase scope by PhaseId inside a running step (host clock)
//   BM_PhaseByName/<name>        the same by name (interned-name lookup on every call)
//   BM_Step5Phases/...           a whole step with forward, loss, backward, clip, optimizer,
//                                including handing the record to the writer. The ring is
//                                drained (flush, untimed) every kFlushEvery steps, so the
//                                figure is the training thread's cost, never a wait on a full
//                                ring (writer_waits, read back from run_end, says so).
//   BM_WriterThroughput/...      step records per second the writer sustains end to end:
//                                N steps pushed as fast as possible through the default
//                                4096-slot ring, then close() (drain + run_end + fsync), all
//                                inside the timed region (manual time). The training thread
//                                waits whenever the ring is full, so this is the writer's
//                                rate, not the training thread's.
//   BM_RingFullStall/...         how long the one step that finds the ring full waits.
//   BM_Step5PhasesFakeActivity   a step with kernel activity and counter sampling on (fake
//                                backends): the training thread's share of that bookkeeping.
//   BM_KernelStats/<n>           the writer thread's per-step kernel figures (unions, idle)
//                                for n kernels, against BM_KernelDurationSum/<n>, a plain sum.
//   BM_CounterAlignment/<n>      the writer thread's join of n counter samples to one step
//                                (DeviceActivityStage), per sample, against
//                                BM_AggregateSamples/<n> (the averaging alone).
//   BM_RunQueueRead              one reading of the training thread's run-queue wait
//                                (RunQueueReader::read(): pread of /proc/thread-self/schedstat
//                                on a file kept open), against BM_RunQueueOpenRead (open +
//                                read + close each time, the obvious alternative).
//   BM_Step5PhasesRunQueueEveryStep  BM_Step5Phases (by id, rss off) plus one extra reading
//                                after every step: the read's cost next to a real step's
//                                bookkeeping. The profiler reads at a step's end at most every
//                                10 ms, so the summary also gives the amortized cost per step.
//   BM_AfterUserWork/<call>      one call after 10 ms of user-space work (cold kernel paths),
//                                as the profiler meets it: getppid (the cold entry alone), the
//                                run-queue reading alone, the RSS reading (statm), and the
//                                run-queue reading right after statm (default options).
//
// Logs go to /tmp/steptrace-bench-<pid>/ (overwrite=true) and are removed at exit unless
// --keep_logs is given. After the Google Benchmark table (console format only) a summary
// prints per-op costs net of the empty loop, ratios and the budget check (< 1 us/phase).
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "backends/fake/fake_device_activity.hpp"
#include "backends/fake/fake_device_timer.hpp"
#include "core/device_activity_stage.hpp"
#include "core/host/host_steal.hpp"
#include "core/host/run_queue.hpp"
#include "core/sample_aggregation.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/steptrace.hpp"

namespace {

namespace fs = std::filesystem;

constexpr int kFlushEvery = 1024;
constexpr std::array<std::string_view, 5> kPhaseNames = {"forward", "loss", "backward", "clip",
                                                         "optimizer"};

fs::path bench_root() {
  static const fs::path root =
      fs::temp_directory_path() / ("steptrace-bench-" + std::to_string(::getpid()));
  return root;
}

steptrace::Config make_config(const std::string& name, bool sample_rss = true) {
  steptrace::Config c;
  c.log_dir = (bench_root() / name).string();
  c.overwrite = true;
  c.run_id = "bench";
  c.rank = 0;
  c.world_size = 1;
  c.sample_rss = sample_rss;
  return c;
}

// Drains the ring every kFlushEvery steps, outside the timed region, so that a step
// benchmark measures the training thread and never a full ring.
void drain_now_and_then(steptrace::Profiler& prof, benchmark::State& state, int& since_flush) {
  if (++since_flush != kFlushEvery) return;
  state.PauseTiming();
  prof.flush();
  since_flush = 0;
  state.ResumeTiming();
}

// writer_waits from the run_end line of a closed log (-1 when not found).
std::int64_t writer_waits(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  const std::string key = "\"writer_waits\":";
  const auto pos = last.find(key);
  if (pos == std::string::npos) return -1;
  return std::stoll(last.substr(pos + key.size()));
}

// The timed loop of the fake-backend step benchmarks: a step with the five phases by id
// (and `after_step` after each, when given), then close.
template <typename AfterStep = void (*)()>
void time_5_phase_steps(steptrace::Profiler& prof, benchmark::State& state,
                        AfterStep after_step = nullptr) {
  std::array<steptrace::PhaseId, 5> ids{};
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = prof.phase_id(kPhaseNames[i]);
  int since_flush = 0;
  for (auto _ : state) {
    {
      auto step = prof.step();
      for (const auto id : ids) {
        auto p = step.phase(id);
        benchmark::DoNotOptimize(p);
      }
    }
    if constexpr (!std::is_pointer_v<AfterStep>) after_step();
    drain_now_and_then(prof, state, since_flush);
  }
  prof.close();
}

// ---- (a) baseline ----
void BM_EmptyLoop(benchmark::State& state) {
  std::int64_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(++i);
  }
}
BENCHMARK(BM_EmptyLoop);

// ---- (e) the hand-written alternative ----
void BM_SteadyClockPair(benchmark::State& state) {
  std::int64_t total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto t1 = std::chrono::steady_clock::now();
    total += (t1 - t0).count();
    benchmark::DoNotOptimize(total);
  }
}
BENCHMARK(BM_SteadyClockPair);

// ---- (b) one phase by id, inside a running step ----
void BM_PhaseById(benchmark::State& state) {
  steptrace::Profiler prof(make_config("phase_by_id"));
  const steptrace::PhaseId id = prof.phase_id("forward");
  {
    auto step = prof.step();
    for (auto _ : state) {
      auto phase = step.phase(id);
      benchmark::DoNotOptimize(phase);
    }
  }
  prof.close();
}
BENCHMARK(BM_PhaseById);

// ---- (c) one phase by name ----
void BM_PhaseByName(benchmark::State& state, const char* name_cstr) {
  steptrace::Profiler prof(make_config("phase_by_name"));
  const std::string_view name(name_cstr);
  {
    auto step = prof.step();
    for (auto _ : state) {
      benchmark::DoNotOptimize(name.data());
      auto phase = step.phase(name);
      benchmark::DoNotOptimize(phase);
    }
  }
  prof.close();
}
BENCHMARK_CAPTURE(BM_PhaseByName, forward, "forward");      // first interned name
BENCHMARK_CAPTURE(BM_PhaseByName, optimizer, "optimizer");  // fifth interned name

// ---- (d) a whole step with the five phases ----
// Args: {by_name, sample_rss}
void BM_Step5Phases(benchmark::State& state) {
  const bool by_name = state.range(0) != 0;
  const bool rss = state.range(1) != 0;
  steptrace::Profiler prof(make_config("step5", rss));
  std::array<steptrace::PhaseId, 5> ids{};
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = prof.phase_id(kPhaseNames[i]);
  int since_flush = 0;
  for (auto _ : state) {
    {
      auto step = prof.step();
      if (by_name) {
        {
          auto p = step.phase(kPhaseNames[0]);
          benchmark::DoNotOptimize(p);
        }
        {
          auto p = step.phase(kPhaseNames[1]);
          benchmark::DoNotOptimize(p);
        }
        {
          auto p = step.phase(kPhaseNames[2]);
          benchmark::DoNotOptimize(p);
        }
        {
          auto p = step.phase(kPhaseNames[3]);
          benchmark::DoNotOptimize(p);
        }
        {
          auto p = step.phase(kPhaseNames[4]);
          benchmark::DoNotOptimize(p);
        }
      } else {
        {
          auto p = step.phase(ids[0]);
          benchmark::DoNotOptimize(p);
        }
        {
          auto p = step.phase(ids[1]);
          benchmark::DoNotOptimize(p);
        }
        {
          auto p = step.phase(ids[2]);
          benchmark::DoNotOptimize(p);
        }
        {
          auto p = step.phase(ids[3]);
          benchmark::DoNotOptimize(p);
        }
        {
          auto p = step.phase(ids[4]);
          benchmark::DoNotOptimize(p);
        }
      }
    }
    drain_now_and_then(prof, state, since_flush);
  }
  prof.close();
  state.counters["writer_waits"] = static_cast<double>(writer_waits(prof.log_path()));
}
BENCHMARK(BM_Step5Phases)->ArgNames({"by_name", "rss"})->Args({0, 0})->Args({0, 1})->Args({1, 1});

// ---- (g) the CUDA-event path's bookkeeping, on the fake device ----
// A step with five phases recorded as device events (12 per step) on a device that
// completes everything at once: the profiler's cost on the device path without the
// driver's (cuEventRecord, measured on a GPU by tests/gpu/).
void BM_Step5PhasesFakeDevice(benchmark::State& state) {
  steptrace::Backends backends;
  auto device = std::make_unique<steptrace::fake::FakeDeviceTimer>();
  device->complete_all(/*from_now_on=*/true);
  backends.device_timer = std::move(device);
  steptrace::Profiler prof(make_config("step5_fake_device", false), {}, std::move(backends));
  prof.set_stream(1);
  time_5_phase_steps(prof, state);
}
BENCHMARK(BM_Step5PhasesFakeDevice);

// ---- (h) kernel activity and counters on, training thread ----
void BM_Step5PhasesFakeActivity(benchmark::State& state) {
  steptrace::Backends backends;
  auto activity = std::make_unique<steptrace::fake::FakeKernelActivity>();
  auto sampler = std::make_unique<steptrace::fake::FakeCounterSampler>();
  activity->delivery.auto_deliver = true;
  sampler->delivery.auto_deliver = true;
  backends.kernel_activity = std::move(activity);
  backends.counter_sampler = std::move(sampler);
  steptrace::Config config = make_config("step5_fake_activity", false);
  config.counter_every = 1;
  steptrace::Profiler prof(config, {}, std::move(backends));
  time_5_phase_steps(prof, state);
}
BENCHMARK(BM_Step5PhasesFakeActivity);

// ---- (i) per-step kernel figures on the writer thread ----
std::vector<steptrace::KernelRecord> kernels_of_a_step(std::int64_t n) {
  std::vector<steptrace::KernelRecord> ks;
  for (std::int64_t i = 0; i < n; ++i) {
    steptrace::KernelRecord k;
    k.step = 0;
    k.start_ns = i * 1000 + (i % 3) * 200;  // some overlap, some gaps
    k.end_ns = k.start_ns + 900;
    k.work = i % 5 == 0
                 ? steptrace::KernelWork::kCommunication
                 : (i % 2 == 0 ? steptrace::KernelWork::kMatmul : steptrace::KernelWork::kCompute);
    ks.push_back(k);
  }
  std::reverse(ks.begin(), ks.end());  // delivered out of order
  return ks;
}

void BM_KernelStats(benchmark::State& state) {
  const auto base = kernels_of_a_step(state.range(0));
  for (auto _ : state) {
    state.PauseTiming();
    auto ks = base;
    state.ResumeTiming();
    auto stats = steptrace::detail::kernel_stats(ks, 0);
    benchmark::DoNotOptimize(stats);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_KernelStats)->Arg(16)->Arg(256)->Arg(4096);

void BM_KernelDurationSum(benchmark::State& state) {
  const auto ks = kernels_of_a_step(state.range(0));
  for (auto _ : state) {
    std::int64_t total = 0;
    for (const auto& k : ks) total += k.end_ns - k.start_ns;
    benchmark::DoNotOptimize(total);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_KernelDurationSum)->Arg(16)->Arg(256)->Arg(4096);

// ---- (j) counter samples joined to a step on the writer thread ----
void BM_CounterAlignment(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  steptrace::Config config;
  steptrace::fake::FakeCounterSampler sampler;
  steptrace::detail::DeviceActivityStage stage(config, nullptr, &sampler);
  std::int64_t step = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const std::int64_t t0 = step * n * 1000;
    for (std::int64_t i = 0; i < n; ++i) {
      sampler.add_sample(t0 + i * 1000, t0 + (i + 1) * 1000, {40, 60, 70, 50});
    }
    sampler.delivery.deliver();
    steptrace::detail::StepRecord r;
    r.step = step++;
    r.counters_sampled = true;
    r.sampler_begin_ns = t0;
    r.sampler_end_ns = t0 + n * 1000;
    state.ResumeTiming();
    stage.complete(r, /*force=*/true);
    benchmark::DoNotOptimize(r.counters);
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_CounterAlignment)->Arg(10)->Arg(100)->Arg(1000);

void BM_AggregateSamples(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  std::vector<steptrace::detail::PmSample> samples;
  for (std::int64_t i = 0; i < n; ++i)
    samples.push_back({i * 1000, (i + 1) * 1000, {40, 60, 70, 50}});
  const std::vector<steptrace::detail::StepWindow> window = {{0, 0, n * 1000}};
  for (auto _ : state) {
    auto r = steptrace::detail::aggregate_samples(samples, window, steptrace::kCounterCount);
    benchmark::DoNotOptimize(r);
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_AggregateSamples)->Arg(10)->Arg(100)->Arg(1000);

// ---- (k) the run-queue wait reading (issue 24: at most 0.5 us per step) ----
void BM_RunQueueRead(benchmark::State& state) {
  steptrace::detail::RunQueueReader reader;
  std::int64_t wait = reader.read().wait_ns;  // the first call opens the file (once per profiler)
  if (wait < 0) {
    state.SkipWithError("no /proc/thread-self/schedstat here");
    return;
  }
  for (auto _ : state) {
    wait = reader.read().wait_ns;
    benchmark::DoNotOptimize(wait);
  }
}
BENCHMARK(BM_RunQueueRead);

void BM_RunQueueOpenRead(benchmark::State& state) {
  char buf[96];
  for (auto _ : state) {
    const int fd = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    const ssize_t n = fd >= 0 ? ::read(fd, buf, sizeof buf) : -1;
    if (fd >= 0) ::close(fd);
    auto wait =
        n > 0 ? steptrace::detail::parse_schedstat(buf, static_cast<std::size_t>(n)).wait_ns : -1;
    benchmark::DoNotOptimize(wait);
  }
}
BENCHMARK(BM_RunQueueOpenRead);

// The steal sample: /proc/stat on the watchdog thread every 10 ms (never the training thread).
void BM_StealSample(benchmark::State& state) {
  steptrace::detail::StealReader reader;
  if (!reader.available()) {
    state.SkipWithError("no steal clock here (bare metal): nothing is sampled");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(reader.sample());
}
BENCHMARK(BM_StealSample);

void BM_Step5PhasesRunQueueEveryStep(benchmark::State& state) {
  steptrace::Profiler prof(make_config("step5_runq", /*sample_rss=*/false));
  steptrace::detail::RunQueueReader reader;
  reader.read();
  time_5_phase_steps(prof, state, [&reader] {
    auto wait = reader.read();
    benchmark::DoNotOptimize(wait);
  });
}
BENCHMARK(BM_Step5PhasesRunQueueEveryStep);

// The reading as the profiler meets it: at a step's end, 10 ms or more after the last
// one, after user-space work (a busy wait here, no system call) that left the kernel's
// paths cold. Each iteration busy-waits 10 ms, then times one call (manual time); the
// counter p50_ns is the median of those calls (the mean is hostage to preemptions).
//   getppid            the cheapest system call: what entering the kernel cold costs
//   runq_read          RunQueueReader::read() (RSS and heap sampling off)
//   statm_read         the RSS reading (/proc/self/statm, pread), also every 10 ms
//   runq_after_statm   RunQueueReader::read() right after a statm read, as with the
//                      default options (RSS sampled): the reading's marginal cost there
enum class AfterUserWork { kGetppid, kRunQueue, kStatm, kRunQueueAfterStatm };

void BM_AfterUserWork(benchmark::State& state, AfterUserWork what) {
  steptrace::detail::RunQueueReader reader;
  reader.read();
  const int statm = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  char buf[128];
  std::vector<double> ns;
  for (auto _ : state) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
    while (std::chrono::steady_clock::now() < until) {
    }
    std::int64_t v = 0;
    if (what == AfterUserWork::kRunQueueAfterStatm) v += ::pread(statm, buf, sizeof buf, 0);
    const auto t0 = std::chrono::steady_clock::now();
    switch (what) {
      case AfterUserWork::kGetppid:
        v += ::getppid();
        break;
      case AfterUserWork::kStatm:
        v += ::pread(statm, buf, sizeof buf, 0);
        break;
      default:
        v += reader.read().wait_ns;
        break;
    }
    const auto t1 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(v);
    const double elapsed = std::chrono::duration<double>(t1 - t0).count();
    state.SetIterationTime(elapsed);
    ns.push_back(elapsed * 1e9);
  }
  if (statm >= 0) ::close(statm);
  std::nth_element(ns.begin(), ns.begin() + static_cast<std::ptrdiff_t>(ns.size() / 2), ns.end());
  state.counters["p50_ns"] = ns.empty() ? 0.0 : ns[ns.size() / 2];
}
BENCHMARK_CAPTURE(BM_AfterUserWork, getppid, AfterUserWork::kGetppid)
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_AfterUserWork, runq_read, AfterUserWork::kRunQueue)
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_AfterUserWork, statm_read, AfterUserWork::kStatm)
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_AfterUserWork, runq_after_statm, AfterUserWork::kRunQueueAfterStatm)
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);

// ---- (f) writer throughput ----
// Args: {steps per run, phases per step, flush_interval_ms}. RSS sampling is off (its cost is
// the training thread's, measured by BM_Step5Phases). flush_interval_ms=100 is the default a
// user gets; flush_interval_ms=1 makes the writer wake every millisecond, which shows what
// its serialization alone sustains.
void BM_WriterThroughput(benchmark::State& state) {
  const std::int64_t steps = state.range(0);
  const int phases = static_cast<int>(state.range(1));
  const int flush_ms = static_cast<int>(state.range(2));
  std::int64_t waits = 0;
  std::int64_t bytes = 0;
  for (auto _ : state) {
    steptrace::Config config = make_config("writer", /*sample_rss=*/false);
    config.flush_interval_ms = flush_ms;
    steptrace::Profiler prof(config);  // untimed: manual time below
    std::array<steptrace::PhaseId, 5> ids{};
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = prof.phase_id(kPhaseNames[i]);
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t s = 0; s < steps; ++s) {
      auto step = prof.step();
      for (int p = 0; p < phases; ++p) {
        auto scope = step.phase(ids[static_cast<std::size_t>(p)]);
        benchmark::DoNotOptimize(scope);
      }
    }
    prof.close();  // drains the ring, writes run_end, fsyncs
    const auto t1 = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    waits += writer_waits(prof.log_path());
    bytes += static_cast<std::int64_t>(fs::file_size(prof.log_path()));
  }
  state.SetItemsProcessed(state.iterations() * steps);
  state.SetBytesProcessed(bytes);
  state.counters["writer_waits_per_run"] =
      benchmark::Counter(static_cast<double>(waits) / static_cast<double>(state.iterations()));
}
BENCHMARK(BM_WriterThroughput)
    ->ArgNames({"steps", "phases", "flush_ms"})
    ->Args({100000, 0, 100})
    ->Args({100000, 5, 100})
    ->Args({100000, 0, 1})
    ->Args({100000, 5, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// ---- (g) the step that finds the ring full ----
// Fills the ring (queue_capacity steps, back to back, right after the profiler starts, so
// the writer is asleep in its flush interval) and times the one step after: how long the
// training thread waits for a slot. Arg: flush_interval_ms. If the writer were woken as
// soon as the ring is full this would be the time to serialize a few records (us); a
// figure close to flush_interval_ms means the training thread waited out the interval.
void BM_RingFullStall(benchmark::State& state) {
  const int flush_ms = static_cast<int>(state.range(0));
  for (auto _ : state) {
    steptrace::Config config = make_config("ring_full", /*sample_rss=*/false);
    config.flush_interval_ms = flush_ms;
    steptrace::Profiler prof(config);
    for (int s = 0; s < config.queue_capacity; ++s) {
      auto step = prof.step();
    }
    const auto t0 = std::chrono::steady_clock::now();
    { auto step = prof.step(); }
    const auto t1 = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    state.PauseTiming();
    prof.close();
    state.ResumeTiming();
  }
}
BENCHMARK(BM_RingFullStall)
    ->ArgNames({"flush_ms"})
    ->Arg(20)
    ->Arg(100)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// ---- summary ----

// Console output as usual, plus the per-iteration real time of each run, for the summary.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  explicit SummaryReporter(OutputOptions options) : ConsoleReporter(options) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) continue;
      const bool aggregate = run.run_type == Run::RT_Aggregate;
      if (aggregate && run.aggregate_name != "median") continue;
      const std::string name = run.run_name.str();
      if (!aggregate && medians_.count(name) != 0) continue;  // a median wins over a repetition
      const double ns =
          run.GetAdjustedRealTime() * (1e9 / benchmark::GetTimeUnitMultiplier(run.time_unit));
      if (aggregate) {
        medians_[name] = ns;
        ns_[name] = ns;
      } else if (ns_.count(name) == 0) {
        ns_[name] = ns;
      }
      if (run.counters.count("items_per_second") != 0) {
        items_per_s_[name] = run.counters.at("items_per_second").value;
      }
      if (run.counters.count("p50_ns") != 0) p50_ns_[name] = run.counters.at("p50_ns").value;
    }
  }

  void PrintSummary() const {
    auto get = [&](const std::string& n) {
      const auto it = ns_.find(n);
      return it == ns_.end() ? -1.0 : it->second;
    };
    const double empty = get("BM_EmptyLoop");
    const double clock_pair = get("BM_SteadyClockPair");
    std::printf("\n== steptrace C++ summary (real time per op, empty loop %.2f ns subtracted) ==\n",
                empty < 0 ? 0.0 : empty);
    auto net = [&](double v) { return v < 0 ? v : v - (empty < 0 ? 0.0 : empty); };
    const double clock_net = net(clock_pair);
    if (clock_pair >= 0)
      std::printf("  %-44s %9.1f ns\n", "steady_clock::now() x2 (alternative)", clock_net);
    struct Row {
      const char* label;
      const char* name;
      double per;  // ops per iteration (5 phases per step)
    };
    const Row rows[] = {
        {"phase by id", "BM_PhaseById", 1},
        {"phase by name (forward)", "BM_PhaseByName/forward", 1},
        {"phase by name (optimizer)", "BM_PhaseByName/optimizer", 1},
        {"step + 5 phases, by id, rss off", "BM_Step5Phases/by_name:0/rss:0", 1},
        {"step + 5 phases, by id, rss on", "BM_Step5Phases/by_name:0/rss:1", 1},
        {"step + 5 phases, by name, rss on (default)", "BM_Step5Phases/by_name:1/rss:1", 1},
        {"step + 5 phases on the fake device (events)", "BM_Step5PhasesFakeDevice", 1},
        {"step + 5 phases, kernel activity + counters", "BM_Step5PhasesFakeActivity", 1},
    };
    bool all_pass = true;
    for (const Row& row : rows) {
      const double v = net(get(row.name));
      if (v < 0) continue;
      const bool is_phase = std::strncmp(row.name, "BM_Phase", 8) == 0;
      std::printf("  %-44s %9.1f ns  %6.1fx the clock pair", row.label, v,
                  clock_net > 0 ? v / clock_net : 0.0);
      if (is_phase) {
        const bool pass = v < 1000.0;
        all_pass = all_pass && pass;
        std::printf("  budget <1 us/phase: %s", pass ? "PASS" : "FAIL");
      } else {
        std::printf("  (%.1f ns per phase boundary pair incl. step share)", v / 5.0);
      }
      std::printf("\n");
    }
    for (const auto& [name, ips] : items_per_s_) {
      if (name.rfind("BM_WriterThroughput", 0) == 0) {
        std::printf("  writer throughput %-26s %9.3g records/s\n",
                    name.substr(std::strlen("BM_WriterThroughput")).c_str(), ips);
      }
    }
    for (const auto& [name, ns] : ns_) {
      if (name.rfind("BM_RingFullStall", 0) == 0) {
        std::printf("  step that finds the ring full %-20s %9.2f ms waited\n",
                    name.substr(std::strlen("BM_RingFullStall")).c_str(), ns / 1e6);
      }
    }
    const double plain = net(get("BM_Step5Phases/by_name:0/rss:0"));
    const double with_activity = net(get("BM_Step5PhasesFakeActivity"));
    if (plain > 0 && with_activity > 0) {
      std::printf(
          "  kernel activity + counters add %.1f ns per step on the training thread "
          "(fake backends; %.2fx the plain step)\n",
          with_activity - plain, with_activity / plain);
    }
    for (const char* n : {"16", "256", "4096"}) {
      const double ours = get(std::string("BM_KernelStats/") + n);
      const double sum = get(std::string("BM_KernelDurationSum/") + n);
      if (ours > 0 && sum > 0) {
        std::printf(
            "  per-step kernel figures, %4s kernels: %7.1f ns per kernel (%.1fx a plain "
            "duration sum)\n",
            n, ours / std::stod(n), ours / sum);
      }
    }
    for (const char* n : {"10", "100", "1000"}) {
      const double ours = get(std::string("BM_CounterAlignment/") + n);
      const double agg = get(std::string("BM_AggregateSamples/") + n);
      if (ours > 0 && agg > 0) {
        std::printf(
            "  counter samples joined to a step, %4s samples: %7.1f ns per sample "
            "(%.1fx the averaging alone)\n",
            n, ours / std::stod(n), ours / agg);
      }
    }
    const double runq = net(get("BM_RunQueueRead"));
    if (runq > 0) {
      const double open_read = net(get("BM_RunQueueOpenRead"));
      const double step_plain = net(get("BM_Step5Phases/by_name:0/rss:0"));
      const double step_runq = net(get("BM_Step5PhasesRunQueueEveryStep"));
      std::printf("  run-queue wait reading (pread, file kept open) %9.1f ns", runq);
      if (open_read > 0) std::printf("  (open + read + close each time: %.1f ns)", open_read);
      std::printf("\n");
      if (step_plain > 0 && step_runq > 0) {
        std::printf(
            "  step + 5 phases with a reading after every step: %.1f ns vs %.1f ns without "
            "(+%.1f ns)\n",
            step_runq, step_plain, step_runq - step_plain);
      }
      const auto p50 = [&](const char* n) {
        const std::string prefix = std::string("BM_AfterUserWork/") + n;  // then /iterations:...
        for (const auto& [name, v] : p50_ns_) {
          if (name == prefix || name.rfind(prefix + "/", 0) == 0) return v;
        }
        return -1.0;
      };
      if (p50("runq_read") > 0) {
        std::printf(
            "  after 10 ms of user-space work (median call): getppid %.0f ns, run-queue reading "
            "%.0f ns, statm (RSS) reading %.0f ns, run-queue reading right after statm %.0f ns\n",
            p50("getppid"), p50("runq_read"), p50("statm_read"), p50("runq_after_statm"));
      }
      // The profiler reads at a step's end when 10 ms have passed since the last reading: a
      // step of T ms pays the reading once every ceil(10 / T) steps.
      constexpr double kIntervalMs = 10.0;
      struct Cost {
        const char* label;
        double ns;
      };
      const Cost costs[] = {{"warm reading", runq},
                            {"cold, after statm (default options)", p50("runq_after_statm")},
                            {"cold, alone (rss off)", p50("runq_read")}};
      for (const Cost& c : costs) {
        if (c.ns <= 0) continue;
        std::printf("  amortized per step, %-36s", c.label);
        for (const double t_ms : {0.1, 0.5, 1.0, 5.0, 10.0}) {
          const double every = std::max(1.0, std::ceil(kIntervalMs / t_ms));
          std::printf("  %g ms: %.3f us", t_ms, c.ns / every / 1000.0);
        }
        const double at_half_ms = c.ns / std::ceil(kIntervalMs / 0.5) / 1000.0;
        std::printf("  | < 0.5 us on a 0.5 ms step: %s\n", at_half_ms < 0.5 ? "PASS" : "FAIL");
      }
      std::printf(
          "  (a step of T ms pays one reading every ceil(10 / T) steps; from %.1f ms (warm) a "
          "step pays more than 0.5 us, at most one reading per step of 10 ms or more: "
          "%.4f%% of it)\n",
          runq > 500.0 ? kIntervalMs * 500.0 / runq : kIntervalMs,
          runq / (kIntervalMs * 1e6) * 100.0);
    }
    std::printf("  C++ per-phase budget (< 1 us, host clock): %s\n", all_pass ? "PASS" : "FAIL");
  }

 private:
  std::map<std::string, double> ns_;
  std::map<std::string, double> medians_;
  std::map<std::string, double> items_per_s_;
  std::map<std::string, double> p50_ns_;  // BM_AfterUserWork: the median call
};

}  // namespace

int main(int argc, char** argv) {
  bool keep_logs = false;
  bool console = true;
  bool color = ::isatty(STDOUT_FILENO) != 0;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--keep_logs") == 0) {
      keep_logs = true;
      continue;
    }
    if (std::strncmp(argv[i], "--benchmark_format=", 19) == 0 &&
        std::strcmp(argv[i] + 19, "console") != 0) {
      console = false;
    }
    if (std::strncmp(argv[i], "--benchmark_color=", 18) == 0) {
      const std::string v(argv[i] + 18);
      color = v == "true" || v == "yes" || v == "1" || (v == "auto" && color);
    }
    args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  std::fprintf(stderr, "steptrace %s; logs in %s\n", steptrace::version(), bench_root().c_str());
  if (console) {
    SummaryReporter reporter(color ? benchmark::ConsoleReporter::OO_ColorTabular
                                   : benchmark::ConsoleReporter::OO_Tabular);
    benchmark::RunSpecifiedBenchmarks(&reporter);
    reporter.PrintSummary();
  } else {
    benchmark::RunSpecifiedBenchmarks();
  }
  benchmark::Shutdown();
  if (!keep_logs) {
    std::error_code ec;
    fs::remove_all(bench_root(), ec);
  }
  return 0;
}
