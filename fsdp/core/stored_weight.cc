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
// never saved; ctx holds only the StoredWeight (a capsule). The bias is added outside.
struct StoredLinearFunction : torch::autograd::Function<StoredLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const c10::intrusive_ptr<StoredWeight>& weight) {
    ctx->saved_data["weight"] = c10::IValue::make_capsule(weight);
    return at::matmul(input, weight->unpack(input.scalar_type()).t());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    const auto weight =
        c10::static_intrusive_pointer_cast<StoredWeight>(ctx->saved_data["weight"].toCapsule());
    return {at::matmul(grad, weight->unpack(grad.scalar_type())), at::Tensor()};
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
  at::Tensor output = StoredLinearFunction::apply(input, weight);
  return bias.defined() ? at::add(output, bias) : output;
}

}  // namespace fsdp
