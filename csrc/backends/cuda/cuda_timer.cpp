// The CUDA event timer: pooled events recorded on the caller's stream, queried later.
//
// CUDA graph capture (a user's torch.cuda.graph, torch.compile's cudagraphs, on this
// thread or another) must never be broken by the profiler:
// - No event is recorded on a stream that is capturing (cuStreamIsCapturing says ACTIVE or
//   INVALIDATED; on the legacy stream, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT means a blocking
//   stream is capturing and the legacy stream is unusable): the record would be captured
//   into the user's graph, and a later query of it fails with CUDA_ERROR_CAPTURED_EVENT.
//   record() then returns kCapturedStream and the caller times that step on the host.
// - Every event call runs with this thread's capture interaction mode switched to
//   CU_STREAM_CAPTURE_MODE_RELAXED and restored after (push-pop, as the documentation of
//   cuThreadExchangeStreamCaptureMode recommends). In the default GLOBAL mode a thread "is
//   prohibited from potentially unsafe API calls" while any other thread has a capture
//   begun in GLOBAL mode (torch.cuda.graph's default), and an event query is such a call:
//   it fails and invalidates the other thread's capture (PyTorch moved its NCCL watchdog's
//   cudaEventQuery out of GLOBAL mode for this, pytorch/pytorch#104555 and #148594). In
//   RELAXED mode "the local thread is not prohibited from potentially unsafe API calls";
//   THREAD_LOCAL would not do, since it still prohibits them while this thread's own
//   capture is under way (a step that begins inside torch.cuda.graph on the training
//   thread polls the earlier steps' events). The events queried were all recorded outside
//   any capture, so none of them "necessarily conflicts with stream capture".
#include <fmt/format.h>

#include <utility>
#include <vector>

#include "cuda_driver.hpp"
#include "steptrace/backend.hpp"

namespace steptrace {
namespace {

using namespace detail::cuda;

// What record() returns when the stream is capturing: no event, not a failure. Must match
// detail::kRecordCaptured (core/device_timing.hpp), the caller's name for it.
constexpr int kCapturedStream = -2;

// This thread in CU_STREAM_CAPTURE_MODE_RELAXED for the guard's lifetime (see the top).
class RelaxedCaptureMode {
 public:
  explicit RelaxedCaptureMode(const Driver& d) noexcept : d_(d) {
    ok_ = d_.cuThreadExchangeStreamCaptureMode(&mode_) == kSuccess;
  }
  ~RelaxedCaptureMode() {
    if (ok_) d_.cuThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  const Driver& d_;
  int mode_ = kCaptureModeRelaxed;  // then the mode to restore
  bool ok_ = false;
};

// The stream's context current on this thread for the guard's lifetime: pushed when
// another (or none) is current, popped after. Events are created "for the current
// context" (cuEventCreate) and "hEvent and hStream must be from the same context
// otherwise CUDA_ERROR_INVALID_HANDLE is returned" (cuEventRecord, cuda.h), so an event is
// created and recorded with its stream's context current, whichever context the training
// thread has (a step inside `with torch.cuda.device(i)`, a thread that never made one).
class StreamContextScope {
 public:
  StreamContextScope(const Driver& d, CUcontext ctx) noexcept : d_(d) {
    CUcontext current = nullptr;
    result_ = d_.cuCtxGetCurrent(&current);
    if (result_ == kSuccess && current != ctx) {
      result_ = d_.cuCtxPushCurrent(ctx);
      pushed_ = result_ == kSuccess;
    }
  }
  ~StreamContextScope() {
    CUcontext popped = nullptr;
    if (pushed_) d_.cuCtxPopCurrent(&popped);
  }
  StreamContextScope(const StreamContextScope&) = delete;
  StreamContextScope& operator=(const StreamContextScope&) = delete;
  CUresult result() const noexcept { return result_; }

 private:
  const Driver& d_;
  CUresult result_ = kSuccess;
  bool pushed_ = false;
};

// The default streams' handles: the NULL stream, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD.
// "Specifying any of the special handles will return the context current to the calling
// thread" (cuStreamGetCtx).
bool default_stream(std::uintptr_t handle) { return handle <= 2; }

// Events are pooled per context (an event belongs to the context it was created in).
// Queries, waits and elapsed times need no context current: "cudaEventQuery() and
// cudaEventSynchronize() will succeed even if the input event is associated to a device
// that is different from the current device" (CUDA C++ Programming Guide, Stream and
// Event Behavior); elapsed times are only taken between one step's events, all on one
// stream (DeviceTiming), never across devices, where cudaEventElapsedTime "will fail".
class CudaTimer final : public DeviceTimer {
 public:
  explicit CudaTimer(Driver driver) : d_(driver) {}
  ~CudaTimer() override {
    RelaxedCaptureMode relaxed(d_);
    for (const Event& e : events_) d_.cuEventDestroy(e.event);
    for (const auto& [device, ctx] : primaries_) d_.cuDevicePrimaryCtxRelease(device);
  }
  CudaTimer(const CudaTimer&) = delete;
  CudaTimer& operator=(const CudaTimer&) = delete;

  const char* name() const noexcept override { return "cuda"; }

  int record(DeviceStream stream) noexcept override {
    RelaxedCaptureMode relaxed(d_);
    CUcontext ctx = nullptr;
    if (!stream_context(stream, &ctx)) return -1;
    StreamContextScope scope(d_, ctx);
    if (scope.result() != kSuccess) {
      fail("cuCtxPushCurrent", scope.result());
      return -1;
    }
    // torch's cudaStream_t comes as an integer
    const auto s = reinterpret_cast<CUstream>(stream.handle);  // NOLINT(performance-no-int-to-ptr)
    int status = kCaptureStatusNone;
    const CUresult c = d_.cuStreamIsCapturing(s, &status);
    if (c == kStreamCaptureImplicit || (c == kSuccess && status != kCaptureStatusNone)) {
      return kCapturedStream;
    }
    if (c != kSuccess) {
      fail("cuStreamIsCapturing", c);
      return -1;
    }
    const int h = acquire(ctx);
    if (h < 0) return -1;
    const CUresult r = d_.cuEventRecord(events_[h].event, s);
    if (r != kSuccess) {
      fail("cuEventRecord", r);
      release(h);
      return -1;
    }
    return h;
  }

  Status query(int event) noexcept override {
    RelaxedCaptureMode relaxed(d_);
    const CUresult r = d_.cuEventQuery(events_[event].event);
    if (r == kSuccess) return Status::kReady;
    if (r == kNotReady) return Status::kPending;
    fail("cuEventQuery", r);
    return Status::kError;
  }

  bool elapsed_ms(int start, int end, float* ms) noexcept override {
    RelaxedCaptureMode relaxed(d_);
    const CUresult r = d_.cuEventElapsedTime(ms, events_[start].event, events_[end].event);
    if (r != kSuccess) fail("cuEventElapsedTime", r);
    return r == kSuccess;
  }

  bool synchronize(int event) noexcept override {
    RelaxedCaptureMode relaxed(d_);
    const CUresult r = d_.cuEventSynchronize(events_[event].event);
    if (r != kSuccess) fail("cuEventSynchronize", r);
    return r == kSuccess;
  }

  void release(int event) noexcept override {
    pools_[static_cast<std::size_t>(events_[event].pool)].free.push_back(event);
    --live_;
  }

  int live_events() const noexcept override { return live_; }
  std::string last_error() const override { return error_; }

  std::string device_name() const override {
    CUdevice dev = 0;
    char name[256] = {};
    if (!device(&dev)) return {};
    if (d_.cuDeviceGetName(name, sizeof(name) - 1, dev) != kSuccess) return {};
    return name;
  }

  std::int64_t device_memory_bytes() const override {
    CUdevice dev = 0;
    std::size_t bytes = 0;
    if (!device(&dev)) return -1;
    if (d_.cuDeviceTotalMem(&bytes, dev) != kSuccess) return -1;
    return static_cast<std::int64_t>(bytes);
  }

 private:
  struct Event {
    CUevent event;
    int pool;
  };
  struct Pool {
    CUcontext ctx;
    CUdevice device;
    std::vector<int> free;  // released events, reused before new ones are created
  };

  // The context of the stream: a created stream's own (asked once per handle: torch never
  // destroys its streams); a default stream's is the named device's primary context (what
  // torch's current_stream(device) means), else the thread's current one.
  bool stream_context(DeviceStream stream, CUcontext* ctx) noexcept {
    if (!default_stream(stream.handle)) {
      if (stream.handle != known_stream_) {
        // torch's cudaStream_t comes as an integer
        // NOLINTNEXTLINE(performance-no-int-to-ptr)
        const CUresult r = d_.cuStreamGetCtx(reinterpret_cast<CUstream>(stream.handle), ctx);
        if (r != kSuccess) {
          fail("cuStreamGetCtx", r);
          return false;
        }
        known_stream_ = stream.handle;
        known_stream_ctx_ = *ctx;
      }
      *ctx = known_stream_ctx_;
      return true;
    }
    if (stream.device >= 0) return primary_context(stream.device, ctx);
    const CUresult r = d_.cuCtxGetCurrent(ctx);
    if (r != kSuccess || *ctx == nullptr) {
      error_ =
          "no CUDA context is current on the training thread and the default stream's device "
          "is unknown (pass the device with the stream)";
      return false;
    }
    return true;
  }

  // The device's primary context, retained once for the timer's lifetime (the framework
  // has it already; the retain keeps it alive while events in it are pooled).
  bool primary_context(int device, CUcontext* ctx) noexcept {
    for (const auto& [dev, c] : primaries_) {
      if (dev == device) {
        *ctx = c;
        return true;
      }
    }
    const CUresult r = d_.cuDevicePrimaryCtxRetain(ctx, device);
    if (r != kSuccess) {
      fail("cuDevicePrimaryCtxRetain", r);
      return false;
    }
    try {
      primaries_.emplace_back(device, *ctx);
    } catch (...) {
      d_.cuDevicePrimaryCtxRelease(device);
      return false;
    }
    return true;
  }

  // An event of ctx's pool; ctx is current (StreamContextScope).
  int acquire(CUcontext ctx) noexcept {
    try {
      if (last_pool_ < 0 || pools_[static_cast<std::size_t>(last_pool_)].ctx != ctx) {
        last_pool_ = -1;
        for (std::size_t i = 0; i < pools_.size(); ++i) {
          if (pools_[i].ctx == ctx) last_pool_ = static_cast<int>(i);
        }
        if (last_pool_ < 0) {
          CUdevice device = -1;
          if (d_.cuCtxGetDevice(&device) != kSuccess) device = -1;
          pools_.push_back(Pool{ctx, device, {}});
          last_pool_ = static_cast<int>(pools_.size() - 1);
        }
      }
      Pool& pool = pools_[static_cast<std::size_t>(last_pool_)];
      if (pool.free.empty()) {
        CUevent e = nullptr;
        const CUresult r = d_.cuEventCreate(&e, 0);  // timing enabled
        if (r != kSuccess) {
          fail("cuEventCreate", r);
          return -1;
        }
        events_.push_back(Event{e, last_pool_});  // a pool grows to the in-flight bound
        pool.free.push_back(static_cast<int>(events_.size() - 1));
      }
      const int h = pool.free.back();
      pool.free.pop_back();
      ++live_;
      return h;
    } catch (...) {
      return -1;
    }
  }

  // The device of the last context events were recorded in, else the current one's.
  bool device(CUdevice* dev) const noexcept {
    if (last_pool_ >= 0 && pools_[static_cast<std::size_t>(last_pool_)].device >= 0) {
      *dev = pools_[static_cast<std::size_t>(last_pool_)].device;
      return true;
    }
    return d_.cuCtxGetDevice(dev) == kSuccess;
  }

  void fail(const char* call, CUresult r) noexcept {
    try {
      error_ = fmt::format("{} failed: {}", call, d_.error_name(r));
    } catch (...) {
    }
  }

  Driver d_;
  std::vector<Event> events_;
  std::vector<Pool> pools_;
  int last_pool_ = -1;
  std::vector<std::pair<CUdevice, CUcontext>> primaries_;  // retained by this timer
  std::uintptr_t known_stream_ = 0;                        // the last created stream seen
  CUcontext known_stream_ctx_ = nullptr;
  int live_ = 0;
  std::string error_;
};

}  // namespace

std::unique_ptr<DeviceTimer> make_cuda_timer(std::string* why_not) {
  std::string why;
  Driver driver;
  if (!driver.load(&why)) {
    if (why_not != nullptr) *why_not = why;
    return nullptr;
  }
  return std::make_unique<CudaTimer>(driver);
}

}  // namespace steptrace
