#include "fsdp/wrap/wrap_context.h"

namespace fsdp {
namespace wrap_internal {

ActiveScope& active_scope() {
  thread_local ActiveScope scope;
  return scope;
}

void enter_scope(const void* scope, const std::type_info& options_type) {
  ActiveScope& active = active_scope();
  TORCH_CHECK(active.scope == nullptr,
              "WrapScope: already inside a wrap scope on this thread; nested wrap scopes "
              "are not supported (PyTorch's enable_wrap raises the same). Close the outer "
              "scope first.");
  active = {scope, &options_type};
}

void exit_scope(const void* scope) {
  ActiveScope& active = active_scope();
  TORCH_INTERNAL_ASSERT(active.scope == scope, "WrapScope destroyed out of order");
  active = {};
}

}  // namespace wrap_internal
}  // namespace fsdp
