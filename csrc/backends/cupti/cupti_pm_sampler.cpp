// Hardware counters through CUPTI PM sampling (CUDA 12.6+): the device samples its
// performance monitors every ~1 ms into a hardware buffer while a sampled step runs; a
// decode thread turns the buffer into CounterSamples every 25 ms. Where PM sampling is
// missing, make_cupti_counter_sampler falls back to the range profiler
// (cupti_range_profiler.cpp). Both are modes of CounterSession (counter_session.hpp),
// which holds their shared lifecycle. libcupti is dlopen'ed
// (the copy already in the process when there is one); the CUPTI headers give only the
// parameter structs. Without them at build time this is a stub that says so.
#include "steptrace/backend.hpp"
#include "steptrace/ext/device_activity.hpp"

#if STEPTRACE_HAVE_CUPTI_HEADERS

#include <cupti_pmsampling.h>
#include <cupti_profiler_target.h>
#include <cupti_target.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "counter_session.hpp"
#include "cupti_host.hpp"
#include "metric_sets.hpp"
#include "pm_sampling_logic.hpp"
#include "profiler_host.hpp"
#include "range_profiler_logic.hpp"

namespace steptrace {
namespace {

using namespace detail::cupti;

// Raw records per 1 ms sample are small; 64 MiB of device buffer covers far more than
// the decode period (25 ms), even if decoding falls behind by seconds.
constexpr std::size_t kHardwareBufferBytes = std::size_t{64} << 20;
constexpr std::uint64_t kIntervalNs = 1'000'000;  // GPU_TIME_INTERVAL: 1 ms
// GPU_SYSCLK_INTERVAL (GA100) counts sys clock cycles; at a ~1 GHz sysclk this is ~1 ms.
// The sysclk frequency varies: the samples carry their own start/end times.
constexpr std::uint64_t kIntervalSysclkCycles = 1'000'000;
// Samples the counter data image holds per decode call; a full image is evaluated,
// reset and decoded into again within the same pass.
constexpr std::uint32_t kSamplesPerImage = 256;
constexpr int kMaxImagesPerPass = 64;

// CUPTI entry points beyond the host API, resolved from the loaded library
// (load_session_api).
struct PmApi {
  ProfilerApi profiler;
  decltype(&::cuptiPmSamplingGetCounterAvailability) counter_availability = nullptr;
  decltype(&::cuptiPmSamplingEnable) enable = nullptr;
  decltype(&::cuptiPmSamplingDisable) disable = nullptr;
  decltype(&::cuptiPmSamplingSetConfig) set_config = nullptr;
  decltype(&::cuptiPmSamplingStart) start = nullptr;
  decltype(&::cuptiPmSamplingStop) stop = nullptr;
  decltype(&::cuptiPmSamplingDecodeData) decode = nullptr;
  decltype(&::cuptiPmSamplingGetCounterDataSize) counter_data_size = nullptr;
  decltype(&::cuptiPmSamplingCounterDataImageInitialize) counter_data_initialize = nullptr;
  decltype(&::cuptiPmSamplingGetCounterDataInfo) counter_data_info = nullptr;
  decltype(&::cuptiPmSamplingCounterDataGetSampleInfo) sample_info = nullptr;

  // The PM sampling entry points (CUPTI 12.6+).
  void resolve_mode(SymbolResolver& resolve) {
    resolve(counter_availability, "cuptiPmSamplingGetCounterAvailability");
    resolve(enable, "cuptiPmSamplingEnable");
    resolve(disable, "cuptiPmSamplingDisable");
    resolve(set_config, "cuptiPmSamplingSetConfig");
    resolve(start, "cuptiPmSamplingStart");
    resolve(stop, "cuptiPmSamplingStop");
    resolve(decode, "cuptiPmSamplingDecodeData");
    resolve(counter_data_size, "cuptiPmSamplingGetCounterDataSize");
    resolve(counter_data_initialize, "cuptiPmSamplingCounterDataImageInitialize");
    resolve(counter_data_info, "cuptiPmSamplingGetCounterDataInfo");
    resolve(sample_info, "cuptiPmSamplingCounterDataGetSampleInfo");
  }
};

class CuptiPmSampler final : public CounterSession {
 public:
  CuptiPmSampler(const PmApi& api, const HostApi& host_api, Device device)
      : CounterSession(api.profiler, host_api, std::move(device), ProfilerMode::kPmSampling,
                       "PM sampling"),
        api_(api) {}

  ~CuptiPmSampler() override { finish(); }
  CuptiPmSampler(const CuptiPmSampler&) = delete;
  CuptiPmSampler& operator=(const CuptiPmSampler&) = delete;

  // After a failed setup: whether the range profiler may do better.
  PmFailure failure() const {
    return no_pm_on_chip_ ? PmFailure::kNoPmOnChip
                          : pm_call_failure(static_cast<int>(setup_result()));
  }

  const char* name() const noexcept override { return "cupti_pm_sampling"; }

  void begin_step(std::int64_t step, bool sampled) noexcept override {
    if (finished_.load(std::memory_order_relaxed)) return;
    last_step_.store(step, std::memory_order_relaxed);
    const bool run = schedule_.begin_step(step, sampled);
    if (run == requested_) return;
    requested_ = run;
    handoff_.request(run, Apply{this});
  }

  void end_step(std::int64_t /*step*/) noexcept override {}

 private:
  // StartStopHandoff's callback: runs with the PM sampling object held.
  struct Apply {
    CuptiPmSampler* self;
    bool operator()(bool run) const noexcept { return self->apply(run); }
  };

  // The chip's PM sampling and the device's counter availability image.
  bool before_host(const ChipFamily& family, std::string* why) override {
    if (!family.pm_sampling) {
      no_pm_on_chip_ = true;
      *why = fmt::format("chip {} has no PM sampling", chip_);
      return false;
    }
    // The device's availability image lets the host API leave out counters this device
    // cannot collect now (MIG, a counter held elsewhere).
    CUpti_PmSampling_GetCounterAvailability_Params avail{};
    avail.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_PmSampling_GetCounterAvailability_Params,
                                                   pCounterAvailabilityImage);
    avail.deviceIndex = static_cast<std::size_t>(device_.index);
    if (CUptiResult r = api_.counter_availability(&avail); r != CUPTI_SUCCESS) {
      *why = setup_reason("cuptiPmSamplingGetCounterAvailability", r);
      return false;
    }
    availability_.assign(avail.counterAvailabilityImageSize, 0);
    avail.pCounterAvailabilityImage = availability_.data();
    if (CUptiResult r = api_.counter_availability(&avail); r != CUPTI_SUCCESS) {
      *why = setup_reason("cuptiPmSamplingGetCounterAvailability", r);
      return false;
    }
    return true;
  }

  // The PM sampling object, configured and stopped, and the counter data image.
  bool open_session(const ChipFamily& family, std::string* why) override {
    CUpti_PmSampling_Enable_Params enable{};
    enable.structSize =
        STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_PmSampling_Enable_Params, pPmSamplingObject);
    enable.deviceIndex = static_cast<std::size_t>(device_.index);
    if (CUptiResult r = api_.enable(&enable); r != CUPTI_SUCCESS) {
      *why = setup_reason("cuptiPmSamplingEnable", r);
      return false;
    }
    pm_ = enable.pPmSamplingObject;

    CUpti_PmSampling_SetConfig_Params config{};
    config.structSize =
        STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_PmSampling_SetConfig_Params, hwBufferAppendMode);
    config.pPmSamplingObject = pm_;
    config.configSize = config_.size();
    config.pConfig = config_.data();
    config.hardwareBufferSize = kHardwareBufferBytes;
    if (family.time_interval_trigger) {
      config.triggerMode = CUPTI_PM_SAMPLING_TRIGGER_MODE_GPU_TIME_INTERVAL;
      config.samplingInterval = kIntervalNs;
    } else {
      config.triggerMode = CUPTI_PM_SAMPLING_TRIGGER_MODE_GPU_SYSCLK_INTERVAL;
      config.samplingInterval = kIntervalSysclkCycles;
    }
    // Keep the oldest records: an overflow is then reported (DecodeData) instead of
    // silently overwriting samples.
    config.hwBufferAppendMode = CUPTI_PM_SAMPLING_HARDWARE_BUFFER_APPEND_MODE_KEEP_OLDEST;
    if (CUptiResult r = api_.set_config(&config); r != CUPTI_SUCCESS) {
      *why = setup_reason("cuptiPmSamplingSetConfig", r);
      return false;
    }

    CUpti_PmSampling_GetCounterDataSize_Params size{};
    size.structSize =
        STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_PmSampling_GetCounterDataSize_Params, counterDataSize);
    size.pPmSamplingObject = pm_;
    size.pMetricNames = metric_names_.data();
    size.numMetrics = metric_names_.size();
    size.maxSamples = kSamplesPerImage;
    if (CUptiResult r = api_.counter_data_size(&size); r != CUPTI_SUCCESS) {
      *why = setup_reason("cuptiPmSamplingGetCounterDataSize", r);
      return false;
    }
    counter_data_.assign(size.counterDataSize, 0);
    CUpti_PmSampling_CounterDataImage_Initialize_Params image{};
    image.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(
        CUpti_PmSampling_CounterDataImage_Initialize_Params, pCounterData);
    image.pPmSamplingObject = pm_;
    image.counterDataSize = counter_data_.size();
    image.pCounterData = counter_data_.data();
    if (CUptiResult r = api_.counter_data_initialize(&image); r != CUPTI_SUCCESS) {
      *why = setup_reason("cuptiPmSamplingCounterDataImageInitialize", r);
      return false;
    }
    // An evaluated image is reset to this copy of the freshly initialized one before the
    // next decode, so that decoding starts at sample 0 again (NVIDIA's sample and XLA
    // re-initialize or restore the image the same way).
    counter_data_initialized_ = counter_data_;
    times_.reserve(kSamplesPerImage);
    return true;
  }

  // The stop is applied now, or by the decode thread when it leaves the object.
  void stop_mode() noexcept override { handoff_.request(false, Apply{this}); }
  void final_pass() noexcept override { decode_pass(); }  // recorded up to the stop

  void close_object(bool torn_down) noexcept override {
    if (pm_ != nullptr && !torn_down) {
      CUpti_PmSampling_Disable_Params p{};
      p.structSize =
          STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_PmSampling_Disable_Params, pPmSamplingObject);
      p.pPmSamplingObject = pm_;
      api_.disable(&p);
    }
    pm_ = nullptr;
  }

  // With the object held: starts or stops; returns whether sampling runs afterwards.
  bool apply(bool run) noexcept {
    if (pm_ == nullptr || call_failure_.torn_down()) return false;
    if (run) {
      // counters taken by another tool: do not keep trying
      if (call_failure_.failed()) return false;
      CUpti_PmSampling_Start_Params p{};
      p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_PmSampling_Start_Params, pPmSamplingObject);
      p.pPmSamplingObject = pm_;
      const CUptiResult r = api_.start(&p);
      if (r != CUPTI_SUCCESS) {
        fail("cuptiPmSamplingStart", r);
        return false;
      }
      has_records_ = true;
      return true;
    }
    CUpti_PmSampling_Stop_Params p{};
    p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_PmSampling_Stop_Params, pPmSamplingObject);
    p.pPmSamplingObject = pm_;
    if (const CUptiResult r = api_.stop(&p); r != CUPTI_SUCCESS) fail("cuptiPmSamplingStop", r);
    return false;
  }

  // One delivery: decodes the hardware buffer until it is empty (or the pass bound),
  // hands the samples to take(), and counts the delivery even when there was nothing.
  void decode_pass() noexcept override {
    std::vector<CounterSample> batch;
    std::int64_t lost = 0;
    bool overflow = false;
    try {
      for (int round = 0; round < kMaxImagesPerPass; ++round) {
        std::size_t completed = 0;
        bool image_full = false;
        handoff_.lock();
        if (pm_ == nullptr || !has_records_ || call_failure_.torn_down()) {
          handoff_.unlock(Apply{this});
          break;
        }
        decode_image(&completed, &image_full, &overflow);
        // Sample times need the PM sampling object: read them while holding it. times_
        // has room for a full image (setup), so nothing here allocates or throws.
        completed = std::min<std::size_t>(completed, kSamplesPerImage);
        times_.resize(completed);
        for (std::size_t i = 0; i < completed; ++i) {
          CUpti_PmSampling_CounterData_GetSampleInfo_Params p{};
          p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(
              CUpti_PmSampling_CounterData_GetSampleInfo_Params, endTimestamp);
          p.pPmSamplingObject = pm_;
          p.pCounterDataImage = counter_data_.data();
          p.counterDataImageSize = counter_data_.size();
          p.sampleIndex = i;
          if (api_.sample_info(&p) == CUPTI_SUCCESS) {
            times_[i] = {static_cast<std::int64_t>(p.startTimestamp),
                         static_cast<std::int64_t>(p.endTimestamp)};
          } else {
            times_[i] = {-1, -1};
          }
        }
        handoff_.unlock(Apply{this});
        // torn down meanwhile: the host object is gone too
        if (call_failure_.torn_down()) {
          lost += static_cast<std::int64_t>(completed);
          break;
        }
        // Evaluation reads only the image and the host object: the training thread may
        // start or stop sampling meanwhile.
        for (std::size_t i = 0; i < completed; ++i) {
          CounterSample s;
          s.step = -1;
          s.start_ns = times_[i].first;
          s.end_ns = times_[i].second;
          add_sample(i, times_[i].first >= 0, s, &batch, &lost);
        }
        // An image with no completed sample is decoded into again as it is, like XLA's
        // decoder does: it may hold the first part of a sample.
        if (completed > 0 || image_full) reset_image();
        if (!image_full) break;
      }
    } catch (...) {
      lost += 1;  // out of memory for the batch: the samples of this pass are lost
    }
    queue_.publish(batch, lost, overflow);
    delivered();
  }

  // With the object held: one DecodeData into the (reset) image.
  void decode_image(std::size_t* completed, bool* image_full, bool* overflow) noexcept {
    CUpti_PmSampling_DecodeData_Params p{};
    p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_PmSampling_DecodeData_Params, overflow);
    p.pPmSamplingObject = pm_;
    p.pCounterDataImage = counter_data_.data();
    p.counterDataImageSize = counter_data_.size();
    const CUptiResult r = api_.decode(&p);
    if (r == CUPTI_ERROR_OUT_OF_MEMORY) {
      // The hardware buffer overflowed (KEEP_OLDEST): the session must be restarted,
      // and what the image holds is incomplete.
      *overflow = true;
      if (handoff_.running()) {
        apply(false);
        handoff_.set_running(apply(true));
      } else {
        has_records_ = false;
      }
      reset_image();
      return;
    }
    if (r != CUPTI_SUCCESS) {
      fail("cuptiPmSamplingDecodeData", r);
      if (handoff_.running()) handoff_.set_running(apply(false));
      has_records_ = false;
      return;
    }
    if (p.overflow != 0) *overflow = true;
    *image_full = p.decodeStopReason == CUPTI_PM_SAMPLING_DECODE_STOP_REASON_COUNTER_DATA_FULL;
    // Stopped and drained: nothing to decode until the next start.
    if (p.decodeStopReason == CUPTI_PM_SAMPLING_DECODE_STOP_REASON_END_OF_RECORDS &&
        !handoff_.running()) {
      has_records_ = false;
    }
    CUpti_PmSampling_GetCounterDataInfo_Params info{};
    info.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_PmSampling_GetCounterDataInfo_Params,
                                                  numCompletedSamples);
    info.pCounterDataImage = counter_data_.data();
    info.counterDataImageSize = counter_data_.size();
    if (const CUptiResult ri = api_.counter_data_info(&info); ri != CUPTI_SUCCESS) {
      fail("cuptiPmSamplingGetCounterDataInfo", ri);
      if (handoff_.running()) handoff_.set_running(apply(false));
      has_records_ = false;
      return;
    }
    // Only completed samples are read; a sample still open at the end of the buffer
    // is completed by a later decode (unverified without a GPU).
    *completed = info.numCompletedSamples;
  }

  void reset_image() noexcept {
    std::memcpy(counter_data_.data(), counter_data_initialized_.data(), counter_data_.size());
  }

  PmApi api_;
  CUpti_PmSampling_Object* pm_ = nullptr;
  bool no_pm_on_chip_ = false;  // setup failed on the chip's row

  // decode thread (and finish, after joining it)
  std::vector<std::uint8_t> counter_data_initialized_;
  std::vector<std::pair<std::int64_t, std::int64_t>> times_;

  // training thread
  SamplingSchedule schedule_;
  bool requested_ = false;

  StartStopHandoff handoff_;
  bool has_records_ = false;  // guarded by handoff_: started since the last full drain
};

}  // namespace

namespace {

// PM sampling on `device`; nullptr with `why`, and in *failure whether that leaves room
// for the range profiler.
std::unique_ptr<CounterSampler> make_pm_sampler(const Library& lib, const Device& device,
                                                std::string* why, PmFailure* failure) {
  *failure = PmFailure::kOther;
  PmApi api;
  HostApi host_api;
  bool pm_missing = false;
  if (!load_session_api(lib, "PM sampling", &api, &host_api, why, &pm_missing)) {
    if (pm_missing) *failure = PmFailure::kTooOld;
    return nullptr;
  }
  auto sampler = std::make_unique<CuptiPmSampler>(api, host_api, device);
  if (!sampler->setup(why)) {
    *failure = sampler->failure();
    return nullptr;
  }
  return sampler;
}

}  // namespace

std::unique_ptr<CounterSampler> make_cupti_counter_sampler(int device_index, std::string* why_not) {
  std::string why;
  auto unavailable = [&](std::string reason) -> std::unique_ptr<CounterSampler> {
    if (why_not != nullptr) *why_not = std::move(reason);
    return nullptr;
  };
  const Library* lib = load_library({}, &why);
  if (lib == nullptr) return unavailable(why);
  const Device device = choose_device(device_index);
  PmFailure failure = PmFailure::kOther;
  if (auto pm = make_pm_sampler(*lib, device, &why, &failure)) return pm;
  // Only where PM sampling itself is missing: elsewhere (no GPU, no privileges) the range
  // profiler fails the same way and the one reason says it.
  if (!falls_back_to_range_profiler(failure)) return unavailable(why);
  std::string range_why;
  if (auto range = make_range_profiler_sampler(*lib, device, &range_why)) return range;
  return unavailable("PM sampling: " + why + "; range profiler: " + range_why);
}

}  // namespace steptrace

#else  // !STEPTRACE_HAVE_CUPTI_HEADERS

namespace steptrace {

std::unique_ptr<CounterSampler> make_cupti_counter_sampler(int /*device_index*/,
                                                           std::string* why_not) {
  if (why_not != nullptr)
    *why_not = "built without CUPTI headers: PM sampling and the range profiler are unavailable";
  return nullptr;
}

}  // namespace steptrace

#endif  // STEPTRACE_HAVE_CUPTI_HEADERS
