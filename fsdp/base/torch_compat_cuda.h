// The CUDA counterpart of torch_compat.h: the LibTorch CUDA calls whose spelling changes
// between LibTorch versions. A separate target (//fsdp/base:torch_compat_cuda) so that
// CPU-only binaries do not link libtorch_cuda. Built against LibTorch 2.11.0 (CUDA 13.0).
//
// Threading: as the LibTorch call it wraps. Errors: c10::Error from LibTorch.
#ifndef FSDP_BASE_TORCH_COMPAT_CUDA_H_
#define FSDP_BASE_TORCH_COMPAT_CUDA_H_

#include <cstddef>

#include <c10/core/StorageImpl.h>

namespace fsdp::compat {

// Resizes the storage of a CUDA tensor to `bytes` (0 frees its memory, back to the CUDA
// caching allocator; tensors viewing it stay valid and may be re-grown), copying the old
// bytes that fit, on the current stream of the storage's device. Not thread-safe for one
// storage. PyTorch: `tensor.untyped_storage().resize_(bytes)` on a CUDA tensor
// (at::native::resize_bytes_cuda, ATen/native/cuda/Resize.h, in 2.11).
void resize_cuda_storage_bytes(c10::StorageImpl* storage, size_t bytes);

}  // namespace fsdp::compat

#endif  // FSDP_BASE_TORCH_COMPAT_CUDA_H_
