// Model FLOP utilisation (issue 18 item 4): the formula and the table of peaks.
#include "examples/gpt/mfu.h"

#include <string>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp::examples {
namespace {

TEST(MfuTest, IsSixFlopsPerParameterPerTokenOverThePeak) {
  // GPT-2 small (124 M parameters) at 400,000 tokens/s on a 989.4 TFLOP/s device.
  EXPECT_DOUBLE_EQ(model_flops_utilization(124000000, 400000, 1, 989.4e12),
                   6.0 * 124e6 * 4e5 / 989.4e12);
  EXPECT_NEAR(model_flops_utilization(124000000, 400000, 1, 989.4e12), 0.3008, 1e-4);
  EXPECT_DOUBLE_EQ(model_flops_utilization(1000, 0, 1, 1e12), 0);
}

TEST(MfuTest, IsPerDeviceTheGlobalRateSharedByTheRanks) {
  // 8 ranks at 3,200,000 tokens/s together: 400,000 per device, the 1-device MFU above
  // (not 8 x it).
  EXPECT_DOUBLE_EQ(model_flops_utilization(124000000, 3200000, 8, 989.4e12),
                   6.0 * 124e6 * 4e5 / 989.4e12);
  EXPECT_DOUBLE_EQ(model_flops_utilization(1000, 3000, 3, 1e12), 6.0 * 1000 * 1000 / 1e12);
  EXPECT_THROW(model_flops_utilization(1000, 3000, 0, 1e12), c10::Error);
  EXPECT_NE(std::string(kMfuFormula).find("tokens/s / ranks"), std::string::npos);
}

TEST(MfuTest, PeaksComeFromTheTableByCudaDeviceName) {
  EXPECT_EQ(peak_bf16_flops("NVIDIA H200", 0), 989.4e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA H100 80GB HBM3", 0), 989.4e12);  // SXM5
  EXPECT_EQ(peak_bf16_flops("NVIDIA H100 SXM5 94GB", 0), 989.4e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA A100-SXM4-80GB", 0), 312e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA A100-PCIE-40GB", 0), 312e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA A100 80GB PCIe", 0), 312e12);
}

TEST(MfuTest, OtherDevicesNeedTheFlag) {
  // Lower-clocked variants of listed chips are not guessed.
  EXPECT_EQ(peak_bf16_flops("NVIDIA H100 PCIe", 0), std::nullopt);
  EXPECT_EQ(peak_bf16_flops("NVIDIA H100 NVL", 0), std::nullopt);
  EXPECT_EQ(peak_bf16_flops("NVIDIA H200 NVL", 0), std::nullopt);
  EXPECT_EQ(peak_bf16_flops("NVIDIA GeForce RTX 4090", 0), std::nullopt);
  EXPECT_EQ(peak_bf16_flops("", 0), std::nullopt);
  EXPECT_EQ(peak_bf16_flops("NVIDIA GeForce RTX 4090", 165.2), 165.2e12);
  // The flag wins over the table (e.g. a power-capped card).
  EXPECT_EQ(peak_bf16_flops("NVIDIA H200", 700), 700e12);
}

TEST(MfuTest, NoDeviceHasNoName) {
  // There is no device 1000 on any machine (and none at all without a GPU).
  EXPECT_EQ(cuda_device_name(1000), "");
}

}  // namespace
}  // namespace fsdp::examples
