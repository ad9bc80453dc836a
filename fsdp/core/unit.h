// FSDP units: the module wrapper that makes a submodule one unit of sharding.
//
//   struct Net : torch::nn::Module {
//     Net() {
//       block1 = register_module("block1", fsdp::Unit<BlockImpl>(std::make_shared<BlockImpl>()));
//       head = register_module("head", torch::nn::Linear(64, 10));
//     }
//     torch::Tensor forward(torch::Tensor x) { return head(block1(x)); }
//     fsdp::Unit<BlockImpl> block1{nullptr};
//     torch::nn::Linear head{nullptr};
//   };
//
// A Unit<T> holds the module as its child "_fsdp_wrapped_module" (so names clean as in
// PyTorch: "block1._fsdp_wrapped_module.fc.weight" -> "block1.fc.weight") and has T's
// forward signature, so it sits in a typed member, a ModuleList, a std::vector or a
// Sequential (AnyModule). Until a FullyShardedDataParallel root binds it, a unit is a
// transparent pass-through: the same model code runs with and without FSDP.
//
// Bound, its forward unshards the unit's flat parameter, runs T::forward, reshards
// (FULL_SHARD) and hooks the tensor outputs for backward (see Note [Units intercept
// forward and backward] in internal/runtime.cc). Outputs hooked: at::Tensor,
// std::tuple/std::vector of tensors; a unit with other outputs keeps its parameters
// gathered until its backward. A unit whose parameters are all frozen reshards when the
// gradients of its tensor arguments are complete, as PyTorch's FSDP does. With mixed precision,
// floating at::Tensor arguments are cast (see Note [Mixed precision] in internal/runtime.cc).
// PyTorch: a nested FullyShardedDataParallel instance.
//
// fsdp::wrap(module) is PyTorch's wrap(): it returns the module itself, annotated inside an
// EnableWrap scope (fully_sharded.h) as a unit with the scope's settings and per-unit
// overrides; the root registers the unit in the module's place, so the parent keeps the
// user's type and calls it through fsdp::forward_as (see wrap below):
//
//   blocks->push_back(fsdp::wrap(Block(64), fsdp::UnitOptions().sharding_strategy(
//                                               fsdp::ShardingStrategy::kNoShard)));
//   for (auto& m : *blocks) x = fsdp::forward_as<BlockImpl>(m, x);
//
// Threading: a unit runs on its rank's thread.
#ifndef FSDP_CORE_UNIT_H_
#define FSDP_CORE_UNIT_H_

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include "fsdp/base/names.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/forward_as.h"
#include "fsdp/core/options.h"

namespace fsdp {

// How a unit was made: whether a root binds it without an auto_wrap_policy, and its own
// settings.
struct UnitAnnotation {
  bool annotated = true;
  UnitOptions options;
};

namespace core_internal {
class UnitState;    // the runtime state of a bound unit (internal/runtime.h)
struct UnitBinder;  // how a FullyShardedDataParallel root binds units (fully_sharded.cc)

// What fsdp::wrap does (see EnableWrap in fully_sharded.h): inside a scope, records the
// annotation of `module` (the scope's settings edited by `overrides`) and shards it if the
// scope shards on construction; outside any scope, nothing.
void annotate_for_wrap(const std::shared_ptr<torch::nn::Module>& module,
                       const UnitOptions& overrides);
}  // namespace core_internal

// What fsdp::wrap recorded for a module inside an EnableWrap scope.
struct WrapAnnotation {
  UnitOptions options;  // the scope's strategy and mixed precision, edited by the overrides
  // The flat parameter made at once if the scope shards on construction (FQNs relative to
  // the module), else null. Owned by the annotation: valid until a root takes it.
  const FlatParamHandle* constructed_handle = nullptr;
};
// The annotation fsdp::wrap recorded for `module`, until a FullyShardedDataParallel root
// registers a unit in its place; nullopt if there is none. Thread-safe.
c10::optional<WrapAnnotation> wrap_annotation(const torch::nn::Module& module);

// What the runtime finds in a module tree: any Unit<T>.
class UnitBase : public torch::nn::Module {
 public:
  // Whether a root makes this a unit without an auto_wrap_policy: true unless made with a
  // UnitAnnotation saying otherwise (a Unit<T> made directly is; so is the unit a root
  // registers for an fsdp::wrap annotation).
  bool annotated() const { return annotation_.annotated; }
  // The unit's own settings (from fsdp::wrap's annotation).
  const UnitOptions& unit_options() const { return annotation_.options; }
  // The wrapped module.
  virtual std::shared_ptr<torch::nn::Module> wrapped_module() const = 0;
  // Whether a FullyShardedDataParallel root has bound this unit (a unit binds once).
  bool is_bound() const { return state_ != nullptr; }
  // The bound unit that wraps `module`, or null (`module` is in no unit, or its unit is
  // not bound). Thread-safe. See fsdp::forward_as.
  static UnitBase* bound_unit_of(const torch::nn::Module& module);

  // Runs the wrapped module's forward, as a `Module` (its C++ type), with the FSDP steps
  // around it: what fsdp::forward_as does for a unit. Errors: c10::Error if the wrapped
  // module is not a `Module`.
  template <typename Module, typename... Args>
  decltype(auto) forward_wrapped_as(Args&&... args) {
    auto* module = dynamic_cast<Module*>(wrapped_module().get());
    if (module == nullptr) throw_not_a(typeid(Module).name());
    return run(inputs_all_seen<Args...>(), [&]() -> decltype(auto) {
      return module->forward(cast_input(std::forward<Args>(args))...);
    });
  }
  // The flat parameter made when this unit was built inside an EnableWrap scope that shards on
  // construction (FQNs relative to the wrapped module), until the binding root takes it.
  const FlatParamHandle* constructed_handle() const { return constructed_handle_.get(); }
  std::unique_ptr<FlatParamHandle> take_constructed_handle() {
    return std::move(constructed_handle_);
  }

 protected:
  explicit UnitBase(UnitAnnotation annotation) : annotation_(std::move(annotation)) {}
  // Called at the end of a unit's constructor: shards now inside an EnableWrap scope that
  // shards on construction.
  void shard_if_constructing();

  ~UnitBase() override;

  // Whether cast_input sees every tensor a forward taking `Args` is passed: each argument
  // is a tensor or a scalar (not a container or struct that may hold tensors). Only then
  // may a frozen unit reshard once its inputs' gradients are complete (Note [Frozen units
  // reshard after their backward] in internal/runtime.cc).
  template <typename... Args>
  static constexpr bool inputs_all_seen() {
    return ((std::is_same_v<std::decay_t<Args>, at::Tensor> ||
             std::is_arithmetic_v<std::decay_t<Args>> || std::is_enum_v<std::decay_t<Args>>)&&...);
  }

  // Runs `forward` (the wrapped module's) with the FSDP steps around it; `inputs_seen`:
  // inputs_all_seen for its arguments.
  template <typename Forward>
  auto run(bool inputs_seen, Forward&& forward) -> decltype(forward()) {
    if (!state_) return forward();
    pre_forward(inputs_seen);
    auto output = [&]() -> decltype(forward()) {
      try {
        return forward();
      } catch (const c10::Error&) {
        rethrow_forward_error();  // See Note [A unit's module called directly] in unit.cc.
      }
    }();
    if constexpr (std::is_same_v<std::decay_t<decltype(output)>, at::Tensor>) {
      output = cast_output(output);
    }
    const OutputHooks hooks = hook_outputs(output);
    post_forward(hooks == OutputHooks::kHooked, hooks == OutputHooks::kNoneNeedGrad);
    return output;
  }

  // An argument of the wrapped module's forward, cast if it is a floating tensor and the
  // unit casts inputs, and watched if it is a tensor that needs a gradient and the unit's
  // parameters are all frozen (Note [Frozen units reshard after their backward] in
  // internal/runtime.cc); any other argument passes through unchanged.
  template <typename T>
  decltype(auto) cast_input(T&& arg) {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      return at::Tensor(state_ ? cast_tensor_input(arg) : arg);
    } else {
      return std::forward<T>(arg);
    }
  }

 private:
  // The runtime steps (unit.cc forwards them to the bound state).
  void pre_forward(bool inputs_seen);
  at::Tensor cast_tensor_input(const at::Tensor& input);
  at::Tensor cast_output(const at::Tensor& output);
  bool hook_output(const at::Tensor& output);
  void post_forward(bool hooked, bool outside_autograd);
  // Inside a catch block: rethrows the error, or one naming the unit whose module the
  // forward called directly (the root only).
  [[noreturn]] void rethrow_forward_error() const;
  [[noreturn]] void throw_not_a(const char* type_name) const;

  // What hooking a forward's outputs found: a tensor that needs a gradient (hooked), only
  // tensors that need none, or something else, which may carry tensors that need one
  // (see the file comment).
  enum class OutputHooks { kNoneNeedGrad = 0, kOpaque = 1, kHooked = 2 };
  static OutputHooks combine(OutputHooks a, OutputHooks b) { return std::max(a, b); }
  OutputHooks hook_tensor(const at::Tensor& output) {
    return hook_output(output) ? OutputHooks::kHooked : OutputHooks::kNoneNeedGrad;
  }

  OutputHooks hook_outputs(const at::Tensor& output) { return hook_tensor(output); }
  OutputHooks hook_outputs(const std::vector<at::Tensor>& outputs) {
    OutputHooks hooks = OutputHooks::kNoneNeedGrad;
    for (const at::Tensor& t : outputs) hooks = combine(hooks, hook_tensor(t));
    return hooks;
  }
  template <typename... Ts>
  OutputHooks hook_outputs(const std::tuple<Ts...>& outputs) {
    return std::apply(
        [this](const auto&... items) {
          OutputHooks hooks = OutputHooks::kNoneNeedGrad;
          ((hooks = combine(hooks, hook_item(items))), ...);
          return hooks;
        },
        outputs);
  }
  template <typename T>
  OutputHooks hook_outputs(const T&) {
    return OutputHooks::kOpaque;  // not a tensor: see the file comment
  }
  template <typename T>
  OutputHooks hook_item(const T& item) {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      return hook_tensor(item);
    } else {
      return OutputHooks::kOpaque;
    }
  }

  friend struct core_internal::UnitBinder;
  // Called by the binding FullyShardedDataParallel root.
  void bind(std::shared_ptr<core_internal::UnitState> state);

  UnitAnnotation annotation_;
  std::shared_ptr<core_internal::UnitState> state_;
  const torch::nn::Module* registered_ = nullptr;  // bound_unit_of's key, once bound
  std::unique_ptr<FlatParamHandle> constructed_handle_;
};

template <typename Contained>
class UnitImpl : public UnitBase,
                 public detail::ForwardAs<UnitImpl<Contained>, decltype(&Contained::forward)> {
 public:
  explicit UnitImpl(std::shared_ptr<Contained> module, UnitAnnotation annotation = {})
      : UnitBase(std::move(annotation)),
        module_(register_module(std::string(kFsdpWrappedModule), std::move(module))) {
    shard_if_constructing();
  }

  std::shared_ptr<torch::nn::Module> wrapped_module() const override { return module_; }
  const std::shared_ptr<Contained>& module() const { return module_; }

  template <typename... Args>
  decltype(auto) call(Args&&... args) {
    return run(this->template inputs_all_seen<Args...>(), [&]() -> decltype(auto) {
      return module_->forward(this->cast_input(std::forward<Args>(args))...);
    });
  }

 private:
  std::shared_ptr<Contained> module_;
};

// A ModuleHolder for UnitImpl<Contained>, made from the module to wrap:
//   fsdp::Unit<torch::nn::LinearImpl> unit(torch::nn::Linear(5, 5).ptr());
template <typename Contained>
class Unit : public torch::nn::ModuleHolder<UnitImpl<Contained>> {
 public:
  using torch::nn::ModuleHolder<UnitImpl<Contained>>::ModuleHolder;
  explicit Unit(std::shared_ptr<Contained> module, UnitAnnotation annotation = {})
      : torch::nn::ModuleHolder<UnitImpl<Contained>>(
            std::make_shared<UnitImpl<Contained>>(std::move(module), std::move(annotation))) {}
};

// A unit around a type-erased module with a Tensor -> Tensor forward: what
// FullyShardedDataParallel's auto_wrap_policy puts in place of a Sequential's child.
class AnyUnitImpl : public UnitBase {
 public:
  explicit AnyUnitImpl(torch::nn::AnyModule module)
      : UnitBase(UnitAnnotation{}),
        module_(std::move(module)),
        wrapped_(register_module(std::string(kFsdpWrappedModule), module_.ptr())) {
    shard_if_constructing();
  }
  std::shared_ptr<torch::nn::Module> wrapped_module() const override { return wrapped_; }
  at::Tensor forward(at::Tensor input) {
    return run(true, [&] { return module_.forward(cast_input(std::move(input))); });
  }

 private:
  torch::nn::AnyModule module_;
  std::shared_ptr<torch::nn::Module> wrapped_;
};

// Calls `module`'s forward as a `Module` (its C++ type), through the FSDP unit that
// wraps it if there is one, else directly: in a model whose parent holds its blocks
// itself (a torch::nn::ModuleList, a typed member), write
//
//   for (auto& m : *blocks) x = fsdp::forward_as<BlockImpl>(m, x);
//   // instead of: for (auto& m : *blocks) x = m->as<BlockImpl>()->forward(x);
//
// and an auto_wrap_policy can make the blocks units (fully_sharded.h). `module` may be
// the module itself (what a ModuleList holds), a ModuleHolder of it (a typed member:
// fsdp::forward_as(block, x)), or a Unit<T> around it. Without FSDP it is the plain
// call. Errors: c10::Error if `module` is null or not a `Module`. Threading: the rank's.
template <typename Module, typename Pointee, typename... Args>
decltype(auto) forward_as(const std::shared_ptr<Pointee>& module, Args&&... args) {
  TORCH_CHECK(module != nullptr, "fsdp::forward_as: the module is null");
  const std::shared_ptr<torch::nn::Module> base = module;
  UnitBase* unit = dynamic_cast<UnitBase*>(base.get());
  if (unit == nullptr) unit = UnitBase::bound_unit_of(*base);
  if (unit != nullptr) {
    return unit->template forward_wrapped_as<Module>(std::forward<Args>(args)...);
  }
  auto* typed = dynamic_cast<Module*>(base.get());
  const torch::nn::Module& actual = *base;  // typeid of a plain reference: clang's -Wall is quiet
  TORCH_CHECK(typed != nullptr, "fsdp::forward_as: expected a ", c10::demangle_type<Module>(),
              " (or a unit around one), but the module is a ",
              c10::demangle(typeid(actual).name()));
  return typed->forward(std::forward<Args>(args)...);
}
template <typename Module, typename... Args>
decltype(auto) forward_as(const torch::nn::ModuleHolder<Module>& module, Args&&... args) {
  return forward_as<Module>(module.ptr(), std::forward<Args>(args)...);
}
template <typename Module, typename... Args>
decltype(auto) forward_as(const Unit<Module>& unit, Args&&... args) {
  return forward_as<Module>(unit.ptr(), std::forward<Args>(args)...);
}

// Unit<T> for a module holder: fsdp::make_unit(torch::nn::Linear(5, 5)).
template <typename Contained>
Unit<Contained> make_unit(const torch::nn::ModuleHolder<Contained>& module) {
  return Unit<Contained>(module.ptr());
}

// PyTorch's wrap(module, **overrides): returns `module` itself, and inside an EnableWrap
// scope on this thread annotates it as a unit with the scope's sharding_strategy and
// mixed_precision, each replaced by `overrides` where set (and shards it at once if the
// scope shards on construction); outside any scope it does nothing (an auto_wrap_policy
// may still pick the module). The parent registers and calls the module as its own type
// (a ModuleList entry stays a BlockImpl); the root that binds the model registers a unit
// in its place, as for a module an auto_wrap_policy picks (fully_sharded.h), so a parent
// that holds it calls it with fsdp::forward_as, and a direct call
// (m->as<BlockImpl>()->forward(x)) under FSDP is the error naming the unit. A
// torch::nn::Sequential child is swapped for a unit around it. Errors: c10::Error for a
// null module, a module annotated twice, or a Unit<T> (wrap the module it holds). PyTorch:
// torch.distributed.fsdp.wrap.wrap. Before issue 36 it returned a Unit<T>; a Unit<T> built
// directly still is one and is called as the module's own forward.
template <typename Holder, typename = typename Holder::ContainedType>
Holder wrap(Holder module, const UnitOptions& overrides = {}) {
  static_assert(std::is_base_of_v<torch::nn::ModuleHolder<typename Holder::ContainedType>, Holder>,
                "fsdp::wrap takes a module holder (e.g. torch::nn::Linear) or a shared_ptr");
  core_internal::annotate_for_wrap(module.ptr(), overrides);
  return module;
}
template <typename Contained>
std::shared_ptr<Contained> wrap(std::shared_ptr<Contained> module,
                                const UnitOptions& overrides = {}) {
  core_internal::annotate_for_wrap(module, overrides);
  return module;
}

}  // namespace fsdp

#endif  // FSDP_CORE_UNIT_H_
