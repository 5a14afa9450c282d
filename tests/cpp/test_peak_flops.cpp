#include "core/peak_flops.hpp"

#include <gtest/gtest.h>

#include <string>

namespace steptrace::detail {
namespace {

// The chip a name resolves to for bf16, or "" when it does not resolve.
std::string chip_of(std::string_view name) {
  const auto p = lookup_peak_flops(name, MathDtype::kBf16);
  return p ? p->chip : std::string();
}

double tflops(std::string_view name, MathDtype d) {
  const auto p = lookup_peak_flops(name, d);
  return p ? p->tflops : -1;
}

TEST(PeakFlops, DtypeNamesRoundTrip) {
  for (const char* n : {"bf16", "fp16", "tf32", "fp32", "fp8"}) {
    const auto d = parse_math_dtype(n);
    ASSERT_TRUE(d.has_value()) << n;
    EXPECT_STREQ(math_dtype_name(*d), n);
  }
  EXPECT_FALSE(parse_math_dtype("BF16").has_value());
  EXPECT_FALSE(parse_math_dtype("bfloat16").has_value());
  EXPECT_FALSE(parse_math_dtype("").has_value());
  EXPECT_FALSE(parse_math_dtype("fp64").has_value());
}

TEST(PeakFlops, RealDeviceNames) {
  // As torch.cuda.get_device_name / nvidia-smi / rocm-smi print them.
  EXPECT_EQ(chip_of("NVIDIA A100-SXM4-80GB"), "A100");
  EXPECT_EQ(chip_of("NVIDIA A100-SXM4-40GB"), "A100");
  EXPECT_EQ(chip_of("NVIDIA A100-PCIE-40GB"), "A100");
  EXPECT_EQ(chip_of("NVIDIA A100 80GB PCIe"), "A100");
  EXPECT_EQ(chip_of("NVIDIA H100 80GB HBM3"), "H100 SXM");
  EXPECT_EQ(chip_of("NVIDIA H100 SXM5 80GB"), "H100 SXM");
  EXPECT_EQ(chip_of("NVIDIA H100 PCIe"), "H100 PCIe");
  EXPECT_EQ(chip_of("NVIDIA H100 NVL"), "H100 NVL");
  EXPECT_EQ(chip_of("NVIDIA H200"), "H200 SXM");
  EXPECT_EQ(chip_of("NVIDIA H200 NVL"), "H200 NVL");
  EXPECT_EQ(chip_of("NVIDIA B200"), "B200");
  EXPECT_EQ(chip_of("NVIDIA L40S"), "L40S");
  EXPECT_EQ(chip_of("NVIDIA L4"), "L4");
  EXPECT_EQ(chip_of("NVIDIA A10"), "A10");
  EXPECT_EQ(chip_of("AMD Instinct MI300X"), "MI300X");
  EXPECT_EQ(chip_of("nvidia h100 nvl"), "H100 NVL");  // case does not matter
}

TEST(PeakFlops, ConfusablePairsStayApart) {
  EXPECT_EQ(chip_of("NVIDIA A10"), "A10");
  EXPECT_EQ(chip_of("NVIDIA A100-PCIE-40GB"), "A100");
  EXPECT_EQ(chip_of("NVIDIA L4"), "L4");
  EXPECT_EQ(chip_of("NVIDIA L40S"), "L40S");
  EXPECT_EQ(chip_of("NVIDIA L40"), "");  // not in the table, and not L4 or L40S
  EXPECT_EQ(chip_of("NVIDIA H100 NVL"), "H100 NVL");
  EXPECT_EQ(chip_of("NVIDIA H100 PCIe"), "H100 PCIe");
  EXPECT_EQ(chip_of("NVIDIA H200 NVL"), "H200 NVL");
  EXPECT_EQ(chip_of("NVIDIA H200"), "H200 SXM");
  EXPECT_EQ(chip_of("NVIDIA GB200"), "");  // not B200
  EXPECT_EQ(chip_of("AMD Instinct MI300A"), "");
  EXPECT_NE(tflops("NVIDIA H100 NVL", MathDtype::kBf16),
            tflops("NVIDIA H100 80GB HBM3", MathDtype::kBf16));
  EXPECT_NE(tflops("NVIDIA H100 PCIe", MathDtype::kBf16),
            tflops("NVIDIA H100 80GB HBM3", MathDtype::kBf16));
  EXPECT_NE(tflops("NVIDIA H200 NVL", MathDtype::kBf16), tflops("NVIDIA H200", MathDtype::kBf16));
  EXPECT_NE(tflops("NVIDIA A10", MathDtype::kBf16),
            tflops("NVIDIA A100-SXM4-80GB", MathDtype::kBf16));
  EXPECT_NE(tflops("NVIDIA L4", MathDtype::kBf16), tflops("NVIDIA L40S", MathDtype::kBf16));
}

TEST(PeakFlops, DenseNotSparse) {
  // Half of the datasheet's starred (2:4 sparse) figure, or its printed dense figure.
  EXPECT_DOUBLE_EQ(tflops("NVIDIA A100-SXM4-80GB", MathDtype::kBf16), 312);  // not 624
  EXPECT_DOUBLE_EQ(tflops("NVIDIA A100-SXM4-80GB", MathDtype::kTf32), 156);  // not 312
  EXPECT_DOUBLE_EQ(tflops("NVIDIA A100-SXM4-80GB", MathDtype::kFp32), 19.5);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H100 80GB HBM3", MathDtype::kBf16), 989.5);  // not 1,979
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H100 80GB HBM3", MathDtype::kFp16), 989.5);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H100 80GB HBM3", MathDtype::kFp8), 1979);  // not 3,958
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H100 80GB HBM3", MathDtype::kTf32), 494.5);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H100 80GB HBM3", MathDtype::kFp32), 67);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H100 PCIe", MathDtype::kBf16), 756.5);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H100 NVL", MathDtype::kFp8), 1670.5);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H200", MathDtype::kBf16), 989.5);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA B200", MathDtype::kBf16), 2250);            // not 4.5 PFLOPS
  EXPECT_DOUBLE_EQ(tflops("NVIDIA L4", MathDtype::kBf16), 121);               // not 242
  EXPECT_DOUBLE_EQ(tflops("NVIDIA L40S", MathDtype::kFp8), 733);              // not 1,466
  EXPECT_DOUBLE_EQ(tflops("NVIDIA A10", MathDtype::kBf16), 125);              // not 250
  EXPECT_DOUBLE_EQ(tflops("AMD Instinct MI300X", MathDtype::kBf16), 1307.4);  // not 2614.9
}

TEST(PeakFlops, EveryRowCitesItsSource) {
  for (const char* name : {"NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
                           "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA B200",
                           "NVIDIA L40S", "NVIDIA L4", "NVIDIA A10", "AMD Instinct MI300X"}) {
    for (MathDtype d : {MathDtype::kBf16, MathDtype::kFp16, MathDtype::kTf32, MathDtype::kFp32}) {
      const auto p = lookup_peak_flops(name, d);
      ASSERT_TRUE(p.has_value()) << name << " " << math_dtype_name(d);
      EXPECT_GT(p->tflops, 0);
      EXPECT_NE(p->source.find("https://"), std::string::npos) << p->source;
    }
  }
}

TEST(PeakFlops, Fp8OnlyWhereTheChipHasIt) {
  std::string why;
  EXPECT_FALSE(lookup_peak_flops("NVIDIA A100-SXM4-80GB", MathDtype::kFp8, &why).has_value());
  EXPECT_NE(why.find("NVIDIA A100-SXM4-80GB"), std::string::npos) << why;
  EXPECT_NE(why.find("fp8"), std::string::npos) << why;
  EXPECT_FALSE(lookup_peak_flops("NVIDIA A10", MathDtype::kFp8).has_value());
  // The A100's other dtypes are still there, and no other chip's fp8 stands in.
  EXPECT_TRUE(lookup_peak_flops("NVIDIA A100-SXM4-80GB", MathDtype::kBf16).has_value());
  for (const char* name : {"NVIDIA H100 80GB HBM3", "NVIDIA H200 NVL", "NVIDIA B200", "NVIDIA L40S",
                           "NVIDIA L4", "AMD Instinct MI300X"}) {
    EXPECT_TRUE(lookup_peak_flops(name, MathDtype::kFp8).has_value()) << name;
  }
}

TEST(PeakFlops, UnknownDevicesSayWhy) {
  for (const char* name :
       {"NVIDIA H800", "NVIDIA GeForce RTX 4090", "Fake GPU", "", "NVIDIA A10G", "NVIDIA H100"}) {
    std::string why;
    EXPECT_FALSE(lookup_peak_flops(name, MathDtype::kBf16, &why).has_value()) << name;
    EXPECT_NE(why.find("bf16"), std::string::npos) << why;
    EXPECT_NE(why.find(std::string("'") + name + "'"), std::string::npos) << why;
  }
  std::string why;
  lookup_peak_flops("NVIDIA A10G", MathDtype::kFp16, &why);
  EXPECT_NE(why.find("A10G"), std::string::npos) << why;
  EXPECT_FALSE(lookup_peak_flops("Fake GPU", MathDtype::kFp32).has_value());  // why is optional
}

}  // namespace
}  // namespace steptrace::detail
