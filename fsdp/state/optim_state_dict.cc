#include "fsdp/state/optim_state_dict.h"

#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "fsdp/base/torch_compat.h"
#include "fsdp/formats/values.h"
#include "fsdp/state/internal/model_layout.h"
#include "fsdp/state/internal/optim_state_dict_layout.h"

namespace fsdp {
namespace {

using state_internal::ModelLayout;
using state_internal::ParamSlice;

constexpr char kStep[] = "step";
constexpr char kSupported[] = "torch::optim::SGD, Adam, AdamW, Adagrad and RMSprop";

// Raises unless fsdp translates `optimizer`'s state (see kSupported).
void check_supported(const torch::optim::Optimizer& optimizer) {
  const bool supported = dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr ||
                         dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr ||
                         dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr ||
                         dynamic_cast<const torch::optim::Adagrad*>(&optimizer) != nullptr ||
                         dynamic_cast<const torch::optim::RMSprop*>(&optimizer) != nullptr;
  TORCH_CHECK(supported, "optimizer ", c10::demangle(typeid(optimizer).name()),
              " is not supported; fsdp translates the state of ", kSupported,
              ": use one of them, or save this optimizer's state yourself");
}

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
// FSDP): element-wise tensors shaped like it, and the step count of the optimizers that
// keep one, as a 0-dim tensor of `step_dtype` (PyTorch's Adagrad and RMSprop keep a
// float32 one; fsdp's Adam and AdamW state keeps its int64 step).
struct State {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::optional<int64_t> step;
  at::ScalarType step_dtype = at::kLong;
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
  if (auto* adagrad = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
    return State{{{"sum", adagrad->sum()}}, adagrad->step(), at::kFloat};
  }
  if (auto* rmsprop = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
    // As PyTorch's RMSprop: "momentum_buffer" with momentum > 0, "grad_avg" when centered.
    State state{{{"square_avg", rmsprop->square_avg()}}, rmsprop->step(), at::kFloat};
    if (rmsprop->momentum_buffer().defined())
      state.tensors.emplace_back("momentum_buffer", rmsprop->momentum_buffer());
    if (rmsprop->grad_avg().defined()) state.tensors.emplace_back("grad_avg", rmsprop->grad_avg());
    return state;
  }
  TORCH_CHECK(false, "optimizer state of type ", c10::demangle(typeid(*s).name()),
              " is not supported; fsdp translates the state of ", kSupported);
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

// The elements of a step count: a full dict holds a tensor, a sharded one a replicated
// ShardedTensor.
const at::Tensor& local_of(const at::Tensor& tensor) { return tensor; }
const at::Tensor& local_of(const ShardedTensor& tensor) { return tensor.local; }

// The Source of an OptimStateDict or ShardedOptimStateDict (kept by reference), its
// elements taken by `elements`.
template <typename Dict>
Source source_of(const Dict& state_dict, const char* what, decltype(Source::elements) elements) {
  Source source;
  source.names = [&state_dict](const std::string& fqn) {
    const auto* state = state_dict.find(fqn);
    return state != nullptr ? state->keys() : std::vector<std::string>{};
  };
  source.elements = std::move(elements);
  source.step = [&state_dict, what](const std::string& fqn) {
    const auto* step = state_dict[fqn].find(kStep);
    TORCH_CHECK(step != nullptr && local_of(*step).numel() == 1, what, ": '", fqn,
                "' has no 'step' (a one-element tensor); it was made by another optimizer");
    const at::Tensor& value = local_of(*step);
    const std::string field = absl::StrCat(what, ": the step of '", fqn, "'");
    return at::isIntegralType(value.scalar_type(), /*includeBool=*/false)
               ? checked_count(value.template item<int64_t>(), field)
               : checked_count(value.template item<double>(), field);
  };
  return source;
}

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

// The options of the param group of `optimizer` that holds `param`.
template <typename Options>
const Options& group_options(const torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  for (const torch::optim::OptimizerParamGroup& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (p.is_same(param)) return static_cast<const Options&>(group.options());
    }
  }
  TORCH_INTERNAL_ASSERT(false, "a parameter of the model is in no param group of the optimizer");
}

// A parameter's state for `optimizer`, from its tensors given by name.
std::unique_ptr<torch::optim::OptimizerParamState> make_state(
    const torch::optim::Optimizer& optimizer, const at::Tensor& param, const std::string& fqn,
    const absl::flat_hash_map<std::string, at::Tensor>& tensors, const Source& source) {
  auto require = [&](std::initializer_list<const char*> names, const char* why) {
    for (const char* name : names) {
      TORCH_CHECK(tensors.contains(name), "the optimizer state of '", fqn, "' has no '", name,
                  "'; ", why);
    }
  };
  constexpr char kOther[] = "it was made by another kind of optimizer";
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr) {
    require({"momentum_buffer"}, kOther);
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(tensors.at("momentum_buffer"));
    return s;
  }
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr) {
    require({"exp_avg", "exp_avg_sq"}, kOther);
    return make_adam_state<torch::optim::AdamParamState>(tensors, source.step(fqn));
  }
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr) {
    require({"exp_avg", "exp_avg_sq"}, kOther);
    return make_adam_state<torch::optim::AdamWParamState>(tensors, source.step(fqn));
  }
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer) != nullptr) {
    require({"sum"}, kOther);
    auto s = std::make_unique<torch::optim::AdagradParamState>();
    s->step(source.step(fqn));
    s->sum(tensors.at("sum"));
    return s;
  }
  TORCH_INTERNAL_ASSERT(dynamic_cast<const torch::optim::RMSprop*>(&optimizer) != nullptr);
  require({"square_avg"}, kOther);
  const auto& options = group_options<torch::optim::RMSpropOptions>(optimizer, param);
  if (options.momentum() > 0) {
    require({"momentum_buffer"},
            "the RMSprop optimizer has momentum > 0; the state was made without momentum: "
            "build the optimizer with the options it was saved with");
  }
  if (options.centered()) {
    require({"grad_avg"},
            "the RMSprop optimizer is centered; the state was made by an RMSprop that is not: "
            "build the optimizer with the options it was saved with");
  }
  auto s = std::make_unique<torch::optim::RMSpropParamState>();
  s->step(source.step(fqn));
  s->square_avg(tensors.at("square_avg"));
  if (tensors.contains("momentum_buffer")) s->momentum_buffer(tensors.at("momentum_buffer"));
  if (tensors.contains("grad_avg")) s->grad_avg(tensors.at("grad_avg"));
  return s;
}

// Installs a parameter's state, its tensors given by name.
void install_state(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                   const std::string& fqn, absl::flat_hash_map<std::string, at::Tensor> tensors,
                   const Source& source) {
  optimizer.state()[compat::optimizer_state_key(param)] =
      make_state(optimizer, param, fqn, tensors, source);
}

// Installs the state `source` gives every parameter of `layout` (flat shards assembled
// from their members' slices) into `optimizer`, after checking `keys` against the model.
void install_optim_state(const ModelLayout& layout, torch::optim::Optimizer& optimizer,
                         const std::vector<std::string>& keys, const Source& source,
                         const char* what) {
  check_supported(optimizer);
  const std::vector<Param> params = params_of(layout);
  std::vector<std::string> known;
  for (const Param& param : params) known.push_back(param.fqn);
  const auto no_grad =
      state_internal::begin_load(known, keys, what, state_internal::KeySet::kOptimState);
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
  check_supported(optimizer);
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
    if (state->step) entry.insert(kStep, whole(at::scalar_tensor(*state->step, state->step_dtype)));
    result.insert(param.fqn, std::move(entry));
  }
  return result;
}

// ---- param_groups. See Note [Hyperparameters by PyTorch's names].

// Note [Hyperparameters by PyTorch's names]
// A group's options are read and written in one place per optimizer type (group_options
// and set_group_options below: add a case for each new type to both). The names and
// their order are PyTorch 2.11's Optimizer.state_dict()["param_groups"]; what LibTorch's
// optimizer has no option for is written as PyTorch's default and, on load, must hold
// the value LibTorch behaves as (maximize False); flags that change only how PyTorch
// computes (foreach, capturable, differentiable, fused) are ignored on load.
using Options = std::vector<std::pair<std::string, c10::IValue>>;

c10::IValue betas_value(const std::tuple<double, double>& betas) {
  return c10::ivalue::Tuple::create({std::get<0>(betas), std::get<1>(betas)});
}

template <typename AdamOptions>
Options adam_options(const AdamOptions& o, bool decoupled) {
  return {{"lr", o.lr()},
          {"betas", betas_value(o.betas())},
          {"eps", o.eps()},
          {"weight_decay", o.weight_decay()},
          {"amsgrad", o.amsgrad()},
          {"maximize", false},
          {"foreach", c10::IValue()},
          {"capturable", false},
          {"differentiable", false},
          {"fused", c10::IValue()},
          {"decoupled_weight_decay", decoupled}};
}

Options group_options(const torch::optim::OptimizerOptions& options) {
  if (const auto* o = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    return {{"lr", o->lr()},
            {"momentum", o->momentum()},
            {"dampening", o->dampening()},
            {"weight_decay", o->weight_decay()},
            {"nesterov", o->nesterov()},
            {"maximize", false},
            {"foreach", c10::IValue()},
            {"differentiable", false},
            {"fused", c10::IValue()}};
  }
  if (const auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    return adam_options(*o, /*decoupled=*/false);
  }
  if (const auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    return adam_options(*o, /*decoupled=*/true);
  }
  if (const auto* o = dynamic_cast<const torch::optim::AdagradOptions*>(&options)) {
    return {{"lr", o->lr()},
            {"lr_decay", o->lr_decay()},
            {"eps", o->eps()},
            {"weight_decay", o->weight_decay()},
            {"initial_accumulator_value", o->initial_accumulator_value()},
            {"foreach", c10::IValue()},
            {"maximize", false},
            {"differentiable", false},
            {"fused", c10::IValue()}};
  }
  if (const auto* o = dynamic_cast<const torch::optim::RMSpropOptions*>(&options)) {
    return {
        {"lr", o->lr()},          {"momentum", o->momentum()}, {"alpha", o->alpha()},
        {"eps", o->eps()},        {"centered", o->centered()}, {"weight_decay", o->weight_decay()},
        {"capturable", false},    {"foreach", c10::IValue()},  {"maximize", false},
        {"differentiable", false}};
  }
  TORCH_CHECK(false, "param_groups: optimizer options of type ",
              c10::demangle(typeid(options).name()),
              " are not supported; fsdp translates torch::optim::SGD, Adam, AdamW, Adagrad and "
              "RMSprop");
}

// Reads typed values of one group's options, with messages naming the group.
class GroupReader {
 public:
  GroupReader(const OptimParamGroup& group, size_t index) : group_(group), index_(index) {}

  void set_double(const char* name, const std::function<void(double)>& set) const {
    if (const c10::IValue* v = find(name)) {
      TORCH_CHECK(v->isDouble() || v->isInt(), where(name), " must be a number, found ",
                  v->tagKind());
      set(checked_finite(v->isDouble() ? v->toDouble() : static_cast<double>(v->toInt()),
                         where(name)));
    }
  }
  void set_bool(const char* name, const std::function<void(bool)>& set) const {
    if (const c10::IValue* v = find(name)) {
      TORCH_CHECK(v->isBool(), where(name), " must be a bool, found ", v->tagKind());
      set(v->toBool());
    }
  }
  void set_betas(const std::function<void(std::tuple<double, double>)>& set) const {
    if (const c10::IValue* v = find("betas")) {
      const bool ok = (v->isTuple() && v->toTupleRef().elements().size() == 2) ||
                      (v->isList() && v->toListRef().size() == 2);
      TORCH_CHECK(ok, where("betas"), " must be a pair of numbers, found ", v->tagKind());
      const auto elements = v->isTuple() ? v->toTupleRef().elements().vec() : v->toListRef().vec();
      auto number = [&](const c10::IValue& e) {
        TORCH_CHECK(e.isDouble() || e.isInt(), where("betas"), " must be a pair of numbers");
        return checked_finite(e.isDouble() ? e.toDouble() : static_cast<double>(e.toInt()),
                              where("betas"));
      };
      set({number(elements[0]), number(elements[1])});
    }
  }
  // Options LibTorch has no switch for must hold the value LibTorch behaves as.
  void expect_false(const char* name) const {
    if (const c10::IValue* v = find(name)) {
      TORCH_CHECK(v->isBool() && !v->toBool(), where(name), " is ", v->tagKind(), " ",
                  v->isBool() ? "True" : "",
                  "; LibTorch's optimizer has no such option and "
                  "behaves as False: train with it False");
    }
  }

 private:
  const c10::IValue* find(const char* name) const {
    const c10::IValue* v = group_.find(name);
    return v != nullptr && !v->isNone() ? v : nullptr;
  }
  std::string where(const char* name) const {
    return "load_optim_param_groups: param_groups[" + std::to_string(index_) + "]['" + name + "']";
  }
  const OptimParamGroup& group_;
  size_t index_;
};

template <typename AdamOptions>
void set_adam_options(AdamOptions& o, const GroupReader& r) {
  r.set_double("lr", [&](double v) { o.lr(v); });
  r.set_betas([&](std::tuple<double, double> v) { o.betas(v); });
  r.set_double("eps", [&](double v) { o.eps(v); });
  r.set_double("weight_decay", [&](double v) { o.weight_decay(v); });
  r.set_bool("amsgrad", [&](bool v) { o.amsgrad(v); });
  r.expect_false("maximize");
}

void set_group_options(torch::optim::OptimizerOptions& options, const GroupReader& r) {
  if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
    r.set_double("lr", [&](double v) { o->lr(v); });
    r.set_double("momentum", [&](double v) { o->momentum(v); });
    r.set_double("dampening", [&](double v) { o->dampening(v); });
    r.set_double("weight_decay", [&](double v) { o->weight_decay(v); });
    r.set_bool("nesterov", [&](bool v) { o->nesterov(v); });
    r.expect_false("maximize");
  } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
    set_adam_options(*o, r);
  } else if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
    set_adam_options(*o, r);
  } else if (auto* o = dynamic_cast<torch::optim::AdagradOptions*>(&options)) {
    r.set_double("lr", [&](double v) { o->lr(v); });
    r.set_double("lr_decay", [&](double v) { o->lr_decay(v); });
    r.set_double("eps", [&](double v) { o->eps(v); });
    r.set_double("weight_decay", [&](double v) { o->weight_decay(v); });
    r.set_double("initial_accumulator_value", [&](double v) { o->initial_accumulator_value(v); });
    r.expect_false("maximize");
  } else if (auto* o = dynamic_cast<torch::optim::RMSpropOptions*>(&options)) {
    r.set_double("lr", [&](double v) { o->lr(v); });
    r.set_double("momentum", [&](double v) { o->momentum(v); });
    r.set_double("alpha", [&](double v) { o->alpha(v); });
    r.set_double("eps", [&](double v) { o->eps(v); });
    r.set_bool("centered", [&](bool v) { o->centered(v); });
    r.set_double("weight_decay", [&](double v) { o->weight_decay(v); });
    r.expect_false("maximize");
  } else {
    group_options(options);  // raises naming the type
  }
}

// The FQNs of each optimizer group's parameters, in the model's parameter order.
std::vector<std::vector<std::string>> group_fqns(const ModelLayout& layout,
                                                 const torch::optim::Optimizer& optimizer) {
  std::vector<std::vector<std::string>> fqns;
  for (const torch::optim::OptimizerParamGroup& group : optimizer.param_groups()) {
    absl::flat_hash_set<const void*> members;
    for (const at::Tensor& p : group.params()) members.insert(p.unsafeGetTensorImpl());
    std::vector<std::string> names;
    for (const Param& param : params_of(layout)) {
      const at::Tensor& key =
          param.handle != nullptr ? param.handle->sharded_flat_param() : param.tensor;
      if (members.contains(key.unsafeGetTensorImpl())) names.push_back(param.fqn);
    }
    fqns.push_back(std::move(names));
  }
  return fqns;
}

}  // namespace

const c10::IValue* OptimParamGroup::find(const std::string& name) const {
  for (const auto& [key, value] : options) {
    if (key == name) return &value;
  }
  return nullptr;
}

std::vector<OptimParamGroup> optim_param_groups(FullyShardedRoot& model,
                                                const torch::optim::Optimizer& optimizer) {
  return state_internal::optim_param_groups(
      state_internal::model_layout(model, "optim_param_groups"), optimizer);
}

void load_optim_param_groups(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                             const std::vector<OptimParamGroup>& groups) {
  state_internal::load_optim_param_groups(
      state_internal::model_layout(model, "load_optim_param_groups"), optimizer, groups);
}

std::vector<OptimParamGroup> state_internal::optim_param_groups(
    const ModelLayout& layout, const torch::optim::Optimizer& optimizer) {
  std::vector<std::vector<std::string>> fqns = group_fqns(layout, optimizer);
  std::vector<OptimParamGroup> groups;
  for (size_t i = 0; i < fqns.size(); ++i) {
    groups.push_back({group_options(optimizer.param_groups()[i].options()), std::move(fqns[i])});
  }
  return groups;
}

void state_internal::load_optim_param_groups(const ModelLayout& layout,
                                             torch::optim::Optimizer& optimizer,
                                             const std::vector<OptimParamGroup>& groups) {
  const std::vector<std::vector<std::string>> fqns = group_fqns(layout, optimizer);
  TORCH_CHECK(groups.size() == fqns.size(), "load_optim_param_groups: the state has ",
              groups.size(), " parameter group(s), the optimizer ", fqns.size(),
              "; build the optimizer with the same groups");
  for (size_t i = 0; i < groups.size(); ++i) {
    TORCH_CHECK(groups[i].params == fqns[i], "load_optim_param_groups: param_groups[", i,
                "] holds '", absl::StrJoin(groups[i].params, "', '"),
                "' but the optimizer's holds '", absl::StrJoin(fqns[i], "', '"),
                "'; build the optimizer with the same groups");
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    set_group_options(optimizer.param_groups()[i].options(), GroupReader(groups[i], i));
  }
}

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
  const Source source =
      source_of(state_dict, kWhat,
                [&](const Param& param, const std::string& name, const std::vector<int64_t>& shape,
                    at::ScalarType dtype, int64_t begin, int64_t numel) {
                  const at::Tensor& value = state_dict[param.fqn][name];
                  state_internal::check_tensor(kWhat, param.fqn + " (" + name + ")", shape, dtype,
                                               value, "the optimizer state dict");
                  return value.reshape({-1}).narrow(0, begin, numel);
                });
  install_optim_state(state_internal::model_layout(model, kWhat), optimizer, state_dict.keys(),
                      source, kWhat);
}

ShardedOptimStateDict sharded_optim_state_dict(FullyShardedRoot& model,
                                               const torch::optim::Optimizer& optimizer) {
  return state_internal::sharded_optim_state_dict(
      state_internal::model_layout(model, "sharded_optim_state_dict"), optimizer);
}

void load_sharded_optim_state_dict(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                                   const ShardedOptimStateDict& state_dict) {
  state_internal::load_sharded_optim_state_dict(
      state_internal::model_layout(model, "load_sharded_optim_state_dict"), optimizer, state_dict);
}

ShardedOptimStateDict state_internal::sharded_optim_state_dict(
    const ModelLayout& layout, const torch::optim::Optimizer& optimizer) {
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

void state_internal::load_sharded_optim_state_dict(const ModelLayout& layout,
                                                   torch::optim::Optimizer& optimizer,
                                                   const ShardedOptimStateDict& state_dict) {
  static const char* kWhat = "load_sharded_optim_state_dict";
  auto elements = [&](const Param& param, const std::string& name,
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
  install_optim_state(layout, optimizer, state_dict.keys(), source_of(state_dict, kWhat, elements),
                      kWhat);
}

}  // namespace fsdp
