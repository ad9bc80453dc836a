// The CUDA counterpart of torch_compat.h: the LibTorch CUDA calls whose spelling changes
// between LibTorch versions. A separate target (//fsdp/base:torch_compat_cuda) that links
// libc10_cuda and the CUDA runtime but not libtorch_cuda: see load_torch_cuda. Built
// against LibTorch 2.11.0 (CUDA 13.0).
#ifndef FSDP_BASE_TORCH_COMPAT_CUDA_H_
#define FSDP_BASE_TORCH_COMPAT_CUDA_H_

#include <cstddef>

#include <c10/core/StorageImpl.h>

namespace fsdp::compat {

// Loads LibTorch's CUDA kernels (libtorch_cuda.so, from the folder that holds the
// libtorch_cpu.so this process runs, else through the loader's search path) into the
// process, once; later calls return at once. Until it is loaded, a CUDA tensor has no
// operators ("Could not run 'aten::empty.memory_format' with arguments from the 'CUDA'
// backend") and LibTorch's CUDA queries (at::detail::getCUDAHooks) answer as a CPU-only
// build. Binaries that link @libtorch//:torch_cuda have it already; the trainers link only
// libc10_cuda and call this when they pick CUDA, so a CPU run never maps libtorch_cuda and
// the NVIDIA libraries behind it (about 235 MiB resident; Note [LibTorch's CUDA kernels,
// loaded when used] in torch_compat_cuda.cc). PyTorch has no counterpart: `import torch`
// loads libtorch_cuda in every process of a CUDA build.
//
// Call it before anything asks LibTorch about CUDA (torch::cuda::is_available,
// torch::manual_seed, a CUDA tensor): LibTorch keeps the first answer of its CUDA hooks for
// the life of the process. Threading: safe from several threads. Errors: c10::Error when
// libtorch_cuda.so cannot be loaded (the loader's message; this LibTorch may be a CPU
// build), or when LibTorch was asked about CUDA before the load, naming what to do.
void load_torch_cuda();

// Resizes the storage of a CUDA tensor to `bytes` (0 frees its memory, back to the CUDA
// caching allocator; tensors viewing it stay valid and may be re-grown), copying the old
// bytes that fit, on the current stream of the storage's device; the caller holds a guard
// for that device. Not thread-safe for one storage. PyTorch:
// `tensor.untyped_storage().resize_(bytes)` on a CUDA tensor (at::native::resize_bytes_cuda,
// ATen/native/cuda/Resize.cpp, in 2.11, whose steps this repeats without linking
// libtorch_cuda).
void resize_cuda_storage_bytes(c10::StorageImpl* storage, size_t bytes);

}  // namespace fsdp::compat

#endif  // FSDP_BASE_TORCH_COMPAT_CUDA_H_
