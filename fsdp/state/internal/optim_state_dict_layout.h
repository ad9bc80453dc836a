// optim_state_dict.h's sharded and param_groups functions over a model layout the caller
// built once (the sharded and the DCP checkpoint's save and load). Not a public API.
#ifndef FSDP_STATE_INTERNAL_OPTIM_STATE_DICT_LAYOUT_H_
#define FSDP_STATE_INTERNAL_OPTIM_STATE_DICT_LAYOUT_H_

#include <vector>

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

// fsdp::optim_param_groups of `layout`'s model.
std::vector<OptimParamGroup> optim_param_groups(const ModelLayout& layout,
                                                const torch::optim::Optimizer& optimizer);

// fsdp::load_optim_param_groups into `layout`'s model.
void load_optim_param_groups(const ModelLayout& layout, torch::optim::Optimizer& optimizer,
                             const std::vector<OptimParamGroup>& groups);

}  // namespace fsdp::state_internal

#endif  // FSDP_STATE_INTERNAL_OPTIM_STATE_DICT_LAYOUT_H_
