#include "examples/gpt/mfu.h"

#include "absl/strings/match.h"
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

namespace fsdp::examples {
namespace {

// Note [Peak bf16 FLOP/s]
// Dense bf16 tensor-core peaks from NVIDIA's datasheets, which quote them "with
// sparsity"; the dense figure is half:
// - H100 SXM5 (NVIDIA H100 Tensor Core GPU datasheet): BF16 1,979 TFLOPS with sparsity,
//   989.4 dense. Its CUDA name is "NVIDIA H100 80GB HBM3" (the PCIe card, "NVIDIA H100
//   PCIe", and the NVL card, "NVIDIA H100 NVL", run at lower clocks and are not listed).
// - H200 SXM (NVIDIA H200 Tensor Core GPU datasheet): BF16 1,979 TFLOPS with sparsity,
//   989.4 dense, the same chip as the H100 SXM5 with more memory; "H200 NVL" runs at
//   lower clocks and is not listed. GH200 (NVIDIA GH200 Grace Hopper Superchip datasheet)
//   has the same peak.
// - A100 SXM4 and PCIe, 40 and 80 GB (NVIDIA A100 Tensor Core GPU datasheet): BF16 312
//   TFLOPS dense (624 with sparsity).
// A device not listed gets MFU only with --peak_tflops.
struct PeakEntry {
  const char* name_has;      // the device name contains this...
  const char* name_has_not;  // ...and not this ("" for no exclusion)
  double flops;
};

constexpr PeakEntry kPeaks[] = {
    {"H200", "NVL", 989.4e12},
    {"H100 80GB HBM3", "", 989.4e12},
    {"H100 SXM", "", 989.4e12},
    {"A100", "", 312e12},
};

}  // namespace

const char kMfuFormula[] =
    "MFU = 6 x parameters x (tokens/s / ranks) / peak bf16 FLOP/s of one device";

double model_flops_utilization(int64_t parameters, double global_tokens_per_s, int64_t world_size,
                               double peak_flops) {
  TORCH_CHECK(world_size >= 1,
              "model_flops_utilization: expected world_size >= 1 (the ranks, one "
              "device each, that share the tokens/s), got ",
              world_size);
  const double tokens_per_s_per_device = global_tokens_per_s / static_cast<double>(world_size);
  return 6.0 * static_cast<double>(parameters) * tokens_per_s_per_device / peak_flops;
}

std::optional<double> peak_bf16_flops(const std::string& device_name, double flag_tflops) {
  if (flag_tflops > 0) return flag_tflops * 1e12;
  for (const PeakEntry& entry : kPeaks) {
    if (absl::StrContains(device_name, entry.name_has) &&
        (*entry.name_has_not == '\0' || !absl::StrContains(device_name, entry.name_has_not))) {
      return entry.flops;
    }
  }
  return std::nullopt;
}

std::string cuda_device_name(int device) {
  cudaDeviceProp properties;
  if (cudaGetDeviceProperties(&properties, device) != cudaSuccess) {
    cudaGetLastError();  // reset the runtime's last error, so later calls do not report it
    return "";
  }
  return properties.name;
}

}  // namespace fsdp::examples
