// Optimizer state of an FSDP model keyed by parameter FQN: full (gathered, shaped like
// the original parameters) and sharded (this rank's pieces). The optimizer was built
// over the model's flat shards (model->parameters()), so its state is per flat
// parameter; these functions translate it to and from per-parameter state.
//
//   torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-3));
//   ... train ...
//   fsdp::OptimStateDict full = fsdp::full_optim_state_dict(*model, adamw);
//   fsdp::load_full_optim_state_dict(*model, adamw, full);   // every rank, same dict
//
// State names, as PyTorch's optimizers name them: SGD "momentum_buffer"; Adam and AdamW
// "step" (0-dim int64 tensor), "exp_avg", "exp_avg_sq" and, with amsgrad,
// "max_exp_avg_sq"; Adagrad "step" (0-dim float32 tensor, as PyTorch's) and "sum";
// RMSprop "step" (0-dim float32), "square_avg", "momentum_buffer" when momentum > 0 and
// "grad_avg" when centered. Loading takes a one-element step of any dtype. Any other
// optimizer is an error naming its C++ type and the supported ones. A parameter the
// optimizer has not stepped yet has no entry (LibTorch's Adagrad makes its state when it
// is built, so it has one from the start). A tied parameter is keyed by its first FQN in pre-order.
// Parameters outside FSDP (ignored modules) given to the same optimizer are included,
// replicated. Hyper-parameters (param_groups) are not part of the state dicts:
// optim_param_groups / load_optim_param_groups give and take them, with PyTorch's names.
//
// PyTorch: FullyShardedDataParallel.full_optim_state_dict / optim_state_dict_to_load /
// sharded_optim_state_dict.
//
// Collective where noted; threading and errors as in state_dict.h.
#ifndef FSDP_STATE_OPTIM_STATE_DICT_H_
#define FSDP_STATE_OPTIM_STATE_DICT_H_

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include "fsdp/state/state_dict.h"

namespace fsdp {

// State name -> tensor, for one parameter.
using ParamOptimState = torch::OrderedDict<std::string, at::Tensor>;
// Cleaned FQN -> the parameter's state, in the model's parameter order.
using OptimStateDict = torch::OrderedDict<std::string, ParamOptimState>;

using ShardedParamOptimState = torch::OrderedDict<std::string, ShardedTensor>;
using ShardedOptimStateDict = torch::OrderedDict<std::string, ShardedParamOptimState>;

// Gathers the state (one all-gather per state tensor of each flat parameter). With
// options.rank0_only(), ranks other than 0 get an empty dict. Collective.
OptimStateDict full_optim_state_dict(FullyShardedRoot& model,
                                     const torch::optim::Optimizer& optimizer,
                                     const FullStateDictOptions& options = {});

// Replaces `optimizer`'s state with `state_dict` (every rank passes the same full dict).
// Every parameter of a unit has state or none has (a flat parameter has one state);
// shapes must equal the parameters' and dtypes their dtype. No communication.
void load_full_optim_state_dict(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                                const OptimStateDict& state_dict);

// This rank's pieces (copies); "step" is replicated. No communication.
ShardedOptimStateDict sharded_optim_state_dict(FullyShardedRoot& model,
                                               const torch::optim::Optimizer& optimizer);

// Loads pieces covering this rank's shards (as sharded_optim_state_dict gave them at the
// same world size, or as load_sharded_checkpoint assembles them at another).
void load_sharded_optim_state_dict(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                                   const ShardedOptimStateDict& state_dict);

// One parameter group as PyTorch's Optimizer.state_dict()["param_groups"] holds it, with
// its parameters named by FQN as torch.distributed.checkpoint.state_dict.get_state_dict
// returns it. Hyperparameters use PyTorch's names and order; values are double, bool,
// None or a tuple of doubles (betas). Those LibTorch's optimizers lack get the value
// PyTorch's default has there (SGD, Adam(W), Adagrad, RMSprop: maximize False, foreach
// None, differentiable False; SGD, Adam(W), Adagrad: fused None; Adam(W), RMSprop:
// capturable False; decoupled_weight_decay False for Adam and True for AdamW).
struct OptimParamGroup {
  std::vector<std::pair<std::string, c10::IValue>> options;
  std::vector<std::string> params;  // cleaned FQNs, in the model's parameter order
  // The value of option `name`, or nullptr.
  const c10::IValue* find(const std::string& name) const;
};

// The optimizer's groups: SGD (lr, momentum, dampening, weight_decay, nesterov, ...),
// Adam and AdamW (lr, betas, eps, weight_decay, amsgrad, ...), Adagrad (lr, lr_decay, eps,
// weight_decay, initial_accumulator_value, foreach, maximize, differentiable, fused) and
// RMSprop (lr, momentum, alpha, eps, centered, weight_decay, capturable, foreach,
// maximize, differentiable), in torch 2.11's order. A flat parameter in a
// group contributes the FQNs of the parameters it holds. Another optimizer is an error
// naming it. No communication.
std::vector<OptimParamGroup> optim_param_groups(FullyShardedRoot& model,
                                                const torch::optim::Optimizer& optimizer);

// Sets each group's hyperparameters from `groups` (as optim_param_groups or PyTorch gave
// them). The groups must list the same FQNs as the optimizer's (any world size gives
// the same); options LibTorch's optimizer lacks must hold the value it implies (e.g.
// maximize False), others absent from a group keep their value. No communication.
// PyTorch: the param_groups part of set_state_dict / Optimizer.load_state_dict.
void load_optim_param_groups(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                             const std::vector<OptimParamGroup>& groups);

}  // namespace fsdp

#endif  // FSDP_STATE_OPTIM_STATE_DICT_H_
