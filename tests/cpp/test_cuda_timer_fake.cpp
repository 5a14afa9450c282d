// The real CUDA event timer (make_cuda_timer: cuda::Driver, CudaTimer) against the
// stand-in libcuda.so.1 (tests/cpp/fake_cupti/fake_cuda.hpp), linked into this test under
// its soname so the driver loader finds it already in the process: the fake device's
// documented behaviour, events pending then ready with the queued work's time, the device
// timing success path (lagged resolution, the in-flight bound, folding past 64 intervals,
// close), and CUDA graph capture: no steptrace call breaks a capture on this thread or
// another, and a step whose stream is capturing is timed on the host.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "device_timing_fixture.hpp"
#include "fake_cupti/fake_cuda.hpp"
#include "fake_cupti/fake_profiler.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

extern "C" {
// The driver's event entry points, as the fake defines them (CUevent / CUstream as void*).
int cuEventCreate(void** event, unsigned int flags);
int cuEventDestroy(void* event);
int cuEventRecord(void* event, void* stream);
int cuEventQuery(void* event);
int cuEventSynchronize(void* event);
int cuEventElapsedTime(float* ms, void* start, void* end);
int cuCtxGetCurrent(void** ctx);
}

namespace steptrace {
namespace {

using testing::DeviceTimingRun;
using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;

constexpr int kSuccess = 0, kInvalidContext = 201, kInvalidHandle = 400, kNotReady = 600;
constexpr std::uintptr_t kStream = 0x5100;   // the training stream
constexpr std::uintptr_t kCapture = 0x5200;  // another thread's capture stream

int g_ctx = 0;
void* as_stream(std::uintptr_t s) { return reinterpret_cast<void*>(s); }

class CudaTimerFake : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_cuda_reset();
    fake_cuda_set_current(&g_ctx, 0);
  }
  void TearDown() override { fake_cuda_set_current(nullptr, 0); }

  static std::unique_ptr<DeviceTimer> timer() {
    std::string why;
    auto t = make_cuda_timer(&why);
    EXPECT_NE(t, nullptr) << why;
    return t;
  }
  // A profiler on the real CUDA timer, the device's part queued on `stream`; nothing else
  // of CUDA (the system's real libcupti must not meet the fake driver).
  // `work` queues the device's part (default: on `stream` in the current context); a
  // `device` goes with the stream (set_stream's).
  static std::unique_ptr<DeviceTimingRun> run(const TempDir& tmp, int max_inflight = 8,
                                              std::uintptr_t stream = kStream,
                                              std::function<void(double)> work = {},
                                              int device = -1) {
    if (!work) work = [stream](double ms) { fake_cuda_enqueue(stream, ms); };
    auto r = std::make_unique<DeviceTimingRun>(tmp, timer(), max_inflight, stream, std::move(work),
                                               [](Config& c) {
                                                 c.kernel_activity = "off";
                                                 c.counters = "off";
                                                 c.nvml = "off";
                                               });
    if (device >= 0) r->prof->set_stream(stream, device);
    return r;
  }
  static std::vector<nlohmann::json> close(std::unique_ptr<DeviceTimingRun>& r) {
    const std::string path = r->path;
    r.reset();  // closes, and the timer destroys its events
    return read_jsonl(path);
  }
  static void expect_no_fallback(const std::vector<nlohmann::json>& records) {
    for (const auto& a : of_kind(records, "alert")) EXPECT_NE(a["type"], "timer_fallback") << a;
  }
};

// A thread that begins a capture on `stream` in `mode`, holds it while the test runs
// steps, and ends it when told: what it returns says whether the capture survived.
class CaptureOnAnotherThread {
 public:
  CaptureOnAnotherThread(std::uintptr_t stream, int mode) {
    thread_ = std::thread([this, stream, mode] {
      const int began = cuStreamBeginCapture_v2(as_stream(stream), mode);
      std::unique_lock<std::mutex> lock(mu_);
      began_ = began;
      state_ = kCapturing;
      cv_.notify_all();
      cv_.wait(lock, [this] { return state_ == kEnding; });
      void* graph = nullptr;
      end_ = cuStreamEndCapture(as_stream(stream), &graph);
    });
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return state_ == kCapturing; });
  }
  ~CaptureOnAnotherThread() {
    if (thread_.joinable()) end();
  }
  int began() const { return began_; }
  /// Ends the capture; cuStreamEndCapture's result.
  int end() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      state_ = kEnding;
    }
    cv_.notify_all();
    thread_.join();
    return end_;
  }

 private:
  enum State { kStarting, kCapturing, kEnding };
  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = kStarting;
  int began_ = -1;
  int end_ = -1;
  std::thread thread_;
};

// ---- the fake device follows the driver API's documentation ----

TEST_F(CudaTimerFake, TheFakeDriverFollowsTheDocumentedEventRules) {
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(cuEventCreate(&a, 0), kSuccess);
  ASSERT_EQ(cuEventCreate(&b, 0), kSuccess);
  float ms = -1;
  EXPECT_EQ(cuEventQuery(a), kSuccess);                      // never recorded: an empty set of work
  EXPECT_EQ(cuEventElapsedTime(&ms, a, b), kInvalidHandle);  // never recorded
  fake_cuda_enqueue(kStream, 2);
  ASSERT_EQ(cuEventRecord(a, as_stream(kStream)), kSuccess);
  fake_cuda_enqueue(kStream, 3);
  ASSERT_EQ(cuEventRecord(b, as_stream(kStream)), kSuccess);
  fake_cuda_enqueue(kStream, 100);  // later work does not change the events
  EXPECT_EQ(cuEventQuery(a), kNotReady);
  EXPECT_EQ(cuEventElapsedTime(&ms, a, b), kNotReady);
  fake_cuda_advance(2);
  EXPECT_EQ(cuEventQuery(a), kSuccess);
  EXPECT_EQ(cuEventQuery(b), kNotReady);
  EXPECT_EQ(cuEventSynchronize(b), kSuccess);  // the host waits: the clock moves on
  EXPECT_DOUBLE_EQ(fake_cuda_now_ms(), 5.0);
  EXPECT_EQ(cuEventQuery(b), kSuccess);
  ASSERT_EQ(cuEventElapsedTime(&ms, a, b), kSuccess);
  EXPECT_FLOAT_EQ(ms, 3.0f);
  EXPECT_EQ(cuEventDestroy(a), kSuccess);
  EXPECT_EQ(cuEventDestroy(b), kSuccess);
  EXPECT_EQ(cuEventQuery(a), kInvalidHandle);
}

TEST_F(CudaTimerFake, TheFakeDriverHasPerThreadContexts) {
  int other = 0;
  std::thread([&] {
    void* ctx = nullptr;
    cuCtxGetCurrent(&ctx);
    EXPECT_EQ(ctx, &g_ctx);  // fake_cuda_set_current's, for threads that set none
    ASSERT_EQ(cuCtxSetCurrent(&other), kSuccess);
    cuCtxGetCurrent(&ctx);
    EXPECT_EQ(ctx, &other);
    ASSERT_EQ(cuCtxSetCurrent(nullptr), kSuccess);
    void* e = nullptr;
    EXPECT_EQ(cuEventCreate(&e, 0), kInvalidContext);  // "for the current context"
  }).join();
  void* ctx = nullptr;
  cuCtxGetCurrent(&ctx);
  EXPECT_EQ(ctx, &g_ctx);  // this thread's is unchanged
}

TEST_F(CudaTimerFake, TheFakeDriverModelsCaptureHazards) {
  void* e = nullptr;
  ASSERT_EQ(cuEventCreate(&e, 0), kSuccess);
  ASSERT_EQ(cuEventRecord(e, as_stream(kStream)), kSuccess);
  {  // a query from a thread in the default (global) mode breaks a global capture
    CaptureOnAnotherThread capture(kCapture, fake_cuda::kCaptureModeGlobal);
    ASSERT_EQ(capture.began(), kSuccess);
    int status = -1;
    ASSERT_EQ(cuStreamIsCapturing(as_stream(kCapture), &status), kSuccess);
    EXPECT_EQ(status, 1);  // ACTIVE
    EXPECT_NE(cuEventQuery(e), kSuccess);
    EXPECT_EQ(capture.end(), fake_cuda::kStreamCaptureInvalidated);
  }
  {  // ... but not a thread-local one, nor from a thread in relaxed mode
    CaptureOnAnotherThread capture(kCapture, fake_cuda::kCaptureModeThreadLocal);
    EXPECT_EQ(cuEventQuery(e), kSuccess);
    EXPECT_EQ(capture.end(), kSuccess);
  }
  {
    CaptureOnAnotherThread capture(kCapture, fake_cuda::kCaptureModeGlobal);
    int mode = fake_cuda::kCaptureModeRelaxed;
    ASSERT_EQ(cuThreadExchangeStreamCaptureMode(&mode), kSuccess);
    EXPECT_EQ(mode, fake_cuda::kCaptureModeGlobal);  // the previous mode comes back
    EXPECT_EQ(cuEventQuery(e), kSuccess);
    EXPECT_EQ(cuEventSynchronize(e), kSuccess);
    cuThreadExchangeStreamCaptureMode(&mode);
    EXPECT_EQ(capture.end(), kSuccess);
  }
  EXPECT_EQ(fake_cuda_invalidated_captures(), 1);
  // An event recorded on a capturing stream is captured: later queries fail.
  ASSERT_EQ(cuStreamBeginCapture_v2(as_stream(kStream), fake_cuda::kCaptureModeGlobal), kSuccess);
  ASSERT_EQ(cuEventRecord(e, as_stream(kStream)), kSuccess);
  void* graph = nullptr;
  ASSERT_EQ(cuStreamEndCapture(as_stream(kStream), &graph), kSuccess);
  EXPECT_NE(graph, nullptr);
  EXPECT_EQ(cuEventQuery(e), fake_cuda::kCapturedEvent);
  EXPECT_EQ(cuEventSynchronize(e), fake_cuda::kCapturedEvent);
  EXPECT_EQ(cuEventDestroy(e), kSuccess);
}

// ---- CudaTimer's success path ----

TEST_F(CudaTimerFake, EventsArePendingThenReadyAndTimeTheQueuedWork) {
  auto t = timer();
  ASSERT_NE(t, nullptr);
  EXPECT_STREQ(t->name(), "cuda");
  EXPECT_EQ(t->device_name(), "Fake H200");
  fake_cuda_enqueue(kStream, 1);
  const int a = t->record({kStream});
  fake_cuda_enqueue(kStream, 3);
  const int b = t->record({kStream});
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  EXPECT_EQ(t->live_events(), 2);
  EXPECT_EQ(t->query(a), DeviceTimer::Status::kPending);
  float ms = 0;
  EXPECT_FALSE(t->elapsed_ms(a, b, &ms));
  EXPECT_NE(t->last_error().find("CUDA_ERROR_NOT_READY"), std::string::npos) << t->last_error();
  fake_cuda_advance(1);
  EXPECT_EQ(t->query(a), DeviceTimer::Status::kReady);
  EXPECT_EQ(t->query(b), DeviceTimer::Status::kPending);
  fake_cuda_advance(3);
  EXPECT_EQ(t->query(b), DeviceTimer::Status::kReady);
  ASSERT_TRUE(t->elapsed_ms(a, b, &ms));
  EXPECT_FLOAT_EQ(ms, 3.0f);
  t->release(a);
  t->release(b);
  EXPECT_EQ(t->live_events(), 0);
  const int c = t->record({kStream});  // from the pool
  fake_cuda_enqueue(kStream, 7);
  const int d = t->record({kStream});
  EXPECT_EQ(fake_cuda_live_events(), 2);
  EXPECT_TRUE(t->synchronize(d));
  ASSERT_TRUE(t->elapsed_ms(c, d, &ms));
  EXPECT_FLOAT_EQ(ms, 7.0f);
  t.reset();
  EXPECT_EQ(fake_cuda_live_events(), 0);
}

TEST_F(CudaTimerFake, StepsAreWrittenAStepOrTwoLaterWithDeviceTimes) {
  TempDir tmp;
  auto r = run(tmp);
  r->step();
  EXPECT_EQ(r->prof->steps_in_flight(), 1u);
  EXPECT_TRUE(r->steps_written().empty());  // the device is 8 ms behind
  r->step();                                // still behind: polls, writes nothing
  EXPECT_TRUE(r->steps_written().empty());
  fake_cuda_advance(8);  // the device finishes step 0
  r->step();
  auto steps = r->steps_written();
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["clock"], "cuda");
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["forward"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["backward"].get<double>(), 5.0);
  EXPECT_DOUBLE_EQ(steps[0]["step_ms"].get<double>(), 8.0);
  EXPECT_DOUBLE_EQ(steps[0]["host_ms"].get<double>(), 2.0);
  EXPECT_FALSE(steps[0].contains("waited"));
  EXPECT_EQ(fake_cuda_event_syncs(), 0);  // nobody waited for the device
  fake_cuda_advance(100);
  r->step();
  EXPECT_EQ(r->steps_written().size(), 3u);
  const auto records = close(r);
  steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 4u);
  for (const auto& s : steps) {
    EXPECT_EQ(s["clock"], "cuda") << s;
    EXPECT_DOUBLE_EQ(s["step_ms"].get<double>(), 8.0) << s;
  }
  expect_no_fallback(records);
  EXPECT_EQ(fake_cuda_live_events(), 0);
  EXPECT_EQ(records.front()["device"]["name"], "Fake H200");
}

TEST_F(CudaTimerFake, AtTheInFlightBoundTheProfilerWaitsForTheDevice) {
  TempDir tmp;
  auto r = run(tmp, /*max_inflight=*/2);
  r->step();
  r->step();
  EXPECT_EQ(fake_cuda_event_syncs(), 0);
  r->step();  // the oldest step must be waited for
  EXPECT_GT(fake_cuda_event_syncs(), 0);
  EXPECT_GE(fake_cuda_now_ms(), 8.0);  // the host waited until the device got there
  const auto steps = r->steps_written();
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["waited"], true);
  EXPECT_DOUBLE_EQ(steps[0]["step_ms"].get<double>(), 8.0);
  const auto records = close(r);
  EXPECT_EQ(of_kind(records, "step").size(), 3u);
  expect_no_fallback(records);
}

// Gradient accumulation: 50 micro-batches of forward + backward, 100 intervals in one step.
TEST_F(CudaTimerFake, ManyPhaseIntervalsFoldOnTheDeviceClock) {
  TempDir tmp;
  auto r = run(tmp, 4);
  {  // the device keeps up: completed intervals are folded, nobody waits
    auto s = r->prof->step();
    for (int micro = 0; micro < 50; ++micro) {
      r->phase(s, "forward", 1, 3);
      fake_cuda_advance(3);
      r->phase(s, "backward", 1, 5);
      fake_cuda_advance(5);
    }
  }
  EXPECT_EQ(fake_cuda_event_syncs(), 0);
  {  // the device is far behind: making room means waiting for the oldest interval
    auto s = r->prof->step();
    for (int micro = 0; micro < 50; ++micro) {
      r->phase(s, "forward", 1, 3);
      r->phase(s, "backward", 1, 5);
    }
  }
  EXPECT_GT(fake_cuda_event_syncs(), 0);
  const auto records = close(r);
  expect_no_fallback(records);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  for (const auto& s : steps) {
    EXPECT_EQ(s["clock"], "cuda");
    EXPECT_NEAR(s["phases_ms"]["forward"].get<double>(), 150.0, 1e-3);  // 50 x 3 ms
    EXPECT_NEAR(s["phases_ms"]["backward"].get<double>(), 250.0, 1e-3);
    EXPECT_NEAR(s["step_ms"].get<double>(), 400.0, 1e-3);
    EXPECT_DOUBLE_EQ(s["host_phases_ms"]["forward"].get<double>(), 50.0);
  }
  EXPECT_FALSE(steps[0].contains("waited"));
  EXPECT_EQ(steps[1]["waited"], true);
  EXPECT_EQ(fake_cuda_live_events(), 0);
}

// ---- CUDA graph capture ----

// Another thread captures in global mode (torch.cuda.graph's default) while the training
// thread's steps poll, fold and wait on their events: none of it may break the capture.
TEST_F(CudaTimerFake, PollingAndWaitingDoNotBreakAGlobalCaptureOnAnotherThread) {
  TempDir tmp;
  auto r = run(tmp, /*max_inflight=*/2);
  r->step();  // in flight when the capture begins
  CaptureOnAnotherThread capture(kCapture, fake_cuda::kCaptureModeGlobal);
  ASSERT_EQ(capture.began(), kSuccess);
  r->step();  // polls step 0 (not ready)
  r->step();  // the bound: waits for step 0
  fake_cuda_advance(50);
  {
    auto s = r->prof->step();  // polls, and folds past 64 intervals
    for (int k = 0; k < 70; ++k) r->phase(s, "forward", 1, 1);
  }
  EXPECT_GT(fake_cuda_unsafe_calls_during_capture(), 0);  // queries ran during the capture
  EXPECT_EQ(capture.end(), kSuccess);
  EXPECT_EQ(fake_cuda_invalidated_captures(), 0);
  const auto records = close(r);
  expect_no_fallback(records);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 4u);
  for (const auto& s : steps) EXPECT_EQ(s["clock"], "cuda") << s;
}

// The whole-network capture example under `steptrace run`: a step begins inside a capture
// on the training thread's own (current) stream. Nothing is recorded on the capturing
// stream, the earlier steps are still polled without breaking the capture, and the
// captured step is timed on the host; the run stays on the CUDA clock.
TEST_F(CudaTimerFake, AStepInsideACaptureOnItsStreamIsTimedOnTheHost) {
  TempDir tmp;
  auto r = run(tmp);
  r->step();  // in flight: polled during the capture
  ASSERT_EQ(cuStreamBeginCapture_v2(as_stream(kStream), fake_cuda::kCaptureModeGlobal), kSuccess);
  r->step();  // captured (its device work is captured, not run)
  void* graph = nullptr;
  EXPECT_EQ(cuStreamEndCapture(as_stream(kStream), &graph), kSuccess);
  EXPECT_EQ(fake_cuda_invalidated_captures(), 0);
  // A step that replays the graph is timed around the replay like any other.
  r->step();
  fake_cuda_advance(100);
  const auto records = close(r);
  expect_no_fallback(records);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0]["clock"], "cuda");
  EXPECT_EQ(steps[1]["clock"], "host");
  EXPECT_EQ(steps[1]["captured"], true);
  EXPECT_FALSE(steps[0].contains("captured"));
  EXPECT_DOUBLE_EQ(steps[1]["phases_ms"]["forward"].get<double>(), 1.0);
  EXPECT_EQ(steps[2]["clock"], "cuda");
  EXPECT_DOUBLE_EQ(steps[2]["step_ms"].get<double>(), 8.0);
  EXPECT_EQ(fake_cuda_live_events(), 0);
}

// A capture that begins mid-step on the step's stream: the events of the step so far are
// returned, the rest of the step records nothing, and the step is timed on the host.
TEST_F(CudaTimerFake, ACaptureBeginningMidStepMakesItAHostStep) {
  TempDir tmp;
  auto r = run(tmp);
  {
    auto s = r->prof->step();
    r->phase(s, "forward", 1, 3);
    ASSERT_EQ(cuStreamBeginCapture_v2(as_stream(kStream), fake_cuda::kCaptureModeGlobal), kSuccess);
    r->phase(s, "backward", 1, 5);
  }
  void* graph = nullptr;
  EXPECT_EQ(cuStreamEndCapture(as_stream(kStream), &graph), kSuccess);
  r->step();
  fake_cuda_advance(100);
  const auto records = close(r);
  expect_no_fallback(records);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0]["clock"], "host");
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["backward"].get<double>(), 1.0);
  EXPECT_EQ(steps[1]["clock"], "cuda");
  EXPECT_EQ(fake_cuda_invalidated_captures(), 0);
  EXPECT_EQ(fake_cuda_live_events(), 0);
}

// Steps on the legacy stream (0) while another thread captures on a blocking stream: the
// legacy stream is unusable then (an event on it would break the capture), so that step is
// timed on the host.
TEST_F(CudaTimerFake, TheLegacyStreamIsLeftAloneWhileAnyStreamCaptures) {
  TempDir tmp;
  auto r = run(tmp, 8, /*stream=*/0);
  r->step();
  {
    CaptureOnAnotherThread capture(kCapture, fake_cuda::kCaptureModeGlobal);
    r->step();
    EXPECT_EQ(capture.end(), kSuccess);
  }
  r->step();
  fake_cuda_advance(100);
  EXPECT_EQ(fake_cuda_invalidated_captures(), 0);
  const auto records = close(r);
  expect_no_fallback(records);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0]["clock"], "cuda");
  EXPECT_EQ(steps[1]["clock"], "host");
  EXPECT_EQ(steps[2]["clock"], "cuda");
}

// The fake driver's legacy stream and a non-blocking stream's capture, as documented: the
// legacy stream waits on blocking streams only ("synchronizes with all other streams in
// the same CUcontext except for non-blocking streams", Driver API 3. Stream
// synchronization behavior), so a capture on a non-blocking stream leaves it usable:
// cuStreamIsCapturing on it says NONE (the IMPLICIT error is "while a blocking stream ...
// is capturing"), an event recorded on it succeeds and breaks nothing; a blocking
// stream's capture makes it unusable.
TEST_F(CudaTimerFake, TheFakeDriverLetsTheLegacyStreamRunBesideANonBlockingCapture) {
  void* side = nullptr;
  ASSERT_EQ(cuStreamCreate(&side, fake_cuda::kStreamNonBlocking), kSuccess);
  void* e = nullptr;
  ASSERT_EQ(cuEventCreate(&e, 0), kSuccess);
  ASSERT_EQ(cuStreamBeginCapture_v2(side, fake_cuda::kCaptureModeGlobal), kSuccess);
  int status = -1;
  ASSERT_EQ(cuStreamIsCapturing(nullptr, &status), kSuccess);
  EXPECT_EQ(status, 0);  // NONE
  ASSERT_EQ(cuStreamIsCapturing(side, &status), kSuccess);
  EXPECT_EQ(status, 1);                                           // ACTIVE
  fake_cuda_enqueue(reinterpret_cast<std::uintptr_t>(side), 50);  // captured, not run
  EXPECT_EQ(cuEventRecord(e, nullptr), kSuccess);
  void* graph = nullptr;
  EXPECT_EQ(cuStreamEndCapture(side, &graph), kSuccess);
  EXPECT_NE(graph, nullptr);
  EXPECT_EQ(cuEventQuery(e), kSuccess);  // the legacy stream did not wait for the capture
  // the same with a blocking stream: the legacy stream is unusable while it captures
  void* blocking = nullptr;
  ASSERT_EQ(cuStreamCreate(&blocking, 0), kSuccess);
  ASSERT_EQ(cuStreamBeginCapture_v2(blocking, fake_cuda::kCaptureModeGlobal), kSuccess);
  EXPECT_EQ(cuStreamIsCapturing(nullptr, &status), 906);  // CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
  EXPECT_EQ(cuEventRecord(e, nullptr), 906);
  EXPECT_EQ(cuStreamEndCapture(blocking, &graph), fake_cuda::kStreamCaptureInvalidated);
  EXPECT_EQ(fake_cuda_invalidated_captures(), 1);
  EXPECT_EQ(cuEventDestroy(e), kSuccess);
}

// torch.cuda.graph inside a step that began on the default (legacy) stream: the capture
// runs on a non-blocking pool stream made current for it, so the step's own stream sees
// nothing and its events would time an idle stream. The framework's current stream, set
// during the step, is asked at the phase boundaries: the step is a captured (host-timed)
// step, and the capture is not broken.
TEST_F(CudaTimerFake, AStepOnTheDefaultStreamAroundACaptureOnAPoolStreamIsCaptured) {
  void* pool = nullptr;
  ASSERT_EQ(cuStreamCreate(&pool, fake_cuda::kStreamNonBlocking), kSuccess);
  const auto pool_stream = reinterpret_cast<std::uintptr_t>(pool);
  TempDir tmp;
  auto r = run(tmp, 8, /*stream=*/0);
  r->step();
  {
    auto s = r->prof->step();
    r->phase(s, "forward", 1, 3);  // eager warm-up work on the default stream
    // with torch.cuda.graph(g): the pool stream becomes current, then the capture begins
    r->prof->set_stream(pool_stream);
    ASSERT_EQ(cuStreamBeginCapture_v2(pool, fake_cuda::kCaptureModeGlobal), kSuccess);
    {
      auto p = s.phase("backward");
      r->clock->advance(testing::kMs);
      fake_cuda_enqueue(pool_stream, 5);  // captured into the graph, not run
    }
    void* graph = nullptr;
    EXPECT_EQ(cuStreamEndCapture(pool, &graph), kSuccess);
    r->prof->set_stream(0);  // the block's end restores the current stream
  }
  r->step();
  fake_cuda_advance(100);
  const auto records = close(r);
  expect_no_fallback(records);
  EXPECT_EQ(fake_cuda_invalidated_captures(), 0);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0]["clock"], "cuda");
  EXPECT_EQ(steps[1]["clock"], "host") << steps[1];
  EXPECT_EQ(steps[1]["captured"], true) << steps[1];
  EXPECT_DOUBLE_EQ(steps[1]["phases_ms"]["backward"].get<double>(), 1.0);
  EXPECT_EQ(steps[2]["clock"], "cuda");
  EXPECT_DOUBLE_EQ(steps[2]["step_ms"].get<double>(), 8.0);
  EXPECT_EQ(steps[2]["stream"]["id"], 0);
  const auto end = of_kind(records, "run_end").at(0);
  EXPECT_EQ(end["device_timing"]["captured_steps"], 1) << end;
  EXPECT_EQ(fake_cuda_live_events(), 0);
}

// A side stream made current during a step that does not capture (a prefetch on its own
// stream): the step stays on the device clock, on its own stream.
TEST_F(CudaTimerFake, ASideStreamThatDoesNotCaptureLeavesTheStepOnTheDevice) {
  void* side = nullptr;
  ASSERT_EQ(cuStreamCreate(&side, fake_cuda::kStreamNonBlocking), kSuccess);
  TempDir tmp;
  auto r = run(tmp, 8, /*stream=*/0);
  {
    auto s = r->prof->step();
    r->phase(s, "forward", 1, 3);
    r->prof->set_stream(reinterpret_cast<std::uintptr_t>(side));
    r->phase(s, "backward", 1, 5);  // still queued on the default stream by the fixture
    r->prof->set_stream(0);
  }
  fake_cuda_advance(100);
  const auto records = close(r);
  expect_no_fallback(records);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["clock"], "cuda") << steps[0];
  EXPECT_FALSE(steps[0].contains("captured"));
  EXPECT_DOUBLE_EQ(steps[0]["step_ms"].get<double>(), 8.0);
  EXPECT_EQ(fake_cuda_live_events(), 0);
}

// ---- contexts: events in the stream's context, one pool per context ----

// The device's part queued on the default stream of `ctx`, the way a framework's kernels
// reach it: launched with that context current.
std::function<void(double)> default_stream_work(void* ctx) {
  return [ctx](double ms) {
    cuCtxPushCurrent(ctx);
    fake_cuda_enqueue(0, ms);
    void* popped = nullptr;
    cuCtxPopCurrent(&popped);
  };
}

void* current_context() {
  void* ctx = nullptr;
  cuCtxGetCurrent(&ctx);
  return ctx;
}

TEST_F(CudaTimerFake, AStepOnAThreadWithoutAContextIsTimedOnTheNamedDevice) {
  // torch.cuda.current_stream(0) seen from a thread that never made a context current:
  // handle 0 on device 0. The events go in device 0's primary context, retained for the
  // run and released at close; the thread is left without a context, as it was.
  fake_cuda_set_current(nullptr, 0);
  void* primary = fake_cuda_primary_context(0);
  TempDir tmp;
  std::vector<nlohmann::json> records;
  std::thread([&] {
    auto r = run(tmp, 8, 0, default_stream_work(primary), /*device=*/0);
    r->step();
    r->step();
    fake_cuda_advance(100);
    EXPECT_EQ(current_context(), nullptr);
    EXPECT_EQ(fake_cuda_primary_retains(0), 1);
    records = close(r);
  }).join();
  EXPECT_EQ(fake_cuda_primary_retains(0), 0);
  EXPECT_EQ(fake_cuda_live_events(), 0);
  expect_no_fallback(records);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  for (const auto& s : steps) {
    EXPECT_EQ(s["clock"], "cuda") << s;
    EXPECT_DOUBLE_EQ(s["step_ms"].get<double>(), 8.0) << s;
    EXPECT_EQ(s["stream"], (nlohmann::json{{"id", 0}, {"device", 0}}));
  }
}

TEST_F(CudaTimerFake, AStepUnderAnotherDevicesContextRecordsInTheStreamsContext) {
  // The training stream belongs to device 0's context; the step runs inside
  // `with torch.cuda.device(1)` (device 1's context current). Events created there would
  // not record on the stream (CUDA_ERROR_INVALID_HANDLE: the run fell back to the host).
  int ctx_a = 0, ctx_b = 0;
  fake_cuda_set_current(&ctx_b, 1);
  fake_cuda_set_current(&ctx_a, 0);
  fake_cuda_set_stream_context(kStream, &ctx_a);
  TempDir tmp;
  std::vector<nlohmann::json> records;
  std::thread([&] {
    ASSERT_EQ(cuCtxSetCurrent(&ctx_b), kSuccess);
    auto r = run(tmp);
    r->step();
    r->step();
    fake_cuda_advance(100);
    EXPECT_EQ(current_context(), &ctx_b);  // restored after every event call
    records = close(r);
  }).join();
  expect_no_fallback(records);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  for (const auto& s : steps) {
    EXPECT_EQ(s["clock"], "cuda") << s;
    EXPECT_DOUBLE_EQ(s["phases_ms"]["backward"].get<double>(), 5.0) << s;
  }
}

TEST_F(CudaTimerFake, StreamsOfTwoContextsEachGetEventsOfTheirOwn) {
  // A process driving two GPUs (device_map="auto"): steps alternate between a stream of
  // each device's context; each context's events come from its own pool, reused.
  int ctx_a = 0, ctx_b = 0;
  constexpr std::uintptr_t kOther = 0x6100;
  fake_cuda_set_current(&ctx_b, 1);
  fake_cuda_set_current(&ctx_a, 0);
  fake_cuda_set_stream_context(kStream, &ctx_a);
  fake_cuda_set_stream_context(kOther, &ctx_b);
  TempDir tmp;
  std::uintptr_t active = kStream;
  auto r = run(tmp, 8, kStream, [&active](double ms) { fake_cuda_enqueue(active, ms); });
  int live_after_warmup = 0;
  for (int i = 0; i < 12; ++i) {
    active = i % 2 == 0 ? kStream : kOther;
    r->prof->set_stream(active, i % 2);
    r->step();
    fake_cuda_advance(100);
    if (i == 3) live_after_warmup = fake_cuda_live_events();
  }
  EXPECT_EQ(fake_cuda_live_events(), live_after_warmup);  // pooled, not created per step
  const auto records = close(r);
  expect_no_fallback(records);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 12u);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i]["clock"], "cuda") << steps[i];
    EXPECT_DOUBLE_EQ(steps[i]["step_ms"].get<double>(), 8.0) << steps[i];
    EXPECT_EQ(steps[i]["stream"]["id"], i % 2 == 0 ? kStream : kOther);
  }
  EXPECT_EQ(fake_cuda_live_events(), 0);
}

}  // namespace
}  // namespace steptrace
