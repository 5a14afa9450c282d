#include "peak_flops.hpp"

#include <cctype>
#include <vector>

namespace steptrace::detail {
namespace {

// One row per chip. Every figure is the vendor's DENSE rate in TFLOP/s per device. NVIDIA's
// datasheets print the tensor-core rates with 2:4 structured sparsity and mark them "*"
// ("Shown with sparsity. Specifications are one-half lower without sparsity."): those are
// stored halved. Where a datasheet prints the dense figure itself, it is stored as printed.
// fp32 is the plain (non-tensor) FP32 rate on every NVIDIA row: NVIDIA's tensor cores have
// no FP32 mode that is not TF32, so an fp32 matmul without TF32 runs on the CUDA cores.
// 0 = the datasheet gives no rate for that dtype (fp8 before Hopper / Ada): no MFU then.
struct Row {
  const char* chip;
  const char* source;
  double bf16, fp16, tf32, fp32, fp8;
};

constexpr char kA100Sheet[] =
    "NVIDIA A100 Tensor Core GPU datasheet, "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf";
constexpr char kH100Sheet[] =
    "NVIDIA H100 Tensor Core GPU datasheet, "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet";
constexpr char kH200Sheet[] =
    "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/";
constexpr char kHgxSheet[] =
    "NVIDIA HGX platform specifications (HGX B200, per GPU), "
    "https://www.nvidia.com/en-us/data-center/hgx/";
constexpr char kL40sSheet[] =
    "NVIDIA L40S GPU datasheet, https://www.nvidia.com/en-us/data-center/l40s/";
constexpr char kL4Sheet[] =
    "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/";
constexpr char kA10Sheet[] =
    "NVIDIA A10 Tensor Core GPU datasheet, "
    "https://www.nvidia.com/en-us/data-center/products/a10-gpu/";
constexpr char kMi300xSheet[] =
    "AMD Instinct MI300X accelerator data sheet, "
    "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
    "amd-instinct-mi300x-data-sheet.pdf";

constexpr Row kRows[] = {
    // A100 (SXM4 and PCIe, 40 GB and 80 GB: one set of peaks for all four). Printed:
    // FP32 19.5 TFLOPS; TF32 Tensor Core 156 TFLOPS | 312 TFLOPS*; BFLOAT16 and FP16 Tensor
    // Core 312 TFLOPS | 624 TFLOPS* (dense | sparse, both printed). No FP8.
    {"A100", kA100Sheet, 312, 312, 156, 19.5, 0},
    // H100 SXM. Printed: FP32 67 teraFLOPS; TF32 Tensor Core 989 teraFLOPS*; BFLOAT16 and
    // FP16 Tensor Core 1,979 teraFLOPS*; FP8 Tensor Core 3,958 teraFLOPS* (* with sparsity).
    {"H100 SXM", kH100Sheet, 989.5, 989.5, 494.5, 67, 1979},
    // H100 PCIe (350 W): the PCIe column of the datasheet's 2022 revision (later revisions
    // list SXM and NVL only). Printed: FP32 51 teraFLOPS; TF32
    // 756 teraFLOPS*; BFLOAT16 and FP16 1,513 teraFLOPS*; FP8 3,026 teraFLOPS*.
    {"H100 PCIe", kH100Sheet, 756.5, 756.5, 378, 51, 1513},
    // H100 NVL (per GPU, 94 GB; the 2023 revision printed the figures for a bridged pair,
    // twice these). Printed: FP32 60 teraFLOPS; TF32 835 teraFLOPS*; BFLOAT16
    // and FP16 1,671 teraFLOPS*; FP8 3,341 teraFLOPS*.
    {"H100 NVL", kH100Sheet, 835.5, 835.5, 417.5, 60, 1670.5},
    // H200 SXM (141 GB). Printed: FP32 67 TFLOPS; TF32 Tensor Core 989 TFLOPS*; BFLOAT16 and
    // FP16 Tensor Core 1,979 TFLOPS*; FP8 Tensor Core 3,958 TFLOPS* (same die as H100 SXM).
    {"H200 SXM", kH200Sheet, 989.5, 989.5, 494.5, 67, 1979},
    // H200 NVL. Printed: FP32 60 TFLOPS; TF32 835 TFLOPS*; BFLOAT16 and FP16 1,671 TFLOPS*;
    // FP8 3,341 TFLOPS*.
    {"H200 NVL", kH200Sheet, 835.5, 835.5, 417.5, 60, 1670.5},
    // B200 as HGX B200 / DGX B200 run it (1,000 W), per GPU. Printed: FP32 75 TFLOPS; TF32
    // Tensor Core 2.2 PFLOPS*; FP16/BF16 Tensor Core 4.5 PFLOPS*; FP8/FP6 Tensor Core
    // 9 PFLOPS* (* with sparsity). The GB200 part (1,200 W) is rated higher and is not this
    // row. TF32 1.1 = half the printed (rounded) 2.2.
    {"B200", kHgxSheet, 2250, 2250, 1100, 75, 4500},
    // L40S. The datasheet prints dense | sparse: FP32 91.6 TFLOPS; TF32 Tensor Core 183 |
    // 366*; BFLOAT16 and FP16 Tensor Core 362.05 | 733*; FP8 Tensor Core 733 | 1,466*. The
    // printed dense 16-bit figure (362.05) is stored, not half of 733.
    {"L40S", kL40sSheet, 362.05, 362.05, 183, 91.6, 733},
    // L4. Printed: FP32 30.3 teraFLOPs; TF32 Tensor Core 120 teraFLOPS*; FP16 and BFLOAT16
    // Tensor Core 242 teraFLOPS*; FP8 Tensor Core 485 teraFLOPS* (* with sparsity).
    {"L4", kL4Sheet, 121, 121, 60, 30.3, 242.5},
    // A10 (PCIe, 150 W). Printed: FP32 31.2 teraFLOPS; TF32 Tensor Core 62.5 | 125
    // teraFLOPS*; BFLOAT16 and FP16 Tensor Core 125 | 250 teraFLOPS*. No FP8.
    // A10G (AWS's variant of the same GA102 chip, in EC2 G5) is NOT this row: its clocks and
    // tensor rates differ from the A10's, and neither NVIDIA nor AWS publishes an A10G
    // datasheet with per-dtype peaks that we could cite, so the A10G has no row at all.
    {"A10", kA10Sheet, 125, 125, 62.5, 31.2, 0},
    // MI300X. AMD prints dense and sparse rates separately: peak FP16 and BF16 1307.4 TFLOPs
    // (2614.9 with structured sparsity); peak FP8 2614.9 TFLOPs (5229.8 with sparsity); peak
    // TF32 653.7 TFLOPs (1307.4 with sparsity); peak FP32 matrix 163.4 TFLOPs (= peak FP32
    // vector 163.4). The matrix cores do run plain FP32, so fp32 here is the matrix rate.
    {"MI300X", kMi300xSheet, 1307.4, 1307.4, 653.7, 163.4, 2614.9},
};

constexpr char kKnownChips[] = "A100, H100 SXM/PCIe/NVL, H200 SXM/NVL, B200, L40S, L4, A10, MI300X";

double rate(const Row& r, MathDtype d) noexcept {
  switch (d) {
    case MathDtype::kBf16:
      return r.bf16;
    case MathDtype::kFp16:
      return r.fp16;
    case MathDtype::kTf32:
      return r.tf32;
    case MathDtype::kFp32:
      return r.fp32;
    case MathDtype::kFp8:
      return r.fp8;
  }
  return 0;
}

const Row* row_named(std::string_view chip) noexcept {
  for (const Row& r : kRows) {
    if (chip == r.chip) return &r;
  }
  return nullptr;
}

// Lower-cased runs of letters and digits: "NVIDIA A100-SXM4-80GB" -> nvidia a100 sxm4 80gb.
std::vector<std::string> name_tokens(std::string_view name) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalnum(u)) {
      cur.push_back(static_cast<char>(std::tolower(u)));
    } else if (!cur.empty()) {
      out.push_back(std::move(cur));
      cur.clear();
    }
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

bool has_token(const std::vector<std::string>& t, std::string_view w) {
  for (const auto& s : t) {
    if (s == w) return true;
  }
  return false;
}

bool has_token_prefix(const std::vector<std::string>& t, std::string_view w) {
  for (const auto& s : t) {
    if (std::string_view(s).substr(0, w.size()) == w) return true;
  }
  return false;
}

// The table row a device name denotes, matched on whole tokens so that A10 is not A100,
// L4 is not L40S and GB200 is not B200. Empty with *reason set when the name is not one
// chip of the table.
std::string_view chip_for(const std::vector<std::string>& t, std::string& reason) {
  std::vector<std::string_view> found;
  if (has_token(t, "a100")) found.emplace_back("A100");
  if (has_token(t, "a10")) found.emplace_back("A10");
  if (has_token(t, "h100")) {
    if (has_token(t, "nvl")) {
      found.emplace_back("H100 NVL");
    } else if (has_token(t, "pcie")) {
      found.emplace_back("H100 PCIe");
    } else if (has_token_prefix(t, "sxm") || has_token(t, "hbm3")) {
      // "NVIDIA H100 80GB HBM3" is what CUDA calls the SXM5 part (the PCIe card is HBM2e).
      found.emplace_back("H100 SXM");
    } else {
      reason =
          "an H100 whose form factor (SXM, PCIe or NVL, rated differently) the name "
          "does not say";
      return {};
    }
  }
  if (has_token(t, "h200")) found.emplace_back(has_token(t, "nvl") ? "H200 NVL" : "H200 SXM");
  if (has_token(t, "b200")) found.emplace_back("B200");
  if (has_token(t, "l40s")) found.emplace_back("L40S");
  if (has_token(t, "l4")) found.emplace_back("L4");
  if (has_token(t, "mi300x")) found.emplace_back("MI300X");
  if (found.size() == 1) return found.front();
  if (found.size() > 1) {
    reason = "the name matches more than one chip of the table";
  } else if (has_token(t, "a10g")) {
    reason =
        "the A10G (AWS's variant of the A10) has no vendor-published per-dtype peak, "
        "and the A10's figures do not apply to it";
  } else {
    reason = std::string("not in the table (it has ") + kKnownChips + ")";
  }
  return {};
}

}  // namespace

std::optional<MathDtype> parse_math_dtype(std::string_view name) noexcept {
  if (name == "bf16") return MathDtype::kBf16;
  if (name == "fp16") return MathDtype::kFp16;
  if (name == "tf32") return MathDtype::kTf32;
  if (name == "fp32") return MathDtype::kFp32;
  if (name == "fp8") return MathDtype::kFp8;
  return std::nullopt;
}

const char* math_dtype_name(MathDtype d) noexcept {
  switch (d) {
    case MathDtype::kBf16:
      return "bf16";
    case MathDtype::kFp16:
      return "fp16";
    case MathDtype::kTf32:
      return "tf32";
    case MathDtype::kFp32:
      return "fp32";
    case MathDtype::kFp8:
      return "fp8";
  }
  return "?";
}

std::optional<PeakFlops> lookup_peak_flops(std::string_view device_name, MathDtype dtype,
                                           std::string* why) {
  const std::string prefix = std::string("no ") + math_dtype_name(dtype) +
                             " peak FLOP/s for device '" + std::string(device_name) + "': ";
  std::string reason;
  const std::string_view chip = chip_for(name_tokens(device_name), reason);
  const Row* row = chip.empty() ? nullptr : row_named(chip);
  if (row == nullptr) {
    if (why != nullptr) {
      *why =
          prefix + (device_name.empty() ? "the device has no name" : reason) + "; set peak_tflops";
    }
    return std::nullopt;
  }
  const double tflops = rate(*row, dtype);
  if (tflops <= 0) {
    if (why != nullptr) {
      *why = prefix + "the " + row->chip + " has no " + math_dtype_name(dtype) +
             " tensor-core rate in its datasheet; set peak_tflops";
    }
    return std::nullopt;
  }
  return PeakFlops{tflops, row->chip, row->source};
}

}  // namespace steptrace::detail
