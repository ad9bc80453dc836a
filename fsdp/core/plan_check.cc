// FullyShardedRoot::memory_plan and check_plan (fully_sharded.h): the runtime's own plan
// (memory_plan.h) and the per-step comparison with what the rank measured.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/fused_adamw.h"
#include "fsdp/core/internal/runtime.h"
#include "fsdp/core/memory_plan.h"

namespace fsdp {
namespace {

template <typename Options>
const Options* first_group_options(const torch::optim::Optimizer& optimizer) {
  if (optimizer.param_groups().empty()) return nullptr;
  return dynamic_cast<const Options*>(&optimizer.param_groups().front().options());
}

int64_t bytes_of(const at::Tensor& tensor) { return tensor.defined() ? tensor.nbytes() : 0; }

int64_t state_bytes(const torch::optim::OptimizerParamState& state) {
  if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    return bytes_of(s->exp_avg()) + bytes_of(s->exp_avg_sq()) + bytes_of(s->max_exp_avg_sq());
  }
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    return bytes_of(s->exp_avg()) + bytes_of(s->exp_avg_sq()) + bytes_of(s->max_exp_avg_sq());
  }
  if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    return bytes_of(s->momentum_buffer());
  }
  if (auto* s = dynamic_cast<const torch::optim::AdagradParamState*>(&state)) {
    return bytes_of(s->sum());
  }
  if (auto* s = dynamic_cast<const torch::optim::RMSpropParamState*>(&state)) {
    return bytes_of(s->square_avg()) + bytes_of(s->momentum_buffer()) + bytes_of(s->grad_avg());
  }
  return 0;
}

// Bytes of the model's tensors that live on the tracked device: the shards (and their
// gradients) unless offloaded to a host the device's statistics do not count.
struct ModelBytes {
  int64_t parameters = 0;
  int64_t gradients = 0;
};

ModelBytes model_bytes(const core_internal::RootState& state, bool device_only) {
  ModelBytes bytes;
  const bool host_tracked = state.device().device().is_cpu();
  for (const auto& unit : state.units()) {
    for (FlatParamHandle* handle : unit->handles()) {
      if (device_only && handle->offloads_params() && !host_tracked) continue;
      const at::Tensor& shard = handle->sharded_flat_param();
      bytes.parameters += bytes_of(shard);
      bytes.gradients += bytes_of(shard.grad());
    }
  }
  return bytes;
}

std::array<CollectiveTraffic, kNumCollectiveKinds> traffic_of(const Communicator& comm) {
  std::array<CollectiveTraffic, kNumCollectiveKinds> traffic;
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    traffic[k] = comm.counters().get(static_cast<CollectiveKind>(k));
  }
  return traffic;
}

}  // namespace

OptimizerSpec optimizer_spec_of(const torch::optim::Optimizer& optimizer) {
  if (auto* o = first_group_options<torch::optim::SGDOptions>(optimizer)) {
    return OptimizerSpec::sgd(o->momentum() != 0);
  }
  if (auto* o = first_group_options<torch::optim::AdamOptions>(optimizer)) {
    OptimizerSpec spec = OptimizerSpec::adam();
    spec.states_per_element += o->amsgrad() ? 1 : 0;
    return spec;
  }
  if (auto* o = first_group_options<torch::optim::AdamWOptions>(optimizer)) {
    // A FusedAdamW is an AdamW whose step makes no temporaries.
    OptimizerSpec spec = dynamic_cast<const FusedAdamW*>(&optimizer) != nullptr
                             ? OptimizerSpec::fused_adamw()
                             : OptimizerSpec::adamw();
    spec.states_per_element += o->amsgrad() ? 1 : 0;
    return spec;
  }
  if (first_group_options<torch::optim::AdagradOptions>(optimizer) != nullptr) {
    return OptimizerSpec::adagrad();
  }
  if (auto* o = first_group_options<torch::optim::RMSpropOptions>(optimizer)) {
    return OptimizerSpec::rmsprop(o->momentum() != 0, o->centered());
  }
  TORCH_CHECK(false,
              "optimizer_spec_of: expected a torch::optim::SGD, Adam, AdamW, Adagrad or RMSprop "
              "with at least one parameter group, got another optimizer; give memory_plan an "
              "OptimizerSpec with its state tensors per element instead");
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t total = 0;
  for (const auto& entry : optimizer.state()) total += state_bytes(*entry.second);
  return total;
}

std::vector<Communicator*> core_internal::RootState::communicators() const {
  std::vector<Communicator*> all = {comm_.get()};
  for (const auto& unit : units_) {
    for (FlatParamHandle* handle : unit->handles()) {
      for (Communicator* c : {&handle->communicator(), handle->replicate_communicator()}) {
        if (c != nullptr && std::find(all.begin(), all.end(), c) == all.end()) all.push_back(c);
      }
    }
  }
  return all;
}

// Note [Checking the plan]
// With plan_check, each root forward opens a window: it resets the device's peak memory
// statistics (for the calling thread's memory tag, or the whole process) and notes the
// memory allocated then, the part of it that is model state (the shards and gradients on
// the tracked device, and the optimizer state the previous check measured), and every
// communicator's counters. check_plan, after the optimizer step, closes it: the measured
// peak is the peak since the window opened less what was allocated at its start that is
// not model state (the batch, the data set, anything of the caller's), so it compares
// with the plan's peak, which counts model state and what the step allocates. Parameters,
// gradients and optimizer state are measured from the tensors themselves, traffic from
// the counters' increase over the window.
void core_internal::RootState::open_plan_window() {
  PlanWindow& window = plan_window_;
  device_->reset_peak_memory_stats();
  window.start_allocated = device_->memory_allocated();
  const ModelBytes model = model_bytes(*this, /*device_only=*/true);
  window.start_model_state = model.parameters + model.gradients + window.optimizer_state_bytes;
  window.start_traffic.clear();
  for (Communicator* comm : communicators()) window.start_traffic.push_back(traffic_of(*comm));
  window.open = true;
}

MemoryPlan FullyShardedRoot::memory_plan(const OptimizerSpec& optimizer,
                                         c10::optional<int64_t> activation_bytes) const {
  // The plan's dtypes are those of the first trainable flat parameter (else of the first
  // floating one, else of the first); flat parameters of other dtypes plan as PlanFrozen.
  const FlatParamHandle* first = nullptr;
  int rank_of_first = 3;
  for (const auto& unit : state_->units()) {
    for (FlatParamHandle* handle : unit->handles()) {
      const int rank = handle->sharded_flat_param().requires_grad()                      ? 0
                       : c10::isFloatingType(handle->sharded_flat_param().scalar_type()) ? 1
                                                                                         : 2;
      if (rank < rank_of_first) {
        first = handle;
        rank_of_first = rank;
      }
    }
  }
  std::vector<PlanUnit> units;
  for (const auto& unit : state_->units()) {
    PlanUnit planned{unit->fqn(), 0, 0, unit->is_root()};
    for (FlatParamHandle* handle : unit->handles()) {
      const c10::ScalarType dtype = handle->sharded_flat_param().scalar_type();
      if (dtype != first->sharded_flat_param().scalar_type()) {
        planned.frozen_other_dtypes.push_back({dtype, handle->numel(), handle->param_dtype()});
      } else {
        (handle->sharded_flat_param().requires_grad() ? planned.trainable_numel
                                                      : planned.frozen_numel) += handle->numel();
      }
    }
    units.push_back(planned);
  }
  MemoryPlanOptions options;
  options.world_size(state_->comm().world_size())
      .sharding_strategy(state_->strategy())
      .optimizer(optimizer)
      .backward_prefetch(state_->backward_prefetch())
      .forward_prefetch(state_->forward_prefetch())
      .backend(plan_backend_of(state_->comm().backend_name()))
      .host_is_tracked(state_->device().device().is_cpu())
      .activation_bytes(activation_bytes);
  if (first != nullptr) {
    options.dtype(first->sharded_flat_param().scalar_type())
        .param_dtype(first->param_dtype())
        .reduce_dtype(first->reduce_dtype())
        .keep_low_precision_grads(first->keep_low_precision_grads())
        .cpu_offload(first->offloads_params());
    if (is_hybrid(state_->strategy())) {
      options.hybrid_shard_group_size(first->communicator().world_size());
    }
  }
  return plan_memory(units, options);
}

PlanCheckResult FullyShardedRoot::check_plan(const torch::optim::Optimizer& optimizer,
                                             c10::optional<int64_t> activation_bytes) {
  core_internal::RootState::PlanWindow& window = state_->plan_window();
  TORCH_CHECK(window.enabled,
              "check_plan: the model was built without plan_check; set "
              "FullyShardedDataParallelOptions::plan_check(true)");
  TORCH_CHECK(window.open,
              "check_plan: no step to check since the last check; call it once after each "
              "optimizer step, after the model's forward and backward");
  window.open = false;
  PlanMeasurement measured;
  const ModelBytes model = model_bytes(*state_, /*device_only=*/false);
  measured.sharded_parameter_bytes = model.parameters;
  measured.sharded_gradient_bytes = model.gradients;
  measured.optimizer_state_bytes = optimizer_state_bytes(optimizer);
  measured.peak_bytes =
      state_->device().max_memory_allocated() - (window.start_allocated - window.start_model_state);
  const std::vector<Communicator*> comms = state_->communicators();
  for (size_t c = 0; c < comms.size() && c < window.start_traffic.size(); ++c) {
    const auto now = traffic_of(*comms[c]);
    for (int k = 0; k < kNumCollectiveKinds; ++k) {
      measured.traffic[k].calls += now[k].calls - window.start_traffic[c][k].calls;
      measured.traffic[k].bytes_sent += now[k].bytes_sent - window.start_traffic[c][k].bytes_sent;
      measured.traffic[k].bytes_received +=
          now[k].bytes_received - window.start_traffic[c][k].bytes_received;
    }
  }
  // The optimizer's state lives beside the shards: on the tracked device unless offloaded.
  const bool state_on_device =
      model_bytes(*state_, /*device_only=*/true).parameters == model.parameters;
  window.optimizer_state_bytes = state_on_device ? measured.optimizer_state_bytes : 0;
  PlanCheckResult result =
      compare_with_plan(memory_plan(optimizer_spec_of(optimizer), activation_bytes), measured);
  if (const PlanComparison* row = result.first_exceeded()) {
    TORCH_CHECK(false, absl::StrFormat(
                           "plan check on rank %d: %s measured %d bytes, the plan says %d (ratio "
                           "%.3f, tolerance +%.0f%%); the step used more than this model's plan "
                           "(memory_plan.h): check that the optimizer is the one given, that no "
                           "collective outside the model ran between the root's forward and "
                           "check_plan, and the activation bytes given",
                           state_->comm().rank(), row->what, row->measured, row->planned,
                           row->ratio(), 100 * row->tolerance));
  }
  return result;
}

}  // namespace fsdp
