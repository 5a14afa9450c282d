// The CUDA event timer: pooled events recorded on the caller's stream, queried later.
#include <fmt/format.h>

#include <vector>

#include "cuda_driver.hpp"
#include "steptrace/backend.hpp"

namespace steptrace {
namespace {

using namespace detail::cuda;

class CudaTimer final : public DeviceTimer {
 public:
  explicit CudaTimer(Driver driver) : d_(driver) {}
  ~CudaTimer() override {
    for (CUevent e : events_) {
      if (e != nullptr) d_.cuEventDestroy(e);
    }
  }
  CudaTimer(const CudaTimer&) = delete;
  CudaTimer& operator=(const CudaTimer&) = delete;

  const char* name() const noexcept override { return "cuda"; }

  int record(std::uintptr_t stream) noexcept override {
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
    const CUresult r = d_.cuEventQuery(events_[event]);
    if (r == kSuccess) return Status::kReady;
    if (r == kNotReady) return Status::kPending;
    fail("cuEventQuery", r);
    return Status::kError;
  }

  bool elapsed_ms(int start, int end, float* ms) noexcept override {
    const CUresult r = d_.cuEventElapsedTime(ms, events_[start], events_[end]);
    if (r != kSuccess) fail("cuEventElapsedTime", r);
    return r == kSuccess;
  }

  bool synchronize(int event) noexcept override {
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
