#include "fsdp/core/stored_weight.h"

#include <utility>

#include <ATen/Functions.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// See the file comment of stored_weight.h: W is unpacked in forward and again in backward,
// never saved. ctx holds the StoredWeight (a capsule) and whether a bias was given.
struct StoredLinearFunction : torch::autograd::Function<StoredLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& bias,
                            const c10::intrusive_ptr<StoredWeight>& weight) {
    ctx->saved_data["weight"] = c10::IValue::make_capsule(weight);
    ctx->saved_data["has_bias"] = bias.defined();
    return at::linear(input, weight->unpack(input.scalar_type()), bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    const auto weight =
        c10::static_intrusive_pointer_cast<StoredWeight>(ctx->saved_data["weight"].toCapsule());
    at::Tensor grad_input;
    if (ctx->needs_input_grad(0)) grad_input = at::matmul(grad, weight->unpack(grad.scalar_type()));
    at::Tensor grad_bias;
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(1)) {
      grad_bias = grad.reshape({-1, grad.size(-1)}).sum(0);
    }
    return {grad_input, grad_bias, at::Tensor()};
  }
};

}  // namespace

at::Tensor stored_linear(const at::Tensor& input, const c10::intrusive_ptr<StoredWeight>& weight,
                         const at::Tensor& bias) {
  TORCH_CHECK(weight, "stored_linear: the stored weight is null");
  const std::vector<int64_t> shape = weight->shape();
  TORCH_CHECK(shape.size() == 2 && input.dim() >= 1 && input.size(-1) == shape[1],
              "stored_linear: expected an input of [*, ", shape.size() == 2 ? shape[1] : -1,
              "] for a weight of shape ", c10::IntArrayRef(shape), ", got ", input.sizes());
  return StoredLinearFunction::apply(input, bias, weight);
}

}  // namespace fsdp
