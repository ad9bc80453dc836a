// Mixed-precision settings of FSDP (PyTorch: torch.distributed.fsdp.MixedPrecision).
//
//   options.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16));
//
// Threading: plain values.
#ifndef FSDP_CORE_MIXED_PRECISION_H_
#define FSDP_CORE_MIXED_PRECISION_H_

#include <functional>

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

namespace fsdp {

// Whether `module` is a BatchNorm (1d, 2d, 3d): MixedPrecision's default
// full_precision_modules.
bool is_batch_norm(const torch::nn::Module& module);

// Mixed-precision training (see Note [Mixed precision] in internal/runtime.cc).
// PyTorch: torch.distributed.fsdp.MixedPrecision, with _module_classes_to_ignore as
// full_precision_modules. The optimizer always sees full-precision flat shards.
struct MixedPrecision {
  // dtype of the unsharded parameters in forward and backward, and of the all-gathers
  // (none: the parameters' own).
  TORCH_ARG(c10::optional<c10::ScalarType>, param_dtype);
  // dtype of gradient reduction (reduce-scatter / all-reduce); none: param_dtype if set,
  // else the parameters' own.
  TORCH_ARG(c10::optional<c10::ScalarType>, reduce_dtype);
  // dtype of the floating buffers while the model runs forward and backward; they are
  // cast back to their own dtype when each iteration ends (none: no cast).
  TORCH_ARG(c10::optional<c10::ScalarType>, buffer_dtype);
  // Keep the reduced gradient shards in reduce_dtype for the optimizer instead of
  // casting them to the parameters' dtype.
  TORCH_ARG(bool, keep_low_precision_grads) = false;
  // Non-root units cast floating tensor arguments of their forward to param_dtype.
  TORCH_ARG(bool, cast_forward_inputs) = false;
  // The root casts floating tensor arguments of its forward to param_dtype.
  TORCH_ARG(bool, cast_root_forward_inputs) = true;
  // Units whose wrapped module this picks stay in full precision (parameters, buffers,
  // gradients), casting floating inputs up and their tensor output back. With an
  // auto_wrap_policy every module it picks is made a unit, as in PyTorch.
  TORCH_ARG(std::function<bool(const torch::nn::Module&)>, full_precision_modules) = is_batch_norm;
};

}  // namespace fsdp

#endif  // FSDP_CORE_MIXED_PRECISION_H_
