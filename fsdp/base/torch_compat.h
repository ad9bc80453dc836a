// The LibTorch calls whose spelling or behaviour changes between LibTorch versions, in one
// place, so that moving to another LibTorch touches this file and torch_compat.cc only.
// Built and tested against LibTorch 2.11.0 (the pinned PyPI wheel). Everything else fsdp
// uses from LibTorch (tensors, autograd Nodes, c10d's process groups and stores,
// PyTorchStreamReader, torch::jit::load) kept its API from 1.13 to 2.11.
//
// Threading: each function is as thread-safe as the LibTorch call it wraps (noted below).
// Errors: c10::Error from LibTorch, passed through.
#ifndef FSDP_BASE_TORCH_COMPAT_H_
#define FSDP_BASE_TORCH_COMPAT_H_

#include <cstddef>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

namespace fsdp::compat {

// The key of `param`'s entry in torch::optim::Optimizer::state(): its TensorImpl address
// (2.x keys by void*; 1.13 keyed by the address printed as a string).
inline void* optimizer_state_key(const at::Tensor& param) { return param.unsafeGetTensorImpl(); }

// Resizes the storage of a CPU tensor to `bytes` (0 frees its memory; tensors viewing it
// stay valid and may be re-grown). Not thread-safe for one storage. The PyTorch
// counterpart is `tensor.untyped_storage().resize_(bytes)`.
void resize_cpu_storage_bytes(c10::StorageImpl* storage, size_t bytes);

// Makes the meta tensor `meta` hold `value` (its storage, sizes, strides, dtype and device),
// in place: every handle to that TensorImpl (a module's member, its registered parameter or
// buffer) then sees `value`, and `meta` keeps its autograd settings (requires_grad). What
// set_data does, for the one case set_data refuses (a meta tensor takes no tensor of another
// backend); PyTorch's Module.to_empty replaces the Parameter object instead, which C++
// members holding the tensor would not see. Throws c10::Error unless `meta` is a meta
// tensor and `value` is not. Not thread-safe for one tensor.
void materialize_meta_tensor(const at::Tensor& meta, const at::Tensor& value);

// Runs `callback` once the autograd engine has finished the current backward pass (call it
// from inside backward: a Node or a hook). PyTorch: Variable._execution_engine.queue_callback.
void queue_end_of_backward_callback(std::function<void()> callback);

// `value` (dicts with string keys, lists, tuples, numbers, strings, CPU tensors) as the
// bytes of a torch.save zip archive that PyTorch's torch.load reads with its default
// weights_only=True: no TorchScript type tags, so a dict loads as a plain dict.
std::vector<char> save_torch_archive(const c10::IValue& value);

}  // namespace fsdp::compat

#endif  // FSDP_BASE_TORCH_COMPAT_H_
