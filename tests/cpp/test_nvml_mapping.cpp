// Which NVML device is CUDA device N: through the PCI bus id (cuDeviceGetPCIBusId ->
// nvmlDeviceGetHandleByPciBusId_v2) where libcuda is there, here the stand-in libcuda.so.1
// (tests/cpp/fake_cupti/fake_cuda.cpp, linked in under its soname) beside the fake
// libnvidia-ml (tests/cpp/fake_nvml). CUDA numbers devices its own way (fastest first by
// default, after CUDA_VISIBLE_DEVICES, in a container after the cgroup's filter); NVML
// numbers them by PCI bus; the bus id is the same to both.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "backends/nvml/nvml_testing.hpp"
#include "fake_cupti/fake_cuda.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/ext/telemetry.hpp"

extern "C" void fake_cuda_set_device_count(int n);  // fake_cuda.cpp: CUDA's visible devices

namespace steptrace {
namespace {

struct Opened {
  TelemetrySample sample;
  std::string device;
  std::string why;
};

// The telemetry of CUDA device `device_index` (-1: the rank's, as none is configured).
Opened open_device0(const char* scenario, int device_index = 0) {
  setenv("STEPTRACE_NVML_LIBRARY", STEPTRACE_FAKE_NVML_PATH, 1);
  setenv("STEPTRACE_FAKE_NVML_SCENARIO", scenario, 1);
  Opened o;
  auto source = make_nvml_telemetry(device_index, 0, &o.why);
  if (source == nullptr) return o;
  o.device = source->device();
  sample_nvml_now(*source);
  std::vector<TelemetrySample> got;
  source->take(got);
  if (!got.empty()) o.sample = got.back();
  return o;
}

TEST(NvmlMapping, CudaDeviceFoundThroughItsPciBusIdWhenTheIndicesDiffer) {
  // CUDA's device 0 is the GPU NVML numbers 1 (on bus 2B, playing "hot": 75 C)
  fake_cuda_set_pci_bus_id(0, "0000:2B:00.0");
  const Opened o = open_device0("steady,hot");
  fake_cuda_set_pci_bus_id(0, nullptr);
  ASSERT_TRUE(o.why.empty()) << o.why;
  EXPECT_NEAR(o.sample.temp_c, 75.5, 0.51);  // "hot": 75-76 C
  EXPECT_NE(o.device.find("PCI 0000:2B:00.0"), std::string::npos) << o.device;
}

TEST(NvmlMapping, NumericCudaVisibleDevicesIsNotTakenForAnNvmlIndex) {
  // CUDA_VISIBLE_DEVICES=3 in a container whose cgroup shows NVML two GPUs: NVML has no
  // device 3, and the bus id finds the right one
  setenv("CUDA_VISIBLE_DEVICES", "3", 1);
  fake_cuda_set_pci_bus_id(0, "0000:2B:00.0");
  const Opened o = open_device0("steady,hot");
  fake_cuda_set_pci_bus_id(0, nullptr);
  unsetenv("CUDA_VISIBLE_DEVICES");
  ASSERT_TRUE(o.why.empty()) << o.why;
  EXPECT_NEAR(o.sample.temp_c, 75.5, 0.51);  // "hot": 75-76 C
}

TEST(NvmlMapping, DefaultBusMapsDeviceZeroToNvmlZero) {
  const Opened o = open_device0("steady,hot");
  ASSERT_TRUE(o.why.empty()) << o.why;
  EXPECT_NEAR(o.sample.temp_c, 65.5, 0.51);
  EXPECT_NE(o.device.find("PCI 0000:1B:00.0"), std::string::npos) << o.device;
}

TEST(NvmlMapping, ABusIdNvmlDoesNotKnowSaysSo) {
  fake_cuda_set_pci_bus_id(0, "0000:99:00.0");
  const Opened o = open_device0("steady");
  fake_cuda_set_pci_bus_id(0, nullptr);
  EXPECT_NE(o.why.find("0000:99:00.0"), std::string::npos) << o.why;
}

// Issue 49: torchrun with one GPU per rank (CUDA_VISIBLE_DEVICES=1 for local rank 1): CUDA
// shows the process one device, its device 0, the GPU on bus 2B. LOCAL_RANK=1 names no
// device CUDA shows: the rank's device is the one it sees (the rule of the counters'
// choose_device), not "no NVML telemetry".
struct RankDevice : ::testing::Test {
  void TearDown() override {
    unsetenv("LOCAL_RANK");
    unsetenv("CUDA_VISIBLE_DEVICES");
    fake_cuda_set_device_count(8);
    fake_cuda_set_pci_bus_id(0, nullptr);
    fake_cuda_set_current(nullptr, 0);
  }
};

TEST_F(RankDevice, LocalRankBeyondTheVisibleDevicesIsTheOneGpuTheRankSees) {
  setenv("LOCAL_RANK", "1", 1);
  setenv("CUDA_VISIBLE_DEVICES", "1", 1);
  fake_cuda_set_device_count(1);
  fake_cuda_set_pci_bus_id(0, "0000:2B:00.0");
  const Opened o = open_device0("steady,hot", -1);
  ASSERT_TRUE(o.why.empty()) << o.why;
  EXPECT_NEAR(o.sample.temp_c, 75.5, 0.51);  // NVML's GPU 1, "hot"
  EXPECT_NE(o.device.find("device 0 (LOCAL_RANK=1 is not among the 1 visible devices"),
            std::string::npos)
      << o.device;
  EXPECT_NE(o.device.find("PCI 0000:2B:00.0"), std::string::npos) << o.device;
}

TEST_F(RankDevice, LocalRankBeyondTheVisibleDevicesTakesTheCurrentContextsDevice) {
  setenv("LOCAL_RANK", "5", 1);
  fake_cuda_set_device_count(2);
  fake_cuda_set_current(fake_cuda_primary_context(1), 1);  // the framework's set_device(1)
  const Opened o = open_device0("steady,hot", -1);
  ASSERT_TRUE(o.why.empty()) << o.why;
  EXPECT_NEAR(o.sample.temp_c, 75.5, 0.51);  // CUDA device 1: bus 2B, NVML's GPU 1
  EXPECT_NE(o.device.find("the current CUDA context's"), std::string::npos) << o.device;
}

TEST_F(RankDevice, LocalRankAmongTheVisibleDevicesIsTheRanksDevice) {
  setenv("LOCAL_RANK", "1", 1);
  fake_cuda_set_current(fake_cuda_primary_context(0), 0);  // before set_device: device 0
  const Opened o = open_device0("steady,hot", -1);
  ASSERT_TRUE(o.why.empty()) << o.why;
  EXPECT_NEAR(o.sample.temp_c, 75.5, 0.51);
  EXPECT_EQ(o.device.rfind("device 1 (LOCAL_RANK=1, PCI 0000:2B:00.0", 0), 0u) << o.device;
}

}  // namespace
}  // namespace steptrace
