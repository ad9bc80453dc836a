// Tensor records of PyTorch's zip archives (torch.save files and TorchScript archives):
// in the archive's data.pkl a tensor is
//   torch._utils._rebuild_tensor_v2(storage, offset, sizes, strides, requires_grad, hooks)
// over a storage named by a persistent id
//   ("storage", torch.FloatStorage, key, location, numel)
// whose bytes are the archive's record data/<key> (numel elements, no header).
//
//   fsdp::TorchStorageId id = fsdp::read_torch_storage_id(*pid);
//   fsdp::TorchTensorView view = fsdp::read_torch_tensor_view(args, id.numel);
//
// Errors: c10::Error saying which argument is wrong and how. Nothing here reads the
// archive: callers check the record's size against `numel` (torch_storage_bytes).
// Threading: pure functions. PyTorch counterpart: torch/_utils.py's _rebuild_tensor_v2 and
// torch.serialization's persistent_load.
#ifndef FSDP_FORMATS_TORCH_TENSOR_RECORD_H_
#define FSDP_FORMATS_TORCH_TENSOR_RECORD_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "fsdp/formats/pickle.h"

namespace fsdp {

// Element type of a legacy storage class ("torch.FloatStorage" -> kFloat); nullopt for
// any other name.
std::optional<at::ScalarType> torch_storage_dtype(const std::string& class_name);

// A persistent id of a storage.
struct TorchStorageId {
  std::string key;  // the record is "data/" + key
  at::ScalarType dtype = at::kFloat;
  int64_t numel = 0;  // elements, >= 0
};

// Reads `pid`; throws c10::Error if it is not a storage id of a known storage class with
// a non-negative element count.
TorchStorageId read_torch_storage_id(const PickleValue& pid);

// Bytes the record of `id` must hold; throws c10::Error if that overflows int64.
int64_t torch_storage_bytes(const TorchStorageId& id);

// A strided view into a storage.
struct TorchTensorView {
  int64_t offset = 0;  // elements
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // elements
  int64_t numel = 0;             // product of sizes
};

// Reads _rebuild_tensor_v2's offset, sizes and strides (args[1..3]) and checks that the
// view lies inside a storage of `storage_numel` elements (sizes and strides in
// [0, 2^40), an offset >= 0). Throws c10::Error naming `what` otherwise.
TorchTensorView read_torch_tensor_view(const std::vector<PickleValuePtr>& args,
                                       int64_t storage_numel, const char* what);

}  // namespace fsdp

#endif  // FSDP_FORMATS_TORCH_TENSOR_RECORD_H_
