// Checkpoint files: full state dicts in PyTorch's format, and sharded checkpoint
// directories that load at any world size.
//
//   // Full: rank 0 writes one file that torch.load reads in Python.
//   fsdp::StateDict full = fsdp::full_state_dict(*model, fsdp::FullStateDictOptions()
//                                                             .rank0_only(true));
//   if (rank == 0) fsdp::save_state_dict(full, "/ckpt/model.pt");
//   fsdp::load_full_state_dict(*model, fsdp::load_state_dict("/ckpt/model.pt"));
//
//   // Sharded: every rank writes its pieces of the model and optimizer (collective).
//   fsdp::save_sharded_checkpoint(*model, &optimizer, "/ckpt/step_00000200");
//   fsdp::load_sharded_checkpoint(*model, &optimizer, *fsdp::latest_checkpoint("/ckpt"));
//   // Resuming: the newest checkpoint that loads on every rank (collective).
//   std::optional<fsdp::LoadedCheckpoint> loaded =
//       fsdp::load_latest_sharded_checkpoint(*model, &optimizer, "/ckpt");
//
// Full files: a zip archive as torch.save writes it (no TorchScript type tags) holding a
// dict str -> Tensor; load_state_dict also reads files saved by PyTorch's
// torch.save(model.state_dict()) (an OrderedDict), e.g. to fine-tune a PyTorch model.
//
// Sharded directory: rank_00000.pt ... (each rank's pieces: dict key -> 1-D tensor; keys
// "model/<FQN>" and "optim/<FQN>/<state name>"; replicated tensors written by rank 0
// only) and metadata.pt (format, version, world size, every tensor's dtype, shape and
// pieces, every file's size and CRC-32). Loading at another world size reads, on each
// rank, only the files its new shard overlaps. The directory must be on a file system
// every rank sees (for several hosts, a shared one).
//
// Crash safety: a file is written to a temporary name, flushed to disk (fsync) and
// renamed; a sharded checkpoint is assembled in a hidden sibling directory
// (".<name>.partial-<id>") and published with one rename (an existing checkpoint of the
// same name is swapped out atomically), so a checkpoint directory is complete or absent.
// A save that fails (no space, a permission, a lost rank) removes its partial directory
// on every rank before it raises, and says how much space the checkpoint needs and how
// much is free; remove_partial_checkpoints clears what a killed process left. Reads
// verify sizes and checksums before parsing.
//
// PyTorch: torch.save / torch.load of state dicts; torch.distributed.checkpoint
// (save_state_dict / load_state_dict with resharding) for sharded checkpoints.
//
// Errors: c10::Error naming the file and what is wrong (missing, truncated, damaged,
// another format or a newer version, tensors of another model: missing or unexpected
// FQNs, shape or dtype mismatches). Collective functions raise on every rank when one
// rank fails to write. Threading: as state_dict.h.
#ifndef FSDP_STATE_CHECKPOINT_H_
#define FSDP_STATE_CHECKPOINT_H_

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/optimizer.h>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/dcp_checkpoint.h"
#include "fsdp/state/optim_state_dict.h"
#include "fsdp/state/state_dict.h"

namespace fsdp {

// Writes `state_dict` to `path` atomically (torch.load in Python returns a dict).
void save_state_dict(const StateDict& state_dict, const std::string& path);
// Reads a file written by save_state_dict or by torch.save(module.state_dict()); tensors
// land on the CPU.
StateDict load_state_dict(const std::string& path);

// The same for a full optimizer state dict (a dict FQN -> dict state name -> Tensor).
void save_optim_state_dict(const OptimStateDict& state_dict, const std::string& path);
OptimStateDict load_optim_state_dict(const std::string& path);

// A learning-rate scheduler's state, as torch.optim.lr_scheduler's state_dict() holds it:
// `last_epoch` (scheduler steps taken; PyTorch's counts from 0 after its first step) and
// `_last_lr` (the learning rate of each param group, in group order). It rides along in
// a sharded checkpoint (keys "scheduler/last_epoch", 0-dim int64, and
// "scheduler/last_lr", 1-D float64, written by rank 0); LibTorch has no scheduler state
// of its own to take it from, so the caller fills it. Pass the same value on every rank.
struct SchedulerState {
  int64_t last_epoch = 0;
  std::vector<double> last_lr;
  bool operator==(const SchedulerState& other) const {
    return last_epoch == other.last_epoch && last_lr == other.last_lr;
  }
};

// The scheduler state in a Distributed Checkpoint folder (dcp_checkpoint.h): the extra
// entry "lr_scheduler" = {"last_epoch": int, "_last_lr": [float, ...]}, the key
// torchtitan saves its schedulers under and torch.optim.lr_scheduler's state_dict names,
// stored as "lr_scheduler.last_epoch" and "lr_scheduler._last_lr" (dcp_to_torch_save
// nests them again). Pass it in DcpCheckpointOptions::extras;
// load_latest_sharded_checkpoint and scheduler_from_dcp_extras read it back.
inline constexpr char kDcpSchedulerKey[] = "lr_scheduler";
std::pair<std::string, c10::IValue> scheduler_dcp_extra(const SchedulerState& scheduler);

// The scheduler state among load_dcp_checkpoint's extras; nullopt when the folder has
// none. Raises c10::Error when "lr_scheduler.last_epoch" is not an int or
// "lr_scheduler._last_lr" not a list of numbers (or only one of them is there).
std::optional<SchedulerState> scheduler_from_dcp_extras(const DcpExtras& extras);

// Writes the model's (and, if not null, the optimizer's and the scheduler's) sharded
// state to directory `dir` (its parent must exist; an existing `dir` is replaced).
// Collective: stage_sharded_checkpoint, then write_sharded_checkpoint over the model's
// communicator.
void save_sharded_checkpoint(FullyShardedRoot& model, const torch::optim::Optimizer* optimizer,
                             const std::string& dir, const SchedulerState* scheduler = nullptr);

// This rank's part of a sharded checkpoint, copied off the model: every entry of the
// checkpoint in the same order on every rank ("model/<FQN>", "optim/<FQN>/<state name>",
// "scheduler/..."), its piece on this rank's CPU (in pinned memory when the model is on
// a GPU) where this rank's file holds it (`written`), else a 0-element tensor of its
// dtype. It shares nothing with the model: training may go on while it is written.
struct StagedShardedCheckpoint {
  struct Entry {
    std::string key;
    ShardedTensor piece;
    bool written = false;
  };
  std::vector<Entry> entries;
  // Where the writer's bookkeeping collectives run (the model's compute device: NCCL
  // takes only CUDA tensors).
  c10::Device device = c10::kCPU;
};

// Copies this rank's shards (and the optimizer's, if not null, and `scheduler`) to host
// memory: the only part of a save that must stop training. No communication. Raises as
// sharded_state_dict and sharded_optim_state_dict do.
StagedShardedCheckpoint stage_sharded_checkpoint(FullyShardedRoot& model,
                                                 const torch::optim::Optimizer* optimizer,
                                                 const SchedulerState* scheduler = nullptr);

// Writes a staged checkpoint to `dir` as save_sharded_checkpoint does (the same files,
// crash safety and errors), its bookkeeping collectives over `comm` (the model's
// communicator, or another one over the same ranks in the same order: see
// async_checkpoint.h). Collective over `comm`; touches no model. Threading: may run on
// any thread, one write per communicator at a time.
void write_sharded_checkpoint(const StagedShardedCheckpoint& staged, const std::string& dir,
                              Communicator& comm);

// Loads a sharded checkpoint saved at any world size into `model` (and `optimizer`, if
// not null: its state becomes the checkpoint's). Strict: the checkpoint's model keys,
// shapes and dtypes must be the model's. Returns the scheduler state it holds (nullopt if
// it was saved without one). Reads files only; no communication.
std::optional<SchedulerState> load_sharded_checkpoint(FullyShardedRoot& model,
                                                      torch::optim::Optimizer* optimizer,
                                                      const std::string& dir);

// The complete sharded checkpoint under `root` (this format's, or a Distributed
// Checkpoint folder, dcp_checkpoint.h) whose directory name sorts last (name them so
// that they sort by step, e.g. step_00000200), or nullopt if there is none.
// Partial directories (a save that crashed) are skipped.
std::optional<std::string> latest_checkpoint(const std::string& root);

// What load_latest_sharded_checkpoint loaded, and the newer checkpoints it skipped.
struct LoadedCheckpoint {
  std::string dir;  // ROOT/<name> of the checkpoint loaded
  // The scheduler state it holds, if any (a DCP folder's "lr_scheduler" entries).
  std::optional<SchedulerState> scheduler;
  // One line per skipped checkpoint: "'ROOT/<name>': rank 1: checkpoint file '...' has
  // 100 bytes, the metadata says 129047: it is truncated or damaged; ...".
  std::vector<std::string> skipped;
  // A Distributed Checkpoint folder's extra entries (e.g. "step"); empty otherwise.
  DcpExtras extras;
};

// Loads the newest checkpoint under `root` that loads on every rank, trying the
// directories holding a checkpoint in reverse name order: this format's (metadata.pt or
// rank_00000.pt) or a Distributed Checkpoint folder (.metadata or __0_0.distcp, loaded
// with load_dcp_checkpoint), whichever each holds.
// Collective: each rank loads the files its shard needs (sizes, CRC-32s and metadata
// verified), then the ranks agree (one all-gather of a small record) before any returns,
// so every rank returns the same checkpoint, or raises the same error. Returns nullopt
// when `root` holds no checkpoint at all. Raises c10::Error naming every damaged file
// when no checkpoint loads on every rank (then the model's and optimizer's in-memory
// state is unspecified; no file was touched), or when the ranks see different folders.
// PyTorch: none (a trainer's resume loop around torch.distributed.checkpoint.load).
std::optional<LoadedCheckpoint> load_latest_sharded_checkpoint(FullyShardedRoot& model,
                                                               torch::optim::Optimizer* optimizer,
                                                               const std::string& root);

// Removes the hidden partial directories (".<name>.partial-<id>") under `root` that a
// save killed mid-way left (a save that fails with an error removes its own); returns
// their paths, sorted. Call it when no save into `root` runs (e.g. at a trainer's start,
// under its lock). Not collective: call it on one rank. Raises c10::Error if one cannot
// be removed.
std::vector<std::string> remove_partial_checkpoints(const std::string& root);

}  // namespace fsdp

#endif  // FSDP_STATE_CHECKPOINT_H_
