#include "fsdp/state/optim_state_dict.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_join.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "fsdp/base/torch_compat.h"
#include "fsdp/state/internal/model_layout.h"

namespace fsdp {
namespace {

using state_internal::ModelLayout;
using state_internal::ParamSlice;

constexpr char kStep[] = "step";

// A parameter the optimizer may hold state for, under its first FQN in pre-order.
struct Param {
  std::string fqn;
  FlatParamHandle* handle = nullptr;  // null: a parameter outside FSDP, `tensor`
  size_t info = 0;
  at::Tensor tensor;
};

std::vector<Param> params_of(const ModelLayout& layout) {
  std::vector<Param> params;
  absl::flat_hash_set<std::pair<const void*, size_t>> seen;
  for (const state_internal::Entry& entry : layout.entries) {
    if (!entry.is_param) continue;
    const void* id = entry.handle != nullptr ? static_cast<const void*>(entry.handle)
                                             : entry.tensor.unsafeGetTensorImpl();
    if (seen.insert({id, entry.info}).second) {
      params.push_back({entry.fqn, entry.handle, entry.info, entry.tensor});
    }
  }
  return params;
}

// The optimizer state of one optimizer parameter (a flat shard or a parameter outside
// FSDP): element-wise tensors shaped like it, and Adam's step count.
struct State {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::optional<int64_t> step;
};

template <typename AdamState>
State adam_state(const AdamState& s) {
  State state{{{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}}, s.step()};
  if (s.max_exp_avg_sq().defined())
    state.tensors.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
  return state;
}

std::optional<State> read_state(const torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  auto it = optimizer.state().find(compat::optimizer_state_key(param));
  if (it == optimizer.state().end()) return std::nullopt;
  const torch::optim::OptimizerParamState* s = it->second.get();
  if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
    return State{{{"momentum_buffer", sgd->momentum_buffer()}}, std::nullopt};
  }
  if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(s)) return adam_state(*adam);
  if (auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(s))
    return adam_state(*adamw);
  TORCH_CHECK(false, "optimizer state of type ", c10::demangle(typeid(*s).name()),
              " is not supported; fsdp translates the state of torch::optim::SGD, Adam and AdamW");
}

// Where a loader takes a parameter's state from: the state names it has (empty: none),
// and elements [begin, begin + numel) of its flattened state `name`, checked against
// the parameter's shape and dtype.
struct Source {
  std::function<std::vector<std::string>(const std::string& fqn)> names;
  std::function<at::Tensor(const Param& param, const std::string& name,
                           const std::vector<int64_t>& shape, at::ScalarType dtype, int64_t begin,
                           int64_t numel)>
      elements;
  std::function<int64_t(const std::string& fqn)> step;
};

template <typename AdamState>
std::unique_ptr<torch::optim::OptimizerParamState> make_adam_state(
    const absl::flat_hash_map<std::string, at::Tensor>& tensors, int64_t step) {
  auto s = std::make_unique<AdamState>();
  s->step(step);
  s->exp_avg(tensors.at("exp_avg"));
  s->exp_avg_sq(tensors.at("exp_avg_sq"));
  if (tensors.contains("max_exp_avg_sq")) s->max_exp_avg_sq(tensors.at("max_exp_avg_sq"));
  return s;
}

// Installs a parameter's state, its tensors given by name.
void install_state(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                   const std::string& fqn, absl::flat_hash_map<std::string, at::Tensor> tensors,
                   const Source& source) {
  const bool sgd = dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr;
  const bool adam = dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr;
  const bool adamw = dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr;
  TORCH_CHECK(sgd || adam || adamw, "optimizer ", c10::demangle(typeid(optimizer).name()),
              " is not supported; fsdp translates the state of torch::optim::SGD, Adam and AdamW");
  for (const char* name : sgd ? std::vector<const char*>{"momentum_buffer"}
                              : std::vector<const char*>{"exp_avg", "exp_avg_sq"}) {
    TORCH_CHECK(tensors.contains(name), "the optimizer state of '", fqn, "' has no '", name,
                "'; it was made by another kind of optimizer");
  }
  std::unique_ptr<torch::optim::OptimizerParamState> state;
  if (sgd) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(tensors.at("momentum_buffer"));
    state = std::move(s);
  } else if (adam) {
    state = make_adam_state<torch::optim::AdamParamState>(tensors, source.step(fqn));
  } else {
    state = make_adam_state<torch::optim::AdamWParamState>(tensors, source.step(fqn));
  }
  optimizer.state()[compat::optimizer_state_key(param)] = std::move(state);
}

void load(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
          const std::vector<std::string>& keys, const Source& source, const char* what) {
  const ModelLayout layout = state_internal::model_layout(model, what);
  const std::vector<Param> params = params_of(layout);
  absl::flat_hash_set<std::string> known;
  for (const Param& param : params) known.insert(param.fqn);
  std::vector<std::string> unexpected;
  for (const std::string& key : keys) {
    if (!known.contains(key)) unexpected.push_back(key);
  }
  TORCH_CHECK(unexpected.empty(), what, ": unexpected keys (", unexpected.size(), "): '",
              absl::StrJoin(unexpected.begin(),
                            unexpected.begin() + std::min<size_t>(unexpected.size(), 10), "', '"),
              "'; optimizer state is keyed by the model's parameter FQNs (a tied parameter by "
              "its first name in pre-order)");
  torch::NoGradGuard no_grad;
  absl::flat_hash_map<const FlatParamHandle*, std::vector<const Param*>> params_by_handle;
  for (const Param& param : params) {
    if (param.handle != nullptr) params_by_handle[param.handle].push_back(&param);
  }
  for (const state_internal::FlatParam& flat : layout.flat_params) {
    const at::Tensor& shard = flat.handle->sharded_flat_param();
    const std::vector<const Param*>& members = params_by_handle[flat.handle];
    const std::vector<std::string> names = source.names(members.front()->fqn);
    for (const Param* member : members) {
      TORCH_CHECK(source.names(member->fqn) == names, what, ": '", member->fqn, "' and '",
                  members.front()->fqn, "' are in one flat parameter (unit '", flat.unit_fqn,
                  "') but have different optimizer state names; every parameter of a unit "
                  "has the same state, or none");
    }
    if (names.empty()) {
      optimizer.state().erase(compat::optimizer_state_key(shard));
      continue;
    }
    absl::flat_hash_map<std::string, at::Tensor> tensors;
    for (const std::string& name : names) {
      if (name == kStep) continue;
      at::Tensor flat_state = at::zeros({flat.handle->shard_numel()}, shard.options());
      for (const Param* member : members) {
        const FlatParamInfo& info = flat.handle->param_infos()[member->info];
        const ParamSlice slice = state_internal::param_slice(*flat.handle, member->info);
        if (slice.numel == 0) continue;
        flat_state.narrow(0, slice.shard_begin, slice.numel)
            .copy_(source.elements(*member, name, info.shape, shard.scalar_type(),
                                   slice.param_begin, slice.numel));
      }
      tensors[name] = flat_state;
    }
    install_state(optimizer, shard, members.front()->fqn, std::move(tensors), source);
  }
  for (const Param& param : params) {
    if (param.handle != nullptr) continue;
    const std::vector<std::string> names = source.names(param.fqn);
    if (names.empty()) continue;
    absl::flat_hash_map<std::string, at::Tensor> tensors;
    for (const std::string& name : names) {
      if (name == kStep) continue;
      tensors[name] = source
                          .elements(param, name, param.tensor.sizes().vec(),
                                    param.tensor.scalar_type(), 0, param.tensor.numel())
                          .view(param.tensor.sizes())
                          .clone();
    }
    install_state(optimizer, param.tensor, param.fqn, std::move(tensors), source);
  }
}

// The state of every flat parameter (element-wise tensors as `view` makes them from the
// flat shard state) and parameter outside FSDP, per canonical parameter.
template <typename Value>
torch::OrderedDict<std::string, torch::OrderedDict<std::string, Value>> collect(
    const ModelLayout& layout, const torch::optim::Optimizer& optimizer,
    const std::function<at::Tensor(const FlatParamHandle&, const at::Tensor&)>& prepare,
    const std::function<Value(const Param&, const at::Tensor&)>& view,
    const std::function<Value(const at::Tensor&)>& whole, bool keep) {
  absl::flat_hash_map<const FlatParamHandle*, State> flat_states;
  for (const state_internal::FlatParam& flat : layout.flat_params) {
    std::optional<State> state = read_state(optimizer, flat.handle->sharded_flat_param());
    if (!state) continue;
    for (auto& item : state->tensors) item.second = prepare(*flat.handle, item.second);
    flat_states.emplace(flat.handle, std::move(*state));
  }
  torch::OrderedDict<std::string, torch::OrderedDict<std::string, Value>> result;
  if (!keep) return result;
  for (const Param& param : params_of(layout)) {
    std::optional<State> state;
    if (param.handle == nullptr) {
      state = read_state(optimizer, param.tensor);
    } else if (auto it = flat_states.find(param.handle); it != flat_states.end()) {
      state = it->second;
    }
    if (!state) continue;
    torch::OrderedDict<std::string, Value> entry;
    for (const auto& [name, tensor] : state->tensors) {
      entry.insert(name, param.handle == nullptr ? whole(tensor.detach()) : view(param, tensor));
    }
    if (state->step) entry.insert(kStep, whole(at::scalar_tensor(*state->step, at::kLong)));
    result.insert(param.fqn, std::move(entry));
  }
  return result;
}

}  // namespace

OptimStateDict full_optim_state_dict(FullyShardedRoot& model,
                                     const torch::optim::Optimizer& optimizer,
                                     const FullStateDictOptions& options) {
  const ModelLayout layout = state_internal::model_layout(model, "full_optim_state_dict");
  auto gather = [&](const FlatParamHandle& handle, const at::Tensor& shard) {
    if (handle.strategy() == ShardingStrategy::kNoShard) return shard.detach();
    // On the compute device: with CPU offload the state lives on the host, and NCCL
    // takes only device tensors.
    at::Tensor full = at::empty({handle.padded_numel()}, shard.options().device(handle.device()));
    // Over the handle's communicator: for HYBRID strategies, the shard group.
    handle.communicator().all_gather_into_tensor(full,
                                                 shard.detach().to(handle.device()).contiguous());
    return full;
  };
  auto copy = [&](const at::Tensor& tensor) {
    return options.offload_to_cpu() ? tensor.to(at::kCPU, false, /*copy=*/true) : tensor.clone();
  };
  return collect<at::Tensor>(
      layout, optimizer, gather,
      [&](const Param& param, const at::Tensor& full) {
        const FlatParamInfo& info = param.handle->param_infos()[param.info];
        return copy(full.narrow(0, info.offset, info.numel).view(info.shape));
      },
      copy, !options.rank0_only() || layout.rank == 0);
}

void load_full_optim_state_dict(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                                const OptimStateDict& state_dict) {
  static const char* kWhat = "load_full_optim_state_dict";
  Source source;
  source.names = [&](const std::string& fqn) {
    const ParamOptimState* state = state_dict.find(fqn);
    return state != nullptr ? state->keys() : std::vector<std::string>{};
  };
  source.elements = [&](const Param& param, const std::string& name,
                        const std::vector<int64_t>& shape, at::ScalarType dtype, int64_t begin,
                        int64_t numel) {
    const at::Tensor& value = state_dict[param.fqn][name];
    state_internal::check_tensor(kWhat, param.fqn + " (" + name + ")", shape, dtype, value,
                                 "the optimizer state dict");
    return value.reshape({-1}).narrow(0, begin, numel);
  };
  source.step = [&](const std::string& fqn) {
    const at::Tensor* step = state_dict[fqn].find(kStep);
    TORCH_CHECK(step != nullptr && step->numel() == 1, kWhat, ": '", fqn,
                "' has no 'step' (a one-element tensor); it was made by another optimizer");
    return step->item<int64_t>();
  };
  load(model, optimizer, state_dict.keys(), source, kWhat);
}

ShardedOptimStateDict sharded_optim_state_dict(FullyShardedRoot& model,
                                               const torch::optim::Optimizer& optimizer) {
  const ModelLayout layout = state_internal::model_layout(model, "sharded_optim_state_dict");
  return collect<ShardedTensor>(
      layout, optimizer, [](const FlatParamHandle&, const at::Tensor& shard) { return shard; },
      [&](const Param& param, const at::Tensor& shard) {
        const ParamSlice slice = state_internal::param_slice(*param.handle, param.info);
        return ShardedTensor{param.handle->param_infos()[param.info].shape, slice.param_begin,
                             shard.detach().narrow(0, slice.shard_begin, slice.numel).clone(),
                             /*replicated=*/false};
      },
      [](const at::Tensor& tensor) {
        return ShardedTensor{tensor.sizes().vec(), 0, tensor.detach().reshape({-1}).clone(),
                             /*replicated=*/true};
      },
      /*keep=*/true);
}

void load_sharded_optim_state_dict(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                                   const ShardedOptimStateDict& state_dict) {
  static const char* kWhat = "load_sharded_optim_state_dict";
  Source source;
  source.names = [&](const std::string& fqn) {
    const ShardedParamOptimState* state = state_dict.find(fqn);
    return state != nullptr ? state->keys() : std::vector<std::string>{};
  };
  source.elements = [&](const Param& param, const std::string& name,
                        const std::vector<int64_t>& shape, at::ScalarType dtype, int64_t begin,
                        int64_t numel) {
    const ShardedTensor& value = state_dict[param.fqn][name];
    const std::string label = param.fqn + " (" + name + ")";
    TORCH_CHECK(
        value.global_shape == shape && value.local.defined() && value.local.scalar_type() == dtype,
        kWhat, ": '", label, "' must have shape ", state_internal::shape_string(shape),
        " and dtype ", c10::toString(dtype), ", got ",
        state_internal::shape_string(value.global_shape));
    const int64_t skip = begin - value.offset;
    TORCH_CHECK(skip >= 0 && skip + numel <= value.local.numel(), kWhat, ": '", label,
                "' holds elements [", value.offset, ", ", value.offset + value.local.numel(),
                ") but this rank needs [", begin, ", ", begin + numel,
                "): it was made at another world size; reshard through a sharded checkpoint");
    return value.local.narrow(0, skip, numel);
  };
  source.step = [&](const std::string& fqn) {
    const ShardedTensor* step = state_dict[fqn].find(kStep);
    TORCH_CHECK(step != nullptr && step->local.numel() == 1, kWhat, ": '", fqn,
                "' has no 'step'; it was made by another optimizer");
    return step->local.item<int64_t>();
  };
  load(model, optimizer, state_dict.keys(), source, kWhat);
}

}  // namespace fsdp
