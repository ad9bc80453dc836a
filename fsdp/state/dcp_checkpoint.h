// PyTorch Distributed Checkpoint (DCP) folders from and into an FSDP model: the layout
// torch.distributed.checkpoint's dcp.save / dcp.load use with the default
// FileSystemWriter, holding {"model": ..., "optim": ...} as
// torch.distributed.checkpoint.state_dict.get_state_dict returns them, plus extra
// non-tensor entries (a trainer's "step").
//
//   fsdp::save_dcp_checkpoint(*model, &adamw, "/ckpt/step_200",
//                             fsdp::DcpCheckpointOptions().extras({{"step", int64_t{200}}}));
//   fsdp::DcpExtras extras = fsdp::load_dcp_checkpoint(*model, &adamw, "/ckpt/step_200");
//
//   // An asynchronous save splits the same work in two steps:
//   fsdp::StagedDcpCheckpoint staged = fsdp::stage_dcp_checkpoint(*model, &adamw, options);
//   ... on another thread: fsdp::write_dcp_checkpoint(staged, dir, comm);
//
// Keys (DCP flattens the nested dict with dots; planner_data keeps the nesting):
// "model.<FQN>" (tensor), "optim.state.<FQN>.<state name>" (tensor; Adam's "step" a
// 0-dim float32 tensor as PyTorch keeps it), "optim.param_groups.<i>.<option>" (a value:
// lr, betas, ... and "params", the group's FQNs), and each extra under its own name.
// A rank's shard, a contiguous range of the flattened tensor, is stored as the few
// row-major boxes (chunks) that tile it, padding excluded; replicated tensors (buffers,
// step counts) and values are written by rank 0 only. Files: `__{rank}_0.distcp` per
// rank, `.metadata` written by rank 0 last. torch 2.11's dcp.load reads the folder into
// a fully_shard model at any world size (model and optimizer through set_state_dict);
// format_utils.dcp_to_torch_save turns it into one torch.save file.
//
// Crash safety as for save_sharded_checkpoint (checkpoint.h): the folder is assembled
// in a hidden sibling (".<name>.partial-<id>") and published with one rename, so a
// folder with a `.metadata` is always complete; a failed save removes its partial folder
// on every rank and raises on every rank.
//
// PyTorch: torch.distributed.checkpoint.save / load with get_state_dict /
// set_state_dict. Errors: c10::Error naming the folder, the key and what is wrong
// (missing keys, shape or dtype mismatches, chunks that do not cover a shard, a missing
// or truncated .distcp file, metadata fsdp cannot read). Threading: stage and load on
// the rank's thread like state_dict.h; write_dcp_checkpoint may run on another thread
// while training continues (it touches only the staged copies and `comm`, which no
// other thread may use meanwhile).
#ifndef FSDP_STATE_DCP_CHECKPOINT_H_
#define FSDP_STATE_DCP_CHECKPOINT_H_

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/formats/dcp.h"

namespace fsdp {

// Top-level non-tensor entries beside "model" and "optim": name -> int, double, bool,
// string, None, a tuple/list of those, or a dict with string keys of any of these, which
// is stored flattened as DCP stores a nested dict: {"lr_scheduler", {"last_epoch": 20}}
// is entry "lr_scheduler.last_epoch" (dcp_to_torch_save nests it again).
// load_dcp_checkpoint returns the flattened names.
using DcpExtras = std::vector<std::pair<std::string, c10::IValue>>;

struct DcpCheckpointOptions {
  // Saved as top-level entries (rank 0's values are written).
  TORCH_ARG(DcpExtras, extras) = {};
};

// One chunk of a tensor this rank writes: its offsets in the whole tensor and its data
// (a contiguous CPU copy shaped like the chunk).
struct DcpStagedChunk {
  std::string fqn;
  std::vector<int64_t> offsets;
  at::Tensor data;
};

// Everything one rank writes, copied off the model and optimizer (stage_dcp_checkpoint).
struct StagedDcpCheckpoint {
  int rank = 0;
  int world_size = 1;
  // Where the bookkeeping collectives of write_dcp_checkpoint run (the model's device:
  // NCCL takes only CUDA tensors).
  at::Device collective_device = at::kCPU;
  // Every key of the checkpoint (tensors with their dtype, size and path; chunks empty),
  // the same on every rank.
  std::vector<DcpEntryMetadata> entries;
  std::vector<DcpStagedChunk> chunks;  // this rank's
  DcpExtras values;                    // non-tensor entries by key; rank 0 writes them
};

// Step (a) of a save, on the caller's thread: copies this rank's model shards, optimizer
// state (if `optimizer` is not null: SGD, Adam or AdamW) and param_groups, and the
// extras. No communication.
StagedDcpCheckpoint stage_dcp_checkpoint(FullyShardedRoot& model,
                                         const torch::optim::Optimizer* optimizer,
                                         const DcpCheckpointOptions& options = {});

// Step (b): writes `staged` into folder `dir` (its parent must exist; an existing `dir`
// is replaced): each rank its `__{rank}_0.distcp`, then the ranks agree (two all-gathers
// of a small record) and rank 0 writes `.metadata` and publishes the folder. Collective
// over `comm` (the model's communicator); every rank raises if one fails.
void write_dcp_checkpoint(const StagedDcpCheckpoint& staged, const std::string& dir,
                          Communicator& comm);

// (a) then (b) with the model's communicator. Collective.
void save_dcp_checkpoint(FullyShardedRoot& model, const torch::optim::Optimizer* optimizer,
                         const std::string& dir, const DcpCheckpointOptions& options = {});

// Loads a DCP folder written at any world size, by fsdp or by PyTorch's dcp.save of
// {"model": ..., "optim": ...} as get_state_dict lays them out, into `model` (strict:
// the same FQNs, shapes and dtypes) and `optimizer` (if not null: state and
// param_groups; the folder must hold "optim"). Each rank reads only the chunks that
// overlap its shards. Returns the folder's other non-tensor top-level entries (e.g.
// "step"; a dict's leaves under their dotted names, e.g. "lr_scheduler.last_epoch").
// Reads files only; no communication.
DcpExtras load_dcp_checkpoint(FullyShardedRoot& model, torch::optim::Optimizer* optimizer,
                              const std::string& dir);

// Whether `dir` holds a DCP checkpoint (its `.metadata`, or a rank's `.distcp` file of an
// incomplete one).
bool is_dcp_checkpoint(const std::string& dir);

}  // namespace fsdp

#endif  // FSDP_STATE_DCP_CHECKPOINT_H_
