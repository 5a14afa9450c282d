// Kernel activity through CUPTI's Activity API: CONCURRENT_KERNEL records tagged with the
// step through external correlation ids (CUSTOM2, since Kineto uses CUSTOM0/1). libcupti
// is dlopen'ed (the copy already in the process when torch loaded one); the headers only
// give the record layouts. This file is the thin call layer: the correlation, naming and
// classification logic is in activity_records.cpp. Without the headers it is a stub.
#include "steptrace/backend.hpp"

#if !STEPTRACE_HAVE_CUPTI_HEADERS

namespace steptrace {

std::unique_ptr<KernelActivitySource> make_cupti_activity(std::string* why_not) {
  if (why_not != nullptr) {
    *why_not = "steptrace was built without the CUPTI headers: no kernel activity";
  }
  return nullptr;
}

}  // namespace steptrace

#else  // STEPTRACE_HAVE_CUPTI_HEADERS

#include <cupti_activity.h>
#include <cupti_result.h>
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <system_error>
#include <thread>
#include <type_traits>

#include "activity_records.hpp"
#include "cupti_errors.hpp"
#include "cupti_host.hpp"

namespace steptrace {
namespace {

using detail::cupti::ActivityRecords;
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
STEPTRACE_SAME_PREFIX(CUpti_ActivityKernel10);
#undef STEPTRACE_SAME_PREFIX
// The external-correlation record has kept one layout since CUDA 8.
static_assert(offsetof(CUpti_ActivityExternalCorrelation, externalKind) == 4);
static_assert(offsetof(CUpti_ActivityExternalCorrelation, externalId) == 8);
static_assert(offsetof(CUpti_ActivityExternalCorrelation, correlationId) == 16);
static_assert(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2 ==
              ActivityRecords::Options{}.step_external_kind);

constexpr CUpti_ExternalCorrelationKind kStepKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2;
constexpr std::size_t kBufferBytes = std::size_t{4} << 20;
constexpr std::size_t kBufferAlign = 8;  // CUPTI's requirement for activity buffers
constexpr std::size_t kPoolMax = 8;      // free buffers kept for reuse (32 MiB)
constexpr auto kFlushPeriod = std::chrono::milliseconds(50);
constexpr int kOldestVersion = 18;  // cuptiGetVersion of CUDA 12.0's CUPTI

// The entry points used, resolved from the loaded library.
struct Api {
  decltype(&::cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&::cuptiActivityEnable) enable = nullptr;
  decltype(&::cuptiActivityDisable) disable = nullptr;
  decltype(&::cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&::cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&::cuptiActivityGetNumDroppedRecords) dropped_records = nullptr;
  decltype(&::cuptiActivityPushExternalCorrelationId) push_id = nullptr;
  decltype(&::cuptiActivityPopExternalCorrelationId) pop_id = nullptr;
  decltype(&::cuptiGetTimestamp) timestamp = nullptr;
  decltype(&::cuptiGetResultString) result_string = nullptr;  // optional

  bool load(void* lib, std::string* missing) {
    bool ok = true;
    auto resolve = [&](auto& fn, const char* name) {
      using Fn = std::remove_reference_t<decltype(fn)>;
      fn = reinterpret_cast<Fn>(dlsym(lib, name));
      if (fn == nullptr && ok) {
        *missing = name;
        ok = false;
      }
    };
    resolve(register_callbacks, "cuptiActivityRegisterCallbacks");
    resolve(enable, "cuptiActivityEnable");
    resolve(disable, "cuptiActivityDisable");
    resolve(flush_all, "cuptiActivityFlushAll");
    resolve(next_record, "cuptiActivityGetNextRecord");
    resolve(dropped_records, "cuptiActivityGetNumDroppedRecords");
    resolve(push_id, "cuptiActivityPushExternalCorrelationId");
    resolve(pop_id, "cuptiActivityPopExternalCorrelationId");
    resolve(timestamp, "cuptiGetTimestamp");
    result_string = reinterpret_cast<decltype(result_string)>(dlsym(lib, "cuptiGetResultString"));
    return ok;
  }

  std::string reason(const char* call, CUptiResult r) const {
    const char* text = nullptr;
    if (result_string == nullptr || result_string(r, &text) != CUPTI_SUCCESS) text = nullptr;
    return detail::cupti::unavailable_reason(call, static_cast<int>(r),
                                             text != nullptr ? text : "");
  }
};

class CuptiActivity;

// What CUPTI's process-wide buffer callbacks reach. Leaked on purpose: CUPTI may call
// them after the backend is gone (or at exit), when they only hand buffers back.
struct Shared {
  std::mutex mu;                   // guards owner and the owner's collected state
  CuptiActivity* owner = nullptr;  // the live backend; null when there is none
  std::mutex pool_mu;
  std::uint8_t* pool[kPoolMax] = {};  // free buffers (fixed array: no allocation)
  std::size_t pooled = 0;
};

Shared& shared() {
  static Shared* s = new Shared;  // NOLINT(cppcoreguidelines-owning-memory): see Shared
  return *s;
}

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size,
                               std::size_t* max_records) noexcept {
  Shared& s = shared();
  std::uint8_t* b = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.pool_mu);
    if (s.pooled > 0) b = s.pool[--s.pooled];
  }
  if (b == nullptr) b = static_cast<std::uint8_t*>(std::aligned_alloc(kBufferAlign, kBufferBytes));
  *buffer = b;
  *size = b != nullptr ? kBufferBytes : 0;  // no buffer: CUPTI drops records and counts them
  *max_records = 0;
}

void release_buffer(std::uint8_t* b) noexcept {
  Shared& s = shared();
  {
    std::lock_guard<std::mutex> lock(s.pool_mu);
    if (s.pooled < kPoolMax) {
      s.pool[s.pooled++] = b;
      return;
    }
  }
  std::free(b);  // NOLINT(cppcoreguidelines-no-malloc): from aligned_alloc
}

void CUPTIAPI buffer_completed(CUcontext context, std::uint32_t stream, std::uint8_t* buffer,
                               std::size_t size, std::size_t valid_size) noexcept;

class CuptiActivity final : public KernelActivitySource {
 public:
  explicit CuptiActivity(const Api& api) : api_(api) {}
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
    if (!yielding && !enable_ours(why)) return false;
    std::lock_guard<std::mutex> control(control_mu_);
    enabled_ = !yielding;
    if (yielding) {
      yielding_.store(true);
      set_status("yielding to torch.profiler");
    }
    try {
      flusher_ = std::thread([this] { flush_loop(); });
    } catch (const std::system_error& e) {
      enabled_ = false;
      api_.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
      api_.disable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION);
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

  void begin_step(std::int64_t step) noexcept override {
    if (pushed_) end_step(step);  // an unbalanced begin: keep CUPTI's id stack balanced
    if (!active_.load(std::memory_order_acquire)) return;
    pushed_ = api_.push_id(kStepKind, ActivityRecords::external_id_for_step(step)) == CUPTI_SUCCESS;
  }

  void end_step(std::int64_t /*step*/) noexcept override {
    // pops whenever begin_step pushed, even if we started yielding in between
    if (!pushed_) return;
    std::uint64_t id = 0;
    api_.pop_id(kStepKind, &id);
    pushed_ = false;
  }

  void take(std::vector<KernelRecord>& out, std::int64_t* dropped) override {
    std::lock_guard<std::mutex> lock(shared().mu);
    records_.take(out);
    if (dropped != nullptr) *dropped += dropped_ + records_.take_lost();
    dropped_ = 0;
  }

  std::uint64_t deliveries() noexcept override {
    return deliveries_.load(std::memory_order_acquire);
  }

  std::string kernel_name(std::uint32_t name_id) override {
    std::lock_guard<std::mutex> lock(shared().mu);
    return records_.name(name_id);
  }

  void set_yielding(bool yielding) noexcept override {
    std::lock_guard<std::mutex> control(control_mu_);
    if (finished_ || yielding == yielding_.load()) return;
    if (yielding) {
      // our records still in CUPTI's buffers come to us before the other tool's
      // callbacks replace ours; nothing else is touched: the kinds are now the other's
      active_.store(false, std::memory_order_release);
      if (enabled_) api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
      enabled_ = false;
      yielding_.store(true);
      {
        std::lock_guard<std::mutex> lock(shared().mu);
        records_.drain();
      }
      deliveries_.fetch_add(1, std::memory_order_acq_rel);
      set_status("yielding to torch.profiler");
      return;
    }
    std::string why;
    yielding_.store(false);
    if (!enable_ours(&why)) {
      set_status(why);  // stays stopped: the profiler carries on without kernel activity
      return;
    }
    enabled_ = true;
    set_status("");
    active_.store(true, std::memory_order_release);
  }

  void finish() noexcept override {
    bool ours = false;
    {
      std::lock_guard<std::mutex> control(control_mu_);
      if (finished_) return;
      finished_ = true;
      ours = enabled_;
      enabled_ = false;
      active_.store(false, std::memory_order_release);
    }
    stop_cv_.notify_all();
    if (flusher_.joinable()) flusher_.join();
    // only kinds we enabled are disabled: while yielding they are the other tool's
    if (ours) {
      // flush, disable, flush again: the second flush brings whatever was recorded
      // between the first and the disable
      api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
      api_.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
      api_.disable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION);
      api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    }
    {
      std::lock_guard<std::mutex> lock(shared().mu);
      records_.drain();
      if (shared().owner == this) shared().owner = nullptr;  // a later profiler may collect
    }
    deliveries_.fetch_add(1, std::memory_order_acq_rel);
  }

  std::string status() const override {
    std::lock_guard<std::mutex> lock(status_mu_);
    return status_;
  }

  // The completion callback, with shared().mu held.
  void parse(CUcontext context, std::uint32_t stream, std::uint8_t* buffer,
             std::size_t valid_size) noexcept {
    if (yielding_.load()) return;  // a buffer of the other tool's time: not ours to read
    CUpti_Activity* record = nullptr;
    while (api_.next_record(buffer, valid_size, &record) == CUPTI_SUCCESS) {
      ParsedRecord p;
      if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
        const auto* k = reinterpret_cast<const KernelPrefix*>(record);
        p.kind = ParsedRecord::Kind::kKernel;
        p.start_ns = k->start;
        p.end_ns = k->end;
        p.correlation_id = k->correlationId;
        p.name = k->name;
      } else if (record->kind == CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION) {
        const auto* c = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(record);
        p.kind = ParsedRecord::Kind::kExternalCorrelation;
        p.external_kind = static_cast<int>(c->externalKind);
        p.external_id = c->externalId;
        p.correlation_id = c->correlationId;
      }
      try {
        records_.add(p);
      } catch (...) {
        ++dropped_;  // out of memory: lose the record, not the process
      }
    }
    // any result but MAX_LIMIT_REACHED (an incomplete record) ends the buffer too
    std::size_t n = 0;
    if (api_.dropped_records(context, stream, &n) == CUPTI_SUCCESS) {
      dropped_ += static_cast<std::int64_t>(n);
    }
  }

 private:
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
    r = api_.enable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION);
    if (r != CUPTI_SUCCESS) {
      *why = api_.reason("cuptiActivityEnable(EXTERNAL_CORRELATION)", r);
      api_.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
      return false;
    }
    return true;
  }

  void flush_loop() noexcept {
    std::unique_lock<std::mutex> control(control_mu_);
    while (!finished_) {
      stop_cv_.wait_for(control, kFlushPeriod, [this] { return finished_; });
      if (finished_) break;
      // not forced: only completed records, so the device is never waited for; while
      // yielding the buffers are the other tool's and nothing is flushed for us
      if (enabled_) {
        const CUptiResult r = api_.flush_all(0);
        if (r != CUPTI_SUCCESS && !flush_failed_) {
          flush_failed_ = true;
          set_status(api_.reason("cuptiActivityFlushAll", r));
        }
      }
      {
        std::lock_guard<std::mutex> lock(shared().mu);
        records_.end_delivery();
      }
      deliveries_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void set_status(const std::string& s) noexcept {
    try {
      std::lock_guard<std::mutex> lock(status_mu_);
      status_ = s;
    } catch (...) {
    }
  }

  const Api api_;
  // training thread: whether an id is pushed now (begin_step and end_step only)
  bool pushed_ = false;
  std::atomic<bool> active_{false};  // tag steps and collect records
  std::atomic<bool> yielding_{false};
  std::atomic<std::uint64_t> deliveries_{0};
  // guarded by control_mu_ (flush thread, set_yielding, finish)
  std::mutex control_mu_;
  std::condition_variable stop_cv_;
  bool finished_ = false;
  bool enabled_ = false;  // our callbacks are registered and our kinds enabled
  bool flush_failed_ = false;
  std::thread flusher_;
  // guarded by shared().mu
  ActivityRecords records_;
  std::int64_t dropped_ = 0;
  mutable std::mutex status_mu_;
  std::string status_;
};

void CUPTIAPI buffer_completed(CUcontext context, std::uint32_t stream, std::uint8_t* buffer,
                               std::size_t /*size*/, std::size_t valid_size) noexcept {
  {
    std::lock_guard<std::mutex> lock(shared().mu);
    if (shared().owner != nullptr) shared().owner->parse(context, stream, buffer, valid_size);
  }
  if (buffer != nullptr) release_buffer(buffer);
}

}  // namespace

std::unique_ptr<KernelActivitySource> make_cupti_activity(std::string* why_not, bool yielding) {
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
  Api api;
  std::string missing;
  if (!api.load(lib->handle, &missing)) {
    return fail(detail::cupti::too_old_reason(
        "kernel activity (" + missing + " missing in " + lib->path + ")", lib->version,
        "CUPTI 12.0"));
  }
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
