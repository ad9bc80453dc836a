// Where each state-dict entry of an FSDP model lives: in a unit's flat parameter (and
// which elements of it this or another rank holds) or in an ordinary module tensor.
// Shared by state_dict, optim_state_dict and checkpoint. Not a public API.
#ifndef FSDP_STATE_INTERNAL_MODEL_LAYOUT_H_
#define FSDP_STATE_INTERNAL_MODEL_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp/core/flat_param.h"
#include "fsdp/core/fully_sharded.h"

namespace fsdp::state_internal {

// One key of the model's state dict (the unwrapped model's name).
struct Entry {
  std::string fqn;
  // A parameter flattened into `handle` (param_infos()[info]); null for a buffer or a
  // parameter FSDP leaves alone (ignored modules), held in `tensor`.
  FlatParamHandle* handle = nullptr;
  size_t info = 0;
  at::Tensor tensor;
  bool is_param = false;
};

// A unit's flat parameter.
struct FlatParam {
  std::string unit_fqn;  // cleaned; "" for the root
  FlatParamHandle* handle = nullptr;
  // Its place in the unit's frozen_handles(); -1 for the unit's handle().
  int frozen_index = -1;
};

// The entries of any module (all with `tensor` set), in the order of PyTorch's
// Module.state_dict(): modules in pre-order, each module's parameters then its buffers;
// a tied parameter appears under each of its names. Names are cleaned.
std::vector<Entry> module_entries(const torch::nn::Module& module);

struct ModelLayout {
  FullyShardedRoot* root = nullptr;
  int rank = 0;
  int world_size = 1;
  std::vector<Entry> entries;          // module_entries, parameters resolved to handles
  std::vector<FlatParam> flat_params;  // units' handles(), pre-order
};

// The layout of `model`; `what` names the calling function in errors. Throws c10::Error
// if `model` is inside forward/backward. It walks the whole module tree, so a function
// that needs it several times (a checkpoint save or load) builds it once and passes it
// to the state_internal overloads of state_dict.h's and optim_state_dict.h's functions.
ModelLayout model_layout(FullyShardedRoot& model, const char* what);

// How many times model_layout has run in this process (any thread); tests count the
// builds a call makes.
int64_t model_layout_builds();

// The elements of one original parameter inside a rank's shard of its flat parameter.
struct ParamSlice {
  int64_t param_begin = 0;  // first element of the parameter (flattened) in the shard
  int64_t shard_begin = 0;  // where it sits in the shard (0 = the shard's first element)
  int64_t numel = 0;        // 0: the parameter has no element in this shard
};

// This rank's slice of param_infos()[info]: the rank in the handle's communicator (for
// the HYBRID strategies, its shard group) picks the shard; NO_SHARD holds everything.
ParamSlice param_slice(const FlatParamHandle& handle, size_t info);

// Whether this rank writes `handle`'s pieces to a checkpoint: under HYBRID strategies
// only the first shard group (global rank = rank in the shard group) does, since the
// other groups hold copies; always true otherwise.
bool writes_pieces(const FlatParamHandle& handle, const ModelLayout& layout);

// The FQNs of the parameters whose pieces this rank does not write (writes_pieces false).
absl::flat_hash_set<std::string> pieces_written_elsewhere(const ModelLayout& layout);

// What a loaded dict's keys must be: all of the model's (a state dict), or some of its
// parameters' FQNs (optimizer state: a parameter the optimizer has not stepped has none).
enum class KeySet { kStateDict, kOptimState };

// Throws c10::Error if `found` is not the key set of `expected` (order aside), or with
// KeySet::kOptimState not a subset of it: names up to 10 missing and 10 unexpected keys
// and the counts, and says what to do when the keys still carry wrapper prefixes.
// `what`: the caller, e.g. "load_full_state_dict".
void check_same_keys(const std::vector<std::string>& expected,
                     const std::vector<std::string>& found, const std::string& what,
                     KeySet key_set = KeySet::kStateDict);

// The preamble of every load_* function of state_dict.cc and optim_state_dict.cc:
// check_same_keys, then the guard that keeps autograd from recording the copies into
// the model's tensors and the optimizer's state while it lives.
[[nodiscard]] torch::NoGradGuard begin_load(const std::vector<std::string>& expected,
                                            const std::vector<std::string>& found,
                                            const std::string& what,
                                            KeySet key_set = KeySet::kStateDict);

// The FQNs of `entries`, in order.
std::vector<std::string> keys_of(const std::vector<Entry>& entries);

// Throws c10::Error unless `value` has `shape` and `dtype`; `source` says where `value`
// comes from ("the state dict", "the checkpoint").
void check_tensor(const std::string& what, const std::string& fqn, at::IntArrayRef shape,
                  at::ScalarType dtype, const at::Tensor& value, const std::string& source);

// "[2, 3]".
std::string shape_string(at::IntArrayRef shape);

}  // namespace fsdp::state_internal

#endif  // FSDP_STATE_INTERNAL_MODEL_LAYOUT_H_
