#include "fsdp/core/unit.h"

#include <mutex>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"

#include "fsdp/core/internal/runtime.h"

namespace fsdp {
namespace {

// Bound units by the module they wrap (see UnitBase::bound_unit_of); ranks may be threads.
struct UnitRegistry {
  std::mutex mutex;
  absl::flat_hash_map<const torch::nn::Module*, UnitBase*> units;
};

UnitRegistry& registry() {
  static auto* registry = new UnitRegistry();  // never destroyed: units outlive statics
  return *registry;
}

}  // namespace

UnitBase::~UnitBase() {
  if (registered_ == nullptr) return;
  UnitRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.units.find(registered_);
  if (it != r.units.end() && it->second == this) r.units.erase(it);
}

void UnitBase::bind(std::shared_ptr<core_internal::UnitState> state) {
  state_ = std::move(state);
  registered_ = wrapped_module().get();
  UnitRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.units[registered_] = this;
}

UnitBase* UnitBase::bound_unit_of(const torch::nn::Module& module) {
  UnitRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.units.find(&module);
  return it == r.units.end() ? nullptr : it->second;
}

void UnitBase::shard_if_constructing() {
  constructed_handle_ =
      core_internal::shard_on_construction(*wrapped_module(), this, unit_options());
}

void UnitBase::pre_forward(bool inputs_seen) { state_->pre_forward(inputs_seen); }

at::Tensor UnitBase::cast_tensor_input(const at::Tensor& input) {
  return state_->cast_input(input);
}

at::Tensor UnitBase::cast_output(const at::Tensor& output) { return state_->cast_output(output); }

bool UnitBase::hook_output(const at::Tensor& output) { return state_->hook_output(output); }

void UnitBase::post_forward(bool hooked, bool outside_autograd) {
  state_->post_forward(hooked, outside_autograd);
}

// Note [A unit's module called directly]
// An auto_wrap_policy may pick a module that its parent holds itself (a ModuleList entry,
// a typed member): FSDP registers a unit around it in the module tree (names and state
// dicts as PyTorch's), while the parent keeps calling the module. Called as
// fsdp::forward_as<T>(module, ...), the call finds the unit (bound_unit_of) and runs
// through it. Called directly (m->as<T>()->forward(x)), it bypasses the unit: between
// its forwards a sharded unit's original parameters hold no memory, so the first kernel
// that reads one throws ("... its data is not allocated yet"), and the root's forward
// turns that into an error naming the unit and the fix; a NO_SHARD or prefetched unit's
// parameters do hold memory, so the root's post-forward checks that every such unit ran
// through its unit in that forward (RootState::check_units_ran). Without FSDP there is
// no unit, and either call is the plain one.
void UnitBase::rethrow_forward_error() const {
  const core_internal::UnitState* skipped =
      state_->is_root() ? state_->root().unit_called_directly() : nullptr;
  if (skipped == nullptr) throw;
  std::string what;
  try {
    throw;
  } catch (const c10::Error& error) {
    what = error.what_without_backtrace();
  }
  TORCH_CHECK(false, core_internal::called_directly_message(*skipped),
              " (the forward failed with: ", what, ")");
}

void UnitBase::throw_not_a(const char* type_name) const {
  const std::shared_ptr<torch::nn::Module> module = wrapped_module();
  const torch::nn::Module& actual = *module;  // typeid of a plain reference
  TORCH_CHECK(false, "fsdp::forward_as: expected the unit's module to be a ",
              c10::demangle(type_name), ", but it is a ", c10::demangle(typeid(actual).name()));
}

}  // namespace fsdp
