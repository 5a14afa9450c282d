// Hardware counters through CUPTI's range profiler (cuptiRangeProfiler*, CUDA 12.6+), for
// where PM sampling is missing: one user range per sampled step, so every sample is
// measured over exactly its step (CounterSample::step). With a one-pass config and user
// replay nothing is replayed and kernels are not serialized (auto range would be).
//
// Threads: the training thread enables the profiler lazily on the first sampled step
// that has a CUDA context (never without one: that crashes libcupti), starts a pass,
// pushes and pops the step's range and stops the pass when the burst of sampled steps
// ends; the decode thread decodes a stopped pass, evaluates its ranges and sets the
// object up for the next pass. An atomic PassState hands the object from one to the
// other: no locks on the training thread. The session's lifecycle (setup, status,
// failures, finish and teardown) is CounterSession's (counter_session.hpp).
#include "steptrace/backend.hpp"
#include "steptrace/ext/device_activity.hpp"

#if STEPTRACE_HAVE_CUPTI_HEADERS

#include <cupti_profiler_target.h>
#include <cupti_range_profiler.h>
#include <dlfcn.h>

#include <atomic>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "../cuda/cuda_driver.hpp"
#include "counter_session.hpp"
#include "cupti_host.hpp"
#include "pm_sampling_logic.hpp"
#include "profiler_host.hpp"
#include "range_profiler_logic.hpp"

namespace steptrace::detail::cupti {
namespace {

// Ranges a pass holds before it is stopped and decoded, also the counter data image's
// room: a long burst of sampled steps is split into passes of this many steps, so that
// their records wait for counters at most this many steps.
constexpr int kMaxRangesPerPass = 8;
constexpr const char* kRangeDelimiter = "/";  // ranges are not nested: never in a name

// CUPTI entry points beyond the host API (load_session_api).
struct RangeApi {
  ProfilerApi profiler;
  decltype(&::cuptiRangeProfilerEnable) enable = nullptr;
  decltype(&::cuptiRangeProfilerDisable) disable = nullptr;
  decltype(&::cuptiRangeProfilerSetConfig) set_config = nullptr;
  decltype(&::cuptiRangeProfilerStart) start = nullptr;
  decltype(&::cuptiRangeProfilerStop) stop = nullptr;
  decltype(&::cuptiRangeProfilerPushRange) push = nullptr;
  decltype(&::cuptiRangeProfilerPopRange) pop = nullptr;
  decltype(&::cuptiRangeProfilerDecodeData) decode = nullptr;
  decltype(&::cuptiRangeProfilerGetCounterDataSize) counter_data_size = nullptr;
  decltype(&::cuptiRangeProfilerCounterDataImageInitialize) counter_data_initialize = nullptr;
  decltype(&::cuptiRangeProfilerGetCounterDataInfo) counter_data_info = nullptr;
  decltype(&::cuptiRangeProfilerCounterDataGetRangeInfo) range_info = nullptr;

  // The range profiler entry points (CUPTI 12.6+).
  void resolve_mode(SymbolResolver& resolve) {
    resolve(enable, "cuptiRangeProfilerEnable");
    resolve(disable, "cuptiRangeProfilerDisable");
    resolve(set_config, "cuptiRangeProfilerSetConfig");
    resolve(start, "cuptiRangeProfilerStart");
    resolve(stop, "cuptiRangeProfilerStop");
    resolve(push, "cuptiRangeProfilerPushRange");
    resolve(pop, "cuptiRangeProfilerPopRange");
    resolve(decode, "cuptiRangeProfilerDecodeData");
    resolve(counter_data_size, "cuptiRangeProfilerGetCounterDataSize");
    resolve(counter_data_initialize, "cuptiRangeProfilerCounterDataImageInitialize");
    resolve(counter_data_info, "cuptiRangeProfilerGetCounterDataInfo");
    resolve(range_info, "cuptiRangeProfilerCounterDataGetRangeInfo");
  }
};

// setup() needs no CUDA context: the profiler, the chip, the metric set and its config
// image (the counter availability image would need a context: none is used). The range
// profiler object itself comes with the first sampled step's context.
class CuptiRangeProfiler final : public CounterSession {
 public:
  CuptiRangeProfiler(const RangeApi& api, const HostApi& host_api, const cuda::Driver& driver,
                     Device device)
      : CounterSession(api.profiler, host_api, std::move(device), ProfilerMode::kRangeProfiler,
                       "the range profiler"),
        api_(api),
        driver_(driver) {}

  ~CuptiRangeProfiler() override { finish(); }
  CuptiRangeProfiler(const CuptiRangeProfiler&) = delete;
  CuptiRangeProfiler& operator=(const CuptiRangeProfiler&) = delete;

  const char* name() const noexcept override { return "cupti_range_profiler"; }

  // Per sampled step: cuCtxGetCurrent, then PushRange (and Start for the burst's first
  // step). The first sampled step with a context also pays the setup, once per run:
  // Enable, GetCounterDataSize, one allocation of the counter data image (a few KB for
  // kMaxRangesPerPass ranges), its initialization and SetConfig. The first unsampled step
  // after a burst pays Stop. What these CUPTI calls cost on a GPU is unmeasured.
  void begin_step(std::int64_t step, bool sampled) noexcept override {
    if (!enter()) return;
    last_step_.store(step, std::memory_order_relaxed);
    const auto state = static_cast<PassState>(state_.load(std::memory_order_acquire));
    const bool want = sampled && step >= 0;
    cuda::CUcontext ctx = nullptr;
    bool on_device = false;
    if (want && state != PassState::kFailed) {
      if (driver_.cuCtxGetCurrent(&ctx) != cuda::kSuccess) ctx = nullptr;
      if (ctx != nullptr && state == PassState::kUnconfigured) {
        int dev = -1;
        on_device = driver_.cuCtxGetDevice(&dev) == cuda::kSuccess && dev == device_.index;
      }
    }
    const BeginPlan plan = plan_begin_step(want, state, ctx, profiled_ctx_, on_device);
    if (plan.stop) stop_pass();
    bool ok = true;
    if (plan.set_up) ok = enable_on(ctx);
    if (ok && plan.start) ok = start_pass();
    if (ok && plan.push) push_range(step);
    if (plan.skip != Skip::kNone) skipped_[static_cast<int>(plan.skip)].fetch_add(1);
    leave();
  }

  void end_step(std::int64_t /*step*/) noexcept override {
    if (!enter()) return;
    if (range_open_) {
      range_open_ = false;
      if (pop_range() && pass_full(++ranges_in_pass_, kMaxRangesPerPass)) stop_pass();
    }
    leave();
  }

 private:
  // A begin_step/end_step that started before finish set the flag finishes first; later
  // ones see the flag and do nothing.
  void stop_mode() noexcept override {
    while (in_step_call_.load()) std::this_thread::yield();
  }

  // The only thread on the object: close what the training thread left open.
  void final_pass() noexcept override {
    if (state() == PassState::kRunning) {
      if (range_open_) {
        range_open_ = false;
        pop_range();
      }
      stop_pass();
    }
    if (state() == PassState::kStopped) decode_stopped(false);
    delivered();
  }

  std::string finished_detail() const override {
    const auto no_ctx = skipped_[static_cast<int>(Skip::kNoContext)].load();
    const auto other = skipped_[static_cast<int>(Skip::kOtherContext)].load();
    const auto busy = skipped_[static_cast<int>(Skip::kDecoding)].load();
    if (no_ctx + other + busy == 0) return {};
    return fmt::format(
        "; sampled steps without a range: {} with no CUDA context, {} on another context, {} "
        "while the previous pass was decoded",
        no_ctx, other, busy);
  }

  PassState state() const noexcept {
    return static_cast<PassState>(state_.load(std::memory_order_acquire));
  }
  void set_state(PassState s) noexcept {
    state_.store(static_cast<int>(s), std::memory_order_release);
  }

  // Training thread: false after finish() began. Sequentially consistent, so that finish,
  // which sets finished_ and then waits for in_step_call_, and this, which sets
  // in_step_call_ and then reads finished_, cannot both miss each other.
  bool enter() noexcept {
    in_step_call_.store(true);
    if (finished_.load()) {
      in_step_call_.store(false);
      return false;
    }
    return true;
  }
  void leave() noexcept { in_step_call_.store(false); }

  // Training thread, state kUnconfigured, `ctx` current and on the device: the object,
  // its counter data image and its config. On failure the state is kFailed.
  bool enable_on(cuda::CUcontext ctx) noexcept {
    CUpti_RangeProfiler_Enable_Params p{};
    p.structSize =
        STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_RangeProfiler_Enable_Params, pRangeProfilerObject);
    p.ctx = reinterpret_cast<CUcontext>(ctx);
    if (const CUptiResult r = api_.enable(&p); r != CUPTI_SUCCESS) {
      fail("cuptiRangeProfilerEnable", r);
      set_state(PassState::kFailed);
      return false;
    }
    object_ = p.pRangeProfilerObject;
    profiled_ctx_ = ctx;

    CUpti_RangeProfiler_GetCounterDataSize_Params size{};
    size.structSize =
        STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_RangeProfiler_GetCounterDataSize_Params, counterDataSize);
    size.pRangeProfilerObject = object_;
    size.pMetricNames = metric_names_.data();
    size.numMetrics = metric_names_.size();
    size.maxNumOfRanges = kMaxRangesPerPass;
    size.maxNumRangeTreeNodes = kMaxRangesPerPass;  // one level: a node per range
    if (const CUptiResult r = api_.counter_data_size(&size); r != CUPTI_SUCCESS) {
      fail("cuptiRangeProfilerGetCounterDataSize", r);
      set_state(PassState::kFailed);
      return false;
    }
    try {
      counter_data_.assign(size.counterDataSize, 0);
    } catch (...) {
      call_failure_.record("allocating the counter data image", CUPTI_ERROR_OUT_OF_MEMORY);
      set_state(PassState::kFailed);
      return false;
    }
    if (!configure()) {
      set_state(PassState::kFailed);
      return false;
    }
    set_state(PassState::kIdle);
    return true;
  }

  // The owner of the object: a fresh counter data image and the config for the next
  // pass. Also after each decode: re-arming the session the way a new one is set up is
  // the documented sequence; whether the object would take a second Start without it is
  // not documented (unverified without a GPU).
  bool configure() noexcept {
    CUpti_RangeProfiler_CounterDataImage_Initialize_Params init{};
    init.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(
        CUpti_RangeProfiler_CounterDataImage_Initialize_Params, pCounterData);
    init.pRangeProfilerObject = object_;
    init.counterDataSize = counter_data_.size();
    init.pCounterData = counter_data_.data();
    if (const CUptiResult r = api_.counter_data_initialize(&init); r != CUPTI_SUCCESS) {
      fail("cuptiRangeProfilerCounterDataImageInitialize", r);
      return false;
    }
    CUpti_RangeProfiler_SetConfig_Params p{};
    p.structSize =
        STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_RangeProfiler_SetConfig_Params, targetNestingLevel);
    p.pRangeProfilerObject = object_;
    p.configSize = config_.size();
    p.pConfig = config_.data();
    p.counterDataImageSize = counter_data_.size();
    p.pCounterDataImage = counter_data_.data();
    p.range = CUPTI_UserRange;
    p.replayMode = CUPTI_UserReplay;  // one pass: the step runs once, nothing is replayed
    p.maxRangesPerPass = kMaxRangesPerPass;
    p.numNestingLevels = 1;
    p.minNestingLevel = 1;
    p.passIndex = 0;
    p.targetNestingLevel = 1;
    if (const CUptiResult r = api_.set_config(&p); r != CUPTI_SUCCESS) {
      fail("cuptiRangeProfilerSetConfig", r);
      return false;
    }
    return true;
  }

  // A call whose parameters are the object only (Start, PopRange, Disable).
  template <class Params>
  CUptiResult object_call(CUptiResult (*fn)(Params*)) noexcept {
    Params p{};
    p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(Params, pRangeProfilerObject);
    p.pRangeProfilerObject = object_;
    return fn(&p);
  }

  bool start_pass() noexcept {
    if (const CUptiResult r = object_call(api_.start); r != CUPTI_SUCCESS) {
      fail("cuptiRangeProfilerStart", r);
      set_state(PassState::kFailed);
      return false;
    }
    ranges_in_pass_ = 0;
    set_state(PassState::kRunning);
    return true;
  }

  // A failed push or pop leaves the pass as it is: Disable (finish) ends it.
  void push_range(std::int64_t step) noexcept {
    // A name buffer per range of the pass, kept until the pass is decoded: whether
    // PushRange copies the name is not documented.
    char(&name)[kRangeNameSize] = range_names_[ranges_in_pass_ % kMaxRangesPerPass];
    range_name(step, name);
    CUpti_RangeProfiler_PushRange_Params p{};
    p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_RangeProfiler_PushRange_Params, pRangeName);
    p.pRangeProfilerObject = object_;
    p.pRangeName = name;
    if (const CUptiResult r = api_.push(&p); r != CUPTI_SUCCESS) {
      fail("cuptiRangeProfilerPushRange", r);
      set_state(PassState::kFailed);
      return;
    }
    range_open_ = true;
  }

  bool pop_range() noexcept {
    if (const CUptiResult r = object_call(api_.pop); r != CUPTI_SUCCESS) {
      fail("cuptiRangeProfilerPopRange", r);
      set_state(PassState::kFailed);
      return false;
    }
    return true;
  }

  // The owner of a running pass: stops it and hands it to the decode thread.
  void stop_pass() noexcept {
    if (state() != PassState::kRunning) return;
    CUpti_RangeProfiler_Stop_Params p{};
    p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_RangeProfiler_Stop_Params, isAllPassSubmitted);
    p.pRangeProfilerObject = object_;
    if (const CUptiResult r = api_.stop(&p); r != CUPTI_SUCCESS) {
      fail("cuptiRangeProfilerStop", r);
      set_state(PassState::kFailed);
      return;
    }
    set_state(PassState::kStopped);
    decoder_.wake();
  }

  // Decode thread: one delivery.
  void decode_pass() noexcept override {
    const PassState s = state();
    if (s == PassState::kStopped) decode_stopped(true);
    if (counts_as_delivery(s)) delivered();
  }

  // The owner of a stopped pass (decode thread, or finish): its ranges into samples, then
  // (`rearm`) the object set up for the next pass and handed back as kIdle.
  void decode_stopped(bool rearm) noexcept {
    std::vector<CounterSample> batch;
    std::int64_t lost = 0;
    bool ok = true;
    try {
      // After Stop the data is still in the device's buffers; DecodeData brings it into
      // the counter data image given to SetConfig. Whether it waits for the device to
      // finish the ranges is not documented (unverified without a GPU).
      CUpti_RangeProfiler_DecodeData_Params d{};
      d.structSize =
          STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_RangeProfiler_DecodeData_Params, numOfRangeDropped);
      d.pRangeProfilerObject = object_;
      if (const CUptiResult r = api_.decode(&d); r != CUPTI_SUCCESS) {
        fail("cuptiRangeProfilerDecodeData", r);
        ok = false;
      } else {
        lost += static_cast<std::int64_t>(d.numOfRangeDropped);
        ok = decode_image(&batch, &lost);
      }
    } catch (...) {
      lost += 1;  // out of memory for the batch: this pass's samples are lost
    }
    queue_.publish(batch, lost, false);
    if (!ok || (rearm && !configure())) {
      set_state(PassState::kFailed);
    } else if (rearm) {
      set_state(PassState::kIdle);
    }
  }

  // The decoded ranges of counter_data_ as samples of their steps.
  bool decode_image(std::vector<CounterSample>* batch, std::int64_t* lost) {
    CUpti_RangeProfiler_GetCounterDataInfo_Params info{};
    info.structSize =
        STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_RangeProfiler_GetCounterDataInfo_Params, numTotalRanges);
    info.pCounterDataImage = counter_data_.data();
    info.counterDataImageSize = counter_data_.size();
    if (const CUptiResult r = api_.counter_data_info(&info); r != CUPTI_SUCCESS) {
      fail("cuptiRangeProfilerGetCounterDataInfo", r);
      return false;
    }
    for (std::size_t i = 0; i < info.numTotalRanges; ++i) {
      CUpti_RangeProfiler_CounterData_GetRangeInfo_Params ri{};
      ri.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(
          CUpti_RangeProfiler_CounterData_GetRangeInfo_Params, rangeName);
      ri.pCounterDataImage = counter_data_.data();
      ri.counterDataImageSize = counter_data_.size();
      ri.rangeIndex = i;
      ri.rangeDelimiter = kRangeDelimiter;
      CounterSample s;
      s.step = api_.range_info(&ri) == CUPTI_SUCCESS && ri.rangeName != nullptr
                   ? range_step(ri.rangeName)
                   : -1;
      add_sample(i, s.step >= 0, s, batch, lost);
    }
    return true;
  }

  void close_object(bool torn_down) noexcept override {
    if (object_ != nullptr && !torn_down) object_call(api_.disable);
    object_ = nullptr;
  }

  RangeApi api_;
  cuda::Driver driver_;

  // Set up by the training thread before it publishes kIdle; used by whoever owns the
  // object (state_).
  CUpti_RangeProfiler_Object* object_ = nullptr;
  cuda::CUcontext profiled_ctx_ = nullptr;
  std::atomic<int> state_{static_cast<int>(PassState::kUnconfigured)};

  // training thread
  bool range_open_ = false;
  int ranges_in_pass_ = 0;
  char range_names_[kMaxRangesPerPass][kRangeNameSize] = {};

  std::atomic<std::int64_t> skipped_[5] = {};  // per Skip
  std::atomic<bool> in_step_call_{false};
};

}  // namespace

std::unique_ptr<CounterSampler> make_range_profiler_sampler(const Library& lib,
                                                            const Device& device,
                                                            std::string* why) {
  RangeApi api;
  HostApi host_api;
  bool range_missing = false;
  if (!load_session_api(lib, "the range profiler", &api, &host_api, why, &range_missing)) {
    return nullptr;
  }
  // The training thread's current context comes from the driver CUPTI runs on.
  cuda::Driver driver;
  if (!driver.load(why)) return nullptr;
  auto sampler = std::make_unique<CuptiRangeProfiler>(api, host_api, driver, device);
  if (!sampler->setup(why)) return nullptr;
  return sampler;
}

}  // namespace steptrace::detail::cupti

#endif  // STEPTRACE_HAVE_CUPTI_HEADERS
