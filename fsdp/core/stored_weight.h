// Stored frozen weights: a frozen weight kept in a packed form (4-bit NF4 codes and their
// scales; fp8 values and a scale) that FSDP shards and all-gathers as it is stored, and
// that is unpacked into the tensor a module computes with right before each use.
//
//   // A module registers the packed tensors as frozen parameters (any dtype) and keeps a
//   // StoredWeight that reads them; FSDP flattens them as any frozen parameter, each dtype
//   // in its own flat parameter, gathered byte for byte (Note [Flat parameters of several
//   // dtypes] in flat_param.cc).
//   c10::intrusive_ptr<fsdp::StoredWeight> weight = ...;  // e.g. lora::Nf4Weight
//   at::Tensor y = fsdp::stored_linear(x, weight, bias);  // x [*, in] -> y [*, out]
//
// What is sharded, all-gathered and freed with the unit is only the packed form; the
// unpacked weight ([out, in] in the input's dtype) exists only inside stored_linear's
// forward, and again inside its backward (the input's gradient needs it: it is unpacked
// again from the packed tensors, which the unit has gathered again for its backward, as
// bitsandbytes' 4-bit matmul does), never between the two. So a layer costs its packed
// bytes between forward and backward, not its unpacked weight's.
//
// PyTorch counterpart: FSDP2's tensor-subclass extension, fsdp_pre_all_gather (what to
// gather: the packed tensors) and fsdp_post_all_gather (the unsharded tensor the module
// computes with); here the packed tensors are ordinary frozen parameters, so the "pre" step
// is the flat parameter itself and the "post" step is StoredWeight::unpack.
//
// Devices and streams: unpack runs on the packed tensors' device, on the current stream.
// Threading: a StoredWeight is used by its module's thread. Errors: unpack's own
// (c10::Error); stored_linear checks that the input's last dimension is the weight's.
#ifndef FSDP_CORE_STORED_WEIGHT_H_
#define FSDP_CORE_STORED_WEIGHT_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>

namespace fsdp {

// A frozen weight stored packed. Subclasses read the packed tensors their module
// registered as parameters (the module's own at::Tensor handles, which FSDP points at the
// gathered values while the unit is unsharded).
class StoredWeight : public torch::CustomClassHolder {
 public:
  ~StoredWeight() override = default;
  // The weight the module computes with, from the packed tensors' current values: a new
  // tensor of shape() in `dtype` on the packed tensors' device.
  virtual at::Tensor unpack(c10::ScalarType dtype) const = 0;
  // The unpacked weight's shape ([out, in] for a linear layer's).
  virtual std::vector<int64_t> shape() const = 0;
};

// input @ W^T + bias, W = weight->unpack(input's dtype) [out, in]; bias [out] or undefined.
// input: [*, in] floating; the result [*, out] in input's dtype. W is frozen: gradients
// flow to input and bias only, and W is unpacked again in backward instead of being saved
// (see the file comment). PyTorch: torch.nn.functional.linear over a weight subclass that
// FSDP2 unpacked in fsdp_post_all_gather. Errors: c10::Error if the input's last dimension
// is not the weight's in (shape()[1]).
at::Tensor stored_linear(const at::Tensor& input, const c10::intrusive_ptr<StoredWeight>& weight,
                         const at::Tensor& bias = {});

}  // namespace fsdp

#endif  // FSDP_CORE_STORED_WEIGHT_H_
