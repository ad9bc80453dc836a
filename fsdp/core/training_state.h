// The training states of an FSDP model and its units: the enums of PyTorch's
// torch/distributed/fsdp/_common_utils.py. (The user-facing enums, BackwardPrefetch and
// ShardingStrategy, are in options.h.)
//
//   if (model->training_state() == fsdp::TrainingState::kIdle) { ... }
//   fsdp::training_state_name(fsdp::TrainingState::kIdle);  // "TrainingState.IDLE"
//
// Threading: plain values and pure functions.
#ifndef FSDP_CORE_TRAINING_STATE_H_
#define FSDP_CORE_TRAINING_STATE_H_

namespace fsdp {

// The root's state: idle between iterations, inside forward/backward, or inside
// summon_full_params. PyTorch: torch.distributed.fsdp._common_utils.TrainingState.
enum class TrainingState { kIdle, kForwardBackward, kSummonFullParams };

// One unit's state within an iteration.
// PyTorch: torch.distributed.fsdp._common_utils.HandleTrainingState.
enum class HandleTrainingState { kIdle, kForward, kBackwardPre, kBackwardPost, kSummonFullParams };

// The names PyTorch prints: "TrainingState.IDLE", "HandleTrainingState.BACKWARD_PRE", ...
const char* training_state_name(TrainingState state);
const char* handle_training_state_name(HandleTrainingState state);

}  // namespace fsdp

#endif  // FSDP_CORE_TRAINING_STATE_H_
