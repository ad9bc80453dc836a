// The wrap scope: annotate modules with wrap() in model code; they become units only
// inside a WrapScope, so the same model code runs with and without FSDP (PyTorch:
// torch.distributed.fsdp.wrap.enable_wrap / wrap, as an RAII object).
//
//   struct UnitOptions { int bucket_mb = 25; };
//   auto make_unit = [](std::shared_ptr<torch::nn::Module> m, const UnitOptions& o) {...};
//   {
//     fsdp::WrapScope<UnitOptions> scope(make_unit, UnitOptions{});
//     auto l1 = fsdp::wrap<UnitOptions>(torch::nn::Linear(5, 5));           // wrapped
//     auto l2 = fsdp::wrap<UnitOptions>(torch::nn::Linear(5, 5),
//                                       [](UnitOptions& o) { o.bucket_mb = 1; });
//   }
//   auto l3 = fsdp::wrap<UnitOptions>(torch::nn::Linear(5, 5));  // unchanged: no scope
//
// `Options` is the wrapper's configuration (the seed's **wrapper_kwargs): the scope holds
// the defaults, and a call-site override edits a copy of them, so it wins.
//
// Threading: a scope is active on the thread that created it, until it is destroyed (the
// seed's context is process-wide; per-thread scopes let ranks run as threads). Nesting
// scopes on one thread, of any Options type, throws c10::Error, as in the seed.
#ifndef FSDP_WRAP_WRAP_CONTEXT_H_
#define FSDP_WRAP_WRAP_CONTEXT_H_

#include <functional>
#include <memory>
#include <typeinfo>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace fsdp {
namespace wrap_internal {

// The scope active on this thread: its address and its Options type, or nulls.
struct ActiveScope {
  const void* scope = nullptr;
  const std::type_info* options_type = nullptr;
};
ActiveScope& active_scope();

// Marks `scope` active; throws if a scope is already active on this thread.
void enter_scope(const void* scope, const std::type_info& options_type);
void exit_scope(const void* scope);

}  // namespace wrap_internal

template <typename Options>
class [[nodiscard]] WrapScope {
 public:
  // Makes the wrapper for a module with the effective options (the seed's wrapper_cls).
  using Factory = std::function<std::shared_ptr<torch::nn::Module>(
      std::shared_ptr<torch::nn::Module> module, const Options& options)>;

  // Throws c10::Error if `wrapper_factory` is empty or a scope is already active on this
  // thread ("nested wrap scopes are not supported").
  WrapScope(Factory wrapper_factory, Options defaults = Options())
      : factory_(std::move(wrapper_factory)), defaults_(std::move(defaults)) {
    TORCH_CHECK(factory_ != nullptr, "WrapScope: wrapper_factory is empty");
    wrap_internal::enter_scope(this, typeid(Options));
  }
  ~WrapScope() { wrap_internal::exit_scope(this); }
  WrapScope(const WrapScope&) = delete;
  WrapScope& operator=(const WrapScope&) = delete;

  std::shared_ptr<torch::nn::Module> apply(std::shared_ptr<torch::nn::Module> module,
                                           const std::function<void(Options&)>& overrides) const {
    Options options = defaults_;
    if (overrides) overrides(options);
    std::shared_ptr<torch::nn::Module> wrapped = factory_(std::move(module), options);
    TORCH_CHECK(wrapped != nullptr, "wrap: the scope's wrapper_factory returned null");
    return wrapped;
  }

 private:
  Factory factory_;
  Options defaults_;
};

// Inside a WrapScope<Options> on this thread: the scope's wrapper around `module`, made
// with the scope's options edited by `overrides`. Outside any scope: `module` itself.
// Throws c10::Error if the active scope has another Options type, or module is null.
// PyTorch: torch.distributed.fsdp.wrap.wrap.
template <typename Options>
std::shared_ptr<torch::nn::Module> wrap(std::shared_ptr<torch::nn::Module> module,
                                        const std::function<void(Options&)>& overrides = {}) {
  TORCH_CHECK(module != nullptr, "wrap: module is null");
  const wrap_internal::ActiveScope& active = wrap_internal::active_scope();
  if (active.scope == nullptr) return module;
  TORCH_CHECK(*active.options_type == typeid(Options),
              "wrap: the active WrapScope takes options of another type; call wrap<> with "
              "the scope's Options type");
  return static_cast<const WrapScope<Options>*>(active.scope)->apply(std::move(module), overrides);
}

// Same, for a module holder such as torch::nn::Linear.
template <typename Options, typename Contained>
std::shared_ptr<torch::nn::Module> wrap(const torch::nn::ModuleHolder<Contained>& module,
                                        const std::function<void(Options&)>& overrides = {}) {
  return wrap<Options>(std::static_pointer_cast<torch::nn::Module>(module.ptr()), overrides);
}

}  // namespace fsdp

#endif  // FSDP_WRAP_WRAP_CONTEXT_H_
