#include "fsdp/base/torch_compat_cuda.h"

#include <ATen/native/cuda/Resize.h>

namespace fsdp::compat {

void resize_cuda_storage_bytes(c10::StorageImpl* storage, size_t bytes) {
  at::native::resize_bytes_cuda(storage, bytes);
}

}  // namespace fsdp::compat
