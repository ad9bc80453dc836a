// Asynchronous checkpoint saves: training stops only while this rank's shards are copied
// to host memory; the files are written by a background thread while training goes on.
//
//   fsdp::AsyncSave save = fsdp::async_save_sharded_checkpoint(*model, &optimizer,
//                                                              "/ckpt/step_00000200");
//   // or a PyTorch Distributed Checkpoint folder: fsdp::async_save_dcp_checkpoint(...)
//   ... train on: the model and optimizer may change, the copy does not ...
//   save.wait();  // optional: rethrows the write's error
//   // A second async save first waits for this one; so does the process's exit.
//
// What each call does, on every rank (collective, same point of the program):
//  1. waits until the previous asynchronous save over the same communicator is written
//     (and raises its error if it failed and nobody waited for it);
//  2. stages: copies this rank's pieces (model, optimizer, scheduler) to the CPU, in
//     pinned memory when the model is on a GPU (the only stall of training);
//  3. takes the communicator of the checkpoint's own (AsyncSaveOptions::communicator,
//     else a new one per save; see Note [A communicator for checkpoint I/O] in
//     async_checkpoint.cc) and returns;
//  4. a background thread writes the staged pieces over that communicator exactly as
//     save_sharded_checkpoint does (checkpoint.h), its bookkeeping collectives on CPU
//     tensors (no device call, no NCCL call), so the same crash safety holds: a
//     process killed (kill -9, Ctrl-C) during the write leaves the previous checkpoint
//     complete and loadable, and at most a hidden partial directory that
//     remove_partial_checkpoints clears.
// Any "stage, then write(staged, dir, communicator)" writer plugs into async_save.
//
// PyTorch: torch.distributed.checkpoint.async_save (staging to CPU, a Future, the
// writes over the process_group it is given, usually a separate Gloo group).
//
// Threading: call the save functions from one thread (the training loop's). Errors:
// c10::Error from staging (on the caller's thread) and from the write (rethrown by
// AsyncSave::wait, or by the next save if nobody waited).
#ifndef FSDP_STATE_ASYNC_CHECKPOINT_H_
#define FSDP_STATE_ASYNC_CHECKPOINT_H_

#include <functional>
#include <memory>
#include <string>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include "fsdp/comm/communicator.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/dcp_checkpoint.h"

namespace fsdp {

// The future of one asynchronous save. Copies share it. Destroying it does not wait (the
// process's next save, wait_for_async_saves or exit does).
class AsyncSave {
 public:
  struct State;
  AsyncSave() = default;  // no save: ready, wait() returns at once
  explicit AsyncSave(std::shared_ptr<State> state) : state_(std::move(state)) {}

  // Blocks until the write is done; rethrows its error (on every call).
  void wait() const;
  // Whether the write is done (successfully or not). Never blocks.
  bool ready() const;

 private:
  std::shared_ptr<State> state_;
};

// A communicator for checkpoint writes over `comm`'s ranks in the same order:
// comm.new_host_subgroup of every rank, a group that moves CPU buffers and makes no device
// call (for Gloo, a second c10d process group over the same store under its own prefix;
// for NCCL, a Gloo group over its store, so that the save thread never calls NCCL),
// outside the family's collective schedule (its collectives run at times that differ from
// rank to rank). Every rank of `comm` calls it at the same point, on the thread that owns
// `comm`. PyTorch: dist.new_group(backend="gloo") for dcp.async_save's process_group.
std::shared_ptr<Communicator> make_checkpoint_communicator(Communicator& comm);

struct AsyncSaveOptions {
  // The communicator the writes' collectives run over: made by
  // make_checkpoint_communicator(model's communicator) once, and used by nothing else
  // while a write runs. Null: each save makes one on the caller's thread (a connection
  // set-up per save, and a rank lost while it is made is reported by the backend's
  // connect error instead of a collective's). PyTorch: dcp.async_save's process_group.
  TORCH_ARG(std::shared_ptr<Communicator>, communicator) = nullptr;
};

// Writes a staged checkpoint over `comm` (a communicator of the checkpoint's own).
using CheckpointWrite = std::function<void(Communicator& comm)>;

// The generic asynchronous save: waits for the previous one (step 1 above), calls
// `stage` on this thread (it copies what the write needs and returns the write), takes
// the checkpoint's communicator (step 3) and runs the write on a background thread.
// Collective over `comm`. Raises c10::Error if options.communicator() is `comm` itself,
// spans other ranks, or moves no CPU buffers. PyTorch: dcp.async_save.
[[nodiscard]] AsyncSave async_save(Communicator& comm,
                                   const std::function<CheckpointWrite()>& stage,
                                   const AsyncSaveOptions& options = {});

// save_sharded_checkpoint (checkpoint.h), asynchronously: stage_sharded_checkpoint on
// this thread, write_sharded_checkpoint in the background. Host memory: one copy of this
// rank's pieces until the write ends. Collective.
[[nodiscard]] AsyncSave async_save_sharded_checkpoint(FullyShardedRoot& model,
                                                      const torch::optim::Optimizer* optimizer,
                                                      const std::string& dir,
                                                      const SchedulerState* scheduler = nullptr,
                                                      const AsyncSaveOptions& options = {});

// save_dcp_checkpoint (dcp_checkpoint.h), asynchronously: stage_dcp_checkpoint on this
// thread (with `scheduler`, if not null, as the extra entry "lr_scheduler":
// scheduler_dcp_extra in checkpoint.h), write_dcp_checkpoint in the background, with the
// same crash safety (a folder with a .metadata is complete). Host memory: one copy of
// this rank's chunks until the write ends. Collective. PyTorch: dcp.async_save of
// {"model", "optim", extras...}.
[[nodiscard]] AsyncSave async_save_dcp_checkpoint(FullyShardedRoot& model,
                                                  const torch::optim::Optimizer* optimizer,
                                                  const std::string& dir,
                                                  const DcpCheckpointOptions& dcp_options = {},
                                                  const SchedulerState* scheduler = nullptr,
                                                  const AsyncSaveOptions& options = {});

// Waits for every asynchronous save of this process in flight, and rethrows the first
// error that no wait() raised. Call it before the communicator goes away (e.g. at the
// end of training); the process's exit also waits (printing an error it cannot raise).
void wait_for_async_saves();

}  // namespace fsdp

#endif  // FSDP_STATE_ASYNC_CHECKPOINT_H_
