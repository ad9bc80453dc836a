// The FSDP runtime behind units (unit.h) and FullyShardedDataParallel
// (fully_sharded.h): per-unit state, the hooks that unshard, reshard and reduce
// gradients, and the training-state checks. Not a public API.
//
// See Note [Units intercept forward and backward] in runtime.cc.
#ifndef FSDP_CORE_INTERNAL_RUNTIME_H_
#define FSDP_CORE_INTERNAL_RUNTIME_H_

#include <array>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/nn/module.h>

#include "fsdp/comm/communicator.h"
#include "fsdp/core/device_handle.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/training_state.h"

namespace fsdp {
namespace core_internal {

class RootState;

// The parameters of `wrapped` (the module of `unit`, or of a module fsdp::wrap annotates:
// `unit` null) flattened and sharded with the unit settings `own`, if an EnableWrap scope
// that shards on construction (fully_sharded.h) is active on this thread; else null.
// Defined in fully_sharded.cc.
std::unique_ptr<FlatParamHandle> shard_on_construction(const torch::nn::Module& wrapped,
                                                       const UnitBase* unit,
                                                       const UnitOptions& own);

// A bound unit: FullyShardedUnit's fields (fqn, handle, handle state) plus the hooks.
class UnitState : public FullyShardedUnit, public std::enable_shared_from_this<UnitState> {
 public:
  // `handle` may be null (a unit that owns no parameters); `frozen_handles` are frozen and
  // set only beside a `handle` (see FullyShardedUnit::frozen_handles).
  UnitState(std::string fqn, bool is_root, RootState* root, std::unique_ptr<FlatParamHandle> handle,
            std::vector<std::unique_ptr<FlatParamHandle>> frozen_handles = {});

  RootState& root() const { return *root_; }

  // Whether the unit's parent holds (and may call) the wrapped module itself: an
  // auto_wrap_policy picked a ModuleList entry or a typed member (see Note [A unit's
  // module called directly] in unit.cc). `type_name`: the module's C++ type.
  void set_parent_holds_module(std::string type_name) {
    parent_holds_module_ = true;
    module_type_name_ = std::move(type_name);
  }
  bool parent_holds_module() const { return parent_holds_module_; }
  const std::string& module_type_name() const { return module_type_name_; }

  // Connects the original parameters to a new gradient sink (see Note [Gradient sinks]).
  void install_gradient_sink();

  // Forward input casting (see Note [Mixed precision] in runtime.cc): floating tensor
  // inputs are cast to `dtype` (none: left alone); with `restore_output_dtype`, a tensor
  // output is cast back to the inputs' dtype.
  void set_input_casting(c10::optional<c10::ScalarType> dtype, bool restore_output_dtype) {
    cast_inputs_to_ = dtype;
    restore_output_dtype_ = restore_output_dtype;
  }
  // A tensor argument of the wrapped module's forward: cast (above), and for a frozen unit
  // watched for the end of its backward (Note [Frozen units reshard after their backward]).
  at::Tensor cast_input(const at::Tensor& input);
  at::Tensor cast_output(const at::Tensor& output);

  // `inputs_seen`: cast_input will see every tensor argument of this forward.
  void pre_forward(bool inputs_seen);
  // Puts the pre-backward hook on an output of the unit's forward that requires grad;
  // returns whether it did.
  bool hook_output(const at::Tensor& output);
  // `hooked`: an output carries the pre-backward hook, so the unit may reshard now and
  // gather again before its backward. `outside_autograd`: every output is a tensor that
  // needs no gradient, so no backward will use this forward's unsharded parameters (Note
  // [Units outside autograd]).
  void post_forward(bool hooked, bool outside_autograd);

  void pre_backward();
  void post_backward(std::vector<at::Tensor> grads);  // the engine's: released as copied
  // Starts the all-gather of this unit's parameters ahead of its forward or backward
  // (Note [Prefetching]); only while the unit is idle (not running, not summoned).
  void prefetch();
  // End of a backward pass: reshard whatever is still unsharded, reset per-iteration flags.
  void finish_iteration();
  void reshard();
  // summon_full_params: unshards in full precision (every rank takes part in the
  // all-gather), then reshards again unless `keep`. Needs the unit idle.
  void summon(bool keep);

 private:
  RootState* root_;
  bool parent_holds_module_ = false;
  std::string module_type_name_;
  c10::optional<c10::ScalarType> cast_inputs_to_;
  bool restore_output_dtype_ = false;
  c10::optional<c10::ScalarType> input_dtype_;  // this forward's inputs', before casting
  bool pre_backward_done_ = false;
  bool needs_backward_ = false;  // a forward of this iteration was hooked or opaque
  bool sink_installed_ = false;  // this iteration's sink exists
  // Note [Frozen units reshard after their backward]: whether this forward's tensor
  // arguments are watched, how many watched ones still wait for their gradient (-1: one
  // could not be watched, so the unit waits for the end of backward), and the iteration
  // a watch belongs to (finish_iteration moves on; older watches do nothing).
  bool watch_inputs_ = false;
  int inputs_pending_ = 0;
  uint64_t iteration_ = 0;

  void unshard();  // every flat parameter of the unit (handles())
  // Whether unshard() or prefetch() would all-gather now (a sharded flat parameter of a
  // sharding strategy).
  bool will_all_gather() const;
  bool all_frozen() const;
  at::Tensor watch_input(const at::Tensor& input);
  void input_gradient_ready(uint64_t iteration);

  // Throws PyTorch's _assert_in_training_states message for the handle's state.
  void assert_handle_in(std::initializer_list<HandleTrainingState> states, const char* what) const;

 public:
  bool pre_backward_done() const { return pre_backward_done_; }
  bool needs_backward() const { return needs_backward_; }
};

// The error for a unit whose module its parent called directly (Note [A unit's module
// called directly] in unit.cc): names the unit and shows the call that goes through it.
std::string called_directly_message(const UnitState& unit);

class RootState {
 public:
  // `device`: the compute device's handle (Note [Compute device] in fully_sharded.cc),
  // which every unit's FlatParamHandle also uses.
  RootState(std::shared_ptr<Communicator> comm, std::shared_ptr<DeviceHandle> device,
            ShardingStrategy strategy, BackwardPrefetch backward_prefetch, bool forward_prefetch)
      : comm_(std::move(comm)),
        device_(std::move(device)),
        strategy_(strategy),
        backward_prefetch_(backward_prefetch),
        forward_prefetch_(forward_prefetch) {}

  Communicator& comm() { return *comm_; }
  DeviceHandle& device() const { return *device_; }
  ShardingStrategy strategy() const { return strategy_; }  // the root's; units may differ
  BackwardPrefetch backward_prefetch() const { return backward_prefetch_; }
  bool forward_prefetch() const { return forward_prefetch_; }
  // Every communicator the model's flat parameters use (shard and replicate groups), the
  // root's first, each once.
  std::vector<Communicator*> communicators() const;
  // plan_check (FullyShardedDataParallelOptions): the measurement window each root forward
  // opens and check_plan closes (Note [Checking the plan] in plan_check.cc).
  struct PlanWindow {
    bool enabled = false;
    bool open = false;
    int64_t start_allocated = 0;    // device memory allocated at the root's forward
    int64_t start_model_state = 0;  // the part of it that is model state
    std::vector<std::array<CollectiveTraffic, kNumCollectiveKinds>> start_traffic;
    int64_t optimizer_state_bytes = 0;  // measured by the last check_plan
  };
  PlanWindow& plan_window() { return plan_window_; }
  void open_plan_window();
  TrainingState training_state() const { return training_state_; }
  const std::vector<std::shared_ptr<UnitState>>& units() const { return units_; }
  // The same units as FullyShardedRoot::units() lists them.
  const std::vector<std::shared_ptr<FullyShardedUnit>>& unit_views() const { return unit_views_; }
  void add_unit(std::shared_ptr<UnitState> unit) {
    unit_views_.push_back(unit);
    units_.push_back(std::move(unit));
  }

  // See Note [A unit's module called directly] in unit.cc. The first unit (pre-order)
  // whose parent holds its module, that has not run in this forward and is sharded; null
  // if none.
  const UnitState* unit_called_directly() const;
  // At the root's post-forward: throws called_directly_message for the first unit whose
  // parent holds its module that did not run in this forward.
  void check_units_ran() const;

  // PyTorch's _assert_in_training_states: throws c10::Error with its message.
  void assert_in_states(std::initializer_list<TrainingState> states, const char* what) const;

  // Gradient synchronization (off inside no_sync).
  bool sync_gradients() const { return sync_gradients_; }
  void set_sync_gradients(bool sync) { sync_gradients_ = sync; }

  // summon_full_params (SummonFullParamsOptions in fully_sharded.h): gathers the units
  // (rank 0 only keeps them if rank0_only); end_summon writes edits back to the shards if
  // writeback, then reshards. See Note [Summoning full parameters] in runtime.cc.
  void begin_summon(const SummonFullParamsOptions& options);
  void end_summon();
  // with_grads: `unit`'s full gradient as its original parameters' grads.
  void summon_grads(UnitState& unit);

  // Buffers cast to another dtype while the model runs forward and backward, and back to
  // their own dtype at the end of each iteration (mixed precision's buffer_dtype).
  void set_buffer_casts(std::vector<at::Tensor> buffers, c10::ScalarType dtype);
  // Parameters outside every unit (ignored modules'), for clip_grad_norm.
  void set_ignored_params(std::vector<at::Tensor> params) { ignored_params_ = std::move(params); }
  // Ignored parameters that require grad (ignored_modules' and ignored_states').
  const std::vector<at::Tensor>& ignored_params() const { return ignored_params_; }
  // Buffers and ignored parameters that were on c10::kMeta at construction, allocated on
  // the device and filled with NaN (zeros if not floating) until
  // FullyShardedRoot::init_parameters computes them (Note [Initialisation on the meta
  // device] in fully_sharded.cc).
  void set_materialized(std::vector<at::Tensor> tensors) { materialized_ = std::move(tensors); }
  const std::vector<at::Tensor>& materialized() const { return materialized_; }
  // See Note [Execution order validation] and Note [First-iteration size checks] in
  // runtime.cc.
  void set_validate_execution_order(bool validate) { validate_execution_order_ = validate; }
  // Checks the collective schedule every `every` iterations (0: never); the
  // communicator's schedule checks are on. See FullyShardedDataParallelOptions.
  void set_schedule_check_every(int64_t every) { schedule_check_every_ = every; }

  // FullyShardedDataParallelImpl::clip_grad_norm_ (see fully_sharded.h).
  at::Tensor clip_grad_norm(double max_norm, double norm_type);

  // Prefetching (see Note [Prefetching] in runtime.cc).
  // ParamExecOrderWrapPolicy: forward and BACKWARD_PRE prefetch, both in the first
  // iteration's order from the second iteration on.
  void prefetch_in_first_iteration_order();
  void record_forward(UnitState* unit);
  void prefetch_for_forward_after(const UnitState* unit);
  void prefetch_for_backward_after(const UnitState* unit, BackwardPrefetch when);
  // See Note [Limiting all-gathers] in runtime.cc: before a unit issues its all-gathers,
  // and after a unit freed gathered parameters.
  void wait_for_all_gather_slot();
  void record_reshard();

  void begin_forward();                    // root pre-forward
  void end_forward_without_grad();         // no backward will come: reshard, back to idle
  void ensure_end_of_backward_callback();  // from any pre-backward hook
  // A unit's gradient reduction (see Note [Asynchronous gradient reduction]).
  void start_reduction(FlatParamHandle& handle, std::vector<at::Tensor> grads);

 private:
  void finish_reduction();
  void finish_backward();
  void abandon_backward();  // see Note [A backward that did not finish]
  void end_iteration();
  void check_schedule_if_due();  // after an iteration that ended normally
  void cast_buffers(bool to_original);
  void validate_position(const UnitState* unit, size_t position);

  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<DeviceHandle> device_;
  ShardingStrategy strategy_;
  BackwardPrefetch backward_prefetch_;
  bool forward_prefetch_;
  bool first_iteration_order_ = false;           // see prefetch_in_first_iteration_order
  std::vector<UnitState*> forward_order_;        // units with parameters, this iteration
  std::vector<UnitState*> last_forward_order_;   // ... the previous iteration
  std::vector<UnitState*> first_forward_order_;  // ... the first iteration
  // Note [Limiting all-gathers]: the compute stream at each recent reshard that freed
  // gathered parameters, oldest first.
  static constexpr size_t kUnitsAhead = 2;
  std::deque<std::unique_ptr<DeviceEvent>> reshard_events_;
  bool validate_execution_order_ = false;
  int64_t schedule_check_every_ = 0;
  int64_t iterations_ = 0;  // that ended normally, for schedule_check_every_
  bool first_iteration_ = true;
  bool warned_order_change_ = false;
  std::vector<at::Tensor> cast_buffers_;
  std::vector<c10::ScalarType> buffer_dtypes_;  // cast_buffers_' own dtypes
  c10::optional<c10::ScalarType> buffer_dtype_;
  std::vector<at::Tensor> ignored_params_;
  std::vector<at::Tensor> materialized_;
  PlanWindow plan_window_;
  TrainingState training_state_ = TrainingState::kIdle;
  // Set from the first pre-backward hook of a pass until finish_backward; still set at
  // the next forward if the pass threw (see Note [A backward that did not finish]).
  bool callback_queued_ = false;
  FlatParamHandle* reducing_ = nullptr;  // its reduction is in flight
  bool sync_gradients_ = true;
  bool summon_writeback_ = false;
  std::vector<UnitState*> summoned_;  // the units begin_summon gathered
  // offload_to_cpu: each offloaded original parameter and its view on the device.
  std::vector<std::pair<at::Tensor, at::Tensor>> offloaded_;
  std::vector<at::Tensor> summoned_grads_;         // with_grads: parameters given a full grad
  std::vector<std::shared_ptr<UnitState>> units_;  // pre-order
  std::vector<std::shared_ptr<FullyShardedUnit>> unit_views_;  // the same
};

}  // namespace core_internal
}  // namespace fsdp

#endif  // FSDP_CORE_INTERNAL_RUNTIME_H_
