// LibTorch adapter: c10's current CUDA stream, so that device events go where the
// trainer's kernels go. Needs c10/cuda (CUDA headers); without them, no stream source.
#include <memory>

#include "steptrace/torch.hpp"

#if defined(STEPTRACE_TORCH_CUDA)
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>
#endif

namespace steptrace {

#if defined(STEPTRACE_TORCH_CUDA)
namespace {

class TorchCudaStreamSource final : public StreamSource {
 public:
  bool current(DeviceStream* stream) noexcept override {
    try {
      const c10::cuda::CUDAStream s = c10::cuda::getCurrentCUDAStream();
      *stream = DeviceStream{reinterpret_cast<std::uintptr_t>(s.stream()), s.device_index()};
      return true;
    } catch (...) {
      return false;  // the step uses the host clock
    }
  }
};

}  // namespace

std::unique_ptr<StreamSource> make_torch_stream_source() {
  try {
    if (!torch::cuda::is_available()) return nullptr;
  } catch (...) {
    return nullptr;
  }
  return std::make_unique<TorchCudaStreamSource>();
}
#else
std::unique_ptr<StreamSource> make_torch_stream_source() { return nullptr; }
#endif

}  // namespace steptrace
