// Reads files written by PyTorch's torch.save and LibTorch's torch::jit::pickle_save (a
// zip archive holding a pickle and one record per tensor storage), restricted to what
// state dicts and checkpoint metadata hold: dicts (OrderedDict too), lists, tuples,
// None, bools, ints, floats, strings and CPU tensors. Anything else (arbitrary Python
// objects) is refused, as torch.load(weights_only=True) does, so a checkpoint cannot run
// code. LibTorch's own reader cannot be used: it turns an OrderedDict (what
// Module.state_dict() returns) into None and rejects one-item dicts (SETITEM).
//
// Errors: c10::Error saying what is wrong with the file (not a zip archive, a missing
// record, an unsupported object, a truncated or inconsistent pickle). Not a public API.
#ifndef FSDP_STATE_INTERNAL_TORCH_FILE_H_
#define FSDP_STATE_INTERNAL_TORCH_FILE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp::state_internal {

struct PyValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kTuple, kList, kDict, kTensor };
  Kind kind = Kind::kNone;
  int64_t integer = 0;  // kBool, kInt
  double real = 0;      // kFloat
  std::string string;   // kString
  std::vector<std::shared_ptr<PyValue>> items;  // kTuple, kList; kDict: key, value, ...
  at::Tensor tensor;                            // kTensor
};
using PyValuePtr = std::shared_ptr<PyValue>;

// "dict", "int", ... for messages.
const char* kind_name(PyValue::Kind kind);

// Parses the archive in `bytes`; `name` (a path) is used in messages.
PyValuePtr read_torch_file(const std::string& bytes, const std::string& name);

}  // namespace fsdp::state_internal

#endif  // FSDP_STATE_INTERNAL_TORCH_FILE_H_
