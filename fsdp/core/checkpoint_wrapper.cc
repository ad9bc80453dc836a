#include "fsdp/core/checkpoint_wrapper.h"

#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdp::core_internal {
namespace {

// What backward needs besides the saved inputs; kept in the autograd context.
struct Recomputation : torch::CustomClassHolder {
  std::function<at::Tensor(const std::vector<at::Tensor>&)> forward;
  size_t num_inputs = 0;
  std::vector<bool> input_requires_grad;
  std::vector<at::Tensor> params;
  at::Tensor rng_state;  // the CPU generator's before the first run, if preserved
};

at::CPUGeneratorImpl* cpu_generator() {
  return at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
}

// Note [Recomputing in backward]
// The Function's inputs are the forward's tensor arguments followed by the parameters, so
// its backward returns gradients for both and the engine sends the parameters' along
// their own edges: to AccumulateGrad for plain leaves, to the unit's gradient sink under
// FSDP (see Note [Gradient sinks] in internal/runtime.cc). Backward therefore computes
// them with torch::autograd::grad (a reentrant engine call that captures gradients at
// the parameters' edges without running those nodes) rather than backward(), which
// would run the sink with this block's share of the gradients only.
class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList tensors,
                            const c10::intrusive_ptr<Recomputation>& recomputation) {
    const std::vector<at::Tensor> inputs(tensors.begin(),
                                         tensors.begin() + recomputation->num_inputs);
    ctx->save_for_backward(inputs);
    ctx->saved_data["recomputation"] = c10::IValue::make_capsule(recomputation);
    return recomputation->forward(inputs);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto recomputation = c10::static_intrusive_pointer_cast<Recomputation>(
        ctx->saved_data["recomputation"].toCapsule());
    std::vector<at::Tensor> inputs = ctx->get_saved_variables();
    std::vector<at::Tensor> targets;  // what grad() differentiates: indices into the result
    std::vector<size_t> target_index;
    for (size_t i = 0; i < inputs.size(); ++i) {
      inputs[i] = inputs[i].detach().requires_grad_(recomputation->input_requires_grad[i]);
      if (recomputation->input_requires_grad[i]) {
        targets.push_back(inputs[i]);
        target_index.push_back(i);
      }
    }
    const std::vector<at::Tensor>& params = recomputation->params;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& param = params[i];
      if (!param.requires_grad()) continue;
      targets.push_back(param);
      target_index.push_back(inputs.size() + i);
    }
    at::Tensor output;
    {
      at::AutoGradMode enable_grad(true);
      if (recomputation->rng_state.defined()) {
        at::CPUGeneratorImpl* generator = cpu_generator();
        c10::intrusive_ptr<c10::TensorImpl> resume;
        {
          std::lock_guard<std::mutex> lock(generator->mutex_);
          resume = generator->get_state();
          generator->set_state(*recomputation->rng_state.unsafeGetTensorImpl());
        }
        output = recomputation->forward(inputs);
        std::lock_guard<std::mutex> lock(generator->mutex_);
        generator->set_state(*resume);
      } else {
        output = recomputation->forward(inputs);
      }
    }
    // One gradient per forward argument: the tensors, then none for `recomputation`.
    torch::autograd::variable_list result(inputs.size() + params.size() + 1);
    if (targets.empty() || !output.requires_grad()) return result;
    const torch::autograd::variable_list grads = torch::autograd::grad(
        {output}, targets, {grad_outputs[0]}, /*retain_graph=*/false, /*create_graph=*/false,
        /*allow_unused=*/true);
    for (size_t k = 0; k < grads.size(); ++k) result[target_index[k]] = grads[k];
    return result;
  }
};

}  // namespace

at::Tensor checkpointed_forward(std::function<at::Tensor(const std::vector<at::Tensor>&)> forward,
                                const std::vector<at::Tensor>& inputs,
                                const std::vector<at::Tensor>& params, bool preserve_rng_state) {
  TORCH_INTERNAL_ASSERT(at::GradMode::is_enabled());
  auto recomputation = c10::make_intrusive<Recomputation>();
  recomputation->forward = std::move(forward);
  recomputation->num_inputs = inputs.size();
  for (const at::Tensor& input : inputs) {
    recomputation->input_requires_grad.push_back(input.requires_grad());
  }
  recomputation->params = params;
  if (preserve_rng_state) {
    at::CPUGeneratorImpl* generator = cpu_generator();
    std::lock_guard<std::mutex> lock(generator->mutex_);
    recomputation->rng_state = at::Tensor(generator->get_state());
  }
  std::vector<at::Tensor> tensors = inputs;
  tensors.insert(tensors.end(), params.begin(), params.end());
  return CheckpointFunction::apply(at::TensorList(tensors), recomputation);
}

}  // namespace fsdp::core_internal
