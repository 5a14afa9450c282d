// Kernel-name classification on real kernel names (taken from the symbol tables of NCCL
// 2.27, cuBLASLt 12.8, libtorch_cuda and CUPTI traces), mangled and demangled.
#include <gtest/gtest.h>

#include <string>

#include "backends/cupti/kernel_classes.hpp"

namespace steptrace::detail::cupti {
namespace {

struct Case {
  const char* name;
  KernelClass cls;
  KernelCategory category;
  KernelLibrary library;
};

void expect_kind(const Case& c) {
  const KernelKind k = classify_kernel(c.name);
  EXPECT_EQ(to_string(k.cls), std::string(to_string(c.cls))) << c.name;
  EXPECT_EQ(to_string(k.category), std::string(to_string(c.category))) << c.name;
  EXPECT_EQ(to_string(k.library), std::string(to_string(c.library))) << c.name;
}

constexpr auto kC = KernelClass::kCompute;
constexpr auto kN = KernelClass::kNccl;

TEST(KernelClasses, NcclOldAndNewNamesMangledOrNot) {
  const char* names[] = {
      // NCCL 2.19+ (mangled, as CUPTI reports them, and demangled)
      "_Z39ncclDevKernel_AllReduce_Sum_f16_TREE_LL24ncclDevKernelArgsStorageILm4096EE",
      "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
      "_Z31ncclDevKernel_AllGather_RING_LL24ncclDevKernelArgsStorageILm4096EE",
      "_Z22ncclDevKernel_SendRecv24ncclDevKernelArgsStorageILm4096EE",
      "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
      "_Z21ncclDevKernel_Generic24ncclDevKernelArgsStorageILm4096EE",
      "ncclDevKernel_Generic",
      // symmetric kernels (2.27+)
      "ncclSymkDevKernel_AllReduce_AGxLL_R_bf16",
      "_Z40ncclSymkDevKernel_AllGather_LLMC_bf16_xyz24ncclSymkDevWorkArgs",
      // NCCL before 2.19
      "_Z36ncclKernel_AllReduce_RING_LL_Sum_floatP11ncclDevCommmP8ncclWork",
      "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
      "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t",
      // a name cut short by the tool that reported it (__cxa_demangle refuses it)
      "_Z42ncclDevKernel_AllReduce_Sum_f8e5m2_TREE_LL24",
  };
  for (const char* n : names) {
    expect_kind({n, kN, KernelCategory::kCommunication, KernelLibrary::kNccl});
  }
}

// NCCL 2.19+ runs the reduction of a one-rank communicator with a pre-multiplied sum
// (ncclAvg) as its own kernel, a template in an anonymous namespace of src/device/onerank.cu
// whose name does not start with "nccl"; nvcc names that namespace _GLOBAL__N__<hash>_<file>.
// Its time is communication (nccl_ms), not a compute reduction.
TEST(KernelClasses, NcclOneRankReduceIsCommunication) {
  const char* names[] = {
      "_ZN43_GLOBAL__N__5d8f1a2e_10_onerank_cu_7f2c9b4113oneRankReduceI13FuncPreMulSumIfEEEvPvS3_"
      "mmb",
      "_ZN43_GLOBAL__N__5d8f1a2e_10_onerank_cu_7f2c9b4113oneRankReduceI13FuncPreMulSumI13__nv_"
      "bfloat16EEEvPvS4_mmb",
      "void (anonymous namespace)::oneRankReduce<FuncPreMulSum<__half> >(void*, void*, unsigned "
      "long, unsigned long, bool)",
      "(anonymous namespace)::oneRankReduce<FuncPreMulSum<double>>",
      // cut short by the tool that reported it: the qualified name still says which
      "_ZN43_GLOBAL__N__5d8f1a2e_10_onerank_cu_7f2c9b4113oneRankReduceI13FuncPre",
  };
  for (const char* n : names) {
    expect_kind({n, kN, KernelCategory::kCommunication, KernelLibrary::kNccl});
  }
  // a name that only looks like it stays compute
  expect_kind({"void my::oneRankReducer<float>(float*)", kC, KernelCategory::kReduction,
               KernelLibrary::kUnknown});
}

TEST(KernelClasses, TorchCollectivesAreCommunicationButCheckForNaNIsNot) {
  expect_kind(
      {"void c10d::symmetric_memory::multimem_all_reduce_kernel<__nv_bfloat16, 16>"
       "(__nv_bfloat16*, unsigned long, unsigned long, unsigned int**, unsigned long, "
       "unsigned long)",
       kN, KernelCategory::kCommunication, KernelLibrary::kC10d});
  expect_kind(
      {"void c10d::intra_node_comm::oneShotAllReduceKernel<16ul>(at::BFloat16*, "
       "unsigned long, unsigned long, std::array<at::BFloat16*, 8ul>, "
       "std::array<unsigned int*, 8ul>, unsigned long, unsigned long)",
       kN, KernelCategory::kCommunication, KernelLibrary::kC10d});
  const KernelKind k = classify_kernel("_ZN4c10d11checkForNaNIN3c1011Float8_e5m2EEEvPT_m");
  EXPECT_EQ(k.cls, KernelClass::kCompute);
}

TEST(KernelClasses, CublasGemms) {
  const char* names[] = {
      "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize64x128x64_cgasize1x1x1_warpgroupsize"
      "1x1x1_aligna4_alignc4",
      "sm90_xmma_gemm_f16f16_f16f16_f16_nn_n_tilesize64x128x32_warpgroupsize1x1x1_execute_"
      "segment_k_on_kernel__5x_cublas",
      "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn",
      "ampere_bf16_s1688gemm_bf16_128x128_ldg8_relu_f2f_nn",
      "sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize96x128x32_stage4_warpsize2x2x1_"
      "tensor16x8x16_kernel",
      "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN",
      "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT",
      "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, "
      "4, 4, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 "
      "const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >(cublasGemvParamsEx<int, "
      "cublasGemvTensorStridedBatched<__nv_bfloat16 const>, "
      "cublasGemvTensorStridedBatched<__nv_bfloat16>, float>, float, float)",
      "volta_sgemm_128x64_nn",
  };
  for (const char* n : names) expect_kind({n, kC, KernelCategory::kGemm, KernelLibrary::kCublas});
  // cuBLASLt's split-K reduction is part of a gemm's cost, but not a gemm itself
  expect_kind(
      {"void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, "
       "false, false, false>(cublasLt::cublasSplitKParams<float>, float const*, "
       "float const*, float*, float const*, float const*, float const*, float const*, "
       "float*, void*, long, float*, int*)",
       kC, KernelCategory::kReduction, KernelLibrary::kCublas});
}

TEST(KernelClasses, CutlassKernels) {
  const char* gemms[] = {
      "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x3_nn_align8",
      "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8",
      "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_bf16_256x128_32x3_tn_align4>"
      "(cutlass_80_tensorop_s1688gemm_bf16_256x128_32x3_tn_align4::Params)",
      "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_"
      "align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
      "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, "
      "int, int>, cutlass::gemm::collective::CollectiveMma<> > >(cutlass::gemm::kernel::"
      "GemmUniversal<>::Params)",
      "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x256x64_1x2x1_0_tnn_align8_warp"
      "specialized_cooperative_epi_tma",
  };
  for (const char* n : gemms) expect_kind({n, kC, KernelCategory::kGemm, KernelLibrary::kCutlass});
}

TEST(KernelClasses, AttentionKernels) {
  // flash attention 2 inside torch (pytorch_flash::) and the standalone package (flash::)
  expect_kind(
      {"_ZN13pytorch_flash16flash_fwd_kernelI23Flash_fwd_kernel_traitsILi128ELi128ELi64"
       "ELi4ELb0ELb0EN7cutlass10bfloat16_tE19Flash_kernel_traitsILi128ELi128ELi64ELi4ES3_"
       "EELb0ELb1ELb0ELb0ELb0ELb0ELb0ELb0EEEvNS_16Flash_fwd_paramsE",
       kC, KernelCategory::kAttention, KernelLibrary::kFlashAttention});
  expect_kind(
      {"void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, "
       "false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, "
       "cutlass::bfloat16_t> >, false, true, false, false, false, false, false, false>"
       "(flash::Flash_fwd_params)",
       kC, KernelCategory::kAttention, KernelLibrary::kFlashAttention});
  expect_kind(
      {"flash_fwd_splitkv_kernel", kC, KernelCategory::kAttention, KernelLibrary::kFlashAttention});
  expect_kind(
      {"void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_"
       "traits<64, 128, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t> >"
       "(pytorch_flash::Flash_bwd_params)",
       kC, KernelCategory::kAttention, KernelLibrary::kFlashAttention});
  // flash attention 3 (Hopper): a cutlass device_kernel whose argument is a flash:: type
  expect_kind(
      {"void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
       "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, "
       "cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> > > > > >"
       "(flash::enable_sm90_or_later<>::Params)",
       kC, KernelCategory::kAttention, KernelLibrary::kFlashAttention});
  // memory-efficient attention (cutlass) and cuDNN SDPA
  expect_kind(
      {"_Z39fmha_cutlassF_f16_aligned_64x64_rf_sm50N22PyTorchMemEffAttention15Attention"
       "KernelIN7cutlass6half_tENS1_4arch4Sm50ELb1ELi64ELi64ELi64ELb1ELb1EE6ParamsE",
       kC, KernelCategory::kAttention, KernelLibrary::kCutlass});
  expect_kind(
      {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_"
       "4x1x1_kernel0_0",
       kC, KernelCategory::kAttention, KernelLibrary::kCudnn});
}

TEST(KernelClasses, TritonKernels) {
  expect_kind(
      {"triton_poi_fused_add_mul_0", kC, KernelCategory::kElementwise, KernelLibrary::kTriton});
  expect_kind({"triton_red_fused__to_copy_add_mean_pow_rsqrt_1", kC, KernelCategory::kReduction,
               KernelLibrary::kTriton});
  expect_kind({"triton_per_fused_native_layer_norm_2", kC, KernelCategory::kReduction,
               KernelLibrary::kTriton});
  expect_kind({"triton_mm_14", kC, KernelCategory::kGemm, KernelLibrary::kTriton});
  expect_kind({"triton_bmm_3", kC, KernelCategory::kGemm, KernelLibrary::kTriton});
  expect_kind({"triton_tem_fused_addmm_relu_0", kC, KernelCategory::kGemm, KernelLibrary::kTriton});
  expect_kind({"triton_tem_fused_flex_attention_0", kC, KernelCategory::kAttention,
               KernelLibrary::kTriton});
}

TEST(KernelClasses, AtenKernels) {
  expect_kind(
      {"_ZN2at6native29vectorized_elementwise_kernelILi2ENS0_10AbsFunctorIbEESt5arrayIPc"
       "Lm2EEEEviT0_T1_",
       kC, KernelCategory::kElementwise, KernelLibrary::kAten});
  expect_kind(
      {"void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>,"
       " std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, "
       "std::array<char*, 1ul>)",
       kC, KernelCategory::kElementwise, KernelLibrary::kAten});
  expect_kind(
      {"void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
       "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::"
       "MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<float, "
       "float, float, at::native::binary_internal::MulFunctor<float> > const&)::"
       "{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<>::{lambda(int)#1})",
       kC, KernelCategory::kElementwise, KernelLibrary::kAten});
  expect_kind(
      {"_ZN2at6native13reduce_kernelILi128ELi2ENS0_8ReduceOpIN3c107complexIdEENS0_10Norm"
       "OneOpsIS5_ddEEjdLi4ELi4EEEEEvT1_",
       kC, KernelCategory::kReduction, KernelLibrary::kAten});
  expect_kind(
      {"_ZN2at6native43_GLOBAL__N__b6de9c8c_10_SoftMax_cu_9f978f6319cunn_SoftMaxForward"
       "ILi8EN3c108BFloat16EffNS1_22SoftMaxForwardEpilogueEEEvPT2_PKT0_i",
       kC, KernelCategory::kReduction, KernelLibrary::kAten});
  expect_kind(
      {"void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, "
       "float>(int, float, float const*, float const*, float const*, float*, float*, "
       "float*)",
       kC, KernelCategory::kReduction, KernelLibrary::kAten});
  expect_kind(
      {"void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, "
       "unsigned int, 2, 2, -2, true>(at::cuda::detail::TensorInfo<float, unsigned int>)",
       kC, KernelCategory::kOther, KernelLibrary::kAten});
}

TEST(KernelClasses, UnknownNamesAreCompute) {
  for (const char* n : {"my_custom_kernel", "", "_Z", "_Zgarbage", "(", "<<<>>>", "void ()"}) {
    EXPECT_EQ(classify_kernel(n).cls, KernelClass::kCompute) << n;
  }
  expect_kind({"my_fused_gemm_kernel", kC, KernelCategory::kGemm, KernelLibrary::kUnknown});
}

TEST(KernelClasses, QualifiedNameAndTemplateArguments) {
  EXPECT_EQ(qualified_name("void at::native::foo<4, F>(int, F)"), "at::native::foo");
  EXPECT_EQ(qualified_name("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"),
            "ncclDevKernel_Generic");
  EXPECT_EQ(qualified_name("void at::native::(anonymous namespace)::k<float>(float)"),
            "at::native::(anonymous namespace)::k");
  EXPECT_EQ(qualified_name("triton_poi_fused_0"), "triton_poi_fused_0");
  EXPECT_EQ(template_arguments("void cutlass::Kernel<cutlass_80_x<1> >(cutlass_80_x<1>::Params)"),
            "cutlass_80_x<1> ");
  EXPECT_EQ(template_arguments("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"), "");
  EXPECT_EQ(demangle("_Z22ncclDevKernel_SendRecv24ncclDevKernelArgsStorageILm4096EE"),
            "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)");
  EXPECT_EQ(demangle("plain_name"), "plain_name");
  EXPECT_EQ(demangle("_ZN2at6native3fooI"), "at::native::foo");
}

}  // namespace
}  // namespace steptrace::detail::cupti
