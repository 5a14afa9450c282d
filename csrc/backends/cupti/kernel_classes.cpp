#include "kernel_classes.hpp"

#include <cxxabi.h>

#include <array>
#include <cstdlib>
#include <memory>

namespace steptrace::detail::cupti {
namespace {

constexpr std::string_view kAnonymous = "(anonymous namespace)";

bool starts_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}

bool contains(std::string_view s, std::string_view p) {
  return s.find(p) != std::string_view::npos;
}

template <std::size_t N>
bool contains_any(std::string_view s, const std::array<std::string_view, N>& words) {
  for (std::string_view w : words) {
    if (contains(s, w)) return true;
  }
  return false;
}

template <std::size_t N>
bool starts_with_any(std::string_view s, const std::array<std::string_view, N>& prefixes) {
  for (std::string_view p : prefixes) {
    if (starts_with(s, p)) return true;
  }
  return false;
}

template <std::size_t N>
bool is_any(std::string_view s, const std::array<std::string_view, N>& names) {
  for (std::string_view n : names) {
    if (s == n) return true;
  }
  return false;
}

// The last component of a qualified name: "at::native::foo" -> "foo".
std::string_view base_name(std::string_view q) {
  const std::size_t colon = q.rfind("::");
  return colon == std::string_view::npos ? q : q.substr(colon + 2);
}

// Names are matched through these tables, first hit wins. NCCL's kernels, as its sources
// name them (github.com/NVIDIA/nccl):
// - up to 2.18: ncclKernel_<Coll>_<ALGO>_<PROTO>_<Op>_<type> (src/collectives/device/
//   common.h, NCCL_KERN_NAME); the one-rank reduction (2.12-2.18, onerank_reduce.cu) is a
//   device function run inside those kernels, so it has no kernel name of its own;
// - 2.19 on: ncclDevKernel_<Coll>_<Op>_<type>_<ALGO>_<PROTO>, ncclDevKernel_SendRecv and
//   ncclDevKernel_Generic (src/device/generate.py, common.h), ncclSymkDevKernel_* for the
//   symmetric kernels in 2.27+ (src/device/symmetric/generate.py);
// - 2.19 on, and the only one whose name does not start with "nccl": the one-rank
//   reduction of a communicator of one rank with a pre-multiplied sum (ncclAvg, the
//   PreMulSum ops), a __global__ template in an anonymous namespace (src/device/onerank.cu),
//   which CUPTI reports as "(anonymous namespace)::oneRankReduce<FuncPreMulSum<float>>(...)"
//   (mangled: _ZN<n>_GLOBAL__N_...13oneRankReduceI13FuncPreMulSumIfEEEvPvS3_mmb). The other
//   one-rank reductions are cudaMemcpyAsync calls: memcpy records, no kernel.
constexpr std::array<std::string_view, 4> kNcclPrefixes = {"ncclDevKernel", "ncclSymkDevKernel",
                                                           "ncclKernel", "nccl"};
// Base names (after namespaces and template arguments) of NCCL kernels the prefixes miss.
constexpr std::array<std::string_view, 1> kNcclKernelNames = {"oneRankReduce"};
// Convolution markers of cuDNN / cutlass / xmma kernel names.
constexpr std::array<std::string_view, 7> kConvWords = {"fprop", "dgrad",    "wgrad",   "conv",
                                                        "Conv",  "convolve", "winograd"};
constexpr std::array<std::string_view, 4> kGemmWords = {"gemm", "Gemm", "gemv", "GEMM"};
// cuBLAS / cuBLASLt kernel name prefixes (the base name, after namespaces).
constexpr std::array<std::string_view, 14> kCublasPrefixes = {
    "nvjet_",    "cublasLt",  "cublas",    "sm100_xmma", "sm90_xmma", "sm89_xmma", "sm86_xmma",
    "sm80_xmma", "sm75_xmma", "sm70_xmma", "ampere_",    "volta_",    "turing_",   "hopper_"};
constexpr std::array<std::string_view, 6> kReductionWords = {"reduce",  "Reduce", "softmax",
                                                             "SoftMax", "norm_",  "_norm"};

KernelKind make(KernelClass c, KernelCategory cat, KernelLibrary lib) { return {c, cat, lib}; }

KernelKind compute(KernelCategory cat, KernelLibrary lib) {
  return make(KernelClass::kCompute, cat, lib);
}

// The category a gemm/conv-capable library's kernel falls in, by the words of its name.
KernelCategory math_category(std::string_view text) {
  if (contains_any(text, kConvWords)) return KernelCategory::kConvolution;
  if (contains_any(text, kGemmWords)) return KernelCategory::kGemm;
  if (contains(text, "splitKreduce") || contains(text, "reduce")) return KernelCategory::kReduction;
  return KernelCategory::kOther;
}

KernelKind classify_triton(std::string_view base) {
  // TorchInductor: triton_poi_ (pointwise), triton_red_ / triton_per_ (reductions),
  // triton_mm / triton_bmm (autotuned matmul templates), triton_tem_fused_* (templates).
  if (starts_with(base, "triton_poi")) {
    return compute(KernelCategory::kElementwise, KernelLibrary::kTriton);
  }
  if (starts_with(base, "triton_red") || starts_with(base, "triton_per")) {
    return compute(KernelCategory::kReduction, KernelLibrary::kTriton);
  }
  if (contains(base, "attention"))
    return compute(KernelCategory::kAttention, KernelLibrary::kTriton);
  if (starts_with(base, "triton_mm") || starts_with(base, "triton_bmm") ||
      (starts_with(base, "triton_tem") &&
       (contains(base, "mm_") || contains(base, "_mm") || contains(base, "gemm")))) {
    return compute(KernelCategory::kGemm, KernelLibrary::kTriton);
  }
  return compute(KernelCategory::kOther, KernelLibrary::kTriton);
}

KernelKind classify_aten(std::string_view base) {
  if (contains(base, "elementwise")) {
    return compute(KernelCategory::kElementwise, KernelLibrary::kAten);
  }
  if (contains_any(base, kReductionWords) || contains(base, "Norm") ||
      starts_with(base, "layer_norm") || starts_with(base, "batch_norm")) {
    return compute(KernelCategory::kReduction, KernelLibrary::kAten);
  }
  if (contains_any(base, kGemmWords)) return compute(KernelCategory::kGemm, KernelLibrary::kAten);
  if (contains(base, "im2col") || contains(base, "col2im") || contains(base, "conv")) {
    return compute(KernelCategory::kConvolution, KernelLibrary::kAten);
  }
  return compute(KernelCategory::kOther, KernelLibrary::kAten);
}

// Manual fallback for `_Z<len><name>...` and `_ZN<len><a><len><b>...E`, for names that
// abi::__cxa_demangle refuses (truncated by the tool that reported them): the qualified
// name only, enough to classify.
std::string demangle_prefix(std::string_view m) {
  std::size_t i = 2;
  const bool nested = i < m.size() && m[i] == 'N';
  if (nested) ++i;
  std::string out;
  while (i < m.size() && m[i] >= '0' && m[i] <= '9') {
    std::size_t len = 0;
    while (i < m.size() && m[i] >= '0' && m[i] <= '9') len = len * 10 + (m[i++] - '0');
    if (len == 0 || i + len > m.size()) break;
    if (!out.empty()) out += "::";
    out.append(m.substr(i, len));
    i += len;
    if (!nested) break;
    // template arguments or cv-qualifiers end the prefix we can read
    if (i < m.size() && !(m[i] >= '0' && m[i] <= '9')) break;
  }
  return out.empty() ? std::string(m) : out;
}

}  // namespace

std::string demangle(std::string_view name) {
  if (!starts_with(name, "_Z")) return std::string(name);
  const std::string mangled(name);
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(
      abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status), std::free);
  if (status == 0 && out != nullptr) return std::string(out.get());
  return demangle_prefix(name);
}

std::string_view qualified_name(std::string_view s) {
  // The name ends at the first '(' outside template arguments (but "(anonymous
  // namespace)" is part of the name); it starts after the return type's last space.
  int angle = 0;
  std::size_t end = s.size();
  std::size_t start = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s.compare(i, kAnonymous.size(), kAnonymous) == 0) {
      i += kAnonymous.size() - 1;
      continue;
    }
    const char c = s[i];
    if (c == '<') {
      ++angle;
    } else if (c == '>') {
      if (angle > 0) --angle;
    } else if (angle == 0 && c == '(') {
      end = i;
      break;
    } else if (angle == 0 && c == ' ') {
      start = i + 1;
    }
  }
  std::string_view q = s.substr(start, end - start);
  // drop the template arguments of the function itself
  const std::size_t lt = q.find('<');
  if (lt != std::string_view::npos) q = q.substr(0, lt);
  return q;
}

std::string_view template_arguments(std::string_view s) {
  const std::string_view q = qualified_name(s);
  const std::size_t base = q.empty() ? 0 : static_cast<std::size_t>(q.data() - s.data());
  const std::size_t lt = s.find('<', base + q.size());
  if (lt == std::string_view::npos || lt != base + q.size()) return {};
  int depth = 0;
  for (std::size_t i = lt; i < s.size(); ++i) {
    if (s[i] == '<') {
      ++depth;
    } else if (s[i] == '>' && --depth == 0) {
      return s.substr(lt + 1, i - lt - 1);
    }
  }
  return s.substr(lt + 1);
}

KernelKind classify_kernel(std::string_view name) {
  const std::string demangled = demangle(name);
  const std::string_view full(demangled);
  const std::string_view q = qualified_name(full);
  const std::string_view base = base_name(q);
  const std::string_view targs = template_arguments(full);

  // communication first: these kernels' GPU time is nccl_ms, whatever else they contain
  if (starts_with_any(base, kNcclPrefixes) || starts_with_any(q, kNcclPrefixes) ||
      is_any(base, kNcclKernelNames)) {
    return make(KernelClass::kNccl, KernelCategory::kCommunication, KernelLibrary::kNccl);
  }
  if (starts_with(q, "c10d::symmetric_memory::") || starts_with(q, "c10d::intra_node_comm::")) {
    // torch's own intra-node collectives (c10d::checkForNaN and friends are compute)
    return make(KernelClass::kNccl, KernelCategory::kCommunication, KernelLibrary::kC10d);
  }

  // attention
  if (starts_with(base, "cudnn") && (contains(base, "sdpa") || contains(base, "mha"))) {
    return compute(KernelCategory::kAttention, KernelLibrary::kCudnn);
  }
  if (contains(q, "flash") || contains(q, "Flash") || contains(targs, "flash::") ||
      contains(targs, "Flash")) {
    return compute(KernelCategory::kAttention, KernelLibrary::kFlashAttention);
  }
  if (starts_with(base, "fmha_cutlass") || contains(targs, "AttentionKernel")) {
    return compute(KernelCategory::kAttention, KernelLibrary::kCutlass);  // mem-efficient SDPA
  }

  if (starts_with(base, "triton")) return classify_triton(base);

  // cutlass: cutlass::Kernel<...>, cutlass::Kernel2<...>, cutlass::device_kernel<...>, and
  // the cutlass_80_tensorop_* / cutlass3x_* names cuBLAS and torch generate
  if (starts_with(q, "cutlass") || starts_with(base, "cutlass")) {
    const KernelCategory cat = math_category(targs.empty() ? base : targs);
    return compute(cat == KernelCategory::kOther ? math_category(base) : cat,
                   KernelLibrary::kCutlass);
  }
  if (starts_with(q, "cudnn") || contains(base, "cudnn") ||
      (contains(base, "xmma") && contains_any(base, kConvWords)) ||
      starts_with(base, "implicit_convolve") || starts_with(base, "precomputed_convolve")) {
    return compute(math_category(base), KernelLibrary::kCudnn);
  }
  if (starts_with_any(base, kCublasPrefixes) || starts_with(base, "gemv") ||
      starts_with(base, "gemm") || starts_with(q, "cublas")) {
    return compute(
        math_category(base) == KernelCategory::kOther ? KernelCategory::kGemm : math_category(base),
        KernelLibrary::kCublas);
  }
  if (starts_with(q, "at::") || starts_with(q, "c10::")) return classify_aten(base);

  // unknown library: the words of the name
  if (contains_any(base, kGemmWords))
    return compute(KernelCategory::kGemm, KernelLibrary::kUnknown);
  if (contains(base, "elementwise")) {
    return compute(KernelCategory::kElementwise, KernelLibrary::kUnknown);
  }
  if (contains_any(base, kReductionWords)) {
    return compute(KernelCategory::kReduction, KernelLibrary::kUnknown);
  }
  return compute(KernelCategory::kOther, KernelLibrary::kUnknown);
}

const char* to_string(KernelClass c) {
  switch (c) {
    case KernelClass::kCompute:
      return "compute";
    case KernelClass::kNccl:
      return "nccl";
    case KernelClass::kMemcpy:
      return "memcpy";
    case KernelClass::kMemset:
      return "memset";
  }
  return "compute";
}

const char* to_string(KernelCategory c) {
  switch (c) {
    case KernelCategory::kGemm:
      return "gemm";
    case KernelCategory::kConvolution:
      return "convolution";
    case KernelCategory::kAttention:
      return "attention";
    case KernelCategory::kElementwise:
      return "elementwise";
    case KernelCategory::kReduction:
      return "reduction";
    case KernelCategory::kCommunication:
      return "communication";
    case KernelCategory::kCopy:
      return "copy";
    case KernelCategory::kOther:
      return "other";
  }
  return "other";
}

const char* to_string(KernelLibrary l) {
  switch (l) {
    case KernelLibrary::kUnknown:
      return "unknown";
    case KernelLibrary::kCublas:
      return "cublas";
    case KernelLibrary::kCutlass:
      return "cutlass";
    case KernelLibrary::kCudnn:
      return "cudnn";
    case KernelLibrary::kFlashAttention:
      return "flash_attention";
    case KernelLibrary::kTriton:
      return "triton";
    case KernelLibrary::kAten:
      return "aten";
    case KernelLibrary::kNccl:
      return "nccl";
    case KernelLibrary::kC10d:
      return "c10d";
  }
  return "unknown";
}

}  // namespace steptrace::detail::cupti
