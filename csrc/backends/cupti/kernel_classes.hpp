// Classification of GPU kernels by name, for the CUPTI activity backend: compute vs NCCL
// (communication) for the per-step `kernels` record, and a coarse category and library
// (gemm from cuBLAS/cutlass, flash attention, triton, ATen elementwise, ...) for the
// diagnoses (matmul-dominated steps, top kernels). Pure functions of the name: no CUPTI.
#pragma once

#include <string>
#include <string_view>

namespace steptrace::detail::cupti {

/// What a kernel's GPU time counts as in the step record.
enum class KernelClass {
  kCompute,  // every kernel that is not communication
  kNccl,     // NCCL collectives / send-recv (and torch's own intra-node comm kernels)
  kMemcpy,   // copies (from memcpy activity records, not from a kernel name)
  kMemset,   // memsets (from memset activity records)
};

/// A coarse kind of work, for diagnoses.
enum class KernelCategory {
  kGemm,           // matmul / batched gemm / gemv (cuBLAS, cutlass, triton mm, nvjet)
  kConvolution,    // cuDNN / cutlass convolutions
  kAttention,      // flash attention, memory-efficient attention, cuDNN SDPA
  kElementwise,    // pointwise kernels (ATen elementwise, triton_poi)
  kReduction,      // reductions, softmax, norms (ATen reduce, triton_red/per)
  kCommunication,  // NCCL and other collectives
  kCopy,           // memcpy / memset
  kOther,
};

/// Which library or code generator a kernel comes from, when the name tells.
enum class KernelLibrary {
  kUnknown,
  kCublas,
  kCutlass,
  kCudnn,
  kFlashAttention,
  kTriton,
  kAten,
  kNccl,
  kC10d,
};

struct KernelKind {
  KernelClass cls = KernelClass::kCompute;
  KernelCategory category = KernelCategory::kOther;
  KernelLibrary library = KernelLibrary::kUnknown;
};

/// Classifies a kernel by its (mangled or demangled) name, as CUPTI reports it.
KernelKind classify_kernel(std::string_view name);

/// Demangles an Itanium C++ name (`_Z...`); returns the input unchanged when it is not
/// mangled or cannot be demangled.
std::string demangle(std::string_view name);

/// The qualified function name of a (demangled) kernel name: no return type, template
/// arguments or parameters. "void at::native::foo<4, F>(int, F)" -> "at::native::foo".
std::string_view qualified_name(std::string_view demangled);

/// The first template argument list of a demangled name, without the brackets ("" when
/// there is none): what cutlass::Kernel<...> and cutlass::device_kernel<...> carry.
std::string_view template_arguments(std::string_view demangled);

const char* to_string(KernelClass c);
const char* to_string(KernelCategory c);
const char* to_string(KernelLibrary l);

}  // namespace steptrace::detail::cupti
