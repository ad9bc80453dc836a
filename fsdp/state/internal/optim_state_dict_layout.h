// optim_state_dict.h's sharded functions over a model layout the caller built once
// (save_sharded_checkpoint and load_sharded_checkpoint). Not a public API.
#ifndef FSDP_STATE_INTERNAL_OPTIM_STATE_DICT_LAYOUT_H_
#define FSDP_STATE_INTERNAL_OPTIM_STATE_DICT_LAYOUT_H_

#include <torch/optim/optimizer.h>

#include "fsdp/state/internal/model_layout.h"
#include "fsdp/state/optim_state_dict.h"

namespace fsdp::state_internal {

// fsdp::sharded_optim_state_dict of `layout`'s model.
ShardedOptimStateDict sharded_optim_state_dict(const ModelLayout& layout,
                                               const torch::optim::Optimizer& optimizer);

// fsdp::load_sharded_optim_state_dict into `layout`'s model.
void load_sharded_optim_state_dict(const ModelLayout& layout, torch::optim::Optimizer& optimizer,
                                   const ShardedOptimStateDict& state_dict);

}  // namespace fsdp::state_internal

#endif  // FSDP_STATE_INTERNAL_OPTIM_STATE_DICT_LAYOUT_H_
