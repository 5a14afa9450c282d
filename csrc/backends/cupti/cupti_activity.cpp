// Kernel activity through CUPTI's Activity API: CONCURRENT_KERNEL records, and the API
// records of the kernel launch calls (runtime and driver), which give each launch's
// correlation id and host start time. A kernel is attributed to the step in which its
// launch call started, on whichever thread: the rule and why it holds are at the top of
// activity_records.hpp. libcupti is dlopen'ed (the copy already in the process when
// torch loaded one); the headers only give the record layouts. This file is the thin
// call layer (its entry points: activity_api.hpp; CUPTI's buffers, their registry and
// the request callback: activity_buffers.*): the correlation, naming and classification
// logic is in activity_records.cpp. Without the headers it is a stub.
#include "steptrace/backend.hpp"
#include "steptrace/ext/background_thread.hpp"
#include "steptrace/ext/device_activity.hpp"

#if !STEPTRACE_HAVE_CUPTI_HEADERS

namespace steptrace {

std::unique_ptr<KernelActivitySource> make_cupti_activity(std::string* why_not, bool /*yielding*/) {
  if (why_not != nullptr) {
    *why_not = "steptrace was built without the CUPTI headers: no kernel activity";
  }
  return nullptr;
}

}  // namespace steptrace

#else  // STEPTRACE_HAVE_CUPTI_HEADERS

#include <cupti_activity.h>
#include <cupti_driver_cbid.h>
#include <cupti_result.h>
#include <cupti_runtime_cbid.h>
#include <cupti_version.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <system_error>
#include <thread>
#include <type_traits>

#include <fmt/format.h>

#include "activity_api.hpp"
#include "activity_buffers.hpp"
#include "activity_records.hpp"
#include "cupti_errors.hpp"
#include "cupti_host.hpp"

namespace steptrace {
// Named (not anonymous): the buffer bookkeeping (activity_buffers.hpp) names the backend.
namespace detail::cupti::activity {

using detail::cupti::ActivityRecords;
using detail::cupti::MarkRing;
using detail::cupti::ParsedRecord;

// Kernel records are read through CUpti_ActivityKernel4, the oldest layout CUPTI 12 can
// emit; every later version only appends fields, so the prefix read here is the same
// whichever version the loaded library writes (CUPTI 12.x: Kernel9, 13: Kernel10).
using KernelPrefix = CUpti_ActivityKernel4;
#define STEPTRACE_SAME_PREFIX(T)                                                          \
  static_assert(offsetof(T, kind) == offsetof(KernelPrefix, kind), #T);                   \
  static_assert(offsetof(T, start) == offsetof(KernelPrefix, start), #T);                 \
  static_assert(offsetof(T, end) == offsetof(KernelPrefix, end), #T);                     \
  static_assert(offsetof(T, correlationId) == offsetof(KernelPrefix, correlationId), #T); \
  static_assert(offsetof(T, name) == offsetof(KernelPrefix, name), #T);                   \
  static_assert(sizeof(T) >= sizeof(KernelPrefix), #T)
STEPTRACE_SAME_PREFIX(CUpti_ActivityKernel5);
STEPTRACE_SAME_PREFIX(CUpti_ActivityKernel6);
STEPTRACE_SAME_PREFIX(CUpti_ActivityKernel7);
STEPTRACE_SAME_PREFIX(CUpti_ActivityKernel8);
STEPTRACE_SAME_PREFIX(CUpti_ActivityKernel9);
#if CUPTI_API_VERSION >= 130000  // CUPTI 13's headers (12.x headers, as torch bundles, stop at 9)
STEPTRACE_SAME_PREFIX(CUpti_ActivityKernel10);
#endif
#undef STEPTRACE_SAME_PREFIX
// The API record (runtime, driver, internal launch) has kept one layout since CUDA 5.
static_assert(offsetof(CUpti_ActivityAPI, start) == 8);
static_assert(offsetof(CUpti_ActivityAPI, correlationId) == 32);

// The calls that launch kernels, whose API records are the only ones steptrace asks for
// (cuptiActivityEnableRuntimeApi / EnableDriverApi, CUPTI 12.3+): the kernel records
// carry their correlation ids. Any other call would only cost time and buffer space.
// Unknown to an older CUPTI: that entry is skipped.
constexpr CUpti_CallbackId kRuntimeLaunches[] = {
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunch_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunch_ptsz_v7000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernelMultiDevice_v9000,
    CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000,
    CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060,
    505,  // __cudaLaunchKernel_v13000 (CUPTI 13)
    506,  // __cudaLaunchKernel_ptsz_v13000
};
constexpr CUpti_CallbackId kDriverLaunches[] = {
    CUPTI_DRIVER_TRACE_CBID_cuLaunch,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchGrid,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchGridAsync,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel,  // triton, and NCCL before cuLaunchKernelEx
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernelMultiDevice,
    CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch,
    CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx,  // NCCL 2.19+
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz,
};
static_assert(CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000 == 211);
static_assert(CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel == 307);

constexpr auto kFlushPeriod = std::chrono::milliseconds(50);
// Our callbacks unheard over this many steps and this long (a step that launches work
// makes CUPTI ask for a buffer or hand one back): another tool has taken them.
constexpr std::uint64_t kQuietSteps = 8;
constexpr std::int64_t kQuietNs = 3'000'000'000;
constexpr int kOldestVersion = 18;  // cuptiGetVersion of CUDA 12.0's CUPTI

void CUPTIAPI buffer_completed(CUcontext context, std::uint32_t stream, std::uint8_t* buffer,
                               std::size_t size, std::size_t valid_size) noexcept;

enum class LaunchRecords { kNone, kLaunchCalls, kWholeApiKinds };

class CuptiActivity final : public KernelActivitySource {
 public:
  explicit CuptiActivity(const Api& api)
      : api_(api), foreign_at_start_(shared().foreign.load(std::memory_order_relaxed)) {}
  ~CuptiActivity() override {
    finish();
    std::lock_guard<std::mutex> lock(shared().mu);
    if (shared().owner == this) shared().owner = nullptr;
  }
  CuptiActivity(const CuptiActivity&) = delete;
  CuptiActivity& operator=(const CuptiActivity&) = delete;
  CuptiActivity(CuptiActivity&&) = delete;  // callbacks and the flush thread hold `this`
  CuptiActivity& operator=(CuptiActivity&&) = delete;

  // Registers the callbacks and enables our kinds; on failure undoes what it enabled.
  // `yielding`: another tool owns the activity buffers now; touch nothing until
  // set_yielding(false).
  bool start(bool yielding, std::string* why) {
    // a fresh start: no buffer of an earlier profiler is waited for (one that comes back
    // is still freed as ours), sizes start over
    stop_waiting_for_held();
    shared().buffer_bytes.store(kInitialBuffer, std::memory_order_relaxed);
    shared().declining.store(yielding, std::memory_order_release);
    if (!yielding && !take_over(why)) {
      shared().declining.store(true, std::memory_order_release);
      return false;
    }
    std::lock_guard<std::mutex> control(control_mu_);
    enabled_ = !yielding;
    heard_reset();
    if (yielding) {
      yielding_.store(true);
      set_status("yielding to torch.profiler");
    }
    try {
      flusher_ = start_background_thread([this] { flush_loop(); });
    } catch (const std::system_error& e) {
      enabled_ = false;
      if (!yielding) disable_ours();
      *why = std::string("cannot start the CUPTI flush thread: ") + e.what();
      return false;
    }
    active_.store(!yielding, std::memory_order_release);
    return true;
  }

  const char* name() const noexcept override { return "cupti"; }

  std::int64_t now_ns() noexcept override {
    std::uint64_t t = 0;
    api_.timestamp(&t);
    return static_cast<std::int64_t>(t);
  }

  // Training thread: a timestamp and a store into the mark ring, per boundary.
  void begin_step(std::int64_t step) noexcept override {
    if (!active_.load(std::memory_order_acquire)) return;
    steps_begun_.store(steps_begun_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    marks_.publish(step, /*begin=*/true, now_ns());
    in_step_ = true;
  }

  void end_step(std::int64_t step) noexcept override {
    // closes the step whenever begin_step opened it, even if we started yielding since
    if (!in_step_) return;
    marks_.publish(step, /*begin=*/false, now_ns());
    in_step_ = false;
  }

  void take(std::vector<KernelRecord>& out, std::int64_t* dropped) override {
    std::lock_guard<std::mutex> lock(shared().mu);
    pull_marks();
    records_.take(out);
    if (dropped != nullptr) *dropped += dropped_ + records_.take_lost();
    dropped_ = 0;
  }

  std::uint64_t deliveries() noexcept override {
    return deliveries_.load(std::memory_order_acquire);
  }

  // Every buffer CUPTI held when a step record arrived may hold that step's records
  // (they were written when the step ran, into the buffers that existed then); the
  // record is complete once all of those have come back.
  std::uint64_t delivery_mark() noexcept override {
    return shared().requested.load(std::memory_order_acquire);
  }

  bool delivered(std::uint64_t mark) noexcept override {
    return shared().done_through.load(std::memory_order_acquire) >= mark;
  }

  std::string kernel_name(std::uint32_t name_id) override {
    std::lock_guard<std::mutex> lock(shared().mu);
    return records_.name(name_id);
  }

  // Records of work launched at t_ns went into a buffer of ours that CUPTI asked for, or
  // filled and handed back, at t_ns or later: with no call of our callbacks since, they
  // went to another tool's (or, once stopped, nowhere).
  ActivityReach reach(std::int64_t t_ns) noexcept override {
    // Kernel records come but no launch record has: none of them can be placed in a step
    // (see without_launch_records), so no step's kernels are known. Not zeros.
    if (unattributable_kernels() > 0) return ActivityReach::kStopped;
    const bool heard = shared().callback_ns.load(std::memory_order_acquire) >= t_ns;
    if (heard) return ActivityReach::kReaching;
    return stopped_.load(std::memory_order_acquire) ? ActivityReach::kStopped
                                                    : ActivityReach::kUnheard;
  }

  void set_yielding(bool yielding) noexcept override {
    std::lock_guard<std::mutex> control(control_mu_);
    if (finished_ || yielding == yielding_.load()) return;
    if (yielding) {
      // No new buffer of ours from here on (CUPTI would complete it into the other tool's
      // callbacks, which leave strangers' buffers alone), and ours still in CUPTI come
      // back to us before the other tool's callbacks replace ours. Nothing else is
      // touched: the kinds are now the other's.
      active_.store(false, std::memory_order_release);
      shared().declining.store(true, std::memory_order_release);
      if (enabled_) api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
      enabled_ = false;
      yielding_.store(true);
      {
        std::lock_guard<std::mutex> lock(shared().mu);
        pull_marks();
        records_.drain();
        note_launch_records();
      }
      stop_waiting_for_held();  // one CUPTI kept is completed into the other's callbacks
      deliveries_.fetch_add(1, std::memory_order_acq_rel);
      set_status("yielding to torch.profiler");
      return;
    }
    std::string why;
    yielding_.store(false);
    shared().declining.store(false, std::memory_order_release);
    // records CUPTI dropped meanwhile (ours declined, the other's) are not ours to count
    std::size_t other_drops = 0;
    api_.dropped_records(nullptr, 0, &other_drops);
    if (!take_over(&why)) {
      shared().declining.store(true, std::memory_order_release);
      stopped_.store(true, std::memory_order_release);
      set_status(why);  // stays stopped: the profiler carries on without kernel activity
      return;
    }
    enabled_ = true;
    stopped_.store(false, std::memory_order_release);
    heard_reset();
    set_status("");
    active_.store(true, std::memory_order_release);
  }

  void finish() noexcept override {
    bool ours = false;
    bool unheard = false;
    {
      std::lock_guard<std::mutex> control(control_mu_);
      if (finished_) return;
      finished_ = true;
      ours = enabled_;
      unheard = unheard_;
      enabled_ = false;
      active_.store(false, std::memory_order_release);
    }
    stop_cv_.notify_all();
    if (flusher_.joinable()) flusher_.join();
    if (ours && unheard) {
      // Our callbacks went unheard: if CUPTI still holds a buffer of ours (a device busy
      // all along), this brings it to them; if no callback of ours runs, another tool has
      // them, and the kinds, now its, are left alone.
      const std::uint64_t before = shared().callbacks.load(std::memory_order_acquire);
      api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
      ours = shared().callbacks.load(std::memory_order_acquire) != before;
    }
    // only kinds we enabled are disabled: while yielding they are the other tool's
    if (ours) {
      // flush, disable, flush again: the second flush brings whatever was recorded
      // between the first and the disable
      api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
      disable_ours();
      api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    }
    {
      std::lock_guard<std::mutex> lock(shared().mu);
      pull_marks();
      records_.drain();
      note_launch_records();
      if (shared().owner == this) shared().owner = nullptr;  // a later profiler may collect
    }
    // closed: CUPTI gets no more buffers from us, whoever left kinds enabled
    shared().declining.store(true, std::memory_order_release);
    stop_waiting_for_held();
    stopped_.store(true, std::memory_order_release);
    const std::uint64_t foreign =
        shared().foreign.load(std::memory_order_relaxed) - foreign_at_start_;
    try {
      if (foreign > 0 && status().empty()) {
        set_status(fmt::format(
            "closed; {} activity buffers of another tool reached steptrace's callbacks and were "
            "left alone",
            foreign));
      }
    } catch (...) {
    }
    deliveries_.fetch_add(1, std::memory_order_acq_rel);
  }

  std::string status() const override {
    std::string out;
    {
      std::lock_guard<std::mutex> lock(status_mu_);
      out = status_;
    }
    if (const std::uint64_t n = unattributable_kernels(); n > 0) {
      const bool per_call = per_call_launch_records_.load(std::memory_order_relaxed);
      out += fmt::format(
          "{}{} kernel records came with no launch record at all: the API records of the "
          "launch calls, enabled {}, were never written, so these kernels could not be "
          "attributed to steps (they count as outside_step_records) and step records go "
          "without kernels",
          out.empty() ? "" : "; ", n,
          per_call ? "one call at a time (cuptiActivityEnableRuntimeApi/EnableDriverApi)"
                   : "as the whole RUNTIME and DRIVER kinds");
    }
    return out;
  }

  // The completion callback, with shared().mu held: `requested` buffers had been asked
  // for, and every one numbered below `done_through` is back once this one is parsed.
  void parse(CUcontext context, std::uint32_t stream, std::uint8_t* buffer, std::size_t valid_size,
             std::uint64_t requested, std::uint64_t done_through) noexcept {
    if (yielding_.load()) return;  // a buffer of the other tool's time: not ours to read
    pull_marks();
    records_.begin_buffer(requested);
    CUpti_Activity* record = nullptr;
    while (buffer != nullptr && api_.next_record(buffer, valid_size, &record) == CUPTI_SUCCESS) {
      ParsedRecord p;
      switch (record->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
          const auto* k = reinterpret_cast<const KernelPrefix*>(record);
          p.kind = ParsedRecord::Kind::kKernel;
          p.start_ns = k->start;
          p.end_ns = k->end;
          p.correlation_id = k->correlationId;
          p.name = k->name;
          break;
        }
        case CUPTI_ACTIVITY_KIND_RUNTIME:
        case CUPTI_ACTIVITY_KIND_DRIVER:
        case CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API: {
          const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
          p.kind = ParsedRecord::Kind::kApi;
          p.start_ns = a->start;
          p.end_ns = a->end;
          p.correlation_id = a->correlationId;
          break;
        }
        default:
          break;
      }
      try {
        records_.add(p);
      } catch (...) {
        ++dropped_;  // out of memory: lose the record, not the process
      }
    }
    // any result but MAX_LIMIT_REACHED (an incomplete record) ends the buffer too
    try {
      records_.end_buffer(done_through);
    } catch (...) {
    }
    note_launch_records();
    std::size_t n = 0;
    if (api_.dropped_records(context, stream, &n) == CUPTI_SUCCESS) {
      dropped_ += static_cast<std::int64_t>(n);
    }
  }

 private:
  // Registers our callbacks and kinds. CUPTI completes a buffer into the callbacks
  // registered when it completes: a forced flush first hands the buffers CUPTI holds to
  // their owner's (still registered) callbacks, one after brings us any that slipped in
  // between (those are the other tool's: left alone), so that none of ours is filled
  // from another tool's buffer.
  bool take_over(std::string* why) {
    api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);  // fails harmlessly when none are
    if (!enable_ours(why)) return false;
    api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    return true;
  }

  bool enable_ours(std::string* why) {
    CUptiResult r = api_.register_callbacks(buffer_requested, buffer_completed);
    if (r != CUPTI_SUCCESS) {
      *why = api_.reason("cuptiActivityRegisterCallbacks", r);
      return false;
    }
    // never KIND_KERNEL: it serializes kernels
    r = api_.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (r != CUPTI_SUCCESS) {
      *why = api_.reason("cuptiActivityEnable(CONCURRENT_KERNEL)", r);
      return false;
    }
    if (!enable_launch_records(why)) {
      api_.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
      return false;
    }
    // kernels the driver launches outside any API call (no cbid); absent before 12.x
    internal_launches_ = api_.enable(CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API) == CUPTI_SUCCESS;
    return true;
  }

  // The launch calls' API records: only those calls where CUPTI lets us choose (the
  // records of every runtime and driver call cost each call some time and fill buffers
  // several times faster), else the whole RUNTIME and DRIVER kinds.
  bool enable_launch_records(std::string* why) {
    if (api_.enable_runtime_api != nullptr && api_.enable_driver_api != nullptr) {
      const bool runtime = api_.enable_runtime_api(CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000,
                                                   1) == CUPTI_SUCCESS;
      const bool driver = runtime && api_.enable_driver_api(CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel,
                                                            1) == CUPTI_SUCCESS;
      if (driver) {
        for (CUpti_CallbackId cbid : kRuntimeLaunches) api_.enable_runtime_api(cbid, 1);
        for (CUpti_CallbackId cbid : kDriverLaunches) api_.enable_driver_api(cbid, 1);
        launch_records_ = LaunchRecords::kLaunchCalls;
        per_call_launch_records_.store(true, std::memory_order_relaxed);
        return true;
      }
      if (runtime) api_.enable_runtime_api(CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000, 0);
    }
    CUptiResult r = api_.enable(CUPTI_ACTIVITY_KIND_RUNTIME);
    if (r != CUPTI_SUCCESS) {
      *why = api_.reason("cuptiActivityEnable(RUNTIME)", r);
      return false;
    }
    r = api_.enable(CUPTI_ACTIVITY_KIND_DRIVER);
    if (r != CUPTI_SUCCESS) {
      *why = api_.reason("cuptiActivityEnable(DRIVER)", r);
      api_.disable(CUPTI_ACTIVITY_KIND_RUNTIME);
      return false;
    }
    launch_records_ = LaunchRecords::kWholeApiKinds;
    per_call_launch_records_.store(false, std::memory_order_relaxed);
    return true;
  }

  void disable_ours() noexcept {
    api_.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (launch_records_ == LaunchRecords::kLaunchCalls) {
      for (CUpti_CallbackId cbid : kRuntimeLaunches) api_.enable_runtime_api(cbid, 0);
      for (CUpti_CallbackId cbid : kDriverLaunches) api_.enable_driver_api(cbid, 0);
    } else if (launch_records_ == LaunchRecords::kWholeApiKinds) {
      api_.disable(CUPTI_ACTIVITY_KIND_RUNTIME);
      api_.disable(CUPTI_ACTIVITY_KIND_DRIVER);
    }
    launch_records_ = LaunchRecords::kNone;
    if (internal_launches_) api_.disable(CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API);
    internal_launches_ = false;
  }

  // With shared().mu held: the step boundaries published since the last call.
  void pull_marks() {
    const std::uint64_t lost =
        marks_.consume([this](std::int64_t step, bool begin, std::int64_t t) {
          records_.add_mark(step, begin, t);
        });
    records_.count_lost_marks(lost);
  }

  // Between completions: a buffer can turn stale (kStaleBufferNs) with none coming back.
  void refresh_delivered() noexcept {
    Shared& s = shared();
    std::lock_guard<std::mutex> lock(s.mu);
    std::uint64_t done = 0;
    {
      std::lock_guard<std::mutex> buffers(s.buffers_mu);
      done = s.low_watermark(steady_ns());
    }
    if (done <= s.done_through.load(std::memory_order_relaxed)) return;
    try {
      records_.end_buffer(done);  // kernels whose launch record can no longer come
    } catch (...) {
    }
    note_launch_records();
    s.done_through.store(done, std::memory_order_release);
  }

  // After a forced flush handed back everything CUPTI would give us: a buffer still out
  // will not come back to us (or not soon), so no step record waits for it. It stays in
  // the registry: if it does come back, it is freed as ours.
  static void stop_waiting_for_held() noexcept {
    Shared& s = shared();
    std::lock_guard<std::mutex> lock(s.buffers_mu);
    for (std::size_t i = 0; i < s.n_held; ++i) s.held[i].gating = false;
    const std::uint64_t all = s.requested.load(std::memory_order_relaxed);
    if (s.done_through.load(std::memory_order_relaxed) < all) {
      s.done_through.store(all, std::memory_order_release);
    }
  }

  void flush_loop() noexcept {
    std::unique_lock<std::mutex> control(control_mu_);
    while (!finished_) {
      stop_cv_.wait_for(control, kFlushPeriod, [this] { return finished_; });
      if (finished_) break;
      // not forced: only buffers whose records are complete, so the device is never
      // waited for; while yielding the buffers are the other tool's and nothing is
      // flushed for us
      if (enabled_) {
        const CUptiResult r = api_.flush_all(0);
        // INVALID_OPERATION: "not preceded by cuptiActivityRegisterCallbacks", which we
        // did: CUPTI forgot it, as cuptiFinalize does
        if (r == CUPTI_ERROR_INVALID_OPERATION || detail::cupti::torn_down_result(r)) {
          lose_to_finalize(r);
        } else if (r != CUPTI_SUCCESS && !flush_failed_) {
          flush_failed_ = true;
          set_status(api_.reason("cuptiActivityFlushAll", r));
        }
        if (enabled_) {
          refresh_delivered();
          watch_callbacks();
        }
      }
      deliveries_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  // Flush thread, control_mu_ held: CUPTI's activity state was reset under us. Our
  // callbacks and kinds are gone with it; nothing more is called until a resume
  // (set_yielding(false)) registers them again.
  void lose_to_finalize(CUptiResult r) noexcept {
    enabled_ = false;
    launch_records_ = LaunchRecords::kNone;
    internal_launches_ = false;
    active_.store(false, std::memory_order_release);
    stopped_.store(true, std::memory_order_release);
    const char* text = nullptr;
    if (api_.result_string == nullptr || api_.result_string(r, &text) != CUPTI_SUCCESS) {
      text = nullptr;
    }
    try {
      set_status(detail::cupti::torn_down_reason("kernel activity", "cuptiActivityFlushAll",
                                                 static_cast<int>(r), text != nullptr ? text : ""));
    } catch (...) {
    }
    {
      std::lock_guard<std::mutex> lock(shared().mu);
      pull_marks();
      records_.drain();
      note_launch_records();
    }
    stop_waiting_for_held();
  }

  void heard_reset() noexcept {
    callbacks_seen_ = shared().callbacks.load(std::memory_order_acquire);
    steps_at_callback_ = steps_begun_.load(std::memory_order_relaxed);
    quiet_since_ns_ = steady_ns();
    unheard_ = false;
  }

  // Flush thread, control_mu_ held. With our kinds enabled, a step that launches work
  // makes CUPTI ask our callbacks for a buffer or hand one back. Many steps and seconds
  // with neither mean another tool registered its own callbacks (on-demand Kineto
  // through dynolog, proton): say so, and leave its kinds alone at close. Any call of
  // our callbacks later proves them ours again.
  void watch_callbacks() noexcept {
    const std::uint64_t n = shared().callbacks.load(std::memory_order_acquire);
    const std::uint64_t steps = steps_begun_.load(std::memory_order_relaxed);
    const std::int64_t now = steady_ns();
    if (n != callbacks_seen_) {
      const bool was_unheard = unheard_;
      heard_reset();
      if (was_unheard) set_status("");
      return;
    }
    if (unheard_ || steps - steps_at_callback_ < kQuietSteps || now - quiet_since_ns_ < kQuietNs) {
      return;
    }
    unheard_ = true;
    stop_waiting_for_held();  // ours went to the other tool: no step record waits for them
    try {
      set_status(fmt::format(
          "no activity buffer reached steptrace's callbacks over the last {} steps ({:.0f} s): "
          "another tool (torch.profiler/Kineto on demand through dynolog, proton) has taken "
          "CUPTI's activity callbacks; those steps' kernels are not collected",
          steps - steps_at_callback_, static_cast<double>(now - quiet_since_ns_) / 1e9));
    } catch (...) {
    }
  }

  // With shared().mu held, after kernels were placed: how many came while no launch
  // record ever had. A third party saw this on CUDA 13, with the launch calls' records
  // enabled one call at a time after CUDA had initialized (cupti_activity.h documents no
  // such limit): kernels with correlation ids, and no API record carrying any of them.
  // Counted only while no launch record has come at all: a few kernels launched before our
  // launch records were enabled, with launch records after them, are outside any step.
  void note_launch_records() noexcept {
    const detail::cupti::ActivityStats& st = records_.stats();
    unattributable_.store(st.api_records == 0 ? st.without_launch_records : 0,
                          std::memory_order_release);
  }
  std::uint64_t unattributable_kernels() const noexcept {
    return unattributable_.load(std::memory_order_acquire);
  }

  void set_status(const std::string& s) noexcept {
    try {
      std::lock_guard<std::mutex> lock(status_mu_);
      status_ = s;
    } catch (...) {
    }
  }

  const Api api_;
  const std::uint64_t foreign_at_start_;  // Shared::foreign is process-wide
  MarkRing marks_;                        // training thread -> parser
  bool in_step_ = false;                  // training thread: begin_step published a begin mark
  std::atomic<bool> active_{false};       // mark steps and collect records
  std::atomic<bool> yielding_{false};
  // collection stopped (a foreign finalize, a failed resume, close) until a resume succeeds
  std::atomic<bool> stopped_{false};
  std::atomic<std::uint64_t> steps_begun_{0};  // written by the training thread only
  std::atomic<std::uint64_t> deliveries_{0};
  // guarded by control_mu_ (flush thread, set_yielding, finish)
  std::mutex control_mu_;
  std::condition_variable stop_cv_;
  bool finished_ = false;
  bool enabled_ = false;  // our callbacks are registered and our kinds enabled
  bool flush_failed_ = false;
  bool unheard_ = false;  // our callbacks went unheard over kQuietSteps and kQuietNs
  std::uint64_t callbacks_seen_ = 0;
  std::uint64_t steps_at_callback_ = 0;
  std::int64_t quiet_since_ns_ = 0;
  LaunchRecords launch_records_ = LaunchRecords::kNone;
  std::atomic<bool> per_call_launch_records_{false};  // launch_records_ was kLaunchCalls
  // kernels delivered with no launch record to place them by (note_launch_records)
  std::atomic<std::uint64_t> unattributable_{0};
  bool internal_launches_ = false;
  std::thread flusher_;
  // guarded by shared().mu
  ActivityRecords records_;
  std::int64_t dropped_ = 0;
  mutable std::mutex status_mu_;
  std::string status_;
};

void CUPTIAPI buffer_completed(CUcontext context, std::uint32_t stream, std::uint8_t* buffer,
                               std::size_t /*size*/, std::size_t valid_size) noexcept {
  Shared& s = shared();
  note_callback(s);
  Shared::Held mine{};
  bool ours = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    std::uint64_t requested = 0;
    std::uint64_t done = 0;
    {
      std::lock_guard<std::mutex> buffers(s.buffers_mu);
      ours = s.take_back(buffer, &mine);
      requested = s.requested.load(std::memory_order_relaxed);
      done = s.low_watermark(steady_ns());
    }
    if (!ours) {
      s.foreign.fetch_add(1, std::memory_order_relaxed);
    } else if (s.owner != nullptr) {
      s.owner->parse(context, stream, buffer, valid_size, requested, done);
    }
    // published after the parse: a step record that sees it finds its kernels taken in
    if (s.done_through.load(std::memory_order_relaxed) < done) {
      s.done_through.store(done, std::memory_order_release);
    }
  }
  // another tool's buffer: not read, freed nor pooled (its allocator, its bookkeeping)
  if (buffer == nullptr || !ours) return;
  if (mine.gating) adapt_buffer_size(mine, valid_size);
  release_buffer(buffer, mine.capacity);
}

}  // namespace detail::cupti::activity

std::unique_ptr<KernelActivitySource> make_cupti_activity(std::string* why_not, bool yielding) {
  using detail::cupti::activity::Api;
  using detail::cupti::activity::CuptiActivity;
  using detail::cupti::activity::kOldestVersion;
  using detail::cupti::activity::shared;
  std::string why;
  auto fail = [&](std::string reason) -> std::unique_ptr<KernelActivitySource> {
    if (why_not != nullptr) *why_not = std::move(reason);
    return nullptr;
  };
  const detail::cupti::Library* lib = detail::cupti::load_library({}, &why);
  if (lib == nullptr) return fail(why);
  if (lib->version < kOldestVersion) {
    return fail(detail::cupti::too_old_reason("kernel activity", lib->version, "CUPTI 12.0"));
  }
  if (std::string unreadable = detail::cupti::activity_records_unreadable(*lib);
      !unreadable.empty()) {
    return fail(std::move(unreadable));
  }
  Api api;
  std::string missing;
  if (!api.load(lib->handle, &missing)) {
    return fail(detail::cupti::too_old_reason(
        "kernel activity (" + missing + " missing in " + lib->path + ")", lib->version,
        "CUPTI 12.0"));
  }
  shared().timestamp.store(api.timestamp, std::memory_order_relaxed);
  auto source = std::make_unique<CuptiActivity>(api);
  {
    std::lock_guard<std::mutex> lock(shared().mu);
    if (shared().owner != nullptr) {
      return fail(
          "another steptrace profiler collects kernel activity in this process (CUPTI's "
          "activity buffers are process-wide): one at a time");
    }
    shared().owner = source.get();
  }
  if (!source->start(yielding, &why)) {
    std::lock_guard<std::mutex> lock(shared().mu);
    shared().owner = nullptr;
    return fail(why);
  }
  return source;
}

}  // namespace steptrace

#endif  // STEPTRACE_HAVE_CUPTI_HEADERS
