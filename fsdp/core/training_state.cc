#include "fsdp/core/training_state.h"

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

}  // namespace fsdp
