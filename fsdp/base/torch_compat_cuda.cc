#include "fsdp/base/torch_compat_cuda.h"

#include <dlfcn.h>
#include <limits.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <utility>

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

namespace fsdp::compat {
namespace {

// Note [LibTorch's CUDA kernels, loaded when used]
// LibTorch splits CUDA in two: libc10_cuda (streams, events, guards, the caching allocator:
// what fsdp's CUDA device handle and NCCL communicator call) and libtorch_cuda (every CUDA
// kernel, the CUDA hooks, cuBLAS, cuDNN, cuFFT, cuSPARSE). A process that links
// libtorch_cuda maps it and its NVIDIA libraries at start, runs its registrations and
// relocations, and keeps about 235 MiB resident (measured on the 2.11 CUDA 13.0 wheel:
// 114 MiB for libtorch_cpu alone, 349 MiB with libtorch_cuda), whether or not it ever
// touches a GPU. On a CPU run of a trainer that is memory a rank could hold parameters in.
// So the trainers link libc10_cuda only and, once they have picked CUDA, load libtorch_cuda
// here: its static registrations then add the CUDA kernels to the dispatcher and its
// CUDAHooks to LibTorch's registry, exactly as if it had been linked.
//
// Two things make this safe:
// - It is loaded from the folder of the libtorch_cpu this process runs (the wheel's
//   torch/lib, or a LibTorch zip's lib/), so the halves always match, whatever run path or
//   LD_LIBRARY_PATH the binary was started with.
// - at::detail::getCUDAHooks() keeps its first answer for the life of the process; asked
//   before the load, it would answer "no CUDA" for ever (torch::manual_seed asks). After
//   the load we check that the hooks are the real ones (hasCUDART) and name the mistake
//   otherwise, instead of failing later in a CUDA call.
// Only resize_bytes_cuda was ever linked from libtorch_cuda by name; its four steps are
// repeated below (resize_cuda_storage_bytes) with libc10_cuda's calls.
std::string folder_of_torch_cpu() {
  void* handle = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return "";
  char origin[PATH_MAX] = {};
  const bool found = dlinfo(handle, RTLD_DI_ORIGIN, origin) == 0;
  dlclose(handle);  // drops only the reference RTLD_NOLOAD took
  return found ? std::string(origin) : std::string();
}

void load_once() {
  const std::string folder = folder_of_torch_cpu();
  const std::string beside = folder.empty() ? "" : folder + "/libtorch_cuda.so";
  void* handle = beside.empty() ? nullptr : dlopen(beside.c_str(), RTLD_NOW | RTLD_GLOBAL);
  std::string why_not_beside = handle == nullptr && !beside.empty() ? dlerror() : "";
  if (handle == nullptr) handle = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_GLOBAL);
  TORCH_CHECK(handle != nullptr, "load_torch_cuda: cannot load LibTorch's CUDA kernels (",
              beside.empty() ? "" : why_not_beside + "; ", "libtorch_cuda.so: ", dlerror(),
              "); expected the CUDA build of LibTorch, whose lib/ folder holds libtorch_cuda.so "
              "beside libtorch_cpu.so, and its NVIDIA libraries; install it (the pinned torch "
              "wheel is one) or run on the CPU (--device=cpu)");
  // The handle is kept: libtorch_cuda is never unloaded, as in a process that links it.
  TORCH_CHECK(at::detail::getCUDAHooks().hasCUDART(),
              "load_torch_cuda: libtorch_cuda.so is loaded, but LibTorch answered a CUDA query "
              "before it was (its CUDA hooks keep the first answer): call "
              "fsdp::compat::load_torch_cuda() before torch::manual_seed, "
              "torch::cuda::is_available or any CUDA tensor");
}

}  // namespace

void load_torch_cuda() {
  static std::once_flag once;
  std::call_once(once, load_once);  // a throw leaves the flag unset: the next call retries
}

void resize_cuda_storage_bytes(c10::StorageImpl* storage, size_t bytes) {
  TORCH_CHECK(storage->resizable(), "resize_cuda_storage_bytes: the storage is not resizable");
  c10::Allocator* allocator = storage->allocator();
  TORCH_CHECK(allocator != nullptr, "resize_cuda_storage_bytes: the storage has no allocator");
  const c10::Device device = storage->device();
  TORCH_CHECK(device.is_cuda(), "resize_cuda_storage_bytes: expected a CUDA storage, got one on ",
              device);
  if (bytes == 0) {
    // The old block goes back to the caching allocator, which frees it for the stream it
    // was allocated on (and any stream recorded on it) once that stream's work is done.
    storage->set_data_ptr_noswap(c10::DataPtr(nullptr, device));
    storage->set_nbytes(0);
    return;
  }
  c10::cuda::CUDAGuard guard(device.index());
  c10::DataPtr data = allocator->allocate(bytes);
  if (storage->data_ptr().get() != nullptr) {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    C10_CUDA_CHECK(cudaMemcpyAsync(data.get(), storage->data(), std::min(storage->nbytes(), bytes),
                                   cudaMemcpyDeviceToDevice,
                                   c10::cuda::getCurrentCUDAStream(device.index())));
  }
  storage->set_data_ptr_noswap(std::move(data));
  storage->set_nbytes(bytes);
}

}  // namespace fsdp::compat
