// LibTorch adapter: per-step statistics of torch's CUDA caching allocator, through c10's
// device-generic allocator interface (so this file needs no CUDA headers).
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include "../backends/host/rss_source.hpp"
#include "steptrace/torch.hpp"

namespace steptrace {
namespace {

class TorchCudaAllocatorSource final : public MemorySource {
 public:
  explicit TorchCudaAllocatorSource(c10::DeviceAllocator* allocator) : allocator_(allocator) {}

  const char* name() const noexcept override { return "torch_cuda_allocator"; }

  std::int64_t live_bytes() noexcept override {
    try {
      const auto device = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
      constexpr auto kAll = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
      return allocator_->getDeviceStats(device).allocated_bytes[kAll].current;
    } catch (...) {
      return -1;
    }
  }

  void sample(MemorySample& out) noexcept override {
    try {
      const auto device = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
      const auto stats = allocator_->getDeviceStats(device);
      constexpr auto kAll = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
      out.allocated_bytes = stats.allocated_bytes[kAll].current;
      out.reserved_bytes = stats.reserved_bytes[kAll].current;
      out.peak_bytes = stats.allocated_bytes[kAll].peak;
      // The next step's peak starts from what is allocated now.
      allocator_->resetPeakStats(device);
    } catch (...) {
      // A failing allocator query must not stop training; the step has no torch figures.
    }
  }

 private:
  c10::DeviceAllocator* allocator_;
};

}  // namespace

std::unique_ptr<MemorySource> make_torch_memory_source() {
  try {
    if (!torch::cuda::is_available()) return nullptr;
    auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
    if (allocator == nullptr || !allocator->initialized()) return nullptr;
    return std::make_unique<TorchCudaAllocatorSource>(allocator);
  } catch (...) {
    return nullptr;
  }
}

Backends torch_backends() {
  Backends backends;
  detail::add_default_rss_source(backends.memory_sources);
  if (auto torch_source = make_torch_memory_source()) {
    backends.memory_sources.push_back(std::move(torch_source));
  }
  backends.stream_source = make_torch_stream_source();
  return backends;
}

}  // namespace steptrace
