// The wrap scope: the thread's wrap configuration while an RAII object lives (PyTorch:
// torch.distributed.fsdp.wrap.enable_wrap, whose wrap() reads the wrapper class and
// kwargs the scope set). fsdp/wrap knows nothing of sharding: `Config` is whatever the
// wrapper needs, e.g. fsdp/core's EnableWrap holds the FSDP options its wrap() makes
// units with.
//
//   struct Config { int bucket_mb = 25; };
//   {
//     fsdp::WrapScope<Config> scope(Config{1});
//     fsdp::WrapScope<Config>::active()->config().bucket_mb;  // 1
//   }
//   fsdp::WrapScope<Config>::active();  // nullptr: no scope
//
// Threading: a scope is active on the thread that created it, until it is destroyed (the
// seed's context is process-wide; per-thread scopes let ranks run as threads). Nesting
// scopes on one thread, of any Config type, throws c10::Error, as PyTorch's `enable_wrap` raises.
#ifndef FSDP_WRAP_WRAP_CONTEXT_H_
#define FSDP_WRAP_WRAP_CONTEXT_H_

#include <typeinfo>
#include <utility>

#include <c10/util/Exception.h>
#include <c10/util/Type.h>

namespace fsdp {
namespace wrap_internal {

// The scope active on this thread: its address and its Config type, or nulls.
struct ActiveScope {
  void* scope = nullptr;
  const std::type_info* config_type = nullptr;
};
const ActiveScope& active_scope();

// Marks `scope` active; throws if a scope is already active on this thread.
void enter_scope(void* scope, const std::type_info& config_type);
void exit_scope(const void* scope);

}  // namespace wrap_internal

template <typename Config>
class [[nodiscard]] WrapScope {
 public:
  // Throws c10::Error if a scope is already active on this thread ("nested wrap scopes
  // are not supported").
  explicit WrapScope(Config config) : config_(std::move(config)) {
    wrap_internal::enter_scope(this, typeid(Config));
  }
  ~WrapScope() { wrap_internal::exit_scope(this); }
  WrapScope(const WrapScope&) = delete;
  WrapScope& operator=(const WrapScope&) = delete;

  Config& config() { return config_; }

  // The scope active on this thread, or nullptr if none is. Throws c10::Error if the
  // active scope holds another Config type.
  static WrapScope* active() {
    const wrap_internal::ActiveScope& active = wrap_internal::active_scope();
    if (active.scope == nullptr) return nullptr;
    TORCH_CHECK(*active.config_type == typeid(Config),
                "wrap: the active wrap scope holds a configuration of another type (",
                c10::demangle(active.config_type->name()), "); close it before using this wrapper");
    return static_cast<WrapScope*>(active.scope);
  }

 private:
  Config config_;
};

}  // namespace fsdp

#endif  // FSDP_WRAP_WRAP_CONTEXT_H_
