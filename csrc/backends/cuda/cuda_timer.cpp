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

class CudaTimer final : public DeviceTimer {
 public:
  explicit CudaTimer(Driver driver) : d_(driver) {}
  ~CudaTimer() override {
    RelaxedCaptureMode relaxed(d_);
    for (CUevent e : events_) {
      if (e != nullptr) d_.cuEventDestroy(e);
    }
  }
  CudaTimer(const CudaTimer&) = delete;
  CudaTimer& operator=(const CudaTimer&) = delete;

  const char* name() const noexcept override { return "cuda"; }

  int record(std::uintptr_t stream) noexcept override {
    RelaxedCaptureMode relaxed(d_);
    int status = kCaptureStatusNone;
    const CUresult c = d_.cuStreamIsCapturing(reinterpret_cast<CUstream>(stream), &status);
    if (c == kStreamCaptureImplicit || (c == kSuccess && status != kCaptureStatusNone)) {
      return kCapturedStream;
    }
    if (c != kSuccess) {
      fail("cuStreamIsCapturing", c);
      return -1;
    }
    const int h = acquire();
    if (h < 0) return -1;
    const CUresult r = d_.cuEventRecord(events_[h], reinterpret_cast<CUstream>(stream));
    if (r != kSuccess) {
      fail("cuEventRecord", r);
      release(h);
      return -1;
    }
    return h;
  }

  Status query(int event) noexcept override {
    RelaxedCaptureMode relaxed(d_);
    const CUresult r = d_.cuEventQuery(events_[event]);
    if (r == kSuccess) return Status::kReady;
    if (r == kNotReady) return Status::kPending;
    fail("cuEventQuery", r);
    return Status::kError;
  }

  bool elapsed_ms(int start, int end, float* ms) noexcept override {
    RelaxedCaptureMode relaxed(d_);
    const CUresult r = d_.cuEventElapsedTime(ms, events_[start], events_[end]);
    if (r != kSuccess) fail("cuEventElapsedTime", r);
    return r == kSuccess;
  }

  bool synchronize(int event) noexcept override {
    RelaxedCaptureMode relaxed(d_);
    const CUresult r = d_.cuEventSynchronize(events_[event]);
    if (r != kSuccess) fail("cuEventSynchronize", r);
    return r == kSuccess;
  }

  void release(int event) noexcept override {
    free_.push_back(event);
    --live_;
  }

  int live_events() const noexcept override { return live_; }
  std::string last_error() const override { return error_; }

  std::string device_name() const override {
    CUdevice dev = 0;
    char name[256] = {};
    if (d_.cuCtxGetDevice(&dev) != kSuccess) return {};
    if (d_.cuDeviceGetName(name, sizeof(name) - 1, dev) != kSuccess) return {};
    return name;
  }

  std::int64_t device_memory_bytes() const override {
    CUdevice dev = 0;
    std::size_t bytes = 0;
    if (d_.cuCtxGetDevice(&dev) != kSuccess) return -1;
    if (d_.cuDeviceTotalMem(&bytes, dev) != kSuccess) return -1;
    return static_cast<std::int64_t>(bytes);
  }

 private:
  int acquire() noexcept {
    try {
      if (free_.empty()) {
        CUevent e = nullptr;
        const CUresult r = d_.cuEventCreate(&e, 0);  // timing enabled
        if (r != kSuccess) {
          fail("cuEventCreate", r);
          return -1;
        }
        events_.push_back(e);  // the pool grows to the in-flight bound, then is reused
        free_.push_back(static_cast<int>(events_.size() - 1));
      }
    } catch (...) {
      return -1;
    }
    const int h = free_.back();
    free_.pop_back();
    ++live_;
    return h;
  }

  void fail(const char* call, CUresult r) noexcept {
    try {
      error_ = fmt::format("{} failed: {}", call, d_.error_name(r));
    } catch (...) {
    }
  }

  Driver d_;
  std::vector<CUevent> events_;
  std::vector<int> free_;
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
