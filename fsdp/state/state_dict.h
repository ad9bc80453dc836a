// Model state dicts of an FSDP model: full (gathered, PyTorch-compatible), sharded
// (each rank's pieces with the metadata to reassemble them) and local (the flat shards as
// stored). Keys are always the unwrapped model's names: the cleaned FQNs of
// named_parameters() and named_buffers(), in the order of PyTorch's Module.state_dict().
//
//   fsdp::StateDict full = fsdp::full_state_dict(*model, fsdp::FullStateDictOptions()
//                                                             .rank0_only(true));
//   fsdp::load_full_state_dict(*model, full);          // every rank passes the full dict
//   fsdp::ShardedStateDict mine = fsdp::sharded_state_dict(*model);
//   fsdp::load_sharded_state_dict(*model, mine);       // same world size and rank
//
//   torch::nn::Linear plain(4, 2);                     // an unwrapped LibTorch model
//   fsdp::load_module_state_dict(*plain, fsdp::module_state_dict(*other));
//
// `model` is the root of an FSDP model, a FullyShardedRoot (fully_sharded.h: pass *model
// of a FullyShardedDataParallel<T>; a unit inside it does not compile), idle (not
// inside forward/backward or summon_full_params). Functions that gather or need every
// rank's part are collective: every rank calls them in the same order.
//
// PyTorch: FullyShardedDataParallel.state_dict() / load_state_dict() under
// StateDictType.FULL_STATE_DICT, SHARDED_STATE_DICT and LOCAL_STATE_DICT.
//
// Threading: one call at a time per model, on its rank's thread. Errors: c10::Error
// naming cleaned FQNs (missing and unexpected keys, shape or dtype mismatches, a model
// that is not idle, a LOCAL state dict from another world size).
#ifndef FSDP_STATE_STATE_DICT_H_
#define FSDP_STATE_STATE_DICT_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/options.h"

namespace fsdp {

// Cleaned FQN -> tensor (PyTorch: the OrderedDict Module.state_dict() returns).
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

// One rank's part of a tensor: the elements [offset, offset + local.numel()) of the
// tensor flattened in row-major order. A replicated tensor (a buffer, a parameter FSDP
// leaves alone, an optimizer step count) is held whole by every rank: offset 0, local
// = all of it. PyTorch: a ShardedTensor with one shard per rank (FSDP flattens, so a
// rank's piece is a contiguous range of the flattened tensor).
struct ShardedTensor {
  std::vector<int64_t> global_shape;
  int64_t offset = 0;
  at::Tensor local;  // 1-D; may be empty (this rank's shard holds none of the tensor)
  bool replicated = false;
};

using ShardedStateDict = torch::OrderedDict<std::string, ShardedTensor>;

// The flat shards as stored, valid only at the world size and rank that made them.
// Keys: "<unit FQN>._flat_param" ("_flat_param" for the root unit) -> the unit's sharded
// flat parameter (1-D, shard_numel elements, padding included), "<unit
// FQN>._frozen_flat_param" -> its first frozen one if it has any,
// "<unit FQN>._frozen_flat_param_<k>" -> frozen flat parameter k (k >= 1: other dtypes),
// plus the buffers and the parameters FSDP leaves alone under their FQNs.
struct LocalStateDict {
  int world_size = 0;
  int rank = 0;
  StateDict tensors;
};

// Key suffix of a unit's flat parameter in a LocalStateDict (PyTorch: FLAT_PARAM).
inline constexpr char kFlatParamName[] = "_flat_param";
// ... and of the unit's first frozen flat parameter beside handle()
// (FullyShardedUnit::frozen_handles; the others add "_<k>", k = 1, 2, ...).
inline constexpr char kFrozenFlatParamName[] = "_frozen_flat_param";

// The full state dict: every parameter gathered to its original shape (a copy that does
// not change with training). Collective: one all-gather per unit with parameters, one
// unit at a time, so at most one unit is unsharded beside the copies.
// FullStateDictOptions (options.h) say whether only rank 0 receives it and whether it is
// copied to the CPU.
StateDict full_state_dict(FullyShardedRoot& model, const FullStateDictOptions& options = {});

// Loads a full state dict (on every rank). Strict: its keys must be exactly the
// model's, each tensor of the same shape and dtype. Each rank copies only its shard's
// elements; no communication.
void load_full_state_dict(FullyShardedRoot& model, const StateDict& state_dict);

// This rank's pieces: every key of the model, each a ShardedTensor (a copy). No
// communication.
ShardedStateDict sharded_state_dict(FullyShardedRoot& model);

// Loads pieces that cover this rank's shard (those sharded_state_dict gave this rank at
// the same world size; to reshard to another world size go through a sharded
// checkpoint, checkpoint.h). Strict about keys, shapes and dtypes.
void load_sharded_state_dict(FullyShardedRoot& model, const ShardedStateDict& state_dict);

LocalStateDict local_state_dict(FullyShardedRoot& model);
// Throws if `state_dict` was made at another world size or rank.
void load_local_state_dict(FullyShardedRoot& model, const LocalStateDict& state_dict);

// The state dict of an unwrapped module (or an FSDP model seen as a plain module: names
// are cleaned, values are the module's tensors themselves, not copies; an FSDP model's
// flat-parameter views hold data only inside summon_full_params).
// PyTorch: Module.state_dict().
StateDict module_state_dict(const torch::nn::Module& module);

// Copies a state dict into an unwrapped module, strictly (keys, shapes and dtypes).
// PyTorch: Module.load_state_dict(strict=True).
void load_module_state_dict(torch::nn::Module& module, const StateDict& state_dict);

}  // namespace fsdp

#endif  // FSDP_STATE_STATE_DICT_H_
