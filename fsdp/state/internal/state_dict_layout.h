// state_dict.h's sharded functions over a model layout the caller built once
// (save_sharded_checkpoint and load_sharded_checkpoint need it three times). Not a
// public API.
#ifndef FSDP_STATE_INTERNAL_STATE_DICT_LAYOUT_H_
#define FSDP_STATE_INTERNAL_STATE_DICT_LAYOUT_H_

#include "fsdp/state/internal/model_layout.h"
#include "fsdp/state/state_dict.h"

namespace fsdp::state_internal {

// fsdp::sharded_state_dict of `layout`'s model.
ShardedStateDict sharded_state_dict(const ModelLayout& layout);

// fsdp::load_sharded_state_dict into `layout`'s model.
void load_sharded_state_dict(const ModelLayout& layout, const ShardedStateDict& state_dict);

}  // namespace fsdp::state_internal

#endif  // FSDP_STATE_INTERNAL_STATE_DICT_LAYOUT_H_
