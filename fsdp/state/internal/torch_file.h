// Reads files written by PyTorch's torch.save and LibTorch's torch::jit::pickle_save (a
// zip archive holding a pickle and one record per tensor storage), restricted to what
// state dicts and checkpoint metadata hold: dicts (OrderedDict too), lists, tuples,
// None, bools, ints, floats, strings and CPU tensors. Anything else (arbitrary Python
// objects) is refused, as torch.load(weights_only=True) does, so a checkpoint cannot run
// code. LibTorch's own reader cannot be used: it turns an OrderedDict (what
// Module.state_dict() returns) into None and rejects one-item dicts (SETITEM). The pickle
// itself is read by fsdp/formats/pickle.h.
//
// Errors: c10::Error saying what is wrong with the file (not a zip archive, a missing
// record, an unsupported object, a truncated or inconsistent pickle). Not a public API.
#ifndef FSDP_STATE_INTERNAL_TORCH_FILE_H_
#define FSDP_STATE_INTERNAL_TORCH_FILE_H_

#include <string>
#include <string_view>

#include "fsdp/formats/pickle.h"

namespace fsdp::state_internal {

using PyValue = PickleValue;
using PyValuePtr = PickleValuePtr;

// "dict", "int", ... for messages.
inline const char* kind_name(PyValue::Kind kind) { return pickle_kind_name(kind); }

// Parses the archive in `bytes`; `name` (a path) is used in messages.
PyValuePtr read_torch_file(std::string_view bytes, const std::string& name);

}  // namespace fsdp::state_internal

#endif  // FSDP_STATE_INTERNAL_TORCH_FILE_H_
