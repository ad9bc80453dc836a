#include "fsdp/core/fused_adamw.h"

#include <memory>
#include <tuple>

#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace fsdp {
namespace {

// The tensors of one kernel call: parameters of one device and dtype in one group.
struct KernelBatch {
  c10::Device device;
  c10::ScalarType dtype;
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
};

KernelBatch& batch_for(std::vector<KernelBatch>& batches, const at::Tensor& p) {
  for (KernelBatch& b : batches) {
    if (b.device == p.device() && b.dtype == p.scalar_type()) return b;
  }
  batches.push_back(KernelBatch{p.device(), p.scalar_type(), {}, {}, {}, {}, {}, {}});
  return batches.back();
}

}  // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (torch::optim::OptimizerParamGroup& group : param_groups_) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    std::vector<KernelBatch> batches;
    for (const at::Tensor& p : group.params()) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      TORCH_CHECK(!grad.is_sparse(), "fsdp::FusedAdamW does not support sparse gradients");
      TORCH_CHECK(!p.is_complex(),
                  "fsdp::FusedAdamW takes real floating parameters; got a complex one: use "
                  "torch::optim::AdamW or view it as real");
      TORCH_CHECK(grad.scalar_type() == p.scalar_type() && grad.device() == p.device(),
                  "fsdp::FusedAdamW: a gradient of dtype ", grad.scalar_type(), " on ",
                  grad.device(), " for a parameter of dtype ", p.scalar_type(), " on ", p.device(),
                  "; the fused kernel needs both to match");
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (slot == nullptr) {  // as torch::optim::AdamW initialises its state
        auto state = std::make_unique<torch::optim::AdamWParamState>();
        state->step(0);
        state->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        state->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (options.amsgrad()) {
          state->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        }
        slot = std::move(state);
      }
      auto& state = static_cast<torch::optim::AdamWParamState&>(*slot);
      state.step(state.step() + 1);
      KernelBatch& batch = batch_for(batches, p);
      batch.params.push_back(p);
      batch.grads.push_back(grad);
      batch.exp_avgs.push_back(state.exp_avg());
      batch.exp_avg_sqs.push_back(state.exp_avg_sq());
      if (options.amsgrad()) batch.max_exp_avg_sqs.push_back(state.max_exp_avg_sq());
      // The kernel reads the step (after this update) from a float tensor on the
      // parameter's device, as torch.optim keeps it.
      batch.steps.push_back(at::full({}, static_cast<double>(state.step()),
                                     at::TensorOptions().dtype(at::kFloat).device(p.device())));
    }
    const auto [beta1, beta2] = options.betas();
    for (KernelBatch& b : batches) {
      at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps,
                        options.lr(), beta1, beta2, options.weight_decay(), options.eps(),
                        options.amsgrad(), /*maximize=*/false);
    }
  }
  return loss;
}

}  // namespace fsdp
