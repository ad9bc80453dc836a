#include "fsdp/core/internal/runtime.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdp {

const char* training_state_name(TrainingState state) {
  switch (state) {
    case TrainingState::kIdle:
      return "TrainingState.IDLE";
    case TrainingState::kForwardBackward:
      return "TrainingState.FORWARD_BACKWARD";
    case TrainingState::kSummonFullParams:
      return "TrainingState.SUMMON_FULL_PARAMS";
  }
  return "unknown";
}

const char* handle_training_state_name(HandleTrainingState state) {
  switch (state) {
    case HandleTrainingState::kIdle:
      return "HandleTrainingState.IDLE";
    case HandleTrainingState::kForward:
      return "HandleTrainingState.FORWARD";
    case HandleTrainingState::kBackwardPre:
      return "HandleTrainingState.BACKWARD_PRE";
    case HandleTrainingState::kBackwardPost:
      return "HandleTrainingState.BACKWARD_POST";
    case HandleTrainingState::kSummonFullParams:
      return "HandleTrainingState.SUMMON_FULL_PARAMS";
  }
  return "unknown";
}

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
    if (auto unit = unit_.lock()) unit->post_backward(grads);
    return {};
  }

  std::string name() const override { return "fsdp::GradientSink"; }

 private:
  std::weak_ptr<UnitState> unit_;
};

}  // namespace

UnitState::UnitState(std::string fqn, bool is_root, RootState* root,
                     std::unique_ptr<FlatParamHandle> handle)
    : fqn_(std::move(fqn)), is_root_(is_root), root_(root), handle_(std::move(handle)) {}

// Note [Gradient sinks]
// The autograd engine runs ready nodes in decreasing sequence number (creation order).
// A sink made at construction would have the lowest number of all and run after every
// other node, so every unit would stay unsharded until the end of backward. Each
// iteration's first forward of a unit therefore makes a new sink (numbered after the
// ops of the units that ran before it), so it runs as soon as the unit's own backward
// ops are done, before the backward of earlier units: each unit is reduced and resharded
// in turn.
void UnitState::install_gradient_sink() {
  if (!handle_) return;
  auto sink = std::make_shared<GradientSink>(weak_from_this());
  const std::vector<at::Tensor>& params = handle_->original_params();
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].requires_grad(), "FullyShardedDataParallel: parameter '",
                handle_->param_infos()[i].fqn,
                "' does not require grad; frozen parameters are not supported yet: leave the "
                "module out with ignored_modules");
    sink->add_input_metadata(params[i]);
    torch::autograd::impl::set_gradient_edge(params[i],
                                             {sink, static_cast<uint32_t>(i)});
  }
}

void UnitState::pre_forward() {
  root_->assert_in_states({TrainingState::kIdle, TrainingState::kForwardBackward},
                          "forward");
  if (is_root_) root_->begin_forward();
  if (!handle_) return;
  root_->record_forward(this);
  if (!sink_installed_ && at::GradMode::is_enabled()) {
    install_gradient_sink();
    sink_installed_ = true;
  }
  handle_->unshard();
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

void UnitState::post_forward(bool hooked) {
  if (handle_) {
    handle_state_ = HandleTrainingState::kIdle;
    // The root keeps its parameters for backward (saves an all-gather); a unit whose
    // outputs carry no hook keeps them too, since nothing would gather them again.
    if (!is_root_ && hooked && root_->strategy() == ShardingStrategy::kFullShard) {
      handle_->reshard();
    }
  }
  if (is_root_ && !at::GradMode::is_enabled()) root_->end_forward_without_grad();
}

void UnitState::pre_backward() {
  root_->ensure_end_of_backward_callback();
  if (pre_backward_done_ || !handle_) return;
  pre_backward_done_ = true;
  handle_->unshard();
  handle_state_ = HandleTrainingState::kBackwardPre;
  root_->prefetch_for_backward_after(this, BackwardPrefetch::kBackwardPre);
}

void UnitState::post_backward(const std::vector<at::Tensor>& grads) {
  TORCH_INTERNAL_ASSERT(handle_ != nullptr);
  handle_state_ = HandleTrainingState::kBackwardPost;
  // The parameters are not needed any more: free them before the reduction allocates.
  reshard_if_sharded_strategy();
  if (root_->sync_gradients()) {
    handle_->reduce_grad(grads);
  } else {
    handle_->accumulate_grad(grads);  // no_sync: no communication
  }
  root_->prefetch_for_backward_after(this, BackwardPrefetch::kBackwardPost);
}

void UnitState::reshard_if_sharded_strategy() {
  if (handle_ && root_->strategy() != ShardingStrategy::kNoShard) handle_->reshard();
}

void UnitState::finish_iteration() {
  reshard_if_sharded_strategy();
  handle_state_ = HandleTrainingState::kIdle;
  pre_backward_done_ = false;
  sink_installed_ = false;
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

void RootState::begin_summon(bool writeback, bool rank0_only) {
  assert_in_states({TrainingState::kIdle}, "summon_full_params");
  TORCH_CHECK(!(writeback && rank0_only), "summon_full_params: writeback=true with "
              "rank0_only=true is not supported (the other ranks hold no full copy to write "
              "back); pass writeback=false");
  training_state_ = TrainingState::kSummonFullParams;
  summon_writeback_ = writeback;
  for (const auto& unit : units_) {
    FlatParamHandle* handle = unit->handle();
    if (handle == nullptr) continue;
    handle->unshard();  // every rank takes part in the all-gather
    unit->set_handle_state(HandleTrainingState::kSummonFullParams);
    if (rank0_only && comm_->rank() != 0) handle->reshard();
  }
}

void RootState::end_summon() {
  for (const auto& unit : units_) {
    FlatParamHandle* handle = unit->handle();
    if (handle == nullptr) continue;
    if (summon_writeback_ && handle->is_unsharded()) handle->write_back_shard();
    unit->finish_iteration();
  }
  training_state_ = TrainingState::kIdle;
}

// Note [Prefetching]
// Units run backward in the reverse of the order they ran forward in this iteration
// (recorded by record_forward). With kBackwardPre, a unit starting its backward begins
// the all-gather of the unit that runs backward next; with kBackwardPost it does so
// after issuing its gradient reduction. With forward_prefetch, a unit starting its
// forward begins the all-gather of the unit that came after it in the previous
// iteration. Prefetching is one unit ahead, so at most one all-gather is in flight
// besides the one being waited for; the all-gathers per iteration are the same ones,
// issued earlier (REFERENCE §4 counts hold).
void RootState::record_forward(UnitState* unit) {
  if (std::find(forward_order_.begin(), forward_order_.end(), unit) == forward_order_.end()) {
    forward_order_.push_back(unit);
  }
}

void RootState::prefetch_for_forward_after(const UnitState* unit) {
  if (!forward_prefetch_) return;
  auto it = std::find(last_forward_order_.begin(), last_forward_order_.end(), unit);
  if (it != last_forward_order_.end() && ++it != last_forward_order_.end()) {
    (*it)->handle()->prefetch();
  }
}

void RootState::prefetch_for_backward_after(const UnitState* unit, BackwardPrefetch when) {
  if (backward_prefetch_ != when) return;
  // The latest unit in forward order, other than `unit`, whose backward has not started.
  for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it) {
    if (*it != unit && !(*it)->pre_backward_done()) {
      (*it)->handle()->prefetch();
      return;
    }
  }
}

void RootState::begin_forward() { training_state_ = TrainingState::kForwardBackward; }

void RootState::end_forward_without_grad() {
  for (const auto& unit : units_) unit->finish_iteration();
  last_forward_order_ = std::move(forward_order_);
  forward_order_.clear();
  training_state_ = TrainingState::kIdle;
}

void RootState::ensure_end_of_backward_callback() {
  if (callback_queued_) return;
  callback_queued_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
}

void RootState::finish_backward() {
  for (const auto& unit : units_) unit->finish_iteration();
  last_forward_order_ = std::move(forward_order_);
  forward_order_.clear();
  training_state_ = TrainingState::kIdle;
  callback_queued_ = false;
}

}  // namespace core_internal
}  // namespace fsdp
