// AdamW whose step runs ATen's fused kernel: one pass over each parameter, its gradient
// and its two moment buffers, instead of torch::optim::AdamW's eight element-wise passes
// and two parameter-sized temporaries. FSDP's parameters are a few large flat shards, so
// the optimizer step is a few long memory passes and the fusion is worth most there.
//
//   fsdp::FusedAdamW adamw(model->parameters(),
//                          torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
//   loss.backward();
//   adamw.step();
//
// Same options, state and update rule as torch::optim::AdamW (decoupled weight decay
// p *= 1 - lr * wd, bias-corrected moments, amsgrad), and it is one: a FusedAdamW is a
// torch::optim::AdamW, so fsdp's optimizer state dicts (fsdp/state:optim_state_dict),
// checkpoints, and torch::optim's save/load and learning-rate schedulers take it
// unchanged, and its state (AdamWParamState: step, exp_avg, exp_avg_sq, max_exp_avg_sq)
// is interchangeable with torch::optim::AdamW's. The update is the same formula evaluated
// in another order (the kernel interpolates the first moment, exp_avg += (1 - beta1) *
// (grad - exp_avg)), so a parameter may differ from torch::optim::AdamW's in its last bits
// after a step; a run is still bitwise reproducible with itself (resume included).
//
// Memory: the state of torch::optim::AdamW and no temporaries in the step; fsdp's memory
// plan takes it as OptimizerSpec::fused_adamw() (fsdp/core/memory_plan.h), which
// optimizer_spec_of (fully_sharded.h) returns for it.
//
// Tensors. Parameters of any floating dtype ATen's kernel takes (float, double, bfloat16,
// half; the moments are kept in the parameter's dtype, as torch::optim::AdamW keeps them)
// on the CPU or on CUDA; parameters are grouped by device and dtype and each group is one
// kernel call. Parameters without a gradient are skipped. Throws c10::Error for a sparse
// or complex gradient, or a gradient whose dtype or device is not its parameter's.
//
// Threading: as any torch::optim optimizer, one thread at a time. On CUDA the step is
// queued on the current stream; the step counters given to the kernel are made on the
// parameters' device (no host synchronisation).
//
// PyTorch: torch.optim.AdamW(params, fused=True) (torch._fused_adamw_).
#ifndef FSDP_CORE_FUSED_ADAMW_H_
#define FSDP_CORE_FUSED_ADAMW_H_

#include <utility>
#include <vector>

#include <torch/optim/adamw.h>

namespace fsdp {

class FusedAdamW : public torch::optim::AdamW {
 public:
  explicit FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                      torch::optim::AdamWOptions defaults = {})
      : torch::optim::AdamW(param_groups, std::move(defaults)) {}
  explicit FusedAdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults = {})
      : torch::optim::AdamW(std::move(params), std::move(defaults)) {}

  // One AdamW step over every parameter with a gradient; returns the closure's loss (an
  // undefined tensor without a closure), as torch::optim::AdamW::step.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace fsdp

#endif  // FSDP_CORE_FUSED_ADAMW_H_
