#include "fsdp/core/internal/runtime.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include "fsdp/base/torch_compat.h"

namespace fsdp {

namespace core_internal {
namespace {

// Note [Units intercept forward and backward]
// The C++ frontend has no module hooks, so a unit's forward() itself runs the FSDP steps
// around the wrapped module's forward (unit.h): pre_forward unshards, post_forward
// reshards (FULL_SHARD, not the root) and puts a hook on each output that requires
// grad. In backward:
// - pre-backward: the output hook fires before the unit's own backward ops and gathers
//   the parameters again (the first such hook of a pass also queues the end-of-backward
//   callback on the autograd engine);
// - post-backward: every original parameter is an output of one GradientSink node per
//   unit (set_gradient_edge), so the engine calls the sink once, with every parameter's
//   summed gradient, after the last op that uses them; the sink reduce-scatters into the
//   sharded flat parameter's .grad and reshards;
// - end of backward: the queued callback reshards units whose sink never ran (unused in
//   this iteration) and resets the per-iteration state.

class GradientSink : public torch::autograd::Node {
 public:
  explicit GradientSink(std::weak_ptr<UnitState> unit) : unit_(std::move(unit)) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (auto unit = unit_.lock()) unit->post_backward(std::move(grads));
    return {};
  }

  std::string name() const override { return "fsdp::GradientSink"; }

 private:
  std::weak_ptr<UnitState> unit_;
};

}  // namespace

UnitState::UnitState(std::string fqn, bool is_root, RootState* root,
                     std::unique_ptr<FlatParamHandle> handle,
                     std::vector<std::unique_ptr<FlatParamHandle>> frozen_handles)
    : FullyShardedUnit(std::move(fqn), is_root, std::move(handle), std::move(frozen_handles)),
      root_(root) {
  for (const auto& frozen : frozen_handles_) {
    TORCH_INTERNAL_ASSERT(handle_ != nullptr && frozen != nullptr &&
                          !frozen->sharded_flat_param().requires_grad());
  }
}

// Note [Frozen parameters in a unit]
// A unit's frozen flat parameters (frozen_handles, one per dtype) follow its first one
// (handle) through every transition: gathered right after it (each by its own all-gather,
// in the same order on every rank), freed with it. They are no input of the gradient
// sink, so they are never reduced and hold no gradient. They are freed when the sink runs
// (the trainable gradients are complete): by Note [Gradient sinks], every backward op of
// the unit that is ready runs before the sink, including those that read the frozen
// parameters (a LoRA layer's frozen weight for its input gradient), the same guarantee the
// trainable parameters rely on.
void UnitState::unshard() {
  if (will_all_gather()) root_->wait_for_all_gather_slot();
  handle_->unshard();
  for (const auto& frozen : frozen_handles_) frozen->unshard();
}

bool UnitState::will_all_gather() const {
  return handle_ != nullptr && handle_->state() == FlatParamState::kSharded &&
         handle_->strategy() != ShardingStrategy::kNoShard;
}

// Note [Gradient sinks]
// The autograd engine runs ready nodes in decreasing sequence number (creation order).
// A sink made at construction would have the lowest number of all and run after every
// other node, so every unit would stay unsharded until the end of backward. Each
// iteration's first forward of a unit therefore makes a new sink (numbered after the
// ops of the units that ran before it), so it runs as soon as the unit's own backward
// ops are done, before the backward of earlier units: each unit is reduced and resharded
// in turn.
bool UnitState::all_frozen() const {
  return handle_ != nullptr && !handle_->sharded_flat_param().requires_grad();
}

void UnitState::install_gradient_sink() {
  if (!handle_ || all_frozen()) return;
  auto sink = std::make_shared<GradientSink>(weak_from_this());
  const std::vector<at::Tensor>& params = handle_->original_params();
  for (size_t i = 0; i < params.size(); ++i) {
    sink->add_input_metadata(params[i]);
    torch::autograd::impl::set_gradient_edge(params[i], {sink, static_cast<uint32_t>(i)});
  }
}

void UnitState::pre_forward(bool inputs_seen) {
  root_->assert_in_states({TrainingState::kIdle, TrainingState::kForwardBackward}, "forward");
  if (is_root_) root_->begin_forward();
  if (!handle_) return;
  root_->record_forward(this);
  // See Note [Frozen units reshard after their backward].
  watch_inputs_ = all_frozen() && at::GradMode::is_enabled();
  if (watch_inputs_ && !inputs_seen) {
    watch_inputs_ = false;
    inputs_pending_ = -1;
  }
  if (!sink_installed_ && at::GradMode::is_enabled()) {
    install_gradient_sink();
    sink_installed_ = true;
  }
  unshard();
  handle_state_ = HandleTrainingState::kForward;
  root_->prefetch_for_forward_after(this);
}

bool UnitState::hook_output(const at::Tensor& output) {
  if (!output.defined() || !output.requires_grad()) return false;
  std::weak_ptr<UnitState> self = weak_from_this();
  output.register_hook([self](const at::Tensor& grad) {
    if (auto unit = self.lock()) unit->pre_backward();
    return grad;
  });
  return true;
}

// Note [Mixed precision]
// PyTorch's MixedPrecision, without module hooks. Parameters: each unit's handle keeps
// the full-precision shard for the optimizer and gathers a param_dtype copy for forward
// and backward (flat_param.h). Inputs: a unit's forward casts its floating at::Tensor
// arguments to param_dtype (the root if cast_root_forward_inputs, other units if
// cast_forward_inputs); integer tensors (token ids) and other arguments are left alone.
// Units whose wrapped module MixedPrecision::full_precision_modules picks (BatchNorm by
// default) keep their parameters in full precision, cast floating inputs up to it and
// their tensor output back to the inputs' dtype, as PyTorch does for
// _module_classes_to_ignore. Buffers: cast to buffer_dtype when the root's forward
// starts and back to their own dtype when the iteration ends, so outside forward and
// backward (state dicts, checkpoints) they have their original dtypes.
at::Tensor UnitState::cast_input(const at::Tensor& input) {
  at::Tensor cast = input;
  if (cast_inputs_to_ && input.defined() && at::isFloatingType(input.scalar_type())) {
    if (!input_dtype_) input_dtype_ = input.scalar_type();
    cast = input.to(*cast_inputs_to_);
  }
  return watch_inputs_ ? watch_input(cast) : cast;
}

at::Tensor UnitState::cast_output(const at::Tensor& output) {
  if (!restore_output_dtype_ || !input_dtype_ || !output.defined() ||
      !at::isFloatingType(output.scalar_type())) {
    return output;
  }
  return output.to(*std::exchange(input_dtype_, c10::nullopt));
}

// Note [Units outside autograd]
// A unit whose forward returns only tensors that need no gradient (a frozen embedding fed
// token ids, as in LoRA; any unit under torch::NoGradGuard) is outside autograd's graph:
// nothing in backward reads its unsharded parameters. It reshards after forward as a
// hooked unit does, and backward prefetching passes over it, since it has no backward to
// gather for. Before this, such a unit kept its parameters gathered until the end of
// backward (a LoRA fine-tune of a 672 M Llama held the 250 MiB embedding through the whole
// step) and an evaluation forward gathered every unit of the model at once. A unit whose
// outputs are not all tensors may hand tensors that need a gradient out another way, so
// it still keeps its parameters (nothing would gather them again for its backward).
void UnitState::post_forward(bool hooked, bool outside_autograd) {
  if (is_root_) root_->check_units_ran();
  if (!outside_autograd) needs_backward_ = true;
  if (handle_) {
    handle_state_ = HandleTrainingState::kIdle;
    // The root keeps its parameters for backward (saves an all-gather); a unit whose
    // outputs carry no hook keeps them too, since nothing would gather them again, unless
    // it is outside autograd (see the Note above).
    if (!is_root_ && (hooked || outside_autograd) && reshards_after_forward(handle_->strategy())) {
      reshard();
    }
  }
  input_dtype_ = c10::nullopt;
  watch_inputs_ = false;
  if (is_root_ && !at::GradMode::is_enabled()) root_->end_forward_without_grad();
}

void UnitState::assert_handle_in(std::initializer_list<HandleTrainingState> states,
                                 const char* what) const {
  if (std::find(states.begin(), states.end(), handle_state_) != states.end()) return;
  std::vector<std::string> names;
  for (HandleTrainingState state : states) names.push_back(handle_training_state_name(state));
  TORCH_CHECK(false, "FullyShardedDataParallel ", what, " of unit ",
              is_root_ ? std::string("(the root)") : "'" + fqn_ + "'",
              ": expected its flat parameter in states [", absl::StrJoin(names, ", "),
              "] but current state is ", handle_training_state_name(handle_state_));
}

// The states a unit's backward hooks may find its handle in: idle after forward (or
// when its pre-backward hook did not run), or already in backward. PyTorch asserts
// BACKWARD_PRE or BACKWARD_POST in its post-backward hook; a C++ unit whose outputs carry
// no hook (post_forward's `hooked`) reaches post-backward from IDLE.
constexpr std::initializer_list<HandleTrainingState> kBackwardStates = {
    HandleTrainingState::kIdle, HandleTrainingState::kBackwardPre,
    HandleTrainingState::kBackwardPost};

void UnitState::pre_backward() {
  const bool first = handle_ && !pre_backward_done_;
  if (first) assert_handle_in(kBackwardStates, "pre-backward");
  root_->ensure_end_of_backward_callback();
  if (!first) return;
  pre_backward_done_ = true;
  unshard();
  handle_state_ = HandleTrainingState::kBackwardPre;
  root_->prefetch_for_backward_after(this, BackwardPrefetch::kBackwardPre);
}

// Note [Frozen units reshard after their backward]
// A unit whose parameters are all frozen (a LoRA model's output head; any unit of a model
// whose parameters are frozen but whose inputs need gradients) has no gradient sink, so
// nothing marked the end of its backward and it stayed gathered until the end of the whole
// backward: in a LoRA fine-tune of a 672 M Llama, the 250 MiB head beside the last two
// layers. Its backward ops read its parameters only to pass gradients on to its inputs, so
// once every tensor argument's gradient is complete they are done with them. PyTorch's
// FSDP does this with a multi-grad hook on the inputs (_register_post_backward_reshard_-
// only_hook) and FSDP2 with RegisterPostBackwardFunction on them. Here each tensor argument
// that needs a gradient is passed through at::alias, a node of its own that only this
// unit's ops read, with a hook that counts down; at zero the unit reshards and may
// prefetch as after a gradient reduction. A unit that cannot see every tensor its forward
// gets (an argument that is a container or struct) waits for the end of backward, as does
// one with an argument that never gets a gradient; the count spans every forward of the
// unit in the iteration. As PyTorch's hooks, this assumes the unit's forward reads no
// tensor that needs a gradient other than its arguments (say, another module's trainable
// parameter held by reference): the backward towards such a tensor could run after the
// count reached zero, on freed parameters.
at::Tensor UnitState::watch_input(const at::Tensor& input) {
  if (!input.defined() || !input.requires_grad() || inputs_pending_ < 0) return input;
  at::Tensor watched = at::alias(input);
  ++inputs_pending_;
  watched.register_hook([self = weak_from_this(), iteration = iteration_](const at::Tensor&) {
    if (auto unit = self.lock()) unit->input_gradient_ready(iteration);
  });
  return watched;
}

void UnitState::input_gradient_ready(uint64_t iteration) {
  if (iteration != iteration_ || inputs_pending_ <= 0 || --inputs_pending_ > 0) return;
  assert_handle_in(kBackwardStates, "post-backward");
  handle_state_ = HandleTrainingState::kBackwardPost;
  reshard();
  root_->prefetch_for_backward_after(this, BackwardPrefetch::kBackwardPost);
}

void UnitState::post_backward(std::vector<at::Tensor> grads) {
  TORCH_INTERNAL_ASSERT(handle_ != nullptr);
  assert_handle_in(kBackwardStates, "post-backward");
  handle_state_ = HandleTrainingState::kBackwardPost;
  // The parameters are not needed any more: free them before the reduction allocates.
  reshard();
  if (root_->sync_gradients()) {
    root_->start_reduction(*handle_, std::move(grads));
  } else {
    handle_->accumulate_grad(std::move(grads));  // no_sync: no communication
  }
  root_->prefetch_for_backward_after(this, BackwardPrefetch::kBackwardPost);
}

void UnitState::prefetch() {
  if (!handle_ || handle_state_ != HandleTrainingState::kIdle) return;
  if (will_all_gather()) root_->wait_for_all_gather_slot();
  for (FlatParamHandle* handle : handles()) handle->prefetch();
}

void UnitState::summon(bool keep) {
  if (!handle_) return;
  assert_handle_in({HandleTrainingState::kIdle}, "summon_full_params");
  for (FlatParamHandle* handle : handles()) handle->unshard_full_precision();
  handle_state_ = HandleTrainingState::kSummonFullParams;
  if (!keep) reshard();
}

void UnitState::reshard() {
  // Gathered parameters to free (NO_SHARD frees only a mixed-precision copy).
  const bool frees_gathered = handle_ != nullptr && handle_->state() != FlatParamState::kSharded &&
                              handle_->strategy() != ShardingStrategy::kNoShard;
  for (FlatParamHandle* handle : handles()) handle->reshard();
  if (frees_gathered) root_->record_reshard();
}

void UnitState::finish_iteration() {
  reshard();
  // CPU offload: gradients reach .grad, and the host shards may be written, only now.
  for (FlatParamHandle* handle : handles()) handle->wait_for_offload();
  handle_state_ = HandleTrainingState::kIdle;
  pre_backward_done_ = false;
  needs_backward_ = false;
  sink_installed_ = false;
  inputs_pending_ = 0;
  ++iteration_;
}

void RootState::assert_in_states(std::initializer_list<TrainingState> states,
                                 const char* what) const {
  for (TrainingState state : states) {
    if (state == training_state_) return;
  }
  std::vector<std::string> names;
  for (TrainingState state : states) names.push_back(training_state_name(state));
  TORCH_CHECK(false, "FullyShardedDataParallel ", what, ": expected to be in states [",
              absl::StrJoin(names, ", "), "] but current state is ",
              training_state_name(training_state_));
}

// Note [Summoning full parameters]
// PyTorch's summon_full_params with use_orig_params=False. Each unit summoned (the root
// only without recurse) gathers its full-precision flat parameter, whose views the
// original parameters are; with rank0_only the other ranks reshard at once. with_grads
// all-gathers each sharded unit's shard gradient into a full flat gradient (one
// all-gather per unit, in the unit's shard group) and gives each original parameter its
// view as grad (NO_SHARD gradients are full already); the grads are dropped at the end.
// offload_to_cpu points each original parameter of a sharded unit at a CPU copy of its
// view (set_data) and back at the end, copying the CPU values into the view first under
// writeback, so the shard written back holds the edits. The scope ends by writing back
// (writeback) and resharding every unit it summoned.
void RootState::begin_summon(const SummonFullParamsOptions& options) {
  assert_in_states({TrainingState::kIdle}, "summon_full_params");
  TORCH_CHECK(!(options.writeback() && options.rank0_only()),
              "summon_full_params: writeback=true with "
              "rank0_only=true is not supported (the other ranks hold no full copy to write "
              "back); pass writeback=false");
  TORCH_CHECK(!(options.with_grads() && options.offload_to_cpu()),
              "summon_full_params: with_grads=true with offload_to_cpu=true is not supported "
              "(as in PyTorch); pass one of them");
  training_state_ = TrainingState::kSummonFullParams;
  summon_writeback_ = options.writeback();
  const bool keep = !options.rank0_only() || comm_->rank() == 0;
  for (const auto& unit : units_) {
    if (!options.recurse() && !unit->is_root()) continue;
    if (options.with_grads()) summon_grads(*unit);  // before the unit's own collectives
    unit->summon(keep);
    summoned_.push_back(unit.get());
    if (!options.offload_to_cpu() || !keep) continue;
    for (FlatParamHandle* handle : unit->handles()) {
      if (handle->strategy() == ShardingStrategy::kNoShard || handle->device().is_cpu()) continue;
      at::NoGradGuard no_grad;
      for (const at::Tensor& p : handle->original_params()) {
        offloaded_.emplace_back(p, p.detach());
        p.set_data(p.detach().to(at::kCPU));
      }
    }
  }
}

void RootState::summon_grads(UnitState& unit) {
  FlatParamHandle* handle = unit.handle();
  if (handle == nullptr) return;
  const at::Tensor& shard_grad = handle->sharded_flat_param().grad();
  // Every rank of the unit's shard group has a gradient or none (one backward).
  if (!shard_grad.defined()) return;
  at::Tensor full = shard_grad;
  if (handle->padded_numel() != handle->shard_numel()) {
    full = at::empty({handle->padded_numel()}, shard_grad.options());
    handle->communicator().all_gather_into_tensor(full, shard_grad.contiguous());
  }
  for (size_t i = 0; i < handle->param_infos().size(); ++i) {
    const FlatParamInfo& info = handle->param_infos()[i];
    const at::Tensor& p = handle->original_params()[i];
    p.mutable_grad() = full.narrow(0, info.offset, info.numel).view(info.shape);
    summoned_grads_.push_back(p);
  }
}

void RootState::end_summon() {
  at::NoGradGuard no_grad;
  for (auto& [param, device_view] : offloaded_) {
    if (summon_writeback_) device_view.copy_(param.detach());
    param.set_data(device_view);
  }
  offloaded_.clear();
  for (at::Tensor& p : summoned_grads_) p.mutable_grad() = at::Tensor();
  summoned_grads_.clear();
  for (UnitState* unit : summoned_) {
    for (FlatParamHandle* handle : unit->handles()) {
      if (summon_writeback_ && handle->is_unsharded()) handle->write_back_shard();
    }
    unit->finish_iteration();
  }
  summoned_.clear();
  training_state_ = TrainingState::kIdle;
}

std::string called_directly_message(const UnitState& unit) {
  const std::string& type = unit.module_type_name();
  return absl::StrCat(
      "FullyShardedDataParallel: the forward called the module of unit '", unit.fqn(), "' (", type,
      ") directly, bypassing the unit, so its parameters were not gathered for it; "
      "call it through its unit with fsdp::forward_as, e.g. `x = fsdp::forward_as<",
      type, ">(m, x);` instead of `x = m->as<", type,
      ">()->forward(x);` (m: the ModuleList entry or typed member; works without FSDP too)");
}

const UnitState* RootState::unit_called_directly() const {
  for (const std::shared_ptr<UnitState>& unit : units_) {
    if (!unit->parent_holds_module() || unit->handle() == nullptr) continue;
    if (unit->handle()->is_unsharded()) continue;
    if (std::find(forward_order_.begin(), forward_order_.end(), unit.get()) ==
        forward_order_.end()) {
      return unit.get();
    }
  }
  return nullptr;
}

void RootState::check_units_ran() const {
  for (const std::shared_ptr<UnitState>& unit : units_) {
    if (!unit->parent_holds_module() || unit->handle() == nullptr) continue;
    TORCH_CHECK(
        std::find(forward_order_.begin(), forward_order_.end(), unit.get()) != forward_order_.end(),
        called_directly_message(*unit),
        " (the unit did not run in this forward; a unit FSDP made around a module its "
        "parent holds must run through fsdp::forward_as in every forward)");
  }
}

// Note [Prefetching]
// Units run backward in the reverse of the order they ran forward in this iteration
// (recorded by record_forward). With kBackwardPre, a unit starting its backward begins
// the all-gather of the unit that runs backward next; with kBackwardPost it does so
// after issuing its gradient reduction. With forward_prefetch, a unit starting its
// forward begins the all-gather of the unit that came after it in the previous
// iteration. Prefetching is one unit ahead, so at most one all-gather is in flight
// besides the one being waited for; the all-gathers per iteration are the same ones,
// issued earlier (REFERENCE §4 counts hold); with the host waiting for each all-gather,
// that bounds the units gathered at once (Note [Streams and freeing unsharded memory] in
// flat_param.cc). Under ParamExecOrderWrapPolicy both passes
// follow the first iteration's order instead, whatever order later iterations run in
// (PyTorch 2.0's experimental policy).
void RootState::record_forward(UnitState* unit) {
  if (std::find(forward_order_.begin(), forward_order_.end(), unit) != forward_order_.end()) {
    return;  // run again in this iteration
  }
  if (validate_execution_order_) validate_position(unit, forward_order_.size());
  forward_order_.push_back(unit);
}

// Note [Execution order validation]
// Units of equal flat size run in different orders on two ranks all-gather each other's
// shards without any error: silently wrong parameters. With validate_execution_order,
// each unit's first forward of the first iteration all-gathers its index (pre-order
// position) from every rank before it unshards, and every rank raises the same error if
// they differ (so none is left waiting in a collective). Later iterations compare the
// order with the first one's locally and warn once if it changed (the prefetching
// order then follows the new one). PyTorch: _ExecOrderData (FSDP debug level DETAIL).
// A rank that runs fewer units than the others still hangs in the check's all-gather
// until the communicator's timeout.
void RootState::validate_position(const UnitState* unit, size_t position) {
  const auto index_of = [this](const UnitState* u) {
    for (size_t i = 0; i < units_.size(); ++i) {
      if (units_[i].get() == u) return static_cast<int64_t>(i);
    }
    TORCH_INTERNAL_ASSERT(false, "unit '", u->fqn(), "' is not one of this root's units");
  };
  if (!first_iteration_) {
    const bool same =
        position < first_forward_order_.size() && first_forward_order_[position] == unit;
    if (!same && !warned_order_change_) {
      warned_order_change_ = true;
      TORCH_WARN(
          "FullyShardedDataParallel: the forward order of units changed after the "
          "first iteration: unit '",
          unit->fqn(), "' ran at position ", position, " where the first iteration ran ",
          position < first_forward_order_.size() ? "'" + first_forward_order_[position]->fqn() + "'"
                                                 : std::string("no unit"),
          "; prefetching follows the previous iteration's order. Warned once.");
    }
    return;
  }
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(device_->device());
  at::Tensor mine = at::full({1}, index_of(unit), on_device);
  at::Tensor all = at::empty({comm_->world_size()}, on_device);
  comm_->all_gather_into_tensor(all, mine);
  all = all.cpu();
  const auto* indices = all.data_ptr<int64_t>();
  std::vector<std::string> ranks;
  bool differs = false;
  for (int r = 0; r < comm_->world_size(); ++r) {
    differs = differs || indices[r] != indices[0];
    ranks.push_back(absl::StrCat("rank ", r, " runs '", units_[indices[r]]->fqn(), "'"));
  }
  TORCH_CHECK(!differs,
              "FullyShardedDataParallel: forward order differs across ranks at "
              "unit position ",
              position, " of the first iteration: ", absl::StrJoin(ranks, ", "),
              ". Every rank must run the units in the same order (the same control flow), "
              "or units would all-gather each other's parameters");
}

// Note [Limiting all-gathers]
// PyTorch FSDP1's limit_all_gathers: a unit may issue its all-gathers only once the device
// has finished the work queued before the second-to-last reshard that freed gathered
// parameters, so the host runs at most two units ahead of the device, however many flat
// parameters (so all-gathers) a unit has: a LoRA unit has two, a QLoRA unit three. Each
// such reshard records an event on the compute stream; a unit about to all-gather (unshard
// or prefetch) waits on the host for the oldest while two or more are queued. On the CPU
// every event has completed when it is recorded. The memory the units hold does not depend
// on it (Note [Streams and freeing unsharded memory] in flat_param.cc): it bounds how much
// work the host queues ahead. NCCL's own bound (NcclOptions::max_in_flight_all_gathers)
// counts all-gathers instead, so at two the third all-gather of a QLoRA unit waited for
// the device to finish the unit before; it is off unless asked for.
void RootState::wait_for_all_gather_slot() {
  if (reshard_events_.size() < kUnitsAhead) return;
  const std::unique_ptr<DeviceEvent> oldest = std::move(reshard_events_.front());
  reshard_events_.pop_front();
  oldest->synchronize();
}

void RootState::record_reshard() {
  // Only the last two are waited for.
  if (reshard_events_.size() == kUnitsAhead) reshard_events_.pop_front();
  reshard_events_.push_back(device_->record_event(device_->current_stream()));
}

void RootState::prefetch_in_first_iteration_order() {
  first_iteration_order_ = true;
  forward_prefetch_ = true;
  backward_prefetch_ = BackwardPrefetch::kBackwardPre;
}

void RootState::prefetch_for_forward_after(const UnitState* unit) {
  if (!forward_prefetch_) return;
  const std::vector<UnitState*>& order =
      first_iteration_order_ ? first_forward_order_ : last_forward_order_;
  auto it = std::find(order.begin(), order.end(), unit);
  if (it != order.end() && ++it != order.end()) (*it)->prefetch();
}

void RootState::prefetch_for_backward_after(const UnitState* unit, BackwardPrefetch when) {
  if (backward_prefetch_ != when) return;
  const std::vector<UnitState*>& order =
      first_iteration_order_ && !first_iteration_ ? first_forward_order_ : forward_order_;
  // The latest unit in forward order, other than `unit`, whose backward has not started
  // and will come (Note [Units outside autograd]).
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    if (*it != unit && (*it)->needs_backward() && !(*it)->pre_backward_done()) {
      (*it)->prefetch();
      return;
    }
  }
}

// Note [A backward that did not finish]
// An exception inside backward (in a unit's backward ops, a user hook, a collective or a
// gradient reduction) ends the autograd engine's pass without running the end-of-backward
// callback, so nothing ends the iteration: a reduction stays in flight (reducing_), units
// stay gathered or marked as having started their backward (the next backward would not
// gather them again), last iteration's gradient sinks stay connected, and the next backward
// would queue no callback (callback_queued_ is still set). The root's next forward sees
// callback_queued_ (no forward of the root runs inside backward: the checkpoint wrapper never
// wraps a unit) and ends the abandoned iteration first (abandon_backward): it drops the
// reduction in flight, after waiting for its collective, instead of adding it to .grad (the
// usual loop zeroes gradients before that forward, and the stale gradient would be added to
// the next one's), then reshards every unit (waiting for any prefetch) and resets the
// per-iteration state as finish_backward would. Units whose post-backward ran before the
// exception keep their reduced gradients in .grad, so zero them (optimizer.zero_grad())
// before the next step, as the usual loop does. Inside no_sync, what the failed pass
// accumulated stays in the unsharded accumulators and is reduced with the next pass's
// gradients. The collectives still match only if every
// rank failed at the same point (an error of the model, not of one rank's data); a failure
// on one rank leaves the others waiting in a collective until the communicator's timeout.
// If the dropped reduction's collective failed, its error is thrown from that forward, with
// the reduction dropped, and the next forward finishes resetting.
void RootState::abandon_backward() {
  if (FlatParamHandle* handle = std::exchange(reducing_, nullptr)) handle->cancel_reduce_grad();
  end_iteration();
  callback_queued_ = false;
}

void RootState::begin_forward() {
  if (callback_queued_) abandon_backward();  // See Note [A backward that did not finish]
  training_state_ = TrainingState::kForwardBackward;
  cast_buffers(/*to_original=*/false);
  if (plan_window_.enabled) open_plan_window();  // See Note [Checking the plan]
  // See Note [First-iteration size checks].
  if (first_iteration_ || validate_execution_order_) comm_->set_size_checks(true);
}

void RootState::end_forward_without_grad() {
  end_iteration();
  check_schedule_if_due();
}

// Iterations are the schedule's steps (Note [Collective schedule checks] in
// fsdp/comm/internal/schedule.cc): each one ends a step (end_iteration), and every
// schedule_check_every-th of this root compares the ranks' schedules (its own count: two
// roots on one communicator each check every N of their own iterations). After the iteration's
// state is reset, so that a mismatch leaves the model idle.
void RootState::check_schedule_if_due() {
  if (schedule_check_every_ <= 0) return;
  if (++iterations_ % schedule_check_every_ == 0) comm_->check_collective_schedule();
}

// Note [First-iteration size checks]
// Ranks that run different units, or the same units in another order, issue collectives
// of different sizes; a communication backend may then corrupt data, hang, or (Gloo)
// terminate the process. During the first iteration every collective of the root's
// communicator family is size-checked (Communicator::set_size_checks), so such ranks
// stop with a CommError naming each rank's collective and size. With
// validate_execution_order the checks stay on in every iteration. They cost one small
// all-gather per collective: on the GPT at W = 2, +11 to +16 ms per step (+16% to +37%,
// Communicator::set_size_checks has the figures), far above the 2% of a step that would
// justify them by default. So by default a divergence after the first iteration still
// ends in Gloo terminating a rank, but only after one line naming the collective and
// the cause (Note [Gloo terminations] in fsdp/comm/gloo.cc). PyTorch checks every
// collective only under TORCH_DISTRIBUTED_DEBUG=DETAIL.
void RootState::end_iteration() {
  for (const auto& unit : units_) unit->finish_iteration();
  if (first_iteration_ && !validate_execution_order_) comm_->set_size_checks(false);
  if (first_iteration_) first_forward_order_ = forward_order_;
  first_iteration_ = false;
  last_forward_order_ = std::move(forward_order_);
  forward_order_.clear();
  cast_buffers(/*to_original=*/true);
  training_state_ = TrainingState::kIdle;
  comm_->end_schedule_step();
}

void RootState::set_buffer_casts(std::vector<at::Tensor> buffers, c10::ScalarType dtype) {
  cast_buffers_ = std::move(buffers);
  buffer_dtypes_.clear();
  for (const at::Tensor& buffer : cast_buffers_) buffer_dtypes_.push_back(buffer.scalar_type());
  buffer_dtype_ = dtype;
}

// See Note [Mixed precision].
void RootState::cast_buffers(bool to_original) {
  for (size_t i = 0; i < cast_buffers_.size(); ++i) {
    const c10::ScalarType dtype = to_original ? buffer_dtypes_[i] : *buffer_dtype_;
    at::Tensor& buffer = cast_buffers_[i];
    if (buffer.scalar_type() != dtype) buffer.set_data(buffer.detach().to(dtype));
  }
}

void RootState::ensure_end_of_backward_callback() {
  if (callback_queued_) return;
  callback_queued_ = true;
  compat::queue_end_of_backward_callback([this] { finish_backward(); });
}

// Note [Asynchronous gradient reduction]
// A unit's post-backward issues its reduce-scatter (NO_SHARD: all-reduce) and returns, so
// the collective's bytes move (Gloo's transport thread, NCCL's stream) while autograd
// computes the next unit's gradients: DDP's overlap of its bucketed all-reduce with
// backward, and what PyTorch FSDP's post-backward stream gives on the GPU. The next
// post-backward first waits for it, so at most one reduction is in flight and peak memory
// grows by one flat gradient at most (REFERENCE §5); the end-of-backward callback waits
// for the last, so every .grad is final when backward() returns. Every rank issues and
// waits in the same order, so collectives still match one for one.
void RootState::start_reduction(FlatParamHandle& handle, std::vector<at::Tensor> grads) {
  finish_reduction();
  handle.start_reduce_grad(std::move(grads));
  reducing_ = &handle;
}

void RootState::finish_reduction() {
  if (reducing_ == nullptr) return;
  FlatParamHandle* handle = reducing_;
  reducing_ = nullptr;
  handle->finish_reduce_grad();
}

void RootState::finish_backward() {
  finish_reduction();
  end_iteration();
  callback_queued_ = false;
  check_schedule_if_due();
}

// Note [Gradient norm over shards]
// The total norm is that of every gradient once: the sharded flat gradients (each rank
// holds a disjoint shard, padding is zero) summed over the shard group, plus gradients
// every rank holds whole (NO_SHARD units, ignored modules' parameters), counted once and
// not reduced (all-reducing them would count them world-size times). For norm p:
// (sum_shards sum |g|^p + sum_replicated |g|^p)^(1/p); for inf: the max over both, the
// shards' max taken over ranks with an all-gather (the communicator has no max
// reduction). In float32 whatever the gradients' dtype. PyTorch:
// FullyShardedDataParallel.clip_grad_norm_.
at::Tensor RootState::clip_grad_norm(double max_norm, double norm_type) {
  assert_in_states({TrainingState::kIdle}, "clip_grad_norm_");
  TORCH_CHECK(norm_type > 0, "clip_grad_norm_: expected norm_type > 0 (or inf), got ", norm_type);
  const bool inf = std::isinf(norm_type);
  std::vector<at::Tensor> grads;
  Communicator* shard_group = nullptr;
  // On the compute device, as the gradients are.
  const auto on_device = at::TensorOptions().dtype(at::kFloat).device(device_->device());
  at::Tensor sharded = at::zeros({1}, on_device);
  at::Tensor replicated = at::zeros({}, on_device);
  const auto add = [&](at::Tensor& total, const at::Tensor& grad) {
    if (!grad.defined()) return;
    grads.push_back(grad);
    // On the gradient's own device (CPU for offloaded shards and maybe ignored parameters),
    // then only the partial norm moves to the compute device.
    const at::Tensor g = grad.detach().to(at::kFloat).abs();
    if (g.numel() == 0) return;
    const at::Tensor part = inf ? g.max() : g.pow(norm_type).sum();
    total =
        inf ? at::maximum(total, part.to(device_->device())) : total + part.to(device_->device());
  };
  for (const auto& unit : units_) {
    FlatParamHandle* handle = unit->handle();
    if (handle == nullptr) continue;
    const at::Tensor& grad = handle->sharded_flat_param().grad();
    if (handle->strategy() == ShardingStrategy::kNoShard) {
      add(replicated, grad);
    } else {
      add(sharded, grad);
      shard_group = &handle->communicator();
    }
  }
  for (const at::Tensor& param : ignored_params_) add(replicated, param.grad());
  if (shard_group != nullptr && shard_group->world_size() > 1) {
    if (inf) {
      at::Tensor all = at::empty({shard_group->world_size()}, on_device);
      shard_group->all_gather_into_tensor(all, sharded);
      sharded = all.max();
    } else {
      shard_group->all_reduce(sharded, ReduceOp::kSum);
    }
  }
  at::Tensor total = inf ? at::maximum(sharded.reshape({}), replicated)
                         : (sharded.reshape({}) + replicated).pow(1.0 / norm_type);
  const at::Tensor coefficient = at::clamp_max(max_norm / (total + 1e-6), 1.0);
  for (at::Tensor& grad : grads)
    grad.detach().mul_(coefficient.to(grad.device(), grad.scalar_type()));
  return total;
}

}  // namespace core_internal
}  // namespace fsdp
