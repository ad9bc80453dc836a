// Activation checkpointing: a module wrapper that keeps none of its module's activations
// for backward and recomputes its forward during backward instead, trading compute for
// memory. PyTorch: torch.distributed.algorithms._checkpoint.checkpoint_wrapper
// (CheckpointImpl.REENTRANT, preserve_rng_state=True).
//
//   struct Net : torch::nn::Module {
//     Net() {
//       block = register_module("block", fsdp::Unit<fsdp::CheckpointWrapperImpl<BlockImpl>>(
//           std::make_shared<fsdp::CheckpointWrapperImpl<BlockImpl>>(
//               std::make_shared<BlockImpl>())));
//     }
//     at::Tensor forward(at::Tensor x) { return block(x); }
//     fsdp::Unit<fsdp::CheckpointWrapperImpl<BlockImpl>> block{nullptr};
//   };
//
// The wrapper holds the module as child "_checkpoint_wrapped_module" (names clean as in
// PyTorch: "block._fsdp_wrapped_module._checkpoint_wrapped_module.fc.weight" ->
// "block.fc.weight") and has its forward signature, so it sits in a typed member, a
// ModuleList or a Sequential. The wrapped forward must take at::Tensor arguments only and
// return one at::Tensor.
//
// With grad mode on, forward runs the module without recording a graph and saves only
// its tensor arguments; backward runs the forward again and back-propagates through it
// to the arguments and the module's parameters. With preserve_rng_state (the default)
// the recomputation runs with the random generators' states of the first run: the CPU
// generator's and the default generator's of each CUDA device that holds an argument or
// a parameter (torch.utils.checkpoint's get_device_states / fork_rng), so dropout masks
// repeat on the CPU and on the GPU; that saves and sets process-wide generators, so ranks
// run as threads of one process (fsdp::FakeWorld) that draw random numbers while another
// recomputes must turn it off. With grad mode off it is a plain call.
//
// Inside FSDP: put the wrapper inside a unit (Unit<CheckpointWrapperImpl<T>>, or around
// a module a unit contains), never around a unit: the recomputation runs while the unit
// is gathered for its backward, and the parameters' gradients reach the unit's gradient
// reduction like any other. The wrapped module must not contain units.
//
// Threading: as any module. Errors: c10::Error from the module's forward.
#ifndef FSDP_CORE_CHECKPOINT_WRAPPER_H_
#define FSDP_CORE_CHECKPOINT_WRAPPER_H_

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/base/names.h"
#include "fsdp/core/forward_as.h"

namespace fsdp {
namespace core_internal {

// Runs forward(inputs) without recording a graph; its output's backward recomputes
// forward(inputs) and returns the gradients of `inputs` and `params` (the tensors the
// forward reads besides its inputs). Needs grad mode on.
at::Tensor checkpointed_forward(std::function<at::Tensor(const std::vector<at::Tensor>&)> forward,
                                const std::vector<at::Tensor>& inputs,
                                const std::vector<at::Tensor>& params, bool preserve_rng_state);

}  // namespace core_internal

// The functional form, for a module that checkpoints part of its own forward (e.g. a
// block whose forward recomputes itself when a flag says so, inside its FSDP unit):
// with grad mode on, runs function(inputs) without recording a graph and saves only
// `inputs`; backward runs it again and back-propagates through it to the inputs that
// require grad and to `params` (the tensors the function reads besides its inputs,
// usually the module's parameters(); frozen ones are skipped). preserve_rng_state as for
// CheckpointWrapper. With grad mode off it is function(inputs). Returns the function's
// output. Same placement rule as the wrapper: inside a unit, never around one. PyTorch:
// torch.utils.checkpoint.checkpoint(function, *inputs, use_reentrant=True).
at::Tensor checkpoint(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& function,
                      const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& params,
                      bool preserve_rng_state = true);

template <typename Contained>
class CheckpointWrapperImpl
    : public torch::nn::Module,
      public detail::ForwardAs<CheckpointWrapperImpl<Contained>, decltype(&Contained::forward)> {
 public:
  explicit CheckpointWrapperImpl(std::shared_ptr<Contained> module, bool preserve_rng_state = true)
      : module_(register_module(std::string(kCheckpointWrappedModule), std::move(module))),
        preserve_rng_state_(preserve_rng_state) {}

  const std::shared_ptr<Contained>& module() const { return module_; }

  template <typename... Args>
  at::Tensor call(Args&&... args) {
    static_assert((std::is_same_v<std::decay_t<Args>, at::Tensor> && ...),
                  "CheckpointWrapper: the wrapped forward must take at::Tensor arguments only");
    if (!at::GradMode::is_enabled()) return module_->forward(std::forward<Args>(args)...);
    return core_internal::checkpointed_forward(
        [module = module_.get()](const std::vector<at::Tensor>& inputs) {
          return run(*module, inputs, std::index_sequence_for<Args...>{});
        },
        {args...}, module_->parameters(), preserve_rng_state_);
  }

 private:
  template <size_t... I>
  static at::Tensor run(Contained& module, const std::vector<at::Tensor>& inputs,
                        std::index_sequence<I...>) {
    return module.forward(inputs[I]...);
  }

  std::shared_ptr<Contained> module_;
  bool preserve_rng_state_;
};

// A ModuleHolder for CheckpointWrapperImpl<Contained>:
//   fsdp::CheckpointWrapper<BlockImpl> block(std::make_shared<BlockImpl>());
template <typename Contained>
class CheckpointWrapper : public torch::nn::ModuleHolder<CheckpointWrapperImpl<Contained>> {
 public:
  using torch::nn::ModuleHolder<CheckpointWrapperImpl<Contained>>::ModuleHolder;
  explicit CheckpointWrapper(std::shared_ptr<Contained> module, bool preserve_rng_state = true)
      : torch::nn::ModuleHolder<CheckpointWrapperImpl<Contained>>(
            std::make_shared<CheckpointWrapperImpl<Contained>>(std::move(module),
                                                               preserve_rng_state)) {}
};

}  // namespace fsdp

#endif  // FSDP_CORE_CHECKPOINT_WRAPPER_H_
