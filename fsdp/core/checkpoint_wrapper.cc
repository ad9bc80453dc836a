#include "fsdp/core/checkpoint_wrapper.h"

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
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
  // Each CUDA device of the inputs and parameters, with its default generator's state
  // before the first run (if preserved). See Note [Random states of the devices].
  std::vector<std::pair<c10::Device, at::Tensor>> device_rng_states;
};

at::CPUGeneratorImpl* cpu_generator() {
  return at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
}

// Note [Random states of the devices]
// torch.utils.checkpoint(preserve_rng_state=True) saves the CPU generator's state and the
// state of the default generator of each device its tensor arguments are on
// (torch.cuda.get_rng_state), and recomputes under torch.random.fork_rng with those
// states, so dropout on the device draws the same mask twice. We do the same for the
// CUDA devices of the forward's tensor arguments and the module's parameters (the
// parameters' device is the one the forward computes on when the arguments are CPU
// tensors). Reached through at::globalContext().defaultGenerator, which is in
// libtorch_cpu (CUDA's hooks), so CPU-only binaries need not link libtorch_cuda. A CUDA
// generator's state is its seed and Philox offset: saving and setting it queues no work
// on a stream and needs no synchronisation.
std::vector<c10::Device> cuda_devices_of(const std::vector<at::Tensor>& inputs,
                                         const std::vector<at::Tensor>& params) {
  std::vector<c10::Device> devices;
  for (const auto* list : {&inputs, &params}) {
    for (const at::Tensor& t : *list) {
      if (!t.defined() || !t.device().is_cuda()) continue;
      const c10::Device device(c10::kCUDA, t.device().has_index() ? t.device().index() : 0);
      if (std::find(devices.begin(), devices.end(), device) == devices.end()) {
        devices.push_back(device);
      }
    }
  }
  return devices;
}

at::Tensor get_rng_state(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_rng_state(at::Generator generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// Sets the saved states of the devices for its life, restoring the current ones after.
class DeviceRngStates {
 public:
  explicit DeviceRngStates(const std::vector<std::pair<c10::Device, at::Tensor>>& saved) {
    for (const auto& [device, state] : saved) {
      at::Generator generator = at::globalContext().defaultGenerator(device);
      resume_.emplace_back(generator, get_rng_state(generator));
      set_rng_state(generator, state);
    }
  }
  ~DeviceRngStates() {
    for (const auto& [generator, state] : resume_) set_rng_state(generator, state);
  }
  DeviceRngStates(const DeviceRngStates&) = delete;
  DeviceRngStates& operator=(const DeviceRngStates&) = delete;

 private:
  std::vector<std::pair<at::Generator, at::Tensor>> resume_;
};

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
        {
          const DeviceRngStates devices(recomputation->device_rng_states);
          output = recomputation->forward(inputs);
        }
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
  if (preserve_rng_state) {
    for (const c10::Device& device : cuda_devices_of(inputs, params)) {
      recomputation->device_rng_states.emplace_back(
          device, get_rng_state(at::globalContext().defaultGenerator(device)));
    }
  }
  std::vector<at::Tensor> tensors = inputs;
  tensors.insert(tensors.end(), params.begin(), params.end());
  return CheckpointFunction::apply(at::TensorList(tensors), recomputation);
}

}  // namespace fsdp::core_internal

namespace fsdp {

at::Tensor checkpoint(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& function,
                      const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& params,
                      bool preserve_rng_state) {
  if (!at::GradMode::is_enabled()) return function(inputs);
  return core_internal::checkpointed_forward(function, inputs, params, preserve_rng_state);
}

}  // namespace fsdp
