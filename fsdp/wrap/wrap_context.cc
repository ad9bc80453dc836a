#include "fsdp/wrap/wrap_context.h"

namespace fsdp {
namespace wrap_internal {

namespace {
thread_local ActiveScope active;
}  // namespace

const ActiveScope& active_scope() { return active; }

void enter_scope(void* scope, const std::type_info& config_type) {
  TORCH_CHECK(active.scope == nullptr,
              "WrapScope: already inside a wrap scope on this thread; nested wrap scopes "
              "are not supported (PyTorch's enable_wrap raises the same). Close the outer "
              "scope first.");
  active = {scope, &config_type};
}

void exit_scope(const void* scope) {
  TORCH_INTERNAL_ASSERT(active.scope == scope, "WrapScope destroyed out of order");
  active = {};
}

}  // namespace wrap_internal
}  // namespace fsdp
