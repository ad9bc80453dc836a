#include "fsdp/state/state_dict.h"

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "fsdp/state/internal/model_layout.h"
#include "fsdp/state/internal/state_dict_layout.h"

namespace fsdp {
namespace {

using state_internal::begin_load;
using state_internal::Entry;
using state_internal::keys_of;
using state_internal::ModelLayout;
using state_internal::ParamSlice;

const FlatParamInfo& info_of(const Entry& entry) { return entry.handle->param_infos()[entry.info]; }

// This rank's elements of a flattened parameter in its flat shard (a view).
at::Tensor shard_part(const Entry& entry, const ParamSlice& slice) {
  return entry.handle->sharded_flat_param().detach().narrow(0, slice.shard_begin, slice.numel);
}

// Copies `value` into the model's `target` (an unsharded tensor) once it has its shape
// and dtype.
void copy_checked(const std::string& what, const std::string& fqn, const at::Tensor& target,
                  const at::Tensor& value) {
  state_internal::check_tensor(what, fqn, target.sizes(), target.scalar_type(), value,
                               "the state dict");
  target.copy_(value);
}

}  // namespace

StateDict full_state_dict(FullyShardedRoot& model, const FullStateDictOptions& options) {
  const ModelLayout layout = state_internal::model_layout(model, "full_state_dict");
  const bool keep = !options.rank0_only() || layout.rank == 0;
  auto copy = [&](const at::Tensor& tensor) {
    const at::Tensor value = tensor.detach();
    return options.offload_to_cpu() ? value.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true)
                                    : value.clone(at::MemoryFormat::Contiguous);
  };
  absl::flat_hash_map<const FlatParamHandle*, std::vector<size_t>> entries_of;
  for (size_t i = 0; i < layout.entries.size(); ++i) {
    if (layout.entries[i].handle != nullptr) entries_of[layout.entries[i].handle].push_back(i);
  }
  std::vector<at::Tensor> values(layout.entries.size());
  // One unit unsharded at a time (every rank takes part in each all-gather), in full
  // precision under mixed precision.
  for (const state_internal::FlatParam& flat : layout.flat_params) {
    flat.handle->unshard_full_precision();
    if (keep) {
      for (size_t i : entries_of[flat.handle]) {
        values[i] = copy(flat.handle->original_params()[layout.entries[i].info]);
      }
    }
    flat.handle->reshard();
  }
  StateDict state_dict;
  if (!keep) return state_dict;
  for (size_t i = 0; i < layout.entries.size(); ++i) {
    const Entry& entry = layout.entries[i];
    state_dict.insert(entry.fqn, entry.handle != nullptr ? values[i] : copy(entry.tensor));
  }
  return state_dict;
}

void load_full_state_dict(FullyShardedRoot& model, const StateDict& state_dict) {
  static const std::string kWhat = "load_full_state_dict";
  const ModelLayout layout = state_internal::model_layout(model, kWhat.c_str());
  const auto no_grad = begin_load(keys_of(layout.entries), state_dict.keys(), kWhat);
  for (const Entry& entry : layout.entries) {
    const at::Tensor& value = state_dict[entry.fqn];
    if (entry.handle == nullptr) {
      copy_checked(kWhat, entry.fqn, entry.tensor, value);
      continue;
    }
    state_internal::check_tensor(kWhat, entry.fqn, info_of(entry).shape,
                                 entry.handle->sharded_flat_param().scalar_type(), value,
                                 "the state dict");
    const ParamSlice slice = state_internal::param_slice(*entry.handle, entry.info);
    if (slice.numel == 0) continue;
    shard_part(entry, slice).copy_(value.reshape({-1}).narrow(0, slice.param_begin, slice.numel));
  }
}

ShardedStateDict sharded_state_dict(FullyShardedRoot& model) {
  return state_internal::sharded_state_dict(
      state_internal::model_layout(model, "sharded_state_dict"));
}

void load_sharded_state_dict(FullyShardedRoot& model, const ShardedStateDict& state_dict) {
  state_internal::load_sharded_state_dict(
      state_internal::model_layout(model, "load_sharded_state_dict"), state_dict);
}

ShardedStateDict state_internal::sharded_state_dict(const ModelLayout& layout) {
  ShardedStateDict state_dict;
  for (const Entry& entry : layout.entries) {
    ShardedTensor sharded;
    if (entry.handle == nullptr) {
      sharded.global_shape = entry.tensor.sizes().vec();
      sharded.local = entry.tensor.detach().reshape({-1}).clone();
      sharded.replicated = true;
    } else {
      const ParamSlice slice = state_internal::param_slice(*entry.handle, entry.info);
      sharded.global_shape = info_of(entry).shape;
      sharded.offset = slice.param_begin;
      sharded.local = shard_part(entry, slice).clone();
    }
    state_dict.insert(entry.fqn, std::move(sharded));
  }
  return state_dict;
}

void state_internal::load_sharded_state_dict(const ModelLayout& layout,
                                             const ShardedStateDict& state_dict) {
  static const std::string kWhat = "load_sharded_state_dict";
  const auto no_grad = begin_load(keys_of(layout.entries), state_dict.keys(), kWhat);
  for (const Entry& entry : layout.entries) {
    const ShardedTensor& value = state_dict[entry.fqn];
    const at::Tensor& target =
        entry.handle != nullptr ? entry.handle->sharded_flat_param() : entry.tensor;
    const std::vector<int64_t> shape =
        entry.handle != nullptr ? info_of(entry).shape : entry.tensor.sizes().vec();
    TORCH_CHECK(value.global_shape == shape, kWhat, ": size mismatch for '", entry.fqn,
                "': the state dict has shape ", state_internal::shape_string(value.global_shape),
                ", the model has ", state_internal::shape_string(shape));
    TORCH_CHECK(value.local.defined() && value.local.dim() == 1 &&
                    value.local.scalar_type() == target.scalar_type(),
                kWhat, ": '", entry.fqn, "' must hold a 1-D local tensor of dtype ",
                c10::toString(target.scalar_type()));
    if (entry.handle == nullptr) {
      TORCH_CHECK(value.offset == 0 && value.local.numel() == entry.tensor.numel(), kWhat, ": '",
                  entry.fqn, "' is replicated and must hold all ", entry.tensor.numel(),
                  " elements, got ", value.local.numel(), " from offset ", value.offset);
      entry.tensor.copy_(value.local.view(entry.tensor.sizes()));
      continue;
    }
    const ParamSlice slice = state_internal::param_slice(*entry.handle, entry.info);
    if (slice.numel == 0) continue;
    const int64_t skip = slice.param_begin - value.offset;
    TORCH_CHECK(skip >= 0 && skip + slice.numel <= value.local.numel(), kWhat, ": '", entry.fqn,
                "' holds elements [", value.offset, ", ", value.offset + value.local.numel(),
                ") but rank ", layout.rank, " needs [", slice.param_begin, ", ",
                slice.param_begin + slice.numel,
                "): the state dict was made at another world "
                "size or rank; reshard it through a sharded checkpoint "
                "(fsdp::load_sharded_checkpoint)");
    shard_part(entry, slice).copy_(value.local.narrow(0, skip, slice.numel));
  }
}

namespace {

// The LOCAL state dict's keys and the tensors they hold (not copies).
std::vector<std::pair<std::string, at::Tensor>> local_targets(const ModelLayout& layout) {
  std::vector<std::pair<std::string, at::Tensor>> targets;
  for (const state_internal::FlatParam& flat : layout.flat_params) {
    const std::string name = flat.frozen_index < 0 ? kFlatParamName
                             : flat.frozen_index == 0
                                 ? kFrozenFlatParamName
                                 : absl::StrCat(kFrozenFlatParamName, "_", flat.frozen_index);
    targets.emplace_back(flat.unit_fqn.empty() ? name : absl::StrCat(flat.unit_fqn, ".", name),
                         flat.handle->sharded_flat_param().detach());
  }
  for (const Entry& entry : layout.entries) {
    if (entry.handle == nullptr) targets.emplace_back(entry.fqn, entry.tensor.detach());
  }
  return targets;
}

}  // namespace

LocalStateDict local_state_dict(FullyShardedRoot& model) {
  const ModelLayout layout = state_internal::model_layout(model, "local_state_dict");
  LocalStateDict state_dict;
  state_dict.world_size = layout.world_size;
  state_dict.rank = layout.rank;
  for (const auto& [key, tensor] : local_targets(layout)) {
    state_dict.tensors.insert(key, tensor.clone());
  }
  return state_dict;
}

void load_local_state_dict(FullyShardedRoot& model, const LocalStateDict& state_dict) {
  static const std::string kWhat = "load_local_state_dict";
  const ModelLayout layout = state_internal::model_layout(model, kWhat.c_str());
  TORCH_CHECK(state_dict.world_size == layout.world_size && state_dict.rank == layout.rank, kWhat,
              ": this LOCAL state dict was made by rank ", state_dict.rank, " of ",
              state_dict.world_size, ", this is rank ", layout.rank, " of ", layout.world_size,
              "; a LOCAL state dict loads only at the world size and rank that made it: use a "
              "SHARDED or FULL state dict to change the world size");
  const auto targets = local_targets(layout);
  std::vector<std::string> keys;
  for (const auto& target : targets) keys.push_back(target.first);
  const auto no_grad = begin_load(keys, state_dict.tensors.keys(), kWhat);
  for (const auto& [key, tensor] : targets)
    copy_checked(kWhat, key, tensor, state_dict.tensors[key]);
}

StateDict module_state_dict(const torch::nn::Module& module) {
  StateDict state_dict;
  for (Entry& entry : state_internal::module_entries(module)) {
    state_dict.insert(std::move(entry.fqn), std::move(entry.tensor));
  }
  return state_dict;
}

void load_module_state_dict(torch::nn::Module& module, const StateDict& state_dict) {
  static const std::string kWhat = "load_module_state_dict";
  const std::vector<Entry> entries = state_internal::module_entries(module);
  const auto no_grad = begin_load(keys_of(entries), state_dict.keys(), kWhat);
  for (const Entry& entry : entries)
    copy_checked(kWhat, entry.fqn, entry.tensor, state_dict[entry.fqn]);
}

}  // namespace fsdp
