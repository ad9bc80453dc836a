#include "fsdp/core/unit.h"

#include <utility>

#include "fsdp/core/internal/runtime.h"

namespace fsdp {

void UnitBase::bind(std::shared_ptr<core_internal::UnitState> state) { state_ = std::move(state); }

void UnitBase::shard_if_constructing() {
  constructed_handle_ = core_internal::shard_on_construction(*this);
}

void UnitBase::pre_forward() { state_->pre_forward(); }

at::Tensor UnitBase::cast_tensor_input(const at::Tensor& input) {
  return state_->cast_input(input);
}

at::Tensor UnitBase::cast_output(const at::Tensor& output) { return state_->cast_output(output); }

bool UnitBase::hook_output(const at::Tensor& output) { return state_->hook_output(output); }

void UnitBase::post_forward(bool hooked) { state_->post_forward(hooked); }

}  // namespace fsdp
