// Dense peak FLOP/s by device and math dtype, from vendor datasheets (issue 28: MFU).
#pragma once
#include <optional>
#include <string>
#include <string_view>
namespace steptrace::detail {
enum class MathDtype : unsigned char { kBf16, kFp16, kTf32, kFp32, kFp8 };
/// "bf16", "fp16", "tf32", "fp32", "fp8" (exactly these); nullopt otherwise.
std::optional<MathDtype> parse_math_dtype(std::string_view name) noexcept;
const char* math_dtype_name(MathDtype d) noexcept;
struct PeakFlops {
  double tflops = 0;   // dense (no structured sparsity), per device
  std::string chip;    // the table row that matched, e.g. "H100 SXM"
  std::string source;  // the datasheet it comes from (short title + URL)
};
/// The vendor's dense peak for a device as CUDA / NVML / ROCm name it (e.g. "NVIDIA H100
/// 80GB HBM3", "NVIDIA A100-SXM4-80GB", "AMD Instinct MI300X"). nullopt for a device not in
/// the table or a dtype the chip has no tensor-core rate for (e.g. fp8 on A100); then
/// *why (when not null) says which, naming the device and dtype. Never falls back to
/// another chip.
std::optional<PeakFlops> lookup_peak_flops(std::string_view device_name, MathDtype dtype,
                                           std::string* why = nullptr);
}  // namespace steptrace::detail
