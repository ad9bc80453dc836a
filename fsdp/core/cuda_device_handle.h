// The CUDA device handle (device_handle.h), in its own target,
// //fsdp/core:cuda_device_handle: linking it registers the handle for c10::kCUDA, so that
// DeviceHandle::for_device(cuda:N) and every FSDP object on CUDA tensors find it; CPU-only
// binaries leave it out. It links libc10_cuda, not libtorch_cuda: making the first handle
// loads LibTorch's CUDA kernels (compat::load_torch_cuda, fsdp/base/torch_compat_cuda.h),
// so a binary that links it but runs on the CPU never maps libtorch_cuda.
//
// What each DeviceHandle method does on CUDA (PyTorch's counterpart in parentheses):
// - device(): cuda:N; a device without an index is the current CUDA device at creation.
// - free_storage / reallocate_storage: resize the storage on its device through
//   compat::resize_cuda_storage_bytes (storage.resize_), so freed bytes go back to the
//   CUDA caching allocator, and the caching allocator's statistics show it.
// - memory_allocated / max_memory_allocated / reset_peak_memory_stats: the caching
//   allocator's aggregate allocated_bytes, current and peak, of the device
//   (torch.cuda.memory_allocated / max_memory_allocated / reset_peak_memory_stats):
//   bytes as the allocator rounds them (multiples of 512).
// - memory_free(): cudaMemGetInfo's free bytes plus the caching allocator's reserved
//   minus allocated bytes of the device (torch.cuda.mem_get_info()[0] +
//   memory_reserved() - memory_allocated()).
// - synchronize(): cudaDeviceSynchronize on the device (torch.cuda.synchronize).
// - current_stream(): the calling thread's current stream of the device
//   (torch.cuda.current_stream).
// - side_stream(name): a stream from LibTorch's pool of the device (getStreamFromPool,
//   as torch.cuda.Stream()), one per name and handle, kept for the handle's life.
// - record_event / wait_event: a c10::cuda::CUDAEvent (ATen/cuda/CUDAEvent.h's, without
//   timing) recorded on the stream / cudaStreamWaitEvent (Stream.record_event,
//   Stream.wait_event).
// - empty_host(numel, dtype): a pinned host tensor from LibTorch's caching host allocator
//   (tensor.pin_memory()), for CPU offload's asynchronous copies.
//
// Errors: c10::Error for a device index out of range or no CUDA device (naming
// c10::cuda::device_count), a tensor, stream or event of another device, and
// load_torch_cuda's when LibTorch's CUDA kernels cannot be loaded.
// Threading: as DeviceHandle; side_stream is safe from several threads.
#ifndef FSDP_CORE_CUDA_DEVICE_HANDLE_H_
#define FSDP_CORE_CUDA_DEVICE_HANDLE_H_

#include <memory>

#include <c10/core/Device.h>

#include "fsdp/core/device_handle.h"

namespace fsdp {

// The handle DeviceHandle::for_device returns for a CUDA device, made directly.
std::shared_ptr<DeviceHandle> make_cuda_device_handle(c10::Device device);

}  // namespace fsdp

#endif  // FSDP_CORE_CUDA_DEVICE_HANDLE_H_
