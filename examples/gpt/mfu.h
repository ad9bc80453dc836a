// Model FLOP utilisation (MFU) of GPT training: the fraction of the device's peak
// arithmetic that the model's own FLOPs use.
//
//   std::optional<double> peak = fsdp::examples::peak_bf16_flops(
//       fsdp::examples::cuda_device_name(0), /*flag_tflops=*/0);
//   if (peak) {
//     mfu = fsdp::examples::model_flops_utilization(parameters, global_tokens_per_s,
//                                                   world_size, *peak);
//   }
//
// One place for the table of peaks (mfu.cc, with its sources); the trainer
// (examples/gpt/train.cc) and the GPU side by side (benchmarks/peer/gpt_fsdp.cc) use it.
#ifndef FSDP_EXAMPLES_GPT_MFU_H_
#define FSDP_EXAMPLES_GPT_MFU_H_

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp::examples {

// MFU of one device: 6 x parameters x (global_tokens_per_s / world_size) / peak_flops.
// Forward and backward of a dense transformer cost about 6 FLOPs per parameter per token
// (2 forward, 4 backward; the attention's own T^2 term is left out, as in the usual
// definition). `global_tokens_per_s` is the whole job's rate (every rank's tokens);
// `world_size` ranks, one device each, share it, and `peak_flops` is ONE device's peak, so
// the result is each device's utilisation (an 8-GPU job at the same per-GPU rate as a
// 1-GPU job reports the same MFU). world_size >= 1 (TORCH_CHECK otherwise). Pure.
double model_flops_utilization(int64_t parameters, double global_tokens_per_s, int64_t world_size,
                               double peak_flops);

// The formula above in words, for the programs' output (one line, no newline).
extern const char kMfuFormula[];

// The dense (no sparsity) bf16 tensor-core peak of a CUDA device, in FLOP/s, by its name
// as cudaGetDeviceProperties reports it ("NVIDIA H100 80GB HBM3"), or `flag_tflops` x
// 1e12 when that is > 0 (it wins over the table: the user knows the clocks). nullopt when
// the device is not in the table and no flag is given. Pure.
std::optional<double> peak_bf16_flops(const std::string& device_name, double flag_tflops);

// cudaGetDeviceProperties(device).name, or "" if the CUDA runtime cannot tell (no device,
// no driver).
std::string cuda_device_name(int device);

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_GPT_MFU_H_
